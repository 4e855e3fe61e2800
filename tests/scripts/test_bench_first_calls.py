"""scripts/bench_first_calls.py: first calls against prepared ones, seqnorm's and torch's, one row per situation
and norm."""

from __future__ import annotations

import re
import sys

import pytest


def test_every_situation_is_measured_for_every_norm(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import bench_first_calls

    argv = ["bench_first_calls.py", "--quick", "--norms", "layer,batch", "--batches", "2", "--steps", "3"]
    monkeypatch.setattr(sys, "argv", [*argv, "--cycles", "2", "--threads", "1"])
    bench_first_calls.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "norm |" not in line]
    situations = ("training steps at new batch sizes", "a fresh layer's generation steps", "first step() after each")
    expected = [(situation, norm) for situation in situations for norm in ("layer", "batch")]
    assert len(rows) == len(expected)
    for row, (situation, norm) in zip(rows, expected, strict=True):
        assert row.split("|")[1].strip().startswith(situation) and row.split("|")[2].strip() == norm
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")][2:]
        assert len(cells) == 4  # first and prepared, seqnorm's then torch's
        assert all(float(number) > 0 for cell in cells for number in re.findall(r"\d+\.\d+", cell))


def test_counts_below_one_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import bench_first_calls

    monkeypatch.setattr(sys, "argv", ["bench_first_calls.py", "--quick", "--steps", "0"])
    with pytest.raises(SystemExit):
        bench_first_calls.main()
