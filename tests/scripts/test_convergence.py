"""The near-convergence tool on tiny settings: every cell, its learning curve and gradient profiles, paired
differences, and a grid that resumes from the runs it finished."""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common
import _data
import convergence
import pytest
import torch
import torch.nn.functional as F

from seqnorm.data import synthetic_lines


def _text(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(synthetic_lines(300, seed=4)))
    return path


def _argv(tmp_path: Path, *norms: str) -> list[str]:
    return ["--quick", "--text", str(_text(tmp_path)), "--norms", *norms, "--batch-sizes", "1", "4", "--seq-lens",
            "6", "--updates", "12", "--evaluations", "3", "--grad-points", "2", "--grad-rows", "4", "--hidden", "8",
            "--embedding", "8", "--val-tokens", "120", "--seeds", "2", "--lrs", "0.003", "0.01", "--out",
            str(tmp_path / "out")]  # fmt: skip


def test_cells_curves_gradients_paired_differences_and_resume(
    tmp_path: Path, read_csv: Callable, finite: Callable
) -> None:
    out = tmp_path / "out"
    convergence.main(_argv(tmp_path, "none"))  # a first, partial grid: a run killed after the plain LSTM's cells
    runs_of_none = len((out / "runs.jsonl").read_text().splitlines())
    convergence.main(_argv(tmp_path, "none", "layer", "batch"))
    markdown = (out / "results.md").read_text()
    assert f"{runs_of_none} runs were read back" in markdown  # the finished cells were not trained again

    rows = {(row["norm"], int(row["batch_size"])): row for row in read_csv(out / "results.csv")}
    assert set(rows) == {(norm, size) for norm in ("none", "layer", "batch") for size in (1, 4)}
    assert rows[("batch", 1)]["status"].startswith("ValueError")
    trials = read_csv(out / "trials.csv")
    for key, row in rows.items():
        if key == ("batch", 1):
            continue
        assert row["status"] == "ok" and int(row["updates"]) == 12 and finite(row["val_bpc"]), key
        assert finite(row["gain_last_fifth"]) and float(row["ms_per_update"]) > 0, key
    assert finite(rows[("batch", 4)]["val_bpc_exact"]) and rows[("batch", 4)]["lr_chosen_on"] == "val_loss_exact"
    # the rate was chosen on runs of a quarter of the updates, seed 0 only
    selection = read_csv(out / "selection.csv")
    assert {(r["updates"], r["seed"]) for r in selection if r["status"] == "ok"} == {("3", "0")}
    # paired differences from the per-seed rows: BN on its exact statistics, the plain LSTM on its own
    for norm, key in (("layer", "val_bpc"), ("batch", "val_bpc_exact")):
        seeds = {
            n: {int(t["seed"]): float(t[k]) for t in trials if (t["norm"], t["batch_size"]) == (n, "4")}
            for n, k in ((norm, key), ("none", "val_bpc"))
        }
        differences = [seeds[norm][seed] - seeds["none"][seed] for seed in (0, 1)]
        assert float(rows[(norm, 4)]["diff_vs_none"]) == pytest.approx(statistics.fmean(differences), abs=1e-6)
        assert int(rows[(norm, 4)]["diff_vs_none_n"]) == 2
    # learning curves at updates 0, 4, 8, 12; gradient profiles at the start and the end, every step t
    curves = read_csv(out / "curves.csv")
    grads = read_csv(out / "grad_norms.csv")
    for t in trials:
        if t["status"] != "ok":
            continue
        run = (t["norm"], t["batch_size"], t["seed"])
        assert [int(c["update"]) for c in curves if (c["norm"], c["batch_size"], c["seed"]) == run] == [0, 4, 8, 12]
        profile = [g for g in grads if (g["norm"], g["batch_size"], g["seed"]) == run]
        assert sorted({(int(g["update"]), int(g["t"])) for g in profile}) == [(u, s) for u in (0, 12) for s in range(6)]
        assert all(float(g["grad_total"]) > 0 and float(g["grad_last"]) > 0 for g in profile)
    assert (out / "learning_curves.png").stat().st_size > 0 and (out / "grad_through_time.png").stat().st_size > 0
    # the reach table: grad_last at the first step over the last, geometric mean over the chosen seeds
    reach = {
        (r["norm"], r["B"]): r
        for r in convergence.gradient_reach(convergence.main(_argv(tmp_path, "none", "layer", "batch")))
    }
    for (norm, size), row in reach.items():
        for column, update in (("at_init", 0), ("at_end", 12)):
            ratios = []
            for seed in (0, 1):
                run = [
                    g
                    for g in grads
                    if (g["norm"], g["batch_size"], g["seed"], g["update"]) == (norm, str(size), str(seed), str(update))
                ]
                ratios.append(math.log10(float(run[0]["grad_last"]) / float(run[-1]["grad_last"])))
            assert float(row[column]) == pytest.approx(10 ** statistics.fmean(ratios), rel=0.06), (norm, size, column)
    assert ("batch", 1) not in reach and len(reach) == 5
    # settled: paired differences on the learning curves (points at updates 0, 4, 8, 12: "half" is the point of index 2)
    rows_now = convergence.main(_argv(tmp_path, "none", "layer", "batch"))
    table = {(r["norm"], r["B"]): r for r in convergence.settled(rows_now, "char")}
    assert set(table) == {("layer", 1), ("layer", 4), ("batch", 4)}
    for column, update in (("at_end", "12"), ("at_half", "8")):
        at = {
            (c["norm"], c["seed"]): float(c["val_bpc"])
            for c in curves
            if c["batch_size"] == "4" and c["update"] == update
        }
        expected = statistics.fmean(at[("layer", seed)] - at[("none", seed)] for seed in ("0", "1"))
        assert float(table[("layer", 4)][column]) == pytest.approx(expected, abs=6e-4)
    # LN against BN, paired by seed: LN's val_bpc minus BN's exact-statistics val_bpc
    against = {(r["norm"], r["B"]): r["minus_batch"] for r in convergence.against_batch_norm(rows_now, "val_bpc")}
    assert set(against) == {("none", 4), ("layer", 4)}
    by_seed = {(t["norm"], t["seed"]): t for t in trials if t["batch_size"] == "4"}
    differences = [
        float(by_seed[("layer", s)]["val_bpc"]) - float(by_seed[("batch", s)]["val_bpc_exact"]) for s in "01"
    ]
    assert float(against[("layer", 4)].split()[0]) == pytest.approx(statistics.fmean(differences), abs=6e-4)
    assert against[("layer", 4)].endswith("/2")

    every_run = len((out / "runs.jsonl").read_text().splitlines())
    convergence.main(_argv(tmp_path, "none", "layer", "batch"))  # all finished: nothing trains again
    assert f"{every_run} runs were read back" in (out / "results.md").read_text()
    assert read_csv(out / "trials.csv") == trials


@pytest.mark.parametrize("norm", ["none", "layer"])
def test_the_gradient_through_time_is_the_total_derivative_through_the_recurrence(tmp_path: Path, norm: str) -> None:
    # against the model run one step at a time, the state carried with its graph: dL/dh_t includes every later step
    data_args = argparse.Namespace(text=str(_text(tmp_path)), dataset=None, seed=0, cache_dir=None)
    corpus, splits = _data.load_sequences(data_args, 7, "window")
    val = splits["val"]
    model = _common.build_model(corpus.vocab_size, argparse.Namespace(embedding=8, hidden=8, seed=0), norm, 7)
    total, last = convergence.gradient_through_time(model, val, batch_size=2, rows=4)
    expected_total, expected_last = torch.zeros(7), torch.zeros(7)
    for start in (0, 2):
        batch = val.batch(torch.arange(start, start + 2))
        state, outputs, states, losses = None, [], [], []
        for t in range(7):
            output, state = model.rnn(model.embedding(batch.inputs[:, t : t + 1]), state, first_step=t)
            outputs.append(output[:, 0])  # h_t as the readout reads it
            states.append(state[0])  # h_t as the next step reads it: (layers, B, H)
            logits = model.projection(outputs[-1])
            losses.append(F.cross_entropy(logits, batch.targets[:, t], reduction="none"))
        per_position = torch.stack(losses, 1)  # (B, T)
        for loss, expected in (
            (per_position.mean(1).sum(), expected_total),
            (per_position[:, -1].sum(), expected_last),
        ):
            grads = torch.autograd.grad(loss, outputs + states, retain_graph=True, allow_unused=True)
            for t in range(7):  # the total derivative: both uses of h_t
                direct, onward = grads[t], grads[7 + t]
                total_t = (direct if direct is not None else 0) + (onward[0] if onward is not None else 0)
                expected[t] += total_t.norm(dim=1).sum()
    torch.testing.assert_close(torch.tensor(total).float(), expected_total / 4, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(torch.tensor(last).float(), expected_last / 4, rtol=1e-5, atol=1e-8)
    assert last[0] < last[-1]  # the last prediction's gradient fades going back (a check that t is not reversed)


def test_report_test_gives_the_best_validation_points_test_number_beside_the_last(
    tmp_path: Path, read_csv: Callable, finite: Callable
) -> None:
    """The carved test split was never reported, and the reported number was the selection's own metric."""
    out = tmp_path / "out"
    argv = [*_argv(tmp_path, "none", "layer", "batch"), "--report", "test", "--select", "apart", "--select-seeds", "1"]
    convergence.main([*argv, "--updates", "24", "--evaluations", "6"])
    selection = read_csv(out / "selection.csv")
    assert {int(row["seed"]) for row in selection} == {1000}  # chosen apart from the reported seeds 0 and 1
    trials = read_csv(out / "trials.csv")
    assert {int(row["seed"]) for row in trials if row["status"] == "ok"} == {0, 1}  # a failed cell: its reason
    rows = {(row["norm"], int(row["batch_size"])): row for row in read_csv(out / "results.csv")}
    layer = rows[("layer", 4)]
    assert finite(layer["best_test_bpc"]) and finite(layer["test_bpc"]) and finite(layer["best_val_bpc"])
    assert finite(rows[("batch", 4)]["best_test_bpc_exact"])
    markdown = (out / "results.md").read_text()
    assert "best_test_bpc is the headline" in markdown and "last_test_bpc" in markdown
    for row in (row for row in trials if row["norm"] == "layer" and row["batch_size"] == "4"):
        assert 0 < int(row["best_update"]) <= 24  # a point of the curve, not the untrained model
        # the best point has the lowest validation loss of the curve: the last point's is no lower
        assert float(row["best_val_bpc"]) <= float(row["val_bpc"]) + 1e-6
        if int(row["best_update"]) == 24:  # the best point is the last: the same model, the same test number
            assert float(row["best_test_bpc"]) == pytest.approx(float(row["test_bpc"]))
    # the test split is what the tables headline: their paired differences are computed from it
    paired = statistics.fmean(
        float(a["best_test_bpc"]) - float(b["best_test_bpc"])
        for a in trials
        for b in trials
        if (a["norm"], b["norm"], a["batch_size"], b["batch_size"]) == ("layer", "none", "4", "4")
        and a["seed"] == b["seed"]
    )
    assert float(layer["diff_vs_none"]) == pytest.approx(paired, rel=1e-5)  # the CSVs keep 8 digits


@pytest.mark.parametrize("gamma", [0.1, 1.0])
def test_gamma_init_sets_every_norms_initial_gain(gamma: float) -> None:
    args = argparse.Namespace(hidden=8, embedding=4, seed=0, gamma_init=gamma)
    for norm in ("layer", "batch", "rms"):
        model = _common.build_model(10, args, norm, max_steps=5)
        gains = [p for name, p in model.named_parameters() if name.endswith("weight") and "norm" in name]
        assert gains and all(torch.all(p == gamma) for p in gains), norm
    assert _common.build_model(10, args, "none", max_steps=5) is not None  # no norm, no gain: nothing to set


def test_updates_by_batch_size() -> None:
    args = convergence.parse_args(["--batch-sizes", "1", "32", "--updates", "1:20000", "3000"])
    assert args.updates == {1: 20000, 32: 3000}
    assert convergence.parse_args(["--batch-sizes", "1", "32"]).updates == {1: 20000, 32: 3000}  # the default
    for bad in (["--updates", "1:500"], ["--updates", "x"], ["--updates", "0"], ["--select-fraction", "2"]):
        with pytest.raises(SystemExit):
            convergence.parse_args(["--batch-sizes", "1", "32", *bad])
    assert math.isclose(convergence.parse_args(["--quick"]).select_fraction, 0.25)


def test_a_gradient_below_float32s_range_is_counted_not_averaged() -> None:
    # over 400 steps the plain LSTM's last-position gradient reaches the first step as exactly 0 at initialization
    def profile(first: float) -> list[dict[str, Any]]:
        return [{"update": 0, "last": [first, 1.0, 2.0]}, {"update": 9, "last": [1e-6, 1.0, 1.0]}]

    def row(*firsts: float) -> dict[str, Any]:
        return {"steps": 3, "batch_size": 2, "norm": "none", "chosen": [{"grads": profile(f)} for f in firsts]}

    (all_zero,) = convergence.gradient_reach([row(0.0, 0.0)])
    assert all_zero["at_init"] == "0 (float32 underflow)" and all_zero["at_end"] == "1.0e-06"
    (some_zero,) = convergence.gradient_reach([row(0.0, 2e-8)])
    assert some_zero["at_init"] == "1.0e-08; 0 in 1 of 2 seeds"
