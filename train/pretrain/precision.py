"""Mixed precision with fp32 master weights and a bf16 compute replica.

The master model (fp32) is what the optimizer updates and what checkpoints hold. With ``bf16``,
forward and backward run on a bf16 replica of it: after each micro-batch's backward the replica's
gradients are added into fp32 master gradients, and after each optimizer step the updated master
weights (and buffers, e.g. the router biases) are copied back into the replica.

Why not autocast: CPU autocast re-casts every fp32 weight to bf16 in every forward and the grouped
expert GEMMs need their own casts; at the nano shape the casts alone took ~30 % of a step. The
replica pays one cast of the weights and one of the gradients per optimizer step instead.
With ``fp32`` the replica is the master model itself and nothing is copied.

The optimizer step (:meth:`MixedPrecision.step`): with the fused CPU kernels (``ernie5.kernels``)
and a fused AdamW, one pass per parameter applies the clip factor, weight decay and the Adam
update to the fp32 master and writes its bf16 rounding into the replica, reading the replica's
bf16 gradient directly when there is a single micro-batch and process. That moves about 30 bytes
per parameter instead of about 48 (fp32 gradient copy, norm, PyTorch's fused AdamW, replica copy):
the optimizer phase of a nano step is bound by memory bandwidth. The gradient norm does not re-read
the expert weight gradients, which are 97% of the nano parameters: the kernels that computed them
also summed their squares into :attr:`MixedPrecision.grad_squares` (give it to
:func:`ernie5.fast.apply_fast_paths`), and a recorded sum is used only while the gradient is still
that very tensor, unchanged. The moments live in the
optimizer's own state (``exp_avg``, ``exp_avg_sq``, ``step``), so checkpoints and resumes are
those of ``torch.optim.AdamW``. Otherwise the step is :func:`train.pretrain.clip.clip_and_step` followed
by a copy of the master weights into the replica.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from ernie5.fast import GradSquares
from ernie5.kernels import kernels
from train.pretrain.clip import clip_and_step


class MixedPrecision:
    """Master/replica pair; ``compute`` is the module to run forward and backward on."""

    def __init__(self, master: nn.Module, dtype: str) -> None:
        self.master = master
        self.bf16 = dtype == "bf16"
        self.compute = copy.deepcopy(master).to(torch.bfloat16) if self.bf16 else master
        self._m_params = [p for p in master.parameters()]
        self._c_params = [p for p in self.compute.parameters()]
        self._m_bufs = [b for b in master.buffers()]
        self._c_bufs = [b for b in self.compute.buffers()]
        self._cpu = all(p.is_cpu for p in self._m_params)
        """The fused C++ kernels (:mod:`ernie5.kernels`) are CPU kernels: on a GPU the step is
        torch's own (and the extension is never built)."""
        self.grad_squares = GradSquares()
        """Sums of squares of gradients recorded by the kernels that computed them."""
        self._grad_store: list[torch.Tensor | None] = [None] * len(self._m_params)
        """Persistent fp32 gradient buffers, reused every step: allocating ~4 bytes x params of
        fresh memory per step costs more in page faults than the conversion itself."""

    @torch.no_grad()
    def accumulate_grads(self, only_micro_batch: bool = False) -> None:
        """Add the replica's gradients into the master gradients (fp32) and clear them.

        A master gradient that is None (first micro-batch after ``zero_grad(set_to_none=True)``)
        becomes its persistent buffer, overwritten by the replica's gradient. With
        ``only_micro_batch`` (one micro-batch, one process: nothing will be added or all-reduced)
        and the fused step available, the bf16 gradients stay on the replica for :meth:`step`.
        """
        if not self.bf16:
            return
        if only_micro_batch and self._kernels() is not None:
            return
        self.grad_squares.clear()  # the replica's gradients are about to be copied or added elsewhere
        copy_dst, copy_src, add_dst, add_src = [], [], [], []
        for i, (m, c) in enumerate(zip(self._m_params, self._c_params)):
            if c.grad is None:
                continue
            if m.grad is None:
                buf = self._grad_store[i]
                if buf is None:
                    buf = self._grad_store[i] = torch.empty_like(m)
                copy_dst.append(buf)
                copy_src.append(c.grad)
                m.grad = buf
            else:
                add_dst.append(m.grad)
                add_src.append(c.grad)
        if copy_dst:
            torch._foreach_copy_(copy_dst, copy_src)
        if add_dst:
            torch._foreach_add_(add_dst, add_src)
        for c in self._c_params:
            c.grad = None

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, max_norm: float, skip_nonfinite: bool = False) -> float:
        """Clip to global norm ``max_norm`` (if > 0), step the optimizer and refresh the replica's
        weights (its buffers are refreshed by :meth:`sync`). Returns the pre-clip norm (NaN when
        clipping is off). The caller then zeroes the master gradients as usual.

        With ``skip_nonfinite`` the norm is always computed (and returned), and when it is not
        finite nothing is stepped: the gradients are left where they are (for the caller to name the
        first non-finite one), then dropped with :meth:`discard_grads`."""
        if not self._fusable(optimizer):
            self.accumulate_grads()  # gradients left on the replica for a fused step that cannot run
            self.grad_squares.clear()
            norm = clip_and_step(optimizer, self._m_params, max_norm, skip_nonfinite=skip_nonfinite)
            if self.bf16 and not (skip_nonfinite and not math.isfinite(norm)):  # stepped
                torch._foreach_copy_(self._c_params, self._m_params)
            return norm
        pairs = []  # (master, its gradient, replica)
        for m, c in zip(self._m_params, self._c_params):
            g = m.grad if m.grad is not None else c.grad
            if g is not None:
                pairs.append((m, g, c))
        k = self._kernels()
        if max_norm > 0 or skip_nonfinite:
            # A gradient whose producing kernel already summed its squares (the expert weight
            # gradients) is not read again for it.
            total = 0.0
            for _, g, c in pairs:
                known = self.grad_squares.take(c, g) if g is c.grad else None
                total += k.sum_squares(g) if known is None else known
            norm = math.sqrt(total)
        else:
            norm = float("nan")
        self.grad_squares.clear()
        if skip_nonfinite and not math.isfinite(norm):
            return norm
        if max_norm <= 0 and not skip_nonfinite:
            norm = float("nan")
        # clip_grad_norm_'s factor min(1, max_norm / (norm + 1e-6)).
        inv_scale = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0
        groups = {id(p): grp for grp in optimizer.param_groups for p in grp["params"]}
        for m, g, c in pairs:
            grp = groups[id(m)]
            st = optimizer.state[m]
            if not st:  # what torch.optim.AdamW(fused=True) creates on its first step
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(m, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(m, memory_format=torch.preserve_format)
            st["step"] += 1
            b1, b2 = grp["betas"]
            k.adamw_step(
                m, g, st["exp_avg"], st["exp_avg_sq"], c, float(grp["lr"]), b1, b2,
                grp["eps"], grp["weight_decay"], float(st["step"]), inv_scale,
            )  # fmt: skip
            c.grad = None  # parameters without a gradient are left alone, as AdamW does
        return norm

    @torch.no_grad()
    def discard_grads(self) -> None:
        """Drop every gradient, on the master and on the replica (a skipped step)."""
        self.grad_squares.clear()
        for p in (*self._m_params, *self._c_params):
            p.grad = None

    def _kernels(self):
        """The CPU kernels where the master weights are on the CPU and they build, else None."""
        return kernels() if self._cpu else None

    def _fusable(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether :meth:`step` can take the fused path for this optimizer."""
        if not self.bf16 or type(optimizer) is not torch.optim.AdamW or self._kernels() is None:
            return False
        return all(
            g.get("fused") and not g.get("amsgrad") and not g.get("maximize") and not g.get("capturable")
            for g in optimizer.param_groups
        ) and all(
            p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous() for p in self._m_params
        )

    @torch.no_grad()
    def sync(self) -> None:
        """Copy master buffers (e.g. router biases updated after the step) into the replica."""
        if not self.bf16:
            return
        for c, m in zip(self._c_bufs, self._m_bufs):
            c.copy_(m)
