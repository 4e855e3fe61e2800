"""``--data.text_format ptb_char``: PTB-char files read as their real characters, the same way whether they come from
the registry's download or from ``--data.path``; PTB-char text read as plain text is refused, not scored."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from seqnorm.data import DataError, TextCorpus
from seqnorm.data.registry import MANIFEST
from tests.conftest import run_path

WORDS = ["the", "cat", "dog", "sat", "on", "a", "mat", "n't", "big", "red", "<unk>", "co.", "$", "N"]
SPECIALS = 4


def _sentences(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8))) for _ in range(count)]


def _ptb_char(sentences: list[str]) -> str:
    # Mikolov's ptb.char.*.txt layout: " a e r _ b a n k\n", a leading space, one sentence a line.
    return "".join(" " + " ".join("_" if c == " " else c for c in sentence) + "\n" for sentence in sentences)


SENTENCES = _sentences(60)
PTB_CHAR = _ptb_char(SENTENCES)
PROSE = (
    "A Heading\n\nI saw a cat on the mat.\nIt sat there for a while, and then it ran off.\n"
    "a b c d\nThe dog did not care at all about it.\nEnd\n"
)


def _files_only(**kwargs: object) -> TextCorpus:
    return TextCorpus(val_fraction=0.0, test_fraction=0.0, batch_size=1, window_length=512, **kwargs)  # type: ignore[arg-type]


def test_ptb_char_tokens_are_the_real_characters_one_per_symbol(write: Callable[..., str]) -> None:
    path = write("ptb.char.train.txt", PTB_CHAR)
    symbols = sum(len(line.split()) for line in PTB_CHAR.split("\n"))  # letters and `_`, no separators
    assert symbols == sum(len(sentence) for sentence in SENTENCES)

    lines = _files_only(path=path, text_format="ptb_char", unit="line")
    assert set(lines.vocab.tokens[SPECIALS:]) == set("".join(SENTENCES))  # `_` is read as the space between words
    assert "_" not in lines.vocab
    # What bpc averages over: one target per symbol and one <eos> per sentence, none for a separator.
    assert sum(len(targets) for _, targets in lines.datasets["train"]) == symbols + len(SENTENCES)

    stream = _files_only(path=path, text_format="ptb_char")
    assert stream.unit == "stream"
    assert stream.datasets["train"].streams.numel() == symbols + len(SENTENCES)  # one newline a sentence

    # The override reads the file as it is: twice the tokens, the separator and `_` among them.
    raw = _files_only(path=path, text_format="plain")
    assert raw.datasets["train"].streams.numel() == len(PTB_CHAR)
    assert "_" in raw.vocab


@pytest.mark.parametrize("unit", ["line", "stream"])
def test_registry_download_and_data_path_give_identical_tensors(
    tmp_path: Path, write: Callable[..., str], unit: str
) -> None:
    texts = {"train": PTB_CHAR, "valid": _ptb_char(_sentences(12, seed=1)), "test": _ptb_char(_sentences(12, seed=2))}
    # The registry's ptb_char cache as left by an earlier verified download: the unpacked members and their
    # recorded SHA-256, which fetch_dataset uses without fetching the archive.
    folder = tmp_path / "cache" / "ptb_char"
    folder.mkdir(parents=True)
    for name, text in texts.items():
        (folder / f"ptb.char.{name}.txt").write_text(text, encoding="utf-8")
    digests = {f"ptb.char.{name}.txt": hashlib.sha256(text.encode()).hexdigest() for name, text in texts.items()}
    (folder / MANIFEST).write_text(json.dumps(digests), encoding="utf-8")

    options = {"unit": unit, "batch_size": 2, "window_length": 9}
    registry = TextCorpus(dataset="ptb_char", cache_dir=str(tmp_path / "cache"), **options)  # type: ignore[arg-type]
    paths = {f"{split}_path": write(f"own/{name}.txt", texts[name]) for split, name in
             (("train", "train"), ("val", "valid"), ("test", "test"))}  # fmt: skip
    own = TextCorpus(**paths, text_format="ptb_char", **options)  # type: ignore[arg-type]

    assert registry.text_format == own.text_format == "ptb_char"
    assert registry.vocab == own.vocab
    for split in ("train", "val", "test"):
        ours, theirs = own.datasets[split], registry.datasets[split]
        assert len(ours) == len(theirs) > 0
        for mine, reference in zip(ours, theirs, strict=True):
            for a, b in zip(mine[:2], reference[:2], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_ptb_char_text_read_as_plain_is_refused_with_the_flags_that_fix_it(write: Callable[..., str]) -> None:
    path = write("ptb.char.train.txt", PTB_CHAR)
    with pytest.raises(DataError) as caught:
        _ = _files_only(path=path).vocab
    message = str(caught.value)
    assert message.startswith(f"--data.path {path}: expected plain text, got what looks like PTB-char")
    assert "--data.text_format ptb_char" in message and "--data.text_format plain" in message

    # Each file is checked under its own flag: a PTB-char validation file beside a plain training file.
    prose = write("prose.txt", PROSE * 5)
    with pytest.raises(DataError, match=r"^--data\.val_path .*ptb\.char\.train\.txt: expected plain text"):
        _ = TextCorpus(train_path=prose, val_path=path, test_fraction=0.0, batch_size=1).vocab


def test_prose_is_read_as_plain_text_and_refused_as_ptb_char(write: Callable[..., str]) -> None:
    path = write("prose.txt", PROSE)
    corpus = _files_only(path=path)  # one line of single letters among longer ones is still prose
    assert corpus.text_format == "plain"
    assert corpus.datasets["train"].streams.numel() == len(PROSE)
    with pytest.raises(DataError, match=r"^--data\.path .*prose\.txt: expected PTB-char text .* got 3 of the 4 lines"):
        _ = _files_only(path=path, text_format="ptb_char").vocab


def test_bad_text_format_values_are_named() -> None:
    with pytest.raises(DataError, match=r"--data\.text_format 'ptb': choose one of plain, ptb_char"):
        TextCorpus(text_format="ptb")  # type: ignore[arg-type]
    with pytest.raises(DataError, match=r"--data\.text_format ptb_char needs a file"):
        TextCorpus(text_format="ptb_char")


def test_the_format_is_saved_and_checked_and_old_states_still_load(write: Callable[..., str]) -> None:
    ptb = _files_only(path=write("ptb.char.txt", PTB_CHAR), text_format="ptb_char")
    state = json.loads(json.dumps(ptb.state_dict()))
    assert state["text_format"] == "ptb_char"
    plain = _files_only(path=write("plain.txt", "".join(sentence + "\n" for sentence in SENTENCES)))
    with pytest.raises(DataError, match=r"read with --data\.text_format ptb_char .* pass --data\.text_format ptb_char"):
        plain.load_state_dict(state)
    del state["text_format"]  # a checkpoint written before text formats
    plain.load_state_dict(state)
    assert plain.vocab == ptb.vocab


def test_cli_fits_tests_and_generates_on_a_ptb_char_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from seqnorm.cli import main
    from seqnorm.lightning.base import DATA_STATE_KEY

    monkeypatch.chdir(tmp_path)
    path = str(tmp_path / "ptb.char.train.txt")
    Path(path).write_text(PTB_CHAR, encoding="utf-8")
    data = ["--data", "TextCorpus", "--data.path", path, "--data.batch_size", "4", "--data.window_length", "17"]
    quiet = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    model = ["--model", "LanguageModel", "--model.hidden_size", "16", "--model.embedding_dim", "8"]
    short = ["--trainer.max_steps", "3", "--trainer.limit_val_batches", "1", *quiet]
    main(["fit", *model, *data, "--data.text_format", "ptb_char", *short])
    last = run_path(0, tmp_path) / "checkpoints" / "last.ckpt"
    state = torch.load(last, weights_only=True)[DATA_STATE_KEY]
    assert state["text_format"] == "ptb_char" and "_" not in state["vocab"]["tokens"]

    # Read from a checkpoint, the file is read the same way: the saved format applies where none is named (the
    # plain-text check would stop it otherwise); a format named against the checkpoint's is refused by name.
    main(["test", *model, *data, "--data.text_format", "ptb_char", *quiet, "--ckpt_path", str(last)])
    main(["test", *model, *data, *quiet, "--ckpt_path", str(last)])
    tested = sorted((tmp_path / "lightning_logs").rglob("hparams.yaml"))  # the run's and its two tests'
    assert len(tested) == 3
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_code:
        main(["test", *model, *data, "--data.text_format", "plain", *quiet, "--ckpt_path", str(last)])
    assert exit_code.value.code == 2
    assert "--data.text_format ptb_char" in capsys.readouterr().err
    main(["generate", "--ckpt_path", str(last), "--prompt", "the cat", "--length", "20", "--seed", "0"])
    assert "_" not in capsys.readouterr().out


def test_a_ptb_char_checkpoint_is_tested_on_a_new_file_with_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``seqnorm test --ckpt_path C --data.test_path F`` stopped at "--data.text_format ptb_char needs a file
    (--data.path or --data.train_path)": the checkpoint carries the vocabulary, the test file is the file."""
    from seqnorm.cli import main

    (tmp_path / "ptb.char.train.txt").write_text(PTB_CHAR, encoding="utf-8")
    (tmp_path / "ptb.char.test.txt").write_text(_ptb_char(_sentences(12, seed=2)), encoding="utf-8")
    quiet = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    fit = ["fit", "--model", "LanguageModel", "--data", "TextCorpus", "--data.path", "ptb.char.train.txt"]
    fit += ["--data.text_format", "ptb_char", "--model.hidden_size", "16", "--model.embedding_dim", "8"]
    fit += ["--data.batch_size", "4", "--data.window_length", "17", "--trainer.max_steps", "2", *quiet]
    fit += ["--trainer.limit_val_batches", "1"]
    monkeypatch.chdir(tmp_path)
    main(fit)  # in this process; the test below in a fresh one, with the checkpoint and the file only
    last = str(run_path(0, tmp_path).relative_to(tmp_path) / "checkpoints" / "last.ckpt")
    tested = _seqnorm(tmp_path, "test", "--ckpt_path", last, "--data.test_path", "ptb.char.test.txt", *quiet)
    assert tested.returncode == 0, tested.stderr
    assert "test/bpc" in tested.stdout + tested.stderr


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A character LM trained (two steps) on plain English: its folder and its last.ckpt, relative to it."""
    from seqnorm.cli import main
    from tests.conftest import QUIET, write_story

    folder = tmp_path_factory.mktemp("plain")
    write_story(folder / "story.txt", lines=200)
    model = ["--model", "LanguageModel", "--model.hidden_size", "16", "--model.embedding_dim", "8"]
    data = ["--data", "TextCorpus", "--data.path", str(folder / "story.txt"), "--data.batch_size", "4"]
    root = ["--trainer.default_root_dir", str(folder), "--trainer.limit_val_batches", "1"]
    main(["fit", *model, *data, *QUIET, *root, "--trainer.max_steps", "2", "--data.window_length", "17"])
    return folder, str(run_path(0, folder).relative_to(folder) / "checkpoints" / "last.ckpt")


def _seqnorm(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The ``seqnorm`` command in a process of its own, in ``folder``, as a user runs it."""
    from seqnorm.cli.threads import THREADS_ENV

    environment = {**os.environ, THREADS_ENV: "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    command = [sys.executable, "-m", "seqnorm.cli", *args]
    return subprocess.run(command, cwd=folder, env=environment, capture_output=True, text=True, timeout=300)


QUIET_TEST = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def test_a_plain_checkpoint_tested_on_a_spaced_character_file_is_refused_as_at_fit(
    plain_run: tuple[Path, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A char LM trained on plain text scored 7.87 bpc on a PTB-char file, silently: a checkpoint's "plain" read the
    file unchecked, where fit refuses it. The user's own --data.text_format plain still reads it as it is."""
    from seqnorm.cli import main
    from tests.conftest import cli_usage_error

    folder, last = plain_run
    monkeypatch.chdir(folder)
    (folder / "spaced.txt").write_text(PTB_CHAR, encoding="utf-8")
    test = ["test", "--ckpt_path", last, "--data.test_path", "spaced.txt", *QUIET_TEST]
    refused = cli_usage_error(capsys, test)  # exit code 2, no traceback
    assert "--data.test_path spaced.txt: expected plain text, got what looks like PTB-char text" in refused
    main([*test, "--data.text_format", "plain"])  # runs


def test_a_test_file_mostly_outside_the_vocabulary_is_said_with_its_rate(plain_run: tuple[Path, str]) -> None:
    folder, last = plain_run
    (folder / "greek.txt").write_text("η γάτα κάθεται στο χαλί\n" * 40, encoding="utf-8")
    tested = _seqnorm(folder, "test", "--ckpt_path", last, "--data.test_path", "greek.txt", *QUIET_TEST)
    assert tested.returncode == 0, tested.stderr
    rate = re.search(r"TextCorpus: ([\d.]+)% of the tokens of --data.test_path greek.txt \(\d+ of \d+\)", tested.stderr)
    assert rate is not None and float(rate.group(1)) > 50, tested.stderr
    assert "not in the checkpoint's vocabulary and are read as <unk>" in tested.stderr
    (folder / "english.txt").write_text((folder / "story.txt").read_text(encoding="utf-8")[:2000], encoding="utf-8")
    quiet = _seqnorm(folder, "test", "--ckpt_path", last, "--data.test_path", "english.txt", *QUIET_TEST)
    assert quiet.returncode == 0 and "vocabulary" not in quiet.stderr


def test_generate_says_which_prompt_characters_the_vocabulary_lacks(plain_run: tuple[Path, str]) -> None:
    folder, last = plain_run
    generated = _seqnorm(folder, "generate", "--ckpt_path", last, "--prompt", "the ωcat", "--length", "5")
    assert generated.returncode == 0, generated.stderr
    # one line (it was Python's warning from torch's no_grad wrapper, file:line, and that wrapper's source line)
    said = "the prompt's characters 'ω' are not in the model's vocabulary and are fed as <unk>"
    assert f"seqnorm generate: warning: generate_text: {said}\n" in generated.stderr
    assert "_contextlib" not in generated.stderr
