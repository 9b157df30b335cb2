"""Training: pretraining with elastic sub-model sampling (SFT and RL join later)."""
