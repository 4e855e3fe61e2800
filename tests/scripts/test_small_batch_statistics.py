"""Small-batch statistics on tiny settings: the measurements that follow from sampling, not from training luck."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from copy import deepcopy
from pathlib import Path

import _common
import _data
import pytest
import small_batch_statistics
import torch
import torch.nn.functional as F

from seqnorm.data import synthetic_lines


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


def test_the_train_eval_gap_compares_both_modes_on_the_same_windows(tmp_path: Path) -> None:
    # it subtracted an eval-mode loss over all N windows from a train-mode one over the first N - N % B; and
    # evaluating after the train-mode pass would read running statistics that pass had moved
    path = tmp_path / "lines.txt"
    path.write_text("\n".join(synthetic_lines(200, seed=3)))
    args = argparse.Namespace(text=str(path), dataset=None, seed=0, cache_dir=None)
    corpus, splits = _data.load_sequences(args, 12, "window")
    model = _common.build_model(corpus.vocab_size, argparse.Namespace(embedding=8, hidden=8, seed=0), "batch", 12)
    _common.train_language_model(model, splits["train"], batch_size=4, tokens=200, lr=1e-2)
    val, batch = splits["val"], 4
    assert len(val) % batch  # some windows are left out of the batched pass
    before = {name: value.clone() for name, value in model.state_dict().items()}
    usable = len(val) - len(val) % batch

    def loss(training: bool) -> float:
        copy = deepcopy(model).train(training)
        with torch.no_grad():
            losses = [
                F.cross_entropy(copy(val.inputs[i : i + batch]).flatten(0, 1), val.targets[i : i + batch].flatten())
                for i in range(0, usable, batch)
            ]
        return float(torch.stack(losses).mean())

    expected = loss(True) - loss(False)
    assert small_batch_statistics.train_eval_gap(model, val, batch) == pytest.approx(expected, abs=1e-6)
    for name, value in model.state_dict().items():  # the model measured is untouched
        assert torch.equal(value, before[name]), name
