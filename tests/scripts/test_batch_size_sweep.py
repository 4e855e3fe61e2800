"""The batch-size sweep on tiny settings: a row per (norm, batch size) under the fair protocol, BN's error recorded."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

import batch_size_sweep
import pytest

from seqnorm.data import synthetic_lines

TINY = ["--quick", "--tokens", "160", "--steps", "8", "--hidden", "8", "--embedding", "8", "--val-tokens", "160"]


def test_grid_rows_and_statuses(tmp_path: Path, read_csv: Callable, finite: Callable) -> None:
    out = tmp_path / "sweep"
    argv = [*TINY, "--norms", "layer", "batch", "none", "--batch-sizes", "1", "2", "--out", str(out)]
    batch_size_sweep.main(argv)
    rows = read_csv(out / "results.csv")
    assert {"norm", "batch_size", "status", "val_loss", "val_bpc"} <= set(rows[0])
    cells = {(row["norm"], int(row["batch_size"])): row for row in rows}
    assert set(cells) == {(norm, size) for norm in ("layer", "batch", "none") for size in (1, 2)}
    bn_at_1 = cells[("batch", 1)]
    assert bn_at_1["status"].startswith("ValueError")
    assert "batch size 1" in bn_at_1["status"]
    assert bn_at_1["val_loss"] == "nan"
    for key, row in cells.items():
        if key != ("batch", 1):
            assert row["status"] == "ok", key
            assert finite(row["val_loss"]) and finite(row["val_bpc"]), key
            assert int(row["tokens"]) >= 160
    markdown = (out / "results.md").read_text()
    assert "| norm | batch_size | status | lr | seeds | val_bpc |" in markdown
    assert "Command: `python scripts/batch_size_sweep.py --quick" in markdown
    assert (out / "val_by_batch_size.png").stat().st_size > 0
    # BN is evaluated twice (running and exact statistics); the batch-independent norms once.
    for (norm, size), row in cells.items():
        has_exact = norm == "batch" and size == 2
        assert finite(row["val_bpc_exact"]) == has_exact and finite(row["ema_gap"]) == has_exact, (norm, size)
    assert float(cells[("batch", 2)]["ema_gap"]) == pytest.approx(
        float(cells[("batch", 2)]["val_bpc"]) - float(cells[("batch", 2)]["val_bpc_exact"]), abs=1e-6
    )
    assert "BN with exact statistics" in markdown and "Chosen learning rate" in markdown


def test_protocol_chooses_the_best_mean_and_reports_every_run(tmp_path: Path, read_csv: Callable) -> None:
    out = tmp_path / "sweep"
    lrs = ["0.0001", "0.01"]
    argv = [*TINY, "--norms", "none", "layer", "--batch-sizes", "2", "8", "--lrs", *lrs, "--seeds", "3",
            "--select", "mean", "--lr-extensions", "0", "--out", str(out)]  # fmt: skip
    returned = batch_size_sweep.main(argv)
    trials = read_csv(out / "trials.csv")
    assert len(trials) == 2 * 2 * len(lrs) * 3
    table = batch_size_sweep.summary(returned, "val_bpc")  # what demo.py prints
    assert [row["norm"] for row in table] == ["none", "layer"] and batch_size_sweep.summary_columns(returned) == [
        "B=2",
        "B=8",
    ]
    assert all(" ± " in row[column] for row in table for column in ("B=2", "B=8"))
    for row in read_csv(out / "results.csv"):
        runs = [t for t in trials if (t["norm"], t["batch_size"]) == (row["norm"], row["batch_size"])]
        means = {lr: statistics.fmean(float(t["val_loss"]) for t in runs if t["lr"] == lr) for lr in lrs}
        assert float(row["lr"]) == float(min(means, key=means.__getitem__))
        chosen = [float(t["val_loss"]) for t in runs if float(t["lr"]) == float(row["lr"])]
        assert float(row["val_loss"]) == pytest.approx(statistics.fmean(chosen), rel=1e-6)
        assert float(row["val_loss_std"]) == pytest.approx(statistics.stdev(chosen), rel=1e-5)  # CSV: 8 digits
        assert row["seeds"] == "3" and row["val_bpc_exact"] == ""
    # Equal tokens: every run saw the budget (and less than one more batch of 8-step windows).
    assert all(160 <= int(t["tokens"]) < 160 + 8 * int(t["batch_size"]) for t in trials)
    markdown = (out / "results.md").read_text()
    assert "| norm | batch_size | lr=0.0001 | lr=0.01 |" in markdown


def test_lines_and_equal_updates(tmp_path: Path, read_csv: Callable, finite: Callable) -> None:
    out = tmp_path / "sweep"
    argv = [*TINY, "--unit", "line", "--updates", "3", "--evaluations", "2", "--norms", "none", "--batch-sizes", "2",
            "4", "--out", str(out)]  # fmt: skip
    batch_size_sweep.main(argv)
    rows = read_csv(out / "results.csv")
    assert [int(row["updates"]) for row in rows] == [3, 3]
    assert all(row["status"] == "ok" and finite(row["val_loss"]) and finite(row["last_gain"]) for row in rows)
    curves = read_csv(out / "curves.csv")
    trials = read_csv(out / "trials.csv")
    assert {(c["lr"], c["seed"], c["batch_size"]) for c in curves} == {
        (t["lr"], t["seed"], t["batch_size"]) for t in trials
    }
    assert min(int(c["tokens"]) for c in curves) == 0 and (out / "learning_curves.png").exists()
    assert "lines (pieces of at most 8)" in (out / "results.md").read_text()


def test_user_text_file(tmp_path: Path, read_csv: Callable, finite: Callable) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(synthetic_lines(300, seed=1)))
    out = tmp_path / "sweep"
    batch_size_sweep.main([*TINY, "--text", str(text), "--norms", "rms", "--batch-sizes", "2", "--out", str(out)])
    (row,) = read_csv(out / "results.csv")
    assert row["status"] == "ok" and finite(row["val_loss"])


@pytest.mark.parametrize("argv", [["--dataset", "no_such_corpus"], ["--text", "a.txt", "--dataset", "ptb_char"]])
def test_bad_sources_are_refused_before_any_download(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        batch_size_sweep.main(argv)


def test_bn_on_lines_uses_running_statistics_at_single_row_tails(tmp_path: Path, read_csv: Callable) -> None:
    rows = {}
    for unit in ("line", "window"):
        out = tmp_path / unit
        argv = [*TINY, "--unit", unit, "--tokens", "400", "--norms", "batch", "--batch-sizes", "4", "--seeds", "1",
                "--out", str(out)]  # fmt: skip
        batch_size_sweep.main(argv)
        (rows[unit],) = read_csv(out / "results.csv")
    assert rows["line"]["status"] == "ok" and float(rows["line"]["fallback_per_update"]) > 0
    assert rows["window"]["status"] == "ok" and float(rows["window"]["fallback_per_update"]) == 0


def test_the_demo_says_what_its_short_run_cannot_show() -> None:
    """``make demo`` ended on LN behind no normalization (3.775 against 3.754 at batch 1) beside a story that LN
    works: it now says, in the run's own numbers, that the short run cannot rank them, and where the runs that can
    are."""
    import demo

    def cell(norm: str, size: int, bpc: float, std: float, status: str = "ok") -> dict:
        return {"norm": norm, "batch_size": size, "val_bpc": bpc, "val_bpc_std": std, "status": status}

    rows = [
        cell("none", 1, 3.754, 0.020), cell("layer", 1, 3.775, 0.031), cell("batch", 1, 0.0, 0.0, "ValueError: ..."),
        cell("none", 32, 3.905, 0.010), cell("layer", 32, 3.868, 0.012),
    ]  # fmt: skip
    said = demo.what_a_short_run_shows(rows, "val_bpc")
    assert "\n  B=1: LN behind no norm by 0.021 (seed std up to 0.031)\n  B=32: LN ahead of no norm by 0.037" in said
    assert "per-timestep BN cannot train at batch size 1" in said and "docs/results.md" in said


def test_the_demo_refuses_fewer_fit_steps_than_it_validates_at(capsys: pytest.CaptureFixture[str]) -> None:
    """``--fit-steps 1`` ran every experiment, then ended in Lightning's ZeroDivisionError (validation every half)."""
    import demo

    with pytest.raises(SystemExit) as stopped:
        demo.main(["--fit-steps", "1"])
    assert stopped.value.code == 2 and "argument --fit-steps: expected an int >= 2, got '1'" in capsys.readouterr().err
