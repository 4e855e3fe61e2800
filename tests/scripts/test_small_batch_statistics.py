"""Small-batch statistics on tiny settings: the measurements that follow from sampling, not from training luck."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import small_batch_statistics


def test_mechanism_rows(tmp_path: Path, read_csv: Callable, finite: Callable) -> None:
    out = tmp_path / "small"
    small_batch_statistics.main(
        ["--quick", "--batch-sizes", "1", "2", "4", "16", "--steps", "6", "--tokens", "300", "--hidden", "8",
         "--embedding", "8", "--val-tokens", "1200", "--out", str(out)]
    )  # fmt: skip
    rows = {int(row["batch_size"]): row for row in read_csv(out / "results.csv")}
    assert set(rows) == {1, 2, 4, 16}
    # Batch size 1: every batch has a single-row step, and BN in training mode raises.
    assert float(rows[1]["raising_batches_random"]) == 1.0
    assert rows[1]["train_mode_status"].startswith("ValueError")
    for size in (2, 4, 16):
        row = rows[size]
        assert row["train_mode_status"] == "ok" and finite(row["train_eval_gap"])
        assert 0.0 < float(row["active_share_random"]) <= float(row["active_share_bucketed"]) <= 1.0
        # The spread of batch means follows sampling theory closely (medians over hundreds of features).
        assert math.isclose(float(row["mean_noise"]), float(row["mean_noise_theory"]), rel_tol=0.2)
    assert finite(rows[4]["eval_mode_loss_exact"]) and finite(rows[4]["train_eval_gap_std"])  # seeds' spread
    assert float(rows[2]["mean_noise"]) > float(rows[16]["mean_noise"])
    assert float(rows[2]["var_noise"]) > float(rows[16]["var_noise"])
    by_step = read_csv(out / "effective_batch_by_step.csv")
    assert {"batch_size", "batching", "step", "active_share_when_running"} <= set(by_step[0])
    assert (out / "small_batch_statistics.png").exists()
