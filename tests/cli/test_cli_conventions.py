"""The `seqnorm` command keeps Lightning's and torch's conventions: threads, Trainer switches, logging, output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from seqnorm.cli import SeqnormCLI, main
from seqnorm.cli.output import in_command_line_words
from seqnorm.cli.threads import DEFAULT_THREADS, THREADS_ENV, choose_threads
from seqnorm.data import TextCorpus
from seqnorm.lightning import LanguageModel, SequenceClassifier
from seqnorm.lightning.progress import SeqnormProgressBar
from tests.conftest import QUIET, SMALL_LM, cli_usage_error, run_path

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["--trainer.max_steps", "4", "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "2"]


# ---- threads -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "environ", "expected"),
    [
        (None, {}, (DEFAULT_THREADS, "the default")),
        (None, {"OMP_NUM_THREADS": "3"}, (None, "OMP_NUM_THREADS=3")),  # torch already follows it
        (None, {"MKL_NUM_THREADS": "3"}, (None, "MKL_NUM_THREADS=3")),
        (None, {THREADS_ENV: "2", "OMP_NUM_THREADS": "3"}, (2, f"{THREADS_ENV}=2")),
        (None, {THREADS_ENV: "0"}, (None, f"{THREADS_ENV}=0")),  # 0: torch's own setting
        (4, {THREADS_ENV: "2", "OMP_NUM_THREADS": "3"}, (4, "--threads 4")),
        (0, {}, (None, "--threads 0")),
    ],
)
def test_thread_count_precedence(flag: int | None, environ: dict[str, str], expected: tuple[int | None, str]) -> None:
    threads, reason = choose_threads(flag, environ)
    assert threads == expected[0] and reason.startswith(expected[1])


def test_the_thread_message_offers_only_what_the_command_takes() -> None:
    # seqnorm generate has no --threads flag: its message names only the variable
    assert "--threads N or" in choose_threads(None, {})[1]
    reason = choose_threads(None, {}, has_flag=False)[1]
    assert f"; {THREADS_ENV}=N to change" in reason and "--threads" not in reason


def test_a_bad_thread_variable_is_one_message(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.setenv(THREADS_ENV, "two")
    error = cli_usage_error(capsys, ["fit", *SMALL_LM, *QUIET, *SHORT])
    assert f"{THREADS_ENV}=two: expected a whole number of torch threads" in error


def test_threads_flag_sets_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    before = torch.get_num_threads()
    try:
        SeqnormCLI(args=[*SMALL_LM, "--threads", "2", "--trainer.logger", "false"], run=False)
        assert torch.get_num_threads() == 2
        monkeypatch.setenv(THREADS_ENV, "0")  # leave torch's setting (the default would set 1)
        SeqnormCLI(args=[*SMALL_LM, "--trainer.logger", "false"], run=False)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# ---- a plain run: clean output, the progress bar, the thread line, logger false ------------------------------------

# What Lightning prints on every run by design (device summary, the stop reason), seqnorm's thread line, and what
# was carved from the training text for validation and test (said once).
EXPECTED_STDERR = (
    r"Seed set to 0",
    r"seqnorm: 1 torch CPU thread: SEQNORM_THREADS=1",
    r"TextCorpus: carved from the end of the embedded synthetic task \(5000 lines\): 500 for val "
    r"\(--data.val_fraction 0.1\) and 500 for test \(--data.test_fraction 0.1\); 4000 lines left for training",
    r"GPU available: .*",
    r"TPU available: .*",
    r"`Trainer\(limit_val_batches=1\)` was configured so 1 batch will be used\.",
    r"`Trainer.fit` stopped: `max_steps=6` reached\.",
)


def test_a_plain_run_prints_nothing_avoidable(tmp_path: Path) -> None:
    # A fresh process: what a user sees (no pytest warning filters, Lightning's own log handler).
    command = [sys.executable, "-m", "seqnorm.cli", "fit", *SMALL_LM, "--trainer.max_steps", "6"]
    command += ["--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "1", "--trainer.logger", "false"]
    env = {key: value for key, value in os.environ.items() if key not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update({THREADS_ENV: "1", "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "default"})
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    unexpected = [line for line in lines if not any(re.fullmatch(pattern, line) for pattern in EXPECTED_STDERR)]
    assert unexpected == [], result.stderr
    assert len(lines) == len(EXPECTED_STDERR), result.stderr  # the thread line once
    # The progress bar of a run bounded by steps names no last epoch (Lightning's bar shows "Epoch 0/-2").
    assert "Epoch 0 " in result.stdout and "/-2" not in result.stdout
    # logger false: the run still gets its own folder, not ./config.yaml and ./checkpoints
    assert sorted(path.name for path in tmp_path.iterdir()) == ["lightning_logs"]
    assert (run_path(0, tmp_path) / "checkpoints" / "last.ckpt").is_file()


def test_progress_bar_names_the_last_epoch_only_when_there_is_one() -> None:
    bar = SeqnormProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=-1)  # what Trainer(max_steps=N) sets
    assert bar._get_train_description(3).rstrip() == "Epoch 3"
    bar._trainer = SimpleNamespace(max_epochs=5)
    assert bar._get_train_description(3).rstrip() == "Epoch 3/4"


# ---- Lightning's switches ------------------------------------------------------------------------------------------


def test_logger_false_twice_gives_each_run_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        main(["fit", *SMALL_LM, *QUIET, *SHORT, "--trainer.logger", "false"])
    for version in (0, 1):
        run = run_path(version, tmp_path)
        assert (run / "config.yaml").is_file() and (run / "checkpoints" / "last.ckpt").is_file()
        assert not list(run.glob("events.out.tfevents*"))  # no logger: no TensorBoard files
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "config.yaml").exists()
    # An explicit default_root_dir keeps Lightning's layout (config.yaml and checkpoints/ in it); a second run there
    # would stop on the first one's config.yaml: one message naming both flags, before training.
    explicit = ["fit", *SMALL_LM, *QUIET, *SHORT, "--trainer.logger", "false", "--trainer.default_root_dir", "mine"]
    main(explicit)
    assert (tmp_path / "mine" / "config.yaml").is_file() and (tmp_path / "mine" / "checkpoints").is_dir()
    error = cli_usage_error(capsys, explicit)
    assert "--trainer.logger false: --trainer.default_root_dir mine already holds a run" in error


def test_enable_checkpointing_false_and_train_loss_per_step_and_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["fit", *SMALL_LM, *QUIET, "--trainer.max_steps", "6", "--trainer.limit_val_batches", "1"]
    args += ["--trainer.val_check_interval", "3", "--trainer.log_every_n_steps", "1"]
    main([*args, "--trainer.enable_checkpointing", "false"])
    run = run_path(0, tmp_path)
    assert not (run / "checkpoints").exists()
    accumulator = EventAccumulator(str(run))
    accumulator.Reload()
    steps = [event.step for event in accumulator.Scalars("train/loss")]
    assert steps == list(range(6))  # every step, under its contract name
    (epoch_mean,) = accumulator.Scalars("train/loss_epoch")  # the run's one (unfinished) epoch
    losses = [event.value for event in accumulator.Scalars("train/loss")]
    assert min(losses) <= epoch_mean.value <= max(losses)
    # A ModelCheckpoint the user adds contradicts the switch: Lightning's sentence, exit 2, no traceback.
    switches = ["--trainer.enable_checkpointing", "false", "--trainer.callbacks+=ModelCheckpoint"]
    error = cli_usage_error(capsys, [*args, *switches])
    assert "enable_checkpointing=False" in error and "ModelCheckpoint" in error


# ---- the BN small-batch error names the flag ------------------------------------------------------------------------


def test_small_batch_error_names_the_flag_that_works(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    bn_at_batch_one = ["fit", *SMALL_LM, *QUIET, *SHORT, "--model.norm", "batch", "--data.batch_size", "1"]
    error = cli_usage_error(capsys, bn_at_batch_one)
    assert "--model.small_batch running" in error and "--model.norm layer" in error
    assert 'small_batch="running"' not in error
    main([*bn_at_batch_one, "--model.small_batch", "running"])  # the flag the message names does work
    # the refused run left no folder behind (it failed before its first step): this one is version_0
    assert (run_path(0, tmp_path) / "checkpoints" / "last.ckpt").is_file()


def test_only_suggested_model_arguments_become_flags() -> None:
    message = 'use norm="layer", or pass small_batch="running"; got momentum="x" and norm=\'weight\''
    assert in_command_line_words(message, [LanguageModel]) == (
        "use --model.norm layer, or pass --model.small_batch running; got momentum=\"x\" and norm='weight'"
    )
    spec = 'or pass norm=BatchRenormSpec(small_batch="running") to normalize'  # a spec's option the model takes
    assert in_command_line_words(spec, [LanguageModel]) == "or pass --model.small_batch running to normalize"


# ---- norm_max_steps, formerly max_steps ----------------------------------------------------------------------------


def _rows(model: LanguageModel | SequenceClassifier) -> int:
    return model.model.rnn.cells[0].norm_hh.running_mean.shape[0]


@pytest.mark.parametrize("cls", [LanguageModel, SequenceClassifier])
def test_norm_max_steps_sets_the_rows_and_the_old_name_is_gone(cls: type) -> None:
    sizes = (10,) if cls is LanguageModel else (10, 2)
    assert _rows(cls(*sizes, norm="batch", norm_max_steps=7)) == 7
    with pytest.raises(TypeError, match="max_steps"):
        cls(*sizes, norm="batch", max_steps=7)


def test_the_old_model_flag_is_refused_naming_the_new_one(capsys: pytest.CaptureFixture[str]) -> None:
    error = cli_usage_error(capsys, ["fit", *SMALL_LM, "--model.norm", "batch", "--model.max_steps", "7", *QUIET])
    assert "--model.max_steps: model argument 'max_steps' was renamed 'norm_max_steps'" in error
    assert "write --model.norm_max_steps" in error


def test_checkpoints_that_saved_max_steps_load_as_norm_max_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    corpus = TextCorpus()
    model = LanguageModel(corpus.vocab_size, corpus.pad_index, norm="batch", hidden_size=16, embedding_dim=8)
    old = {("max_steps" if k == "norm_max_steps" else k): v for k, v in model.hparams.items()} | {"max_steps": 7}
    model = LanguageModel(**{**model.hparams, "norm_max_steps": 7})
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": old, "pytorch-lightning_version": "2.4.0"}, path)
    loaded = LanguageModel.load_from_checkpoint(path)
    assert _rows(loaded) == 7 and loaded.hparams.norm_max_steps == 7 and "max_steps" not in loaded.hparams
    # through the CLI, which fills in the model flags from the checkpoint: evaluation runs on the old checkpoint
    flags = ["--model.norm", "batch", "--trainer.limit_test_batches", "1", "--ckpt_path", str(path)]
    main(["test", *SMALL_LM, *QUIET, *flags])
    config = (run_path(0, tmp_path) / "config.yaml").read_text()
    assert re.search(r"^\s+norm_max_steps: 7$", config, re.MULTILINE), config


def test_shipped_bn_overlays_use_the_new_name() -> None:
    for overlay in (ROOT / "configs" / "norm").glob("batch*.yaml"):
        text = overlay.read_text()
        assert "norm_max_steps:" in text and not re.search(r"^\s+max_steps:", text, re.MULTILINE), overlay


def test_train_loss_is_the_mean_since_the_last_written_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Written every 3 steps, ``train/loss`` is the mean of those 3 steps' losses (equal batches: equal weights),
    not the last batch's alone; written every step, it is each step's loss."""
    monkeypatch.chdir(tmp_path)
    classifier = ["--model", "SequenceClassifier", "--data", "LabeledText", "--data.batch_size", "8"]
    classifier += ["--model.hidden_size", "16", "--model.embedding_dim", "8", "--trainer.limit_val_batches", "0"]

    def losses(every: int) -> list[tuple[int, float]]:
        root = tmp_path / f"every{every}"
        main(["fit", *classifier, *QUIET, "--trainer.max_steps", "6", "--trainer.log_every_n_steps", str(every),
              "--trainer.default_root_dir", str(root)])  # fmt: skip
        accumulator = EventAccumulator(str(run_path(0, root)))
        accumulator.Reload()
        return [(event.step, event.value) for event in accumulator.Scalars("train/loss")]

    per_step = losses(1)
    assert [step for step, _ in per_step] == list(range(6))
    means = losses(3)
    assert [step for step, _ in means] == [2, 5]
    for (_, value), first in zip(means, (0, 3), strict=True):
        expected = sum(loss for _, loss in per_step[first : first + 3]) / 3
        assert value == pytest.approx(expected, rel=1e-5)


def test_a_run_shorter_than_its_first_validation_keeps_last_without_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(["fit", *SMALL_LM, *QUIET, "--trainer.max_steps", "3"])  # an epoch is longer: no validation
    assert not [str(w.message) for w in caught if "could not find the monitored key" in str(w.message)]
    checkpoints = run_path(0, tmp_path) / "checkpoints"
    assert [path.name for path in checkpoints.iterdir()] == ["last.ckpt"]
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 3


def test_the_private_lightningcli_methods_overridden_are_listed_and_still_lightnings() -> None:
    """An override of a method Lightning renamed or removed would silently never run (the checked checkpoint read):
    the list is exact, and every name on it is still LightningCLI's."""
    from lightning.pytorch.cli import LightningCLI

    from seqnorm.cli.app import PRIVATE_OVERRIDES, SeqnormCLI

    private = {name for name in vars(SeqnormCLI) if name.startswith("_") and not name.startswith("__")}
    assert {name for name in private if hasattr(LightningCLI, name)} == set(PRIVATE_OVERRIDES)
    assert all(callable(getattr(LightningCLI, name, None)) for name in PRIVATE_OVERRIDES)


def test_predict_alone_lists_the_prediction_writer_among_its_default_callbacks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """predict's --trainer.callbacks default is its own (one JSON line per input), fit's and test's are not."""
    listed = {}
    for subcommand in ("fit", "test", "predict"):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            main([subcommand, *SMALL_LM, "--print_config"])
        callbacks = yaml.safe_load(capsys.readouterr().out)["trainer"]["callbacks"]
        listed[subcommand] = [callback["class_path"].rpartition(".")[2] for callback in callbacks]
    assert listed == {
        "fit": ["ResumableCheckpoint"],
        "test": ["ResumableCheckpoint"],
        "predict": ["ResumableCheckpoint", "PredictionWriter"],
    }
