"""The batch-size sweep's quick path on tiny settings: one row per (norm, batch size), BN's error recorded."""

from __future__ import annotations

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
    assert "| norm | batch_size | status | val_loss |" in markdown
    assert "Command: `python scripts/batch_size_sweep.py --quick" in markdown
    assert (out / "val_by_batch_size.png").stat().st_size > 0


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
