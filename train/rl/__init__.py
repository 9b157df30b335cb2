"""Unified multimodal RL (``ernie5 rl``): the loop (:mod:`train.rl.trainer`), its config
(:mod:`train.rl.config`), the replay buffer (:mod:`train.rl.buffer`), the actor losses and masks
(:mod:`train.rl.objectives`), and one rollout module per output, each owning its prompts, engine,
answers and learner batches (:mod:`train.rl.rollout_text`, :mod:`train.rl.rollout_image`,
:mod:`train.rl.rollout_audio`)."""
