"""scripts/bench.py: its tables, and the check of issue 14's targets against the medians it measured."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest


def test_targets_take_the_worst_covered_row_and_mark_it_against_the_bound() -> None:
    from bench import Measured, Target, target_rows

    targets = (
        Target("LN training", "training", ("layer",), 1.15, batch_one=False),
        Target("batch 1", "training", ("layer", "rms"), 1.5, batch_one=True),
        Target("memory", "memory", ("layer",), 1.2),
        Target("generation", "generation", ("layer",), 1.1),
    )
    measured = [
        Measured("training", "lstm 100x32", 32, "layer", 1.02),
        Measured("training", "gru 100x64", 64, "layer", 1.16),  # the worst LN row, over its bound
        Measured("training", "lstm 100x32", 32, "rms", 3.0),  # another norm: not LN's
        Measured("training", "lstm 100x1", 1, "layer", 1.4),  # batch 1: only the batch-1 target's
        Measured("training", "lstm 100x1", 1, "rms", 1.49),
        Measured("memory", "lstm 100x32", 32, "layer", 0.91),
    ]
    rows = target_rows(measured, targets)
    assert rows == [
        "| LN training | ≤ 1.15 | 1.160 (gru 100x64, layer; 2 rows) | ✗ |",
        "| batch 1 | ≤ 1.5 | 1.490 (lstm 100x1, rms; 2 rows) | ✓ |",
        "| memory | ≤ 1.2 | 0.910 (lstm 100x32, layer; 1 rows) | ✓ |",
        "| generation | ≤ 1.1 | not measured | |",
    ]


def test_a_run_prints_every_table_and_one_row_per_target(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    table_after: Callable[[str, str], list[list[str]]],
) -> None:
    import bench

    argv = ["bench.py", "--sizes", "4x3x5x6,4x1x5x6", "--cells", "lstm", "--norms", "layer,batch", "--repeats", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--threads", "1", "--generation-steps", "2", "--no-reference"])
    bench.main()
    out = capsys.readouterr().out
    assert "### Training step" in out and "### Generation step" in out
    rows = table_after(out, "### Against issue 14's targets")
    assert [cells[0] for cells in rows] == [target.name for target in bench.TARGETS]
    for cells, target in zip(rows, bench.TARGETS, strict=True):
        if target.norms == ("rms",) or target.norms == ("batch_renorm",):
            assert cells[2] == "not measured"  # not among --norms
            continue
        worst = float(cells[2].split(" ")[0])
        assert cells[3] == ("✓" if worst <= target.bound else "✗")
