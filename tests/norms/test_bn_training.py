"""Per-timestep BN in Lightning training: variable-length lines by default, fallback counters, precise BN."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.testing import assert_close

import seqnorm
from seqnorm.cli import main
from seqnorm.data import TextCorpus
from seqnorm.lightning import LanguageModel, PreciseBN
from seqnorm.lightning.old_hparams import current_hparams
from tests.conftest import QUIET, run_path

TINY = ["--model.hidden_size", "24", "--model.embedding_dim", "8", "--model.norm", "batch"]


def _lines(story: Path, batch_size: int, *extra: str) -> list[str]:
    data = ["--data", "TextCorpus", "--data.path", str(story), "--data.level", "char", "--data.unit", "line"]
    return ["--model", "LanguageModel", *data, "--data.batch_size", str(batch_size), *extra, *TINY, *QUIET]


def _scalars(run: Path) -> dict[str, list[float]]:
    accumulator = EventAccumulator(str(run))
    accumulator.Reload()
    return {tag: [event.value for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def _tail_steps(lengths: torch.Tensor) -> int:
    """Steps of a batch where fewer than 2 rows are real: from the second-longest length to the longest."""
    top = lengths.topk(2).values
    return int(top[0] - top[1])


def test_bn_trains_from_the_cli_on_variable_length_lines_and_counts_fallbacks(story: Path) -> None:
    steps = 12
    args = _lines(story, 8, "--data.bucket", "false", "--trainer.max_steps", str(steps))
    main(["fit", *args, "--trainer.log_every_n_steps", "1", "--trainer.val_check_interval", "6"])
    scalars = _scalars(run_path(0))
    # The batches the run took: epoch 0's order is a function of the seed alone.
    loader = iter(TextCorpus(path=str(story), level="char", unit="line", batch_size=8, bucket=False).train_dataloader())
    expected = [_tail_steps(next(loader)["lengths"]) for _ in range(steps)]
    assert sum(expected) > 0, "the test needs batches with a padded tail"
    assert scalars["norm/fallback_steps"] == [float(n) for n in expected]
    assert scalars["norm/fallback_total"][-1] == sum(expected)
    assert all(torch.isfinite(torch.tensor(scalars["train/loss"])))


def test_bn_at_batch_size_one_is_still_the_clear_error(story: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *_lines(story, 1, "--trainer.max_steps", "3")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "expected a batch of at least 2 rows" in error and "batch size 1" in error and "Traceback" not in error


def test_strict_policy_from_the_cli(story: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        args = _lines(story, 8, "--data.bucket", "false", "--model.small_batch", "error", "--trainer.max_steps", "12")
        main(["fit", *args])
    assert exit_info.value.code == 2
    assert "expected at least 2 active (non-padding) rows" in capsys.readouterr().err


def _norm_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items() if "running_" in k}


def test_precise_bn_from_the_cli_leaves_exact_statistics_in_the_checkpoint(story: Path) -> None:
    callback = '--trainer.callbacks+={"class_path": "seqnorm.lightning.PreciseBN", "init_args": {"num_batches": 4}}'
    # Fixed windows: no step falls back to running statistics, so the pass does not depend on the statistics it
    # starts from, and recomputing it from the checkpoint must give the same numbers.
    args = _lines(story, 8, "--data.unit", "window", "--data.window_length", "24", callback)
    main(["fit", *args, "--trainer.max_steps", "10", "--trainer.val_check_interval", "5"])
    checkpoint = run_path(0) / "checkpoints/last.ckpt"
    model = LanguageModel.load_from_checkpoint(checkpoint)
    saved = _norm_buffers(model)
    assert saved
    corpus = TextCorpus(path=str(story), level="char", unit="window", window_length=24, batch_size=8)
    corpus.load_state_dict(torch.load(checkpoint, weights_only=True)["seqnorm_data"])
    batches = [batch for _, batch in zip(range(4), corpus.train_dataloader(), strict=False)]
    seqnorm.update_bn(batches, model, forward=lambda m, b: m(b["inputs"], b["lengths"]))
    for name, value in _norm_buffers(model).items():
        assert_close(saved[name], value, msg=name)


def _fit(tmp_path: Path, callbacks: list[pl.Callback], **options: object) -> tuple[LanguageModel, float]:
    corpus = TextCorpus(unit="window", window_length=17, batch_size=8)  # the embedded task: no padded tails
    pl.seed_everything(0)
    model = LanguageModel(
        corpus.vocab_size, corpus.pad_index, hidden_size=16, embedding_dim=8, norm="batch", dropout=0.3
    )
    trainer = pl.Trainer(
        **{"max_steps": 12, "val_check_interval": 6, "limit_val_batches": 3, **options},  # type: ignore[arg-type]
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, corpus)
    return model, float(trainer.callback_metrics["val/loss"])


def test_precise_bn_does_not_change_the_training_run(tmp_path: Path) -> None:
    # Full windows never fall back to running statistics, and the callback forks the random generators: the weights
    # (dropout 0.3 draws every step) come out bitwise the same; only the evaluation statistics differ.
    plain, plain_loss = _fit(tmp_path / "plain", [])
    precise, precise_loss = _fit(tmp_path / "precise", [PreciseBN(num_batches=3)])
    for (name, a), b in zip(plain.named_parameters(), precise.parameters(), strict=True):
        assert torch.equal(a, b), name
    plain_stats, precise_stats = _norm_buffers(plain), _norm_buffers(precise)
    assert plain_stats.keys() == precise_stats.keys()
    assert any(not torch.equal(value, precise_stats[name]) for name, value in plain_stats.items())
    assert plain_loss != precise_loss


def test_precise_bn_runs_under_the_trainers_precision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16-mixed: the population pass runs under autocast, as training and validation do (it ran in float32)."""
    from seqnorm.lightning import precise_bn

    autocast: list[bool] = []
    real = precise_bn.update_bn

    def recording(*args: object, **kwargs: object) -> None:
        autocast.append(torch.is_autocast_enabled("cpu"))
        real(*args, **kwargs)

    monkeypatch.setattr(precise_bn, "update_bn", recording)
    _fit(tmp_path, [PreciseBN(2)], precision="bf16-mixed", max_steps=4, val_check_interval=2)
    assert autocast and all(autocast)


def test_precise_bn_checks_its_argument() -> None:
    with pytest.raises(ValueError, match=r"^PreciseBN: expected num_batches >= 1 or None, got 0"):
        PreciseBN(num_batches=0)
    with pytest.raises(ValueError, match=r"^PreciseBN: expected num_batches to be a positive int or None, got 2.5"):
        PreciseBN(num_batches=2.5)  # type: ignore[arg-type]


def test_checkpoints_from_before_the_tail_default_still_load() -> None:
    # Task modules stored small_batch="error" (then the default) whatever the norm; it means nothing without BN.
    saved = {**LanguageModel(20, norm="layer").hparams, "small_batch": "error"}
    model = LanguageModel(**current_hparams(saved))  # translated where checkpoints are read
    assert model.model.rnn.norm_spec == seqnorm.norms.LayerNormSpec()
    assert LanguageModel(20, norm="batch", small_batch="error").model.rnn.norm_spec.small_batch == "error"
    for policy in ("error", "running"):  # given today, an option the norm lacks is refused
        with pytest.raises(ValueError, match=r"^LanguageModel: expected norm to be one of .* for small_batch="):
            LanguageModel(20, norm="layer", small_batch=policy)


def test_population_pass_on_stream_windows_carries_the_state() -> None:
    # On stream windows the recurrent term's statistics are those of carried states, as training sees them: not
    # those of windows that each start from zeros.
    corpus = TextCorpus(unit="stream", window_length=9, batch_size=4)
    model = LanguageModel(corpus.vocab_size, corpus.pad_index, hidden_size=8, embedding_dim=4, norm="batch")
    batches = [batch for _, batch in zip(range(4), corpus.train_dataloader(), strict=False)]
    assert [int(batch["window"]) for batch in batches] == [0, 1, 2, 3]
    seqnorm.update_bn(batches, model, forward=lambda m, b: m.population_forward(b))
    carried = _norm_buffers(model)
    seqnorm.update_bn(batches, model, forward=lambda m, b: m(b["inputs"], b["lengths"]))
    from_zeros = _norm_buffers(model)
    recurrent = [name for name in carried if "norm_hh" in name and name.endswith("running_mean")]
    assert recurrent and not torch.allclose(carried[recurrent[0]][0], from_zeros[recurrent[0]][0])
    inputs = [name for name in carried if "norm_ih" in name and name.endswith("running_mean")]
    assert_close(carried[inputs[0]], from_zeros[inputs[0]])  # W_ih x does not depend on the state
