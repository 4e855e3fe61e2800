"""LabeledText: both line formats, label ids, the seeded validation split, truncation, checkpoint state."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

import pytest
import torch

from seqnorm.data import DataError, LabeledText
from seqnorm.data.labeled import NO_LABEL

EXAMPLES = [("pos" if i % 3 else "neg", f"word{i % 5} common text {'x ' * (i % 4)}".strip()) for i in range(30)]


def _tsv(examples: list[tuple[str, str]]) -> str:
    return "".join(f"{label}\t{text}\n" for label, text in examples)


def _texts(data: LabeledText, split: str) -> list[str]:
    dataset = data.datasets[split]
    return [" ".join(data.vocab.decode(dataset[i][0])) for i in range(len(dataset))]


def test_tsv_labels_and_batches(write: Callable[..., str]) -> None:
    data = LabeledText(train_path=write("t.tsv", _tsv(EXAMPLES)), val_fraction=0.0, batch_size=4)
    assert data.labels == ["neg", "pos"] and data.num_classes == 2
    assert len(data.datasets["train"]) == 30 and len(data.datasets["test"]) == 0
    ids, label = data.datasets["train"][1]
    assert data.vocab.decode(ids) == EXAMPLES[1][1].split()
    assert data.labels[label] == EXAMPLES[1][0]
    batch = next(iter(data.train_dataloader()))
    assert set(batch) == {"inputs", "lengths", "labels"}
    assert batch["inputs"].shape[0] == batch["labels"].shape[0] == 4
    assert batch["labels"].dtype == torch.int64
    assert "<bos>" not in data.vocab and data.pad_index == 0


def test_first_token_format(write: Callable[..., str]) -> None:
    path = write("t.txt", "b the first\n\nc second one\na\tthird\n")  # any whitespace ends the label
    data = LabeledText(train_path=path, format="first_token", val_fraction=0.0, batch_size=1)
    assert data.labels == ["a", "b", "c"]
    assert _texts(data, "train") == ["the first", "second one", "third"]
    assert [data.datasets["train"][i][1] for i in range(3)] == [1, 2, 0]


def test_val_fraction_split_is_seeded_and_disjoint(write: Callable[..., str]) -> None:
    # Distinct orders of the same five words: every word is in the vocabulary, so decoded texts identify examples.
    orders = itertools.permutations("abcde")
    numbered = [(label, " ".join(next(orders))) for label, _ in EXAMPLES]
    path = write("t.tsv", _tsv(numbered))
    first = LabeledText(train_path=path, val_fraction=0.2, seed=1, batch_size=2)
    again = LabeledText(train_path=path, val_fraction=0.2, seed=1, batch_size=2)
    other = LabeledText(train_path=path, val_fraction=0.2, seed=2, batch_size=2)
    train, val = set(_texts(first, "train")), set(_texts(first, "val"))
    assert len(val) == 6 and len(train) == 24
    assert not train & val
    assert train | val == {text for _, text in numbered}
    assert _texts(again, "val") == _texts(first, "val")
    assert set(_texts(other, "val")) != val


def test_vocabulary_from_training_split_only(write: Callable[..., str]) -> None:
    data = LabeledText(train_path=write("t.tsv", "a\tknown words\nb\tmore words\n"),
                       val_path=write("v.tsv", "a\tunseen words\n"), batch_size=1)  # fmt: skip
    assert "unseen" not in data.vocab
    ids, _ = data.datasets["val"][0]
    assert ids.tolist() == [data.vocab.unk_index, data.vocab.index("words")]


def test_char_level_and_max_length(write: Callable[..., str]) -> None:
    data = LabeledText(train_path=write("t.tsv", "x\tabcdef\ny\tab\n"), level="char", max_length=3,
                       val_fraction=0.0, batch_size=1)  # fmt: skip
    assert data.datasets["train"].lengths == [3, 2]
    assert data.vocab.decode(data.datasets["train"][0][0]) == ["a", "b", "c"]


def test_label_missing_from_training_file(write: Callable[..., str]) -> None:
    data = LabeledText(train_path=write("t.tsv", "a\tx\nb\ty\n"), val_path=write("v.tsv", "a\tx\nzzz\ty\n"),
                       batch_size=1)  # fmt: skip
    with pytest.raises(DataError, match=r"v\.tsv:2: label 'zzz'"):
        _ = data.num_classes


def test_state_dict_round_trip(write: Callable[..., str]) -> None:
    original = LabeledText(train_path=write("a.tsv", _tsv(EXAMPLES)), val_fraction=0.0, batch_size=1)
    state = json.loads(json.dumps(original.state_dict()))
    # Another file whose own vocabulary and labels differ ("zebra" is new, "neg" is absent).
    restored = LabeledText(train_path=write("b.tsv", "pos\tcommon zebra\npos\ttext\n"), val_fraction=0.0,
                           batch_size=1)  # fmt: skip
    assert restored.labels == ["pos"]
    restored.load_state_dict(state)
    assert restored.vocab == original.vocab and restored.labels == ["neg", "pos"]
    ids, label = restored.datasets["train"][0]
    assert ids.tolist() == original.vocab.encode(["common", "zebra"]) and label == 1
    assert ids.tolist()[1] == original.vocab.unk_index


def test_embedded_task_works_offline() -> None:
    data = LabeledText(batch_size=8)
    assert data.labels == ["invalid", "valid"]
    assert {split: len(dataset) for split, dataset in data.datasets.items()} == {"train": 1800, "val": 200,
                                                                               "test": 500}  # fmt: skip
    batch = next(iter(data.train_dataloader()))
    assert set(batch["labels"].tolist()) <= {0, 1}


def test_predict_path_reads_unlabelled_lines_in_file_order(write: Callable[..., str]) -> None:
    train = write("t.tsv", _tsv(EXAMPLES))
    texts = ["word1 common text", "", "zebra word2", "   "]
    data = LabeledText(train_path=train, predict_path=write("new.txt", "\n".join(texts)), batch_size=2)
    batches = list(data.predict_dataloader())
    decoded = [
        data.vocab.decode(row[:length].tolist())
        for b in batches
        for row, length in zip(b["inputs"], b["lengths"], strict=True)
    ]
    assert decoded == [["word1", "common", "text"], ["<unk>", "word2"]]  # blank lines skipped; unknown words <unk>
    assert all((b["labels"] == NO_LABEL).all() for b in batches)
    with pytest.raises(DataError, match=r"blank\.txt: the file is empty \(given as --data\.predict_path\)"):
        LabeledText(train_path=train, predict_path=write("blank.txt", "\n \n")).predict_dataloader()
    with pytest.raises(DataError, match=r"--data\.predict_path"):
        LabeledText(train_path=train, predict_path="nowhere.txt").predict_dataloader()


def test_degenerate_training_data_warns(write: Callable[..., str]) -> None:
    with pytest.warns(UserWarning, match=r"every training example has the label 'pos'"):
        _ = LabeledText(
            train_path=write("one.tsv", _tsv([("pos", f"text {i}") for i in range(8)])), batch_size=2
        ).labels
    with pytest.warns(UserWarning, match=r"no token besides the special ones .*--data.min_freq 1000"):
        _ = LabeledText(train_path=write("t.tsv", _tsv(EXAMPLES)), min_freq=1000, batch_size=2).vocab


def test_a_state_of_another_level_is_refused(write: Callable[..., str]) -> None:
    # a word vocabulary read at character level made every input <unk> (test/acc of a constant input, exit 0)
    path = write("a.tsv", _tsv(EXAMPLES))
    words = LabeledText(train_path=path, val_fraction=0.0, batch_size=1)
    chars = LabeledText(train_path=path, val_fraction=0.0, batch_size=1, level="char")
    with pytest.raises(DataError, match=r"trained with --data.level word but this run has --data.level char"):
        chars.load_state_dict(words.state_dict())
