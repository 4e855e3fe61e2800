"""How many torch threads `seqnorm fit` should use: the same short run with 1 and 2 threads, interleaved.

Each run is a fresh ``python -m seqnorm.cli fit`` process on the embedded corpus (``configs/embedded_lm.yaml``,
no validation, no progress bar) whose thread count is set through ``OMP_NUM_THREADS``, which the CLI respects.
The variants alternate within each repeat, so a change in the machine's load hits both alike. Prints a Markdown
table of the wall-clock seconds per run (start-up included: the same for every variant) and the median.

    python scripts/bench_cli_threads.py --steps 300 --repeats 3 --hidden 128 512
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_once(hidden: int, threads: int, steps: int) -> float:
    """Seconds of one ``seqnorm fit`` process with ``threads`` torch threads."""
    command = [sys.executable, "-m", "seqnorm.cli", "fit", "--config", str(ROOT / "configs" / "embedded_lm.yaml")]
    command += ["--model.hidden_size", str(hidden), "--trainer.max_steps", str(steps)]
    command += ["--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false"]
    command += ["--trainer.enable_model_summary", "false"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    env.pop("SEQNORM_THREADS", None)
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        subprocess.run(command, cwd=folder, env=env, check=True, capture_output=True)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, nargs="+", default=[128])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), "?")
    print(f"{cpu}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; {platform.python_version()}")
    times: dict[tuple[int, int], list[float]] = {(h, t): [] for h in args.hidden for t in args.threads}
    for _ in range(args.repeats):
        for hidden in args.hidden:
            for threads in args.threads:
                times[hidden, threads].append(run_once(hidden, threads, args.steps))
                print(f"hidden {hidden}, {threads} thread(s): {times[hidden, threads][-1]:.1f} s", flush=True)
    print(f"\n| hidden | threads | seconds per {args.steps}-step run | median |\n|---|---|---|---|")
    for (hidden, threads), values in times.items():
        runs = ", ".join(f"{value:.1f}" for value in values)
        print(f"| {hidden} | {threads} | {runs} | {statistics.median(values):.1f} |")


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


if __name__ == "__main__":
    main()
