"""First calls against steady ones, seqnorm's layers beside torch.nn's in the same process (issue 14: "no first-call
pause in the default path once set up").

Three situations where something is prepared on first use, each printed as one Markdown row per norm with ms per
call: the first call(s), the same calls once prepared, and torch's counterpart measured alike.

- **new batch sizes**: training steps (forward + backward of ``output.sum()``, the input requiring a gradient) at
  ``--batches`` batch sizes the process has not run yet, then the same sizes again; ``torch.nn.LSTM`` interleaved,
  step by step. The first pass's median and worst against the second's median.
- **a fresh layer's generation steps**: a new layer's ``step()`` (batch size 1, ``no_grad``, eval mode) against a new
  ``torch.nn.LSTMCell`` of the same size: the first step, the worst of the next ``--steps``, and the median of the
  ``--steps`` after those.
- **sampling between training steps**: ``--cycles`` times a training step with an optimizer update, then ``step()``
  ``--steps`` times; the first ``step()`` after each update (the cached step is rebuilt: the weights changed) against
  the steady ones; torch's cell alike (it caches nothing).

A process chooses each matmul route and weight layout once per shape (``seqnorm/csrc/product.h``,
``seqnorm.kernels.cpu.LayoutChoice``), so the three use shapes that no other part of the run uses.

Usage: ``python scripts/bench_first_calls.py`` (``--norms layer,batch``, ``--threads 2``; ``--quick``: tiny sizes).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from datetime import date

import torch
from bench import cpu_name, training_step
from torch import nn

import seqnorm


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return 1e3 * (time.perf_counter() - start)


def new_batch_sizes(args: argparse.Namespace, norm: str, size: tuple[int, int, int, int]) -> str:
    steps, input_size, hidden, batch = size
    ours, theirs = seqnorm.LSTM(input_size, hidden, norm=norm), nn.LSTM(input_size, hidden)
    warm = torch.randn(steps, batch + 1, input_size, requires_grad=True)
    for _ in range(3):
        training_step(ours, warm)()
        training_step(theirs, warm)()
    passes: dict[str, list[list[float]]] = {"ours": [], "torch": []}
    for _ in range(2):
        times: dict[str, list[float]] = {"ours": [], "torch": []}
        for rows in range(batch, batch - args.batches, -1):
            x = torch.randn(steps, rows, input_size, requires_grad=True)
            times["ours"].append(timed(training_step(ours, x)))
            times["torch"].append(timed(training_step(theirs, x)))
        for name, samples in times.items():
            passes[name].append(samples)
    cells = [
        f"{statistics.median(first):.1f} (worst {max(first):.1f}) | {statistics.median(again):.1f}"
        for first, again in (passes["ours"], passes["torch"])
    ]
    sizes = f"T={steps} B={batch}..{batch - args.batches + 1} I={input_size} H={hidden}"
    return f"| training steps at new batch sizes, {sizes} | {norm} | " + " | ".join(cells) + " |"


def fresh_generation(args: argparse.Namespace, norm: str, size: tuple[int, int]) -> str:
    input_size, hidden = size
    layer, cell = seqnorm.LSTM(input_size, hidden, norm=norm).eval(), nn.LSTMCell(input_size, hidden)
    x = torch.randn(1, input_size)
    with torch.no_grad():
        state = None
        ours = []
        for _ in range(1 + 2 * args.steps):
            start = time.perf_counter()
            _, state = layer.step(x, state)
            ours.append(1e3 * (time.perf_counter() - start))
        pair = None
        theirs = []
        for _ in range(1 + 2 * args.steps):
            start = time.perf_counter()
            pair = cell(x, pair)
            theirs.append(1e3 * (time.perf_counter() - start))
    cells = [
        f"{times[0]:.2f}; next {args.steps} worst {max(times[1 : 1 + args.steps]):.2f} | "
        f"{statistics.median(times[1 + args.steps :]):.3f}"
        for times in (ours, theirs)
    ]
    return f"| a fresh layer's generation steps, I={input_size} H={hidden} | {norm} | " + " | ".join(cells) + " |"


def sampling_between_updates(args: argparse.Namespace, norm: str, size: tuple[int, int]) -> str:
    input_size, hidden = size
    layer, cell = seqnorm.LSTM(input_size, hidden, norm=norm), nn.LSTMCell(input_size, hidden)
    optimizers = [torch.optim.SGD(module.parameters(), lr=1e-3) for module in (layer, cell)]
    batch = torch.randn(20, 8, input_size, requires_grad=True)
    x = torch.randn(1, input_size)
    first: dict[str, list[float]] = {"ours": [], "torch": []}
    steady: dict[str, list[float]] = {"ours": [], "torch": []}
    for _ in range(args.cycles):
        layer.train()
        training_step(layer, batch)()
        cell.zero_grad()
        cell(batch[0])[0].sum().backward()
        for optimizer in optimizers:
            optimizer.step()
        layer.eval()
        with torch.no_grad():
            state, pair = None, None
            for index in range(args.steps):
                start = time.perf_counter()
                _, state = layer.step(x, state)
                middle = time.perf_counter()
                pair = cell(x, pair)
                end = time.perf_counter()
                for name, spent in (("ours", middle - start), ("torch", end - middle)):
                    (first if index == 0 else steady)[name].append(1e3 * spent)
    cells = [
        f"{statistics.median(first[name]):.3f} (worst {max(first[name]):.3f}) | {statistics.median(steady[name]):.3f}"
        for name in ("ours", "torch")
    ]
    return (
        f"| first step() after each of {args.cycles} updates, I={input_size} H={hidden} | {norm} | "
        + " | ".join(cells)
        + " |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--norms", default="layer,batch", help="norms to measure, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, default=8, help="new batch sizes per norm")
    parser.add_argument("--steps", type=int, default=64, help="generation steps per phase")
    parser.add_argument("--cycles", type=int, default=6, help="training updates, each followed by sampling")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: seconds, for a smoke test")
    args = parser.parse_args()
    if min(args.batches, args.steps, args.cycles) < 1:
        parser.error("--batches, --steps and --cycles must be at least 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    # Sizes no other row uses (a shape's route and layout are chosen once per process): TxIxH and the largest batch
    # of the first norm's new batch sizes (the next norm's lie above them).
    train_size = (5, 6, 7, 12) if args.quick else (20, 256, 512, 63)
    generation = (6, 10) if args.quick else (512, 1024)
    sampling = (7, 11) if args.quick else (256, 512)
    print(f"{cpu_name()}; torch {torch.__version__}, {args.threads} threads; {date.today()}; ms per call")
    print(f"kernels: {seqnorm.kernels.status()}\n")
    print("| what | norm | seqnorm: first | seqnorm: prepared | torch: first | torch: prepared |")
    print("|---|---|---|---:|---|---:|")
    norms = args.norms.split(",")
    for index, norm in enumerate(norms):
        top = train_size[3] + index * (args.batches + 1)
        print(new_batch_sizes(args, norm, (*train_size[:3], top)), flush=True)
    for index, norm in enumerate(norms):
        print(fresh_generation(args, norm, (generation[0], generation[1] - index)), flush=True)
    for norm in norms:
        print(sampling_between_updates(args, norm, sampling), flush=True)


if __name__ == "__main__":
    main()
