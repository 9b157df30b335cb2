"""A local Hugging Face causal LM (and its elastic sub-models) as a sweep target.

``ernie5 sweep --checkpoint hf:PATH`` (and ``ernie5 nightly``) evaluate the model in the folder
``PATH`` (``AutoModelForCausalLM.from_pretrained(PATH, local_files_only=True)`` and its tokenizer,
fp32, eval mode) through the same units, cache, results and report folder as an ERNIE5 checkpoint.
transformers is imported only here, when such a target is loaded (the ``hf`` extra).

:func:`load_hf_target` gives an :class:`HFTarget`, which stands where the sweep holds a
``Checkpoint``: ``cfg`` is an :class:`~evals.hf_elastic.HFShape` (so the ERNIE5 spec strings resolve
unchanged), ``hash`` is the folder's content hash and :meth:`HFTarget.adapter` makes the
:class:`HFEvalModel` of one sub-model. The sub-model runs by the scoped patches of
:mod:`evals.hf_elastic`.

Requests follow the ERNIE5 adapter's lm-eval conventions (:mod:`evals.adapter`): the sequence starts
with the tokenizer's BOS (EOS when it has none); a continuation is the token difference between
``encode(context + continuation)`` and ``encode(context)`` (alone when BPE merges across the
boundary); contexts are cut from the left to the window; rolling loglikelihood uses windows of
``max_seq_len`` tokens with a stride of half a window. Requests that share a context share one
forward when every continuation is one token; others are scored ``batch_size`` sequences at a time
with right padding (causal attention and dropless routing: padding changes no real position).
Requests with media raise :class:`~evals.adapter.EvalInputError`; the sweep gates media tasks out
beforehand (an HF target has no vision, audio or refiner capability).

Importance (``layers=importance``, ``experts=importance``) is measured as ERNIE5 measures it
(:mod:`ernie5.subnets.importance`): ShortGPT block influence ``1 - cos(h_in, h_out)`` of each decoder
layer and each expert's share of the top-k selections, on the same calibration text (the seeded
procedural documents, plus Tiny Shakespeare when the data root has it) encoded by this tokenizer.

References:
  * lm-evaluation-harness ``HFLM`` (context/continuation split, rolling windows).
  * ShortGPT block influence (arXiv 2403.03853); ERNIE 5.0 Technical Report §3.3.

Deviations:
  1. Greedy generation runs one request at a time: a prefill, then one forward per token over a
     ``DynamicCache`` holding the sub-model's kept layers only (their cache indices renumbered in
     order while it runs, :func:`evals.hf_elastic.compact_cache_indices`); it is not batched.
  2. Efficiency rows carry the analytic parameter counts of each cut (:func:`evals.hf_elastic.
     param_counts`, ``flops_per_token`` = 2 x active, attention's context term left out) and timings
     of the masked model (skipped layers and dropped experts cost nothing, but no sub-model is
     extracted: ``extracted_bytes`` and ``peak_memory_mb`` stay empty), measured as the ERNIE5 rows'
     are; no ``active_params_measured`` (routing is not recorded for it).
  3. The calibration text is cut at 128 tokens of this tokenizer, as ERNIE5 cuts it at 128 of its.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ernie5.generation.text import cut_at_stop
from ernie5.model.elastic import Subnet
from ernie5.subnets.importance import Importance
from ernie5.subnets.spec import needs_calibration, parse_subnet, resolve
from evals.adapter import EvalInputError
from evals.api import (
    Answers,
    Context,
    Cost,
    GenerationRequest,
    GenerationResult,
    LoglikelihoodRequest,
    LoglikelihoodResult,
    MediaPart,
    RollingRequest,
    RollingResult,
)
from evals.hf_elastic import (
    HFShape,
    RoutingCounter,
    compact_cache_indices,
    decoder_layers,
    elastic,
    param_counts,
    shape_of,
)
from evals.shared_context import rolling_windows

HF_PREFIX = "hf:"
NO_TIMINGS = "not measured for Hugging Face targets (analytic parameter counts only)"
HF_ADAPTER_VERSION = 1
"""Bumped when this adapter's tokenisation or scoring changes (it is part of the target's hash)."""


def is_hf_target(checkpoint: str | Path) -> bool:
    """Whether ``checkpoint`` names a Hugging Face folder (``hf:PATH``)."""
    return str(checkpoint).startswith(HF_PREFIX)


def folder_hash(path: Path) -> str:
    """sha256 of every file's relative name and bytes in ``path`` (sorted)."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode() + b"\0")
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


@dataclass
class HFTarget:
    """A loaded Hugging Face folder where the sweep holds a ``Checkpoint``."""

    path: Path
    model: torch.nn.Module
    tokenizer: object
    cfg: HFShape
    hash: str
    vision_tokenizer: None = None
    audio_codec: None = None
    refiner: None = None

    def resolve_specs(self, specs: list, data_dir=None) -> list[Subnet]:
        """The concrete sub-models of ``specs`` (calibrating importance once when one needs it)."""
        parsed = [parse_subnet(s) for s in specs]
        importance = None
        if any(needs_calibration(s, self.cfg) for s in parsed):
            importance = compute_importance(self, calibration_ids(self.tokenizer, data_dir))
        return [resolve(s, self.cfg, importance) for s in parsed]  # type: ignore[arg-type]

    def random_twin(self, seed: int) -> HFTarget:
        """The same architecture freshly initialised from ``seed`` (global RNG left as it was)."""
        from transformers import AutoModelForCausalLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(self.model.config, dtype=torch.float32)
        model.to(next(self.model.parameters()).device)
        twin_hash = hashlib.sha256(f"{self.hash}|random|{seed}".encode()).hexdigest()
        return dataclasses.replace(self, model=model.eval(), hash=twin_hash)

    def adapter(self, subnet: Subnet, batch_size: int, routing: bool = True) -> HFEvalModel:
        """The :class:`HFEvalModel` of ``subnet``."""
        return HFEvalModel(self, subnet, batch_size, routing=routing)


def load_hf_target(checkpoint: str | Path, max_len: int = 4096) -> HFTarget:
    """Load ``hf:PATH`` (or ``PATH``): model (fp32, eval) and tokenizer, from local files only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(str(checkpoint).removeprefix(HF_PREFIX)).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a Hugging Face model folder (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    content = folder_hash(path)
    target_hash = hashlib.sha256(f"hf|{content}|{HF_ADAPTER_VERSION}".encode()).hexdigest()
    return HFTarget(path, model.eval(), tokenizer, shape_of(model, max_len), target_hash)


def calibration_ids(tokenizer, data_dir=None, n: int = 4, seq_len: int = 128) -> list[torch.Tensor]:
    """ERNIE5's calibration text (:func:`ernie5.subnets.importance.calibration_batches`) in this
    tokenizer's ids: batches of two equal-length rows."""
    from ernie5.subnets.importance import calibration_texts

    texts = calibration_texts(data_dir, n)
    prefix = _prefix(tokenizer)
    ids = [[*prefix, *tokenizer.encode(t, add_special_tokens=False)][:seq_len] for t in texts]
    width = min(len(x) for x in ids)
    return [torch.tensor([x[:width] for x in ids[i : i + 2]]) for i in range(0, len(ids) - 1, 2)]


@torch.no_grad()
def compute_importance(target: HFTarget, batches: list[torch.Tensor]) -> Importance:
    """Block influence per decoder layer and each expert's share of top-k selections (full model)."""
    model, shape = target.model, target.cfg
    influence = [0.0] * shape.n_layers
    inputs: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(decoder_layers(model)):

        def pre(_m, args, kwargs, i=i):
            inputs[i] = (args[0] if args else kwargs["hidden_states"]).detach()

        def post(_m, _args, output, i=i):
            h_out = output[0] if isinstance(output, tuple) else output
            cos = torch.nn.functional.cosine_similarity(inputs[i].float(), h_out.float(), dim=-1)
            influence[i] += float((1 - cos).mean())

        hooks.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(layer.register_forward_hook(post))
    counter = RoutingCounter(shape.moe.n_experts)
    try:
        with elastic(model, Subnet.full(shape), shape, counter):  # type: ignore[arg-type]
            device = next(model.parameters()).device
            for ids in batches:
                model(input_ids=ids.to(device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    nb = max(1, len(batches))
    freq = []
    for i in range(shape.n_layers):
        c = counter.counts.get(i)
        freq.append(tuple((c.double() / c.sum().clamp_min(1)).tolist()) if c is not None else None)
    return Importance(tuple(v / nb for v in influence), tuple(freq))


def _prefix(tokenizer) -> list[int]:
    """The token every sequence starts with: BOS, else EOS (lm-eval's prefix token)."""
    for tok in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if tok is not None:
            return [int(tok)]
    raise EvalInputError("the tokenizer has neither a BOS nor an EOS token to start sequences with")


class HFEvalModel:
    """One sub-model of a Hugging Face causal LM, answering the text requests of
    :class:`~evals.api.EvalModel` (media requests raise :class:`~evals.adapter.EvalInputError`)."""

    def __init__(self, target: HFTarget, subnet: Subnet | None = None, batch_size: int = 16, *, routing=True):
        self.target = target
        self.model = target.model.eval()
        self.device = next(self.model.parameters()).device
        """Where the model runs (the sweep's ``device``): inputs go there, log-probabilities come back."""
        self.tokenizer = target.tokenizer
        self.shape = target.cfg
        self.subnet = subnet or Subnet.full(self.shape)  # type: ignore[arg-type]
        self.batch_size = batch_size
        self.max_len = self.shape.max_seq_len
        self.routing = routing and bool(self.shape.moe_layers)
        self.prefix = _prefix(self.tokenizer)
        self.pad = int(
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.prefix[0]
        )

    @property
    def fingerprint(self) -> str:
        """Target hash + the concrete sub-model + dtype + adapter version."""
        s = self.subnet
        ident = f"{self.target.hash}|{s.layers}|{s.experts}|{s.top_k}|float32|{HF_ADAPTER_VERSION}"
        return f"{self.target.hash}:{s.name}:{hashlib.sha256(ident.encode()).hexdigest()[:16]}"

    # ---------------------------------------------------------------- helpers
    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _text(self, context: Context) -> str:
        if isinstance(context, str):
            return context
        for p in context:
            if isinstance(p, MediaPart):
                raise EvalInputError(
                    f"{self.target.path}: a text-only Hugging Face model cannot take {p.modality} inputs"
                )
        return "".join(context)

    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        ctx, whole = self._encode(context), self._encode(context + continuation)
        return ctx, (whole[len(ctx) :] if whole[: len(ctx)] == ctx else self._encode(continuation))

    def _logprobs(self, rows: list[list[int]], counter: RoutingCounter | None) -> torch.Tensor:
        """Log-softmax over the vocabulary of one right-padded forward of ``rows`` (B, T, V)."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        real = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            real[i, : len(r)] = True
        if counter is not None:
            counter.real = real.reshape(-1)
        with torch.inference_mode(), elastic(self.model, self.subnet, self.shape, counter):
            logits = self.model(
                input_ids=ids.to(self.device), attention_mask=real.long().to(self.device), use_cache=False
            ).logits
        return logits.float().log_softmax(dim=-1).cpu()

    def _answers(self, results: list, costs: list[Cost], model_s: float, counter) -> Answers:
        routing = {k: v.tolist() for k, v in sorted(counter.counts.items())} if counter else {}
        return Answers(results, costs, model_s=model_s, routing=routing)

    def _counter(self) -> RoutingCounter | None:
        return RoutingCounter(self.shape.moe.n_experts) if self.routing else None

    def _score(self, seqs: list[tuple[list[int], int]], counter) -> tuple[list, list[Cost], float]:
        """Sum log P of the last ``n`` tokens of each sequence and whether all are greedy."""
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
        results: list[tuple[float, bool]] = [(0.0, True)] * len(seqs)
        costs = [Cost()] * len(seqs)
        model_s = 0.0
        for start in range(0, len(order), self.batch_size):
            idx = [i for i in order[start : start + self.batch_size]]
            t0 = time.perf_counter()
            lp = self._logprobs([seqs[i][0][:-1] for i in idx], counter)
            dt = time.perf_counter() - t0
            model_s += dt
            for row, i in enumerate(idx):
                toks, n = seqs[i]
                if n == 0:
                    results[i], costs[i] = (0.0, True), Cost(dt / len(idx), len(toks), 0)
                    continue
                tgt = torch.tensor(toks[-n:])
                pos = lp[row, torch.arange(len(toks) - 1 - n, len(toks) - 1)]
                results[i] = (float(pos.gather(-1, tgt[:, None]).sum()), bool((pos.argmax(-1) == tgt).all()))
                costs[i] = Cost(dt / len(idx), len(toks) - n, n)
        return results, costs, model_s

    # ---------------------------------------------------------------- EvalModel
    def loglikelihood(self, requests: list[LoglikelihoodRequest]) -> Answers[LoglikelihoodResult]:
        """log P(continuation | context); one forward per context when every continuation is one token."""
        counter = self._counter()
        seqs = []
        for r in requests:
            ctx, cont = self._split(self._text(r.context), r.continuation)
            toks = [*self.prefix, *ctx, *cont][-(self.max_len + 1) :]
            seqs.append((toks, min(len(cont), len(toks) - 1)))
        groups: dict[tuple, list[int]] = {}
        for i, (toks, n) in enumerate(seqs):
            groups.setdefault(tuple(toks[: len(toks) - n]), []).append(i)
        shared = {k: v for k, v in groups.items() if all(seqs[i][1] == 1 for i in v)}
        rest = [i for k, v in groups.items() if k not in shared for i in v]
        out: list = [None] * len(requests)
        costs: list[Cost] = [Cost()] * len(requests)
        scored, rest_costs, model_s = self._score([seqs[i] for i in rest], counter)
        for i, (lp, greedy), c in zip(rest, scored, rest_costs, strict=True):
            out[i], costs[i] = LoglikelihoodResult(lp, greedy, seqs[i][1]), c
        keys = sorted(shared, key=len, reverse=True)
        for start in range(0, len(keys), self.batch_size):
            part = keys[start : start + self.batch_size]
            t0 = time.perf_counter()
            lp = self._logprobs([list(k) for k in part], counter)
            dt = time.perf_counter() - t0
            model_s += dt
            for row, key in enumerate(part):
                last = lp[row, len(key) - 1]
                for i in shared[key]:
                    tok = seqs[i][0][-1]
                    out[i] = LoglikelihoodResult(float(last[tok]), bool(last.argmax() == tok), 1)
                    costs[i] = Cost(dt / sum(len(shared[k]) for k in part), len(key), 1)
        return self._answers(out, costs, model_s, counter)

    def loglikelihood_rolling(self, requests: list[RollingRequest]) -> Answers[RollingResult]:
        """log P(document), in half-overlapping windows of ``max_seq_len`` tokens."""
        counter = self._counter()
        windows: list[tuple[list[int], int]] = []
        owner, n_tokens = [], []
        for i, r in enumerate(requests):
            toks = [*self.prefix, *self._encode(r.text)]
            n_tokens.append(len(toks) - 1)
            mine = rolling_windows(toks, self.max_len)
            windows += mine
            owner += [i] * len(mine)
        scored, window_costs, model_s = self._score(windows, counter)
        totals = [0.0] * len(requests)
        spent = [(0.0, 0, 0)] * len(requests)
        for (lp, _), i, c in zip(scored, owner, window_costs, strict=True):
            totals[i] += lp
            s = spent[i]
            spent[i] = (s[0] + c.latency_s, s[1] + c.n_input_tokens, s[2] + c.n_output_tokens)
        results = [RollingResult(totals[i], n_tokens[i]) for i in range(len(requests))]
        return self._answers(results, [Cost(*s) for s in spent], model_s, counter)

    def generate(self, requests: list[GenerationRequest]) -> Answers[GenerationResult]:
        """Greedy continuations cut at the first stop string (one request at a time, KV-cached)."""
        counter = self._counter()
        out, costs, model_s = [], [], 0.0
        for r in requests:
            if r.temperature > 0:
                raise EvalInputError("the Hugging Face adapter generates greedily only (temperature 0)")
            room = self.max_len - r.max_new_tokens
            if room < 1:
                raise EvalInputError(
                    f"max_new_tokens={r.max_new_tokens} leaves no room in max_seq_len={self.max_len}"
                )
            prompt = [*self.prefix, *self._encode(self._text(r.context))][-room:]
            t0 = time.perf_counter()
            new = self._greedy(prompt, r.max_new_tokens, r.stop, counter)
            dt = time.perf_counter() - t0
            model_s += dt
            out.append(GenerationResult(cut_at_stop(self.tokenizer.decode(new), r.stop), len(new)))
            costs.append(Cost(dt, len(prompt), len(new)))
        return self._answers(out, costs, model_s, counter)

    def _greedy(
        self,
        prompt: list[int],
        max_new: int,
        stops: tuple[str, ...],
        counter,
        on_forward: Callable[[], None] | None = None,
        stop_at_eos: bool = True,
    ) -> list[int]:
        """Greedy tokens after ``prompt``: one prefill, then one cached forward per token (the sub-model's
        kept layers only in the cache: :func:`evals.hf_elastic.compact_cache_indices`). ``on_forward``
        is called after each forward (timing); ``stop_at_eos=False`` decodes all ``max_new`` tokens."""
        from transformers import DynamicCache

        new: list[int] = []
        eos = self.tokenizer.eos_token_id if stop_at_eos else None
        if counter is not None:
            counter.real = None  # every position of a generation is real
        cache = DynamicCache()
        ids = torch.tensor([prompt], device=self.device)
        with (
            torch.inference_mode(),
            elastic(self.model, self.subnet, self.shape, counter),
            compact_cache_indices(self.model, self.subnet),
        ):
            for _ in range(max_new):
                logits = self.model(input_ids=ids, past_key_values=cache, use_cache=True).logits
                nxt = int(logits[0, -1].float().argmax())
                if on_forward is not None:
                    on_forward()
                new.append(nxt)
                if nxt == eos or (stops and any(s in self.tokenizer.decode(new[-32:]) for s in stops)):
                    break
                ids = torch.tensor([[nxt]], device=self.device)
        return new


def efficiency_rows(
    target: HFTarget, subnets: list[Subnet], cfg=None, *, clock: Callable[[], float] | None = None
) -> list[dict]:
    """One row per sub-model: the analytic parameter counts of the cut (:func:`evals.hf_elastic.
    param_counts`; ``flops_per_token`` = 2 x active) and, with the suite's efficiency settings
    ``cfg``, prefill and decoding times measured as the ERNIE5 rows' are (:mod:`evals.efficiency`:
    a ``prompt_len``-token prompt, ``decode_tokens`` greedy tokens through the KV-cached decoder,
    every step timed, the same checks and retries) on the masked model (Deviations 2)."""
    from ernie5.runtime.threads import num_threads
    from evals.efficiency import (
        CPU_THREADS,
        MIN_REPEATS,
        _timing_columns,
        machine_matmul_peak,
        time_forwards,
        timing_columns,
    )

    clock = clock or time.perf_counter
    nan = math.nan
    first = next(target.model.parameters())
    on_cpu = first.device.type == "cpu"
    threads = CPU_THREADS if on_cpu else None
    peak = machine_matmul_peak(str(first.device), first.dtype, threads or 0) if cfg is not None else nan
    repeats = max(cfg.repeats, MIN_REPEATS) if cfg is not None else 0
    vocab = int(target.model.config.vocab_size)
    prompt_len = cfg.prompt_len if cfg is not None else 0
    prompt = torch.randint(
        min(16, vocab - 1), vocab, (prompt_len,), generator=torch.Generator().manual_seed(0)
    )
    prompt = prompt.tolist()
    rows = []
    for sub in subnets:
        total, active = param_counts(target.model, sub, target.cfg)
        moe = [i for i in sub.layers if target.cfg.is_moe_layer(i)]
        row = {
            "subnet": sub.name,
            "depth": len(sub.layers),
            "width": max((sub.n_experts_kept(i, target.cfg.moe.n_experts) for i in moe), default=0),
            "top_k": sub.top_k,
            "total_params": total,
            "active_params": active,
            "active_params_measured": None,
            "flops_per_token": 2 * active,
            "threads": threads,
            "peak_memory_mb": None,
            "extracted_bytes": None,
        }
        if cfg is None:
            row.update(_timing_columns([], [], 1, 1.0, nan), status="failed", reason=NO_TIMINGS)  # all NaN
        else:
            model = HFEvalModel(target, sub, 1, routing=False)

            def run(mark, model=model) -> None:
                model._greedy(prompt, cfg.decode_tokens, (), None, mark, stop_at_eos=False)

            with num_threads(threads):
                row.update(
                    timing_columns(
                        lambda run=run: time_forwards(run, first.device, repeats, clock),
                        cfg.prompt_len,
                        2 * active,
                        peak,
                    )
                )
        rows.append(row)
    return rows
