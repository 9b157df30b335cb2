"""Static key/value cache for incremental decoding.

One preallocated buffer per layer, plus the document and block ids of every cached position so
that masks over the cache follow the same (document, block) rule as the full forward. ``length``
is shared by all layers; :meth:`truncate` rolls back positions (speculative decoding rejects
drafted tokens that way); :meth:`select` copies rows out, so that one prefix computed once can be
continued in several rows (the harness scores every choice of a question after one shared context).
"""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer K/V buffers of shape ``(B, K, max_len, Dh)``."""

    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.doc_BS = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.blk_BS = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.max_len = max_len
        self.length = 0
        self._pending = 0

    def begin(self, doc_BT: torch.Tensor, blk_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Register the ids of ``T`` new positions; returns the ids of all keys (cache + new)."""
        t = doc_BT.shape[1]
        if self.length + t > self.max_len:
            raise ValueError(f"KV cache overflow: {self.length} + {t} > max_len={self.max_len}")
        end = self.length + t
        self.doc_BS[:, self.length : end] = doc_BT
        self.blk_BS[:, self.length : end] = blk_BT
        self._pending = t
        return self.doc_BS[:, :end], self.blk_BS[:, :end]

    def update(
        self, layer: int, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys/values of ``layer``; returns all keys/values up to the new end."""
        end = self.length + k_BKTD.shape[2]
        self.k[layer][:, :, self.length : end] = k_BKTD
        self.v[layer][:, :, self.length : end] = v_BKTD
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def commit(self) -> None:
        """Advance ``length`` past the positions registered by :meth:`begin`."""
        self.length += self._pending
        self._pending = 0

    def truncate(self, length: int) -> None:
        """Forget every position at or after ``length``."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def select(self, rows_R: torch.Tensor) -> KVCache:
        """A new cache whose row ``r`` is a copy of this cache's row ``rows_R[r]`` (rows may repeat),
        with the same committed length and the same room."""
        if self._pending:
            raise ValueError("cannot select rows of a cache with uncommitted positions")
        rows_R = rows_R.to(self.doc_BS.device)
        out = KVCache.__new__(KVCache)
        out.k = [k.index_select(0, rows_R) for k in self.k]
        out.v = [v.index_select(0, rows_R) for v in self.v]
        out.doc_BS = self.doc_BS.index_select(0, rows_R)
        out.blk_BS = self.blk_BS.index_select(0, rows_R)
        out.max_len, out.length, out._pending = self.max_len, self.length, 0
        return out
