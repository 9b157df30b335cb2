"""The one command-line entry: ``ernie5 <command>``.

Each subcommand parses its arguments and calls one library function. Bad input is a one-line
``ernie5 <command>: error: ...`` on stderr with exit code 2 and no traceback; :data:`EXIT_CODES`
lists every exit code (``ernie5 --help`` prints them).

The commands live in :mod:`jobs.commands`, one module per family (``training``, ``models``,
``evaluation``, ``reporting``), each handler beside its parser; this module builds the tree and runs
one. It sits on the top layer (``jobs``), above ``train``, ``evals`` and ``reports``, which the
handlers import lazily so that ``ernie5 --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

from jobs.commands import evaluation, models, reporting, training
from jobs.commands.common import (
    EXIT_BAD_INPUT,
    EXIT_BROKEN_PIPE,
    EXIT_CODES,
    EXIT_DIVERGED,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    CLIError,
)


def _diverged() -> type[BaseException]:
    from train.common.nonfinite import DivergedError

    return DivergedError


def _preempted() -> type[BaseException]:
    from ernie5.runtime.preempt import Preempted

    return Preempted


def _user_errors() -> tuple[type[BaseException], ...]:
    from ernie5.config import ConfigError
    from ernie5.data.root import DataDirError, DataMissing
    from ernie5.data.voices import VoicesUnavailable
    from ernie5.generation.text import GenerationError
    from ernie5.store.checkpoint import CheckpointError
    from ernie5.subnets.spec import SubnetError
    from ernie5.tokenizers.text import TokenizerError

    errors: list[type[BaseException]] = [
        CLIError,
        ConfigError,
        SubnetError,
        CheckpointError,
        DataMissing,
        DataDirError,
        GenerationError,
        TokenizerError,
        VoicesUnavailable,
    ]
    from ernie5.data.text import DataCorrupt
    from ernie5.store.runs import RunLocked
    from ernie5.tokenizers.refiner import RefinerError
    from ernie5.tokenizers.vision import VisionTokenizerError
    from evals.adapter import EvalInputError
    from evals.verifiers import VerifierError
    from reports.load import ReportError
    from train.common.run_folder import RunError

    errors += [DataCorrupt, EvalInputError, RunError, ReportError, RefinerError, VisionTokenizerError]
    errors.append(VerifierError)
    return (*errors, RunLocked)


def _os_error_line(e: OSError) -> str:
    """One line for a file-system error: what failed on which path."""
    paths = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    return f"{e.strerror or type(e).__name__}: {paths}"


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of every command."""
    epilog = "exit codes:\n" + "\n".join(
        textwrap.fill(what, 100, initial_indent=f"  {code:<4} ", subsequent_indent=" " * 7)
        for code, what in EXIT_CODES.items()
    )
    p = argparse.ArgumentParser(
        prog="ernie5",
        description=__doc__.splitlines()[0],
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for family in (training, models, evaluation, reporting):
        family.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from ernie5.kernels import mode as kernels_mode
    from ernie5.runtime.allocator import tune_allocator

    tune_allocator()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        kernels_mode()
    except ValueError as e:
        print(f"ernie5: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if argv[:1] == ["lm-eval"]:  # forward verbatim: argparse's REMAINDER rejects a leading --option
        args = argparse.Namespace(command="lm-eval", fn=evaluation.cmd_lm_eval, lm_eval_args=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        if hasattr(args, "data_dir"):
            from ernie5.data.root import resolve_data_dir

            resolve_data_dir(args.data_dir)  # a root that is not a folder is bad input, before any work
        return args.fn(args)
    except _user_errors() as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"ernie5 {args.command}: error: {msg}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except _diverged() as e:
        print(f"ernie5 {args.command}: diverged: {e}", file=sys.stderr)
        return EXIT_DIVERGED
    except _preempted() as e:
        print(f"ernie5 {args.command}: preempted: {e}", file=sys.stderr)
        return EXIT_PREEMPTED
    except KeyboardInterrupt:
        print(f"ernie5 {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`ernie5 params --json | head`): stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except OSError as e:
        if e.filename is None:  # not about a file or folder: a real failure, keep its traceback
            raise
        print(f"ernie5 {args.command}: error: {_os_error_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
