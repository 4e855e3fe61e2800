"""Every shipped config parses and instantiates, alone and with every norm overlay."""

from __future__ import annotations

from pathlib import Path

import pytest

from seqnorm.cli import SeqnormCLI
from seqnorm.norms import NORMS

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TASKS = sorted(CONFIGS.glob("*.yaml"))
OVERLAYS = {path.stem: path for path in sorted((CONFIGS / "norm").glob("*.yaml"))}


def test_every_norm_has_an_overlay() -> None:
    assert set(OVERLAYS) == set(NORMS)
    assert {path.stem for path in TASKS} >= {"embedded_lm", "embedded_classifier", "char_lm", "word_lm", "classifier"}


@pytest.mark.parametrize("norm", sorted(OVERLAYS))
@pytest.mark.parametrize("task", TASKS, ids=lambda path: path.stem)
def test_config_instantiates(task: Path, norm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    data = []
    if "text_format: ptb_char" in task.read_text(encoding="utf-8"):  # a recipe for a PTB-char file of the user's
        Path("ptb.char.train.txt").write_text("a b c _ d e f\n" * 2000, encoding="utf-8")  # 64 windows of 100
        data = ["--data.train_path", "ptb.char.train.txt"]
    cli = SeqnormCLI(
        args=["--config", str(task), "--config", str(OVERLAYS[norm]), "--trainer.logger", "false", *data],
        run=False,
    )
    assert cli.model.hparams.norm == norm
    assert cli.model.hparams.vocab_size == cli.datamodule.vocab_size  # linked, not typed
    rnn = cli.model.model.rnn
    assert all(cell.norm == norm for cell in rnn.cells)
