"""The parts of the ``seqnorm`` command that need neither Lightning nor jsonargparse: ``--version``, the top-level
``--help``, ``configs`` and the usage errors before a subcommand is known.

:func:`seqnorm.cli.entry.main` (the console script) answers these before it imports :mod:`seqnorm.cli.app`: importing
Lightning and jsonargparse there made each of them take seconds longer (docs/cli.md), and they work on a base install
without the ``train`` extra.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["COMMANDS", "answer_without_lightning", "top_level_help", "usage_error", "version"]

COMMANDS = ("fit", "validate", "test", "predict", "generate", "configs")

_SUMMARIES = (
    ("fit", "Train a model (--model LanguageModel | SequenceClassifier, --data TextCorpus | LabeledText)."),
    ("validate", "Evaluate a checkpoint (--ckpt_path) on the validation split."),
    ("test", "Evaluate a checkpoint (--ckpt_path) on the test split."),
    ("predict", "Write a checkpoint's predictions to predictions.jsonl, beside its run (<run>/predict_N/)."),
    ("generate", "Sample text from a LanguageModel checkpoint."),
    ("configs", "List the shipped configs, used as --config seqnorm:NAME."),
)


def top_level_help() -> str:
    """What ``seqnorm --help`` prints: the commands, and where each one's flags are listed."""
    commands = "\n".join(f"    {name:<12}{summary}" for name, summary in _SUMMARIES)
    return (
        f"usage: seqnorm {{{','.join(COMMANDS)}}} ...\n\n"
        "Normalized recurrent networks: train, evaluate and sample them (LightningCLI).\n\n"
        f"commands:\n{commands}\n\n"
        "options:\n"
        "    -h, --help  Show this help message and exit (seqnorm COMMAND --help: that command's flags).\n"
        "    -V, --version\n"
        "                Print seqnorm's and torch's versions and whether the compiled kernels run.\n\n"
        "e.g. seqnorm fit --config seqnorm:char_lm --data.path my.txt"
    )


def version() -> str:
    """``seqnorm --version``: this package, torch, and whether the compiled kernels run."""
    import torch

    import seqnorm

    return f"seqnorm {seqnorm.__version__} (torch {torch.__version__}; compiled kernels: {seqnorm.kernels.status()})"


def usage_error(message: str) -> NoReturn:
    """The usage line and ``message`` on stderr, exit code 2 (argparse's convention)."""
    print(f"usage: seqnorm {{{','.join(COMMANDS)}}} ...\nseqnorm: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def answer_without_lightning(argv: Sequence[str]) -> bool:
    """Answer ``argv`` here when it needs no Lightning (``--version``, ``--help``, ``configs``, no or an unknown
    command): ``True`` when done (``SystemExit`` after help and usage errors, as argparse), ``False`` when the command
    is :mod:`seqnorm.cli.app`'s to run."""
    command = argv[0] if argv else ""
    if command in ("--version", "-V"):
        print(version())
        return True
    if command in ("-h", "--help"):
        print(top_level_help())
        raise SystemExit(0)  # as argparse's --help does (seqnorm COMMAND --help too)
    if command == "configs":
        from seqnorm.shipped_configs import describe_configs

        print(describe_configs())  # the list is all there is to say, also for --help
        return True
    if not command:  # LightningCLI's own error would list its subcommands only
        usage_error("no command given (seqnorm --help lists them)")
    if not command.startswith("-") and command not in COMMANDS:  # LightningCLI's own error omits ours
        close = difflib.get_close_matches(command, COMMANDS, n=1)
        guess = f"; did you mean {close[0]!r}?" if close else ""
        usage_error(f"invalid choice: {command!r} (choose from {', '.join(repr(name) for name in COMMANDS)}){guess}")
    return False
