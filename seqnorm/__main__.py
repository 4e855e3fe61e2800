"""The ``seqnorm`` command (also ``python -m seqnorm``): :func:`seqnorm.cli.main`, once the training extra is there.

A base install (``pip install seqnorm``, the library alone) has the command too; without Lightning and jsonargparse
it said so with a traceback from ``seqnorm.cli``'s imports.
"""

from __future__ import annotations

import sys

TRAINING_EXTRA = ("lightning", "jsonargparse", "tensorboard", "pooch", "rich", "matplotlib", "torchmetrics")
"""Top-level packages of the ``train`` extra (and what they bring) that the command imports."""


def main() -> None:
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
    command()


if __name__ == "__main__":
    main()
