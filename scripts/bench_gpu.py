"""The Triton backend on a CUDA GPU against cuDNN's ``nn.LSTM``/``nn.GRU`` and against seqnorm's plain path.

Prints the versions and the GPU; checks the Triton backend against the plain-PyTorch path on the GPU (outputs and
gradients of an LN-LSTM and an LN-GRU, float32 with TF32 off); then median milliseconds of a training step (forward
and backward of ``output.sum()``, the input requiring a gradient) at ``--size`` (T x B x I x H, default
100x64x512x512) in three precisions — float32 with TF32 off, float32 with TF32, bf16 autocast (the input
projection in bf16, the recurrence in float32) — with ratios to cuDNN and to the plain path, and a batch-1
generation step against ``nn.LSTMCell``/``nn.GRUCell``. Markdown tables, for BENCHMARKS.md. Without CUDA it says
so and exits 0.

It needs torch, triton and seqnorm's core only (no training extras): ``PYTHONPATH=. python scripts/bench_gpu.py``
from the checkout (``make bench-gpu``). Each timing is a CUDA-event median over ``--repeats`` runs after warm-ups;
the whole run is sized to finish in a few minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

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


def check(device: torch.device) -> list[str]:
    """The Triton backend against the plain path on the GPU: the largest differences, one line per cell."""
    lines = []
    for kind in ("lstm", "gru"):
        torch.manual_seed(0)
        layer = seqnorm.LAYERS[kind](32, 64, num_layers=2, bidirectional=True, norm="layer").to(device)
        x = torch.randn(20, 8, 32, device=device, requires_grad=True)
        lengths = torch.tensor([20, 15, 20, 3, 9, 20, 1, 12])
        path = layer.plan(x, lengths=lengths).path
        results = []
        with _precision("fp32"):
            for off in (False, True):
                layer.zero_grad()
                x.grad = None
                with kernels.disabled() if off else contextlib.nullcontext():
                    output, _ = layer(x, lengths=lengths)
                    output.sum().backward()
                results.append([output.detach(), x.grad.clone(), *(p.grad.clone() for p in layer.parameters())])
        worst = max(((a - b).abs().max() / b.abs().max().clamp(min=1)).item() for a, b in zip(*results, strict=True))
        lines.append(f"- {kind.upper()}(norm='layer'), 2 layers, bidirectional, lengths: path {path!r}; largest "
                     f"difference from the plain path, relative to each tensor's scale: {worst:.1e}")  # fmt: skip
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="100x64x512x512", help="T x B x I x H of the training step")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per variant (median)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here (torch.cuda.is_available() is False): nothing to measure")
        return
    import triton

    device = torch.device("cuda")
    steps, batch, inputs, hidden = (int(v) for v in args.size.split("x"))
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}, "
          f"GPU {torch.cuda.get_device_name(device)}; seqnorm kernels on cuda: {kernels.status('cuda')}\n")  # fmt: skip
    print("Check against the plain path (float32, TF32 off):")
    print("\n".join(check(device)) + "\n")
    print(f"Training step, T={steps} B={batch} I={inputs} H={hidden} (median ms of {args.repeats}):\n")
    print("| cell | norm | precision | path | seqnorm ms | torch (cuDNN) ms | × torch | plain ms | plain / seqnorm |")
    print("|---|---|---|---|---|---|---|---|---|")
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
                    theirs = _median_ms(_training_step(reference, x), args.repeats)
                    with kernels.disabled():
                        plain = _median_ms(_training_step(layer, x), max(3, args.repeats // 4), warmup=1)
                print(f"| {kind} | {norm} | {precision} | {path} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f} "
                      f"| {plain:.2f} | {plain / ours:.1f} |")  # fmt: skip
    print("\nGeneration step, batch 1, no_grad, eval (median µs over 200 steps of each):\n")
    print("| cell | norm | seqnorm µs | torch cell µs | × torch |")
    print("|---|---|---|---|---|")
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
                theirs = _median_ms(lambda: [cell(x_t) for _ in range(200)], 5) * 1000 / 200  # noqa: B023
            print(f"| {kind} | {norm} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f} |")


if __name__ == "__main__":
    main()
