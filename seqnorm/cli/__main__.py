"""``python -m seqnorm.cli``: the ``seqnorm`` command, as ``python -m seqnorm`` and the console script run it."""

from seqnorm.cli.entry import main

if __name__ == "__main__":
    main()
