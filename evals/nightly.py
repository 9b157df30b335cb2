"""``ernie5 nightly``: the main job (interim version until the sweep lands).

Trains the ``micro`` preset on the embedded default data (procedural tasks, plus real text when a
data root is found), then reports its parameter counts per sub-model and a generation.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ernie5.checkpoint import resolve_checkpoint
from ernie5.config import load
from ernie5.data.root import resolve_data_dir
from ernie5.model.elastic import resolve
from ernie5.params import count_params
from ernie5.presets import resolve_config_path
from ernie5.serve import generate_text


def run_nightly(
    checkpoint=None, suite="nightly", data_dir=None, out=None, baseline=None, quiet=False
) -> Path:
    """Run the main job; returns the run folder."""
    from train.config import RunConfig
    from train.loop import pretrain

    out = Path(out or f"runs/nightly-{time.strftime('%Y%m%d-%H%M%S')}")
    data_dir = resolve_data_dir(data_dir)
    if checkpoint is None:
        cfg = load(RunConfig, resolve_config_path("micro"), ["train.steps=200", "train.ckpt_every=200"])
        pretrain(cfg, out / "train", data_dir=str(data_dir) if data_dir else None, quiet=quiet)
        checkpoint = out / "train"
    ckpt = resolve_checkpoint(checkpoint)
    from ernie5.checkpoint import load_checkpoint

    model_cfg = load_checkpoint(ckpt).cfg
    rows = []
    for spec in ("full", "k1", "d0.75", "w0.5", "d0.75-w0.5-k1"):
        r = count_params(model_cfg, resolve(spec, model_cfg))
        rows.append({"subnet": spec, "total_params": r.total_params, "active_params": r.active_params})
    text, info = generate_text(ckpt, "Q: 12+7=\nA:", max_new_tokens=16)
    summary = {
        "checkpoint": str(ckpt),
        "params": rows,
        "sample": {"prompt": "Q: 12+7=\\nA:", "output": text, **info},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return out
