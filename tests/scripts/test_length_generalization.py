"""Length generalization's quick path on tiny settings: every variant trains and has a loss at every position."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import length_generalization
import pytest


def test_rows_and_loss_by_position(tmp_path: Path, read_csv: Callable, finite: Callable) -> None:
    out = tmp_path / "length"
    length_generalization.main(
        ["--quick", "--steps", "6", "--eval-steps", "12", "--tokens", "200", "--batch-size", "4", "--hidden", "8",
         "--embedding", "8", "--val-tokens", "240", "--norms", "none", "layer", "batch", "--out", str(out)]
    )  # fmt: skip
    rows = read_csv(out / "results.csv")
    assert [(row["norm"], row["max_steps"]) for row in rows] == [
        ("none", "6"),
        ("layer", "6"),
        ("batch", "6"),
        ("batch", "6"),
        ("batch", "12"),
    ]
    assert [row["stats_beyond_T"] for row in rows] == [
        "none needed",
        "none needed",
        "reuse step 5",
        "pooled steps 0..5",
        "untrained rows (0/1)",
    ]
    for row in rows:
        assert row["status"] == "ok"
        assert finite(row["loss_beyond_T_exact"]) == (row["norm"] == "batch")  # BN also with exact statistics
        assert all(finite(row[key]) for key in ("loss_within_T", "loss_beyond_T", "beyond_minus_within"))
    positions = read_csv(out / "loss_by_position.csv")
    assert len(positions) == 12 and all(finite(value) for row in positions for value in row.values())
    assert (out / "loss_by_position.png").exists()


def test_eval_steps_must_exceed_steps() -> None:
    with pytest.raises(SystemExit):
        length_generalization.main(["--steps", "10", "--eval-steps", "10"])
