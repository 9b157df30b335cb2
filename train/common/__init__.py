"""What every trainer shares: the run folder and its resume contract (:mod:`train.common.run_folder`),
the AdamW config and parameter-group rule (:mod:`train.common.optim`) and the learning-rate schedule
(:mod:`train.common.schedule`)."""
