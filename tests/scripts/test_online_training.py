"""Online training's quick path on tiny settings: LN learns at batch size 1, BN's row holds its error."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import online_training


def test_curves_and_statuses(tmp_path: Path, read_csv: Callable, finite: Callable) -> None:
    out = tmp_path / "online"
    online_training.main(
        ["--quick", "--tokens", "160", "--evaluations", "2", "--steps", "8", "--hidden", "8", "--embedding", "8",
         "--val-tokens", "160", "--norms", "layer", "batch", "--lr-extensions", "0", "--out", str(out)]
    )  # fmt: skip
    rows = {(row["norm"], int(row["batch_size"])): row for row in read_csv(out / "results.csv")}
    assert set(rows) == {("layer", 1), ("layer", 32), ("batch", 1), ("batch", 32)}
    assert rows[("batch", 1)]["status"].startswith("ValueError")
    for key in (("layer", 1), ("layer", 32), ("batch", 32)):
        assert rows[key]["status"] == "ok" and finite(rows[key]["val_loss"]), key
    assert int(rows[("layer", 1)]["updates"]) == 20  # 160 tokens, one 8-step window per update
    # The fair protocol: a rate from the quick grid, two seeds, BN (only) also with exact statistics.
    for key in (("layer", 1), ("layer", 32), ("batch", 32)):
        assert float(rows[key]["lr"]) in online_training.QUICK["lrs"] and rows[key]["seeds"] == "2", key
    assert finite(rows[("batch", 32)]["val_bpc_exact"]) and finite(rows[("batch", 32)]["ema_gap"])
    assert rows[("layer", 1)]["val_bpc_exact"] == ""
    trials = read_csv(out / "trials.csv")
    assert len([t for t in trials if (t["norm"], t["batch_size"]) == ("layer", "1")]) == 3  # 2 rates, then seed 1
    curve = [row for row in read_csv(out / "curves.csv") if row["norm"] == "layer" and row["batch_size"] == "1"]
    assert [int(row["tokens"]) for row in curve] == [0, 80, 160]
    assert all(finite(row["val_bpc"]) for row in curve)
    assert (out / "learning_curves.png").exists()
