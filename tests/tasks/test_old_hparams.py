"""Hyperparameters of before norm specs: old checkpoints build the same model, old configs are refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from seqnorm.cli import main
from seqnorm.data import TextCorpus
from seqnorm.lightning import LanguageModel, SequenceClassifier
from seqnorm.lightning.old_hparams import current_hparams
from seqnorm.norms import BatchNormSpec, BatchRenormSpec, LayerNormSpec, WeightNormSpec
from tests.cli.test_cli import QUIET
from tests.conftest import SMALL_LM, run_path

# (the old hyperparameters that differ from today's, today's, the spec the model must get)
OLD: list[tuple[dict[str, Any], dict[str, Any], Any]] = [
    (
        {"norm": "batch", "max_steps": 7, "rnn_options": {"momentum": 0.05, "norm_placement": "joint"}},
        {"norm": {"name": "batch", "momentum": 0.05, "norm_placement": "joint"}, "norm_max_steps": 7},
        BatchNormSpec(momentum=0.05, norm_placement="joint", max_steps=7),
    ),
    (
        {"norm": "batch_renorm", "rnn_options": {"norm_options": {"r_max": 2.0}, "zoneout_h": 0.1}},
        {"norm": {"name": "batch_renorm", "r_max": 2.0}, "rnn_options": {"zoneout_h": 0.1}},
        BatchRenormSpec(r_max=2.0),
    ),
    (  # a spec saved as data, with a keyword beside it (the keyword set a field the spec left at its default)
        {"norm": LayerNormSpec(eps=1e-3).to_dict(), "rnn_options": {"state_norm": "carried", "gamma_init": 0.5}},
        {"norm": {**LayerNormSpec(eps=1e-3).to_dict(), "state_norm": "carried", "gamma_init": 0.5}},
        LayerNormSpec(eps=1e-3, state_norm="carried", gamma_init=0.5),
    ),
    (  # keywords at their defaults said nothing, whatever the norm; "error" was the model-wide default
        {"norm": "layer", "small_batch": "error", "rnn_options": {"momentum": 0.1, "eps": 1e-5, "affine": True}},
        {"norm": "layer"},
        LayerNormSpec(),
    ),
    (
        {"norm": "weight", "rnn_options": {"norm_options": {"mean_only_bn": True}, "momentum": 0.2}},
        {"norm": {"name": "weight", "mean_only_bn": True, "momentum": 0.2}},
        WeightNormSpec(mean_only_bn=True, momentum=0.2),
    ),
]


def _hparams(**changes: Any) -> dict[str, Any]:
    """A LanguageModel's saved hyperparameters (all of them, as ``save_hyperparameters`` stores them), changed."""
    saved = dict(LanguageModel(30, hidden_size=8, embedding_dim=4).hparams)
    if "max_steps" in changes:  # a checkpoint of before the rename has the old name only
        del saved["norm_max_steps"]
    return {**saved, **changes}


@pytest.mark.parametrize(("old", "new", "spec"), OLD)
def test_old_hyperparameters_are_translated_to_todays(old: dict[str, Any], new: dict[str, Any], spec: Any) -> None:
    translated = current_hparams(_hparams(**old))
    assert translated == {**_hparams(**new), "small_batch": translated["small_batch"]}
    assert "max_steps" not in translated
    model = LanguageModel(**translated)
    assert model.model.rnn.norm_spec == spec
    assert current_hparams(dict(model.hparams)) == dict(model.hparams)  # today's keys stay as they are


def test_todays_model_refuses_the_old_keys() -> None:
    with pytest.raises(TypeError, match=r"^LSTM: got an unexpected keyword 'momentum'; pass norm=BatchNormSpec\(mom"):
        LanguageModel(10, norm="batch", rnn_options={"momentum": 0.05})
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_steps'"):
        LanguageModel(10, norm="batch", max_steps=7)  # type: ignore[call-arg]


@pytest.mark.parametrize("cls", [LanguageModel, SequenceClassifier])
def test_a_checkpoint_with_old_keys_loads_the_same_model(cls: type, tmp_path: Path) -> None:
    sizes = (10,) if cls is LanguageModel else (10, 3)
    spec = BatchNormSpec(momentum=0.05, norm_placement="joint", input_stats="timestep", max_steps=7)
    model = cls(*sizes, norm=spec, hidden_size=8, embedding_dim=4)
    torch.manual_seed(0)
    model.train()(torch.randint(1, 10, (3, 5)), torch.tensor([5, 4, 5]))  # running statistics move
    old = {k: v for k, v in model.hparams.items() if k not in ("norm_max_steps", "norm")}
    old |= {"norm": "batch", "max_steps": 7, "rnn_options": {"momentum": 0.05, "norm_placement": "joint"}}
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": old, "pytorch-lightning_version": "2.4.0"}, path)
    loaded = cls.load_from_checkpoint(path)
    assert loaded.model.rnn.norm_spec == spec
    inputs, lengths = torch.randint(1, 10, (3, 6)), torch.tensor([6, 2, 4])
    torch.testing.assert_close(loaded.eval()(inputs, lengths), model.eval()(inputs, lengths), rtol=0, atol=0)


def test_the_cli_evaluates_a_checkpoint_with_old_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    corpus = TextCorpus()
    model = LanguageModel(corpus.vocab_size, corpus.pad_index, norm="batch", hidden_size=16, embedding_dim=8)
    old = {k: v for k, v in model.hparams.items() if k != "norm_max_steps"}
    old |= {"max_steps": 100, "rnn_options": {"momentum": 0.1, "beyond_max_steps": "pooled"}}
    model = LanguageModel(**current_hparams(old))
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": old, "pytorch-lightning_version": "2.4.0"}, path)
    main(["test", *SMALL_LM, *QUIET, "--trainer.limit_test_batches", "1", "--ckpt_path", str(path)])
    config = yaml.safe_load((run_path(0, tmp_path) / "config.yaml").read_text())["model"]["init_args"]
    assert config["norm"]["init_args"]["beyond_max_steps"] == "pooled" and config["rnn_options"] is None


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ({"max_steps": 50}, "model.init_args.max_steps: model argument 'max_steps' was renamed 'norm_max_steps'"),
        (
            {"rnn_options": {"eps": 0.001}},
            "model.init_args.rnn_options.eps: rnn_options.eps is no longer accepted: a norm's options are fields of "
            "its spec, write --model.norm.class_path seqnorm.norms.<Norm>Spec --model.norm.init_args.eps ...",
        ),
    ],
)
def test_the_command_refuses_an_old_config_naming_the_replacement(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    model: dict[str, Any],
    expected: str,
) -> None:
    from tests.conftest import cli_usage_error

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "old.yaml"
    config.write_text(yaml.safe_dump({"model": {"class_path": "LanguageModel", "init_args": model}}))
    overlay = tmp_path / "overlay.yaml"  # an overlay without class_path, as configs/norm/*.yaml are written
    overlay.write_text(yaml.safe_dump({"model": {"init_args": model}}))
    for path, extra in ((config, []), (overlay, ["--model", "LanguageModel"])):
        lines = cli_usage_error(capsys, ["fit", *extra, "--config", str(path), "--data", "TextCorpus"]).splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"seqnorm fit: error: --config {path}: {expected}"), lines


def test_old_flags_are_refused_naming_the_replacement(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.conftest import cli_usage_error

    error = cli_usage_error(capsys, ["fit", *SMALL_LM, "--model.max_steps", "7", *QUIET])
    assert "--model.max_steps: model argument 'max_steps' was renamed 'norm_max_steps'" in error
    error = cli_usage_error(capsys, ["fit", *SMALL_LM, "--model.rnn_options", '{"norm_options": {"r_max": 2}}'])
    assert "--model.rnn_options: rnn_options.norm_options is no longer accepted" in error
