"""The LightningModules driven from Python by one Trainer after another, as Lightning users do."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest

from seqnorm.data import TextCorpus
from seqnorm.lightning import LanguageModel

_TRAINER = {
    "max_steps": 3,
    "limit_val_batches": 2,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def _trainer(root: Path) -> pl.Trainer:
    return pl.Trainer(**_TRAINER, default_root_dir=root)


def test_validate_before_fit_then_test_on_one_model(tmp_path: Path) -> None:
    data = TextCorpus(batch_size=8)
    data.setup("fit")
    model = LanguageModel(vocab_size=data.vocab_size, pad_index=data.pad_index, hidden_size=16, embedding_dim=8)
    # validate's metric states are reset under inference mode; fit's validation then updates them under no_grad
    before = _trainer(tmp_path / "a").validate(model, data)[0]["val/loss"]
    fit = _trainer(tmp_path / "b")
    fit.fit(model, data)
    after = fit.validate(model, data)[0]["val/loss"]
    tested = _trainer(tmp_path / "c").test(model, data)[0]["test/loss"]
    assert math.isfinite(before) and math.isfinite(after) and math.isfinite(tested)
    assert fit.global_step == 3 and after < before


def test_a_checkpoint_saved_after_fit_resumes(tmp_path: Path) -> None:
    # trainer.save_checkpoint after fit asked the spent train loader its length, which Lightning refuses
    data = TextCorpus(batch_size=8)
    model = LanguageModel(vocab_size=data.vocab_size, pad_index=data.pad_index, hidden_size=16, embedding_dim=8)
    fit = _trainer(tmp_path)
    fit.fit(model, data)
    fit.save_checkpoint(tmp_path / "after.ckpt")
    resumed = pl.Trainer(**{**_TRAINER, "max_steps": 5, "default_root_dir": tmp_path})
    resumed.fit(model, data, ckpt_path=tmp_path / "after.ckpt")
    assert resumed.global_step == 5


class _BatchLosses(pl.Callback):
    """Each training batch's loss and real target tokens (what train/loss weighs it by)."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, int]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        tokens = int((batch["targets"] != module.hparams.pad_index).sum())
        self.rows.append((float(outputs["loss"]) * trainer.accumulate_grad_batches, tokens))


def test_train_loss_covers_every_batch_since_the_last_point_with_gradient_accumulation(tmp_path: Path) -> None:
    """log_every_n_steps counts optimizer steps: with 2 batches per step the window is 2 x 3 batches (it was 3)."""
    corpus = TextCorpus(batch_size=4)
    model = LanguageModel(corpus.vocab_size, corpus.pad_index, hidden_size=16, embedding_dim=8)
    record = _BatchLosses()
    trainer = pl.Trainer(
        max_steps=4,
        accumulate_grad_batches=2,
        log_every_n_steps=3,
        callbacks=[record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, corpus)
    last = record.rows[-6:]
    expected = sum(loss * tokens for loss, tokens in last) / sum(tokens for _, tokens in last)
    assert math.isclose(float(trainer.callback_metrics["train/loss"]), expected, rel_tol=1e-5)


@pytest.mark.parametrize("name", ["lr", "weight_decay"])
def test_an_infinite_rate_is_refused(name: str) -> None:
    # inf trained to NaN weights and saved them as if nothing went wrong (exit code 0)
    with pytest.raises(ValueError, match=rf"^LanguageModel: expected {name} to be finite and >= 0, got inf$"):
        LanguageModel(10, **{name: math.inf})
