"""Attention masks from per-token document ids and block ids.

A query may attend to a key iff both are in the same document and the key's block id is not
greater than the query's: bidirectional inside a block, causal across blocks, nothing across
documents. Text (and audio) tokens are one-token blocks, so text is plain causal attention; one
scale of one video frame is one block (bidirectional inside, causal across scales and frames).

Two equivalent realisations:
  * a dense boolean mask ``(B, 1, Tq, Tk)`` for SDPA (the CPU path), with fast paths for the
    common pure-causal and attend-to-everything cases;
  * a flex_attention ``BlockMask`` built from the same predicate, a FlashMask equivalent: its
    memory is O(T^2 / 128^2) blocks and fully masked tiles are skipped.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §2.2.3 (scale-wise causal mask), §5.3 (FlashMask).
  * FlashMask (arXiv 2410.01359); PyTorch ``torch.nn.attention.flex_attention``.

Deviations:
  1. FlashMask's column-wise start/end encoding is not reproduced; the flex BlockMask expresses the
     same masks from the (document, block) ids directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttnMask:
    """How a layer's attention is masked; built once per forward and shared by all layers."""

    dense_B1TS: torch.Tensor | None = None
    """Boolean mask (True = may attend), or None for the fast paths."""
    is_causal: bool = False
    """Pure causal attention over a single document with no cache offset."""
    block_mask: object | None = None
    """flex_attention BlockMask, when ``attn_impl='flex'``."""
    _additive: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def additive_B1TS(self, dtype: torch.dtype) -> torch.Tensor | None:
        """``dense_B1TS`` as an additive mask (0 where allowed, -inf elsewhere) in ``dtype``, built
        once per mask and dtype and shared by every layer (None for the fast paths)."""
        if self.dense_B1TS is None:
            return None
        if dtype not in self._additive:
            zeros = torch.zeros(self.dense_B1TS.shape, dtype=dtype, device=self.dense_B1TS.device)
            self._additive[dtype] = zeros.masked_fill_(~self.dense_B1TS, float("-inf"))
        return self._additive[dtype]


def allowed(
    doc_q_BT: torch.Tensor, blk_q_BT: torch.Tensor, doc_k_BS: torch.Tensor, blk_k_BS: torch.Tensor
) -> torch.Tensor:
    """The mask predicate as a dense boolean tensor ``(B, Tq, Tk)``."""
    same_doc = doc_q_BT[:, :, None] == doc_k_BS[:, None, :]
    return same_doc & (blk_q_BT[:, :, None] >= blk_k_BS[:, None, :])


SMALL_QUERY_ROWS = 4
"""Up to this many queries per row after a cache, :func:`build_mask` builds the dense mask first
and tests it (five small ops rather than the dozen of the fast-path tests)."""


def _is_single_doc(doc_BT: torch.Tensor) -> bool:
    return bool((doc_BT == doc_BT[:, :1]).all())


def build_mask(
    doc_q_BT: torch.Tensor,
    blk_q_BT: torch.Tensor,
    doc_k_BS: torch.Tensor,
    blk_k_BS: torch.Tensor,
    impl: str = "sdpa",
) -> AttnMask:
    """Build the mask for queries ``(doc_q, blk_q)`` over keys ``(doc_k, blk_k)``.

    Keys are the cached prefix followed by the queries themselves, so ``Tk >= Tq``.
    """
    tq, tk = doc_q_BT.shape[1], doc_k_BS.shape[1]
    if impl == "flex":
        return AttnMask(block_mask=_flex_block_mask(doc_q_BT, blk_q_BT, doc_k_BS, blk_k_BS))
    if tq <= SMALL_QUERY_ROWS and tq < tk:  # a decoding step over a cache: the dense mask is small
        dense_BTS = allowed(doc_q_BT, blk_q_BT, doc_k_BS, blk_k_BS)
        return AttnMask() if bool(dense_BTS.all()) else AttnMask(dense_B1TS=dense_BTS[:, None])
    single = _is_single_doc(doc_k_BS) and bool((doc_q_BT == doc_k_BS[:, :1]).all())
    if single:
        q_before_all_keys = bool((blk_q_BT.min(dim=1).values >= blk_k_BS.max(dim=1).values).all())
        if q_before_all_keys:
            return AttnMask()  # every query sees every key (e.g. one-token decode step)
        if tq == tk and bool((blk_q_BT == blk_k_BS).all() and (blk_q_BT[:, 1:] > blk_q_BT[:, :-1]).all()):
            return AttnMask(is_causal=True)
    return AttnMask(dense_B1TS=allowed(doc_q_BT, blk_q_BT, doc_k_BS, blk_k_BS)[:, None])


def _flex_block_mask(doc_q_BT, blk_q_BT, doc_k_BS, blk_k_BS):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q, kv):
        return (doc_q_BT[b, q] == doc_k_BS[b, kv]) & (blk_q_BT[b, q] >= blk_k_BS[b, kv])

    b, tq = doc_q_BT.shape
    tk = doc_k_BS.shape[1]
    return create_block_mask(mask_mod, b, None, tq, tk, device=doc_q_BT.device)
