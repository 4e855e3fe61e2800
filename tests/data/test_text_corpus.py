"""TextCorpus: units, levels, splits, batches, laziness, checkpoint state."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import seqnorm.data.text as text_module
from seqnorm.data import DataError, TextCorpus, synthetic_lines

LINES = [f"line {i}" + " ab" * (i % 7) for i in range(40)]


def _decode(corpus: TextCorpus, ids: torch.Tensor) -> list[str]:
    return corpus.vocab.decode(ids)


def test_char_lines_split_contiguously_train_first(write: Callable[..., str]) -> None:
    corpus = TextCorpus(unit="line", path=write("c.txt", "\n".join(LINES) + "\n"), batch_size=4)
    sizes = {split: len(dataset) for split, dataset in corpus.datasets.items()}
    assert sizes == {"train": 32, "val": 4, "test": 4}
    inputs, targets = corpus.datasets["train"][0]
    assert _decode(corpus, inputs) == ["<bos>", *LINES[0]]
    assert _decode(corpus, targets) == [*LINES[0], "<eos>"]
    assert _decode(corpus, corpus.datasets["val"][0][1])[:-1] == list(LINES[32])
    assert _decode(corpus, corpus.datasets["test"][-1][1])[:-1] == list(LINES[39])
    assert corpus.level == "char" and corpus.unit == "line"


def test_batches_have_targets_shifted_from_inputs(write: Callable[..., str]) -> None:
    corpus = TextCorpus(unit="line", path=write("c.txt", "\n".join(LINES)), batch_size=5)
    for batch in corpus.train_dataloader():
        assert batch["inputs"].shape == batch["targets"].shape
        for row, length in enumerate(batch["lengths"].tolist()):
            assert batch["inputs"][row, 0] == corpus.vocab.bos_index
            assert batch["targets"][row, length - 1] == corpus.vocab.eos_index
            assert torch.equal(batch["inputs"][row, 1:length], batch["targets"][row, : length - 1])
            assert (batch["targets"][row, length:] == corpus.pad_index).all()


def test_vocabulary_comes_from_the_training_split_only(write: Callable[..., str]) -> None:
    train = write("train.txt", "abc\ncab\n")
    val = write("val.txt", "abz\n")
    corpus = TextCorpus(unit="line", train_path=train, val_path=val, test_fraction=0.0, batch_size=1)
    assert "z" not in corpus.vocab
    _, targets = corpus.datasets["val"][0]
    assert targets.tolist()[2] == corpus.vocab.unk_index
    assert len(corpus.datasets["test"]) == 0


def test_word_level_lines(write: Callable[..., str]) -> None:
    path = write("w.txt", "the cat sat\n\n  the dog  \nthe cat ran\n")
    corpus = TextCorpus(unit="line", path=path, level="word", val_fraction=0.0, test_fraction=0.0, batch_size=1)
    assert corpus.vocab.tokens[4:] == ["the", "cat", "dog", "ran", "sat"]
    inputs, targets = corpus.datasets["train"][1]
    assert _decode(corpus, inputs) == ["<bos>", "the", "dog"]
    assert _decode(corpus, targets) == ["the", "dog", "<eos>"]
    assert len(corpus.datasets["train"]) == 3


def test_char_windows_cover_the_stream(write: Callable[..., str]) -> None:
    text = "".join(LINES[i] + "\n" for i in range(10))
    corpus = TextCorpus(path=write("c.txt", text), unit="window", window_length=16, val_fraction=0.0,
                        test_fraction=0.0, batch_size=2)  # fmt: skip
    dataset = corpus.datasets["train"]
    assert all(length == 15 for length in dataset.lengths[:-1])
    assert 1 <= dataset.lengths[-1] <= 15
    joined = "".join(token for i in range(len(dataset)) for token in _decode(corpus, dataset[i][1]))
    assert joined == text[1:]
    assert _decode(corpus, dataset[0][0]) == list(text[:15])


def test_word_windows_mark_line_ends(write: Callable[..., str]) -> None:
    corpus = TextCorpus(path=write("w.txt", "a b c\nd e\n"), level="word", unit="window", window_length=4,
                        val_fraction=0.0, test_fraction=0.0, batch_size=1)  # fmt: skip
    stream = [token for i in range(len(corpus.datasets["train"])) for token in
              _decode(corpus, corpus.datasets["train"][i][1])]  # fmt: skip
    assert stream == ["b", "c", "<eos>", "d", "e", "<eos>"]


@pytest.mark.parametrize("level", ["char", "word"])
def test_a_carved_split_of_one_token_is_refused(write: Callable[..., str], level: str) -> None:
    # carved, announced ("1 for val"), then empty: a run without validation, said only by Lightning's zero-length
    # loader warning
    text = "hello world\r\nsecond line here\r\nthird\r\n" if level == "word" else "abcdefghijklmnopqrst"
    corpus = TextCorpus(path=write("t.txt", text), level=level, unit="window", window_length=3, batch_size=1,
                        val_fraction=0.05, test_fraction=0.0)  # fmt: skip
    with pytest.raises(DataError, match=r"the val split has fewer than 2 tokens, .*raise --data\.val_fraction"):
        corpus.setup()


def test_paragraph_and_sentence_units(write: Callable[..., str]) -> None:
    text = "One. Two!\nStill two?\n\n\nThree\nlines here.\n"
    paragraphs = TextCorpus(path=write("p.txt", text), unit="paragraph", val_fraction=0.0, test_fraction=0.0,
                            batch_size=1)  # fmt: skip
    first = "".join(_decode(paragraphs, paragraphs.datasets["train"][0][1])[:-1])
    assert first == "One. Two!\nStill two?"
    assert len(paragraphs.datasets["train"]) == 2
    sentences = TextCorpus(path=write("s.txt", text), unit="sentence", level="word", val_fraction=0.0,
                           test_fraction=0.0, batch_size=1)  # fmt: skip
    got = [" ".join(_decode(sentences, target)[:-1]) for _, target in sentences.datasets["train"]]
    assert got == ["One.", "Two!", "Still two?", "Three lines here."]


def test_long_units_are_cut_to_window_length(write: Callable[..., str]) -> None:
    corpus = TextCorpus(unit="line", path=write("l.txt", "x" * 50 + "\nshort\n"), window_length=8, val_fraction=0.0,
                        test_fraction=0.0, batch_size=1)  # fmt: skip
    lengths = corpus.datasets["train"].lengths
    assert max(lengths) == 7
    assert sum(lengths) == (50 + 1) + (5 + 1)  # every target of both units exactly once


def test_batch_size_one(write: Callable[..., str]) -> None:
    corpus = TextCorpus(unit="line", path=write("c.txt", "\n".join(LINES)), batch_size=1)
    batches = list(corpus.train_dataloader())
    assert len(batches) == len(corpus.datasets["train"])
    assert all(batch["inputs"].shape[0] == 1 and batch["lengths"].shape == (1,) for batch in batches)
    unbucketed = TextCorpus(unit="line", path=write("c.txt", "\n".join(LINES)), batch_size=1, bucket=False)
    assert len(list(unbucketed.val_dataloader())) == len(unbucketed.datasets["val"])


def test_predict_keeps_file_order(write: Callable[..., str]) -> None:
    corpus = TextCorpus(unit="line", path=write("c.txt", "\n".join(LINES)), batch_size=3)
    rows = [row[:length] for batch in corpus.predict_dataloader()
            for row, length in zip(batch["targets"], batch["lengths"].tolist(), strict=True)]  # fmt: skip
    assert ["".join(_decode(corpus, row)[:-1]) for row in rows] == LINES[36:]


def test_vocab_size_is_available_right_after_construction_and_read_once(
    write: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real_read = text_module.read_text
    monkeypatch.setattr(text_module, "read_text", lambda *args: calls.append(args[0]) or real_read(*args))
    corpus = TextCorpus(
        unit="line", path=write("c.txt", "abc\nabd\n"), val_fraction=0.0, test_fraction=0.0, batch_size=1
    )
    assert calls == []  # nothing is read at construction
    assert corpus.vocab_size == 4 + 4
    corpus.setup("fit")
    corpus.train_dataloader()
    assert len(calls) == 1
    assert corpus.pad_index == 0


def test_state_dict_round_trip_reproduces_the_mapping(write: Callable[..., str]) -> None:
    original = TextCorpus(unit="line", path=write("a.txt", "hello world\nhello there\n"), val_fraction=0.0,
                          test_fraction=0.0, batch_size=1)  # fmt: skip
    state = json.loads(json.dumps(original.state_dict()))
    # Another corpus whose own vocabulary would order characters differently.
    restored = TextCorpus(
        unit="line", path=write("b.txt", "zzz world\n"), val_fraction=0.0, test_fraction=0.0, batch_size=1
    )
    assert restored.vocab != original.vocab
    restored.load_state_dict(state)
    assert restored.vocab == original.vocab
    inputs, _ = restored.datasets["train"][0]
    assert inputs.tolist() == [2, *original.vocab.encode("zzz world")]
    assert inputs.tolist()[1] == original.vocab.unk_index


def test_load_state_dict_rejects_another_level(write: Callable[..., str]) -> None:
    words = TextCorpus(
        unit="line", path=write("a.txt", "a b\n"), level="word", val_fraction=0.0, test_fraction=0.0, batch_size=1
    )
    chars = TextCorpus(unit="line", path=write("a.txt", "a b\n"), val_fraction=0.0, test_fraction=0.0, batch_size=1)
    with pytest.raises(DataError, match=r"--data\.level word"):
        chars.load_state_dict(words.state_dict())


def test_embedded_task_works_offline() -> None:
    corpus = TextCorpus(batch_size=8)
    assert corpus.source == "the embedded synthetic task"
    assert corpus.vocab_size == 20  # 8 letters, 8 brackets, 4 specials
    batch = next(iter(corpus.train_dataloader()))
    assert batch["inputs"].shape[0] == 8
    assert TextCorpus(batch_size=8, seed=0).vocab == corpus.vocab


@pytest.mark.filterwarnings("ignore:You passed in a `val_dataloader` but have no `validation_step`")
def test_lightning_saves_the_vocabulary_in_checkpoints(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    corpus = TextCorpus(batch_size=16)

    class Tiny(pl.LightningModule):
        def __init__(self, vocab_size: int) -> None:
            super().__init__()
            self.embedding = torch.nn.Embedding(vocab_size, 8)
            self.head = torch.nn.Linear(8, vocab_size)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            logits = self.head(self.embedding(batch["inputs"]))
            return torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["targets"], ignore_index=0)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(max_epochs=2, limit_train_batches=3, limit_val_batches=0, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(Tiny(corpus.vocab_size), datamodule=corpus)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert checkpoint["TextCorpus"]["vocab"] == corpus.vocab.to_dict()
    assert trainer.train_dataloader.batch_sampler.epoch == 1  # Lightning advanced the bucket sampler's epoch

    # Resuming on text whose own vocabulary differs (same size, other frequency order) restores the saved mapping.
    swapped = {"(": ")", ")": "(", "a": "h", "h": "a"}
    text = "\n".join(line.translate(str.maketrans(swapped)) for line in synthetic_lines(400, seed=9))
    resumed_corpus = TextCorpus(unit="line", path=str(tmp_path / "other.txt"), batch_size=16)
    (tmp_path / "other.txt").write_text(text)
    assert resumed_corpus.vocab != corpus.vocab and resumed_corpus.vocab_size == corpus.vocab_size
    resumed = pl.Trainer(max_epochs=3, limit_train_batches=3, limit_val_batches=0, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    resumed.fit(Tiny(corpus.vocab_size), datamodule=resumed_corpus, ckpt_path=tmp_path / "last.ckpt")
    assert resumed_corpus.vocab == corpus.vocab


def test_a_character_lm_on_a_text_file_reads_it_as_streams_by_default(write) -> None:  # type: ignore[no-untyped-def]
    # The char-rnn setup is what a character-LM user expects of a plain file; other sources keep their units.
    path = write("c.txt", "\n".join(LINES) + "\n")
    assert TextCorpus(path=path).unit == "stream"
    assert TextCorpus(train_path=path).unit == "stream"
    assert TextCorpus(path=path, level="word").unit == "line"
    assert TextCorpus().unit == "line"  # the embedded task: one sequence per line
    assert TextCorpus(path=path, unit="line").unit == "line"
    batch = next(iter(TextCorpus(path=path, batch_size=2, window_length=9).train_dataloader()))
    assert int(batch["window"]) == 0 and tuple(batch["inputs"].shape) == (2, 8)
