"""Where a training step's time goes: the forward with a gradient, the backward, and the forward without one, each
as a ratio to torch.nn's fused layer in the same rounds (issue 14).

``bench.py`` times whole training steps; this splits them, so that a machine where a ratio moves shows which half
moved. Each round runs every variant once, in turn, on the same input (``bench.py``'s interleaving): the forward of
``output.sum()`` with autograd recording, its backward, then the forward under ``torch.no_grad()``. Printed as a
Markdown table, ``median (lowest–highest)`` of the rounds' ratios, with the CPU named.

Usage: ``python scripts/bench_phases.py --sizes 100x32x128x256,100x64x256x512 --cells lstm,gru --norms layer,batch``.
"""

from __future__ import annotations

import statistics
import time
from datetime import date

import torch
from bench import LAYERS, TORCH_LAYERS, ab_arguments, cpu_name, parse_sizes, ratio
from torch import nn

import seqnorm

PHASES = ("forward", "backward", "no-grad forward")


def phases(module: nn.Module, x: torch.Tensor) -> tuple[float, float, float]:
    """Seconds of one forward with a gradient, its backward, and one forward without a gradient."""
    for param in module.parameters():
        param.grad = None
    x.grad = None
    start = time.perf_counter()
    output, _ = module(x)
    loss = output.sum()
    forward = time.perf_counter()
    loss.backward()
    backward = time.perf_counter()
    with torch.no_grad():
        module(x)
    return forward - start, backward - forward, time.perf_counter() - backward


def split(variants: dict[str, nn.Module], x: torch.Tensor, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Per phase, every round's seconds of each variant, after one warm-up round."""
    for module in variants.values():
        phases(module, x)
    times: dict[str, dict[str, list[float]]] = {phase: {name: [] for name in variants} for phase in PHASES}
    for _ in range(repeats):
        for name, module in variants.items():
            for phase, seconds in zip(PHASES, phases(module, x), strict=True):
                times[phase][name].append(seconds)
    return times


def main() -> None:
    args = ab_arguments(__doc__.splitlines()[0], cells="lstm,gru", norms="layer,rms,batch", repeats=9)
    print(f"{cpu_name()}; torch {torch.__version__}, {args.threads} threads; compiled kernels: ", end="")
    print(f"{seqnorm.kernels.status()}; {date.today()}; median (lowest–highest) of {args.repeats} interleaved rounds'")
    print(f"ratios to torch's layer; training input {'with' if args.input_grad else 'without'} gradient\n")
    print("| cell TxBxIxH | norm | torch ms (" + " / ".join(PHASES) + ") | " + " | ".join(PHASES) + " |")
    print("|---|---|---:|" + "---:|" * len(PHASES))
    for steps, batch, input_size, hidden in parse_sizes(args.sizes):
        x = torch.randn(steps, batch, input_size).requires_grad_(args.input_grad)
        for kind in args.cells.split(","):
            variants: dict[str, nn.Module] = {"torch": TORCH_LAYERS[kind](input_size, hidden)}
            for norm in args.norms.split(","):
                torch.manual_seed(0)
                variants[norm] = LAYERS[kind](input_size, hidden, norm=norm)
            times = split(variants, x, args.repeats)
            torch_ms = " / ".join(f"{1e3 * statistics.median(times[phase]['torch']):.1f}" for phase in PHASES)
            label = f"{kind} {steps}x{batch}x{input_size}x{hidden}"
            for norm in args.norms.split(","):
                cells = " | ".join(ratio(times[phase], norm, "torch") for phase in PHASES)
                print(f"| {label} | {norm} | {torch_ms} | {cells} |")


if __name__ == "__main__":
    main()
