"""Runs named after what they train: ``lightning_logs/<cell>-<norm>-h<hidden>/version_N``, as TensorBoard lists them
(before, every run was ``version_N`` and an LN run could not be told from a BN one in the run list)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

from seqnorm.cli import main
from seqnorm.cli.runs import checkpoint_run_dir, run_name
from seqnorm.cli.threads import THREADS_ENV
from seqnorm.data import LabeledText, TextCorpus
from seqnorm.data.base import short_name
from seqnorm.lightning import LanguageModel, SequenceClassifier
from seqnorm.norms import BatchNormSpec
from tests.conftest import QUIET, cli_usage_error

ROOT = Path(__file__).resolve().parents[2]
# The embedded classification task (no file), tiny: two steps and one validation batch
CLASSIFIER = ["--model", "SequenceClassifier", "--data", "LabeledText", "--data.batch_size", "8"]
TINY = [*CLASSIFIER, "--model.hidden_size", "8", "--model.embedding_dim", "4", *QUIET]
TINY += ["--trainer.max_steps", "2", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"]


LN, BN = "classifier-embedded-lstm-layer-h8", "classifier-embedded-lstm-batch-h8"  # TINY's runs, by norm


def _runs(root: Path) -> list[str]:
    return sorted(str(run.relative_to(root / "lightning_logs")) for run in root.glob("lightning_logs/**/version_*"))


def test_runs_of_ln_and_bn_read_apart_in_tensorboards_run_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    main(["fit", *TINY, "--model.norm", "layer"])
    # the BN run as a user starts it: the seqnorm command, in a fresh process
    env = {key: value for key, value in os.environ.items() if key not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update({THREADS_ENV: "1", "PYTHONPATH": str(ROOT)})
    command = [sys.executable, "-m", "seqnorm.cli", "fit", *TINY, "--model.norm", "batch"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    runs = EventMultiplexer().AddRunsFromDirectory(str(tmp_path / "lightning_logs")).Runs()
    assert sorted(runs) == [f"{BN}/version_0", f"{LN}/version_0"]  # `tensorboard --logdir` names

    # A resumed fit continues its own run; an evaluation of a checkpoint writes beside its training run, inside it.
    batch_norm = Path(f"lightning_logs/{BN}/version_0/checkpoints/last.ckpt")
    main(["fit", *TINY, "--model.norm", "batch", "--trainer.max_steps", "3", "--ckpt_path", str(batch_norm)])
    assert torch.load(batch_norm, weights_only=True)["global_step"] == 3
    layer_norm = Path(f"lightning_logs/{LN}/version_0/checkpoints/last.ckpt")
    for command in ("validate", "test", "validate"):
        main([command, *CLASSIFIER, *QUIET, "--trainer.limit_val_batches", "1", "--ckpt_path", str(layer_norm)])
    assert _runs(tmp_path) == [f"{BN}/version_0", f"{LN}/version_0"]
    evaluations = sorted(path.name for path in layer_norm.parents[1].iterdir() if path.is_dir())
    assert evaluations == ["checkpoints", "test_0", "validate_0", "validate_1"]
    assert Path(f"lightning_logs/{LN}/version_0/validate_1/config.yaml").is_file()
    runs = EventMultiplexer().AddRunsFromDirectory(str(tmp_path / "lightning_logs")).Runs()
    assert f"{LN}/version_0/test_0" in runs  # listed under the run it evaluates
    assert checkpoint_run_dir(str(layer_norm)) == Path(f"lightning_logs/{LN}/version_0")
    assert checkpoint_run_dir(f"file://{tmp_path / layer_norm}") == tmp_path / f"lightning_logs/{LN}/version_0"


def test_a_char_lm_a_word_lm_and_a_classifier_on_one_file_read_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All three became ``lstm-layer-h8/version_0..2``: the task and the data are in the name now."""
    monkeypatch.chdir(tmp_path)
    Path("data").mkdir()
    Path("data/ptb.char.valid.txt").write_text("a b c d _ e f g\n" * 40, encoding="utf-8")
    Path("data/questions 2024.tsv").write_text("".join(f"{k % 2}\tq{k} is\n" for k in range(40)), encoding="utf-8")
    small = ["--model.hidden_size", "8", "--model.embedding_dim", "4", "--data.batch_size", "4", *QUIET]
    small += ["--trainer.max_steps", "1", "--trainer.limit_val_batches", "1"]
    lm = ["--model", "LanguageModel", "--data", "TextCorpus", "--data.path", "data/ptb.char.valid.txt", *small]
    main(["fit", *lm, "--data.text_format", "ptb_char"])
    main(["fit", *lm, "--data.level", "word", "--data.text_format", "plain"])
    classifier = ["--model", "SequenceClassifier", "--data", "LabeledText", *small]
    main(["fit", *classifier, "--data.train_path", "data/questions 2024.tsv"])
    assert _runs(tmp_path) == [
        "charlm-ptb.char.valid-lstm-layer-h8/version_0",
        "classifier-questions_2024-lstm-layer-h8/version_0",
        "wordlm-ptb.char.valid-lstm-layer-h8/version_0",
    ]


def test_a_run_of_the_unnamed_layout_resumes_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run written before runs were named (``lightning_logs/version_0``) continues there, not in a new folder."""
    monkeypatch.chdir(tmp_path)
    main(["fit", *TINY])
    shutil.move(f"lightning_logs/{LN}/version_0", "lightning_logs/version_0")
    Path(f"lightning_logs/{LN}").rmdir()
    last = Path("lightning_logs/version_0/checkpoints/last.ckpt")
    main(["fit", *TINY, "--trainer.max_steps", "3", "--ckpt_path", str(last)])
    assert torch.load(last, weights_only=True)["global_step"] == 3
    assert _runs(tmp_path) == ["version_0"]


def test_a_resumed_run_is_not_warned_of_its_own_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ModelCheckpoint warns of a non-empty checkpoint folder: a resumed fit's is its own. The filter lasts the run."""
    monkeypatch.chdir(tmp_path)
    main(["fit", *TINY])
    last = Path(f"lightning_logs/{LN}/version_0/checkpoints/last.ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(["fit", *TINY, "--trainer.max_steps", "3", "--ckpt_path", str(last)])
        left = [entry for entry in warnings.filters if entry[1] is not None and "not empty" in entry[1].pattern]
    assert torch.load(last, weights_only=True)["global_step"] == 3
    assert not [str(w.message) for w in caught if "exists and is not empty" in str(w.message)]
    assert not left


def test_the_name_says_task_data_cell_norm_size_depth_and_direction() -> None:
    assert run_name(LanguageModel(20)) == "charlm-lstm-layer-h256"
    words = TextCorpus(train_path="corpora/wiki:103 (train).TXT", level="word")
    assert run_name(LanguageModel(20, level="word"), words) == "wordlm-wiki_103_train-lstm-layer-h256"
    classifier = SequenceClassifier(20, 3, cell="gru", norm=BatchNormSpec(momentum=0.2), hidden_size=64)
    assert run_name(classifier, LabeledText()) == "classifier-embedded-gru-batch-h64"
    labelled = LabeledText(predict_path="texts/new.txt")  # was "embedded": the texts to label were not looked at
    assert run_name(classifier, labelled) == "classifier-new-gru-batch-h64"
    stacked = SequenceClassifier(20, 3, norm="rms", hidden_size=32, num_layers=2, bidirectional=True)
    evaluated = LabeledText(test_path="/x/" + "q" * 60 + ".tsv")  # a long name: cut short
    assert run_name(stacked, evaluated) == f"classifier-{'q' * 32}-lstm-rms-h32-2layers-bi"
    assert run_name(torch.nn.Linear(2, 2)) is None  # no seqnorm layer: Lightning's own lightning_logs/version_N
    assert short_name("..//") == "data" and short_name("a b\\c.tsv") == "a_b_c"


def _contents(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(path.relative_to(folder)): (path.stat().st_size, path.stat().st_mtime_ns) for path in folder.rglob("*")}


# The user's own loggers, which Lightning numbers (lightning_logs/version_N), a TensorBoard and a CSV log side by side
USER_LOGGERS = ["--trainer.logger+=TensorBoardLogger", "--trainer.logger.save_dir", "."]
USER_LOGGERS += ["--trainer.logger+=CSVLogger", "--trainer.logger.save_dir", "."]


@pytest.mark.parametrize("loggers", [[], USER_LOGGERS], ids=["default-logger", "users-loggers"])
def test_two_runs_started_together_in_one_folder_take_two_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loggers: list[str]
) -> None:
    """Both chose ``version_0``: the second wrote an event file into the first run's folder, then died with a raw
    ``RuntimeError: SaveConfigCallback expected .../config.yaml to NOT exist``. Here the second run listed the folder
    before the first made its ``version_0`` (a stale listing, as two processes starting together have): it must
    still take a folder of its own, writing nothing into the first's. The user's own loggers too, which Lightning
    numbered only when they first wrote."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from seqnorm.cli import runs

    monkeypatch.chdir(tmp_path)
    main(["fit", *TINY, *loggers])
    (first,) = tmp_path.glob("lightning_logs/**/version_0")
    before = _contents(first)
    for logger in (TensorBoardLogger, CSVLogger):  # Lightning's own numbering, stale
        monkeypatch.setattr(logger, "_get_next_version", lambda self: 0)
    monkeypatch.setattr(runs, "_next_version", lambda parent, prefix="version": 0)  # and seqnorm's
    main(["fit", *TINY, *loggers])
    assert _contents(first) == before
    second = first.with_name("version_1")
    assert (second / "config.yaml").is_file() and (second / "checkpoints" / "last.ckpt").is_file()
    assert len(list(second.glob("events.out.tfevents.*"))) == 1
    assert (second / "metrics.csv").is_file() == bool(loggers)  # the CSV log beside the TensorBoard one


@pytest.mark.parametrize("given", ["version-flag", "slurm-job-id"])
def test_a_run_given_another_runs_folder_stops_in_one_line_before_writing_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], given: str
) -> None:
    """A folder given, not claimed (``--trainer.logger.version``; a SLURM job's id, every run's version in that job):
    the run wrote an event file into the other run's folder, then died with SaveConfigCallback's RuntimeError."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    monkeypatch.chdir(tmp_path)
    if given == "version-flag":
        flags = ["--trainer.logger", "TensorBoardLogger", "--trainer.logger.save_dir", ".", "--trainer.logger.version"]
        flags.append("0")
        other, shown = Path("lightning_logs/version_0"), os.path.join(".", "lightning_logs", "version_0")
        remedy = "leave --trainer.logger.version unset (each run then takes the next free version_N) or pass one free"
    else:
        monkeypatch.setattr(SLURMEnvironment, "job_id", staticmethod(lambda: "4242"))
        flags, other = [], Path.cwd() / f"lightning_logs/{LN}/4242"
        shown = str(other)
        remedy = "in a SLURM job every run's version is the job's id: give each run its own --trainer.default_root_dir"
    (other / "checkpoints").mkdir(parents=True)
    (other / "config.yaml").write_text("the other run's\n", encoding="utf-8")
    (other / "checkpoints" / "last.ckpt").write_bytes(b"the other run's")
    before = _contents(other)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *TINY, *flags])
    assert exit_info.value.code == 2
    assert _contents(other) == before  # no event file of this run's there
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"seqnorm fit: error: {shown} already holds a run (config.yaml), which this one would write into: {remedy}"
    )


def test_a_claimed_run_folder_is_released_only_while_empty(tmp_path: Path) -> None:
    from seqnorm.cli.runs import release_unused_runs, run_logger

    unused, used = (Path(run_logger(str(tmp_path), "lstm-layer-h8").log_dir) for _ in range(2))
    assert (unused.name, used.name) == ("version_0", "version_1") and unused.is_dir()  # claimed at once
    (used / "config.yaml").write_text("written\n", encoding="utf-8")
    release_unused_runs()  # a command that failed before its first write leaves no empty version_N
    assert not unused.exists() and (used / "config.yaml").is_file()


@pytest.mark.parametrize("command", ["fit", "test"])
def test_a_run_that_fails_before_its_first_step_leaves_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """Per-timestep BN at batch size 1 is refused at set-up, after the run's config.yaml, hparams.yaml and event file
    were written: that ``version_N`` stayed, the next one a user opened. One that failed after a step keeps its
    folder (its curves say how far it got), and so does a resumed run's."""
    monkeypatch.chdir(tmp_path)
    main(["fit", *TINY, "--model.norm", "batch"])  # a run to evaluate; its folder is one that must stay
    last = Path(f"lightning_logs/{BN}/version_0/checkpoints/last.ckpt")
    Path("unlabeled.tsv").write_text("a line without its label\n", encoding="utf-8")
    before = sorted(str(path) for path in tmp_path.rglob("*"))
    if command == "fit":  # refused in the model's set-up, after its config.yaml, hparams.yaml and event file
        args = ["fit", *TINY, "--data.batch_size", "1", "--model.norm", "batch", "--model.hidden_size", "12"]
    else:  # refused as the test file is read, after the evaluation's config.yaml
        args = ["test", "--ckpt_path", str(last), *QUIET, "--data.test_path", "unlabeled.tsv"]
    cli_usage_error(capsys, args)
    assert sorted(str(path) for path in tmp_path.rglob("*")) == before

    def fail_at_step_two(self: object, outputs: object, batch: object, batch_idx: int) -> None:
        if batch_idx == 1:
            raise ValueError("failed at step 2")

    monkeypatch.setattr(SequenceClassifier, "on_train_batch_end", fail_at_step_two, raising=False)
    assert "failed at step 2" in cli_usage_error(capsys, ["fit", *TINY, "--model.hidden_size", "12"])
    assert (tmp_path / "lightning_logs/classifier-embedded-lstm-layer-h12/version_0/config.yaml").is_file()
