"""What synchronizing per-timestep BN across processes costs: 2 CPU processes (gloo), one training step of a
``seqnorm.LSTM``/``GRU`` with ``norm="batch"`` on each, with and without :func:`seqnorm.convert_sync_batchnorm`.

Per variant it prints the median step time (forward + backward; the slower process of each step counts), the
collectives per step (every ``torch.distributed.all_reduce`` counted) and the median latency of one all-reduce of
the size a norm sends, all measured in the same run. The unsynchronized variant is plain data parallelism without
DDP's gradient all-reduce, i.e. the compute alone; the synchronized one adds the statistics' collectives and the
reference loop they run on. One process alone (``norm="batch"``, the fast path) is the baseline.

    python scripts/bench_ddp.py            # T=64, B=16 per process, 128 -> 128, LSTM and GRU
    python scripts/bench_ddp.py --quick    # seconds
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import seqnorm


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats")
    parser.add_argument("--steps", type=int, default=64, help="time steps T")
    parser.add_argument("--batch", type=int, default=16, help="sequences per process")
    parser.add_argument("--size", type=int, default=128, help="input and hidden size")
    parser.add_argument("--repeats", type=int, default=15, help="timed training steps per variant")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.batch, args.size, args.repeats = 16, 8, 32, 5
    return args


def _timed_steps(layer: torch.nn.Module, x: torch.Tensor, repeats: int) -> list[float]:
    """Per step, the slowest process's time (each process measures its own, then they agree on the maximum)."""
    times = []
    for repeat in range(repeats + 2):  # two warm-up steps
        dist.barrier()
        start = time.perf_counter()
        output, _ = layer(x)
        output.sum().backward()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if repeat >= 2:
            times.append(float(elapsed))
    return times


def _latency(size: int, repeats: int = 200) -> float:
    payload = torch.randn(size)
    for _ in range(10):
        dist.all_reduce(payload)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(payload)
    return (time.perf_counter() - start) / repeats


def _process(rank: int, args: argparse.Namespace, folder: str, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    counted = {"calls": 0}
    plain_all_reduce = dist.all_reduce

    def counting_all_reduce(*call_args: Any, **kwargs: Any) -> Any:
        counted["calls"] += 1
        return plain_all_reduce(*call_args, **kwargs)

    try:
        rows = []
        for kind, layer_class in (("lstm", seqnorm.LSTM), ("gru", seqnorm.GRU)):
            torch.manual_seed(0)
            x = torch.randn(args.steps, args.batch, args.size)
            for synchronized in (False, True):
                torch.manual_seed(0)
                layer = layer_class(args.size, args.size, norm="batch")
                if synchronized:
                    seqnorm.convert_sync_batchnorm(layer)
                times = _timed_steps(layer, x, args.repeats)
                dist.all_reduce = counting_all_reduce  # type: ignore[assignment]
                counted["calls"] = 0
                output, _ = layer(x)
                forward_calls = counted["calls"]
                output.sum().backward()
                dist.all_reduce = plain_all_reduce  # type: ignore[assignment]
                rows.append((kind, synchronized, statistics.median(times), forward_calls, counted["calls"]))
        features = 4 * args.size  # an LSTM gate term: the largest per-step payload
        latency = _latency(2 * features + 2)
        if rank == 0:
            results.put((rows, latency))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _single(args: argparse.Namespace) -> dict[str, float]:
    """One process, the whole batch of both (2B sequences), the fast path: what DDP divides."""
    torch.set_num_threads(1)
    medians = {}
    for kind, layer_class in (("lstm", seqnorm.LSTM), ("gru", seqnorm.GRU)):
        torch.manual_seed(0)
        layer = layer_class(args.size, args.size, norm="batch")
        x = torch.randn(args.steps, 2 * args.batch, args.size)
        times = []
        for repeat in range(args.repeats + 2):
            start = time.perf_counter()
            output, _ = layer(x)
            output.sum().backward()
            if repeat >= 2:
                times.append(time.perf_counter() - start)
        medians[kind] = statistics.median(times)
    return medians


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as folder:
        context = mp.get_context("spawn")
        results = context.SimpleQueue()
        mp.spawn(_process, args=(args, folder, results), nprocs=2, join=True)
        rows, latency = results.get()
    single = _single(args)
    cpu = platform_cpu()
    print(f"## DDP with synchronized BN: 2 processes (gloo), {cpu}, torch {torch.__version__}, 1 thread each")
    print(f"T={args.steps}, B={args.batch} per process, size {args.size}, norm=batch, median of {args.repeats} steps")
    print()
    print("| cell | variant | step (ms) | × unsynchronized | collectives forward / backward |")
    print("|---|---|---|---|---|")
    base = {kind: seconds for kind, synchronized, seconds, *_ in rows if not synchronized}
    for kind, synchronized, seconds, forward_calls, total_calls in rows:
        variant = "synchronized" if synchronized else "local statistics"
        ratio = seconds / base[kind]
        collectives = f"{forward_calls} / {total_calls - forward_calls}"
        print(f"| {kind} | {variant} | {seconds * 1e3:.1f} | {ratio:.2f} | {collectives} |")
    for kind, seconds in single.items():
        print(f"| {kind} | one process, 2B sequences | {seconds * 1e3:.1f} | {seconds / base[kind]:.2f} | 0 / 0 |")
    print()
    print(f"One all-reduce of {2 * 4 * args.size + 2} floats (an LSTM gate term's sums): {latency * 1e6:.0f} µs")


def platform_cpu() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} CPUs)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
