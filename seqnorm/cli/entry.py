"""The ``seqnorm`` command's entry point (the console script, ``python -m seqnorm``, ``python -m seqnorm.cli``):
:func:`seqnorm.cli.main`, once the training extra is there.

``--version``, ``--help`` and ``configs`` are answered first, without importing Lightning or jsonargparse
(:mod:`seqnorm.cli.commands`): they are quick, and they work on a base install (``pip install seqnorm``, the library
alone). Every other command needs the ``train`` extra, and says so when it is missing.
"""

from __future__ import annotations

import os
import sys

from seqnorm.cli.commands import answer_without_lightning

TRAINING_EXTRA = ("lightning", "jsonargparse", "tensorboard", "pooch", "rich", "matplotlib", "torchmetrics")
"""Top-level packages of the ``train`` extra (and what they bring) that the command imports."""


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``seqnorm`` console script (``args``: ``sys.argv[1:]`` when ``None``).

    Output into a pipe whose reader has gone (``seqnorm --help | head -1``) ends the command quietly with status 141,
    as SIGPIPE ends other commands, rather than with a ``BrokenPipeError`` traceback."""
    try:
        try:
            _run(args)
        finally:
            sys.stdout.flush()  # here, not at exit, where a closed pipe is only an "Exception ignored" message
    except BrokenPipeError:
        # Python's recipe (signal module docs, "Note on SIGPIPE"): what is still buffered must not fail again at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(141) from None


def _run(args: list[str] | None) -> None:
    if answer_without_lightning(sys.argv[1:] if args is None else args):
        return
    try:
        from seqnorm.cli import main as command
    except ModuleNotFoundError as error:
        missing = (error.name or "").partition(".")[0]
        if missing not in TRAINING_EXTRA:
            raise
        print(
            f"seqnorm: error: the command needs the training extra ({missing} is not installed): "
            "pip install 'seqnorm[train]'",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    command(args)
