"""The ``seqnorm`` command (:mod:`seqnorm.cli.entry` is its entry point), one module per concern.

- :mod:`~seqnorm.cli.commands`: what it answers without Lightning: ``--version``, the top-level ``--help``, ``configs``
- :mod:`~seqnorm.cli.app`: LightningCLI's ``fit``, ``validate``, ``test``, ``predict``, and ``generate``
  (:class:`SeqnormCLI`, :func:`main`)
- :mod:`~seqnorm.cli.checks`: what it checks before it runs (flags against ``--ckpt_path``, the log folder, errors)
- :mod:`~seqnorm.cli.flags`: "did you mean" for a mistyped flag
- :mod:`~seqnorm.cli.output`: what it prints (error text in command-line words, generated text, quieted warnings)
- :mod:`~seqnorm.cli.runs`: a run's name, folder and logger
- :mod:`~seqnorm.cli.threads`: how many torch threads a run uses
- :mod:`~seqnorm.cli.trainer`: the Trainer settings it adjusts (checkpointing, progress bar)

The names below come from :mod:`seqnorm.cli.app` on first use: importing ``seqnorm.cli.commands`` (all that
``seqnorm --help`` needs) must not import Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from seqnorm.cli.app import SIGTERM_EXIT_CODE, SeqnormCLI, generate, main

__all__ = ["SIGTERM_EXIT_CODE", "SeqnormCLI", "generate", "main"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from seqnorm.cli import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
