"""Fused CPU kernels, compiled on first use, with eager PyTorch fallbacks.

Eager PyTorch runs a chain like RMSNorm as half a dozen elementwise ops, each streaming the whole
activation through memory; each kernel here does its chain in one pass (fp32 math, bf16 or fp32
storage), with its backward where it has one:

* ``cpu_kernels.cpp``: RMSNorm; the attention prologue (split of the packed q/k/v projection,
  QK-norm, RoPE, heads-first layout); the MoE router (fp32 logits from bf16 without fp32 copies;
  scores, biased top-k, gates, counts); the dispatch into padded levels, the gather of token rows
  into them and the combine back; the gated SwiGLU activation of the batched experts; the
  cross-entropy rows of the output head (log-sum-exp, NLL and the logit gradient in place); the
  mixed-precision AdamW step (``train.pretrain.precision``).
* ``cpu_attention.cpp``: bf16 training attention, forward and backward (AMX / AVX512-BF16).
* ``cpu_expert_gemm.cpp``: the six batched expert GEMMs of a level without their padding (bf16,
  AVX512-BF16), run with the gated activation as one forward and one backward pass over whole
  experts.
* ``cpu_infer_f32.cpp``: fp32 inference experts over exactly the routed rows, and fp32 inference
  attention.
* ``cpu_decode.cpp``: what a decoding step runs for its few token rows: products reading the
  weights in place, the experts of the gather path, attention over the KV cache, and a whole block
  in one call (``decode_layer``, see :mod:`ernie5.fast.decode`).

Nothing here knows the model: :mod:`ernie5.fast` applies these kernels to it, and ``ernie5 bench``
measures what they buy.

The extension is built with ``torch.utils.cpp_extension`` the first time a process needs it
(about a minute on 2 cores, then cached in ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``, under a name keyed by the source, torch, the CPU, the compiler flags
(it is built with ``-march=native``) and the checkout's path). One process builds at a time, and a
build killed half-way does not block the next one (:func:`_one_builder`).
It needs a C++ compiler (ninja comes with the package). Where the build fails, :func:`kernels`
returns ``None`` and every caller runs its eager PyTorch code, which computes the same function
and is the reference the parity tests compare against.

``ERNIE5_KERNELS`` selects: ``auto`` (default: fused when it builds), ``off`` (always eager), ``on``
(fused, and a build failure is an error).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

_SOURCES = [
    Path(__file__).with_name(n)
    for n in (
        "cpu_kernels.cpp",
        "cpu_attention.cpp",
        "cpu_expert_gemm.cpp",
        "cpu_infer_f32.cpp",
        "cpu_decode.cpp",
    )
]
_HEADERS = [Path(__file__).with_name("cpu_common.h")]
FAILED_MARKER = "build_failed.txt"
"""Written into the build folder when a build fails, so later processes fall back at once."""
BUILD_FLOCK = "ernie5-build.flock"
"""The file :func:`_one_builder` flocks."""
TORCH_LOCK = "lock"
"""The lock file ``torch.utils.cpp_extension`` creates in the build folder during a build."""
_STATE: dict[str, object] = {}


# mode() runs with every kernel dispatch (~16 times per decoded token on the fused decoding path,
# ~165 on the module path), and ``os.environ.get`` costs about a microsecond (it encodes the key
# and decodes the value). CPython keeps the encoded environment in ``os.environ._data``, whose
# value object only changes when the variable is set again, so the parsed mode is kept for that
# object and the variable is still read on every call.
_ENV_DATA = getattr(os.environ, "_data", None) if hasattr(os.environ, "encodekey") else None
_ENV_KEY = os.environ.encodekey("ERNIE5_KERNELS") if _ENV_DATA is not None else None
_MODE_MEMO: list = [False, None, None]  # [valid, raw value object, parsed mode]


def mode() -> str:
    """``ERNIE5_KERNELS`` (``auto`` if unset); a ValueError naming the value if it is not auto/on/off."""
    raw = _ENV_DATA.get(_ENV_KEY) if _ENV_DATA is not None else None
    if _MODE_MEMO[0] and raw is _MODE_MEMO[1]:
        return _MODE_MEMO[2]
    value = os.environ.get("ERNIE5_KERNELS", "auto").strip().lower() or "auto"
    if value not in ("auto", "on", "off"):
        raise ValueError(f"ERNIE5_KERNELS={value!r}: expected auto, on or off")
    _MODE_MEMO[:] = [_ENV_DATA is not None, raw, value]
    return value


def _build_name() -> str:
    """Extension name keyed by the source, torch, the CPU (the build uses -march=native) and where
    the sources live: two checkouts on one machine get a build each, instead of rebuilding one
    shared build in turn (ninja sees other source paths and starts over)."""
    cpu = platform.processor() or platform.machine()
    try:
        flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = ""
    import torch

    build = " ".join(_cflags())
    code = b"".join(p.read_bytes() for p in _SOURCES + _HEADERS)
    where = str(Path(__file__).resolve().parent)
    key = hashlib.sha1(code + f"{torch.__version__}|{cpu}|{flags}|{build}|{where}".encode()).hexdigest()[:12]
    return f"ernie5_cpu_kernels_{key}"


def _cflags() -> list[str]:
    """Compiler flags (part of the build name). On x86 the loops use 512-bit vectors where the CPU
    has them: GCC defaults to 256-bit on AVX-512 CPUs, which ran the cross-entropy rows 1.4x slower
    here; the flag is x86-only, and a no-op on CPUs without AVX-512."""
    flags = ["-O3", "-march=native", "-fno-trapping-math", "-fno-math-errno", "-fopenmp"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags.append("-mprefer-vector-width=512")
    return flags


def _prefer_package_ninja() -> None:
    """Put the ``ninja`` installed with the package (the pip wheel) first on ``PATH``, whether or
    not its venv is activated. Ninja 1.12 changed the command hash of its build log, so a system
    ninja 1.11 and the wheel's 1.13 each took the other's build as out of date: a process started
    from an activated venv (the wheel first on ``PATH``) and one started by path (the system
    ninja) rebuilt the whole extension in turn, ~75 s each time. Without the wheel, ``PATH`` decides."""
    try:
        import ninja
    except ImportError:
        return  # whatever ninja PATH has; torch reports a missing one
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != ninja.BIN_DIR:
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path


@contextlib.contextmanager
def _one_builder(build_dir: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the build folder while building or loading.

    ``torch.utils.cpp_extension`` guards a build with a ``lock`` file that a killed build (Ctrl-C,
    ``kill -9`` during the first, slow build) leaves behind, and every later process then waits on
    it forever, silently. A ``flock`` is released by the kernel when its holder dies, so while this
    process holds it no other process is building here, and a ``lock`` file found then is stale:
    it is removed. A second process waits for the first, and says so."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / BUILD_FLOCK, "a+b") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("ernie5: waiting for another process building the fused CPU kernels", file=sys.stderr)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            (build_dir / TORCH_LOCK).unlink(missing_ok=True)  # no live builder holds it: stale
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build() -> ModuleType:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise RuntimeError("no C++ compiler (c++) on PATH")
    _prefer_package_ninja()
    # A CUDA build of torch on a machine without the CUDA runtime logs a warning when this module is
    # imported ("No CUDA runtime is found"); these kernels are CPU-only, so it is noise here.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    from torch.utils import cpp_extension

    name = _build_name()
    build_dir = Path(cpp_extension._get_build_directory(name, False))
    failed = build_dir / FAILED_MARKER
    if failed.exists():  # this source already failed to build here: don't pay for it in every process
        reason = failed.read_text(encoding="utf-8").strip()
        raise RuntimeError(f"an earlier build failed ({reason}); delete {failed} to retry")
    with _one_builder(build_dir):
        if not any(build_dir.glob("*.so")):  # the slow first build, rather than a load from the cache
            print(
                "ernie5: building the fused CPU kernels (once per checkout, about a minute)", file=sys.stderr
            )
        try:
            return cpp_extension.load(
                name=name,
                sources=[str(p) for p in _SOURCES],
                build_directory=str(build_dir),
                extra_cflags=_cflags(),
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as exc:
            with contextlib.suppress(OSError):
                failed.write_text(_why(exc) + "\n", encoding="utf-8")
            raise


def _why(exc: BaseException) -> str:
    """``Type: first line of the message``."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def kernels() -> ModuleType | None:
    """The compiled kernel module, or ``None`` (eager fallback). Builds at most once per process."""
    selected = mode()
    if selected == "off":
        return None
    if "module" not in _STATE:
        try:
            _STATE["module"] = _build()
            _STATE["status"] = "fused"
        except Exception as exc:  # noqa: BLE001 - any build problem means: fall back to eager
            if selected == "on":
                raise RuntimeError(
                    f"ERNIE5_KERNELS=on but the fused CPU kernels did not build: {exc}"
                ) from exc
            _STATE["module"] = None
            _STATE["status"] = f"eager ({_why(exc)})"
            warnings.warn(
                f"fused CPU kernels unavailable, using eager PyTorch: {_STATE['status']}", stacklevel=2
            )
    return _STATE["module"]  # type: ignore[return-value]


def status() -> str:
    """``fused``, ``off`` or ``eager (why)``: what :func:`kernels` gives this process (builds if needed)."""
    if mode() == "off":
        return "off"
    kernels()
    return str(_STATE["status"])


def attention_status() -> str:
    """Which training attention this process runs on CPU: ``fused (amx)``, ``fused (avx512-bf16)``,
    ``pytorch (no avx512-bf16 build)`` or ``pytorch (kernels ...)`` when the kernels are off or eager."""
    overall = status()
    if overall != "fused":
        return f"pytorch (kernels {overall})"
    mod = kernels()
    if not mod.attention_available():
        return "pytorch (no avx512-bf16 build)"
    return "fused (amx)" if mod.attention_amx() else "fused (avx512-bf16)"
