"""Training, split by what it trains, on shared parts:

* :mod:`train.common`: the run folder and its resume contract, the AdamW config and parameter-group
  rule, the learning-rate schedule;
* :mod:`train.pretrain`: pretraining and SFT of the elastic MoE backbone (loop, data, prefetching,
  mixed precision, elastic sub-model sampling, several processes, the training-step bench);
* :mod:`train.rl`: unified multimodal RL (loop, replay buffer, objectives, one rollout module per
  output);
* :mod:`train.side`: the side models the backbone reads frozen (audio codec, vision tokenizer,
  refiner).
"""
