"""Issue 14's targets over several fresh processes of ``bench.py``: whether each held in each process, and the LSTM
training-step ratios behind them, as the Markdown tables BENCHMARKS.md records, with the CPU named.

A process's ratios depend on the process as well as on the code: which matmul route its first products measured
fastest (``product.h``), where its allocations landed, what the machine's neighbours did meanwhile. One run of
``bench.py`` therefore says little about whether a target holds on a kind of machine; this runs it ``--processes``
times in a row, each in a fresh interpreter, and puts the worst median ratio per target side by side. Each process's
full ``bench.py`` output is kept in ``--out``.

Usage: ``python scripts/bench_targets.py`` (three processes of the issue's sizes: ``make bench-targets``), or
``--processes 4 --repeats 9``; options it does not know are handed to ``bench.py`` (``--sizes``, ``--cells``, ...).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from bench import DEFAULT_SIZES, TARGETS, Measured, Target, cpu_name, mark, worst_row

BENCH = Path(__file__).resolve().parent / "bench.py"
DEFAULT_BENCH_ARGS = ("--sizes", DEFAULT_SIZES, "--no-reference", "--no-plain", "--threads", "2")


@dataclass(frozen=True)
class Process:
    """What one ``bench.py`` process measured, and the matmul route it chose per product shape."""

    measured: list[Measured]
    routes: dict[str, str]


def run_process(bench_args: Sequence[str], out: Path, number: int) -> Process:
    """One fresh ``bench.py`` process: its output into ``out/process-N.md``, what it measured returned."""
    record = out / f"process-{number}.json"
    output = out / f"process-{number}.md"
    with open(output, "w", encoding="utf-8") as log:
        done = subprocess.run([sys.executable, str(BENCH), *bench_args, "--json", str(record)], stdout=log)
    if done.returncode != 0:
        raise SystemExit(
            f"bench_targets.py: bench.py failed in process {number} (exit {done.returncode}; see {output})"
        )
    result = json.loads(record.read_text(encoding="utf-8"))
    return Process([Measured(**row) for row in result["measured"]], result["routes"])


def targets_table(runs: list[list[Measured]], targets: Sequence[Target] = TARGETS) -> list[str]:
    """Per target: its bound, each process's worst median ratio with ✓ or ✗, and in how many processes it held."""
    numbers = range(1, len(runs) + 1)
    lines = [
        "| target | bound | " + " | ".join(f"process {n}" for n in numbers) + " | held in |",
        "|---|---|" + "---|" * len(runs) + "---|",
    ]
    for target in targets:
        worst = [worst_row(measured, target)[0] for measured in runs]
        cells = [f"{row.ratio:.3f} {mark(row.ratio, target)}" if row else "not measured" for row in worst]
        measured = [row for row in worst if row is not None]
        held = sum(target.holds(row.ratio) for row in measured)
        tally = f"{held} of {len(measured)}" if measured else "-"
        lines.append(f"| {target.name} | ≤ {target.bound} | " + " | ".join(cells) + f" | {tally} |")
    return lines


def training_table(runs: list[list[Measured]], cell: str) -> list[str]:
    """Per size of ``cell`` (``"lstm"``, ``"gru"``): torch's step in ms and each norm's median ratio, process by
    process (``a / b / c``)."""
    rows = [
        [row for row in measured if row.what == "training" and row.where.startswith(f"{cell} ")] for measured in runs
    ]
    sizes = list(dict.fromkeys(row.where for measured in rows for row in measured))
    norms = list(dict.fromkeys(row.norm for measured in rows for row in measured))
    if not sizes:
        return []
    lines = [f"| {cell.upper()} size | torch ms | " + " | ".join(norms) + " |", "|---|---|" + "---|" * len(norms)]
    for size in sizes:
        here = [{row.norm: row for row in measured if row.where == size} for measured in rows]
        torch_ms = " / ".join(
            f"{1e3 * next(iter(by_norm.values())).torch_seconds:.1f}" if by_norm else "-" for by_norm in here
        )
        ratios = [" / ".join(f"{by_norm[n].ratio:.2f}" if n in by_norm else "-" for by_norm in here) for n in norms]
        lines.append(f"| {size.split(' ', 1)[1]} | {torch_ms} | " + " | ".join(ratios) + " |")
    return lines


def routes_table(processes: list[Process]) -> list[str]:
    """Per product shape: the route each process chose (``-`` where it ran no such product)."""
    shapes = list(dict.fromkeys(shape for process in processes for shape in process.routes))
    if not shapes:
        return []
    numbers = range(1, len(processes) + 1)
    lines = [
        "| rows × K × N (threads) | " + " | ".join(f"process {n}" for n in numbers) + " |",
        "|---|" + "---|" * len(processes),
    ]
    for shape in shapes:
        lines.append(f"| {shape} | " + " | ".join(process.routes.get(shape, "-") for process in processes) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=3, help="fresh bench.py processes, one after another")
    parser.add_argument("--repeats", type=int, default=7, help="bench.py's interleaved rounds per process")
    parser.add_argument(
        "--out", type=Path, default=Path("results/bench_targets"), help="where each process's output goes"
    )
    args, extra = parser.parse_known_args()
    if args.processes < 1:
        parser.error(f"--processes: expected at least 1, got {args.processes}")
    bench_args = [*DEFAULT_BENCH_ARGS, "--repeats", str(args.repeats), *extra]  # later options win in argparse
    args.out.mkdir(parents=True, exist_ok=True)
    processes = []
    for number in range(1, args.processes + 1):
        print(f"process {number} of {args.processes} ...", file=sys.stderr, flush=True)
        processes.append(run_process(bench_args, args.out, number))
    runs = [process.measured for process in processes]
    command = shlex.join(["python", "scripts/bench.py", *bench_args])
    print(f"{cpu_name()}; {date.today().isoformat()}; {args.processes} processes of `{command}`, one after another")
    print(f"(each process's output: {args.out}/process-N.md)\n")
    print("### Issue 14's targets, process by process (the worst median ratio of the rows each covers)\n")
    print("\n".join(targets_table(runs)))
    for cell in ("lstm", "gru"):
        lines = training_table(runs, cell)
        if lines:
            print(f"\n### {cell.upper()} training step, median ratio to torch's layer, process by process\n")
            print("\n".join(lines))
    lines = routes_table(processes)
    if lines:
        print("\n### The per-step matmul route each process measured fastest, per product shape\n")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
