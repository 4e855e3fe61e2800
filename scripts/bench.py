"""Speed and memory of seqnorm's layers against torch.nn's LSTM/GRU and against seqnorm's own reference loop.

Everything is measured in one process, interleaved (every repeat runs every variant once, in turn, on the same
inputs) and summarized by the median, so a load that comes and goes touches all variants alike. Printed as Markdown
tables, ready for BENCHMARKS.md:

- **training step**: forward + backward of ``output.sum()`` for a ``(T, B, I)`` input that requires a gradient (as an
  embedding's output or a lower layer's does; ``--no-input-grad``: parameters only, as runs before 2026-11-25
  measured); ms, tokens/s (``T*B`` per step) and the ratio to ``torch.nn.LSTM``/``GRU``. ``reference ×`` is the same
  layer with ``impl="reference"``: the straightforward per-step Python loop over the normalized cell.
- **activation memory**: bytes of the tensors autograd saves for backward during one forward (every saved tensor's
  storage counted once, parameters excluded), via ``torch.autograd.graph.saved_tensors_hooks``. On a CPU this is the
  memory a training step holds between forward and backward, the part that grows with ``T`` and ``B``; process-level
  peaks (RSS) are dominated by the allocator and would not separate the variants.
- **generation step**: batch size 1, ``no_grad``, eval mode, one ``layer.step()`` against one ``torch.nn.LSTMCell``
  (``GRUCell``) call; µs per step.
- **against issue 14's targets**: for each target (:data:`TARGETS`), the worst median ratio among the rows it covers
  and where, ✓ within the bound, ✗ above it, or "not measured" when no row covers it (a size with batch 1 for the
  batch-1 training target, say).
- **routes**: the per-step matmul route the compiled kernels measured fastest for each product shape in this process
  (``product.h``); a process that chose a slow one reads worse at that size.

``--json FILE`` also writes the measured ratios (with torch's times) and the routes, for ``bench_targets.py``, which
runs this script in several fresh processes and puts them side by side (``make bench-targets``).

``× torch`` is the median over the repeats of each round's ratio to that round's torch time, with its spread (lowest
and highest round) beside it; ``plain ×`` is the same layer with the compiled kernels switched off
(``seqnorm.kernels.disabled()``: the plain-PyTorch loop over the cell's step), the fallback where nothing is built.
The header names the CPU (``/proc/cpuinfo``), torch, the thread count and whether the kernels ran.

Usage: ``python scripts/bench.py`` (the sizes of issue 7), ``--quick`` (seconds), ``--sizes 100x32x128x256,...``,
``--cells lstm``, ``--norms layer,batch``, ``--repeats 7``, ``--threads 2``, ``--no-reference`` (skip the slow loop),
``--no-plain`` (skip the plain-PyTorch path).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

import torch
from torch import nn

import seqnorm

TORCH_LAYERS: dict[str, type[nn.Module]] = {"lstm": nn.LSTM, "gru": nn.GRU}
TORCH_CELLS: dict[str, type[nn.Module]] = {"lstm": nn.LSTMCell, "gru": nn.GRUCell}
LAYERS: dict[str, type[seqnorm.layers.RecurrentLayer]] = {"lstm": seqnorm.LSTM, "gru": seqnorm.GRU}
DEFAULT_SIZES = "100x32x128x256,100x64x256x512,50x16x512x1024,100x1x128x256"
QUICK_SIZES = "20x8x32x64,20x1x32x64"


@dataclass(frozen=True)
class Measured:
    """One measured ratio to torch: ``what`` is "training", "memory" (activation memory) or "generation"."""

    what: str
    where: str  # the row's cell and size, as in its table
    batch: int
    norm: str
    ratio: float
    torch_seconds: float = 0.0  # torch's median for the row's size (a step, or a generation step; none for memory)


@dataclass(frozen=True)
class Target:
    """A bound on the median ratio to torch of the rows of ``what`` with one of ``norms`` (and batch size 1 or not)."""

    name: str
    what: str
    norms: tuple[str, ...]
    bound: float
    batch_one: bool | None = None  # True: batch-1 rows only; False: the others; None: any

    def holds(self, ratio: float) -> bool:
        """Whether a median ratio meets the target (at or below its bound)."""
        return ratio <= self.bound

    def covers(self, row: Measured) -> bool:
        return (
            row.what == self.what
            and row.norm in self.norms
            and (self.batch_one is None or (row.batch == 1) == self.batch_one)
        )


# Issue 14's targets, for the norms its kernels run.
KERNEL_NORMS = ("layer", "rms", "batch", "batch_renorm")
TARGETS = (
    Target("training step, LayerNorm (LSTM, GRU)", "training", ("layer",), 1.15, batch_one=False),
    Target("training step, RMSNorm", "training", ("rms",), 1.15, batch_one=False),
    Target("training step, per-timestep BN", "training", ("batch",), 1.25, batch_one=False),
    Target("training step, batch renormalization", "training", ("batch_renorm",), 1.4, batch_one=False),
    Target("training step at batch size 1 (layer, rms)", "training", ("layer", "rms"), 1.5, batch_one=True),
    Target("generation step vs torch's cell", "generation", KERNEL_NORMS, 1.1),
    Target("activation memory", "memory", KERNEL_NORMS, 1.2),
)


def worst_row(measured: list[Measured], target: Target) -> tuple[Measured | None, int]:
    """The covered row with the highest median ratio (``None`` if none is covered), and how many rows are covered."""
    covered = [row for row in measured if target.covers(row)]
    return (max(covered, key=lambda row: row.ratio) if covered else None), len(covered)


def mark(ratio: float, target: Target) -> str:
    return "✓" if target.holds(ratio) else "✗"


def target_rows(measured: list[Measured], targets: tuple[Target, ...] = TARGETS) -> list[str]:
    """One Markdown row per target: its bound, the worst median ratio among the rows it covers and where, ✓ or ✗."""
    rows = []
    for target in targets:
        worst, count = worst_row(measured, target)
        if worst is None:
            rows.append(f"| {target.name} | ≤ {target.bound} | not measured | |")
            continue
        where = f"{worst.where}, {worst.norm}; {count} rows"
        rows.append(f"| {target.name} | ≤ {target.bound} | {worst.ratio:.3f} ({where}) | {mark(worst.ratio, target)} |")
    return rows


def add_input_grad_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input-grad",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="training steps also compute the input's gradient, as under an embedding or in a stack's upper layers "
        "(default; runs of before 2026-11-25 did not: --no-input-grad)",
    )


def ab_arguments(description: str, *, cells: str, norms: str, repeats: int) -> argparse.Namespace:
    """The options of the A/B scripts (``bench_phases.py``, ``bench_routes.py``), with their defaults; sets torch's
    thread count to ``--threads``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--sizes", default="100x32x128x256,100x64x256x512", help="TxBxIxH[,TxBxIxH...]")
    parser.add_argument("--cells", default=cells, help="lstm,gru")
    parser.add_argument("--norms", default=norms, help="norms to measure")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--threads", type=int, default=2)
    add_input_grad_option(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


def parse_sizes(text: str) -> list[tuple[int, int, int, int]]:
    sizes = []
    for item in text.split(","):
        parts = [int(part) for part in item.lower().split("x")]
        if len(parts) != 4:
            raise SystemExit(f"bench.py: expected sizes as TxBxIxH[,TxBxIxH...], got {item!r}")
        sizes.append((parts[0], parts[1], parts[2], parts[3]))
    return sizes


def training_step(module: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        for param in module.parameters():
            param.grad = None
        x.grad = None  # with --input-grad the backward computes it, as under an embedding or a lower layer
        output, _ = module(x)
        output.sum().backward()

    return run


def saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward during one forward (parameters excluded)."""
    params = {param.untyped_storage().data_ptr() for param in module.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output, _ = module(x)
    del output
    return sum(storages.values())


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def interleaved(variants: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Seconds of every call of each variant; one warm-up call each, then ``repeats`` rounds in turn."""
    for run in variants.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times


def round_ratios(times: dict[str, list[float]], name: str, base: str) -> list[float]:
    """Each round's ratio of ``name`` to ``base``, sorted."""
    return sorted(value / reference for value, reference in zip(times[name], times[base], strict=True))


def ratio(times: dict[str, list[float]], name: str, base: str) -> str:
    """``median (lowest–highest)`` of the per-round ratios of ``name`` to ``base``."""
    rounds = round_ratios(times, name, base)
    return f"{statistics.median(rounds):.2f} ({rounds[0]:.2f}–{rounds[-1]:.2f})"


def median_ratio(times: dict[str, list[float]], name: str, base: str) -> float:
    """The median of the per-round ratios of ``name`` to ``base`` (what :func:`ratio` prints first)."""
    return statistics.median(round_ratios(times, name, base))


def plain(run: Callable[[], None]) -> Callable[[], None]:
    """``run`` with the compiled kernels switched off."""

    def without_kernels() -> None:
        with seqnorm.kernels.disabled():
            run()

    return without_kernels


def bench_training(args: argparse.Namespace, size: tuple[int, int, int, int], measured: list[Measured]) -> list[str]:
    steps, batch, input_size, hidden = size
    rows = []
    for kind in args.cells:
        torch.manual_seed(0)
        x = torch.randn(steps, batch, input_size).requires_grad_(args.input_grad)
        baseline = TORCH_LAYERS[kind](input_size, hidden)
        variants = {"torch": training_step(baseline, x)}
        memory = {"torch": saved_bytes(baseline, x)}
        layers = {}
        for norm in args.norms:
            if batch < 2 and seqnorm.NORMS[norm].batch_statistics:
                continue  # per-timestep batch statistics cannot train at batch size 1
            layer = LAYERS[kind](input_size, hidden, norm=norm)
            layers[norm] = layer
            variants[norm] = training_step(layer, x)
            memory[norm] = saved_bytes(layer, x)
            if args.plain:
                variants[f"{norm}/plain"] = plain(training_step(layer, x))
            if args.reference:
                reference = LAYERS[kind](input_size, hidden, norm=norm, impl="reference")
                reference.load_state_dict(layer.state_dict())
                variants[f"{norm}/reference"] = training_step(reference, x)
        times = interleaved(variants, args.repeats)
        seconds = {name: statistics.median(values) for name, values in times.items()}
        base = seconds["torch"]
        tokens = steps * batch
        label = f"{kind} {steps}x{batch}x{input_size}x{hidden}"
        rows.append(
            f"| {label} | torch.nn.{TORCH_LAYERS[kind].__name__} | {base * 1e3:.1f} | {tokens / base:,.0f} | 1.00 | "
            f"| | 1.00 |"
        )
        for norm in layers:
            measured.append(Measured("training", label, batch, norm, median_ratio(times, norm, "torch"), base))
            measured.append(Measured("memory", label, batch, norm, memory[norm] / memory["torch"]))
            plain_ratio = ratio(times, f"{norm}/plain", "torch") if args.plain else "-"
            reference_ratio = ratio(times, f"{norm}/reference", "torch") if args.reference else "-"
            rows.append(
                f"| {label} | {norm} | {seconds[norm] * 1e3:.1f} | {tokens / seconds[norm]:,.0f} | "
                f"{ratio(times, norm, 'torch')} | {plain_ratio} | {reference_ratio} | "
                f"{memory[norm] / memory['torch']:.2f} |"
            )
    return rows


def bench_generation(args: argparse.Namespace, size: tuple[int, int, int, int], measured: list[Measured]) -> list[str]:
    _, _, input_size, hidden = size
    rows = []
    for kind in args.cells:
        torch.manual_seed(0)
        x = torch.randn(1, input_size)
        cell = TORCH_CELLS[kind](input_size, hidden).eval()
        zeros = torch.zeros(1, hidden)
        cell_state = (zeros, zeros) if kind == "lstm" else zeros

        def torch_steps(cell: nn.Module = cell, cell_state: object = cell_state, x: torch.Tensor = x) -> None:
            state = cell_state
            for _ in range(args.generation_steps):
                state = cell(x, state)

        variants = {"torch": torch_steps}
        for norm in args.norms:
            layer = LAYERS[kind](input_size, hidden, norm=norm).eval()

            def seqnorm_steps(layer: seqnorm.layers.RecurrentLayer = layer, x: torch.Tensor = x) -> None:
                state = None
                for _ in range(args.generation_steps):
                    _, state = layer.step(x, state)

            variants[norm] = seqnorm_steps
            if args.plain:
                # A copy: the same layer would rebuild its cached step whenever the switch flips between variants.
                other = copy.deepcopy(layer)

                def plain_steps(layer: seqnorm.layers.RecurrentLayer = other, x: torch.Tensor = x) -> None:
                    state = None
                    for _ in range(args.generation_steps):
                        _, state = layer.step(x, state)

                variants[f"{norm}/plain"] = plain(plain_steps)
        with torch.no_grad():
            times = interleaved(variants, args.repeats)
        per_step = {name: statistics.median(values) / args.generation_steps for name, values in times.items()}
        base = per_step["torch"]
        label = f"{kind} I={input_size} H={hidden}"
        rows.append(f"| {label} | torch.nn.{TORCH_CELLS[kind].__name__} | {base * 1e6:.0f} | 1.00 | |")
        for norm in args.norms:
            measured.append(Measured("generation", label, 1, norm, median_ratio(times, norm, "torch"), base))
            plain_ratio = ratio(times, f"{norm}/plain", "torch") if args.plain else "-"
            rows.append(
                f"| {label} | {norm} | {per_step[norm] * 1e6:.0f} | {ratio(times, norm, 'torch')} | {plain_ratio} |"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"small sizes ({QUICK_SIZES}), 2 repeats")
    parser.add_argument("--sizes", default=None, help=f"TxBxIxH, comma-separated (default {DEFAULT_SIZES})")
    parser.add_argument("--cells", default="lstm,gru", help="lstm,gru")
    parser.add_argument("--norms", default=",".join(seqnorm.NORMS), help="norms to measure")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 5, quick 2)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for every variant")
    parser.add_argument(
        "--generation-steps", type=int, default=200, help="steps per generation measurement (0: no generation table)"
    )
    add_input_grad_option(parser)
    parser.add_argument("--no-reference", dest="reference", action="store_false", help="skip the reference loop")
    parser.add_argument("--no-plain", dest="plain", action="store_false", help="skip the plain-PyTorch path")
    parser.add_argument("--json", type=Path, default=None, help="also write the measured ratios to this file")
    args = parser.parse_args()
    args.sizes = parse_sizes(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES))
    args.cells = args.cells.split(",")
    args.norms = args.norms.split(",")
    args.repeats = args.repeats or (2 if args.quick else 5)
    if args.generation_steps < 0:
        parser.error(f"--generation-steps: expected 0 (no generation table) or more, got {args.generation_steps}")
    if args.quick:
        args.generation_steps = min(args.generation_steps, 50)
    if args.threads:
        torch.set_num_threads(args.threads)

    print(
        f"{cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads; compiled kernels: "
        f"{seqnorm.kernels.status()}; {date.today().isoformat()}; median of {args.repeats} interleaved repeats "
        f"(spread: lowest–highest round); training input {'with' if args.input_grad else 'without'} gradient\n"
    )
    print("### Training step (forward + backward)\n")
    print(
        "| cell TxBxIxH | norm | ms | tokens/s | × torch | plain × torch | reference × torch | "
        "activation memory × torch |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    measured: list[Measured] = []
    for size in args.sizes:
        for row in bench_training(args, size, measured):
            print(row, flush=True)
    if args.generation_steps:
        print("\n### Generation step (batch size 1, `layer.step()` vs torch's cell)\n")
        print("| cell | norm | µs / step | × torch cell | plain × torch cell |")
        print("|---|---|---:|---:|---:|")
        for size in {(1, 1, s[2], s[3]): None for s in args.sizes}:
            for row in bench_generation(args, size, measured):
                print(row, flush=True)
    print(f"\n### Against issue 14's targets ({cpu_name()}; the worst median ratio of the rows each covers)\n")
    print("| target | bound | worst median ratio (where; rows) | |")
    print("|---|---|---|---|")
    for row in target_rows(measured):
        print(row)
    routes = chosen_routes()
    if routes:
        print("\n### The per-step matmul routes this process measured fastest (`product.h`)\n")
        print("| rows × K × N (threads) | route |")
        print("|---|---|")
        for shape, route in routes.items():
            print(f"| {shape} | {route} |")
    if args.json is not None:
        header = {"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads()}
        record = {**header, "kernels": seqnorm.kernels.status(), "routes": routes}
        record["measured"] = [asdict(row) for row in measured]
        args.json.write_text(json.dumps(record, indent=1), encoding="utf-8")


def chosen_routes() -> dict[str, str]:
    """The compiled kernels' measured route per product shape in this process (none without the kernels)."""
    kernels = seqnorm.kernels.native("cpu")
    if kernels is None:
        return {}
    return {f"{rows} × {k} × {n} ({threads})": route for rows, k, n, threads, route in kernels.chosen_routes()}


if __name__ == "__main__":
    main()
