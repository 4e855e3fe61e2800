"""The `seqnorm` command end to end on small files the tests write: train, watch, stop, resume, generate."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import seqnorm
from seqnorm.cli import main
from seqnorm.lightning import LanguageModel, SequenceClassifier
from seqnorm.norms import BatchNormSpec, LayerNormSpec
from tests.conftest import QUIET, WORDS, evaluation_path, logged_scalars, run_path

TINY_LM = ["--model.hidden_size", "48", "--model.embedding_dim", "16", "--model.lr", "0.01"]


def test_char_lm_on_own_file_trains_resumes_and_generates(story: Path, capsys: pytest.CaptureFixture) -> None:
    base = ["--model", "LanguageModel", "--data", "TextCorpus", "--data.path", str(story), "--data.batch_size", "16"]
    main(["fit", *base, *TINY_LM, *QUIET, "--trainer.max_steps", "90", "--trainer.log_every_n_steps", "10"])
    run = run_path(0)
    last = run / "checkpoints" / "last.ckpt"
    assert last.is_file() and list((run / "checkpoints").glob("best-*.ckpt"))
    scalars = logged_scalars(run)
    assert {"train/loss", "val/loss", "val/bpc"} <= set(scalars)
    first_bpc, final_bpc = scalars["val/bpc"][0][1], scalars["val/bpc"][-1][1]
    # uniform over the ~20 symbols is 4.3 bits; the text's own entropy is about 0.9 bits per character
    assert final_bpc < 1.25, scalars["val/bpc"]
    assert final_bpc < first_bpc
    assert scalars["val/loss"][-1][1] == pytest.approx(final_bpc * torch.log(torch.tensor(2.0)).item(), rel=1e-5)
    checkpoint = torch.load(last, weights_only=False)
    assert checkpoint["global_step"] == 90
    assert checkpoint["seqnorm_data"]["level"] == "char"

    # stop, then resume from last.ckpt: the step count and the optimizer state continue, in the same run directory
    main(["fit", *base, *TINY_LM, *QUIET, "--trainer.max_steps", "120", "--ckpt_path", str(last)])
    assert [path.name for path in run_path(0).parent.iterdir()] == ["version_0"]
    resumed_checkpoint = torch.load(last, weights_only=False)
    assert resumed_checkpoint["global_step"] == 120
    adam_steps = {float(state["step"]) for state in resumed_checkpoint["optimizer_states"][0]["state"].values()}
    assert adam_steps == {120.0}
    # one TensorBoard run: the first run's points, then the resumed run's, in step order
    resumed_scalars = logged_scalars(run)
    assert resumed_scalars["val/loss"][: len(scalars["val/loss"])] == scalars["val/loss"]
    steps = [step for step, _ in resumed_scalars["val/loss"]]
    assert steps == sorted(steps) and steps[-1] >= 110 and len(steps) > len(scalars["val/loss"])

    # generate at batch size 1 from the checkpoint: the prompt, then characters of the training text only
    capsys.readouterr()
    main(["generate", "--ckpt_path", str(last), "--prompt", "the ", "--length", "60", "--seed", "0"])
    text = capsys.readouterr().out.removesuffix("\n")
    assert text.startswith("the ") and len(text) == len("the ") + 60
    assert set(text) <= set(story.read_text()) | {"\n"}
    capsys.readouterr()
    main(["generate", "--ckpt_path", str(last), "--prompt", "the ", "--length", "60", "--seed", "0"])
    assert capsys.readouterr().out.rstrip("\n") == text  # seeded: reproducible

    # test reads the same checkpoint, in a folder of its own beside the run (inside it)
    main(["test", *base, *TINY_LM, *QUIET, "--ckpt_path", str(last)])
    tested = logged_scalars(evaluation_path("test"))
    assert {"test/loss", "test/bpc"} <= set(tested)
    assert tested["test/bpc"][0][1] < 1.3


def test_interrupted_run_resumes_from_last_checkpoint(story: Path) -> None:
    base = ["--model", "LanguageModel", "--data", "TextCorpus", "--data.path", str(story), "--data.unit", "line"]
    base += [*TINY_LM, *QUIET]
    sigint = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):  # Lightning's graceful shutdown after Ctrl-C
            main(
                [
                    "fit",
                    *base,
                    "--trainer.max_steps",
                    "50",
                    "--trainer.callbacks+=tests.interrupt.InterruptAfter",
                    "--trainer.callbacks.step",
                    "12",
                ]
            )
    finally:
        signal.signal(signal.SIGINT, sigint)  # Lightning ignores further Ctrl-C while shutting down
    last = run_path(0) / "checkpoints/last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 12
    assert not list(last.parent.glob("best-*"))  # Ctrl-C writes last.ckpt only: nothing was validated at step 12
    main(["fit", *base, "--trainer.max_steps", "20", "--ckpt_path", str(last)])
    assert torch.load(last, weights_only=False)["global_step"] == 20


def test_word_lm_reports_perplexity(story: Path) -> None:
    args = ["--model", "LanguageModel", "--data", "TextCorpus", "--data.path", str(story), "--data.level", "word"]
    main(["fit", *args, *TINY_LM, *QUIET, "--trainer.max_steps", "40", "--data.batch_size", "16"])
    scalars = logged_scalars(run_path(0))
    assert "val/ppl" in scalars and "val/bpc" not in scalars
    # 14 words + <eos> + specials: a trained model is far below the uniform perplexity
    assert scalars["val/ppl"][-1][1] < 14


def test_classifier_on_own_tsv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    rng = random.Random(1)
    rows = []
    for _ in range(400):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
        label = "pets" if {"cat", "dog"} & set(words) else "other"
        rows.append(f"{label}\t{' '.join(words)}")
    (tmp_path / "train.tsv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    base = ["--model", "SequenceClassifier", "--data", "LabeledText", "--data.train_path", "train.tsv"]
    options = ["--model.hidden_size", "32", "--model.embedding_dim", "16", "--model.lr", "0.01"]
    main(["fit", *base, *options, *QUIET, "--trainer.max_epochs", "8", "--data.batch_size", "16"])
    scalars = logged_scalars(run_path(0))
    assert scalars["val/acc"][-1][1] >= 0.9, scalars["val/acc"]
    assert {"train/loss", "val/loss"} <= set(scalars)


def test_fit_with_no_data_arguments_trains_the_embedded_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    short = [*QUIET, "--trainer.max_steps", "20", "--trainer.limit_val_batches", "2"]
    short += ["--trainer.val_check_interval", "10"]
    switches = ["--model.norm.class_path", "LayerNormSpec", "--model.norm.init_args.norm_placement", "joint"]
    switches += ["--model.rnn_options", '{"zoneout_h": 0.1}']
    main(["fit", "--model", "LanguageModel", "--data", "TextCorpus", *TINY_LM, *switches, *short])
    main(["fit", "--model", "SequenceClassifier", "--data", "LabeledText", "--model.hidden_size", "16", *short])
    language_model = Path("lightning_logs/charlm-embedded-lstm-layer-h48")
    classifier = Path("lightning_logs/classifier-embedded-lstm-layer-h16")
    assert "val/bpc" in logged_scalars(language_model / "version_0")
    checkpoint = torch.load(language_model / "version_0/checkpoints/last.ckpt", weights_only=False)
    assert checkpoint["hyper_parameters"]["rnn_options"] == {"zoneout_h": 0.1}
    assert checkpoint["hyper_parameters"]["norm"] == LayerNormSpec(norm_placement="joint").to_dict()
    assert any(".norm_gates_l0." in key for key in checkpoint["state_dict"])
    assert "val/acc" in logged_scalars(classifier / "version_0")
    assert (classifier / "version_0/checkpoints/last.ckpt").is_file()


def test_rnn_options_reach_the_layer_and_bad_ones_are_named() -> None:
    model = LanguageModel(10, norm=BatchNormSpec(state_norm="carried"), rnn_options={"zoneout_c": 0.1})
    cell = model.model.rnn.cells[0]
    assert cell.state_norm == "carried" and cell.zoneout_c == 0.1
    with pytest.raises(ValueError, match=r"^LanguageModel: expected rnn_options without .* got norm \(use --model"):
        LanguageModel(10, rnn_options={"norm": "batch"})
    with pytest.raises(ValueError, match=r"^build_rnn: expected keyword arguments of seqnorm.GRU .* got zonout_h$"):
        SequenceClassifier(10, 2, cell="gru", rnn_options={"zonout_h": 0.1})
    with pytest.raises(ValueError, match=r"^GRU: expected state_norm='output'"):
        SequenceClassifier(10, 2, cell="gru", norm=LayerNormSpec(state_norm="carried"))


@pytest.mark.parametrize(
    ("options", "expected"),
    [('{"zonout_h": 0.1}', "Unexpected keys: {'zonout_h'}"), ('{"impl": "fastest"}', "Got value: fastest")],
)
def test_rnn_options_are_typed_on_the_command_line(capsys: pytest.CaptureFixture, options: str, expected: str) -> None:
    # RNNOptions is a TypedDict: jsonargparse refuses an unknown key or a value outside its choices while parsing,
    # before any data is read or model built.
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--model", "LanguageModel", "--data", "TextCorpus", "--model.rnn_options", options, *QUIET])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_print_config(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--model", "LanguageModel", "--data", "TextCorpus", "--model.norm", "rms", "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "class_path: seqnorm.lightning.LanguageModel" in printed and "norm: rms" in printed
    assert re.search(r"^\s+(vocab_size|pad_index):", printed, re.MULTILINE) is None  # linked from the data


@pytest.mark.parametrize(
    ("make_file", "flag_args", "expected"),
    [
        (None, ["--data.path", "missing.txt"], "missing.txt"),
        (lambda p: p.write_bytes(b"caf\xe9 au lait\n" * 50), ["--data.path", "latin1.txt"], "UTF-8 at byte 3"),
        (lambda p: p.write_text(""), ["--data.path", "empty.txt"], "empty.txt"),
        (None, ["--data.dataset", "imagenet"], "ptb_char"),
    ],
)
def test_user_errors_are_one_message_and_exit_code_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, make_file, flag_args, expected
) -> None:
    monkeypatch.chdir(tmp_path)
    if make_file is not None:
        make_file(tmp_path / flag_args[1])
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--model", "LanguageModel", "--data", "TextCorpus", *flag_args, *QUIET])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert expected in error and "Traceback" not in error


def test_generate_rejects_a_missing_checkpoint(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--ckpt_path", "nowhere.ckpt"])
    assert exit_info.value.code == 2
    assert "--ckpt_path nowhere.ckpt: no such checkpoint file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--temperature", "-1", "--temperature -1.0: expected a finite value >= 0 (0: greedy)"),
        ("--top_k", "0", "--top_k 0: expected an int >= 1"),
        ("--length", "-2", "--length -2: expected an int >= 0"),
    ],
)
def test_generate_names_the_flag_at_fault(capsys: pytest.CaptureFixture, flag: str, value: str, expected: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--ckpt_path", "nowhere.ckpt", flag, value])  # checked before the file is read
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"seqnorm generate: error: {expected}"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--model.norm_max_steps", "0"], "LanguageModel: expected norm_max_steps to be a positive int, got 0"),
        (["--model.lr", "-1"], "LanguageModel: expected lr to be finite and >= 0, got -1.0"),
        (["--model.weight_decay", "-0.1"], "LanguageModel: expected weight_decay to be finite and >= 0, got -0.1"),
        (["--model.dropout", "2.0"], "LanguageModel: expected dropout to be a finite number in [0, 1), got 2.0"),
        (["--trainer.accumulate_grad_batches", "0"], "--trainer.accumulate_grad_batches 0: expected an int >= 1"),
    ],
)
def test_model_numbers_are_refused_under_their_own_flag_names(
    capsys: pytest.CaptureFixture, flags: list[str], expected: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--model", "LanguageModel", "--data", "TextCorpus", *flags, *QUIET, "--trainer.max_steps", "1"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"error: {expected}")


def test_console_script_exit_code_and_no_traceback(tmp_path: Path) -> None:
    (tmp_path / "bad.tsv").write_text("positive\tgood film\nno label here\n", encoding="utf-8")
    command = [sys.executable, "-m", "seqnorm.cli", "fit", "--model", "SequenceClassifier", "--data", "LabeledText"]
    result = subprocess.run(
        [*command, "--data.train_path", "bad.tsv"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2
    assert "bad.tsv:2" in result.stderr and "Traceback" not in result.stderr


def test_version_names_the_package_torch_and_the_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--version"])
    out = capsys.readouterr().out
    assert out.startswith(f"seqnorm {seqnorm.__version__} (torch {torch.__version__}; compiled kernels: ")


def test_help_lists_generate_and_configs_beside_lightnings_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    for command in ("fit", "validate", "test", "predict", "generate", "configs"):
        assert f"    {command} " in out, command


def test_no_command_and_generate_help_name_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    assert "usage: seqnorm {fit,validate,test,predict,generate,configs} ..." in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert capsys.readouterr().out.startswith("usage: seqnorm generate ")
    with pytest.raises(SystemExit) as exit_info:
        main(["gnerate"])  # LightningCLI's own error listed fit..predict only
    assert exit_info.value.code == 2
    assert "invalid choice: 'gnerate' (choose from 'fit', 'validate', 'test', 'predict', 'generate', 'configs')" in (
        capsys.readouterr().err
    )


def test_the_console_help_has_no_lightning_warning() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import sys; sys.argv = ['seqnorm', '--help']; from seqnorm.cli import main; main()"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "fit" in result.stdout and "args parameter" not in result.stderr, result.stderr


def test_the_command_without_the_training_extra_says_what_to_install() -> None:
    """A base install has the `seqnorm` command; without Lightning it was a traceback from seqnorm.cli's imports.
    (``--version``, ``--help`` and ``configs`` work without it: tests/cli/test_cli_usability.py.)"""
    code = (
        "import sys; sys.modules['lightning'] = None; sys.argv = ['seqnorm', 'fit']\n"
        "from seqnorm.__main__ import main; main()"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        "seqnorm: error: the command needs the training extra (lightning is not installed): "
        "pip install 'seqnorm[train]'"
    )
    working = subprocess.run(
        [sys.executable, "-m", "seqnorm", "--version"], capture_output=True, text=True, timeout=300
    )
    assert working.returncode == 0 and working.stdout.startswith("seqnorm ")


def test_a_scheduler_without_an_optimizer_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """LightningCLI attaches a scheduler only to an optimizer it builds: alone, it was silently ignored."""
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "fit",
                "--model",
                "LanguageModel",
                "--data",
                "TextCorpus",
                "--lr_scheduler",
                "ExponentialLR",
                "--lr_scheduler.gamma",
                "0.5",
                *QUIET,
                "--trainer.max_steps",
                "1",
            ]
        )
    assert exit_info.value.code == 2
    assert "error: --lr_scheduler: needs --optimizer too" in capsys.readouterr().err
