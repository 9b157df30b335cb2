"""Experiment trackers: what ``metrics.jsonl`` records, also sent to TensorBoard, Weights & Biases or
MLflow (``--log-with`` on ``train``, ``sft``, ``rl``, ``sweep`` and ``nightly``).

The trackers are accelerate's own (``accelerate.tracking``), created here directly rather than through
an ``Accelerator`` (a run's process group is the project's own), on the first process only. They are
offline unless the user asks otherwise, and never make a network call by default:

  * ``tensorboard``: event files under ``RUN_DIR/tensorboard/<run name>/`` (``tensorboard --logdir``).
  * ``wandb``: ``mode="offline"`` under ``RUN_DIR/wandb/`` (``wandb sync`` uploads it later), unless
    ``WANDB_MODE`` is set.
  * ``mlflow``: the run folder's own store, ``RUN_DIR/mlflow.db`` (SQLite, with full ``mlflow``) or
    ``RUN_DIR/mlruns`` (the file store, with ``mlflow-skinny``), read by ``mlflow ui
    --backend-store-uri ...``, unless ``MLFLOW_TRACKING_URI`` is set.

A tracker whose package is absent is a one-line :class:`~ernie5.config.ConfigError` naming the package
to install, before any work; a tracker that fails while the run goes on is dropped with one warning
(the run and its ``metrics.jsonl`` matter more than a mirror of them). Only numbers are logged: nested
records are flattened to ``a/b`` keys, and strings, lists and ``None`` are left to ``metrics.jsonl``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ernie5.config import ConfigError

TRACKERS = ("tensorboard", "wandb", "mlflow")
"""The trackers ``--log-with`` accepts."""
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
_INSTALL = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny (or mlflow)"}


def parse_log_with(values: str | Iterable[str] | None) -> tuple[str, ...]:
    """``"tensorboard,wandb"`` or ``["tensorboard", "wandb"]`` -> the tracker names, checked: an unknown
    name, or one whose package is not installed, is a one-line :class:`ConfigError`."""
    if values is None:
        return ()
    items = [values] if isinstance(values, str) else list(values)
    names: list[str] = []
    for item in items:
        for name in (x.strip() for x in item.split(",")):
            if not name:
                continue
            if name not in TRACKERS:
                raise ConfigError(f"--log-with {name!r}: expected one of {', '.join(TRACKERS)}")
            if importlib.util.find_spec(_PACKAGES[name]) is None:
                raise ConfigError(
                    f"--log-with {name}: the {_PACKAGES[name]} package is not installed "
                    f"(pip install {_INSTALL[name]})"
                )
            if name not in names:
                names.append(name)
    return tuple(names)


def scalars(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of ``record`` (nested mappings flattened to ``a/b``; bools as 0/1; non-finite kept,
    as TensorBoard and W&B show them)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out |= scalars(value, f"{name}/")
        elif isinstance(value, int | float):  # bool included
            out[name] = float(value)
    return out


def _accelerate_state() -> None:
    """accelerate's trackers log through its logging utility, which needs its process state: a
    one-process state when the run is not launched for several (a launched run's processes made theirs
    when they joined the group, :func:`ernie5.runtime.distributed.init_dist`)."""
    from accelerate import PartialState

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or PartialState._shared_state:
        PartialState()


def _mlflow_store(run_dir: Path) -> str:
    """The run folder's own MLflow store: SQLite (``mlflow.db``) where SQLAlchemy is installed (full
    ``mlflow``), else the file store ``mlruns/`` (``mlflow-skinny``; MLflow 3 keeps it in maintenance
    mode and asks for an explicit opt-in, given here for this process)."""
    if importlib.util.find_spec("sqlalchemy") is not None:
        return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return (run_dir / "mlruns").resolve().as_uri()


def _config_values(config: Mapping[str, Any] | None) -> dict[str, bool | str | float | int]:
    """A run config flattened to the simple values trackers take as hyperparameters."""
    flat: dict[str, bool | str | float | int] = {}

    def walk(obj: Any, prefix: str) -> None:
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(v, f"{prefix}{k}.")
        elif isinstance(obj, bool | int | float | str):
            flat[prefix[:-1]] = obj
        elif obj is not None:
            flat[prefix[:-1]] = str(obj)

    walk(config or {}, "")
    return flat


class Trackers:
    """The trackers of one run (none: every call does nothing). Use as a context manager, or call
    :meth:`close` at the end."""

    def __init__(
        self,
        names: Sequence[str],
        run_dir: str | Path,
        run_name: str,
        config: Mapping[str, Any] | None = None,
        *,
        main: bool = True,
    ) -> None:
        self.names = tuple(names) if main else ()
        self.run_dir = Path(run_dir)
        self._trackers: list[Any] = []
        if self.names:
            _accelerate_state()
        values = _config_values(config) if self.names else {}
        for name in self.names:
            tracker = self._make(name, run_name)
            tracker.main_process_only = False  # this object exists on the first process only
            tracker.start()
            if values:
                tracker.store_init_configuration(values)
            self._trackers.append(tracker)

    def _make(self, name: str, run_name: str):
        from accelerate import tracking

        if name == "tensorboard":
            import tensorboard  # noqa: F401  (torch.utils.tensorboard's writer needs the package)

            return tracking.TensorBoardTracker(run_name, self.run_dir / "tensorboard")
        if name == "wandb":
            import wandb

            (self.run_dir / "wandb").mkdir(parents=True, exist_ok=True)
            return tracking.WandBTracker(
                run_name,
                name=run_name,
                dir=str(self.run_dir),
                mode=os.environ.get("WANDB_MODE", "offline"),
                settings=wandb.Settings(console="off", silent=True),
            )
        if name == "mlflow":
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no network call by default
            import mlflow

            if not os.environ.get("MLFLOW_TRACKING_URI"):
                mlflow.set_tracking_uri(_mlflow_store(self.run_dir))
            return tracking.MLflowTracker(experiment_name=run_name, run_name=self.run_dir.name)
        raise ConfigError(f"--log-with {name!r}: expected one of {', '.join(TRACKERS)}")

    def log(self, record: Mapping[str, Any], step: int | None = None, prefix: str = "") -> None:
        """Log the numbers of ``record`` at ``step``."""
        values = scalars(record, prefix)
        if not values:
            return
        for tracker in list(self._trackers):
            try:
                tracker.log(values, step=step)
            except Exception as e:  # noqa: BLE001 - a mirror of metrics.jsonl must not end the run
                self._drop(tracker, e)

    def _drop(self, tracker: Any, e: Exception) -> None:
        self._trackers.remove(tracker)
        print(
            f"ernie5: warning: the {tracker.name} tracker failed ({type(e).__name__}: {e}); "
            "logging to it stops, metrics.jsonl goes on",
            file=sys.stderr,
        )

    def close(self) -> None:
        for tracker in self._trackers:
            try:
                tracker.finish()
            except Exception as e:  # noqa: BLE001
                print(f"ernie5: warning: closing the {tracker.name} tracker failed: {e}", file=sys.stderr)
        self._trackers = []

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
