"""The LM adapter: an ERNIE5 checkpoint and sub-model as lm-eval model ``ernie5``.

``model_args``: ``checkpoint`` (checkpoint or run folder), ``subnet`` (compact SubnetSpec, default
``full``), ``cache`` (our SQLite response cache, keyed by checkpoint *and* sub-model), ``batch_size``,
``device`` (cpu | cuda[:N]). lm-eval's own ``use_cache`` is refused (:data:`USE_CACHE_ERROR`): its key
has no model identity, so a second sub-model would silently get the first one's answers.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from ernie5.data.root import resolve_data_dir
from ernie5.store.checkpoint import load_checkpoint
from ernie5.subnets.params import count_params
from ernie5.subnets.spec import resolve_specs
from evals.adapter import Ernie5EvalModel
from evals.api import GenerationRequest, LoglikelihoodRequest, RollingRequest, add_routing
from evals.cache import CachedModel, ResponseCache
from evals.lm_eval.common import LmEvalUsageError, one_line

USE_CACHE_ERROR = (
    "lm-eval's --use_cache is not keyed by model, so sub-models would share answers; the "
    "ernie5 bridge caches per checkpoint and subnet itself: use --model_args ...,cache=PATH"
)


def inner_model(model: Any) -> Any:
    while isinstance(model, CachedModel):
        model = model.model
    return model


class _DeviceEvalModel(Ernie5EvalModel):
    """The adapter with its inputs moved to the model's device and the logits brought back."""

    def _run(self, inputs, real_BT, tally, cache=None):
        dev = self.model.tok_emb.weight.device
        out = super()._run(inputs.to(dev), real_BT.to(dev), tally, cache)
        out.logits_BTV = out.logits_BTV.cpu()
        return out


@register_model("ernie5")
class Ernie5LM(LM):
    """An ERNIE5 checkpoint + sub-model as an lm-eval ``LM``, answering through our EvalModel."""

    def __init__(
        self,
        checkpoint: str | None = None,
        subnet: str = "full",
        batch_size: Any = None,
        device: str | None = None,
        cache: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if not checkpoint:
            raise LmEvalUsageError("ernie5: model_args needs checkpoint=PATH (a checkpoint or run folder)")
        dev = str(device or "cpu")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", dev) or (dev != "cpu" and not torch.cuda.is_available()):
            raise LmEvalUsageError(f"ernie5: device={dev!r}: use cpu, or cuda[:N] on a machine with CUDA")
        try:  # CheckpointError, SubnetError, DataDirError: one line on the command line
            ckpt = load_checkpoint(checkpoint, device=dev)
            (sub,) = resolve_specs([str(subnet)], ckpt, resolve_data_dir(None))
        except ValueError as e:
            raise LmEvalUsageError(f"ernie5: {one_line(e)}") from None
        bs = 16 if batch_size is None or str(batch_size).startswith("auto") else max(1, int(batch_size))
        model = (Ernie5EvalModel if dev == "cpu" else _DeviceEvalModel)(ckpt, sub, batch_size=bs)
        self._setup(CachedModel(model, ResponseCache(cache)) if cache else model)
        self._device = dev

    @classmethod
    def from_eval_model(cls, eval_model: Any) -> Ernie5LM:
        """Wrap a loaded EvalModel (our adapter, a CachedModel, a baseline) without reloading anything."""
        self = cls.__new__(cls)
        LM.__init__(self)
        self._setup(eval_model)
        return self

    def _setup(self, eval_model: Any) -> None:
        self.eval_model, self.max_len = eval_model, int(getattr(inner_model(eval_model), "max_len", 2048))
        self.model_s = 0.0
        """Seconds the model spent in forwards for every answer so far."""
        self.routing: dict[int, list[int]] = {}
        """Expert loads of every answer so far (see :class:`evals.api.Answers`)."""

    def _ask(self, method: str, requests: list) -> list:
        answers = getattr(self.eval_model, method)(requests)
        self.model_s += answers.model_s
        add_routing(self.routing, answers.routing)
        return answers.results

    def set_cache_hook(self, cache_hook: Any) -> None:
        """Called only by lm-eval's CachingLM (``use_cache``), whose key ignores the sub-model: refuse."""
        raise ValueError(USE_CACHE_ERROR)

    def loglikelihood(self, requests: list) -> list[tuple[float, bool]]:  # noqa: D102
        reqs = [LoglikelihoodRequest(r.args[0], r.args[1]) for r in requests]
        return [(float(a.logprob), bool(a.is_greedy)) for a in self._ask("loglikelihood", reqs)]

    def loglikelihood_rolling(self, requests: list) -> list[float]:  # noqa: D102
        reqs = [RollingRequest(r.args[0]) for r in requests]
        return [float(a.logprob) for a in self._ask("loglikelihood_rolling", reqs)]

    def generate_until(self, requests: list) -> list[str]:  # noqa: D102
        return [a.text for a in self._ask("generate", [self._gen_request(r.args) for r in requests])]

    def _gen_request(self, args: tuple) -> GenerationRequest:
        kw, until = dict(args[1] or {}), (args[1] or {}).get("until") or ()
        max_new = int(kw.get("max_gen_toks") or 256)
        max_new = max_new if max_new < self.max_len else max(1, self.max_len // 2)  # room for a prompt
        temperature = float(kw.get("temperature", 1.0) or 0.0) if kw.get("do_sample") else 0.0
        stop = (until,) if isinstance(until, str) else tuple(until)
        return GenerationRequest(args[0], max_new_tokens=max_new, stop=stop, temperature=temperature)

    def get_model_info(self) -> dict[str, Any]:
        """Checkpoint, concrete sub-model and its parameter counts (lm-eval merges this into config)."""
        inner = inner_model(self.eval_model)
        info = {"fingerprint": getattr(self.eval_model, "fingerprint", None)}
        ckpt, sub = getattr(inner, "ckpt", None), getattr(inner, "subnet", None)
        if ckpt is None or sub is None:
            return info
        rep, n_exp = count_params(ckpt.cfg, sub), ckpt.cfg.moe.n_experts
        return {
            **info,
            "checkpoint": str(ckpt.path),
            "checkpoint_hash": getattr(inner, "ckpt_hash", None),
            "subnet": sub.name,
            "layers": list(sub.layers),
            "top_k": sub.top_k,
            "experts_per_layer": [n_exp if e is None else len(e) for e in sub.experts],
            "active_params": rep.active_params,
            "total_params": rep.total_params,
            "activation_rate": rep.activation_rate,
        }
