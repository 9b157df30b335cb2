"""What is written to disk: checkpoints (the model, its tokenizers and side models, exact-resume
state) and the run-folder files every job writes (provenance, atomic writes, JSON lines)."""
