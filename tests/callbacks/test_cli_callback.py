"""HiddenStateStats from the `seqnorm` command: on in the shipped configs, and appended with `callbacks+=`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint

from seqnorm.callbacks import HiddenStateStats
from seqnorm.cli import SeqnormCLI, main
from tests.callbacks.conftest import events

ROOT = Path(__file__).resolve().parents[2]
TASK_CONFIGS = sorted(path.name for path in (ROOT / "configs").glob("*.yaml"))
TINY = [
    "--model.hidden_size=8",
    "--model.embedding_dim=4",
    "--trainer.max_steps=2",
    "--trainer.limit_train_batches=2",
    "--trainer.limit_val_batches=1",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]


@pytest.fixture(autouse=True)
def _in_tmp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["seqnorm"])  # LightningCLI warns about pytest's own arguments


@pytest.mark.parametrize("config", TASK_CONFIGS)
def test_every_task_config_turns_the_callback_on_beside_the_defaults(config: str) -> None:
    trainer = yaml.safe_load((ROOT / "configs" / config).read_text())["trainer"]
    # `callbacks+` appends to the CLI's default callbacks; a plain `callbacks` key would replace them
    assert [entry["class_path"] for entry in trainer["callbacks+"]] == ["seqnorm.callbacks.HiddenStateStats"]
    assert "callbacks" not in trainer


def test_a_config_callback_joins_the_default_callbacks() -> None:
    cli = SeqnormCLI(args=["--config", str(ROOT / "configs" / "embedded_lm.yaml")], run=False)
    callbacks = cli.trainer.callbacks
    assert any(isinstance(callback, HiddenStateStats) for callback in callbacks)
    assert any(isinstance(callback, ModelCheckpoint) and callback.monitor == "val/loss" for callback in callbacks)


def test_callbacks_append_from_the_command_line(tmp_path: Path) -> None:
    args = ["fit", "--model", "SequenceClassifier", "--data", "LabeledText", "--data.batch_size=8", *TINY]
    main([*args, "--trainer.callbacks+=seqnorm.callbacks.HiddenStateStats", "--trainer.callbacks.every_n_steps=1"])
    (run,) = (tmp_path / "lightning_logs").glob("*/version_*")
    logged = events(run)
    assert [event.step for event in logged.Scalars("hidden/l0/h_std")] == [0, 1]
    assert 0 < logged.Scalars("hidden/l0/val_h_std")[-1].value < 1
    assert "norm/val_profile" in logged.Tags()["images"]


def test_shipped_config_runs_with_the_callback(tmp_path: Path) -> None:
    main(["fit", "--config", str(ROOT / "configs" / "embedded_classifier.yaml"), "--data.batch_size=8", *TINY])
    (run,) = (tmp_path / "lightning_logs").glob("*/version_*")
    logged = events(run)
    assert logged.Scalars("grad/l0/last_over_first")[0].value > 0
