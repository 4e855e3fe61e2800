"""The fair protocol (``scripts/_protocol.py``) and the data it trains on (``scripts/_data.py``), on tiny settings."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import _common
import _data
import _protocol
import pytest
import torch

import seqnorm
from seqnorm.data import BucketBatchSampler, synthetic_lines


def _fake(losses: dict[tuple[float, int], float], failing: set[tuple[float, int]] = frozenset()):  # type: ignore[assignment]
    """A ``train_one`` that returns the given validation loss of each (lr, seed) and records the calls."""
    calls: list[tuple[float, int]] = []

    def train_one(lr: float, seed: int) -> dict[str, object]:
        calls.append((lr, seed))
        if (lr, seed) in failing:
            return {"status": "diverged: loss nan at update 3", "val_loss": math.nan, "updates": 3}
        return {"status": "ok", "val_loss": losses[(lr, seed)], "updates": 10}

    return train_one, calls


# Seed 0 alone prefers lr 0.1; the mean over seeds prefers lr 0.01.
LOSSES = {(0.01, 0): 2.0, (0.01, 1): 2.0, (0.01, 2): 2.0, (0.1, 0): 1.9, (0.1, 1): 2.5, (0.1, 2): 2.5}


def test_mean_rule_picks_the_best_mean_over_seeds() -> None:
    train_one, calls = _fake(LOSSES)
    cell = _protocol.run_cell(train_one, [0.01, 0.1], seeds=3, select="mean")
    assert cell.lr == 0.01
    assert sorted(calls) == sorted(LOSSES)  # every lr x seed ran
    assert [row["seed"] for row in cell.chosen] == [0, 1, 2]


def test_first_rule_chooses_on_seed_zero_then_runs_the_other_seeds_at_that_rate_only() -> None:
    train_one, calls = _fake(LOSSES)
    cell = _protocol.run_cell(train_one, [0.01, 0.1], seeds=3, select="first")
    assert cell.lr == 0.1
    assert calls == [(0.01, 0), (0.1, 0), (0.1, 1), (0.1, 2)]
    assert {(row["lr"], row["seed"]) for row in cell.chosen} == {(0.1, 0), (0.1, 1), (0.1, 2)}


def test_apart_rule_chooses_on_seeds_that_are_not_reported() -> None:
    """Seed 0 both chose the rate and was reported: the selection's optimism went into the headline."""
    start = _protocol.SELECTION_SEEDS_FROM
    losses = {**LOSSES, (0.01, start): 2.4, (0.01, start + 1): 2.4, (0.1, start): 2.0, (0.1, start + 1): 2.1}
    train_one, calls = _fake(losses)
    cell = _protocol.run_cell(train_one, [0.01, 0.1], seeds=3, select="apart", select_seeds=2)
    assert cell.lr == 0.1  # the selection seeds' mean; the reported seeds' would have chosen 0.01
    assert calls == [(0.01, start), (0.01, start + 1), (0.1, start), (0.1, start + 1), (0.1, 0), (0.1, 1), (0.1, 2)]
    assert [row["seed"] for row in cell.chosen] == [0, 1, 2]  # what is reported: no selection seed
    assert _protocol.summarize(cell, other_key="val_loss")["lr_other_metric"] == 0.1  # on the selection seeds


def test_a_rate_with_a_failed_seed_is_not_eligible() -> None:
    train_one, _ = _fake(LOSSES, failing={(0.01, 2)})
    assert _protocol.run_cell(train_one, [0.01, 0.1], seeds=3, select="mean").lr == 0.1
    train_one, _ = _fake(LOSSES, failing=set(LOSSES))
    cell = _protocol.run_cell(train_one, [0.01, 0.1], seeds=3, select="mean")
    assert cell.lr is None
    summary = _protocol.summarize(cell)
    assert summary["status"].startswith("diverged") and summary["lr"] is None


def test_first_rule_drops_a_rate_where_a_later_seed_fails() -> None:
    train_one, _ = _fake(LOSSES, failing={(0.1, 2)})
    cell = _protocol.run_cell(train_one, [0.01, 0.1], seeds=3, select="first")
    assert cell.lr is None
    # reported as the failure it is (it read as seed 0's clean run at lr 0.01, a rate nobody chose)
    summary = _protocol.summarize(cell)
    assert summary["status"].startswith("diverged") and summary["lr"] is None
    assert _protocol.grid_row(cell, "val_loss")["lr=0.1"] == "diverged"  # seed 0 trained there; seed 2 did not


def test_summary_is_mean_and_sample_std_over_the_chosen_seeds() -> None:
    train_one, _ = _fake({**LOSSES, (0.01, 1): 2.3, (0.01, 2): 1.6})
    cell = _protocol.run_cell(train_one, [0.01, 0.1], seeds=3, select="mean")
    summary = _protocol.summarize(cell)
    chosen = [2.0, 2.3, 1.6]
    assert summary["lr"] == 0.01 and summary["seeds"] == 3 and summary["status"] == "ok"
    assert summary["val_loss"] == pytest.approx(statistics.fmean(chosen))
    assert summary["val_loss_std"] == pytest.approx(statistics.stdev(chosen))
    assert summary["updates"] == 10 and summary["updates_std"] == 0
    grid = _protocol.grid_row(cell, "val_loss")
    assert grid == {"lr=0.01": "1.967 (3) *", "lr=0.1": "2.300 (3)"}


def test_pm_formats_a_single_run_without_std() -> None:
    assert _protocol.pm(3.14159, 0.0123) == "3.142 ± 0.012"
    assert _protocol.pm(3.14159, math.nan) == "3.142"


def _lines(tmp_path, count: int = 200):  # type: ignore[no-untyped-def]
    path = tmp_path / "lines.txt"
    path.write_text("\n".join(synthetic_lines(count, seed=3)))
    args = argparse.Namespace(text=str(path), dataset=None, seed=0, cache_dir=None)
    return _data.load_sequences(args, 12, "line")


def test_line_batches_are_ragged_and_trimmed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, splits = _lines(tmp_path)
    train = splits["train"]
    assert train.ragged and int(train.lengths.max()) <= 12
    batch = train.batch(torch.tensor([0, 1, 2]))
    assert batch.steps == int(train.lengths[:3].max())
    assert batch.tokens == int(train.lengths[:3].sum())
    padding = torch.arange(batch.steps) >= batch.lengths.unsqueeze(1)
    assert (batch.inputs[padding] == 0).all() and (batch.targets[padding] == 0).all()
    assert (batch.targets[~padding] != 0).all()


def test_evaluation_ignores_padding(tmp_path) -> None:  # type: ignore[no-untyped-def]
    corpus, splits = _lines(tmp_path)
    val = splits["val"].head(120)
    args = argparse.Namespace(embedding=8, hidden=8, seed=0)
    model = _common.build_model(corpus.vocab_size, args, "layer", max_steps=12)
    together, _ = _common.evaluate(model, val, batch_size=len(val))
    # Each sequence alone, weighted by its real tokens: what the padded batch must equal.
    alone = [(_common.evaluate(model, val.batch(torch.tensor([i])))[0], int(val.lengths[i])) for i in range(len(val))]
    expected = sum(loss * count for loss, count in alone) / sum(count for _, count in alone)
    assert together == pytest.approx(expected, rel=1e-5)


def test_equal_tokens_and_equal_updates(tmp_path) -> None:  # type: ignore[no-untyped-def]
    corpus, splits = _lines(tmp_path)
    args = argparse.Namespace(embedding=8, hidden=8, seed=0)
    for batch_size in (2, 5):
        model = _common.build_model(corpus.vocab_size, args, "none", max_steps=12)
        result = _common.train_language_model(model, splits["train"], batch_size=batch_size, tokens=300, lr=1e-2)
        assert result.status == "ok"
        largest_batch = int(splits["train"].lengths.sort(descending=True).values[:batch_size].sum())
        assert 300 <= result.tokens < 300 + largest_batch  # real tokens, padding excluded
        model = _common.build_model(corpus.vocab_size, args, "none", max_steps=12)
        result = _common.train_language_model(
            model, splits["train"], batch_size=batch_size, tokens=300, lr=1e-2, max_updates=7
        )
        assert result.updates == 7
        # a curve ends where training ended, even when the planned evaluation points overshoot the run (an
        # --updates budget estimated from mean line lengths): the last point was lost
        model = _common.build_model(corpus.vocab_size, args, "none", max_steps=12)
        result = _common.train_language_model(
            model, splits["train"], batch_size=batch_size, tokens=300, lr=1e-2, max_updates=7,
            evaluate_every=10_000, evaluate_fn=lambda m: 1.0,
        )  # fmt: skip
        assert [tokens for tokens, _ in result.curve] == [0, result.tokens]


@pytest.mark.parametrize("unit", ["window", "line", "stream"])
def test_exact_statistics_recomputes_bn_buffers_on_a_copy(tmp_path, unit: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "lines.txt"
    path.write_text("\n".join(synthetic_lines(200, seed=3)))
    data_args = argparse.Namespace(text=str(path), dataset=None, seed=0, cache_dir=None)
    corpus, splits = _data.load_sequences(data_args, 12, unit)
    model = _common.build_model(corpus.vocab_size, argparse.Namespace(embedding=8, hidden=8, seed=0), "batch", 12)
    _common.train_language_model(model, splits["train"], batch_size=4, tokens=96, lr=1e-2)
    before = {name: value.clone() for name, value in [*model.named_parameters(), *model.named_buffers()]}
    exact = _protocol.exact_statistics(model, splits["train"], tokens=500)
    for name, value in [*model.named_parameters(), *model.named_buffers()]:  # the original is untouched
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)
    exact_buffers = dict(exact.named_buffers())
    running = [name for name in exact_buffers if "running" in name]
    assert running and any(not torch.equal(exact_buffers[name], before[name]) for name in running)
    for name, value in exact.named_parameters():  # update_bn leaves parameters alone
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


def test_trial_cache_reads_back_runs_of_the_same_settings_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "trials.jsonl"
    train_one, calls = _fake(LOSSES)
    first = _protocol.run_cell(train_one, [0.01, 0.1], 3, "mean", cache=_protocol.TrialCache(path, {"a": 1}), name="c")
    assert len(calls) == 6
    cache = _protocol.TrialCache(path, {"a": 1})
    again = _protocol.run_cell(train_one, [0.01, 0.1], 3, "mean", cache=cache, name="c")
    assert len(calls) == 6 and cache.hits == 6  # nothing trained again
    assert again.trials == first.trials and again.lr == first.lr
    _protocol.run_cell(train_one, [0.01, 0.1], 3, "mean", cache=_protocol.TrialCache(path, {"a": 2}), name="c")
    assert len(calls) == 12  # other settings: trained
    _protocol.run_cell(train_one, [0.01, 0.1], 3, "mean", cache=_protocol.TrialCache(path, {"a": 1}), name="d")
    assert len(calls) == 18  # another cell: trained


def test_sweep_resumes_from_its_trials_cache(tmp_path, read_csv) -> None:  # type: ignore[no-untyped-def]
    import batch_size_sweep

    argv = ["--quick", "--tokens", "64", "--steps", "8", "--hidden", "8", "--embedding", "8", "--val-tokens", "64",
            "--norms", "none", "--batch-sizes", "2", "--lr-extensions", "0", "--trials-cache",
            str(tmp_path / "trials.jsonl")]  # fmt: skip
    batch_size_sweep.main([*argv, "--out", str(tmp_path / "a")])
    batch_size_sweep.main([*argv, "--out", str(tmp_path / "b")])
    assert read_csv(tmp_path / "a" / "trials.csv") == read_csv(tmp_path / "b" / "trials.csv")
    assert "3 runs were read back" in (tmp_path / "b" / "results.md").read_text()
    assert "read back" not in (tmp_path / "a" / "results.md").read_text()


def _streams(tmp_path):  # type: ignore[no-untyped-def]
    path = tmp_path / "lines.txt"
    path.write_text("\n".join(synthetic_lines(300, seed=3)))
    args = argparse.Namespace(text=str(path), dataset=None, seed=0, cache_dir=None)
    return _data.load_sequences(args, 12, "stream")


def test_stream_batches_continue_each_stream(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, splits = _streams(tmp_path)
    train = splits["train"]
    assert train.stateful and not train.ragged
    batches = train.stream_batches(4)
    per_stream = len(train) // 4
    assert len(batches) == per_stream
    for k, index in enumerate(batches):  # batch k holds window k of every stream: rows b*M + k
        assert index.tolist() == [b * per_stream + k for b in range(4)]


@pytest.mark.parametrize("norm", ["none", "layer"])
def test_stream_evaluation_carries_the_state_as_one_long_sequence(tmp_path, norm: str) -> None:  # type: ignore[no-untyped-def]
    corpus, splits = _streams(tmp_path)
    val = splits["val"].head(120)
    model = _common.build_model(corpus.vocab_size, argparse.Namespace(embedding=8, hidden=8, seed=0), norm, 12)
    with torch.no_grad():
        for parameter in model.parameters():  # away from the initialization, so a dropped state would show
            parameter.add_(torch.randn_like(parameter) * 0.1)
    carried, _ = _common.evaluate(model, val)
    model.eval()
    with torch.no_grad():
        logits = model(val.inputs.reshape(1, -1))  # every window after the previous one: one sequence
        whole = torch.nn.functional.cross_entropy(logits[0], val.targets.reshape(-1))
    assert carried == pytest.approx(float(whole), rel=1e-5)
    independent, _ = _common.evaluate(model, _data.Sequences(val.inputs, val.targets, val.lengths))
    assert abs(independent - carried) > 1e-4  # the windows alone (from zeros) differ


def test_stream_training_runs_in_order_and_detaches(tmp_path) -> None:  # type: ignore[no-untyped-def]
    corpus, splits = _streams(tmp_path)
    model = _common.build_model(corpus.vocab_size, argparse.Namespace(embedding=8, hidden=8, seed=0), "layer", 12)
    result = _common.train_language_model(model, splits["train"], batch_size=4, tokens=400, lr=1e-2)
    assert result.status == "ok" and result.updates == -(-400 // (4 * 12))


@pytest.mark.parametrize(
    ("script", "flags", "message"),
    [
        ("batch_size_sweep", ["--batch-sizes", "0"], "argument --batch-sizes: expected an int >= 1, got '0'"),
        ("batch_size_sweep", ["--lrs", "-0.01"], "argument --lrs: expected a number > 0, got '-0.01'"),
        ("batch_size_sweep", ["--seeds", "0"], "argument --seeds: expected an int >= 1, got '0'"),
        ("online_training", ["--evaluations", "0"], "argument --evaluations: expected an int >= 1, got '0'"),
        ("length_generalization", ["--steps", "x"], "argument --steps: expected an int >= 1, got 'x'"),
        ("init_study", ["--seed", "-1"], "argument --seed: expected an int >= 0, got '-1'"),
        # raised to 2 unsaid
        ("convergence", ["--grad-points", "1"], "argument --grad-points: expected an int >= 2, got '1'"),
        # read and ignored: the init study's inputs are noise
        ("init_study", ["--text", "my.txt"], "unrecognized arguments: --text my.txt"),
        # ran as --lrs, or was ambiguous between it and --lr-extensions: no abbreviations
        ("batch_size_sweep", ["--lr", "1e-2"], "unrecognized arguments: --lr 1e-2"),
        ("online_training", ["--hid", "8"], "unrecognized arguments: --hid 8"),
    ],
)
def test_bad_flags_are_refused_by_name(
    script: str, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Flags the scripts used unchecked (ZeroDivisionError at --batch-sizes 0, an untrained model reported ok at
    --tokens 0, Adam's error at --lrs -0.01) stop at parsing, argparse's error naming the flag."""
    module = __import__(script)
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args(["--quick", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_text_file_is_named_by_the_scripts_flag(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"^error: --text .*nowhere.txt: no such file$"):
        __import__("batch_size_sweep").parse_args(["--quick", "--text", str(tmp_path / "nowhere.txt")])


def test_a_folder_given_as_text_is_not_called_missing(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=rf"^error: --text {tmp_path}: not a regular file$"):
        __import__("batch_size_sweep").parse_args(["--quick", "--text", str(tmp_path)])


@pytest.mark.parametrize("script", ["batch_size_sweep", "convergence", "online_training"])
def test_an_out_folder_that_cannot_be_made_stops_the_script_before_it_trains(script: str, tmp_path: Path) -> None:
    """It was a NotADirectoryError traceback when the tables were written, after every run had trained."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(
        SystemExit, match=rf"^error: --out {blocker}/sub: cannot create the folder \(Not a directory\)$"
    ):
        __import__(script).parse_args(["--quick", "--out", str(blocker / "sub")])


def test_convergence_writes_where_every_script_does_not_into_the_docs() -> None:
    """Its default --out was docs/results/convergence: a quick run overwrote the committed results there."""
    assert __import__("convergence").parse_args(["--quick"]).out == Path("results") / "convergence"


def test_the_librarys_data_messages_name_the_scripts_flags(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """They named the seqnorm command's --data.val_fraction / --data.val_path / --data.encoding, which the scripts
    do not have; so did the notice of the carved splits."""
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("ab\n")
    args = __import__("batch_size_sweep").parse_args(["--quick", "--text", str(tiny), "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit) as stopped, caplog.at_level(logging.INFO):
        _data.open_corpus(args, "window", 4)
    assert str(stopped.value) == (
        f"error: {tiny}: the val split has fewer than 2 tokens, nothing to predict: add text (validation and test "
        "take 10% of it each)"
    )
    assert any(message.startswith(f"TextCorpus: carved from the end of --text {tiny}") for message in caplog.messages)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9 au lait\n".encode("latin-1") * 40)
    args.text = str(latin)
    with pytest.raises(SystemExit, match=r"pass --encoding with the file's real encoding \(e\.g\. --encoding latin-1"):
        _data.open_corpus(args, "window", 4)
    args.encoding = "latin-1"
    assert "é" in _data.open_corpus(args, "window", 4).vocab.tokens
    assert not any("--data." in message for message in caplog.messages)


def test_the_trials_cache_is_keyed_on_the_texts_content(tmp_path: Path) -> None:
    # the same path with other text is other data: its runs must not be read back
    text = tmp_path / "corpus.txt"
    args = argparse.Namespace(text=str(text), tokens=100, trials_cache=None)
    text.write_text("one text\n")
    first = _protocol.TrialCache.for_args(args, "script").settings
    text.write_text("another text\n")
    second = _protocol.TrialCache.for_args(args, "script").settings
    assert first["text"] == second["text"] and first["text_sha256"] != second["text_sha256"]
    # the same text in another folder (another clone, another machine) is the same data: its runs are read back
    elsewhere = tmp_path / "clone" / "corpus.txt"
    elsewhere.parent.mkdir()
    elsewhere.write_text("another text\n")
    moved = _protocol.TrialCache.for_args(argparse.Namespace(**{**vars(args), "text": str(elsewhere)}), "script")
    assert moved.settings == second and str(tmp_path) not in json.dumps(moved.settings)


def test_large_numbers_keep_their_digits_in_the_tables() -> None:
    # token counts averaged over seeds (100022.3) printed as 1.000e+05
    assert _common._format(100022.3, 8) == "100022.3" and _common._format(100022.0, 4) == "100022.0"
    assert _common._format(2.8187654321, 4) == "2.819"


# --- the self-extending grid ----------------------------------------------------------------------------------------


def _bowl(best: float, calls: list[tuple[float, int]] | None = None):  # type: ignore[no-untyped-def]
    """A ``train_one`` whose validation loss is (log10(lr / best))^2 (+ a per-seed offset): optimum at ``best``."""

    def train_one(lr: float, seed: int) -> dict[str, object]:
        if calls is not None:
            calls.append((lr, seed))
        return {"status": "ok", "val_loss": math.log10(lr / best) ** 2 + 0.01 * seed, "updates": 10}

    return train_one


def test_a_best_rate_at_the_top_edge_extends_the_grid_until_it_is_interior() -> None:
    calls: list[tuple[float, int]] = []
    cell = _protocol.run_cell(_bowl(0.2, calls), [0.01, 0.03], seeds=2, select="mean", extensions=5)
    # 0.03 is the best of the grid; one step of x3 beyond it at a time: 0.09, 0.27 (best, still the top), 0.81
    assert cell.added == [0.09, 0.27, 0.81]
    assert cell.lr == 0.27 and cell.edge == ""
    assert sorted(calls) == sorted((lr, seed) for lr in (0.01, 0.03, 0.09, 0.27, 0.81) for seed in (0, 1))
    summary = _protocol.summarize(cell)
    assert summary["lrs_added"] == "0.09 0.27 0.81" and summary["lr_edge"] == "" and summary["lr"] == 0.27
    assert list(_protocol.grid_row(cell, "val_loss")) == ["lr=0.01", "lr=0.03", "lr=0.09", "lr=0.27", "lr=0.81"]


def test_the_cap_stops_the_extension_and_says_the_best_is_still_at_the_edge() -> None:
    cell = _protocol.run_cell(_bowl(0.2), [0.01, 0.03], seeds=1, extensions=2)
    assert cell.added == [0.09, 0.27] and cell.lr == 0.27 and cell.edge == "top"
    cell = _protocol.run_cell(_bowl(0.2), [0.01, 0.03], seeds=1)  # no extension unless asked
    assert cell.added == [] and cell.lr == 0.03 and cell.edge == "top"
    assert _protocol.summarize(cell)["lr_edge"] == "top"


def test_a_best_rate_at_the_bottom_edge_extends_downwards_and_under_first_only_seed_zero_explores() -> None:
    calls: list[tuple[float, int]] = []
    cell = _protocol.run_cell(_bowl(1e-4, calls), [0.001, 0.003], seeds=3, select="first", extensions=5)
    assert cell.added == [0.00033, 0.00011, 3.7e-05]  # steps of 1/3 at 2 significant digits
    assert cell.lr == 0.00011 and cell.edge == ""
    explored = [(0.001, 0), (0.003, 0), (0.00033, 0), (0.00011, 0), (3.7e-05, 0)]
    assert calls == [*explored, (0.00011, 1), (0.00011, 2)]


def test_a_rate_that_diverges_beyond_the_edge_ends_the_extension() -> None:
    bowl = _bowl(10.0)

    def train_one(lr: float, seed: int) -> dict[str, object]:
        if lr > 0.05:
            return {"status": "diverged: loss nan at update 3", "val_loss": math.nan, "updates": 3}
        return bowl(lr, seed)

    cell = _protocol.run_cell(train_one, [0.01, 0.03], seeds=1, extensions=5)
    assert cell.added == [0.09] and cell.lr == 0.03 and cell.edge == ""  # bounded by a failed rate: interior


def test_bn_chooses_its_rate_on_the_metric_it_headlines_and_reports_the_other_choice() -> None:
    # running averages favour the larger rate (less lag after few updates), exact statistics the smaller
    losses = {0.01: (2.0, 1.8), 0.03: (1.9, 1.95)}

    def train_one(lr: float, seed: int) -> dict[str, object]:
        running, exact = losses[lr]
        return {"status": "ok", "val_loss": running, "val_loss_exact": exact, "updates": 10}

    for metric, chosen, other in (("exact", 0.01, 0.03), ("running", 0.03, 0.01)):
        args = argparse.Namespace(bn_select=metric)
        key = _protocol.selection_key("batch", args)
        cell = _protocol.run_cell(train_one, [0.01, 0.03], seeds=2, key=key)
        summary = _protocol.summarize(cell, key, _protocol.other_key("batch", args))
        assert (cell.lr, summary["lr_other_metric"], summary["lr_chosen_on"]) == (chosen, other, key), metric
    assert _protocol.selection_key("layer", argparse.Namespace(bn_select="exact")) == "val_loss"
    assert _protocol.other_key("layer", argparse.Namespace(bn_select="exact")) is None


# --- paired differences ---------------------------------------------------------------------------------------------


def test_paired_differences_of_known_numbers() -> None:
    paired = _protocol.paired_difference({0: 1.0, 1: 1.2, 2: 0.9}, {0: 1.1, 1: 1.5, 2: 1.0})
    differences = [-0.1, -0.3, -0.1]
    half = 4.303 * statistics.stdev(differences) / math.sqrt(3)  # t(0.975, 2) = 4.303
    assert paired is not None and paired.n == 3 and paired.held == 3
    assert paired.mean == pytest.approx(-0.5 / 3)
    assert (paired.low, paired.high) == pytest.approx((-0.5 / 3 - half, -0.5 / 3 + half))
    assert _protocol.paired_text(paired) == "-0.167 [-0.454, +0.120], 3/3"
    mixed = _protocol.paired_difference({0: 1.0, 1: 2.0, 2: 3.0}, {0: 1.5, 1: 1.8, 2: 3.1})
    assert mixed is not None and mixed.held == 2 and mixed.mean == pytest.approx(-0.4 / 3)  # -0.5, +0.2, -0.1
    assert _protocol.t_quantile_975(10) == 2.228 and _protocol.t_quantile_975(27) == 2.060  # between entries: wider


def test_paired_against_pairs_runs_by_seed_and_leaves_failures_out() -> None:
    runs = [{"seed": 2, "status": "ok", "val_bpc": 1.0}, {"seed": 0, "status": "ok", "val_bpc": 2.0},
            {"seed": 1, "status": "diverged", "val_bpc": math.nan}]  # fmt: skip
    baseline = [{"seed": seed, "status": "ok", "val_bpc": 1.5 + seed} for seed in range(3)]
    paired = _protocol.paired_against(runs, baseline, "val_bpc")
    assert paired is not None and paired.differences == {0: 0.5, 2: -2.5} and paired.n == 2
    assert _protocol.paired_against(runs[2:], baseline, "val_bpc") is None


def test_the_sweep_reports_paired_differences_computed_from_its_per_seed_rows(tmp_path, read_csv) -> None:  # type: ignore[no-untyped-def]
    import batch_size_sweep

    out = tmp_path / "sweep"
    batch_size_sweep.main(
        ["--quick", "--tokens", "96", "--steps", "8", "--hidden", "8", "--embedding", "8", "--val-tokens", "96",
         "--norms", "none", "layer", "--batch-sizes", "2", "--seeds", "3", "--select", "mean", "--out", str(out)]
    )  # fmt: skip
    rows = {row["norm"]: row for row in read_csv(out / "results.csv")}
    trials = read_csv(out / "trials.csv")

    def chosen(norm: str) -> dict[int, float]:
        lr = float(rows[norm]["lr"])
        return {int(t["seed"]): float(t["val_bpc"]) for t in trials if t["norm"] == norm and float(t["lr"]) == lr}

    differences = [chosen("layer")[seed] - chosen("none")[seed] for seed in range(3)]
    mean = statistics.fmean(differences)
    half = 4.303 * statistics.stdev(differences) / math.sqrt(3)
    layer = rows["layer"]
    assert float(layer["diff_vs_none"]) == pytest.approx(mean, abs=1e-6)
    assert float(layer["diff_vs_none_low"]) == pytest.approx(mean - half, abs=1e-6)
    assert float(layer["diff_vs_none_high"]) == pytest.approx(mean + half, abs=1e-6)
    assert int(layer["diff_vs_none_held"]) == sum(1 for d in differences if (d > 0) == (mean > 0))
    assert (
        rows["none"]["diff_vs_none"] == "" and float(layer["forget_bias"]) == float(rows["none"]["forget_bias"]) == 1.0
    )
    markdown = (out / "results.md").read_text()
    assert "Paired per-seed difference from the plain LSTM" in markdown
    assert "forget bias 1 for every norm (plain LSTM included)" in markdown.splitlines()[0]
    # the grid table has a column for every rate tried, those the extension added too
    added = [rate for row in rows.values() for rate in row["lrs_added"].split()]
    header = next(line for line in markdown.splitlines() if line.startswith("| norm | batch_size | lr="))
    assert all(f"lr={rate} |" in header for rate in ["0.003", "0.01", *added])


# --- forget bias ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [1.0, 0.0, 2.5])
def test_the_forget_bias_is_the_same_for_every_norm(value: float) -> None:
    # the plain LSTM kept torch's random init while normalized cells got 1: initialization confounded the comparison
    args = __import__("batch_size_sweep").parse_args(["--quick", "--forget-bias", str(value)])
    assert args.forget_bias == value
    args.hidden, args.embedding = 6, 4
    for norm in seqnorm.NORMS:  # every registered norm
        cell = _common.build_model(11, args, norm, max_steps=5).rnn.cells[0]
        hidden = cell.hidden_size
        forget = slice(cell.forget_gate * hidden, (cell.forget_gate + 1) * hidden)
        torch.testing.assert_close(cell.bias_ih[forget], torch.full((hidden,), value), msg=norm)
        torch.testing.assert_close(cell.bias_hh[forget], torch.zeros(hidden), msg=norm)


def test_the_default_forget_bias_is_one_and_library_restores_the_per_norm_defaults() -> None:
    sweep = __import__("batch_size_sweep")
    assert sweep.parse_args(["--quick"]).forget_bias == _common.FORGET_BIAS == 1.0
    args = sweep.parse_args(["--quick", "--forget-bias", "library"])
    args.hidden, args.embedding = 6, 4
    plain = _common.build_model(11, args, "none", max_steps=5).rnn.cells[0]
    assert plain.forget_bias is None and len(set(plain.bias_ih[6:12].tolist())) > 1  # torch's random init
    assert _common.build_model(11, args, "layer", max_steps=5).rnn.cells[0].forget_bias == 1.0
    with pytest.raises(SystemExit):
        sweep.parse_args(["--quick", "--forget-bias", "nan"])


# --- bucketed lines -------------------------------------------------------------------------------------------------


class _Recorder(torch.nn.Module):
    """A tiny language model that records the lengths of every batch it is trained on."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab_size, vocab_size)
        self.batches: list[list[int]] = []

    def forward(self, inputs: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        self.batches.append(lengths.tolist() if lengths is not None else [inputs.shape[1]] * inputs.shape[0])
        return self.embedding(inputs)


def test_bucketed_lines_batch_similar_lengths_with_the_librarys_sampler(tmp_path) -> None:  # type: ignore[no-untyped-def]
    corpus, splits = _lines(tmp_path, count=400)
    train = splits["train"]
    spreads = {}
    for bucket in (False, True):
        model = _Recorder(corpus.vocab_size)
        result = _common.train_language_model(
            model, train, batch_size=4, tokens=10**9, max_updates=2 * (len(train) // 4), lr=1e-2, seed=3,
            bucket=bucket,
        )  # fmt: skip
        assert result.status == "ok"
        spreads[bucket] = statistics.fmean(max(batch) - min(batch) for batch in model.batches)
        if bucket:  # the batches are the sampler's, epoch after epoch
            sampler = BucketBatchSampler(train.lengths.tolist(), 4, drop_last=True, seed=3)
            expected = []
            for epoch in (0, 1):
                sampler.set_epoch(epoch)
                expected += [[int(train.lengths[i]) for i in batch] for batch in sampler]
            assert model.batches == expected
    assert spreads[True] < spreads[False] / 2


def test_bucket_needs_lines() -> None:
    with pytest.raises(SystemExit):
        __import__("batch_size_sweep").parse_args(["--quick", "--bucket"])


# --- text formats and data errors -----------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
TINY_SWEEP = ["--quick", "--tokens", "48", "--steps", "6", "--hidden", "6", "--embedding", "6", "--val-tokens",
              "48", "--norms", "none", "--batch-sizes", "2", "--seeds", "1", "--lr-extensions", "0"]  # fmt: skip


def _ptb_char(path: Path) -> Path:
    lines = [" ".join("_" if c == " " else c for c in line) for line in synthetic_lines(300, seed=2)]
    path.write_text("\n".join(f" {line} " for line in lines) + "\n")
    return path


def test_a_ptb_char_file_read_as_plain_text_ends_the_script_with_one_line_naming_the_file_and_the_flag(
    tmp_path: Path,
) -> None:
    # it ended in a traceback whose advice named the seqnorm command's --data.text_format
    path = _ptb_char(tmp_path / "ptb.char.train.txt")
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "batch_size_sweep.py"), *TINY_SWEEP, "--text", str(path), "--out",
         str(tmp_path / "out")],
        capture_output=True, text=True, env=environment, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: --text {path}: expected plain text") and "pass --text-format ptb_char" in line
    assert "--data." not in line and "Traceback" not in result.stderr


def test_a_plain_file_named_ptb_char_is_refused_in_one_line_naming_the_scripts_flag(tmp_path: Path) -> None:
    path = tmp_path / "plain.txt"
    path.write_text("Some ordinary prose, with words longer than one letter.\n" * 50)
    with pytest.raises(SystemExit) as exit_info:
        __import__("online_training").main([*TINY_SWEEP, "--text", str(path), "--text-format", "ptb_char"])
    (line,) = str(exit_info.value.code).splitlines()
    assert line.startswith(f"error: --text {path}: expected PTB-char text for --text-format ptb_char")
    assert "leave out --text-format" in line and "--data." not in line


def test_the_text_format_flag_reads_ptb_char_as_its_characters(tmp_path: Path) -> None:
    path = _ptb_char(tmp_path / "ptb.txt")
    args = argparse.Namespace(text=str(path), dataset=None, seed=0, cache_dir=None, text_format="ptb_char")
    corpus, splits = _data.load_sequences(args, 12, "line")
    plain = tmp_path / "plain.txt"
    plain.write_text("\n".join(synthetic_lines(300, seed=2)) + "\n")
    expected, expected_splits = _data.load_sequences(
        argparse.Namespace(text=str(plain), dataset=None, seed=0, cache_dir=None, text_format=None), 12, "line"
    )
    assert corpus.vocab_size == expected.vocab_size  # the separators are gone: the same characters
    assert torch.equal(splits["train"].inputs, expected_splits["train"].inputs)
