"""Pretraining and supervised fine-tuning of the elastic MoE backbone: the loop (:mod:`train.pretrain.loop`),
its config (:mod:`train.pretrain.config`), the data mixture and its prefetching loader (``data``,
``prefetch``), mixed precision and clipping (``precision``, ``clip``), elastic sub-model sampling
(``elastic``), the frozen media models a run reads (``media``), training over several processes
(:mod:`train.pretrain.parallel`), SFT (``sft``) and the training-step benchmark (``bench``)."""
