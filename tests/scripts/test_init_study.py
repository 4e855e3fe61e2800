"""The init study on tiny settings: one row per init x norm, finite variances and gradients."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import init_study
import pytest

from tests.conftest import KINDS


@pytest.mark.parametrize("cell", KINDS)
def test_rows(tmp_path: Path, cell: str, read_csv: Callable, finite: Callable) -> None:
    out = tmp_path / cell
    init_study.main(
        ["--quick", "--cell", cell, "--steps", "5", "--hidden", "8", "--input-size", "4", "--batch-size", "4",
         "--norms", "none", "layer", "batch", "--inits", "default", "orthogonal", "--out", str(out)]
    )  # fmt: skip
    rows = read_csv(out / "results.csv")
    assert [(row["norm"], row["init"]) for row in rows] == [
        (norm, init) for norm in ("none", "layer", "batch") for init in ("default", "orthogonal")
    ]
    for row in rows:
        assert row["status"] == "ok"
        for key in ("h_std_first", "h_std_last", "grad_first", "grad_last", "log10_grad_ratio"):
            assert finite(row[key]), (row["norm"], row["init"], key)
        assert float(row["h_std_last"]) > 0 and float(row["grad_last"]) > 0
        assert (row["c_std_last"] != "") == (cell == "lstm")
    assert (out / "variance_through_time.png").exists()
