"""Training over several processes with PyTorch's own distributed engine: FSDP2 and expert
parallelism applied from outside the model (:func:`train.pretrain.parallel.shard.parallelize`), and sharded
checkpoints that resume at another world size (:mod:`train.pretrain.parallel.checkpoint`)."""
