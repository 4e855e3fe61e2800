"""How many CPU threads the ``seqnorm`` command gives torch, and the one line that says so.

seqnorm's models are small recurrent networks: each time step is a handful of small matrix products, each one a
parallel region whose threads must all arrive before the next step can start. When another job holds a core, the
descheduled OpenMP worker stalls every one of them. One thread is the default: at worst 1.2-1.7x slower on an idle
machine, where two threads are several times slower on cores shared with other jobs (docs/cli.md, "CPU threads",
and ``scripts/bench_cli_threads.py``). On a machine of your own, ``--threads 2`` (or more, or 0) is faster. The
order of precedence:

1. ``--threads N`` (or ``threads: N`` in a ``--config`` file);
2. the environment variable ``SEQNORM_THREADS=N``;
3. ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` when set: torch already follows them, so they are left alone;
4. one thread.

``N = 0`` leaves torch's own setting (one thread per core, or what ``torch.set_num_threads`` set in a process that
calls :func:`seqnorm.cli.main` itself). Under a multi-process strategy (DDP on CPU) Lightning's launcher divides the
cores between the processes unless ``OMP_NUM_THREADS`` is set.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

__all__ = ["DEFAULT_THREADS", "THREADS_ENV", "THREADS_HELP", "choose_threads", "configure_threads"]

DEFAULT_THREADS = 1
"""torch threads of a run nothing else configures (module docstring: measured)."""
THREADS_ENV = "SEQNORM_THREADS"
_TORCH_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # read by torch at start-up for its intra-op thread count

THREADS_HELP = (
    f"torch CPU threads (intra-op). Default: ${THREADS_ENV} if set, else torch's own count when OMP_NUM_THREADS or "
    f"MKL_NUM_THREADS is set, else {DEFAULT_THREADS}: with the cores shared with other jobs, seqnorm's small "
    "recurrent models measured several times slower on two threads than on one (on an idle machine 1.2-1.7x "
    "faster: pass 2 or more there). 0 leaves torch's setting (one thread per core)."
)


def choose_threads(
    flag: int | None, environ: Mapping[str, str] = os.environ, *, has_flag: bool = True
) -> tuple[int | None, str]:
    """The thread count to set (``None``: leave torch's) and where it comes from, by the module's precedence
    (``has_flag=False``: the command has no ``--threads``, so the message offers only the variable)."""
    if flag is not None:
        return (flag or None), f"--threads {flag}"
    if environ.get(THREADS_ENV, "").strip():
        value = environ[THREADS_ENV].strip()
        if not value.isdigit():
            raise ValueError(
                f"{THREADS_ENV}={value}: expected a whole number of torch threads (0 leaves torch's own count); "
                f"unset it or set it to, e.g., {THREADS_ENV}=1"
            )
        return (int(value) or None), f"{THREADS_ENV}={value}"
    for name in _TORCH_ENV:
        if environ.get(name, "").strip():
            return None, f"{name}={environ[name].strip()}"
    change = f"--threads N or {THREADS_ENV}=N" if has_flag else f"{THREADS_ENV}=N"
    return DEFAULT_THREADS, (
        f"the default, steady on shared cores; {change} to change (2 or more is faster on an idle machine)"
    )


def configure_threads(flag: int | None, environ: Mapping[str, str] = os.environ, *, has_flag: bool = True) -> int:
    """Set torch's intra-op thread count as :func:`choose_threads` says, log it once, return the count in use."""
    threads, reason = choose_threads(flag, environ, has_flag=has_flag)
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    count = torch.get_num_threads()
    kept = " (torch's setting)" if threads is None else ""
    rank_zero_info(f"seqnorm: {count} torch CPU thread{'s' if count != 1 else ''}{kept}: {reason}")
    return count
