"""Checkpoints are untrusted input: crafted, foreign, broken or contradicted ones end in one message and exit 2.

One tiny language model is trained once for the module; each test copies or edits its checkpoint.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

import seqnorm.cli.app
import seqnorm.cli.checks
import seqnorm.lightning.base
from seqnorm import checkpoint_io
from seqnorm.checkpoint_io import CheckpointError
from seqnorm.cli import main
from seqnorm.data import TextCorpus
from seqnorm.lightning import LanguageModel
from seqnorm.lightning.base import TaskModule
from seqnorm.lightning.checkpoint import ResumableCheckpoint
from tests.conftest import QUIET, logged_scalars, run_path, write_story

TINY = ["--model.hidden_size", "16", "--model.embedding_dim", "8", *QUIET]
SHORT = ["--trainer.max_steps", "4", "--trainer.limit_val_batches", "2"]
LM = ["--model", "LanguageModel", "--data", "TextCorpus"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``last.ckpt`` of a 4-step run (hidden_size 16) on a story written beside it; copy it before changing it."""
    root = tmp_path_factory.mktemp("trained")
    story = write_story(root / "story.txt", lines=200)
    main(["fit", *LM, "--data.path", str(story), *TINY, *SHORT, "--trainer.default_root_dir", str(root)])
    return run_path(0, root) / "checkpoints" / "last.ckpt"


@pytest.fixture
def story(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trained: Path) -> Path:
    """The story the checkpoint was trained on, in a fresh working directory."""
    monkeypatch.chdir(tmp_path)
    return Path(shutil.copy(trained.parents[4] / "story.txt", tmp_path / "story.txt"))


def _fails(capsys: pytest.CaptureFixture, args: list[str]) -> str:
    """Run ``seqnorm args``; assert exit code 2 and one paragraph without a traceback; return the message."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr
    message = stderr.rstrip("\n").splitlines()[-1]  # Lightning's log lines ("Seed set to 0") may come before it
    assert message.startswith(f"seqnorm {args[0]}: error: ")
    return message


def _commands(ckpt: Path, story: Path) -> dict[str, list[str]]:
    data = ["--data.path", str(story)]
    return {
        "generate": ["generate", "--ckpt_path", str(ckpt)],
        "fit": ["fit", *LM, *data, *TINY, *SHORT, "--ckpt_path", str(ckpt)],
        "test": ["test", *LM, *data, *TINY, "--ckpt_path", str(ckpt)],
    }


class _Touch:
    """Unpickling this calls ``Path.touch(marker)``: a stand-in for ``os.system`` that leaves visible evidence."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., None], tuple[Path]]:
        return pathlib.Path.touch, (self.marker,)


@pytest.fixture
def crafted(tmp_path: Path) -> tuple[Path, Path]:
    """``(checkpoint, marker)``: a checkpoint-shaped file whose pickle would create ``marker``."""
    marker = tmp_path / "pwned"
    path = tmp_path / "crafted.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {}, "payload": _Touch(marker)}, path)
    return path, marker


def test_the_crafted_file_would_run_its_payload(crafted: tuple[Path, Path]) -> None:
    path, marker = crafted
    torch.load(path, weights_only=False)  # what `seqnorm generate` used to do
    assert marker.exists()


@pytest.mark.parametrize("command", ["generate", "fit", "test"])
def test_crafted_pickle_is_refused_and_never_runs(
    story: Path, crafted: tuple[Path, Path], capsys: pytest.CaptureFixture, command: str
) -> None:
    path, marker = crafted
    error = _fails(capsys, _commands(path, story)[command])
    assert f"--ckpt_path {path}: refused" in error and "nothing in it was executed" in error
    assert "pathlib" in error  # the global it asked for
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="nothing in it was executed"):
        LanguageModel.load_from_checkpoint(path)
    assert not marker.exists()


def test_console_script_refuses_a_crafted_checkpoint(story: Path, crafted: tuple[Path, Path]) -> None:
    path, marker = crafted
    result = subprocess.run(
        [sys.executable, "-m", "seqnorm.cli", "generate", "--ckpt_path", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and str(path) in result.stderr and "Traceback" not in result.stderr
    assert not marker.exists()


def _marker_module(folder: Path, name: str, class_name: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The marker file that importing module ``name`` (written to ``folder``, put on ``sys.path``) creates; the
    module defines ``class_name``."""
    marker = folder / "imported"
    (folder / f"{name}.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\nclass {class_name}:\n    def __init__(self): ...\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return marker


@pytest.mark.parametrize("command", ["generate", "fit", "test"])
@pytest.mark.parametrize("key", ["_class_path", "rnn_options"])
def test_foreign_class_path_is_refused_without_importing_it(
    story: Path,
    trained: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    key: str,
) -> None:
    marker = _marker_module(story.parent, "foreign_model_module", "Model", monkeypatch)
    checkpoint = torch.load(trained, weights_only=True)
    # at the top, or nested where jsonargparse would resolve it while building the model
    foreign = "foreign_model_module.Model"
    checkpoint["hyper_parameters"][key] = foreign if key == "_class_path" else {"zoneout_h": {"class_path": foreign}}
    path = story.parent / "foreign.ckpt"
    torch.save(checkpoint, path)
    error = _fails(capsys, _commands(path, story)[command])
    assert f"--ckpt_path {path}: refused" in error and f"'{foreign}'" in error and "not imported" in error
    assert not marker.exists() and "foreign_model_module" not in sys.modules


def _past_hparams_checkpoint(
    story: Path, trained: Path, monkeypatch: pytest.MonkeyPatch, key: str
) -> tuple[Path, Path]:
    """``(checkpoint, marker)``: the class spec under Lightning's hyperparameter key of before 1.0 (``hparams``,
    ``module_arguments``), which its loader merges into the model's arguments; ``rnn_options`` (an Any that
    jsonargparse resolves a class_path in) left out of the checked ``hyper_parameters`` so that it comes from there."""
    marker = _marker_module(story.parent, "past_hparams_module", "Init", monkeypatch)
    checkpoint = torch.load(trained, weights_only=True)
    del checkpoint["hyper_parameters"]["rnn_options"]
    checkpoint[key] = {"rnn_options": {"init": {"class_path": "past_hparams_module.Init"}}}
    path = story.parent / f"past_{key}.ckpt"
    torch.save(checkpoint, path)
    return path, marker


@pytest.mark.parametrize("key", ["hparams", "module_arguments"])
def test_a_class_under_lightnings_past_hparams_key_was_imported_without_the_check(
    story: Path, trained: Path, monkeypatch: pytest.MonkeyPatch, key: str
) -> None:
    path, marker = _past_hparams_checkpoint(story, trained, monkeypatch, key)
    monkeypatch.setattr("seqnorm.checkpoint_io._check_lightning_keys", lambda checkpoint, where: None)
    with pytest.raises(Exception):  # noqa: B017 -- whatever the built object then breaks: it was built
        LanguageModel.load_from_checkpoint(path)
    assert marker.exists()


@pytest.mark.parametrize("command", ["generate", "fit", "test"])
@pytest.mark.parametrize("key", ["hparams", "module_arguments"])
def test_lightnings_past_hparams_keys_are_refused_without_importing(
    story: Path,
    trained: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    key: str,
) -> None:
    """A crafted ``hparams`` key had ``generate`` and ``load_from_checkpoint`` build ``subprocess.Popen(shell=True)``
    from it: Lightning merges it into the model's arguments, and seqnorm checked ``hyper_parameters`` only."""
    path, marker = _past_hparams_checkpoint(story, trained, monkeypatch, key)
    error = _fails(capsys, _commands(path, story)[command])
    assert f"--ckpt_path {path}: refused: it holds '{key}'" in error and "nothing in it was built" in error
    with pytest.raises(CheckpointError, match=f"refused: it holds '{key}'"):
        LanguageModel.load_from_checkpoint(path)
    assert not marker.exists() and "past_hparams_module" not in sys.modules


def test_an_hparams_name_other_than_kwargs_is_refused(story: Path, trained: Path) -> None:
    """Lightning wraps every saved hyperparameter into the ``__init__`` argument it names: a TypeError traceback."""
    checkpoint = torch.load(trained, weights_only=True)
    assert checkpoint["hparams_name"] == "kwargs"  # what save_hyperparameters() writes
    checkpoint["hparams_name"] = "rnn_options"
    path = story.parent / "hparams_name.ckpt"
    torch.save(checkpoint, path)
    with pytest.raises(CheckpointError, match="expected its hparams_name to be 'kwargs', got 'rnn_options'"):
        LanguageModel.load_from_checkpoint(path)


CONFIGS_NAMING = {
    "a callback": (
        "trainer:\n  callbacks:\n    - class_path: config_module.Thing\n",
        "trainer.callbacks[0].class_path",
    ),
    "an optimizer by name": ("optimizer: config_module.Thing\n", "optimizer"),
    "a section in another file": ("trainer: more.yaml\n", "trainer.callbacks[0].class_path"),
    "the model": ("model:\n  class_path: config_module.Thing\n", "model.class_path"),
}


@pytest.mark.parametrize("case", list(CONFIGS_NAMING))
def test_a_config_file_naming_a_class_outside_seqnorm_torch_and_lightning_is_refused_before_its_import(
    story: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """jsonargparse imported the module a --config file named (its code ran: a file from elsewhere could run
    anything); the file and every file it names are checked first."""
    marker = _marker_module(story.parent, "config_module", "Thing", monkeypatch)
    text, key = CONFIGS_NAMING[case]
    (story.parent / "more.yaml").write_text("callbacks:\n  - class_path: config_module.Thing\n", encoding="utf-8")
    config = story.parent / "from_elsewhere.yaml"
    config.write_text(text, encoding="utf-8")
    args = ["fit", *([] if case == "the model" else LM), "--data.path", str(story), *TINY, "--config", str(config)]
    error = _fails(capsys, args)
    assert f"--config {config}: refused: {key} names 'config_module.Thing', outside seqnorm, torch, lightning" in error
    assert "SEQNORM_TRUSTED_MODULES=config_module" in error
    assert not marker.exists() and "config_module" not in sys.modules
    if case == "a callback":  # its package trusted: jsonargparse imports it (and refuses a class of no Callback)
        monkeypatch.setenv("SEQNORM_TRUSTED_MODULES", "config_module")
        with pytest.raises(SystemExit):
            main(args)
        assert marker.exists()


def test_a_config_file_builds_no_class_from_a_model_argument(story: Path, capsys: pytest.CaptureFixture) -> None:
    """``rnn_options`` is an Any: jsonargparse built any class_path there (torch's PackageImporter unpickles)."""
    config = story.parent / "any.yaml"
    config.write_text(
        "model:\n  init_args:\n    rnn_options:\n      init:\n        class_path: torch.package.PackageImporter\n"
    )
    error = _fails(capsys, ["fit", *LM, "--data.path", str(story), *TINY, "--config", str(config)])
    assert f"--config {config}: model: refused: its hyper_parameters.rnn_options.init names the class" in error


def test_the_shipped_configs_and_a_runs_own_config_name_only_trusted_classes(trained: Path) -> None:
    for config in [
        *Path(seqnorm.cli.app.__file__).parents[2].glob("configs/**/*.yaml"),
        trained.parents[1] / "config.yaml",
    ]:
        seqnorm.cli.checks.check_config_files(["--config", str(config)])


def _string_spec_checkpoint(
    story: Path, trained: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> tuple[Path, Path]:
    """``(checkpoint, marker)``: a class spec hidden in a string hyperparameter (JSON in ``rnn_options.init``, an Any,
    plain or with the key escaped; YAML in ``norm``; or ``norm`` naming a YAML file beside the checkpoint), naming a
    module whose import creates ``marker``."""
    marker = _marker_module(story.parent, "string_spec_module", "Spec", monkeypatch)
    checkpoint = torch.load(trained, weights_only=True)
    hparams = checkpoint["hyper_parameters"]
    spec = "class_path: string_spec_module.Spec\n"
    if form == "json":
        hparams["rnn_options"] = {"init": '{"class_path": "string_spec_module.Spec"}'}
    elif form == "escaped":  # no "class_path" in the string: only YAML reading it finds the key
        hparams["rnn_options"] = {"init": r'{"class\u005fpath": "string_spec_module.Spec"}'}
    elif form == "file":  # jsonargparse reads a string naming a file as a config file for `norm`
        (story.parent / "norm.yaml").write_text(spec, encoding="utf-8")
        hparams["norm"] = "norm.yaml"
    else:
        hparams["norm"] = spec
    path = story.parent / f"string_spec_{form}.ckpt"
    torch.save(checkpoint, path)
    return path, marker


def test_a_class_spec_in_a_string_would_be_imported_without_the_check(
    story: Path, trained: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # jsonargparse parses a string for an Any-typed field as YAML and resolves the class_path it finds there
    path, marker = _string_spec_checkpoint(story, trained, monkeypatch, "json")
    monkeypatch.setattr("seqnorm.checkpoint_io._structure_in_string", lambda value: None)
    with pytest.raises(ValueError):  # the model refuses the option, but only after the class was imported
        LanguageModel.load_from_checkpoint(path)
    assert marker.exists()


@pytest.mark.parametrize("command", ["generate", "fit", "test"])
@pytest.mark.parametrize("form", ["json", "escaped", "yaml", "file"])
def test_a_class_spec_in_a_string_is_refused_without_importing_it(
    story: Path,
    trained: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    form: str,
) -> None:
    path, marker = _string_spec_checkpoint(story, trained, monkeypatch, form)
    key = "rnn_options.init" if form in ("json", "escaped") else "norm"
    error = _fails(capsys, _commands(path, story)[command])
    assert f"--ckpt_path {path}: refused: its hyper_parameters.{key} is a string holding YAML/JSON" in error
    with pytest.raises(CheckpointError, match="nothing in it was parsed or imported"):
        LanguageModel.load_from_checkpoint(path)
    assert not marker.exists() and "string_spec_module" not in sys.modules


def _received_run(story: Path, trained: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """``(checkpoint, victim)``: a copy of the trained run, entered, whose checkpoint state records a "previous
    last.ckpt" that leads out of its folder to ``victim``, a directory with a file in it."""
    run = story.parent / "received"
    shutil.copytree(trained.parents[3], run / "lightning_logs")
    monkeypatch.chdir(run)  # as one resumes a run folder one was sent
    victim = story.parent / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep\n", encoding="utf-8")
    checkpoint_path = run_path(0, run) / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(checkpoint_path, weights_only=True)
    (key,) = [key for key in checkpoint["callbacks"] if key.startswith("ResumableCheckpoint")]
    state = checkpoint["callbacks"][key]
    state["last_model_path"] = state["dirpath"] + "/.." * 40 + str(victim)
    torch.save(checkpoint, checkpoint_path)
    return checkpoint_path, victim


def _resume(story: Path, checkpoint: Path) -> None:
    main(["fit", *LM, "--data.path", str(story), *TINY, "--trainer.max_steps", "8", "--ckpt_path", str(checkpoint)])


def test_a_received_run_would_delete_outside_its_folder_without_the_check(
    story: Path, trained: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lightning removes the previous last.ckpt recursively, and tests "inside dirpath" without resolving ".."
    checkpoint, victim = _received_run(story, trained, monkeypatch)
    monkeypatch.setattr("seqnorm.lightning.checkpoint.ResumableCheckpoint._owns", lambda self, path: True)
    _resume(story, checkpoint)
    assert not victim.exists()


def test_a_received_run_cannot_make_resuming_delete_outside_its_folder(
    story: Path, trained: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint, victim = _received_run(story, trained, monkeypatch)
    with pytest.warns(UserWarning, match="names files outside .* they are forgotten"):
        _resume(story, checkpoint)
    assert (victim / "precious.txt").read_text(encoding="utf-8") == "keep\n"
    assert torch.load(checkpoint, weights_only=True)["global_step"] == 8  # the run went on and saved last.ckpt


def test_what_a_run_may_remove_is_what_lies_inside_its_folder(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "link.ckpt").symlink_to(tmp_path / "elsewhere.ckpt")
    owns = ResumableCheckpoint(dirpath=str(folder))._owns
    assert owns(str(folder / "last.ckpt"))
    assert owns(str(folder / "best-val" / "loss=1.00.ckpt"))  # a filename template with a "/"
    assert not owns(str(folder / ".." / "victim"))  # ".." resolved
    assert not owns(str(folder / "link.ckpt"))  # a link resolved to where it points
    assert not owns(str(folder)) and not owns(str(tmp_path))
    assert not owns("memory://victim")  # a remote path in a local run's record
    assert not owns("s3://bucket/victim")  # nor one of a filesystem not installed here (no ImportError)
    remote = ResumableCheckpoint(dirpath="memory://run/checkpoints")._owns
    assert remote("memory://run/checkpoints/last.ckpt")
    assert not remote("memory://run/checkpoints/../../victim") and not remote("file:///run/checkpoints/last.ckpt")


def _truncated(trained: Path, path: Path) -> None:
    data = trained.read_bytes()
    path.write_bytes(data[: len(data) // 2])


BROKEN: dict[str, tuple[Callable[[Path, Path], object] | None, str]] = {
    "missing": (None, "no such checkpoint file"),
    "directory": (lambda trained, path: path.mkdir(), "is a directory"),
    "empty": (lambda trained, path: path.write_bytes(b""), "empty (0 bytes)"),
    "truncated": (_truncated, "truncated or corrupt"),
    "text": (lambda trained, path: path.write_text("not a checkpoint\n"), "not a PyTorch checkpoint"),
    "tensor": (lambda trained, path: torch.save(torch.zeros(3), path), "got Tensor"),
    "dict": (lambda trained, path: torch.save({"weights": torch.zeros(3)}, path), "expected a dict with state_dict"),
    # Files that load safely but do not fit their own hyperparameters (edited, or from elsewhere).
    "weight_missing": (lambda trained, path: _edited(trained, path, drop="model.rnn.weight_hh_l0"), "weight_hh_l0"),
    "weight_resized": (
        lambda trained, path: _edited(trained, path, resize="model.rnn.weight_hh_l0"),
        r"weight_hh_l0 of shape \[3, 3\] where the model has \[64, 16\]|weight_hh_l0: copying a param with shape",
    ),
    # A diverged run's weights: NaN metrics from test, a traceback from generate, NaN training from fit, before.
    "weight_nan": (
        lambda trained, path: _edited(trained, path, nan="model.rnn.weight_hh_l0"),
        r"its weights hold NaN or inf \(state_dict\.model\.rnn\.weight_hh_l0\)",
    ),
    # A hyperparameter its model class does not accept (jsonargparse's refusal, attributed to the file).
    "hparam_corrupt": (
        lambda trained, path: _edited(trained, path, hparams={"cell": "transformer"}),
        r"its hyper_parameters do not describe a LanguageModel \(.*cell.*transformer",
    ),
}


@pytest.mark.parametrize(
    ("norm", "key", "expected"),
    [
        (
            "batch",
            "norm_hh_l0.running_var",
            "its state_dict.model.rnn.norm_hh_l0.running_var holds a negative variance",
        ),
        (
            "weight",
            "parametrizations_l0.weight_hh.original1",
            "its state_dict.model.rnn.parametrizations_l0.weight_hh.original1 (a weight norm's direction) has a row",
        ),
    ],
)
def test_finite_weights_that_make_every_output_nan_are_refused(
    tmp_path: Path, norm: str, key: str, expected: str
) -> None:
    """No training writes them, and a test run on them reported ``test/loss nan`` and exited 0."""
    import seqnorm

    layer = seqnorm.LSTM(3, 4, norm=norm).eval()
    state = layer.state_dict()
    state[key][1] = -1.0 if norm == "batch" else 0.0
    layer.load_state_dict(state)
    assert torch.isnan(layer(torch.randn(5, 2, 3))[0][-1]).all()  # what evaluating them gives (from step 2)
    path = tmp_path / "nan_maker.ckpt"
    torch.save(
        {"state_dict": {f"model.rnn.{name}": value for name, value in state.items()}, "hyper_parameters": {}}, path
    )
    with pytest.raises(CheckpointError, match=re.escape(f"--ckpt_path {path}: a corrupt checkpoint: {expected}")):
        checkpoint_io.read_checkpoint(path)
    state[key][1] = 1.0  # the same with the row made sound again: read
    torch.save(
        {"state_dict": {f"model.rnn.{name}": value for name, value in state.items()}, "hyper_parameters": {}}, path
    )
    checkpoint_io.read_checkpoint(path)


def _edited(
    trained: Path,
    path: Path,
    drop: str | None = None,
    resize: str | None = None,
    hparams: dict | None = None,
    entries: dict | None = None,
    nan: str | None = None,
) -> None:
    checkpoint = torch.load(trained, weights_only=True)
    checkpoint["hyper_parameters"].update(hparams or {})
    checkpoint.update(entries or {})
    if drop is not None:
        del checkpoint["state_dict"][drop]
    if resize is not None:
        checkpoint["state_dict"][resize] = torch.zeros(3, 3)
    if nan is not None:
        checkpoint["state_dict"][nan][0, 0] = float("nan")
    torch.save(checkpoint, path)


@pytest.mark.parametrize("command", ["generate", "fit", "test"])
@pytest.mark.parametrize("kind", list(BROKEN))
def test_unusable_ckpt_path_is_one_message(
    story: Path, trained: Path, capsys: pytest.CaptureFixture, command: str, kind: str
) -> None:
    make, expected = BROKEN[kind]
    path = story.parent / f"{kind}.ckpt"
    if make is not None:
        make(trained, path)
    error = _fails(capsys, _commands(path, story)[command])
    assert f"--ckpt_path {path}: " in error and (expected in error or re.search(expected, error)), error


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        ({"seqnorm_random_states": {"torch": torch.zeros(3)}}, "expected its seqnorm_random_states to be states"),
        ({"seqnorm_recent_losses": [("x", 1)]}, "expected its seqnorm_recent_losses to be a list of (loss, token"),
        # a NaN there was logged as train/loss, the run exiting 0
        ({"seqnorm_recent_losses": [(float("nan"), 10)]}, "expected its seqnorm_recent_losses to be a list of"),
        ({"seqnorm_fallback_total": -3}, "expected its seqnorm_fallback_total to be a count, got -3"),
        ({"seqnorm_epoch_loss": (0, float("nan"), 3)}, "expected its seqnorm_epoch_loss to be an (epoch, loss sum"),
        # each was a traceback from deep in Lightning's restore, or from the first step
        ({"pytorch-lightning_version": "0.9.0"}, "expected its pytorch-lightning_version to be a version of Light"),
        ({"loops": {"fit_loop": "x"}}, "expected its loops to be a dict of the states of fit_loop, validate_loop"),
        ({"global_step": "4"}, "expected its global_step to be a count, got '4'"),
        ({"optimizer_states": [{"state": {}}]}, "expected its optimizer_states to be a list of optimizer states"),
        ({"callbacks": {"ResumableCheckpoint": "x"}}, "expected its callbacks to be a dict of the callbacks' states"),
        ({"seqnorm_stream_state": []}, "expected its seqnorm_stream_state to be a dict whose 'train' holds"),
    ],
)
def test_corrupt_resume_state_is_one_message(
    story: Path, trained: Path, capsys: pytest.CaptureFixture, entries: dict, expected: str
) -> None:
    path = story.parent / "corrupt_state.ckpt"
    _edited(trained, path, entries=entries)
    args = _commands(path, story)["fit"]
    args[args.index("--trainer.max_steps") + 1] = "8"  # past the checkpoint's 4 steps: training resumes
    error = _fails(capsys, args)
    assert f"--ckpt_path {path}: a corrupt checkpoint: {expected}" in error


def _callback_state(checkpoint: dict) -> dict:
    (key,) = [key for key in checkpoint["callbacks"] if key.startswith("ResumableCheckpoint")]
    return checkpoint["callbacks"][key]


def _adam_moment(checkpoint: dict) -> dict:
    return checkpoint["optimizer_states"][0]["state"][0]


EDITS: dict[str, tuple[Callable[[dict], object], str]] = {
    "no best_model_path": (
        lambda checkpoint: _callback_state(checkpoint).pop("best_model_path"),
        "expected the ResumableCheckpoint state's best_model_path to be a path, got 'nothing'",
    ),
    "a score in words": (
        lambda checkpoint: _callback_state(checkpoint).update(best_k_models={"a.ckpt": "low"}),
        "expected the ResumableCheckpoint state's best_k_models to be a dict of paths to scores",
    ),
    "a NaN moment": (  # it trained the weights to NaN and saved them, exit 0
        lambda checkpoint: _adam_moment(checkpoint)["exp_avg"].fill_(float("nan")),
        "its optimizer_states hold NaN or inf",
    ),
    "a moment of another shape": (  # a RuntimeError from inside Adam.step, after training had begun
        lambda checkpoint: _adam_moment(checkpoint).update(exp_avg=torch.zeros(2, 2)),
        "expected its optimizer_states to fit the model's parameters, got exp_avg of shape [2, 2] for a parameter",
    ),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_corrupt_training_state_is_one_message(
    story: Path, trained: Path, capsys: pytest.CaptureFixture, edit: str
) -> None:
    change, expected = EDITS[edit]
    checkpoint = torch.load(trained, weights_only=True)
    change(checkpoint)
    path = story.parent / "corrupt_training_state.ckpt"
    torch.save(checkpoint, path)
    args = _commands(path, story)["fit"]
    args[args.index("--trainer.max_steps") + 1] = "8"
    error = _fails(capsys, args)
    assert f"--ckpt_path {path}: a corrupt checkpoint: {expected}" in error


@pytest.mark.parametrize("command", ["fit", "test"])
def test_a_second_data_state_unlike_the_checked_one_is_refused(
    story: Path, trained: Path, capsys: pytest.CaptureFixture, command: str
) -> None:
    """Lightning also saves the DataModule's state under its class name and restores it after the CLI checked and
    adopted ``seqnorm_data``: a reordered vocabulary there was tested (and trained on) silently, a longer one ended
    in an IndexError traceback from the embedding."""
    path = story.parent / "second_vocab.ckpt"
    checkpoint = torch.load(trained, weights_only=True)
    assert checkpoint["TextCorpus"] == checkpoint["seqnorm_data"]  # as Lightning and seqnorm write them
    checkpoint["TextCorpus"]["vocab"]["tokens"].reverse()
    torch.save(checkpoint, path)
    args = _commands(path, story)[command]
    if command == "fit":
        args[args.index("--trainer.max_steps") + 1] = "8"
    error = _fails(capsys, args)
    assert f"--ckpt_path {path}: a corrupt checkpoint: expected its TextCorpus to be the data state saved" in error


def test_generate_refuses_a_vocabulary_that_does_not_fit_the_model(
    story: Path, trained: Path, capsys: pytest.CaptureFixture
) -> None:
    path = story.parent / "short_vocab.ckpt"
    checkpoint = torch.load(trained, weights_only=True)
    vocab = checkpoint["seqnorm_data"]["vocab"]
    vocab["tokens"] = vocab["tokens"][:-3]
    torch.save(checkpoint, path)
    error = _fails(capsys, ["generate", "--ckpt_path", str(path)])
    size = checkpoint["hyper_parameters"]["vocab_size"]
    assert f"a corrupt checkpoint: its vocabulary has {size - 3} tokens and its model {size}; use one" in error


def test_unwritable_default_root_dir_is_one_message(story: Path, capsys: pytest.CaptureFixture) -> None:
    # Under a regular file nothing can be created, even by root (who ignores permission bits).
    root = story / "logs"
    error = _fails(capsys, ["fit", *LM, "--data.path", str(story), *TINY, "--trainer.default_root_dir", str(root)])
    assert f"--trainer.default_root_dir {root}: cannot write there" in error


def test_resume_fills_unset_flags_from_the_checkpoint(story: Path, trained: Path) -> None:
    # --model.hidden_size as in the checkpoint, --model.embedding_dim unset (its default, 64, is not what was used)
    args = ["fit", *LM, "--data.path", str(story), "--model.hidden_size", "16", *QUIET]
    main([*args, "--trainer.max_steps", "6", "--trainer.limit_val_batches", "2", "--ckpt_path", str(trained)])
    run = run_path(0)
    resumed = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["global_step"] > torch.load(trained, weights_only=True)["global_step"]
    saved = yaml.safe_load((run / "config.yaml").read_text())["model"]["init_args"]
    assert (saved["hidden_size"], saved["embedding_dim"]) == (16, 8)
    assert resumed["hyper_parameters"]["embedding_dim"] == 8


@pytest.mark.parametrize("where", ["command line", "config file"])
def test_flag_contradicting_the_checkpoint_names_both_values(
    story: Path, trained: Path, capsys: pytest.CaptureFixture, where: str
) -> None:
    if where == "command line":
        flag = ["--model.hidden_size", "32"]
    else:
        Path("override.yaml").write_text("model:\n  init_args:\n    hidden_size: 32\n", encoding="utf-8")
        flag = ["--config", "override.yaml"]
    for command in ("fit", "test"):
        args = [command, *LM, *flag, "--data.path", str(story), *QUIET, "--ckpt_path", str(trained)]
        error = _fails(capsys, args)
        assert f"--model.hidden_size 32 contradicts the checkpoint {trained} (hidden_size=16)" in error
    assert not Path("lightning_logs").exists()


@pytest.mark.parametrize("command", ["test", "fit"])
def test_a_checkpoint_naming_no_class_asks_for_the_model(
    story: Path, trained: Path, capsys: pytest.CaptureFixture, command: str
) -> None:
    # as trainer.save_checkpoint writes it from Python: it was jsonargparse's usage and `required: test.model`
    checkpoint = torch.load(trained, weights_only=True)
    del checkpoint["hyper_parameters"]["_class_path"]
    path = story.parent / "from_python.ckpt"
    torch.save(checkpoint, path)
    assert _fails(capsys, [command, "--ckpt_path", str(path)]) == (
        f"seqnorm {command}: error: --ckpt_path {path}: the checkpoint names no model class (it was not written by "
        "`seqnorm fit`): pass --model LanguageModel or --model SequenceClassifier"
    )


def test_model_class_contradicting_the_checkpoint(story: Path, trained: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["fit", "--model", "SequenceClassifier", "--data", "LabeledText", "--data.train_path", str(story)]
    error = _fails(capsys, [*args, "--ckpt_path", str(trained)])
    assert "--model SequenceClassifier contradicts" in error and "LanguageModel" in error


def test_resuming_on_another_corpus_is_refused_before_any_size_mismatch(
    story: Path, trained: Path, capsys: pytest.CaptureFixture
) -> None:
    other = write_story(story.parent / "other.txt", lines=200, words=["zebra", "quiz", "jumping", "vex", "the"], seed=1)
    args = ["fit", *LM, "--data.path", str(other), *QUIET, *SHORT, "--ckpt_path", str(trained)]
    error = _fails(capsys, args)
    vocab = torch.load(trained, weights_only=True)["seqnorm_data"]["vocab"]["tokens"]
    assert f"--data.path {other}: its vocabulary" in error and str(trained) in error
    assert f"({len(vocab)} entries;" in error and "'z'" in error
    assert "size mismatch" not in error


def test_resuming_with_another_batch_size_is_refused(story: Path, trained: Path, capsys: pytest.CaptureFixture) -> None:
    saved = torch.load(trained, weights_only=True)["seqnorm_data"]["batch_size"]
    args = ["fit", *LM, "--data.path", str(story), "--data.batch_size", str(saved + 1), *QUIET, *SHORT]
    error = _fails(capsys, [*args, "--ckpt_path", str(trained)])
    assert error.endswith(
        f"error: --data.batch_size {saved + 1}: the checkpoint {trained} was trained with --data.batch_size {saved}, "
        f"and a resumed fit continues that run's data order in batches of {saved}: pass --data.batch_size {saved}, "
        "or start a new run without --ckpt_path"
    )
    main(["test", *LM, "--data.path", str(story), "--data.batch_size", "3", *QUIET, "--ckpt_path", str(trained)])


def test_evaluation_reads_new_text_with_the_checkpoints_vocabulary(story: Path, trained: Path) -> None:
    """``test --data.test_path`` on held-out text: nothing is carved off ``--data.path`` for testing then, so the
    data's own vocabulary would come out in another order (it was refused). The checkpoint's mapping applies: the
    carved test text, passed as a file, scores exactly what the carved split does; other text is read too."""
    held_out = story.parent / "held_out.txt"
    held_out.write_text(TextCorpus(path=str(story))._load_items()["test"], encoding="utf-8")
    other = write_story(story.parent / "other.txt", lines=50, words=["zebra", "quiz", "the"], seed=1)
    losses = []
    for extra in ([], ["--data.test_path", str(held_out)], ["--data.test_path", str(other)]):
        main(["test", *LM, "--data.path", str(story), *extra, *QUIET, "--ckpt_path", str(trained)])
        losses.append(logged_scalars(run_path(len(losses)))["test/loss"][-1][1])
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    assert all(loss == loss and loss < 10 for loss in losses)  # finite: unknown characters read as <unk>


def test_weights_only_false_is_refused(story: Path, trained: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["test", *LM, "--data.path", str(story), *QUIET, "--ckpt_path", str(trained), "--weights_only", "false"]
    assert "--weights_only false: refused" in _fails(capsys, args)


def test_the_trainer_restores_the_checkpoint_with_weights_only(
    story: Path, trained: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning's default for a local file is weights_only=False: the CLI hands the Trainer method True, which
    reaches the checkpoint plugin, while the run's config.yaml keeps the user's value (null)."""
    given = []
    load = checkpoint_io.CheckedCheckpointIO.load_checkpoint

    def recording(self: checkpoint_io.CheckedCheckpointIO, path: str, map_location=None, weights_only=None) -> dict:
        given.append(weights_only)
        return load(self, path, map_location, weights_only)

    monkeypatch.setattr(checkpoint_io.CheckedCheckpointIO, "load_checkpoint", recording)
    main(["test", *LM, "--data.path", str(story), *QUIET, "--ckpt_path", str(trained)])
    assert given and set(given) == {True}
    assert yaml.safe_load((run_path(0) / "config.yaml").read_text(encoding="utf-8"))["weights_only"] is None


def test_refused_rnn_option_shows_the_model_sentence_first(story: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["fit", *LM, "--data.path", str(story), *TINY, "--model.rnn_options", '{"small_batch": "running"}']
    error = _fails(capsys, args)
    assert error.startswith(
        "seqnorm fit: error: LanguageModel: expected rnn_options without arguments the model takes itself, got "
        "small_batch (use --model.small_batch)"
    )
    assert "Union" not in error


def test_load_from_checkpoint_reads_a_real_checkpoint(trained: Path) -> None:
    model = LanguageModel.load_from_checkpoint(trained)
    assert model.hparams.hidden_size == 16
    saved = torch.load(trained, weights_only=True)["state_dict"]
    torch.testing.assert_close(model.state_dict(), saved)


@pytest.mark.parametrize("cls", [LanguageModel, TextCorpus])
def test_load_from_checkpoint_refuses_weights_only_false(trained: Path, cls: type) -> None:
    # Lightning's keyword passed on beside ours: a bare TypeError (the model), an unexpected argument (the data)
    with pytest.raises(CheckpointError, match=rf"^{cls.__name__}.load_from_checkpoint: weights_only=False: refused"):
        cls.load_from_checkpoint(trained, weights_only=False)
    assert cls.load_from_checkpoint(trained, weights_only=True) is not None


def test_load_from_checkpoint_names_the_file_when_the_model_refuses_a_saved_value(
    story: Path, trained: Path, capsys: pytest.CaptureFixture
) -> None:
    path = story.parent / "negative_size.ckpt"
    _edited(trained, path, hparams={"hidden_size": -1})  # an int, so jsonargparse lets it through to the model
    with pytest.raises(
        CheckpointError, match=r"load_from_checkpoint .*negative_size.ckpt: a corrupt checkpoint: .*hidden_size"
    ):
        LanguageModel.load_from_checkpoint(path)
    error = _fails(capsys, ["generate", "--ckpt_path", str(path)])
    assert f"--ckpt_path {path}: a corrupt checkpoint: " in error and "hidden_size" in error


def test_generate_restarts_stream_windows_as_the_run_did(
    story: Path, trained: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict = {}
    monkeypatch.setattr("seqnorm.cli.app.generate_text", lambda *args, **kwargs: seen.update(kwargs) or "")
    data_state = torch.load(trained, weights_only=True)["seqnorm_data"]
    assert data_state["unit"] == "stream"  # a character file: streams, with stream_steps="restart" by default
    main(["generate", "--ckpt_path", str(trained)])
    assert seen["window_steps"] == data_state["window_length"] - 1
    older = story.parent / "older.ckpt"  # written before the data state recorded its window length
    checkpoint = torch.load(trained, weights_only=True)
    del checkpoint["seqnorm_data"]["window_length"]
    torch.save(checkpoint, older)
    main(["generate", "--ckpt_path", str(older)])
    assert seen["window_steps"] is None


# ---- one read: what was checked is what is built --------------------------------------------------------------


def _swap_after_the_check(monkeypatch: pytest.MonkeyPatch, link: Path, replacement: Path) -> None:
    """Point the symlink ``link`` at ``replacement`` the moment seqnorm has read and checked it, as an attacker's
    loop flipping the link would at the worst time: every later read of the path gets the replacement."""
    real = checkpoint_io.read_checkpoint

    def read_then_swap(path: object, *args: object) -> dict:
        checkpoint = real(path, *args)
        if Path(path) == link:
            link.unlink()
            link.symlink_to(replacement)
        return checkpoint

    for module in (seqnorm.cli.app, seqnorm.lightning.base):
        monkeypatch.setattr(module, "read_checkpoint", read_then_swap)


@pytest.fixture(params=["class_path", "pickle"])
def swapped(
    request: pytest.FixtureRequest, story: Path, trained: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, Path]:
    """``(link, marker)``: a symlink to the genuine checkpoint that turns, right after the check, into one whose
    ``hyper_parameters.norm`` names a class in a module that creates ``marker`` on import (what jsonargparse would
    import if the model were built from a second read), or into one whose pickle would create ``marker``."""
    genuine = Path(shutil.copy(trained, story.parent / "genuine.ckpt"))
    evil = story.parent / "evil.ckpt"
    if request.param == "class_path":
        marker = _marker_module(story.parent, "evilmod", "Spec", monkeypatch)
        _edited(trained, evil, hparams={"norm": {"class_path": "evilmod.Spec"}})
    else:
        marker = story.parent / "pwned"
        _edited(trained, evil, entries={"payload": _Touch(marker)})
    link = story.parent / "last.ckpt"
    link.symlink_to(genuine)
    _swap_after_the_check(monkeypatch, link, evil)
    return link, marker


def test_load_from_checkpoint_builds_what_it_checked(trained: Path, swapped: tuple[Path, Path]) -> None:
    link, marker = swapped
    model = LanguageModel.load_from_checkpoint(link)
    assert link.resolve().name == "evil.ckpt"  # the swap happened, after the one read
    assert not marker.exists() and "evilmod" not in sys.modules
    torch.testing.assert_close(model.state_dict(), torch.load(trained, weights_only=True)["state_dict"])


@pytest.mark.parametrize("command", ["generate", "fit", "test"])
def test_cli_builds_and_restores_what_it_checked(story: Path, swapped: tuple[Path, Path], command: str) -> None:
    link, marker = swapped
    args = _commands(link, story)[command]
    if command == "fit":
        args[args.index("--trainer.max_steps") + 1] = "6"  # past the checkpoint's 4 steps: its state is restored
    main(args)  # the evil file is never read: neither built nor restored (weights_only would refuse the pickle)
    assert link.resolve().name == "evil.ckpt"
    assert not marker.exists() and "evilmod" not in sys.modules


def test_a_checked_file_swapped_before_a_second_read_imports_its_class(
    story: Path, trained: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What `load_from_checkpoint` did before: check the path's contents, then let Lightning read the path again.
    marker = _marker_module(story.parent, "evilmod", "Spec", monkeypatch)
    link = story.parent / "last.ckpt"
    link.symlink_to(trained)
    checkpoint_io.read_checkpoint(link)
    _edited(trained, story.parent / "evil.ckpt", hparams={"norm": {"class_path": "evilmod.Spec"}})
    link.unlink()
    link.symlink_to(story.parent / "evil.ckpt")
    with pytest.raises(Exception):  # noqa: B017 - it fails, but only after the class was imported
        super(TaskModule, LanguageModel).load_from_checkpoint(link, weights_only=True)
    assert marker.exists()


def test_hparams_file_is_checked_too(story: Path, trained: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = _marker_module(story.parent, "hparams_module", "Spec", monkeypatch)
    hparams = dict(torch.load(trained, weights_only=True)["hyper_parameters"])
    hparams["norm"] = {"class_path": "hparams_module.Spec"}
    hparams_file = story.parent / "hparams.yaml"
    hparams_file.write_text(yaml.safe_dump(hparams), encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"hparams_file .*hparams.yaml: refused: its hyper_parameters.norm"):
        LanguageModel.load_from_checkpoint(trained, hparams_file=hparams_file)
    assert not marker.exists() and "hparams_module" not in sys.modules
    hparams["norm"] = "rms"
    hparams_file.write_text(yaml.safe_dump(hparams), encoding="utf-8")
    assert LanguageModel.load_from_checkpoint(trained, hparams_file=hparams_file, strict=False).hparams.norm == "rms"


LAUGHS = "\n".join(  # "billion laughs": nine aliases of nine aliases ... of a string, 10**9 strings once expanded
    [f"laugh0: &laugh0 [{', '.join(['lol'] * 9)}]"]
    + [f"laugh{n}: &laugh{n} [{', '.join([f'*laugh{n - 1}'] * 9)}]" for n in range(1, 9)]
)


@pytest.mark.parametrize("where", ["a key of its own", "a model argument"])
def test_a_billion_laughs_hparams_file_is_a_checkpoint_error(
    story: Path, trained: Path, capsys: pytest.CaptureFixture, where: str
) -> None:
    """It was a raw TypeError, where other bad files get the one-line CheckpointError."""
    hparams = dict(torch.load(trained, weights_only=True)["hyper_parameters"])
    text = yaml.safe_dump(hparams) + LAUGHS + "\n"
    if where == "a model argument":
        text = yaml.safe_dump({k: v for k, v in hparams.items() if k != "init"}) + LAUGHS + "\ninit: *laugh8\n"
    hparams_file = story.parent / "laughs.yaml"
    hparams_file.write_text(text, encoding="utf-8")
    with pytest.raises(CheckpointError) as caught:
        LanguageModel.load_from_checkpoint(trained, hparams_file=hparams_file)
    assert str(caught.value).startswith(f"LanguageModel.load_from_checkpoint: hparams_file {hparams_file}: refused: ")
    assert "alias" in str(caught.value) and "\n" not in str(caught.value)


def _with_text_format(trained: Path, path: Path, text_format: object) -> None:
    checkpoint = torch.load(trained, weights_only=True)
    checkpoint["seqnorm_data"]["text_format"] = text_format
    torch.save(checkpoint, path)


@pytest.mark.parametrize("command", ["fit", "validate", "test", "predict"])
@pytest.mark.parametrize("form", ["dict", "path"])
def test_corrupt_saved_text_format_names_the_file(
    story: Path, trained: Path, capsys: pytest.CaptureFixture, command: str, form: str
) -> None:
    path = story.parent / f"text_format_{form}.ckpt"
    _with_text_format(trained, path, {"class_path": "x"} if form == "dict" else str(story))
    args = ["--data.path", str(story), *TINY, "--ckpt_path", str(path)]
    error = _fails(capsys, [command, *LM, *args])
    assert f"--ckpt_path {path}: a corrupt checkpoint: expected its seqnorm_data.text_format to be one of" in error
