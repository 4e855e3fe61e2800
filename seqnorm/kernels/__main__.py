"""``python -m seqnorm.kernels``: compile seqnorm's C++ kernels for this machine (once; later runs find the build).

A build that fails its check (a truncated or replaced library, one for another torch, a half-built folder) is built
again; ``--force`` builds again in any case.

Without a compiler, or when the build fails, it says so and exits 0 — the layers then run their plain-PyTorch path
(``--strict``: exit 1 instead). ``make venv`` runs it; elsewhere the first layer that needs the kernels builds them,
and this command builds them ahead of time (a Docker image, a cluster's login node) or retries a build that failed.
"""

from __future__ import annotations

import argparse
import sys
import time

from seqnorm import kernels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m seqnorm.kernels", description=__doc__.splitlines()[0].replace("``", "")
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when the kernels cannot be built")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands and output")
    parser.add_argument("--force", action="store_true", help="build again even where a build passes its check")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        path = kernels.build(verbose=args.verbose, force=args.force)
    except Exception as error:  # any compiler or toolchain failure: the plain path still works
        print(f"seqnorm.kernels: not built ({type(error).__name__}: {error}); the plain-PyTorch path will run.")
        return 1 if args.strict else 0
    print(f"seqnorm.kernels: {path} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
