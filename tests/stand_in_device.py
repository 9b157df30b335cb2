"""A stand-in for a CUDA device on a machine without one, for tests of the GPU code paths.

Inside :func:`stand_in_device`, the ``meta`` device plays the GPU: a module moved there, or a tensor
made there (``torch.zeros(..., device="meta")``, ``x.to(model_device)``), is a :class:`StandIn`
tensor, whose ``.device`` is meta and ``.is_cpu`` False (so the code takes its device paths: no fused
CPU kernel, ``.cpu()`` before host work) but which holds a real CPU tensor that every operation runs
on (so ``.item()``, ``.tolist()``, boolean masks and sampling give real values, and results can be
compared with the CPU's). ``.cpu()`` gives back a plain tensor.

An operation that mixes a stand-in tensor with a plain CPU tensor of one or more dimensions (what a
CUDA kernel refuses: "Expected all tensors to be on the same device") is recorded, with the project
line that ran it, in the list the context yields; so is ``.numpy()`` of a stand-in tensor. CPU index
tensors and 0-dim CPU tensors are allowed, as on CUDA.

What it cannot see: CUDA-only kernel limits (alignment, dtypes: the meta kernels check some, see
``tests/fast/test_devices.py``), streams and synchronisation, NCCL, and CUDA's numerics.
Autocast has no meta device: inside the context an autocast request for it runs as the CPU's, and
reports autocast off for it.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, return_and_correct_aliasing
from torch.utils._pytree import tree_leaves, tree_map

_ROOT = str(Path(__file__).resolve().parents[1])
_aten = torch.ops.aten
_CPU = torch.device("cpu")
_MAY_MIX = {
    _aten.copy_.default,
    _aten.index.Tensor,
    _aten.index_put_.default,
    _aten._index_put_impl_.default,
    _aten.index_put.default,
    _aten.lift_fresh.default,
    _aten._local_scalar_dense.default,
}
"""Operations CUDA runs with CPU operands too (copies, indexing with CPU indices)."""
_REPORTS: list[str] | None = None


def _report(what: str) -> None:
    if _REPORTS is None:
        return
    ours = [
        f
        for f in traceback.extract_stack()
        if f.filename.startswith(_ROOT)
        and not any(lib in f.filename for lib in ("site-packages", "dist-packages"))  # any venv's name
        and not f.filename.endswith(__file__)
    ]
    line = f"{what} at {ours[-1].filename[len(_ROOT) + 1 :]}:{ours[-1].lineno}" if ours else what
    if line not in _REPORTS:
        _REPORTS.append(line)


class StandIn(torch.Tensor):
    """A tensor on the stand-in device (``meta``) holding a real CPU tensor (``inner``)."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            inner.shape,
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            device="meta",
            requires_grad=inner.requires_grad,
        )
        r.inner = inner
        return r

    def __repr__(self) -> str:
        return f"StandIn({self.inner!r})"

    # Python indices (lists, scalars) become tensors on ``self``'s device below the dispatcher, where
    # a meta tensor would have no values: make them CPU tensors, which CUDA takes as well.
    def __getitem__(self, index):  # noqa: D105
        return super().__getitem__(_cpu_index(index))

    def __setitem__(self, index, value) -> None:  # noqa: D105
        if not isinstance(value, torch.Tensor):
            value = _PLAIN_TENSOR(value, dtype=self.dtype)
        super().__setitem__(_cpu_index(index), value)

    def tolist(self):  # noqa: D102
        return self.inner.tolist()

    def numpy(self, *args, **kwargs):  # noqa: D102
        _report("Tensor.numpy() of a device tensor")
        return self.inner.numpy(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if any(isinstance(t, torch.Tensor) and not isinstance(t, StandIn) and t.is_meta for t in leaves):
            raise RuntimeError(f"stand-in device: {func} got a meta tensor without values (not a stand-in)")
        if func not in _MAY_MIX and any(
            isinstance(t, torch.Tensor) and not isinstance(t, StandIn) and t.dim() > 0 and t.is_cpu
            for t in leaves
        ):
            _report(f"{func} mixes CPU and device tensors")
        if func.overloadpacket in (_aten.to, _aten._to_copy):
            return _move(func, args, kwargs)
        if func is _aten.copy_.default:
            _plain(args[0]).copy_(_plain(args[1]))
            return args[0]
        plain_args, plain_kwargs = tree_map(_plain, (args, kwargs))
        if plain_kwargs.get("device") is not None and torch.device(plain_kwargs["device"]).type == "meta":
            plain_kwargs = {**plain_kwargs, "device": _CPU}
        out = tree_map(
            lambda t: StandIn(t) if isinstance(t, torch.Tensor) else t, func(*plain_args, **plain_kwargs)
        )
        if torch.is_inference_mode_enabled():
            # a view taken under inference mode of a normal tensor must be a normal tensor
            with torch.inference_mode(False):
                return tree_map(lambda t: StandIn(t.inner) if isinstance(t, StandIn) else t, out)
        return return_and_correct_aliasing(func, args, kwargs, out)


_PLAIN_TENSOR = torch.tensor


def _plain(t):
    """The CPU tensor inside a stand-in tensor; anything else as it is."""
    return t.inner if isinstance(t, StandIn) else t


def _cpu_index(index):
    """``index`` with its lists of ints or bools as CPU tensors."""
    if isinstance(index, tuple):
        return tuple(_cpu_index(i) for i in index)
    if isinstance(index, list) and all(isinstance(i, (int, bool)) for i in index):
        return _PLAIN_TENSOR(index)
    return index


def _move(func, args, kwargs):
    """``.to()`` / ``.cpu()``: to the CPU gives a plain tensor (a copy); else the result stays, or
    becomes, a stand-in tensor."""
    targets: list[torch.device] = []

    def redirect(v):
        if isinstance(v, (torch.device, str)):
            targets.append(torch.device(v))
            return _CPU
        return v

    x = args[0]
    inner = x.inner if isinstance(x, StandIn) else x
    kw = {k: redirect(v) if k == "device" and v is not None else v for k, v in kwargs.items()}
    out = func(inner, *[redirect(v) for v in args[1:]], **kw)
    to_cpu = bool(targets) and targets[0].type == "cpu"
    if to_cpu:
        return out.clone() if out is inner and isinstance(x, StandIn) else out
    if isinstance(x, StandIn) or (targets and targets[0].type == "meta"):
        return StandIn(out)
    return out


class _Factories(TorchDispatchMode):
    """Tensors made or moved onto the meta device become stand-in tensors."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(t, StandIn) for t in tree_leaves((args, kwargs))):
            return func(*args, **kwargs)
        if func.overloadpacket in (_aten.to, _aten._to_copy):
            return _move(func, args, kwargs)
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "meta":
            out = func(*args, **{**kwargs, "device": _CPU})
            return tree_map(lambda t: StandIn(t) if isinstance(t, torch.Tensor) else t, out)
        return func(*args, **kwargs)


def _via_cpu(make):
    """``torch.tensor`` / ``as_tensor`` build below the dispatcher's Python modes: on the CPU, then moved."""

    def build(data, *args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "meta":
            return make(data, *args, **kwargs).to("meta")
        return make(data, *args, device=device, **kwargs)

    return build


class _Autocast(torch.autocast):
    def __init__(self, device_type, *args, **kwargs):
        super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)


@contextlib.contextmanager
def stand_in_device() -> Iterator[list[str]]:
    """Run with ``meta`` as the stand-in GPU; yields the list of device-mixing reports (empty: none)."""
    global _REPORTS
    saved = (torch.tensor, torch.as_tensor, torch.autocast, torch.is_autocast_enabled)
    is_enabled = torch.is_autocast_enabled

    def autocast_enabled(device_type=None):
        if device_type == "meta":
            return False
        return is_enabled() if device_type is None else is_enabled(device_type)

    reports: list[str] = []
    _REPORTS = reports
    # Module.to() on stand-in parameters must swap the tensors (their ``inner`` goes with them), not
    # assign ``param.data``, which would keep the old inner tensor under the new dtype.
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    torch.tensor, torch.as_tensor = _via_cpu(saved[0]), _via_cpu(saved[1])
    torch.autocast, torch.is_autocast_enabled = _Autocast, autocast_enabled
    try:
        with _Factories():
            yield reports
    finally:
        torch.tensor, torch.as_tensor, torch.autocast, torch.is_autocast_enabled = saved
        torch.__future__.set_swap_module_params_on_conversion(swap)
        _REPORTS = None
