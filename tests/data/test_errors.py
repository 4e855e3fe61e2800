"""Every data problem raises DataError, when first detectable, naming the file (or file:line) or the flag."""

from __future__ import annotations

import os
import pathlib
import re
from collections.abc import Callable
from typing import Any

import pytest

from seqnorm.data import DataError, LabeledText, TextCorpus


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"batch_size": 0}, "--data.batch_size"),
        ({"window_length": 1}, "--data.window_length"),
        ({"val_fraction": -0.1}, "--data.val_fraction"),
        ({"test_fraction": 1.0}, "--data.test_fraction"),
        ({"val_fraction": 0.5, "test_fraction": 0.5}, "--data.val_fraction"),
        ({"min_freq": 0}, "--data.min_freq"),
        ({"max_vocab_size": 4}, "--data.max_vocab_size"),
        ({"num_workers": -1}, "--data.num_workers"),
        ({"encoding": "no-such-codec"}, "--data.encoding"),
        ({"encoding": "rot13"}, "--data.encoding 'rot13' is not a text encoding"),  # a codec, not bytes -> text
        ({"level": "byte"}, "--data.level"),
        ({"unit": "page"}, "--data.unit"),
        ({"path": "a.txt", "train_path": "b.txt"}, "--data.train_path"),
        ({"dataset": "ptb_char", "path": "a.txt"}, "--data.dataset"),
    ],
)
def test_text_corpus_checks_arguments_in_the_constructor(kwargs: dict[str, Any], flag: str) -> None:
    with pytest.raises(DataError, match=re.escape(flag)):
        TextCorpus(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"batch_size": 0}, "--data.batch_size"),
        ({"val_fraction": 1.0}, "--data.val_fraction"),
        ({"max_length": 0}, "--data.max_length"),
        ({"max_vocab_size": 2}, "--data.max_vocab_size"),
        ({"format": "csv"}, "--data.format"),
        ({"level": "byte"}, "--data.level"),
    ],
)
def test_labeled_text_checks_arguments_in_the_constructor(kwargs: dict[str, Any], flag: str) -> None:
    with pytest.raises(DataError, match=re.escape(flag)):
        LabeledText(**kwargs)


def test_files_to_evaluate_without_a_training_file_need_a_checkpoints_vocabulary(
    write: Callable[..., str],
) -> None:
    """Refused when first read, not when made: evaluating a checkpoint, its vocabulary (and labels) is loaded in
    between (``seqnorm test --ckpt_path X --data.test_path new.txt``), and then the files alone are the data."""
    text = write("t.txt", "the cat sat\non the mat\n" * 20)
    with pytest.raises(DataError, match=re.escape("--data.val_path / --data.test_path need --data.train_path")):
        _ = TextCorpus(test_path=text, unit="line").vocab_size
    trained = TextCorpus(path=text, unit="line", batch_size=2)
    evaluated = TextCorpus(test_path=text, unit="line", batch_size=2)
    evaluated.load_state_dict(trained.state_dict())
    assert len(evaluated.datasets["test"]) == 40 and len(evaluated.datasets["train"]) == 0  # nothing carved
    tsv = write("t.tsv", "pets\tthe cat\nother\tthe mat\n" * 4)
    with pytest.raises(DataError, match=re.escape("--data.predict_path need --data.train_path")):
        _ = LabeledText(test_path=tsv).num_classes
    labeled = LabeledText(predict_path=tsv, batch_size=2)  # no test_path either: not the embedded task
    labeled.load_state_dict(LabeledText(train_path=tsv, val_fraction=0.0, batch_size=2).state_dict())
    assert labeled.labels == ["other", "pets"] and len(labeled.datasets["train"]) == 0


def test_unknown_dataset_lists_the_choices() -> None:
    with pytest.raises(DataError) as caught:
        TextCorpus(dataset="ptb")
    assert "--data.dataset 'ptb'" in str(caught.value)
    for name in ("ptb_char", "ptb_word", "wikitext2", "tiny_shakespeare", "text8"):
        assert name in str(caught.value)


def test_missing_file_is_reported_at_first_read(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nope.txt"
    corpus = TextCorpus(unit="line", path=str(missing))  # constructing reads nothing
    with pytest.raises(DataError, match=rf"{missing}: no such file \(given as --data.path\)"):
        _ = corpus.vocab_size


def test_missing_val_file_names_its_flag(write: Callable[..., str], tmp_path: pathlib.Path) -> None:
    corpus = TextCorpus(unit="line", train_path=write("t.txt", "abc\n"), val_path=str(tmp_path / "v.txt"))
    with pytest.raises(DataError, match=r"v\.txt: no such file \(given as --data.val_path\)"):
        _ = corpus.vocab


def test_empty_file(write: Callable[..., str]) -> None:
    path = write("empty.txt", "  \n\n")
    with pytest.raises(DataError, match=rf"{path}: the file is empty"):
        _ = TextCorpus(unit="line", path=path).vocab_size


def test_directory(tmp_path: pathlib.Path) -> None:
    with pytest.raises(DataError, match=rf"{tmp_path}: is a directory"):
        _ = LabeledText(train_path=str(tmp_path)).num_classes


def test_unreadable_file(write: Callable[..., str], monkeypatch: pytest.MonkeyPatch) -> None:
    path = write("secret.txt", "abc\n")
    if os.geteuid() != 0:  # root reads anything, so then the permission error is simulated below
        os.chmod(path, 0)
    real_read_bytes = pathlib.Path.read_bytes

    def deny(self: pathlib.Path) -> bytes:
        if str(self) == path:
            raise PermissionError(13, "Permission denied")
        return real_read_bytes(self)

    monkeypatch.setattr(pathlib.Path, "read_bytes", deny)
    with pytest.raises(DataError, match=rf"{path}: cannot be read: permission denied"):
        _ = TextCorpus(unit="line", path=path).vocab_size


def test_invalid_utf8_names_the_byte_offset(write: Callable[..., str]) -> None:
    path = write("latin.txt", "caf\u00e9 ol\u00e9\n".encode("latin-1"))  # é is byte 0xE9 at offset 3
    with pytest.raises(DataError) as caught:
        _ = TextCorpus(unit="line", path=path, batch_size=1).vocab_size
    message = str(caught.value)
    assert message.startswith(f"{path}: not valid UTF-8 at byte 3: pass --data.encoding")
    corpus = TextCorpus(unit="line", path=path, encoding="latin-1", val_fraction=0.0, test_fraction=0.0, batch_size=1)
    assert "\u00e9" in corpus.vocab


@pytest.mark.parametrize(
    ("content", "fmt", "expected"),
    [
        ("pos\tgood\nno tab here\n", "tsv", r":2: no label"),
        ("pos\tgood\n\tno label\n", "tsv", r":2: no label"),
        ("pos\tgood\n\nneg\t   \n", "tsv", r":3: label 'neg' has no text"),
        ("pos good\nneg\n", "first_token", r":2: label 'neg' has no text"),
    ],
)
def test_labeled_lines_without_label_or_text(write: Callable[..., str], content: str, fmt: str, expected: str) -> None:
    path = write("data.tsv", content)
    with pytest.raises(DataError, match=rf"{path}{expected}"):
        _ = LabeledText(train_path=path, format=fmt, val_fraction=0.0, batch_size=1).num_classes  # type: ignore[arg-type]


def test_corpus_too_small_for_one_batch(write: Callable[..., str]) -> None:
    path = write("small.txt", "one\ntwo\nthree\n")
    with pytest.raises(DataError) as caught:
        _ = TextCorpus(unit="line", path=path, val_fraction=0.0, test_fraction=0.0, batch_size=8).vocab_size
    assert "has 3 sequences" in str(caught.value) and "--data.batch_size is 8" in str(caught.value)
    with pytest.raises(DataError, match=r"has 3 examples but --data\.batch_size is 4"):
        _ = LabeledText(train_path=write("s.tsv", "a\tx\nb\ty\na\tz\n"), val_fraction=0.0, batch_size=4).labels


def test_corpus_too_small_to_carve_splits(write: Callable[..., str]) -> None:
    with pytest.raises(DataError, match="only 2 units"):
        _ = TextCorpus(unit="line", path=write("two.txt", "a\nb\n"), batch_size=1).vocab_size
