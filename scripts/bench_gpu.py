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

Then FlashRNN (``pip install flashrnn``; no norms) where it imports: its fused Triton kernel, its fused CUDA kernel and
its alternating CUDA kernels, each backend in a child process against cuDNN in that process, the same training step
(with the input projection), float32 and bf16, under ``--flashrnn-timeout`` per backend and within ``--deadline``
seconds of the start (where its CUDA kernels take that long to compile, the rows say so; ``--flashrnn only`` runs
those rows alone, ``off`` none). Last, issue 39's targets read from the rows: the worst row each covers and whether it
holds. Everything also goes to ``--json`` (rewritten after each part, so a run cut short keeps what it measured).

It needs torch, triton and seqnorm's core only (no training extras): ``PYTHONPATH=. python scripts/bench_gpu.py``
from the checkout (``make bench-gpu``). For a GPU machine that cannot reach the package index, ``make
build/flashrnn`` unpacks FlashRNN and einops here, and ``PYTHONPATH=.:build/flashrnn`` (``make bench-gpu`` adds it)
lets the children import them. Each timing is a CUDA-event median over ``--repeats`` runs after warm-ups; the run is
meant to finish within four minutes (the issue's budget; ``--deadline`` bounds FlashRNN's part, the rest has not been
timed on a GPU since FlashRNN and the checks were added), and it prints how long it took.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import json
import math
import os
import pstats
import signal
import statistics
import subprocess
import sys
import time
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
    """The median of ``repeats`` runs after ``warmup``, in ms: CUDA events where CUDA is, else the wall clock (the
    FlashRNN cases' CPU rehearsal in the tests)."""
    for _ in range(warmup):
        run()
    if not torch.cuda.is_available():
        return statistics.median(_wall_ms(run) for _ in range(repeats))
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


def _wall_ms(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return (time.perf_counter() - start) * 1000


@contextlib.contextmanager
def _precision(name: str, device_type: str = "cuda") -> Iterator[None]:
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = name == "tf32"
    try:
        if name == "bf16":
            with torch.autocast(device_type, dtype=torch.bfloat16):
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
                with _precision("fp32", device.type):
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
                with _precision("fp32", device.type), _graphs(on):
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
            with _precision("fp32", device.type):
                reference = _run(copy.deepcopy(layer), x, lengths, plain=True)
            with _precision("bf16", device.type):
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


# --- FlashRNN (issue 39: "also benchmark against FlashRNN where it installs") ---------------------------------------
# FlashRNN (NX-AI, `pip install flashrnn`) runs LSTMs and GRUs without norms: its fused Triton kernel (LSTM, heads of
# at most 64), its fused CUDA kernel (LSTM; GRU falls back to the next) and its alternating CUDA kernels. Each backend
# runs in a child process of its own under a timeout: its CUDA kernels are compiled at first use (nvcc, which a GPU
# machine may lack or take minutes over), and a failure or a hang there must not cost the rest of the run.
FLASHRNN_CASES: dict[str, tuple[tuple[str, str], ...]] = {
    "triton_fused": (("lstm", "fp32"), ("lstm", "bf16")),
    "cuda_fused": (("lstm", "fp32"), ("lstm", "bf16")),
    "cuda": (("lstm", "fp32"), ("lstm", "bf16"), ("gru", "fp32"), ("gru", "bf16")),
}
FLASHRNN_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _flashrnn_cases(backend: str) -> tuple[tuple[str, str], ...]:
    """A backend's ``(cell, precision)`` cases; another backend's (FlashRNN's PyTorch ``vanilla``, the tests'
    rehearsal on the CPU): both cells in float32."""
    return FLASHRNN_CASES.get(backend, (("lstm", "fp32"), ("gru", "fp32")))


def _flashrnn_heads(backend: str, hidden: int) -> tuple[int, int]:
    """``(heads, head size)`` FlashRNN runs ``hidden`` with: one head of all of it, except in the fused Triton kernel,
    which takes heads of at most 64 (a block-diagonal recurrence: less work than the dense one it is compared to)."""
    if backend == "triton_fused" and hidden > 64:
        if hidden % 64:
            raise ValueError(
                f"FlashRNN's fused Triton kernel: expected a hidden size that heads of 64 divide, got {hidden}"
            )
        return hidden // 64, 64
    return 1, hidden


def flashrnn_case(kind: str, backend: str, precision: str, size: str, repeats: int, device: torch.device) -> dict:
    """One FlashRNN training step against torch's ``nn.LSTM``/``nn.GRU`` (cuDNN) in this process, on the same input:
    the input projection (``F.linear``, as the layers have it) then ``flashrnn(...)`` and ``h.sum()`` backward, in
    ``precision`` (``fp32``: float32 with TF32 off; ``bf16``: FlashRNN's tensors in bf16, cuDNN under bf16 autocast).
    Also the largest difference of its hidden states and ``R``'s gradient from FlashRNN's own PyTorch backend
    (``vanilla``) on the same tensors in float32, so that what is timed is seen to compute the recurrence."""
    from flashrnn import flashrnn

    steps, batch, inputs, hidden = (int(v) for v in size.split("x"))
    heads, head = _flashrnn_heads(backend, hidden)
    gates, biases = (4, 4) if kind == "lstm" else (3, 4)  # FlashRNN's GRU: 3 input and recurrent gates, 4 biases
    dtype = FLASHRNN_DTYPES[precision]
    torch.manual_seed(0)
    x = torch.randn(steps, batch, inputs, device=device)
    weight_ih = torch.randn(gates * hidden, inputs, device=device) / inputs**0.5
    recurrent = torch.randn(gates, heads, head, head, device=device) / head**0.5
    bias = torch.zeros(biases, heads, head, device=device)

    def step(tensors: list[torch.Tensor], on: str, name: str) -> Callable[[], list[torch.Tensor]]:
        def run() -> list[torch.Tensor]:
            for tensor in tensors:
                tensor.grad = None
            inputs_, weight, r, b = tensors
            projected = torch.nn.functional.linear(inputs_, weight).view(steps, batch, gates, heads, head)
            states, _ = flashrnn(projected.transpose(0, 1), r, b, function=kind, backend=on, dtype=name)
            states[0].float().sum().backward()
            return [states[0].detach().float(), r.grad.float()]

        return run

    def leaves(of: torch.dtype) -> list[torch.Tensor]:
        return [t.to(of).requires_grad_() for t in (x, weight_ih, recurrent, bias)]

    name = str(dtype).removeprefix("torch.")
    run = step(leaves(dtype), backend, name)
    difference = _difference(run(), step(leaves(torch.float32), "vanilla", "float32")())
    ms = _median_ms(run, repeats)
    reference = (torch.nn.LSTM if kind == "lstm" else torch.nn.GRU)(inputs, hidden).to(device)
    with _precision(precision, device.type):
        theirs = _median_ms(_training_step(reference, x.requires_grad_()), repeats)
    return {"cell": kind, "backend": backend, "precision": precision, "heads": heads, "head_size": head, "ms": ms,
            "torch_ms": theirs, "ratio": ms / theirs, "difference": difference}  # fmt: skip


def _flashrnn_child(args: argparse.Namespace) -> None:
    """``--flashrnn-case BACKEND``: this backend's cases, one JSON line each as it finishes (what a timeout cuts off
    is only the rest), an error line where one fails; ``{"error": ...}`` alone where FlashRNN does not import."""
    device = torch.device(args.device)
    try:
        import flashrnn  # noqa: F401
    except Exception as error:  # an install that does not import is what the table reports
        print(json.dumps({"backend": args.flashrnn_case, "error": f"flashrnn does not import: {error}"}), flush=True)
        return
    for kind, precision in _flashrnn_cases(args.flashrnn_case):
        try:
            row = flashrnn_case(kind, args.flashrnn_case, precision, args.size, args.repeats, device)
        except Exception as error:  # one failing kernel leaves the others' rows
            first = str(error).splitlines()[0] if str(error) else ""
            row = _unmeasured(kind, args.flashrnn_case, precision, f"{type(error).__name__}: {first}")
        print(json.dumps(row), flush=True)


def _unmeasured(kind: str, backend: str, precision: str, error: str) -> dict:
    """The row of a FlashRNN case that has no measurement, with what stopped it."""
    return {"cell": kind, "backend": backend, "precision": precision, "error": error}


def flashrnn_rows(
    size: str, repeats: int, deadline: float, timeout: float, device: str = "cuda", backends: Iterable[str] = ()
) -> list[dict]:
    """Every FlashRNN backend's rows, each backend in a child process (``--flashrnn-case``) that is given at most
    ``timeout`` seconds and is cut off at ``deadline`` (``time.monotonic()``; none starts with under 10 s left). A
    row per case: measured, or with an ``error`` (not installed, failed, timed out, skipped at the deadline)."""
    rows: list[dict] = []
    for backend in backends or FLASHRNN_CASES:
        cases = _flashrnn_cases(backend)
        left = min(timeout, deadline - time.monotonic())
        if left < 10:
            rows += [_unmeasured(kind, backend, precision, "skipped: the run's deadline") for kind, precision in cases]
            continue
        command = [sys.executable, str(Path(__file__).resolve()), "--flashrnn-case", backend, "--size", size,
                   "--repeats", str(repeats), "--device", device]  # fmt: skip
        output, ended = _run_cut_off(command, left)
        found = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
        if len(found) == 1 and "cell" not in found[0]:  # not installed: one line for the backend
            rows += [_unmeasured(kind, backend, precision, found[0]["error"]) for kind, precision in cases]
            continue
        rows += found
        reported = {(row["cell"], row["precision"]) for row in found}
        rows += [_unmeasured(kind, backend, precision, ended or "no result")
                 for kind, precision in cases if (kind, precision) not in reported]  # fmt: skip
    return rows


def _run_cut_off(command: list[str], timeout: float) -> tuple[str, str | None]:
    """``command``'s standard output and how it ended (``None``: exit status 0). Past ``timeout`` seconds its whole
    process group is killed, the compilers FlashRNN started included, and what it printed until then is kept."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             start_new_session=True)  # fmt: skip
    try:
        output, _ = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        output, _ = child.communicate()
        return output, f"timed out after {timeout:.0f} s"
    return output, None if child.returncode == 0 else f"exit status {child.returncode}"


def flashrnn_table(rows: list[dict]) -> list[str]:
    lines = ["| cell | FlashRNN backend | heads × size | precision | FlashRNN ms | torch (cuDNN) ms | × torch "
             "| difference to its PyTorch backend |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['cell']} | {row['backend']} | | {row['precision']} | {row['error']} | | | |")
        else:
            lines.append(f"| {row['cell']} | {row['backend']} | {row['heads']} × {row['head_size']} "
                         f"| {row['precision']} | {row['ms']:.2f} | {row['torch_ms']:.2f} | {row['ratio']:.2f} "
                         f"| {row['difference']:.1e} |")  # fmt: skip
    return lines


# --- issue 39's targets, read from the measured rows -----------------------------------------------------------------
def targets(training: list[dict], generation: list[dict]) -> list[dict]:
    """Each of issue 39's targets against the rows this run measured: the worst row it covers, the bound, whether it
    holds. LN and RMS ≤ 1.5× cuDNN in fp32 and TF32, ≤ 2× under bf16 autocast; per-timestep BN ≤ 2×; ≥ 5× the plain
    path's speed; batch-1 generation ≤ 1.0× torch's cell."""
    checks = [
        ("LN/RMS training step, fp32 and TF32 (× cuDNN)", "max", 1.5,
         [r["ours"] / r["torch"] for r in training if r["norm"] in ("layer", "rms") and r["precision"] != "bf16"]),
        ("LN/RMS training step, bf16 autocast (× cuDNN)", "max", 2.0,
         [r["ours"] / r["torch"] for r in training if r["norm"] in ("layer", "rms") and r["precision"] == "bf16"]),
        ("per-timestep BN training step (× cuDNN)", "max", 2.0,
         [r["ours"] / r["torch"] for r in training if r["norm"] == "batch"]),
        ("speed-up over the plain path (plain / seqnorm)", "min", 5.0, [r["plain"] / r["ours"] for r in training]),
        ("batch-1 generation step (× torch's cell)", "max", 1.0, [r["ours"] / r["torch"] for r in generation]),
    ]  # fmt: skip
    found = []
    for name, worst, bound, values in checks:
        if not values:
            continue
        value = max(values) if worst == "max" else min(values)
        holds = value <= bound if worst == "max" else value >= bound
        found.append({"target": name, "bound": bound, "worst": value, "rows": len(values), "holds": holds})
    return found


def targets_table(found: list[dict]) -> list[str]:
    lines = ["| target | bound | worst row | rows | holds |", "|---|---|---|---|---|"]
    for row in found:
        sign = "≤" if "speed-up" not in row["target"] else "≥"
        lines.append(f"| {row['target']} | {sign} {row['bound']} | {row['worst']:.2f} | {row['rows']} "
                     f"| {'yes' if row['holds'] else 'no'} |")  # fmt: skip
    return lines


def _flashrnn_part(args: argparse.Namespace, started: float, report: dict, save: Callable[[], None]) -> None:
    print(f"\nFlashRNN (no norm), the same training step against cuDNN in its own process (median ms of "
          f"{args.repeats}; each backend at most {args.flashrnn_timeout:.0f} s, all ended by "
          f"{args.deadline:.0f} s from the start):\n")  # fmt: skip
    deadline = started + args.deadline
    report["flashrnn"] = flashrnn_rows(args.size, args.repeats, deadline, args.flashrnn_timeout, args.device)
    save()
    print("\n".join(flashrnn_table(report["flashrnn"])))


def main() -> None:
    started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="100x64x512x512", help="T x B x I x H of the training step")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per variant (median)")
    parser.add_argument("--profile", action="store_true", help="only profile a training step (device busy vs wall)")
    parser.add_argument("--check-only", action="store_true", help="only the check against the plain path")
    parser.add_argument("--json", type=Path, default=Path("bench_gpu.json"), help="where the results go as JSON "
                        "(written after each part, so that a run cut short leaves what it measured)")  # fmt: skip
    parser.add_argument("--flashrnn", choices=("on", "off", "only"), default="on",
                        help="FlashRNN's rows where it imports; only: those and nothing else")  # fmt: skip
    parser.add_argument("--deadline", type=float, default=230.0,
                        help="seconds from the start by which FlashRNN's children end (cut off there)")  # fmt: skip
    parser.add_argument("--flashrnn-timeout", type=float, default=90.0, help="seconds a FlashRNN backend may take")
    parser.add_argument("--flashrnn-case", help=argparse.SUPPRESS)  # the child process: one FlashRNN backend
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": the tests' rehearsal
    args = parser.parse_args()
    if args.flashrnn_case:
        _flashrnn_child(args)
        return
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here (torch.cuda.is_available() is False): nothing to measure")
        return
    import triton

    device = torch.device(args.device)
    steps, batch, inputs, hidden = (int(v) for v in args.size.split("x"))
    report: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
                    "gpu": torch.cuda.get_device_name(device), "kernels": kernels.status("cuda"), "size": args.size,
                    "repeats": args.repeats}  # fmt: skip

    def save() -> None:
        report["seconds"] = round(time.monotonic() - started, 1)
        args.json.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")

    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}, "
          f"GPU {report['gpu']}; seqnorm kernels on cuda: {report['kernels']}\n")  # fmt: skip
    if args.profile:
        profile(device, args.size)
        return
    if args.flashrnn == "only":
        _flashrnn_part(args, started, report, save)
        return
    print("Check against the plain path (TF32 off; training: outputs, states, gradients; evaluation; generation):")
    lines, worst = check(device)
    report["check"] = {"lines": lines, "largest_difference": worst}
    save()
    print("\n".join(lines) + f"\n\nLargest difference of all: {worst:.1e}\n")
    print("The loops as CUDA graphs against the same loops eagerly (5 training steps each, TF32 off):\n")
    report["graphs_check"] = graphs_check(device, args.size)
    save()
    print("\n".join(report["graphs_check"]) + "\n")
    print("Half-precision step products under bf16 autocast (training step, largest relative difference):\n")
    report["half_check"] = half_check(device)
    save()
    print("\n".join(report["half_check"]) + "\n")
    if args.check_only:
        return
    print(f"Training step, T={steps} B={batch} I={inputs} H={hidden} (median ms of {args.repeats}):\n")
    print("| cell | norm | precision | path | seqnorm ms | no graphs ms | neither ms | torch (cuDNN) ms | × torch "
          "| plain ms | plain / seqnorm | reference loop ms | reference / plain |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    training: list[dict] = report.setdefault("training", [])
    x = torch.randn(steps, batch, inputs, device=device, requires_grad=True)
    for kind in ("lstm", "gru"):
        torch.manual_seed(0)
        reference = (torch.nn.LSTM if kind == "lstm" else torch.nn.GRU)(inputs, hidden).to(device)
        for norm in NORMS:
            layer = seqnorm.LAYERS[kind](inputs, hidden, norm=norm).to(device)
            for precision in ("fp32", "tf32", "bf16"):
                with _precision(precision, device.type):
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
                training.append({"cell": kind, "norm": norm, "precision": precision, "path": path, "ours": ours,
                                 "no_graphs": eager, "neither": neither, "torch": theirs, "plain": plain,
                                 "plain_path": plain_path, "reference_loop": loop})  # fmt: skip
                save()
                print(f"| {kind} | {norm} | {precision} | {path} | {ours:.2f} | {eager:.2f} | {neither:.2f} "
                      f"| {theirs:.2f} "
                      f"| {ours / theirs:.2f} "
                      f"| {plain:.2f} ({plain_path}) | {plain / ours:.1f} "
                      f"| {loop:.2f} | {loop / plain:.2f} |")  # fmt: skip
    print("\nGeneration step, batch 1, no_grad, eval (median µs over 200 steps of each):\n")
    print("| cell | norm | seqnorm µs | no graphs µs | torch cell µs | × torch |")
    print("|---|---|---|---|---|---|")
    generation: list[dict] = report.setdefault("generation", [])
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
            generation.append({"cell": kind, "norm": norm, "ours": ours, "no_graphs": eager, "torch": theirs})
            save()
            print(f"| {kind} | {norm} | {ours:.1f} | {eager:.1f} | {theirs:.1f} | {ours / theirs:.2f} |")
    if args.flashrnn == "on":
        _flashrnn_part(args, started, report, save)
    report["targets"] = targets(training, generation)
    save()
    print("\nIssue 39's targets in this run (the worst row each covers):\n")
    print("\n".join(targets_table(report["targets"])))
    print(f"\n{time.monotonic() - started:.0f} s in all; JSON: {args.json}")


if __name__ == "__main__":
    main()
