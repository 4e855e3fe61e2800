"""What the `seqnorm` command says and shows: a mistyped flag, generate's prompt, the commands that need no Lightning,
the shipped config a missing --config names, the progress bar at 80 columns and the run it names."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from seqnorm.cli import main
from seqnorm.cli.flags import unknown_flag
from seqnorm.lightning.progress import run_label
from seqnorm.shipped_configs import shipped_name_of
from tests.conftest import QUIET, SMALL_LM, cli_usage_error, run_path

ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _seqnorm(args: list[str], cwd: Path, **environ: str) -> subprocess.CompletedProcess[str]:
    """The `seqnorm` console script's entry point (seqnorm.__main__:main) in a fresh process, output piped."""
    env = {key: value for key, value in os.environ.items() if key != "FORCE_COLOR"}  # piped: plain output
    env.update({"PYTHONPATH": str(ROOT), **environ})
    command = [sys.executable, "-m", "seqnorm", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


# ---- a mistyped flag -----------------------------------------------------------------------------------------------


def test_a_mistyped_model_flag_is_one_short_error_with_the_flag_meant(tmp_path: Path) -> None:
    # It was jsonargparse's usage of every --trainer flag and a nested Union report: 45 lines, no suggestion.
    result = _seqnorm(["fit", *SMALL_LM, "--model.hiden_size", "10"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "seqnorm fit: error: --model.hiden_size: not a flag of LanguageModel; did you mean --model.hidden_size?",
        "(seqnorm fit --model.help LanguageModel lists the flags)",
    ]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["fit", *SMALL_LM, "--trainer.max_stepz", "3"],
            "--trainer.max_stepz: no such flag; did you mean --trainer.max_steps or --trainer.max_time?",
        ),
        (["fit", *SMALL_LM, "--data.pth", "x.txt"], "--data.pth: not a flag of TextCorpus; did you mean --data.path?"),
        (["fit", *SMALL_LM, "--hidden_size", "8"], "--hidden_size: no such flag; did you mean --model.hidden_size?"),
        (  # a valid number YAML 1.1 reads as a string is no bad value (it was said to be no finite number)
            ["fit", *SMALL_LM, "--model.lr", "1e-3", "--trainer.max_stepz", "3"],
            "--trainer.max_stepz: no such flag; did you mean --trainer.max_steps or --trainer.max_time?",
        ),
        (  # no --model on the command line (a --config may name it): the flags of every model
            ["fit", "--model.hiden_size", "8"],
            "--model.hiden_size: not a flag of LanguageModel or SequenceClassifier; did you mean --model.hidden_size?",
        ),
        (["fit", *SMALL_LM, "--optimizer", "Adam", "--optimizer.lrr", "1"], "Adam; did you mean --optimizer.lr?"),
        (["generate", "--ckpt_path", "x.ckpt", "--promt", "a"], "--promt: no such flag; did you mean --prompt?"),
    ],
)
def test_a_mistyped_flag_names_the_closest_valid_ones(
    capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    error = cli_usage_error(capsys, args)
    assert f"seqnorm {args[0]}: error: " in error and expected in error
    assert len(error.splitlines()) == 2 and "usage:" not in error


@pytest.mark.parametrize(
    "words",
    [
        ["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.monitor", "val/loss"],  # under a listed option
        ["--model", "my_package.UnknownModel", "--model.anything", "1"],  # a class not importable here: not judged
        ["--model.norm.init_args.eps", "1e-3"],  # under an argument of the model
    ],
)
def test_flags_that_are_valid_or_cannot_be_judged_get_no_suggestion(words: list[str]) -> None:
    from seqnorm.lightning import LanguageModel

    options = ["--trainer", "--trainer.callbacks", "--trainer.max_steps", "--model"]
    assert unknown_flag(words, options, {"model": (LanguageModel,)}) is None


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["fit", *SMALL_LM, "--data.text_format", "ptbchar"],
            "--data.text_format ptbchar: expected one of plain, ptb_char, got 'ptbchar'; did you mean ptb_char?",
        ),
        (
            ["fit", *SMALL_LM, "--model.cell", "lstmm"],
            "--model.cell lstmm: expected one of lstm, gru, got 'lstmm'; did you mean lstm?",
        ),
        (
            ["test", *SMALL_LM, "--data.unit=lines"],
            "--data.unit lines: expected one of line, paragraph, sentence, window, stream, got 'lines'; did you mean "
            "line?",
        ),
        (
            ["fit", "--model", "SequenceClassifier", "--data", "LabeledText", "--data.format", "tssv"],
            "--data.format tssv: expected one of tsv, first_token, got 'tssv'; did you mean tsv?",
        ),
        (["fit", *SMALL_LM, "--model.hidden_size", "8.5"], "--model.hidden_size 8.5: expected an integer, got '8.5'"),
        (["fit", *SMALL_LM, "--model.num_layers=many"], "--model.num_layers many: expected an integer, got 'many'"),
        (["fit", *SMALL_LM, "--model.lr", "nan"], "--model.lr nan: expected a finite number, got 'nan'"),
        (["test", *SMALL_LM, "--data.val_fraction", "-inf"], "--data.val_fraction -inf: expected a finite number, got"),
    ],
)
def test_a_value_that_is_none_of_the_choices_is_one_line_with_the_nearest(
    capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    """They ended 61-67 lines of jsonargparse in ``Given value: NestedArg(key='cell', val='lstmm')``; a number that
    is not one, or not finite, too (and of ``nan`` it said "Expected a <class 'float'>")."""
    lines = cli_usage_error(capsys, args).splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"seqnorm {args[0]}: error: {expected}")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["fit", *SMALL_LM, "--threads", "-2"], "--threads -2: expected an integer >= 0 or null, got '-2'"),
        (["fit", *SMALL_LM, "--trainer.max_steps", "2.5"], "--trainer.max_steps 2.5: expected an integer, got '2.5'"),
        (
            ["fit", *SMALL_LM, "--trainer.precision=bf16-mixd"],
            "--trainer.precision bf16-mixd: expected one of 64, 32, 16, transformer-engine, "
            "transformer-engine-float16, 16-true, 16-mixed, bf16-true, bf16-mixed, 32-true, 64-true, bf16 or null, "
            "got 'bf16-mixd'; did you mean bf16-mixed?",
        ),
        (
            ["fit", *SMALL_LM, "--trainer.enable_checkpointing", "maybe"],
            "--trainer.enable_checkpointing maybe: expected true, false or null, got 'maybe'",
        ),
        (
            ["fit", *SMALL_LM, "--trainer.gradient_clip_val", "nan"],
            "--trainer.gradient_clip_val nan: expected a finite number or null, got 'nan'",
        ),
        (["generate", "--ckpt_path", "x.ckpt", "--length", "3.5"], "--length 3.5: expected an integer, got '3.5'"),
        (["generate", "--ckpt_path", "x.ckpt", "--top_k=1.5"], "--top_k 1.5: expected an integer or null, got '1.5'"),
    ],
)
def test_a_value_not_of_a_flags_type_is_one_line_saying_what_it_takes(
    capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    """Flags outside --model/--data (the Trainer's, --threads, generate's) ended jsonargparse's whole usage and a
    ten-line report (``Does not validate against any of the Union subtypes ... Given value: -2``)."""
    lines = cli_usage_error(capsys, args).splitlines()
    assert lines == [f"seqnorm {args[0]}: error: {expected}"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (  # a ZeroDivisionError traceback from Lightning's training loop, at its first step
            ["--trainer.val_check_interval", "0"],
            "--trainer.val_check_interval 0: expected a number of training steps (1 or more) or a fraction of an "
            "epoch (0.0 to 1.0)",
        ),
        (  # it named the constructor's arguments and no way out
            ["--model.tie_weights", "true"],
            "RNNLanguageModel: expected embedding_dim == hidden_size with tie_weights, got 8 and 16: set "
            "--model.embedding_dim 16 or --model.tie_weights false",
        ),
    ],
)
def test_settings_refused_before_training_are_one_line_in_flags(
    capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    lines = cli_usage_error(capsys, ["fit", *SMALL_LM, *args]).strip().splitlines()
    assert lines[-1] == f"seqnorm fit: error: {expected}"


def test_a_value_of_the_wrong_type_in_a_config_file_is_one_line_with_the_value(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "steps.yaml"
    config.write_text("trainer:\n  max_steps: 2.5\n")
    lines = cli_usage_error(capsys, ["fit", *SMALL_LM, "--config", str(config)]).splitlines()
    assert lines == ["seqnorm fit: error: --trainer.max_steps 2.5: expected an integer, got '2.5'"]


def test_a_trainer_setting_lightning_refuses_with_a_type_error_is_one_line(tmp_path: Path) -> None:
    """Lightning's TypeError for ``--trainer.devices -3`` on the CPU was a 40-line traceback."""
    result = _seqnorm(["fit", *SMALL_LM, "--trainer.devices", "-3", *QUIET], tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "seqnorm fit: error: --trainer: `devices` selected with `CPUAccelerator` should be an int > 0."
    )
    assert "Traceback" not in result.stderr


def test_an_abbreviated_flag_is_refused_with_the_flag_meant(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse took a unique prefix: ``--trainer.max_step 3`` ran as ``--trainer.max_steps 3``, unsaid."""
    assert (
        cli_usage_error(capsys, ["fit", *SMALL_LM, "--trainer.max_step", "3"])
        .splitlines()[0]
        .startswith("seqnorm fit: error: --trainer.max_step: no such flag; did you mean --trainer.max_steps")
    )
    from seqnorm.lightning import LanguageModel

    options = ["--trainer", "--trainer.max_steps", "--model"]
    assert unknown_flag(["--trainer.max_step", "3"], options, {"model": (LanguageModel,)})[:2] == (
        "--trainer.max_step",
        ["--trainer.max_steps"],
    )


NO_DATA = (
    "--data: no data given: name its class, --data TextCorpus or --data LabeledText, then its files (`seqnorm {} "
    "--data.help TextCorpus` lists its flags)"
)


@pytest.mark.parametrize(
    "args",
    [
        ["fit", "--model", "LanguageModel", "--model.hidden_size", "8"],
        ["validate", "--model", "SequenceClassifier"],
        ["fit", "--config", "model.yaml"],  # a config that names no data either
    ],
)
def test_no_data_is_one_line_naming_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    """It was jsonargparse's ``empty(): argument 'size' ... NoneType`` and every model argument, naming no flag."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.yaml").write_text("model:\n  class_path: LanguageModel\n")
    assert cli_usage_error(capsys, args).splitlines()[-1] == f"seqnorm {args[0]}: error: {NO_DATA.format(args[0])}"
    assert not (tmp_path / "lightning_logs").exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["fit", "--model", "LanguageModel", "--data.path", "x.txt"],
            "--data.path: no --data class given: name it before its flags, --data TextCorpus or --data LabeledText",
        ),
        (
            ["test", "--data=TextCorpus", "--model.hidden_size", "8"],
            "--model.hidden_size: no --model class given: name it before its flags, --model LanguageModel or "
            "--model SequenceClassifier",
        ),
    ],
)
def test_a_class_flag_without_its_class_is_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    """It was the whole usage and jsonargparse's ``NestedArg(key='path', val='x.txt')``, 60 lines."""
    assert cli_usage_error(capsys, args).splitlines() == [f"seqnorm {args[0]}: error: {expected}"]


def test_a_class_named_in_a_config_takes_its_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.yaml").write_text("data:\n  class_path: TextCorpus\n")
    args = ["fit", "-c", "data.yaml", "--model", "LanguageModel", "--data.path", "missing.txt"]
    assert "missing.txt: no such file (given as --data.path)" in cli_usage_error(capsys, args)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"\xff\xfe\x00bin", "not UTF-8 text (byte 0xff at offset 0)"),
        (b"model: [\n", "not YAML: expected the node content, but found '<stream end>' at line 2, column 1"),
        (b"", "expected a YAML mapping of sections (model:, data:, trainer:, ...), got an empty file"),
        (b"- fit\n", "expected a YAML mapping of sections (model:, data:, trainer:, ...), got a list"),
    ],
    ids=["binary", "malformed", "empty", "list"],
)
def test_an_unusable_config_file_is_one_line_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], content: bytes, expected: str
) -> None:
    """The binary file's error named neither the file nor the flag; the malformed one's said ``<unicode string>``;
    the empty one's was ``Unexpected config:`` with nothing after it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run config.yaml").write_bytes(content)
    args = ["fit", *SMALL_LM, "--config=run config.yaml"]
    assert cli_usage_error(capsys, args).splitlines() == [f"seqnorm fit: error: --config run config.yaml: {expected}"]


def test_a_bad_value_not_judged_here_keeps_jsonargparses_report(capsys: pytest.CaptureFixture[str]) -> None:
    error = cli_usage_error(capsys, ["fit", *SMALL_LM, "--trainer.max_steps", "many"])
    assert "no such flag" not in error and "not a flag" not in error and "max_steps" in error


# ---- generate shows its prompt --------------------------------------------------------------------------------------


def _trained(directory: Path, level: str) -> Path:
    data = ["--data.path", str(directory / "story.txt"), "--data.level", level, "--data.batch_size", "8"]
    main(["fit", *SMALL_LM, *data, *QUIET, "--trainer.max_steps", "2", "--trainer.default_root_dir", str(directory)])
    return run_path(0, directory) / "checkpoints" / "last.ckpt"


def test_generate_prints_the_prompt_then_the_continuation(
    story: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    last = _trained(story.parent, "char")
    sample = ["generate", "--ckpt_path", str(last), "--prompt", "the ", "--length", "20", "--seed", "0"]
    piped = _seqnorm(sample, story.parent)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.startswith("the ") and "\x1b" not in piped.stdout  # plain text when piped
    assert len(piped.stdout) == len("the ") + 20 + 1  # the prompt, 20 characters, the line break
    # On a terminal (FORCE_COLOR makes rich treat the output as one) the prompt is bold and the rest plain.
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("TERM", "xterm-256color")  # TERM=dumb would keep it plain
    capsys.readouterr()
    main(sample)
    shown = capsys.readouterr().out
    assert shown.startswith("\x1b[1mthe \x1b[0m")
    assert ANSI.sub("", shown) == piped.stdout


def test_generated_words_follow_the_prompt_after_a_space(story: Path, capsys: pytest.CaptureFixture[str]) -> None:
    last = _trained(story.parent, "word")
    capsys.readouterr()
    main(["generate", "--ckpt_path", str(last), "--prompt", "the cat", "--length", "5", "--seed", "0"])
    out = capsys.readouterr().out
    assert out.startswith("the cat") and out[len("the cat")] in " \n", out
    assert len(out[len("the cat") :].split()) == 5 - out[len("the cat") :].count("\n") + out.endswith("\n")


# ---- the commands that need no Lightning ---------------------------------------------------------------------------

# Lightning and jsonargparse cannot be imported: what a base install (no `train` extra) has, and the proof that these
# commands do not import them (each took 4-6 s for Lightning's import alone).
BLOCKED = """
import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("lightning", "jsonargparse"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Blocked())
sys.argv = ["seqnorm", *sys.argv[1:]]
from seqnorm.__main__ import main
main()
"""


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("--version", r"\Aseqnorm \S+ \(torch \S+; compiled kernels: .*\)\Z"),
        ("--help", r"\Ausage: seqnorm \{fit,validate,test,predict,generate,configs\} \.\.\.\n(.|\n)*\n    configs  "),
        ("configs", r"\Aseqnorm:char_lm +\S+char_lm\.yaml\n(.|\n)*\nUse: seqnorm fit --config seqnorm:char_lm "),
    ],
    ids=["version", "help", "configs"],
)
def test_version_help_and_configs_need_no_lightning(tmp_path: Path, command: str, expected: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", BLOCKED, command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert re.search(expected, result.stdout.strip()), result.stdout


@pytest.mark.parametrize("unbuffered", ["1", ""], ids=["unbuffered", "buffered"])
@pytest.mark.parametrize("command", ["--help", "configs"])
def test_output_into_a_closed_pipe_ends_quietly(tmp_path: Path, command: str, unbuffered: str) -> None:
    # `seqnorm --help | head -1`: head has gone when the output arrives. It was a BrokenPipeError traceback, from
    # print() when unbuffered, or "Exception ignored ... BrokenPipeError" and exit 120 from the flush at exit.
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written: every write fails, whatever the timing
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": unbuffered}
    try:
        result = subprocess.run(
            [sys.executable, "-m", "seqnorm", command],
            cwd=tmp_path,
            env=env,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    finally:
        os.close(write)
    assert result.stderr == ""
    assert result.returncode == 141  # 128 + SIGPIPE, what a shell reports for a command its pipe ended


# ---- a --config of the repository's configs/, outside a checkout ---------------------------------------------------


def test_a_missing_config_file_names_the_shipped_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    error = cli_usage_error(capsys, ["fit", "--config", "configs/char_lm.yaml", "--data.path", "my.txt"])
    assert error.strip() == (
        "seqnorm fit: error: --config configs/char_lm.yaml: no such file (the repository's configs/ is not in this "
        "directory); seqnorm ships a config of that name: pass --config seqnorm:char_lm (`seqnorm configs` lists them)"
    )


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("configs/norm/batch.yaml", "norm/batch"),
        ("elsewhere/char_lm.yaml", "char_lm"),
        ("batch.yaml", "norm/batch"),  # the only shipped config of that file name
        ("configs/mine.yaml", None),
        ("configs/char_lm.json", None),
    ],
)
def test_the_shipped_config_a_missing_file_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path, name) -> None:
    monkeypatch.chdir(tmp_path)
    assert shipped_name_of(path) == name


def test_an_existing_config_file_is_read_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "char_lm.yaml").write_text("seed_everything: 3\n")
    assert shipped_name_of("configs/char_lm.yaml") is None


# ---- the progress bar ----------------------------------------------------------------------------------------------

SHORT = ["--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1"]


def _bar_lines(out: str) -> list[str]:
    return [line.rstrip() for line in out.splitlines() if line.startswith("Epoch")]


def test_the_progress_bar_fits_80_columns_and_names_the_run_after_a_resume(
    story: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = ["--data.path", str(story), "--data.batch_size", "8", "--trainer.enable_model_summary", "false"]
    monkeypatch.setenv("COLUMNS", "80")  # what rich reads when the output is not a terminal
    capsys.readouterr()
    main(["fit", *SMALL_LM, *data, *SHORT])
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80, out
    # one line: the metrics wrapped onto a second one (Lightning's row is about 130 columns)
    assert any(re.search(r"loss: \d+\.\d{3} .*val/bpc: \d+\.\d{3}$", line) for line in _bar_lines(out)), out
    monkeypatch.setenv("COLUMNS", "200")
    last = run_path(0, story.parent) / "checkpoints" / "last.ckpt"
    main(["fit", *SMALL_LM, *data, *SHORT[2:], "--trainer.max_steps", "6", "--ckpt_path", str(last)])
    bars = _bar_lines(capsys.readouterr().out)
    # the resumed run continues version_0: Lightning showed the last 4 characters of "version_0" ("on_0"), and
    # version numbers as floats ("0.000")
    assert bars and all(re.search(r" v_num: 0 ", line) for line in bars), bars


@pytest.mark.parametrize(
    ("version", "label"),
    [(13, "13"), ("version_13", "13"), ("char_lm-layer", "char_lm-layer"), ("", None), (None, None)],
)
def test_run_label(version: int | str | None, label: str | None) -> None:
    assert run_label(version) == label


def test_batch_norm_at_batch_size_1_is_refused_before_anything_runs(tmp_path: Path) -> None:
    """It was refused after the model summary, the sanity validation and the first step's forward."""
    from tests.conftest import write_story

    write_story(tmp_path / "story.txt")
    args = ["fit", *SMALL_LM, "--data.path", "story.txt", "--model.norm", "batch", "--data.batch_size", "1"]
    result = _seqnorm([*args, "--trainer.max_steps", "2"], tmp_path)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    expected = "seqnorm fit: error: LSTMCell: expected a batch of at least 2 rows to form per-timestep batch statistics"
    assert last.startswith(f"{expected} in training, got batch size 1."), last
    output = result.stdout + result.stderr
    assert "Total estimated model params" not in output and "Sanity" not in output and "Traceback" not in output
    running = _seqnorm([*args, "--model.small_batch", "running", "--trainer.max_steps", "1", *QUIET], tmp_path)
    assert running.returncode == 0, running.stderr  # what the error suggests trains
