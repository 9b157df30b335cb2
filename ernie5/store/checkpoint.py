"""Checkpoints: directories of safetensors, YAML and JSON, written atomically, read without pickle.

Layout of a checkpoint directory::

    model.safetensors          model state_dict (persistent buffers included, tied weights once)
    config.yaml                the ModelConfig, as ``ernie5.config.dump`` writes it
    tokenizer.json             optional, the TextTokenizer
    optimizer.safetensors      optional (exact resume): per-parameter optimizer state tensors
    train_tensors.safetensors  optional (exact resume): e.g. RNG states as uint8 tensors
    train_state.json           optional (exact resume): JSON train state + optimizer structure
    meta.json                  caller's metadata + ``format`` + ``files`` (sha256 and size of
                               every other file); written last, its presence means complete
    train_state.dcp/           a parallel run's checkpoint instead of model.safetensors: every
                               process's shards of the model and AdamW state, written with
                               ``torch.distributed.checkpoint`` (``train.pretrain.parallel.checkpoint``);
                               loaded here into one process (the weights only), or consolidated
                               into model.safetensors by ``ernie5 export``

Run folders keep their checkpoints under ``checkpoints/step_XXXXXXXX/``.

Saving writes everything into a hidden sibling ``.<name>.tmp-<pid>`` directory, fsyncs it and
renames it into place, so a crash never leaves a directory that looks complete but is partial.
Loading never unpickles (no ``torch.load``): tensors come from safetensors, the rest from YAML and
JSON, and every file is checked against the manifest in ``meta.json`` before use.

Over 500 lines for one reason: the folder format is one contract (write, verify, read, resolve), and
the media parts it carries (vision tokenizer, audio codec, refiner) are read through its private
manifest and tensor helpers; a separate module would import them back (an import cycle).

References:
  * safetensors format (https://github.com/huggingface/safetensors): no code execution on load.
  * Hugging Face ``save_pretrained`` layout (``model.safetensors`` + config + tokenizer files).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from ernie5.config import ConfigError, dump, from_dict, read_yaml
from ernie5.fast import apply_fast_paths
from ernie5.files import file_sha256, fsync_path, publish_folder, write_failure
from ernie5.model.config import ModelConfig
from ernie5.model.model import Ernie5Model
from ernie5.model.rope import inv_frequencies
from ernie5.tokenizers.text import TextTokenizer, TokenizerError

FORMAT = 1
"""Version of the checkpoint layout, stored in ``meta.json``."""
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.json"
META_FILE = "meta.json"
OPTIMIZER_FILE = "optimizer.safetensors"
TRAIN_TENSORS_FILE = "train_tensors.safetensors"
TRAIN_STATE_FILE = "train_state.json"
TRAIN_FILES = (OPTIMIZER_FILE, TRAIN_TENSORS_FILE, TRAIN_STATE_FILE)
VISION_TOKENIZER_FILES = ("vision_tokenizer.safetensors", "vision_tokenizer.yaml")
REFINER_FILES = ("refiner.safetensors", "refiner.yaml")
AUDIO_CODEC_FILES = ("audio_codec.safetensors", "audio_codec.yaml")
SPEECH_ENCODER_FILES = ("speech_encoder.safetensors", "speech_encoder.yaml")
"""The speech-content encoder attached to the codec (models with ``audio.content_dim > 0``)."""
SHARDS_DIR = "train_state.dcp"
"""The sharded state of a parallel run's checkpoint (in place of ``model.safetensors``)."""
RESERVED_FILES = (
    MODEL_FILE,
    CONFIG_FILE,
    TOKENIZER_FILE,
    META_FILE,
    *TRAIN_FILES,
    *VISION_TOKENIZER_FILES,
    *REFINER_FILES,
    *AUDIO_CODEC_FILES,
    *SPEECH_ENCODER_FILES,
)
_STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or inconsistent. One line, naming the path."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A loaded checkpoint."""

    path: Path
    """The checkpoint directory."""
    model: Ernie5Model
    cfg: ModelConfig
    tokenizer: TextTokenizer | None
    meta: dict[str, Any]
    """Everything in ``meta.json``: the caller's metadata plus ``format`` and ``files``."""
    vision_tokenizer: Any = None
    """The frozen vision tokenizer the model was trained with (``VisionTokenizer``), if any."""
    refiner: Any = None
    """The separately trained cascaded refiner (``ernie5.tokenizers.refiner.Refiner``), if any."""
    audio_codec: Any = None
    """The frozen audio codec the model was trained with (``AudioCodec``), if any."""


# ---------------------------------------------------------------------- files
def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_tensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, path, metadata=metadata)
    fsync_path(path)


def _write_part(folder: Path, files: tuple[str, str], module: Any) -> None:
    """A frozen side part (vision tokenizer, refiner, codec, speech encoder): its weights and config as
    ``files`` = ``(weights, config)`` in ``folder``."""
    _write_tensors(
        folder / files[0], {k: v.contiguous() for k, v in module.state_dict().items()}, metadata={}
    )
    _write_bytes(folder / files[1], dump(module.cfg).encode())


def _load_part(
    path: Path, files: tuple[str, str], build: Any, cfg_type: type, device, fits: Any = None
) -> Any:
    """The side part stored as ``files`` in ``path``: its config read strictly (and checked by
    ``fits(cfg, where)`` when given), ``build(cfg)`` loaded with its weights, frozen on ``device``; every
    problem a one-line :class:`CheckpointError` naming the file."""
    weights_file, config_file = (path / name for name in files)
    try:
        part_cfg = from_dict(cfg_type, read_yaml(config_file))
    except ConfigError as e:
        raise CheckpointError(f"{config_file}: {e}") from None
    if fits is not None:
        fits(part_cfg, str(config_file))
    module = build(part_cfg)
    try:
        module.load_state_dict(_read_tensors(weights_file))
    except RuntimeError as e:
        raise CheckpointError(f"{weights_file}: {str(e).splitlines()[0]}") from None
    return module.to(device).eval().requires_grad_(False)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{path.parent}: missing {path.name}")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors file ({str(e).splitlines()[0]})") from None


@contextmanager
def _open_tensors(path: Path, device: str) -> Iterator[Any]:
    try:
        handle = safe_open(path, framework="pt", device=device)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors file ({str(e).splitlines()[0]})") from None
    with handle as f:
        yield f


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: malformed JSON ({str(e).splitlines()[0]})") from None


def _read_meta(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory not found")
    if not (path / META_FILE).is_file():
        raise CheckpointError(f"{path}: missing {META_FILE} (incomplete or not a checkpoint)")
    meta = _read_json(path / META_FILE)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"{path / META_FILE}: unsupported format {got!r} (expected {FORMAT})")
    files = meta.get("files")
    if not isinstance(files, dict) or not all(
        _plain_relative(k)
        and isinstance(v, dict)
        and isinstance(v.get("sha256"), str)
        and isinstance(v.get("bytes"), int)
        for k, v in files.items()
    ):
        raise CheckpointError(f"{path / META_FILE}: 'files' must map file names to {{sha256, bytes}}")
    return meta


def _plain_relative(name: Any) -> bool:
    """A manifest entry: a file name, or a relative path inside a stored folder (no ``..``)."""
    if not isinstance(name, str) or not name or name.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def _check_files(path: Path, files: dict[str, dict[str, Any]], verify: bool) -> None:
    sharded = any(name.startswith(f"{SHARDS_DIR}/") for name in files) and MODEL_FILE not in files
    for name in (*(() if sharded else (MODEL_FILE,)), CONFIG_FILE, *files):
        if not (path / name).is_file():
            raise CheckpointError(f"{path}: missing {name}")
        if name not in files:
            raise CheckpointError(f"{path / META_FILE}: {name} is not in the file manifest")
    if not verify:
        return
    for name, want in files.items():
        size = (path / name).stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(
                f"{path / name}: {size} bytes, but {META_FILE} says {want['bytes']} (truncated or replaced)"
            )
        if file_sha256(path / name) != want["sha256"]:
            raise CheckpointError(f"{path / name}: sha256 differs from {META_FILE} (corrupted or replaced)")


# ---------------------------------------------------------------------- model tensors
def _aliases(model: nn.Module) -> dict[str, str]:
    """Map each extra name of a tensor registered under several names to its first name."""
    first: dict[int, str] = {}
    alias = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, t in named:
        if id(t) in first:
            alias[name] = first[id(t)]
        else:
            first[id(t)] = name
    return alias


def _set_tensor(model: nn.Module, names: list[str], value: torch.Tensor) -> None:
    """Put ``value`` under every name (aliases share one new Parameter, so ties survive)."""
    mod_name, _, attr = names[0].rpartition(".")
    old = model.get_submodule(mod_name)._parameters.get(attr)
    if old is not None:
        value = nn.Parameter(value, requires_grad=old.requires_grad)
    for name in names:
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        (mod._parameters if old is not None else mod._buffers)[attr] = value


def _shape(shape: Any) -> str:
    return f"[{', '.join(str(s) for s in shape)}]"


def _load_model(file: Path, cfg: ModelConfig, device: str, dtype: torch.dtype | None) -> Ernie5Model:
    """Build the model on the meta device (no init) and fill it from ``file``."""
    with torch.device("meta"):
        model = Ernie5Model(cfg)
    alias = _aliases(model)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in alias}
    params = {k for k, _ in model.named_parameters(remove_duplicate=False)}
    with _open_tensors(file, device) as f:
        found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        for key, shape in expected.items():
            if key not in found:
                raise CheckpointError(
                    f"{file}: missing tensor {key} (shape {_shape(shape)} in config.yaml's model)"
                )
            if found[key] != shape:
                raise CheckpointError(
                    f"{file}: {key} has shape {_shape(found[key])}, config.yaml's model {_shape(shape)}"
                )
        if extra := sorted(found.keys() - expected.keys()):
            key = extra[0]
            raise CheckpointError(
                f"{file}: unexpected tensor {key} (shape {_shape(found[key])}) not in config.yaml's model"
            )
        for key in expected:
            t = f.get_tensor(key)
            if dtype is not None and key in params and t.is_floating_point():
                t = t.to(dtype)
            _set_tensor(model, [key, *(a for a, k in alias.items() if k == key)], t)
    # Non-persistent buffers are not in the file; recompute them (the only one is RoPE's table).
    if model.inv_freq.is_meta:
        _set_tensor(model, ["inv_freq"], inv_frequencies(cfg.dim_head, cfg.rope_theta, torch.device(device)))
    unknown = [n for n, b in model.named_buffers() if b.is_meta]
    if unknown:  # a transient buffer added to the model since: pay for one real init to compute it
        ref = dict(Ernie5Model(cfg).named_buffers())
        for name in unknown:
            _set_tensor(model, [name], ref[name].to(device))
    return model


@contextmanager
def quiet_dcp() -> Iterator[None]:
    """``torch.distributed.checkpoint`` warns that it assumes one process whenever no process group is
    up; reading or writing shards in one process is the intent."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _load_sharded_model(folder: Path, cfg: ModelConfig, device: torch.device, dtype) -> Ernie5Model:
    """A parallel run's weights from its shards, into one process: DCP reads whatever slices this
    process's plain tensors cover (all of them), under the one-process names the run saved them with
    (``model.<name>``, ``train.pretrain.parallel.checkpoint``)."""
    import torch.distributed.checkpoint as dcp

    with torch.device("meta"):
        model = Ernie5Model(cfg)
    model.to_empty(device=device)
    model.reset_buffers()  # the RoPE table; the router biases are read below
    state = {"model": model.state_dict()}
    try:
        with quiet_dcp():
            dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    except Exception as e:  # noqa: BLE001 - any reader failure is this checkpoint's fault
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        raise CheckpointError(f"{folder}: cannot read the model's shards ({why})") from None
    if dtype is not None:
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dtype)
    return model


# ---------------------------------------------------------------------- train state
def _encode(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors[key] = value
        return {"__tensor__": key}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{key}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{key}.{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): _encode(v, f"{key}.{k}", tensors) for k, v in value.items()}
    return value


def _decode(value: Any, tensors: dict[str, torch.Tensor], path: Path) -> Any:
    if isinstance(value, dict) and "__tensor__" in value:
        if value["__tensor__"] not in tensors:
            raise CheckpointError(f"{path.parent / OPTIMIZER_FILE}: missing tensor {value['__tensor__']}")
        return tensors[value["__tensor__"]]
    if isinstance(value, dict) and "__tuple__" in value:
        return tuple(_decode(v, tensors, path) for v in value["__tuple__"])
    if isinstance(value, list):
        return [_decode(v, tensors, path) for v in value]
    if isinstance(value, dict):
        return {k: _decode(v, tensors, path) for k, v in value.items()}
    return value


def save_train_state(
    dir: Path, *, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], state: dict[str, Any]
) -> None:
    """Write the exact-resume files into ``dir`` (use ``save_checkpoint(train_state=...)`` instead).

    Files written, fsynced, but not added to any manifest:
      * ``optimizer.safetensors``: every tensor of ``optimizer.state_dict()``, keyed
        ``state.{param_idx}.{name}`` (and ``param_groups.{i}.{name}`` for tensor hyper-parameters),
        with dtypes kept (Adam's scalar ``step`` tensors included);
      * ``train_tensors.safetensors``: ``tensors`` (e.g. RNG states as uint8 tensors);
      * ``train_state.json``: ``state`` plus the optimizer's non-tensor state and param groups.

    Raises:
        ValueError: ``state`` or the optimizer hyper-parameters are not JSON-serialisable.
    """
    dir = Path(dir)
    sd = optimizer.state_dict()
    opt_tensors: dict[str, torch.Tensor] = {}
    structure = {
        "state": {str(i): _encode(s, f"state.{i}", opt_tensors) for i, s in sd["state"].items()},
        "param_groups": [
            _encode(g, f"param_groups.{i}", opt_tensors) for i, g in enumerate(sd["param_groups"])
        ],
    }
    try:
        text = json.dumps({"state": state, "optimizer": structure}, indent=2, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"train state is not JSON-serialisable: {e}") from None
    _write_tensors(dir / OPTIMIZER_FILE, opt_tensors)
    _write_tensors(dir / TRAIN_TENSORS_FILE, tensors)
    _write_bytes(dir / TRAIN_STATE_FILE, text.encode())


def load_train_state(
    dir: Path, *, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Restore ``optimizer`` from ``dir`` and return ``(tensors, state)`` given to the save.

    The optimizer must be built over the same parameters, in the same groups, as the saved one; its
    next ``step()`` is then bit-identical to the saved optimizer's. Files are not re-hashed here:
    ``load_checkpoint(verify=True)`` has checked them.

    Raises:
        CheckpointError: a file is missing or unreadable, or the state does not fit ``optimizer``.
    """
    dir = Path(dir)
    if not (dir / TRAIN_STATE_FILE).is_file():
        raise CheckpointError(f"{dir}: missing {TRAIN_STATE_FILE} (no train state saved)")
    data = _read_json(dir / TRAIN_STATE_FILE)
    opt_tensors = _read_tensors(dir / OPTIMIZER_FILE)
    tensors = _read_tensors(dir / TRAIN_TENSORS_FILE)
    try:
        structure = data["optimizer"]
        sd = {
            "state": {int(i): _decode(s, opt_tensors, dir) for i, s in structure["state"].items()},
            "param_groups": _decode(structure["param_groups"], opt_tensors, dir),
        }
        optimizer.load_state_dict(sd)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        msg = str(e).splitlines()[0] if str(e) else repr(e)
        raise CheckpointError(f"{dir / TRAIN_STATE_FILE}: optimizer state does not fit ({msg})") from None
    return tensors, data.get("state", {})


# ---------------------------------------------------------------------- public entry points
def save_checkpoint(
    path: str | Path,
    model: Ernie5Model,
    *,
    tokenizer: TextTokenizer | None = None,
    meta: dict[str, Any] | None = None,
    extra_files: dict[str, bytes] | None = None,
    train_state: tuple[torch.optim.Optimizer, dict[str, torch.Tensor], dict[str, Any]] | None = None,
    vision_tokenizer: Any = None,
    refiner: Any = None,
    audio_codec: Any = None,
    extra_dirs: dict[str, Path] | None = None,
    weights: bool = True,
) -> Path:
    """Write a checkpoint directory atomically (replacing ``path`` if it exists).

    Args:
        path: the checkpoint directory, e.g. ``run/checkpoints/step_00001000``.
        model: the (unwrapped) model; its ``cfg`` goes to ``config.yaml``.
        tokenizer: saved as ``tokenizer.json`` when given.
        meta: JSON-serialisable metadata (git hash, step, ...); ``format`` and ``files`` are
            recomputed, so passing a loaded checkpoint's ``meta`` back is fine.
        extra_files: more files (plain names, not the reserved ones) covered by the manifest.
        train_state: ``(optimizer, tensors, state)`` for exact resume (see :func:`save_train_state`).
        vision_tokenizer: the frozen ``VisionTokenizer`` of a vision model, stored as
            ``vision_tokenizer.safetensors`` + ``vision_tokenizer.yaml`` (covered by the manifest).
        refiner: the cascaded ``Refiner`` shipped with a vision model, stored as
            ``refiner.safetensors`` + ``refiner.yaml``.
        audio_codec: the frozen ``AudioCodec`` of an audio model, stored as
            ``audio_codec.safetensors`` + ``audio_codec.yaml``.
        extra_dirs: ``{name: folder}``: folders MOVED into the checkpoint as ``name`` (e.g. a
            parallel run's sharded train state, ``train.pretrain.parallel.checkpoint``), their files
            covered by the manifest as ``name/<relative path>``.
        weights: write ``model.safetensors``; False for a parallel run's checkpoint, whose weights
            are its shards (``extra_dirs`` must then hold :data:`SHARDS_DIR`; ``model`` gives the
            config only and may be on the meta device).

    Returns:
        ``path``.

    Raises:
        ValueError: bad ``meta``, ``extra_files`` or train state, or a tokenizer larger than
            the model's vocabulary.
    """
    path = Path(path)
    model = getattr(model, "_orig_mod", model)  # torch.compile wrapper
    meta = {k: v for k, v in (meta or {}).items() if k not in ("format", "files")}
    try:
        json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta is not JSON-serialisable: {e}") from None
    if not weights and SHARDS_DIR not in (extra_dirs or {}):
        raise ValueError(f"weights=False needs the shards: extra_dirs must hold {SHARDS_DIR!r}")
    extra_files = extra_files or {}
    for name in extra_files:
        if name in RESERVED_FILES or not name or name.startswith(".") or Path(name).name != name:
            raise ValueError(
                f"extra file name {name!r} must be a plain file name, not one of {RESERVED_FILES}"
            )
    if tokenizer is not None and tokenizer.vocab_size > model.cfg.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} tokens > model vocab_size={model.cfg.vocab_size}"
        )

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if weights:
            alias = _aliases(model)
            tensors = {k: v for k, v in model.state_dict().items() if k not in alias}
            _write_tensors(tmp / MODEL_FILE, tensors, metadata={"format": "pt"})
        _write_bytes(tmp / CONFIG_FILE, dump(model.cfg).encode())
        if tokenizer is not None:
            _write_bytes(tmp / TOKENIZER_FILE, tokenizer.to_str().encode())
        if train_state is not None:
            optimizer, tensors, state = train_state
            save_train_state(tmp, optimizer=optimizer, tensors=tensors, state=state)
        for name, data in extra_files.items():
            _write_bytes(tmp / name, data)
        parts = {
            VISION_TOKENIZER_FILES: vision_tokenizer,
            REFINER_FILES: refiner,
            AUDIO_CODEC_FILES: audio_codec,
            SPEECH_ENCODER_FILES: getattr(audio_codec, "content_encoder", None),
        }
        for files_, part in parts.items():
            if part is not None:
                _write_part(tmp, files_, part)
        for name, folder in (extra_dirs or {}).items():
            if name in RESERVED_FILES or not name or name.startswith(".") or Path(name).name != name:
                raise ValueError(
                    f"extra folder name {name!r} must be a plain name, not one of {RESERVED_FILES}"
                )
            shutil.move(str(folder), str(tmp / name))
        files = {
            p.relative_to(tmp).as_posix(): {"sha256": file_sha256(p), "bytes": p.stat().st_size}
            for p in sorted(tmp.rglob("*"))
            if p.is_file()
        }
        # meta.json last: its presence (with the manifest) is what makes a checkpoint complete.
        text = json.dumps({**meta, "format": FORMAT, "files": files}, indent=2, sort_keys=True)
        _write_bytes(tmp / META_FILE, text.encode())
        fsync_path(tmp)
        publish_folder(tmp, path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing partial left behind, and the space back
        failed = write_failure(e, path, "the checkpoint")
        if failed is not None:
            raise failed from None
        raise
    return path


def load_checkpoint(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    verify: bool = True,
    fast: bool = True,
    weights: bool = True,
) -> Checkpoint:
    """Load a checkpoint directory written by :func:`save_checkpoint`, without unpickling.

    Args:
        path: anything :func:`resolve_checkpoint` accepts: a checkpoint folder, a run folder (its
            newest complete checkpoint) or a shipped checkpoint's name (``reference``).
        device: where the model's tensors are placed.
        dtype: cast floating-point parameters to this dtype (buffers such as the router bias keep
            their saved dtype); None keeps the saved dtypes, unless ``meta.json`` names a
            ``load_dtype`` (a shipped checkpoint stores bf16 weights and computes in float32).
        verify: check every file's size and sha256 against ``meta.json`` first.
        fast: apply :func:`ernie5.fast.apply_fast_paths` to the model (False: the eager maths,
            e.g. for a trainer that applies them to its own compute copy).
        weights: False gives the model on the meta device, nothing read into it (a parallel
            trainer resuming loads its own shards); a parallel run's checkpoint (no
            ``model.safetensors``) is otherwise read from its shards into this one process.

    Raises:
        CheckpointError: missing directory or file, a file that fails verification or parsing, an
            invalid ``config.yaml``, or weights that do not fit the model ``config.yaml`` describes.
    """
    path = _checkpoint_folder(path)
    meta = _read_meta(path)
    _check_files(path, meta["files"], verify)
    if dtype is None and meta.get("load_dtype") in ("float32", "bfloat16"):
        dtype = getattr(torch, meta["load_dtype"])
    try:
        cfg = from_dict(ModelConfig, read_yaml(path / CONFIG_FILE))
    except ConfigError as e:
        msg = str(e)
        raise CheckpointError(msg if str(path) in msg else f"{path / CONFIG_FILE}: {msg}") from None
    tokenizer = None
    if (path / TOKENIZER_FILE).is_file():
        try:
            tokenizer = TextTokenizer.load(path / TOKENIZER_FILE)
        except TokenizerError as e:
            raise CheckpointError(str(e)) from None
        if tokenizer.vocab_size > cfg.vocab_size:
            raise CheckpointError(
                f"{path / TOKENIZER_FILE}: {tokenizer.vocab_size} tokens > vocab_size={cfg.vocab_size}"
            )
    if not weights:
        with torch.device("meta"):
            model = Ernie5Model(cfg)
    elif (path / MODEL_FILE).is_file():
        model = _load_model(path / MODEL_FILE, cfg, str(torch.device(device)), dtype)
    else:
        model = _load_sharded_model(path / SHARDS_DIR, cfg, torch.device(device), dtype)
    if fast:
        apply_fast_paths(model)
    vision_tok = (
        _load_vision_tokenizer(path, cfg, device) if (path / VISION_TOKENIZER_FILES[0]).is_file() else None
    )
    refiner = _load_refiner(path, device) if (path / REFINER_FILES[0]).is_file() else None
    codec = _load_audio_codec(path, cfg, device) if (path / AUDIO_CODEC_FILES[0]).is_file() else None
    return Checkpoint(
        path=path,
        model=model,
        cfg=cfg,
        tokenizer=tokenizer,
        meta=meta,
        vision_tokenizer=vision_tok,
        refiner=refiner,
        audio_codec=codec,
    )


def _load_audio_codec(path: Path, cfg: ModelConfig, device, check_content: bool = True) -> Any:
    """The stored audio codec (with its speech-content encoder attached when the checkpoint has one),
    checked against the model's audio config (``check_content``: its content width too)."""
    from ernie5.tokenizers.audio_codec import AudioCodec
    from ernie5.tokenizers.audio_config import AudioCodecConfig

    def fits(ccfg, where: str) -> None:
        check_codec_fits(ccfg, cfg, where, CheckpointError)

    codec = _load_part(path, AUDIO_CODEC_FILES, AudioCodec, AudioCodecConfig, device, fits)
    if (path / SPEECH_ENCODER_FILES[0]).is_file():
        from ernie5.tokenizers.speech_content import SpeechContentConfig, SpeechContentEncoder

        encoder = _load_part(path, SPEECH_ENCODER_FILES, SpeechContentEncoder, SpeechContentConfig, device)
        codec.attach_content_encoder(encoder)
    if check_content:
        check_content_fits(codec.content_encoder, cfg, str(path), CheckpointError)
    return codec


def check_content_fits(encoder: Any, cfg: ModelConfig, where: str, error: type[Exception]) -> None:
    """A model that reads content features (``audio.content_dim > 0``) needs an encoder of that width."""
    want = cfg.audio.content_dim if cfg.audio.enabled else 0
    if want and encoder is None:
        raise error(
            f"{where}: the model reads speech-content features (audio.content_dim={want}) "
            "and no speech-content encoder came with its codec"
        )
    if want and encoder.cfg.width != want:
        raise error(f"{where}: speech-content encoder width {encoder.cfg.width} != audio.content_dim={want}")


def check_codec_fits(codec_cfg: Any, cfg: ModelConfig, where: str, error: type[Exception]) -> None:
    """Raise ``error`` unless the codec's (levels, codebook size) are the model's audio config's."""
    a = cfg.audio
    got, want = (codec_cfg.n_levels, codec_cfg.codebook_size), (a.n_levels, a.codebook_size)
    if got != want:
        raise error(f"{where}: codec (n_levels, codebook_size)={got} does not fit model.audio {want}")


def check_vision_fits(tokenizer_cfg: Any, cfg: ModelConfig, where: str, error: type[Exception]) -> None:
    """Raise ``error`` unless the vision tokenizer's (image, latent, bits, scales, channels) are the
    model's vision config's."""
    v, t = cfg.vision, tokenizer_cfg
    want = (v.image_size, v.latent_size, v.latent_bits, tuple(v.scales), v.cnn_channels)
    got = (t.image_size, t.latent_size, t.latent_bits, tuple(t.scales), t.feature_channels)
    if got != want:
        raise error(
            f"{where}: tokenizer (image, latent, bits, scales, channels)={got} does not fit "
            f"model.vision {want}"
        )


def _load_refiner(path: Path, device) -> Any:
    """The stored cascaded refiner."""
    from ernie5.tokenizers.refiner import Refiner, RefinerConfig

    return _load_part(path, REFINER_FILES, Refiner, RefinerConfig, device)


def _load_vision_tokenizer(path: Path, cfg: ModelConfig, device) -> Any:
    """The stored vision tokenizer, checked against the model's vision config."""
    from ernie5.tokenizers.vision import VisionTokenizer
    from ernie5.tokenizers.vision_config import VisionTokenizerConfig

    def fits(tcfg, where: str) -> None:
        check_vision_fits(tcfg, cfg, where, CheckpointError)

    return _load_part(path, VISION_TOKENIZER_FILES, VisionTokenizer, VisionTokenizerConfig, device, fits)


def _media_files(part: str) -> tuple[str, str]:
    files = {"vision_tokenizer": VISION_TOKENIZER_FILES, "audio_codec": AUDIO_CODEC_FILES}
    if part not in files:
        raise ValueError(f"unknown media part {part!r} (expected one of {sorted(files)})")
    return files[part]


def names_media_checkpoint(value: str | Path, part: str) -> bool:
    """Whether ``value`` names a checkpoint that carries the media ``part`` (a shipped name such as
    ``reference``, or a checkpoint folder with the part's files), as opposed to the folder the part's
    own trainer wrote."""
    from ernie5.store import shipped

    folder = Path(value)
    return shipped.is_shipped_name(value) or (
        (folder / META_FILE).is_file() and (folder / _media_files(part)[0]).is_file()
    )


def load_media_part(path: str | Path, part: str, cfg: ModelConfig, device: str = "cpu") -> Any:
    """One frozen media part (``"vision_tokenizer"`` or ``"audio_codec"``) of the checkpoint ``path``
    names (a shipped name such as ``reference``, a checkpoint folder, or a run folder), checked against
    ``cfg``: how a training run reuses the tokenizer and codec a checkpoint carries
    (``data.vision_tokenizer: reference``).

    Raises:
        CheckpointError: no such checkpoint, the checkpoint has no such part, or it does not fit ``cfg``.
    """
    files = _media_files(part)
    folder = resolve_checkpoint(path)
    if not all((folder / name).is_file() for name in files):
        raise CheckpointError(f"{folder}: the checkpoint carries no {part.replace('_', ' ')}")
    if part == "vision_tokenizer":
        return _load_vision_tokenizer(folder, cfg, device)
    return _load_audio_codec(folder, cfg, device, check_content=False)  # the run may attach its own


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    """Where a run keeps the checkpoint of ``step``: ``run_dir/checkpoints/step_XXXXXXXX``."""
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """A run's complete checkpoints (``checkpoints/step_XXXXXXXX`` with a ``meta.json``), oldest first;
    hidden temp directories and interrupted writes are not among them."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    steps = [
        (int(m.group(1)), d)
        for d in root.iterdir()
        if (m := _STEP_DIR.fullmatch(d.name)) and (d / META_FILE).is_file()
    ]
    return [d for _, d in sorted(steps)]


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint ``path`` names: a shipped checkpoint's name (``reference``, see
    ``ernie5.store.shipped``), a checkpoint folder, or a run folder's newest complete checkpoint.

    Hidden temp directories and step directories without ``meta.json`` are ignored.

    Raises:
        CheckpointError: ``path`` is none of these, or the run folder has no complete checkpoint.
    """
    from ernie5.store import shipped  # looked up at call time (the package folder may be patched)

    if shipped.is_shipped_name(path):
        folder = shipped.shipped_dir(str(path))
        if not (folder / META_FILE).is_file():
            raise CheckpointError(
                f"the shipped checkpoint {path!r} is missing from this install ({folder}); "
                f"reinstall the package, or rebuild it with `ernie5 recipe {path} --out DIR --install`"
            )
        return folder
    path = Path(path)
    if (path / META_FILE).is_file() and not (path / "checkpoints").is_dir():
        return path  # a checkpoint (load_checkpoint reports any file it lacks)
    if (path / "checkpoints").is_dir():
        if not (steps := checkpoint_dirs(path)):
            raise CheckpointError(f"{path}: no complete checkpoint under checkpoints/")
        return steps[-1]
    raise CheckpointError(f"{path}: not a checkpoint or a run folder with checkpoints")


def _checkpoint_folder(path: str | Path) -> Path:
    """The folder :func:`load_checkpoint` reads: a shipped name or a run folder resolved by
    :func:`resolve_checkpoint`, anything else taken as a checkpoint folder (so a missing or
    incomplete one is reported file by file by :func:`_read_meta`)."""
    from ernie5.store import shipped

    if shipped.is_shipped_name(path) or (Path(path) / "checkpoints").is_dir():
        return resolve_checkpoint(path)
    return Path(path)


def checkpoint_hash(path: str | Path) -> str:
    """Short (12 hex) stable fingerprint of a checkpoint's model, for tagging eval results.

    Computed from the sha256 values in ``meta.json`` of every file except ``meta.json`` and the
    train-state files, so it does not change with the caller's metadata or the optimizer state.
    """
    path = resolve_checkpoint(path)
    files = _read_meta(path)["files"]
    h = hashlib.sha256()
    for name in sorted(files):
        if name not in TRAIN_FILES:
            h.update(f"{name}\0{files[name]['sha256']}\n".encode())
    return h.hexdigest()[:12]


def export_checkpoint(source: str | Path, out: str | Path) -> Path:
    """A consolidated copy of checkpoint ``source`` at ``out``: ``model.safetensors`` (read from a
    parallel run's shards where it has no such file), config, tokenizer, media models and the
    caller's metadata, without any train state (``ernie5 export``)."""
    ckpt = load_checkpoint(source, fast=False)
    meta = {k: v for k, v in ckpt.meta.items() if k not in ("format", "files", "train_state")}
    return save_checkpoint(
        out,
        ckpt.model,
        tokenizer=ckpt.tokenizer,
        meta={**meta, "exported_from": str(ckpt.path)},
        vision_tokenizer=ckpt.vision_tokenizer,
        refiner=ckpt.refiner,
        audio_codec=ckpt.audio_codec,
    )
