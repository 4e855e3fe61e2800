"""``scripts/compare_arms.py``: two sweeps' differences from their plain LSTMs, and how much they moved, from known
numbers."""

from __future__ import annotations

import csv
from pathlib import Path

import compare_arms
import pytest

TRIALS = ["norm", "batch_size", "lr", "seed", "status", "val_bpc", "val_bpc_exact", "fallback_per_update"]
RESULTS = ["norm", "batch_size", "status", "lr", "lr_chosen_on"]


def _arm(folder: Path, values: dict[str, list[float]], tails: list[float], shift: float = 0.0) -> Path:
    """An arm at B=8: none and layer at rate 0.01, BN at 0.003 on exact statistics (its running ones shifted by 1,
    and a selection seed and an unchosen rate that must be ignored)."""
    folder.mkdir()
    with open(folder / "results.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, RESULTS)
        writer.writeheader()
        writer.writerow({"norm": "none", "batch_size": 8, "status": "ok", "lr": 0.01, "lr_chosen_on": "val_loss"})
        writer.writerow({"norm": "layer", "batch_size": 8, "status": "ok", "lr": 0.01, "lr_chosen_on": "val_loss"})
        writer.writerow(
            {"norm": "batch", "batch_size": 8, "status": "ok", "lr": 0.003, "lr_chosen_on": "val_loss_exact"}
        )
    with open(folder / "trials.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, TRIALS)
        writer.writeheader()
        for norm, lr in (("none", 0.01), ("layer", 0.01), ("batch", 0.003)):
            for seed, value in enumerate(values[norm]):
                row = {"norm": norm, "batch_size": 8, "lr": lr, "seed": seed, "status": "ok", "val_bpc": value}
                if norm == "batch":
                    row.update(val_bpc=value + 1, val_bpc_exact=value + shift, fallback_per_update=tails[seed])
                writer.writerow(row)
            writer.writerow({"norm": norm, "batch_size": 8, "lr": lr, "seed": 1000, "status": "ok", "val_bpc": 9.0})
            writer.writerow({"norm": norm, "batch_size": 8, "lr": 0.03, "seed": 0, "status": "ok", "val_bpc": 9.0})
    return folder


def test_the_change_is_the_per_seed_difference_of_the_differences(tmp_path: Path) -> None:
    none = [2.0, 2.1, 2.2]
    first = _arm(tmp_path / "a", {"none": none, "layer": [1.9, 2.0, 2.1], "batch": [2.5, 2.5, 2.8]}, [3.0, 3.0, 3.3])
    second = _arm(
        tmp_path / "b", {"none": none, "layer": [1.9, 2.0, 2.1], "batch": [2.3, 2.35, 2.5]}, [0.1, 0.2, 0.3], shift=0.1
    )
    rows = {row["norm"]: row for row in compare_arms.compare(first, second, ("random", "bucketed"))}
    assert set(rows) == {"layer", "batch"}
    batch = rows["batch"]
    # BN minus none, exact statistics: (0.5, 0.4, 0.6) in the first arm, (0.4, 0.35, 0.4) in the second.
    assert batch["random_diff_vs_none"] == pytest.approx(0.5)
    assert batch["bucketed_diff_vs_none"] == pytest.approx(1.15 / 3)
    assert batch["change"] == pytest.approx(-0.35 / 3)  # (-0.1, -0.05, -0.2)
    assert batch["change_n"] == 3 and batch["change_held"] == 3
    assert batch["random_tail_steps_per_update"] == pytest.approx(3.1)
    assert batch["bucketed_tail_steps_per_update"] == pytest.approx(0.2)
    assert rows["layer"]["change"] == pytest.approx(0.0)


def test_the_table_and_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    values = {"none": [2.0, 2.1], "layer": [1.9, 2.0], "batch": [2.5, 2.6]}
    first, second = _arm(tmp_path / "a", values, [3.0, 3.0]), _arm(tmp_path / "b", values, [0.5, 0.5])
    assert compare_arms.main([str(first), str(second), "--names", "random", "bucketed", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "| batch | 8 | +0.500 [+0.500, +0.500], 2/2 | +0.500 [+0.500, +0.500], 2/2 |" in printed
    assert "| 3.00 / 0.50 |" in printed
    assert (tmp_path / "comparison.md").read_text().startswith(printed.rstrip("\n"))
    with open(tmp_path / "comparison.csv", newline="") as file:
        assert [row["norm"] for row in csv.DictReader(file)] == ["batch", "layer"]


def test_a_folder_without_a_sweep_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"expected .*results\.csv \(a batch_size_sweep\.py --out folder\)"):
        compare_arms.compare(tmp_path, tmp_path, ("a", "b"))


def test_another_scripts_folder_is_one_line(tmp_path: Path) -> None:
    # length_generalization.py writes results.csv and trials.csv too, without batch sizes: a KeyError, before
    arm = _arm(tmp_path / "sweep", {"none": [1.0], "layer": [1.0], "batch": [1.0]}, [0.0])
    other = tmp_path / "other"
    other.mkdir()
    (other / "results.csv").write_text("norm,status,lr,trained_length\nlayer,ok,0.01,50\n")
    (other / "trials.csv").write_text("norm,seed,status\nlayer,0,ok\n")
    with pytest.raises(SystemExit, match=r"results\.csv of a batch_size_sweep\.py --out folder, .*without batch_size$"):
        compare_arms.compare(arm, other, ("a", "b"))


def test_an_out_folder_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    arm = _arm(tmp_path / "sweep", {"none": [1.0], "layer": [1.0], "batch": [1.0]}, [0.0])
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SystemExit, match=r"^error: --out .*a_file/sub: cannot create the folder \(Not a directory\)$"):
        compare_arms.main([str(arm), str(arm), "--out", str(blocker / "sub")])
