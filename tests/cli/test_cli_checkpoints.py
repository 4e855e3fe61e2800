"""Every subcommand reads a checkpoint of every task: ``validate``, ``test``, ``predict``, a resumed ``fit``, and
``generate`` where it applies. One tiny run per task is trained for the module; each test works on a copy of it.
"""

from __future__ import annotations

import inspect
import json
import random
import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from seqnorm.cli import main
from seqnorm.data import TextCorpus
from seqnorm.lightning import LanguageModel, SequenceClassifier
from tests.conftest import QUIET, WORDS, evaluation_path, last_checkpoint, logged_scalars, run_path, write_story

TINY = ["--model.hidden_size", "16", "--model.embedding_dim", "8", "--model.lr", "0.01", "--data.batch_size", "16"]
# a validation every 3 steps, so a resumed run's validations continue the curve
SCHEDULE = ["--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "2", "--trainer.log_every_n_steps", "1"]
STEPS = 6
TASKS = {
    "LanguageModel": ["--model", "LanguageModel", "--data", "TextCorpus", "--data.path", "story.txt"],
    "SequenceClassifier": ["--model", "SequenceClassifier", "--data", "LabeledText", "--data.train_path", "train.tsv"],
}
TASKS["LanguageModel"] += ["--data.unit", "line"]  # one sequence per line: one prediction per line
TASKS["SequenceClassifier"] += ["--data.test_path", "test.tsv"]
# Both tasks' runs are named after what they train (an LSTM with LayerNorm, hidden_size 16): cli.runs.run_name


def _write_labeled(path: Path, rows: int, seed: int) -> list[str]:
    """``label<TAB>text`` lines whose label says whether a pet is named; returns the labels in file order."""
    rng = random.Random(seed)
    lines, labels = [], []
    for _ in range(rows):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 10))]
        labels.append("pets" if {"cat", "dog"} & set(words) else "other")
        lines.append(f"{labels[-1]}\t{' '.join(words)}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return labels


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per task, a folder with its data and ``lightning_logs/<run name>/version_0`` of a ``STEPS``-step run."""
    folders = {}
    for task, args in TASKS.items():
        folder = tmp_path_factory.mktemp(task)
        write_story(folder / "story.txt", lines=300)
        _write_labeled(folder / "train.tsv", 240, seed=1)
        _write_labeled(folder / "test.tsv", 50, seed=2)
        root = ["--trainer.default_root_dir", str(folder)]
        data = [str(folder / arg) if arg.endswith((".txt", ".tsv")) else arg for arg in args]
        main(["fit", *data, *TINY, *QUIET, *SCHEDULE, *root, "--trainer.max_steps", str(STEPS)])
        folders[task] = folder
    return folders


@pytest.fixture
def run(trained: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):
    """A copy of the task's trained folder as the working directory; yields the task's arguments."""
    task = request.param
    shutil.copytree(trained[task], tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    return task, [*TASKS[task], *TINY, *QUIET]


def _metric(task: str) -> str:
    return "acc" if task == "SequenceClassifier" else "bpc"


@pytest.mark.parametrize("run", list(TASKS), indirect=True)
@pytest.mark.parametrize("command", ["validate", "test"])
def test_evaluation_from_a_checkpoint(run: tuple[str, list[str]], command: str) -> None:
    task, args = run
    main([command, *args, "--ckpt_path", str(last_checkpoint())])
    stage = "val" if command == "validate" else "test"
    # a folder of its own beside the training run, inside it: the evaluation's config.yaml and metrics
    logged = logged_scalars(evaluation_path(command))
    assert {f"{stage}/loss", f"{stage}/{_metric(task)}"} <= set(logged)


@pytest.mark.parametrize("run", list(TASKS), indirect=True)
def test_the_checkpoint_names_the_model_when_no_flag_does(run: tuple[str, list[str]]) -> None:
    task, args = run
    without_model = args[2:]  # drops "--model <task>": the checkpoint's class is used
    assert "--model" not in without_model
    main(["test", *without_model, "--ckpt_path", str(last_checkpoint())])
    assert f"test/{_metric(task)}" in logged_scalars(evaluation_path("test"))
    config = (evaluation_path("test") / "config.yaml").read_text(encoding="utf-8")
    assert f"class_path: seqnorm.lightning.{task}" in config


@pytest.mark.parametrize("run", list(TASKS), indirect=True)
def test_resumed_fit_continues_the_same_run(run: tuple[str, list[str]]) -> None:
    _, args = run
    before = logged_scalars(run_path(0))
    main(["fit", *args, *SCHEDULE, "--trainer.max_steps", str(STEPS + 3), "--ckpt_path", str(last_checkpoint())])
    assert sorted(path.name for path in run_path(0).parent.iterdir()) == ["version_0"]
    assert torch.load(last_checkpoint(), weights_only=True)["global_step"] == STEPS + 3
    # the copied run's top-k files are tracked on from their new place: last.ckpt is rewritten, not a last-v1.ckpt
    assert not list(last_checkpoint().parent.glob("last-v*"))
    after = logged_scalars(run_path(0))
    # one TensorBoard run whose curves go on: the earlier points are kept, the resumed run's follow them
    assert [step for step, _ in before["val/loss"]] == [2, 5]  # steps count from 0: after steps 3 and 6
    assert [step for step, _ in after["val/loss"]] == [2, 5, 8]
    assert after["val/loss"][:2] == before["val/loss"]
    assert max(step for step, _ in after["train/loss"]) == STEPS + 2
    config = (run_path(0) / "config.yaml").read_text(encoding="utf-8")
    assert f"max_steps: {STEPS + 3}" in config  # the resumed run's own config replaced the first one's


@pytest.mark.parametrize("run", ["SequenceClassifier"], indirect=True)
def test_classifier_predictions_are_label_names_that_score_what_test_reports(run: tuple[str, list[str]]) -> None:
    _, args = run
    main(["test", *args, "--ckpt_path", str(last_checkpoint())])
    main(["predict", *args, "--ckpt_path", str(last_checkpoint())])
    tested = logged_scalars(evaluation_path("test"))["test/acc"][-1][1]
    rows = [json.loads(line) for line in (evaluation_path("predict") / "predictions.jsonl").read_text().splitlines()]
    truth = [line.split("\t")[0] for line in Path("test.tsv").read_text().splitlines()]
    assert [row["index"] for row in rows] == list(range(len(truth)))  # one row per input line, in input order
    assert {row["label"] for row in rows} <= {"pets", "other"}
    assert all(0.5 <= row["probability"] <= 1.0 for row in rows)  # the most likely of two classes
    accuracy = sum(row["label"] == label for row, label in zip(rows, truth, strict=True)) / len(truth)
    assert accuracy == pytest.approx(tested, abs=1e-6)


@pytest.mark.parametrize("run", ["SequenceClassifier"], indirect=True)
def test_classifier_labels_unlabelled_text(run: tuple[str, list[str]]) -> None:
    """``--data.predict_path``: the test file's texts without their labels (and a blank line) get the labels and
    probabilities the labelled test file gets."""
    _, args = run
    texts = [line.split("\t", 1)[1] for line in Path("test.tsv").read_text().splitlines()]
    Path("unlabelled.txt").write_text("\n".join([texts[0], "", *texts[1:]]) + "\n", encoding="utf-8")
    main(["predict", *args, "--ckpt_path", str(last_checkpoint())])
    main(["predict", *args, "--data.predict_path", "unlabelled.txt", "--ckpt_path", str(last_checkpoint())])
    labelled, unlabelled = (
        [json.loads(line) for line in (evaluation_path("predict", n) / "predictions.jsonl").read_text().splitlines()]
        for n in (0, 1)
    )
    assert len(unlabelled) == len(texts)
    for got, expected in zip(unlabelled, labelled, strict=True):
        assert got["index"] == expected["index"] and got["label"] == expected["label"]
        assert got["probability"] == pytest.approx(expected["probability"], abs=1e-6)


@pytest.mark.parametrize("run", ["SequenceClassifier"], indirect=True)
def test_a_classifier_checkpoint_tests_and_labels_with_nothing_but_the_file(run: tuple[str, list[str]]) -> None:
    """The checkpoint supplies the data set-up (LabeledText, its vocabulary, labels, batch size): the run's own test
    file when none is named, a named file alone (the training file unread), and texts to label alone."""
    _, args = run
    main(["test", *args, "--ckpt_path", str(last_checkpoint())])  # the full command
    main(["test", "--ckpt_path", str(last_checkpoint()), *QUIET])  # the run's own test file, named by the checkpoint
    main(["test", "--ckpt_path", str(last_checkpoint()), "--data.test_path", "test.tsv", *QUIET])
    # no training file read: the vocabulary and labels are the checkpoint's
    assert "train_path: null" in (evaluation_path("test", 2) / "config.yaml").read_text(encoding="utf-8")
    accuracies = [logged_scalars(evaluation_path("test", n))["test/acc"][-1][1] for n in (0, 1, 2)]
    assert accuracies[0] == accuracies[1] == accuracies[2]
    texts = [line.split("\t", 1)[1] for line in Path("test.tsv").read_text().splitlines()]
    Path("unlabelled.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    main(["predict", "--ckpt_path", str(last_checkpoint()), "--data.predict_path", "unlabelled.txt", *QUIET])
    rows = (evaluation_path("predict") / "predictions.jsonl").read_text().splitlines()
    assert len(rows) == len(texts)


@pytest.mark.parametrize("run", ["LanguageModel"], indirect=True)
def test_predict_with_the_runs_own_config_still_writes_predictions(run: tuple[str, list[str]]) -> None:
    """The fit run's config.yaml lists fit's callbacks, which replace predict's default list (its writer)."""
    own = ["--config", str(run_path(0) / "config.yaml"), "--trainer.default_root_dir", "."]  # not the original's
    main(["predict", *own, "--ckpt_path", str(last_checkpoint())])
    assert (evaluation_path("predict") / "predictions.jsonl").read_text().splitlines()
    config = (evaluation_path("predict") / "config.yaml").read_text(encoding="utf-8")
    assert "PredictionWriter" not in config  # the writer came from the fallback, not from the list


@pytest.mark.parametrize("run", ["LanguageModel"], indirect=True)
def test_language_model_predictions_are_per_sequence_losses(
    run: tuple[str, list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    _, args = run
    main(["predict", *args, "--ckpt_path", str(last_checkpoint())])
    written = evaluation_path("predict") / "predictions.jsonl"
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    test_split = TextCorpus(path="story.txt", unit="line").datasets["test"]
    assert [row["index"] for row in rows] == list(range(len(test_split)))
    assert [row["tokens"] for row in rows] == [len(test_split[i][0]) for i in range(len(test_split))]
    assert all(row["bpc"] == pytest.approx(row["loss"] / torch.log(torch.tensor(2.0)).item()) for row in rows)
    assert f"{len(rows)} predictions written to {written.resolve()}" in caplog.text


@pytest.mark.parametrize("run", ["LanguageModel"], indirect=True)
def test_language_model_predictions_name_the_line_each_row_was_cut_from(run: tuple[str, list[str]]) -> None:
    # a line longer than --data.window_length (the run's 128) is several rows, which nothing tied to their line
    lines = ["the cat sat", "", " ".join(["the dog"] * 40), "a mat"]
    Path("new.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    main(["predict", "--ckpt_path", str(last_checkpoint()), "--data.test_path", "new.txt", *QUIET])
    written = (evaluation_path("predict") / "predictions.jsonl").read_text(encoding="utf-8")
    rows = [json.loads(line) for line in written.splitlines()]
    units = [row["unit"] for row in rows]
    assert units == sorted(units) and units[0] == 0 and units[-1] == 2 and units.count(1) == 3  # blank line skipped
    for unit, line in enumerate(line for line in lines if line):  # every character and <eos>, predicted once
        assert sum(row["tokens"] for row in rows if row["unit"] == unit) == len(line) + 1


def test_generate_from_a_language_model_and_not_from_a_classifier(
    trained: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    main(["generate", "--ckpt_path", str(last_checkpoint(trained["LanguageModel"])), "--length", "20", "--seed", "0"])
    assert set(capsys.readouterr().out.rstrip("\n")) <= set((trained["LanguageModel"] / "story.txt").read_text())
    classifier = last_checkpoint(trained["SequenceClassifier"])
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--ckpt_path", str(classifier)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error == (
        f"seqnorm generate: error: --ckpt_path {classifier}: holds a SequenceClassifier, and generate samples text "
        "from a LanguageModel: pass the checkpoint of a language model run (`seqnorm predict` labels text with a "
        "classifier)"
    )


def test_checkpoint_hyperparameters_are_constructor_arguments(trained: dict[str, Path]) -> None:
    # The CLI links data.level into the model; a SequenceClassifier takes no level, and its checkpoints once held it
    # anyway, which broke every reader that builds the model from the saved hyperparameters with jsonargparse.
    for task, cls in (("SequenceClassifier", SequenceClassifier), ("LanguageModel", LanguageModel)):
        path = last_checkpoint(trained[task])
        hparams = torch.load(path, weights_only=True)["hyper_parameters"]
        assert set(hparams) - {"_class_path", "_instantiator"} <= set(inspect.signature(cls).parameters)
        # Lightning's own reader for CLI checkpoints: the class comes from the file (what LightningCLI does too)
        model = pl.LightningModule.load_from_checkpoint(path, weights_only=True)
        assert type(model) is cls
    assert hparams["level"] == "char"  # the LanguageModel's link is applied and recorded


@pytest.mark.parametrize("run", ["SequenceClassifier"], indirect=True)
def test_checkpoint_written_before_the_fix_still_reads(run: tuple[str, list[str]]) -> None:
    _, args = run
    checkpoint = torch.load(last_checkpoint(), weights_only=True)
    checkpoint["hyper_parameters"]["level"] = "word"  # what the linked level left in classifier checkpoints
    torch.save(checkpoint, "old.ckpt")
    main(["test", *args, "--ckpt_path", "old.ckpt"])
    assert "test/acc" in logged_scalars(run_path(1))  # old.ckpt is outside the run folders: a run of its own


def test_stream_language_model_predicts_every_window(story: Path) -> None:
    # a character LM on a file reads it as streams by default: one row per stream and window, each from zeros
    args = ["--model", "LanguageModel", "--data", "TextCorpus", "--data.path", str(story), *TINY, *QUIET]
    main(["fit", *args, "--data.window_length", "65", "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1"])
    main(["predict", *args, "--data.window_length", "65", "--ckpt_path", str(last_checkpoint())])
    rows = [json.loads(line) for line in (evaluation_path("predict") / "predictions.jsonl").read_text().splitlines()]
    windows = TextCorpus(path=str(story), batch_size=16, window_length=65).datasets["test"]
    assert [(row["window"], row["stream"]) for row in rows] == [(w, s) for w in range(len(windows)) for s in range(16)]
    assert [row["index"] for row in rows] == list(range(len(rows)))
    assert all(row["tokens"] == len(windows[row["window"]][0][row["stream"]]) for row in rows)


@pytest.mark.parametrize("run", ["SequenceClassifier"], indirect=True)
def test_predict_without_texts_to_predict_names_the_flag(
    run: tuple[str, list[str]], capsys: pytest.CaptureFixture
) -> None:
    _, args = run
    without_test_file = args[: args.index("--data.test_path")] + args[args.index("--data.test_path") + 2 :]
    with pytest.raises(SystemExit) as exit_info:
        main(["predict", *without_test_file, "--ckpt_path", str(last_checkpoint())])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]  # Lightning's log lines may come before it
    assert message == (
        "seqnorm predict: error: --data.test_path: predict reads the test split, and this data has none: pass "
        "--data.test_path with the texts to predict"
    )
