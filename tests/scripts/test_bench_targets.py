"""scripts/bench_targets.py: issue 14's targets over several fresh processes of bench.py, side by side."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest


def test_each_process_s_worst_row_is_marked_and_the_processes_that_held_are_counted() -> None:
    from bench import Measured, Target
    from bench_targets import targets_table

    targets = (
        Target("LN training", "training", ("layer",), 1.15, batch_one=False),
        Target("generation", "generation", ("layer",), 1.1),
    )
    first = [
        Measured("training", "lstm 100x32", 32, "layer", 1.02, 0.05),
        Measured("training", "gru 100x64", 64, "layer", 1.10, 0.3),
    ]
    second = [
        Measured("training", "lstm 100x32", 32, "layer", 1.16, 0.05),  # over the bound
        Measured("training", "lstm 100x1", 1, "layer", 3.0, 0.005),  # batch 1: not this target's
    ]
    assert targets_table([first, second], targets) == [
        "| target | bound | process 1 | process 2 | held in |",
        "|---|---|---|---|---|",
        "| LN training | ≤ 1.15 | 1.100 ✓ | 1.160 ✗ | 1 of 2 |",
        "| generation | ≤ 1.1 | not measured | not measured | - |",
    ]


def test_the_training_table_puts_each_size_s_ratios_side_by_side() -> None:
    from bench import Measured
    from bench_targets import training_table

    runs = [
        [
            Measured("training", "lstm 10x2x3x4", 2, "layer", 1.04, 0.0123),
            Measured("training", "lstm 10x2x3x4", 2, "batch", 1.2, 0.0123),
            Measured("training", "gru 10x2x3x4", 2, "layer", 0.9, 0.011),
            Measured("memory", "lstm 10x2x3x4", 2, "layer", 1.1),
        ],
        [
            Measured("training", "lstm 10x2x3x4", 2, "layer", 1.06, 0.0131),
            Measured("training", "lstm 10x2x3x4", 2, "batch", 1.18, 0.0131),
        ],
    ]
    assert training_table(runs, "lstm") == [
        "| LSTM size | torch ms | layer | batch |",
        "|---|---|---|---|",
        "| 10x2x3x4 | 12.3 / 13.1 | 1.04 / 1.06 | 1.20 / 1.18 |",
    ]
    assert training_table(runs, "gru")[2] == "| 10x2x3x4 | 11.0 / - | 0.90 / - |"


def test_a_run_of_two_processes_prints_both_tables_and_keeps_each_output(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    table_after: Callable[[str, str], list[list[str]]],
) -> None:
    import bench
    import bench_targets

    tiny = ["--sizes", "4x3x5x6", "--cells", "lstm", "--norms", "layer", "--generation-steps", "2", "--threads", "1"]
    argv = ["bench_targets.py", "--processes", "2", "--repeats", "1", "--out", str(tmp_path), *tiny]
    monkeypatch.setattr(sys, "argv", argv)
    bench_targets.main()
    out = capsys.readouterr().out
    assert "2 processes of `python scripts/bench.py" in out and "--sizes 4x3x5x6" in out
    rows = table_after(out, "### Issue 14's targets, process by process")
    assert [cells[0] for cells in rows] == [target.name for target in bench.TARGETS]
    assert all(cell.endswith(("✓", "✗")) for cell in rows[0][2:4]) and rows[0][4].endswith("of 2")
    assert table_after(out, "### LSTM training step")[0][0] == "4x3x5x6"
    for number in (1, 2):
        assert "### Against issue 14's targets" in (tmp_path / f"process-{number}.md").read_text(encoding="utf-8")


def test_fewer_than_one_process_is_refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import bench_targets

    monkeypatch.setattr(sys, "argv", ["bench_targets.py", "--processes", "0"])
    with pytest.raises(SystemExit):
        bench_targets.main()
    assert "--processes: expected at least 1, got 0" in capsys.readouterr().err


def test_a_failed_process_is_named_with_its_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    import bench_targets

    monkeypatch.setattr(sys, "argv", ["bench_targets.py", "--processes", "2", "--out", str(tmp_path), "--sizes", "4x3"])
    with pytest.raises(SystemExit, match=r"bench.py failed in process 1 \(exit 1; see .*process-1.md\)"):
        bench_targets.main()
    assert "bench.py: expected sizes as TxBxIxH[,TxBxIxH...], got '4x3'" in capfd.readouterr().err
    assert not (tmp_path / "process-2.md").exists()  # the first failure ends the run


def test_the_routes_table_lists_every_shape_any_process_chose_a_route_for() -> None:
    from bench_targets import Process, routes_table

    processes = [
        Process([], {"16 × 1024 × 4096 (2)": "packed", "16 × 4096 × 1024 (2)": "brgemm"}),
        Process([], {"16 × 1024 × 4096 (2)": "blas"}),
    ]
    assert routes_table(processes) == [
        "| rows × K × N (threads) | process 1 | process 2 |",
        "|---|---|---|",
        "| 16 × 1024 × 4096 (2) | packed | blas |",
        "| 16 × 4096 × 1024 (2) | brgemm | - |",
    ]
    assert routes_table([Process([], {})]) == []
