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


# A stand-in for FlashRNN's API (flashrnn(Wx, R, b, function=, backend=, dtype=) -> (states, last states)), written
# into a folder the child processes import from: a plain tanh recurrence over the summed gates, the same for every
# backend (so each backend's difference to "vanilla" is 0), except "fails", which raises as a missing compiler would.
STAND_IN = """
import torch

def flashrnn(Wx, R, b, states=None, function="lstm", config=None, backend="cuda_fused", dtype="bfloat16"):
    if backend == "fails":
        raise RuntimeError("nvcc not found\\nsecond line")
    batch, steps, gates, heads, size = Wx.shape
    h, outputs = Wx.new_zeros(batch, heads, size), []
    for t in range(steps):
        h = torch.tanh(Wx[:, t].sum(1) + b.sum(0) + torch.einsum("gnde,bne->bnd", R, h))
        outputs.append(h)
    states = torch.stack(outputs, 1).unsqueeze(0)
    return states, states[:, :, -1:]
"""


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "flashrnn").mkdir()
    (tmp_path / "flashrnn" / "__init__.py").write_text(STAND_IN)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return tmp_path


def test_flashrnn_rows_measured_failed_or_skipped_at_the_deadline(stand_in: Path) -> None:
    """Each FlashRNN backend runs in a child process: its cases' rows come back measured (against torch's layer in
    that process, and checked against FlashRNN's own PyTorch backend), or with the error that stopped them; a backend
    is not started once the run's deadline has passed."""
    import time

    from bench_gpu import flashrnn_rows, flashrnn_table

    rows = flashrnn_rows("4x3x5x6", 2, time.monotonic() + 600, 120, device="cpu", backends=("vanilla", "fails"))
    measured = [row for row in rows if row["backend"] == "vanilla"]
    assert [(row["cell"], row["precision"]) for row in measured] == [("lstm", "fp32"), ("gru", "fp32")]
    for row in measured:
        assert row["ms"] > 0 and row["torch_ms"] > 0 and row["ratio"] == pytest.approx(row["ms"] / row["torch_ms"])
        assert row["difference"] == 0 and (row["heads"], row["head_size"]) == (1, 6)
    failed = [row for row in rows if row["backend"] == "fails"]
    assert [row["error"] for row in failed] == ["RuntimeError: nvcc not found"] * 2
    late = flashrnn_rows("4x3x5x6", 2, time.monotonic() - 1, 120, device="cpu", backends=("cuda",))
    assert [row["error"] for row in late] == ["skipped: the run's deadline"] * 4
    table = flashrnn_table(rows + late)
    assert len(table) == 2 + len(rows) + len(late) and table[2].startswith("| lstm | vanilla | 1 × 6 | fp32 |")


def test_flashrnn_rows_say_what_a_missing_install_or_a_timeout_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without FlashRNN every case of the backend says it does not import; a backend cut off by its timeout keeps
    the rows it printed before, and the rest say it timed out."""
    import json
    import time

    import bench_gpu

    monkeypatch.setenv("PYTHONPATH", "")
    missing = bench_gpu.flashrnn_rows("4x3x5x6", 1, time.monotonic() + 600, 120, device="cpu", backends=("cuda",))
    assert len(missing) == 4
    assert all(row["error"].startswith("flashrnn does not import: No module named 'flashrnn'") for row in missing)

    first = {"cell": "lstm", "backend": "cuda", "precision": "fp32", "ms": 1.0}
    cut_off = (json.dumps(first) + "\n", "timed out after 30 s")
    monkeypatch.setattr(bench_gpu, "_run_cut_off", lambda command, timeout: cut_off)
    rows = bench_gpu.flashrnn_rows("4x3x5x6", 1, time.monotonic() + 600, 30, backends=("cuda",))
    assert rows[0] == first
    assert [(row["cell"], row["precision"], row["error"]) for row in rows[1:]] == [
        ("lstm", "bf16", "timed out after 30 s"),
        ("gru", "fp32", "timed out after 30 s"),
        ("gru", "bf16", "timed out after 30 s"),
    ]


def test_a_child_past_its_timeout_is_killed_with_what_it_started_and_its_output_kept() -> None:
    """A FlashRNN child compiling its CUDA kernels runs compilers of its own: at the timeout the whole process group
    goes, and the lines printed before stay."""
    import os
    import sys
    import time

    from bench_gpu import _run_cut_off

    # The grandchild does not hold the output pipe: were only the child killed, the call would return all the same,
    # with the grandchild still asleep.
    script = (
        "import subprocess, sys, time; grandchild = subprocess.Popen([sys.executable, '-c', 'import time; "
        "time.sleep(3600)'], stdout=subprocess.DEVNULL); print(grandchild.pid, flush=True); time.sleep(3600)"
    )
    output, ended = _run_cut_off([sys.executable, "-c", script], 3)
    assert ended == "timed out after 3 s"
    grandchild = int(output.split()[0])
    for _ in range(200):  # gone, or a zombie until init reaps it (SIGKILL's delivery polled for)
        try:
            with open(f"/proc/{grandchild}/stat") as stat:
                if stat.read().split(") ")[1].startswith("Z"):
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        os.kill(grandchild, 9)
        raise AssertionError("the grandchild outlived the timeout")
    assert _run_cut_off([sys.executable, "-c", "print('done')"], 30) == ("done\n", None)
    assert _run_cut_off([sys.executable, "-c", "raise SystemExit(3)"], 30) == ("", "exit status 3")


def test_the_targets_are_read_from_the_worst_row_each_covers() -> None:
    from bench_gpu import targets, targets_table

    def row(norm: str, precision: str, ours: float, torch_ms: float, plain: float) -> dict:
        return {"cell": "lstm", "norm": norm, "precision": precision, "ours": ours, "torch": torch_ms, "plain": plain}

    training = [
        row("layer", "fp32", 1.4, 1.0, 10.0),
        row("rms", "tf32", 1.6, 1.0, 10.0),  # the worst fp32/TF32 LN-RMS row: 1.6 > 1.5
        row("layer", "bf16", 3.0, 2.0, 30.0),  # 1.5 ≤ 2
        row("batch", "fp32", 1.9, 1.0, 9.0),  # 1.9 ≤ 2; plain / seqnorm 4.7 < 5: the speed-up target fails here
    ]
    generation = [{"cell": "gru", "norm": "layer", "ours": 20.0, "torch": 25.0}]
    found = {entry["target"]: entry for entry in targets(training, generation)}
    assert [(entry["worst"], entry["rows"], entry["holds"]) for entry in found.values()] == [
        (pytest.approx(1.6), 2, False),
        (pytest.approx(1.5), 1, True),
        (pytest.approx(1.9), 1, True),
        (pytest.approx(9.0 / 1.9), 4, False),
        (pytest.approx(0.8), 1, True),
    ]
    assert targets(training[:1], []) == targets(training[:1], generation)[:2]  # a target no row covers: left out
    speed_up = "| speed-up over the plain path (plain / seqnorm) | ≥ 5.0 | 4.74 | 4 | no |"
    assert targets_table(list(found.values()))[5] == speed_up


def test_a_whole_run_rehearsed_on_the_cpu_prints_its_tables_and_writes_json(
    stand_in: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """main() from start to end on the CPU, so that a GPU session's one run does not end in a slip of the script's
    own: CUDA's calls and the checks that need a GPU stood in, every timed closure run once (the layers' training
    steps and generation steps included), FlashRNN's rows from the stand-in in a child process."""
    import json
    import sys

    import bench_gpu

    runs: list[int] = []

    def once(run: object, repeats: int, warmup: int = 3) -> float:
        run()  # type: ignore[operator]
        runs.append(repeats)
        return float(len(runs))  # a different "time" for each, so ratios are not all 1

    monkeypatch.setattr(bench_gpu.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_gpu.torch.cuda, "get_device_name", lambda device: "stand-in GPU")
    monkeypatch.setattr(bench_gpu, "_median_ms", once)
    monkeypatch.setattr(bench_gpu, "check", lambda device: (["- a check line"], 1e-7))
    monkeypatch.setattr(bench_gpu, "graphs_check", lambda device, size: ["| graphs |"])
    monkeypatch.setattr(bench_gpu, "half_check", lambda device: ["| half |"])
    monkeypatch.setattr(bench_gpu, "FLASHRNN_CASES", {"triton_fused": (("lstm", "fp32"), ("lstm", "bf16"))})
    report = tmp_path / "bench.json"
    argv = ["bench_gpu.py", "--device", "cpu", "--size", "3x2x4x8", "--repeats", "2", "--json", str(report)]
    monkeypatch.setattr(sys, "argv", argv)
    bench_gpu.main()
    printed = capsys.readouterr().out
    written = json.loads(report.read_text())
    assert len(written["training"]) == 2 * 3 * 3 and len(written["generation"]) == 2 * 3
    assert [row["path"] for row in written["training"][:3]] == [row["path"] for row in written["training"][3:6]]
    assert [(row["backend"], row.get("error")) for row in written["flashrnn"]] == [("triton_fused", None)] * 2
    # the stand-in ran both cases: in float32 as its "vanilla" backend does, in bf16 within bf16's rounding of it
    assert [row["difference"] == 0 for row in written["flashrnn"]] == [True, False]
    assert max(row["difference"] for row in written["flashrnn"]) < 0.05
    assert written["targets"][0]["target"] == "LN/RMS training step, fp32 and TF32 (× cuDNN)"
    assert written["check"] == {"lines": ["- a check line"], "largest_difference": 1e-7}
    assert "| lstm | layer | fp32 |" in printed and "| gru | batch | 12" not in printed
    assert "Issue 39's targets in this run" in printed
    assert "| lstm | triton_fused | 1 × 8 | fp32 |" in printed
