"""The ERNIE 5.0 backbone.

Tensor names carry their shape as a suffix (torchtitan convention):
B batch, T time/tokens (queries), S keys, D d_model, F expert or FFN hidden width, H heads,
K kv-heads, P rotary frequency pairs, V vocab, E experts, A active experts per token (top-k),
N routed tokens (B*T), C per-expert capacity rows, M rows of continuous input embeddings.
"""

from ernie5.model.config import ModelConfig, MoEConfig, MTPConfig
from ernie5.model.model import IGNORE, Ernie5Model, ModelOutput

Ernie5Config = ModelConfig

__all__ = ["IGNORE", "Ernie5Config", "Ernie5Model", "MTPConfig", "ModelConfig", "ModelOutput", "MoEConfig"]
