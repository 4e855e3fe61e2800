"""``python -m seqnorm``, and the ``seqnorm`` console script: the command's entry point, :func:`seqnorm.cli.entry.main`
(kept in :mod:`seqnorm.cli`, so that the command's package does not import this module back)."""

from seqnorm.cli.entry import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
