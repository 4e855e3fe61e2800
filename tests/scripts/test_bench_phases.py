"""scripts/bench_phases.py splits a training step into its forward, its backward and a no-grad forward."""

from __future__ import annotations

import sys

import pytest


def test_every_phase_is_a_ratio_to_torch(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import bench_phases

    argv = ["bench_phases.py", "--sizes", "4x3x5x6", "--norms", "layer,batch", "--repeats", "2", "--threads", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    bench_phases.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| lstm", "| gru"))]
    assert [tuple(cell.strip() for cell in row.split("|")[1:3]) for row in rows] == [
        ("lstm 4x3x5x6", "layer"),
        ("lstm 4x3x5x6", "batch"),
        ("gru 4x3x5x6", "layer"),
        ("gru 4x3x5x6", "batch"),
    ]
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == 3 + len(bench_phases.PHASES)
        assert all(float(value) > 0 for value in cells[2].split(" / "))  # torch's three phases, ms
        for cell in cells[3:]:
            median, spread = cell.split(" (")
            low, high = (float(value) for value in spread.rstrip(")").split("–"))
            assert 0 < low <= float(median) <= high
