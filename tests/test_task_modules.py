"""The LightningModules driven from Python by one Trainer after another, as Lightning users do."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl

from seqnorm.data import TextCorpus
from seqnorm.lightning import LanguageModel


def _trainer(root: Path) -> pl.Trainer:
    return pl.Trainer(
        max_steps=3,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )


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
