"""``predictions.jsonl`` is written through a temporary file renamed into place: a link planted at its path is replaced,
never written through (``open(path, "w")`` followed it), and a predict that fails keeps the previous file."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest

from seqnorm.data import TextCorpus
from seqnorm.lightning import LanguageModel
from seqnorm.lightning.prediction_writer import PREDICTIONS_FILE, PredictionWriter


def _predict(out: Path) -> None:
    data = TextCorpus(batch_size=4)  # the embedded task
    model = LanguageModel(data.vocab_size, data.pad_index, hidden_size=8, embedding_dim=4)
    trainer = pl.Trainer(
        callbacks=[PredictionWriter(output_dir=str(out))],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        limit_predict_batches=2,
    )
    trainer.predict(model, datamodule=data, return_predictions=False)


def test_a_link_planted_at_the_predictions_path_is_replaced_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("someone's own file\n", encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    (out / PREDICTIONS_FILE).symlink_to(victim)
    _predict(out)
    assert victim.read_text(encoding="utf-8") == "someone's own file\n"
    written = out / PREDICTIONS_FILE
    assert not written.is_symlink() and len(written.read_text(encoding="utf-8").splitlines()) == 8  # 2 batches of 4
    assert [path.name for path in out.iterdir()] == [PREDICTIONS_FILE]  # no temporary file left


def test_a_predict_that_fails_keeps_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _predict(tmp_path)
    previous = (tmp_path / PREDICTIONS_FILE).read_text(encoding="utf-8")
    calls = []

    def failing(self: LanguageModel, prediction: object, batch: object) -> list[dict]:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the second batch fails")
        return [{"tokens": 1}]

    monkeypatch.setattr(LanguageModel, "prediction_records", failing)
    with pytest.raises(RuntimeError, match="the second batch fails"):
        _predict(tmp_path)
    assert (tmp_path / PREDICTIONS_FILE).read_text(encoding="utf-8") == previous
    assert [path.name for path in tmp_path.iterdir()] == [PREDICTIONS_FILE]
