"""Model commands: ``params``, ``extract``, ``generate`` and ``bench``.

Each handler sits beside the parser of its command; :func:`add_parsers` adds them to ``ernie5``.
"""

from __future__ import annotations

import json
import sys

from jobs.commands.common import CLIError, check_out, load_model_config, print_json


def cmd_params(args) -> int:
    """``ernie5 params``."""
    from ernie5.subnets.params import count_params
    from ernie5.subnets.spec import resolve_subnet

    if bool(args.config) == bool(args.checkpoint):
        raise CLIError("give exactly one of --config or --checkpoint")
    cfg, path = load_model_config(args)
    subnet = resolve_subnet(args.subnet, cfg, path) if args.subnet else None
    report = count_params(cfg, subnet, args.seq_len).to_dict()
    report = {"subnet": subnet.name if subnet else "full", **report}
    if args.json:
        print_json(report)
    else:
        for k, v in report.items():
            if isinstance(v, float) and k == "activation_rate":
                v = f"{v * 100:.3f} %"
            elif isinstance(v, int | float) and not isinstance(v, bool) and abs(v) >= 1000:
                v = f"{v:,.0f}"
            print(f"{k:28s} {v}")
    return 0


def add_params_parser(sub) -> None:
    """``ernie5 params``."""
    pa = sub.add_parser("params", help="total/active params, activation rate and FLOPs per token")
    pa.add_argument("--config", help="preset name or run-config YAML")
    pa.add_argument("--checkpoint", help="checkpoint folder or run folder (its newest checkpoint)")
    pa.add_argument("--subnet", help="elastic sub-model, e.g. d0.75-w0.5-k1")
    pa.add_argument("--set", action="append", metavar="KEY=VALUE", help="override model.* values")
    pa.add_argument(
        "--seq-len", type=int, default=None, help="context for attention FLOPs (default: max_seq_len)"
    )
    pa.add_argument("--json", action="store_true", help="print JSON")
    pa.set_defaults(fn=cmd_params)


def cmd_extract(args) -> int:
    """``ernie5 extract``."""
    from ernie5.subnets.extract import extract_checkpoint

    out = check_out(args.out)
    if out.exists():
        raise CLIError(f"--out {out} already exists; choose a new folder (nothing is overwritten)")
    report = extract_checkpoint(args.checkpoint, args.subnet, out, data_dir=args.data_dir)
    print_json(report)
    return 0


def add_extract_parser(sub) -> None:
    """``ernie5 extract``."""
    e = sub.add_parser("extract", help="write a standalone checkpoint of a sub-model (physically sliced)")
    e.add_argument("--checkpoint", required=True, help="checkpoint folder or run folder")
    e.add_argument("--subnet", required=True, help="sub-model spec, e.g. d0.75-w0.5-k1")
    e.add_argument("--out", required=True, help="new checkpoint folder")
    e.add_argument("--data-dir", help="data root for importance calibration text (optional)")
    e.set_defaults(fn=cmd_extract)


def cmd_export(args) -> int:
    """``ernie5 export``."""
    from ernie5.store.checkpoint import export_checkpoint

    out = check_out(args.out)
    if out.exists():
        raise CLIError(f"--out {out} already exists; choose a new folder (nothing is overwritten)")
    print(export_checkpoint(args.checkpoint, out))
    return 0


def add_export_parser(sub) -> None:
    """``ernie5 export``."""
    e = sub.add_parser(
        "export",
        help="a consolidated copy of a checkpoint (model.safetensors; a parallel run's from its shards)",
    )
    e.add_argument("--checkpoint", required=True, help="checkpoint folder or run folder")
    e.add_argument("--out", required=True, help="new checkpoint folder")
    e.set_defaults(fn=cmd_export)


def cmd_generate(args) -> int:
    """``ernie5 generate``."""
    from ernie5.generation.text import generate_text

    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens {args.max_new_tokens}: expected an integer >= 1")
    if not args.temperature >= 0:
        raise CLIError(f"--temperature {args.temperature}: expected a number >= 0 (0 = greedy)")
    text, info = generate_text(
        args.checkpoint,
        args.prompt,
        subnet=args.subnet,
        max_new_tokens=args.max_new_tokens,
        speculative=args.speculative,
        temperature=args.temperature,
        seed=args.seed,
    )
    print(text)
    if info:
        print(json.dumps(info), file=sys.stderr)
    return 0


def add_generate_parser(sub) -> None:
    """``ernie5 generate``."""
    g = sub.add_parser("generate", help="generate text from a checkpoint (optionally a sub-model)")
    g.add_argument("--checkpoint", required=True)
    g.add_argument("--subnet", default=None)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (>= 1)")
    g.add_argument("--speculative", action="store_true", help="MTP self-speculative decoding (greedy)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), > 0 samples")
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(fn=cmd_generate)


def cmd_bench(args) -> int:
    """``ernie5 bench moe|gemm|decode|train|parity|harness``."""
    for name in ("repeats", "grad_accum"):
        if getattr(args, name) < 1:
            raise CLIError(f"--{name.replace('_', '-')} {getattr(args, name)}: expected an integer >= 1")
    if args.grad_accum != 1 and args.what != "train":
        raise CLIError(f"--grad-accum applies to `bench train`, not `bench {args.what}`")
    if args.decoding is not None and args.what != "decode":
        raise CLIError(f"--decoding applies to `bench decode`, not `bench {args.what}`")
    from ernie5.bench.timing import resolve_device

    try:
        device = resolve_device(args.device)
    except ValueError as e:
        raise CLIError(str(e)) from None
    if args.activation_checkpoint and args.what != "train":
        raise CLIError(f"--activation-checkpoint applies to `bench train`, not `bench {args.what}`")
    if args.fp8 and args.what != "train":
        raise CLIError(f"--fp8 applies to `bench train`, not `bench {args.what}`")
    if args.fp8:
        from train.pretrain.parallel.fp8 import fp8_supported

        why = fp8_supported(device)
        if why is not None:
            raise CLIError(f"--fp8: {why}")
    if args.shape is not None and args.what not in ("gemm", "train", "decode"):
        raise CLIError(f"--shape applies to `bench gemm`, `train` and `decode`, not `bench {args.what}`")
    for name in ("batch_size", "seq_len"):
        value = getattr(args, name)
        if value is not None and (args.what != "train" or value < 1):
            flag = "--" + name.replace("_", "-")
            why = "expected an integer >= 1" if value < 1 else "applies to `bench train` only"
            raise CLIError(f"{flag} {value}: {why}")
    if args.shape is not None and args.what in ("train", "decode"):
        from ernie5.presets import resolve_config_path

        resolve_config_path(args.shape)  # an unknown preset: ConfigError, before any work
    if args.peer and args.shape not in (None, "nano"):
        raise CLIError("--peer times the peer at the nano shape only")
    if args.what != "harness" and (args.checkpoint is not None or args.items is not None):
        raise CLIError(f"--checkpoint and --items apply to `bench harness`, not `bench {args.what}`")
    if args.what == "harness":
        if device.type != "cpu":
            raise CLIError("bench harness runs on cpu (the sweep's device)")
        if args.items is not None and args.items < 1:
            raise CLIError(f"--items {args.items}: expected an integer >= 1")
        from ernie5.data.root import resolve_data_dir
        from evals.bench import bench_harness

        result = bench_harness(
            args.checkpoint or "reference",
            data_dir=resolve_data_dir(args.data_dir),
            items=args.items or 40,
            repeats=args.repeats,
        )
    elif args.what == "parity":
        from ernie5.bench.parity import bench_parity

        result = bench_parity(device=device)
    elif args.what == "gemm":
        from ernie5.bench.gemm import bench_gemm

        try:
            result = bench_gemm(shape=args.shape, repeats=args.repeats, device=device)
        except ValueError as e:
            raise CLIError(f"--shape: {e}") from None
    elif args.what == "moe":
        from ernie5.bench.moe import bench_moe

        result = bench_moe(tokens=args.tokens, repeats=args.repeats, device=device)
    elif args.what == "decode":
        from ernie5.bench.decode import bench_decode

        result = bench_decode(
            repeats=args.repeats,
            new_tokens=args.new_tokens,
            device=device,
            decoding=args.decoding or "sampled",
            shape=args.shape or "nano",
        )
    else:
        from train.pretrain.bench import bench_train

        result = bench_train(
            repeats=args.repeats,
            shape=args.shape or "nano",
            batch_size=args.batch_size or 8,
            seq_len=args.seq_len or 256,
            peer=args.peer,
            grad_accum=args.grad_accum,
            device=str(device),
            activation_checkpoint=args.activation_checkpoint,
            fp8=args.fp8,
        )
    if args.json:
        print_json(result)
    else:
        print(json.dumps(result, indent=2))
    return 0


def add_bench_parser(sub) -> None:
    """``ernie5 bench``."""
    b = sub.add_parser("bench", help="benchmarks printing JSON (medians over repeats)")
    b.add_argument("what", choices=["moe", "gemm", "decode", "train", "parity", "harness"])
    b.add_argument("--json", action="store_true", help="print JSON only")
    b.add_argument("--repeats", type=int, default=5)
    b.add_argument("--tokens", type=int, default=2048, help="moe: tokens per forward")
    b.add_argument(
        "--shape",
        help="gemm: nano or gpu (default: gpu on CUDA, else nano); train, decode: a preset's model (default "
        "nano; gpu_fill fills one H100)",
    )
    b.add_argument("--batch-size", type=int, help="train: sequences per micro-batch (default 8)")
    b.add_argument("--seq-len", type=int, help="train: tokens per sequence (default 256)")
    b.add_argument("--new-tokens", type=int, default=64, help="decode: tokens generated per repeat")
    b.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    b.add_argument("--checkpoint", default=None, help="harness: checkpoint (default: reference)")
    b.add_argument("--items", type=int, default=None, help="harness: items per task family (default 40)")
    b.add_argument("--data-dir", help="harness: data root (default: $ERNIE5_DATA_DIR)")
    b.add_argument(
        "--decoding",
        choices=["sampled", "greedy"],
        default=None,
        help="decode: sample at temperature 1 with a fixed seed (default) or decode greedily",
    )
    b.add_argument(
        "--peer",
        action="store_true",
        help="train: also time Hugging Face Mixtral at the same shape in this process (needs transformers)",
    )
    b.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="train: micro-batches (8 x 256 tokens each) per optimizer step (default 1, as the peer)",
    )
    b.add_argument(
        "--activation-checkpoint",
        action="store_true",
        help="train: recompute each block's activations in the backward; reports the saved activation memory",
    )
    b.add_argument(
        "--fp8",
        action="store_true",
        help="train: the blocks' dense projections in FP8 (torchao; a GPU of compute capability >= 8.9)",
    )
    b.set_defaults(fn=cmd_bench)


def add_parsers(sub) -> None:
    """This module's commands, in ``ernie5 --help`` order."""
    add_params_parser(sub)
    add_extract_parser(sub)
    add_export_parser(sub)
    add_generate_parser(sub)
    add_bench_parser(sub)
