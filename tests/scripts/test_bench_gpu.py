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
