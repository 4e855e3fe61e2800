"""LightningCLI parses the DataModules' signatures and links sizes read right after construction."""

from __future__ import annotations

import sys
from collections.abc import Callable

import lightning.pytorch as pl
import pytest
from lightning.pytorch.cli import LightningCLI

from seqnorm.data import LabeledText, TextCorpus


@pytest.fixture(autouse=True)
def _no_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # LightningCLI warns when pytest's own arguments sit in sys.argv beside `args`.
    monkeypatch.setattr(sys, "argv", ["seqnorm"])


class SizedModel(pl.LightningModule):
    """Records the sizes the CLI links into it."""

    def __init__(self, vocab_size: int = 0, pad_index: int = -1, num_classes: int = 0) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.pad_index = pad_index
        self.num_classes = num_classes


class _LanguageModelCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:  # type: ignore[no-untyped-def]
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.pad_index", "model.pad_index", apply_on="instantiate")


class _ClassifierCLI(_LanguageModelCLI):
    def add_arguments_to_parser(self, parser) -> None:  # type: ignore[no-untyped-def]
        super().add_arguments_to_parser(parser)
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")


@pytest.mark.parametrize("extra", [[], ["--data.level", "word", "--data.unit", "window"]])
def test_text_corpus_sizes_link_into_the_model(write: Callable[..., str], extra: list[str]) -> None:
    path = write("corpus.txt", "".join(f"line {i} of text\n" for i in range(20)))
    args = ["--data.path", path, "--data.batch_size", "1", *extra]
    cli = _LanguageModelCLI(SizedModel, TextCorpus, run=False, args=args, trainer_defaults={"logger": False})
    assert cli.model.vocab_size == cli.datamodule.vocab_size > 4
    assert cli.model.pad_index == 0


def test_labeled_text_sizes_link_into_the_model(write: Callable[..., str]) -> None:
    path = write("train.tsv", "a\tsome text\nb\tmore text\nc\tthird one\n")
    args = ["--data.train_path", path, "--data.val_fraction", "0", "--data.batch_size", "1"]
    cli = _ClassifierCLI(SizedModel, LabeledText, run=False, args=args, trainer_defaults={"logger": False})
    assert cli.model.num_classes == 3
    assert cli.model.vocab_size == cli.datamodule.vocab_size == 2 + 5


def test_invalid_flag_value_is_reported_by_the_parser() -> None:
    with pytest.raises(SystemExit):
        _LanguageModelCLI(SizedModel, TextCorpus, run=False, args=["--data.unit", "page"])
