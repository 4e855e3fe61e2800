"""The Triton backend on a CUDA GPU against cuDNN's ``nn.LSTM``/``nn.GRU`` and against seqnorm's plain path.

Prints the versions and the GPU; checks the Triton backend against the plain-PyTorch path on the GPU (every cell and
norm, training and evaluation, float32 with TF32 off and float64, plus generation steps); then median milliseconds
of a training step (forward and backward of ``output.sum()``, the input requiring a gradient) at ``--size`` (T x B x
I x H, default 100x64x512x512) in three precisions — float32 with TF32 off, float32 with TF32, bf16 autocast (the
input projection and each step's product ``W_hh h`` with bf16 operands, statistics, gates and states in float32;
checked against float32 beside the plain path under autocast) — with ratios to cuDNN, to the plain path (the loop
over the cell's step with hoisted input terms) and to the reference loop (``impl="reference"``), and a batch-1
generation step against ``nn.LSTMCell``/``nn.GRUCell``. The loops' CUDA graphs (the backend's ``graphs.py``) are
checked against the same loops run eagerly, with the memory they hold, and each training step is timed with them
("seqnorm ms"), without ("no graphs ms", ``SEQNORM_CUDA_GRAPHS=0``), and without them or the direct launches ("neither
ms", also ``SEQNORM_DIRECT_LAUNCH=0``: every launch through Triton's ``kernel[grid](...)``). Markdown tables, for
BENCHMARKS.md. Without CUDA it says so and exits 0.

It needs torch, triton and seqnorm's core only (no training extras): ``PYTHONPATH=. python scripts/bench_gpu.py``
from the checkout (``make bench-gpu``). Each timing is a CUDA-event median over ``--repeats`` runs after warm-ups;
the whole run is sized to finish in a few minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import math
import os
import pstats
import statistics
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # seqnorm from this checkout

import seqnorm
from seqnorm import kernels

NORMS = ("layer", "rms", "batch")


def _median_ms(run: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@contextlib.contextmanager
def _precision(name: str) -> Iterator[None]:
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = name == "tf32"
    try:
        if name == "bf16":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                yield
        else:
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


def _training_step(layer: torch.nn.Module, x: torch.Tensor) -> Callable[[], object]:
    def run() -> object:
        output = layer(x)[0]
        output.float().sum().backward()
        return output

    return run


def _difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest difference between paired tensors, relative to each reference tensor's scale."""
    return max(((x - y).abs().max() / y.abs().max().clamp(min=1)).item() for x, y in zip(a, b, strict=True))


def _run(layer: torch.nn.Module, x: torch.Tensor, lengths: torch.Tensor, plain: bool) -> list[torch.Tensor]:
    layer.zero_grad()
    x.grad = None
    with kernels.disabled() if plain else contextlib.nullcontext():
        output, (h_n, *rest) = layer(x, lengths=lengths)
        if not layer.training:
            return [output, h_n, *rest]
        (output.sum() + h_n.square().sum()).backward()
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in layer.parameters()]
    return [output.detach(), h_n.detach(), x.grad.clone(), *grads]


def check(device: torch.device) -> tuple[list[str], float]:
    """The Triton backend against the plain path on the GPU, for every cell and norm: training (outputs, final
    states, every gradient) and evaluation, float32 (TF32 off) and float64, two bidirectional layers with lengths;
    then 20 generation steps. One line per case and the largest difference of all of them."""
    lines, worst_of_all = [], 0.0
    lengths = torch.tensor([20, 15, 20, 3, 9, 20, 1, 12])
    for kind in ("lstm", "gru"):
        for norm in seqnorm.NORMS:
            for dtype in (torch.float32, torch.float64):
                torch.manual_seed(0)
                layer = seqnorm.LAYERS[kind](32, 64, num_layers=2, bidirectional=True, norm=norm)
                layer = layer.to(device=device, dtype=dtype)
                x = torch.randn(20, 8, 32, device=device, dtype=dtype, requires_grad=True)
                worst, paths = 0.0, []
                with _precision("fp32"):
                    for training in (True, False):
                        layer.train(training)
                        paths.append(layer.plan(x, lengths=lengths).path)
                        with torch.set_grad_enabled(training):
                            ours, plain = _run(layer, x, lengths, False), _run(layer, x, lengths, True)
                        worst = max(worst, _difference(ours, plain))
                    step = seqnorm.LAYERS[kind](32, 64, num_layers=2, norm=norm).to(device=device, dtype=dtype)
                    step.eval()
                    with torch.no_grad():
                        outputs = []
                        for off in (False, True):
                            state, ys = None, []
                            with kernels.disabled() if off else contextlib.nullcontext():
                                for t in range(20):
                                    y, state = step.step(x[t, :1].detach(), state)
                                    ys.append(y)
                            outputs.append(torch.stack(ys))
                    worst = max(worst, _difference(outputs[:1], outputs[1:]))
                worst_of_all = max(worst_of_all, worst)
                lines.append(f"- {kind} {norm} {str(dtype).removeprefix('torch.')}: paths train/eval "
                             f"{paths[0]}/{paths[1]}; largest relative difference {worst:.1e}")  # fmt: skip
    for kind in ("lstm", "gru"):  # a cell in a user's own loop, masked: on the GPU against the CPU, float64
        for norm in ("layer", "batch", "batch_renorm"):
            torch.manual_seed(0)
            cell = seqnorm.CELLS[kind](32, 64, norm=norm).double()
            x = torch.randn(20, 8, 32, dtype=torch.float64)
            results = []
            for where in (device, torch.device("cpu")):
                on = copy.deepcopy(cell).to(where)
                inputs = x.to(where).requires_grad_()
                state = None
                for t in range(20):
                    state = on(inputs[t], state, step=t, mask=(t < lengths).to(where))
                h = state[0] if isinstance(state, tuple) else state
                h.square().sum().backward()
                grads = [p.grad for p in on.parameters()]
                results.append([t.detach().cpu() for t in (h, inputs.grad, *grads, *on.buffers())])
            worst = _difference(*results)
            worst_of_all = max(worst_of_all, worst)
            lines.append(f"- {kind} cell {norm} float64 in a masked loop, GPU against CPU: {worst:.1e}")
    return lines, worst_of_all


@contextlib.contextmanager
def _switch(name: str, on: bool) -> Iterator[None]:
    """The environment switch ``name`` on or off inside."""
    before = os.environ.get(name)
    os.environ[name] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def _graphs(on: bool) -> contextlib.AbstractContextManager[None]:
    """The Triton backend's CUDA graphs of its loops on or off (``SEQNORM_CUDA_GRAPHS``) inside."""
    from seqnorm.kernels.triton_backend import graphs

    return _switch(graphs.ENV, on)


def _direct(on: bool) -> contextlib.AbstractContextManager[None]:
    """The Triton backend's direct launches on or off (``SEQNORM_DIRECT_LAUNCH``) inside."""
    from seqnorm.kernels.triton_backend import launch

    return _switch(launch.ENV, on)


def graphs_check(device: torch.device, size: str) -> list[str]:
    """The loops as CUDA graphs against the same loops run eagerly: five training steps of LN, RMS and BN LSTM/GRU
    at ``size`` with new inputs each (``graphs.WARMUPS`` eager, then the capture, then replays), float32 with TF32
    off; the largest difference, the graphs made and the device memory they hold."""
    from seqnorm.kernels.triton_backend import graphs

    steps, batch, inputs, hidden = (int(v) for v in size.split("x"))
    lines = ["| cell | norm | graphs made | largest difference, graphed − eager | memory the graphs hold (MiB) |",
             "|---|---|---|---|---|"]  # fmt: skip
    for kind in ("lstm", "gru"):
        for norm in NORMS:
            torch.manual_seed(0)
            layer = seqnorm.LAYERS[kind](inputs, hidden, norm=norm).to(device)
            xs = [torch.randn(steps, batch, inputs, device=device, requires_grad=True) for _ in range(5)]
            lengths = torch.full((batch,), steps, dtype=torch.long)
            results = []
            for on in (False, True):
                graphs.GRAPHS.clear()
                with _precision("fp32"), _graphs(on):
                    results.append([tensor for x in xs for tensor in _run(layer, x, lengths, plain=False)])
            torch.cuda.synchronize(device)
            made, with_graphs = len(graphs.GRAPHS), torch.cuda.memory_allocated(device)
            graphs.GRAPHS.clear()  # the graphs and their static tensors go; what the runs returned stays
            held = with_graphs - torch.cuda.memory_allocated(device)
            difference = _difference(results[1], results[0])
            lines.append(f"| {kind} | {norm} | {made} | {difference:.1e} | {held / 2**20:.0f} |")
    return lines


def half_check(device: torch.device) -> list[str]:
    """Under bf16 autocast each step's product takes bf16 operands, summed in float32: a training step (two
    bidirectional layers, lengths) against float32 without autocast, beside the plain path under autocast (which
    rounds ``W_hh h`` itself to bf16). Whether cuBLAS's bf16 product with a float32 output ran, or the emulation."""
    from seqnorm.kernels.triton_backend import common

    used = "yes" if common.HALF_INTO_FLOAT32 else "no (this torch lacks it: the exact emulation ran)"
    lines = [f"cuBLAS's bf16 product into float32 used: {used}\n",
             "| cell | norm | seqnorm under autocast − float32 | plain path under autocast − float32 |",
             "|---|---|---|---|"]  # fmt: skip
    lengths = torch.tensor([20, 15, 20, 3, 9, 20, 1, 12])
    for kind in ("lstm", "gru"):
        for norm in NORMS:
            torch.manual_seed(0)
            layer = seqnorm.LAYERS[kind](32, 64, num_layers=2, bidirectional=True, norm=norm).to(device)
            x = torch.randn(20, 8, 32, device=device, requires_grad=True)
            with _precision("fp32"):
                reference = _run(copy.deepcopy(layer), x, lengths, plain=True)
            with _precision("bf16"):
                ours = _run(copy.deepcopy(layer), x, lengths, plain=False)
                plain = _run(copy.deepcopy(layer), x, lengths, plain=True)
            lines.append(f"| {kind} | {norm} | {_difference(ours, reference):.1e} | "
                         f"{_difference(plain, reference):.1e} |")  # fmt: skip
    return lines


def device_kernels(events: Iterable[FunctionEvent]) -> tuple[int, float]:
    """The kernels a profile recorded on the GPU and the milliseconds the GPU was busy with them: ``(launches,
    busy)``. Only the device's own rows count (``device_type`` CUDA, memory copies and sets left out), their time
    spans merged so that kernels overlapping on two streams count once. Summing ``self_device_time_total`` over
    ``key_averages()`` counted a cuBLAS kernel twice, under its own row and again under the aten op that launched it,
    and its rows' counts counted those ops as launches."""
    spans = sorted(
        (event.time_range.start, event.time_range.end)
        for event in events
        if event.device_type == DeviceType.CUDA and not event.name.startswith(("Memcpy", "Memset"))
    )
    busy, reached = 0.0, -math.inf
    for start, end in spans:
        busy += max(end - max(start, reached), 0)
        reached = max(reached, end)
    return len(spans), busy / 1000


def profile(device: torch.device, size: str) -> None:
    """Where a training step's time goes: the device's busy time (the sum of its kernels' durations) against the
    step's wall time, and the host-side calls that take the most time, for the LN- and BN-LSTM at ``size``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    steps, batch, inputs, hidden = (int(v) for v in size.split("x"))
    x = torch.randn(steps, batch, inputs, device=device, requires_grad=True)
    for norm in ("layer", "batch"):
        layer = seqnorm.LSTM(inputs, hidden, norm=norm).to(device)
        run = _training_step(layer, x)
        wall = _median_ms(run, 5)
        with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
            run()
            torch.cuda.synchronize()
        launches, busy = device_kernels(trace.events())
        print(f"\nLSTM norm={norm!r}, T={steps} B={batch} I={inputs} H={hidden}: wall {wall:.2f} ms a step, "
              f"device busy {busy:.2f} ms ({busy / wall:.0%}), {launches} kernel launches ({launches / steps:.1f} a "
              "time step, forward and backward); host calls by self CPU time:\n")  # fmt: skip
        print(trace.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
        python = cProfile.Profile()
        python.runcall(run)
        torch.cuda.synchronize()
        print("Python functions by own time (one step):")
        pstats.Stats(python).sort_stats("tottime").print_stats(12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="100x64x512x512", help="T x B x I x H of the training step")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per variant (median)")
    parser.add_argument("--profile", action="store_true", help="only profile a training step (device busy vs wall)")
    parser.add_argument("--check-only", action="store_true", help="only the check against the plain path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here (torch.cuda.is_available() is False): nothing to measure")
        return
    import triton

    device = torch.device("cuda")
    steps, batch, inputs, hidden = (int(v) for v in args.size.split("x"))
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}, "
          f"GPU {torch.cuda.get_device_name(device)}; seqnorm kernels on cuda: {kernels.status('cuda')}\n")  # fmt: skip
    if args.profile:
        profile(device, args.size)
        return
    print("Check against the plain path (TF32 off; training: outputs, states, gradients; evaluation; generation):")
    lines, worst = check(device)
    print("\n".join(lines) + f"\n\nLargest difference of all: {worst:.1e}\n")
    print("The loops as CUDA graphs against the same loops eagerly (5 training steps each, TF32 off):\n")
    print("\n".join(graphs_check(device, args.size)) + "\n")
    print("Half-precision step products under bf16 autocast (training step, largest relative difference):\n")
    print("\n".join(half_check(device)) + "\n")
    if args.check_only:
        return
    print(f"Training step, T={steps} B={batch} I={inputs} H={hidden} (median ms of {args.repeats}):\n")
    print("| cell | norm | precision | path | seqnorm ms | no graphs ms | neither ms | torch (cuDNN) ms | × torch "
          "| plain ms | plain / seqnorm | reference loop ms | reference / plain |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    x = torch.randn(steps, batch, inputs, device=device, requires_grad=True)
    for kind in ("lstm", "gru"):
        torch.manual_seed(0)
        reference = (torch.nn.LSTM if kind == "lstm" else torch.nn.GRU)(inputs, hidden).to(device)
        for norm in NORMS:
            layer = seqnorm.LAYERS[kind](inputs, hidden, norm=norm).to(device)
            for precision in ("fp32", "tf32", "bf16"):
                with _precision(precision):
                    path = layer.plan(x).path
                    ours = _median_ms(_training_step(layer, x), args.repeats)
                    with _graphs(False):
                        eager = _median_ms(_training_step(layer, x), args.repeats)
                        with _direct(False):
                            neither = _median_ms(_training_step(layer, x), args.repeats)
                    theirs = _median_ms(_training_step(reference, x), args.repeats)
                    with kernels.disabled():
                        plain_path = layer.plan(x).path
                        plain = _median_ms(_training_step(layer, x), max(3, args.repeats // 4), warmup=1)
                    layer.impl = "reference"  # the autograd loop over the cell's step, input terms included
                    loop = _median_ms(_training_step(layer, x), max(3, args.repeats // 4), warmup=1)
                    layer.impl = "auto"
                print(f"| {kind} | {norm} | {precision} | {path} | {ours:.2f} | {eager:.2f} | {neither:.2f} "
                      f"| {theirs:.2f} "
                      f"| {ours / theirs:.2f} "
                      f"| {plain:.2f} ({plain_path}) | {plain / ours:.1f} "
                      f"| {loop:.2f} | {loop / plain:.2f} |")  # fmt: skip
    print("\nGeneration step, batch 1, no_grad, eval (median µs over 200 steps of each):\n")
    print("| cell | norm | seqnorm µs | no graphs µs | torch cell µs | × torch |")
    print("|---|---|---|---|---|---|")
    for kind in ("lstm", "gru"):
        cell = (torch.nn.LSTMCell if kind == "lstm" else torch.nn.GRUCell)(inputs, hidden).to(device)
        x_t = torch.randn(1, inputs, device=device)
        for norm in NORMS:
            layer = seqnorm.LAYERS[kind](inputs, hidden, norm=norm).to(device).eval()
            state: list[object] = [None]

            def ours_step(
                layer: torch.nn.Module = layer, state: list[object] = state, x_t: torch.Tensor = x_t
            ) -> object:
                output, state[0] = layer.step(x_t, state[0])
                return output

            with torch.no_grad():
                ours = _median_ms(lambda: [ours_step() for _ in range(200)], 5) * 1000 / 200
                with _graphs(False):
                    eager = _median_ms(lambda: [ours_step() for _ in range(200)], 5) * 1000 / 200
                theirs = _median_ms(lambda: [cell(x_t) for _ in range(200)], 5) * 1000 / 200  # noqa: B023
            print(f"| {kind} | {norm} | {ours:.1f} | {eager:.1f} | {theirs:.1f} | {ours / theirs:.2f} |")


if __name__ == "__main__":
    main()
