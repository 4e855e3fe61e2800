"""scripts/bench_gpu.py: without CUDA it says so and exits 0, importing nothing beyond torch and seqnorm's core."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_gpu.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the script would measure it")
def test_without_cuda_it_says_so_and_exits_0() -> None:
    code = (
        f"import runpy, sys; sys.argv = ['bench_gpu.py']; runpy.run_path({str(SCRIPT)!r}, run_name='__main__'); "
        "print('lightning' in sys.modules, 'triton' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "bench_gpu: no CUDA device here (torch.cuda.is_available() is False): nothing to measure"
    assert lines[1] == "False False"  # neither the training extras nor triton imported to say so


def test_the_profile_counts_each_gpu_kernel_once() -> None:
    """A recorded profile's rows, as torch.profiler gives them for one cuBLAS product and two Triton steps: the aten
    op on the CPU whose self device time is its kernel's (summing every row's counted that kernel twice, and the op
    as a launch), the kernels on the device (two overlapping on two streams), and a copy, which is no kernel."""
    from bench_gpu import device_kernels  # scripts/ is on the path (tests/scripts/conftest.py)
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    def row(index: int, name: str, start: int, end: int, device: DeviceType) -> FunctionEvent:
        return FunctionEvent(index, name, thread=0, start_us=start, end_us=end, device_type=device)

    events = [
        row(0, "aten::mm", 0, 12, DeviceType.CPU),
        row(1, "sm90_xmma_gemm_f32f32_f32f32_f32_nn", 10, 30, DeviceType.CUDA),
        row(2, "lstm_rows", 30, 35, DeviceType.CUDA),
        row(3, "lstm_rows_backward", 32, 40, DeviceType.CUDA),  # another stream, overlapping the one before
        row(4, "Memcpy HtoD (Pageable -> Device)", 40, 41, DeviceType.CUDA),
        row(5, "cudaLaunchKernel", 12, 13, DeviceType.CPU),
    ]
    events[0].append_kernel("sm90_xmma_gemm_f32f32_f32f32_f32_nn", 0, 20)  # the op's device time, as recorded
    assert device_kernels(events) == (3, 0.030)  # 10..40 µs busy, once
    assert device_kernels(events[:1] + events[5:]) == (0, 0.0)
