"""Evaluating a checkpoint needs only ``--ckpt_path`` and the new file, and no split is carved out of sight.

As a user hits it (issue 31, items 2 and 3): ``seqnorm fit --config configs/char_lm.yaml --model.hidden_size ...
--data.train_path A --data.val_path B``, then ``seqnorm test --ckpt_path last.ckpt --data.test_path C``, run as the
``seqnorm`` command in a process of its own. One tiny two-step run is trained for the module.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from seqnorm.checkpoint_io import CheckpointError
from seqnorm.cli import main
from seqnorm.cli.threads import THREADS_ENV
from seqnorm.data import DataError, LabeledText, TextCorpus
from seqnorm.data.base import SequenceDataModule
from tests.conftest import QUIET, logged_scalars, write_story

ROOT = Path(__file__).resolve().parents[2]
RUN = "lightning_logs/charlm-A-lstm-layer-h16"  # the run's folder, named after what it trains: a char LM on A.txt
LAST = f"{RUN}/version_0/checkpoints/last.ckpt"
# The user's command, with a model and batches small enough for a test (the config's sizes are a real run's).
SIZES = ["--model.hidden_size", "16", "--model.embedding_dim", "8", "--data.batch_size", "4"]
SIZES += ["--data.window_length", "33"]
FIT = ["--config", str(ROOT / "configs" / "char_lm.yaml"), *SIZES, "--data.train_path", "A.txt"]
FIT += ["--data.val_path", "B.txt"]
SHORT = ["--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", *QUIET]


def _seqnorm(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The ``seqnorm`` command (``python -m seqnorm.cli``, what the console script calls) run in ``folder``."""
    env = {**os.environ, THREADS_ENV: "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "seqnorm.cli", *args], cwd=folder, env=env, capture_output=True, text=True, timeout=300
    )


def _write_texts(folder: Path) -> None:
    write_story(folder / "A.txt", lines=300, seed=0)  # training
    write_story(folder / "B.txt", lines=60, seed=1)  # validation
    write_story(folder / "C.txt", lines=60, seed=2)  # the new file a trained model is tested on


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A folder with A/B/C.txt and ``lightning_logs/<run name>/version_0`` of the user's run; and what that fit
    printed."""
    folder = tmp_path_factory.mktemp("run")
    _write_texts(folder)
    result = _seqnorm(folder, "fit", *FIT, *SHORT)
    assert result.returncode == 0, result.stderr
    return folder, result.stderr


@pytest.fixture
def run(trained: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the trained folder, as the working directory."""
    shutil.copytree(trained[0], tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _bpc(run: Path, number: int) -> float:
    """test/bpc of the ``number``-th test of the run's checkpoint (beside the run, in its folder)."""
    return logged_scalars(run / f"{RUN}/version_0/test_{number}")["test/bpc"][-1][1]


@pytest.mark.usefixtures("one_route")  # here and in the child (--trainer.deterministic): the route trials round apart
def test_a_checkpoint_is_tested_on_a_new_file_with_nothing_else(run: Path) -> None:
    """It stopped at "Option 'test_path' is not accepted": the data module was not taken from the checkpoint."""
    one_route = ["--trainer.deterministic", "true"]
    alone = _seqnorm(run, "test", "--ckpt_path", LAST, "--data.test_path", "C.txt", *one_route, *QUIET)
    assert alone.returncode == 0, alone.stderr
    # the full original command, the test file added: the same data set-up, so the same number
    main(["test", *FIT, "--data.test_path", "C.txt", "--ckpt_path", LAST, *QUIET])
    assert _bpc(run, 0) == _bpc(run, 1)
    config = yaml.safe_load((run / f"{RUN}/version_0/test_0/config.yaml").read_text(encoding="utf-8"))
    data = config["data"]
    assert data["class_path"] == "seqnorm.data.TextCorpus"
    # the run's set-up, recorded in the evaluation's config.yaml; its training files were not needed
    assert {key: data["init_args"][key] for key in ("level", "unit", "window_length", "batch_size", "test_path")} == {
        "level": "char",
        "unit": "stream",
        "window_length": 33,
        "batch_size": 4,
        "test_path": "C.txt",
    }
    assert data["init_args"]["train_path"] is None and data["init_args"]["val_path"] is None


@pytest.mark.usefixtures("one_route")  # the kernels' route trials round differently; they are not what is compared
def test_a_contradicting_config_names_the_runs_own_config_which_works(run: Path) -> None:
    """``--config configs/char_lm.yaml`` (hidden_size 512) against the checkpoint (16): the error names the run's
    own config.yaml, and passing it (before --ckpt_path) tests as the checkpoint alone does."""
    given = ["--config", str(ROOT / "configs" / "char_lm.yaml"), "--ckpt_path", LAST, "--data.test_path", "C.txt"]
    refused = _seqnorm(run, "test", *given, *QUIET)
    assert refused.returncode == 2
    assert "Traceback" not in refused.stderr
    message = refused.stderr.strip().splitlines()[-1]
    assert message.startswith(f"seqnorm test: error: --model.hidden_size 512 contradicts the checkpoint {LAST}")
    own = str(Path(f"{RUN}/version_0/config.yaml"))
    assert f"pass the run's own config (--config {own}, before --ckpt_path)" in message
    root = ["--trainer.default_root_dir", "."]  # the run's config.yaml names the fit's folder (a tmp folder)
    main(["test", "--config", own, *root, "--ckpt_path", LAST, "--data.test_path", "C.txt", *QUIET])
    main(["test", "--ckpt_path", LAST, "--data.test_path", "C.txt", *QUIET])
    assert _bpc(run, 0) == _bpc(run, 1)


def test_a_config_after_ckpt_path_that_resets_it_is_refused(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The run's config.yaml records ``ckpt_path: null``: given after --ckpt_path it tested an untrained model."""
    with pytest.raises(SystemExit) as exit_info:
        main(["test", "--ckpt_path", LAST, "--config", f"{RUN}/version_0/config.yaml", *QUIET])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"seqnorm test: error: --ckpt_path {LAST}: reset to null by a --config file given after it (a run's "
        "config.yaml records ckpt_path: null): put --ckpt_path after --config"
    )


@pytest.mark.usefixtures("one_route")  # the kernels' route trials round differently; they are not what is compared
def test_validate_and_predict_take_the_runs_data_from_the_checkpoint(run: Path) -> None:
    main(["validate", "--ckpt_path", LAST, *QUIET])  # the run's own validation file, B.txt
    # FIT's config turns HiddenStateStats on, which observes a validation batch: bitwise the same number all the
    # same (an Intel Xeon gave 4.4774017333984375 against 4.477402210235596 when the batch was observed in place)
    main(["validate", *FIT, "--ckpt_path", LAST, *QUIET])
    validated = [logged_scalars(run / f"{RUN}/version_0/validate_{n}")["val/bpc"][-1][1] for n in (0, 1)]
    assert validated[0] == validated[1]
    main(["predict", "--ckpt_path", LAST, "--data.test_path", "C.txt", *QUIET])
    rows = (run / f"{RUN}/version_0/predict_0/predictions.jsonl").read_text().splitlines()
    windows = TextCorpus(train_path="A.txt", test_path="C.txt", batch_size=4, window_length=33).datasets["test"]
    assert len(rows) == len(windows) * 4  # one row per window and stream


def test_a_data_class_that_contradicts_the_checkpoint_is_named(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["test", "--data", "LabeledText", "--data.test_path", "C.txt", "--ckpt_path", LAST, *QUIET])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"seqnorm test: error: --data LabeledText contradicts the checkpoint {LAST}, whose run read its data with "
        "TextCorpus: pass --data TextCorpus (or leave --data out: the checkpoint supplies it)"
    )


# ---- item 3: what is carved from the training file, and that it is said ---------------------------------------------


def test_nothing_is_carved_from_the_training_file_when_a_validation_file_is_named(
    trained: tuple[Path, str], caplog: pytest.LogCaptureFixture
) -> None:
    folder, printed = trained
    assert "carved" not in printed  # the user's fit: A.txt trained on whole
    sizes = {"batch_size": 4, "window_length": 33}
    named = TextCorpus(train_path=str(folder / "A.txt"), val_path=str(folder / "B.txt"), **sizes)
    with caplog.at_level(logging.INFO):
        batches = len(named.train_dataloader())
    # every split with a file of its own: the whole of A.txt is trained on, under the old default as the new
    files = {split: str(folder / f"{name}.txt") for split, name in (("train", "A"), ("val", "B"), ("test", "C"))}
    whole = TextCorpus(train_path=files["train"], val_path=files["val"], test_path=files["test"], **sizes)
    assert batches == len(whole.train_dataloader())
    assert "carved" not in caplog.text
    asked = TextCorpus(train_path=str(folder / "A.txt"), val_path=str(folder / "B.txt"), test_fraction=0.1, **sizes)
    assert len(asked.train_dataloader()) < batches  # a test share only when asked for


def test_what_is_carved_is_printed_once_with_the_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _write_texts(tmp_path)
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO):
        main(["fit", "--model", "LanguageModel", "--data", "TextCorpus", "--data.path", "A.txt", *SIZES, *SHORT])
    total = len((tmp_path / "A.txt").read_text(encoding="utf-8"))
    carved = round(total * 0.1)
    lines = [record.getMessage() for record in caplog.records if "carved" in record.getMessage()]
    assert lines == [
        f"TextCorpus: carved from the end of --data.path A.txt ({total} characters): {carved} for val "
        f"(--data.val_fraction 0.1) and {carved} for test (--data.test_fraction 0.1); {total - 2 * carved} "
        "characters left for training"
    ]


def test_a_held_out_validation_share_of_labelled_text_is_printed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "train.tsv"
    path.write_text("".join(f"{'pets' if i % 3 else 'other'}\tthe cat sat {i}\n" for i in range(50)), "utf-8")
    with caplog.at_level(logging.INFO):
        data = LabeledText(train_path=str(path), val_fraction=0.2, batch_size=4)
        sizes = len(data.datasets["train"]), len(data.datasets["val"])
    assert sizes == (40, 10)
    assert (
        f"LabeledText: held out 10 of the 50 examples of --data.train_path {path} for validation (--data.val_fraction "
        "0.2, drawn with --data.seed 0); 40 left for training"
    ) in caplog.text


# ---- the data set-up is read as safely as the model -----------------------------------------------------------------


@pytest.mark.parametrize("where", ["_class_path", "nested"])
def test_a_foreign_data_class_in_a_checkpoint_is_refused_without_importing_it(
    run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    marker = run / "imported"
    (run / "foreign_data_module.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\nclass Data:\n    def __init__(self): ...\n", "utf-8"
    )
    monkeypatch.syspath_prepend(str(run))
    monkeypatch.delitem(sys.modules, "foreign_data_module", raising=False)
    checkpoint = torch.load(LAST, weights_only=True)
    foreign = "foreign_data_module.Data"
    data = checkpoint["datamodule_hyper_parameters"]
    if where == "_class_path":
        data["_class_path"] = foreign
    else:  # where jsonargparse would build it while making the DataModule
        data["encoding"] = {"class_path": foreign}
    torch.save(checkpoint, "foreign.ckpt")
    with pytest.raises(SystemExit) as exit_info:
        main(["test", "--ckpt_path", "foreign.ckpt", "--data.test_path", "C.txt", *QUIET])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--ckpt_path foreign.ckpt: refused: " in error and "datamodule_hyper_parameters" in error
    with pytest.raises(CheckpointError, match=re.escape("TextCorpus.load_from_checkpoint foreign.ckpt: refused: ")):
        TextCorpus.load_from_checkpoint("foreign.ckpt")
    assert not marker.exists() and "foreign_data_module" not in sys.modules


def test_a_data_module_loads_from_a_checkpoint_as_the_run_made_it(run: Path) -> None:
    saved = torch.load(LAST, weights_only=True)["seqnorm_data"]
    for cls in (SequenceDataModule, TextCorpus):  # the class from the checkpoint, among seqnorm's
        data = cls.load_from_checkpoint(LAST, test_path="C.txt")
        assert type(data) is TextCorpus and data.paths == {"train": "A.txt", "val": "B.txt", "test": "C.txt"}
        assert (data.batch_size, data.window_length, data.unit, data.level) == (4, 33, "stream", "char")
        assert data.vocab.to_dict() == saved["vocab"]
    with pytest.raises(CheckpointError, match="which is not one of LabeledText"):
        LabeledText.load_from_checkpoint(LAST)


# ---- a checkpoint's data settings are untrusted input ---------------------------------------------------------------


def _crafted(name: str, **data: object) -> str:
    """The run's checkpoint with its saved data arguments changed as an attacker would: written as ``name``."""
    checkpoint = torch.load(LAST, weights_only=True)
    checkpoint["datamodule_hyper_parameters"].update(data)
    torch.save(checkpoint, name)
    return name


def test_a_checkpoint_chooses_no_cache_to_delete_in_and_no_checksum(
    run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It deleted ``<cache_dir>/tiny_shakespeare/input.txt`` (checksum mismatch, then a download attempt) and wrote
    ``sha256.json`` and a temporary file there: the cache and the checksum are the user's, never the file's."""
    import pooch
    import requests

    victim = run / "victim"
    (victim / "tiny_shakespeare").mkdir(parents=True)
    (victim / "tiny_shakespeare" / "input.txt").write_text("someone's own file\n", encoding="utf-8")
    monkeypatch.setenv("SEQNORM_CACHE", str(run / "cache"))  # this machine's cache, as the user set it
    fetched_into = []

    def offline(url: str, known_hash: str, fname: str, path: str) -> str:
        fetched_into.append((path, known_hash))
        raise requests.ConnectionError("offline")

    monkeypatch.setattr(pooch, "retrieve", offline)
    crafted = _crafted(
        "crafted.ckpt",
        dataset="tiny_shakespeare",
        cache_dir=str(victim),
        dataset_hash="sha256:" + "0" * 64,
        path=None,
        train_path=None,
        val_path=None,
        test_path=None,
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["test", "--ckpt_path", crafted, *QUIET])
    assert exit_info.value.code == 2
    assert "could not download" in capsys.readouterr().err.strip().splitlines()[-1]
    # nothing in the folder the checkpoint named was deleted, replaced or added
    assert sorted(p.relative_to(victim) for p in victim.rglob("*")) == [
        Path("tiny_shakespeare"),
        Path("tiny_shakespeare/input.txt"),
    ]
    assert (victim / "tiny_shakespeare" / "input.txt").read_text(encoding="utf-8") == "someone's own file\n"
    # the download went to this machine's cache, checked against the registry's checksum
    (where, known_hash), *_ = fetched_into
    assert Path(where) == run / "cache" / "tiny_shakespeare" and known_hash != "sha256:" + "0" * 64


def test_a_checkpoint_sets_no_worker_count_cache_or_checksum(run: Path) -> None:
    crafted = _crafted("crafted.ckpt", num_workers=3, cache_dir="elsewhere", dataset_hash="md5:" + "0" * 32)
    main(["validate", "--ckpt_path", crafted, *QUIET])
    config = yaml.safe_load((run / f"{RUN}/version_1/config.yaml").read_text(encoding="utf-8"))["data"]["init_args"]
    assert (config["num_workers"], config["cache_dir"], config["dataset_hash"]) == (0, None, None)
    data = TextCorpus.load_from_checkpoint(crafted)
    assert (data.num_workers, data.cache_dir, data.dataset_hash) == (0, None, None)
    # the user's own settings still apply
    assert TextCorpus.load_from_checkpoint(crafted, num_workers=1).num_workers == 1


def _not_a_file(run: Path, kind: str) -> str:
    if kind == "folder":
        (run / "folder").mkdir()
        return "folder"
    if kind == "fifo":
        os.mkfifo(run / "fifo")  # opened, it would wait for a writer forever
        return "fifo"
    return os.devnull  # a device: /dev/zero would fill the memory


@pytest.mark.parametrize("kind", ["folder", "device"])
def test_a_checkpoints_data_path_that_is_no_regular_file_is_refused(
    run: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    crafted = _crafted("crafted.ckpt", test_path=_not_a_file(run, kind))
    with pytest.raises(SystemExit) as exit_info:
        main(["test", "--ckpt_path", crafted, *QUIET])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"seqnorm test: error: --ckpt_path {crafted}: expected its --data.test_path to be a regular file, got "
        f"{os.devnull if kind == 'device' else kind} (a device, FIFO or folder): refused; "
        "pass --data.test_path with a file of yours"
    )


@pytest.mark.parametrize("kind", ["folder", "device", "fifo"])
def test_load_from_checkpoint_refuses_a_data_path_that_is_no_regular_file(run: Path, kind: str) -> None:
    crafted = _crafted("crafted.ckpt", test_path=_not_a_file(run, kind))
    with pytest.raises(DataError, match=r"expected its --data\.test_path to be a regular file"):
        TextCorpus.load_from_checkpoint(crafted)
    assert TextCorpus.load_from_checkpoint(crafted, test_path="C.txt").paths["test"] == "C.txt"  # the user's own


def test_the_files_a_checkpoint_names_are_said_once(run: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``test_path="../x"`` or any readable file was read with no word that the path came from the checkpoint."""
    with caplog.at_level(logging.INFO):
        main(["validate", "--ckpt_path", LAST, *QUIET])
    said = [record.getMessage() for record in caplog.records if "data from the checkpoint" in record.getMessage()]
    assert said == [
        f"training data from the checkpoint: A.txt (--data.train_path; --ckpt_path {LAST})",
        f"validation data from the checkpoint: B.txt (--data.val_path; --ckpt_path {LAST})",
    ]
