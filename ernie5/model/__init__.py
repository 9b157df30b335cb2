"""The ERNIE 5.0 backbone: the paper's maths, eager PyTorch, no fast paths (see ``ernie5.fast``).

Tensor names carry their shape as a suffix (torchtitan convention):
B batch, T time/tokens (queries), S keys, D d_model, F expert or FFN hidden width, H heads,
K kv-heads, P rotary frequency pairs (or NFSP/NCP positions), V vocab, E experts, A active experts
per token (top-k), N routed tokens (B*T), C per-expert capacity rows, M rows of continuous input
embeddings, Q audio codec levels.
"""

from ernie5.model.config import ModelConfig, MoEConfig, MTPConfig
from ernie5.model.inputs import IGNORE, Inputs, Targets
from ernie5.model.model import Ernie5Model, Losses, ModelOutput

Ernie5Config = ModelConfig

__all__ = [
    "IGNORE",
    "Ernie5Config",
    "Ernie5Model",
    "Inputs",
    "Losses",
    "MTPConfig",
    "ModelConfig",
    "ModelOutput",
    "MoEConfig",
    "Targets",
]
