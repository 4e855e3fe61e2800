"""The fair protocol (``scripts/_protocol.py``) and the data it trains on (``scripts/_data.py``), on tiny settings."""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

import _common
import _data
import _protocol
import pytest
import torch

from seqnorm.data import synthetic_lines


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
            "--norms", "none", "--batch-sizes", "2", "--trials-cache", str(tmp_path / "trials.jsonl")]  # fmt: skip
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


def test_the_trials_cache_is_keyed_on_the_texts_content(tmp_path: Path) -> None:
    # the same path with other text is other data: its runs must not be read back
    text = tmp_path / "corpus.txt"
    args = argparse.Namespace(text=str(text), tokens=100, trials_cache=None)
    text.write_text("one text\n")
    first = _protocol.TrialCache.for_args(args, "script").settings
    text.write_text("another text\n")
    second = _protocol.TrialCache.for_args(args, "script").settings
    assert first["text"] == second["text"] and first["text_sha256"] != second["text_sha256"]


def test_large_numbers_keep_their_digits_in_the_tables() -> None:
    # token counts averaged over seeds (100022.3) printed as 1.000e+05
    assert _common._format(100022.3, 8) == "100022.3" and _common._format(100022.0, 4) == "100022.0"
    assert _common._format(2.8187654321, 4) == "2.819"
