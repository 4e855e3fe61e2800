"""``LabeledText``: a LightningDataModule for sequence classification from labelled lines."""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader, Dataset

from seqnorm.data.base import SequenceDataModule, check_at_least, check_fraction
from seqnorm.data.collate import ClassificationDataset, collate_classification
from seqnorm.data.errors import DataError
from seqnorm.data.files import read_text
from seqnorm.data.synthetic import synthetic_labeled
from seqnorm.data.vocab import Vocabulary, tokenize

__all__ = ["NO_LABEL", "SYNTHETIC_CLASSIFICATION_SIZES", "Example", "LabeledText", "parse_labeled"]

SYNTHETIC_CLASSIFICATION_SIZES = {"train": 2000, "test": 500}
"""Examples of the embedded bracket task (validation is carved from train) when no ``train_path`` is given."""


@dataclass(frozen=True)
class Example:
    """One labelled line and where it came from (for error messages)."""

    label: str
    text: str
    origin: str


def parse_labeled(text: str, path: str, fmt: Literal["tsv", "first_token"], flag: str) -> list[Example]:
    """Parse ``label<TAB>text`` (``tsv``) or ``label text...`` (``first_token``) lines; blank lines are skipped.

    Raises:
        DataError: naming ``path:line`` for a line without a label or without text.
    """
    examples = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        if fmt == "tsv":
            if "\t" not in line:
                raise DataError(
                    f"{where}: no label: --data.format tsv expects 'label<TAB>text' but the line has no tab "
                    f"(given as {flag}); pass --data.format first_token for 'label text' lines"
                )
            label, body = line.split("\t", 1)
        else:
            parts = line.split(None, 1)  # the first whitespace-separated token (a tab too), as words split
            label, body = parts[0], parts[1] if len(parts) > 1 else ""
        label, body = label.strip(), body.strip()
        if not label:
            raise DataError(f"{where}: no label before the text (given as {flag}): every line needs one")
        if not body:
            raise DataError(f"{where}: label {label!r} has no text after it (given as {flag})")
        examples.append(Example(label, body, where))
    return examples


NO_LABEL = -1
"""The label id of a text to be labelled (``predict_path``): no class."""


class LabeledText(SequenceDataModule):
    """Classification batches from labelled text files, or from the embedded bracket-nesting task.

    Each non-blank line is one example, ``label<TAB>text`` (``format="tsv"``) or ``label text...``
    (``format="first_token"``). The label ids are the sorted label strings of the training file; the vocabulary
    comes from the training split only. Both are saved in checkpoints (:meth:`state_dict`). Nothing is read until
    first needed: :attr:`vocab_size` and :attr:`num_classes` work right after construction (LightningCLI links
    them to the model on instantiation).

    Args:
        train_path: the training file. ``None``: the embedded task (see :func:`synthetic_labeled`), whose symbols
            are space-separated so both levels work.
        val_path: the validation file. ``None``: a seeded random ``val_fraction`` of the training file (printed
            once, with the sizes).
        test_path: the test file (also what ``predict`` labels without ``predict_path``). ``None``: no test split
            (the embedded task has one).
        predict_path: texts to label, one per non-blank line and without labels: what ``predict`` reads when
            given (the model's vocabulary applies; tokens outside it become ``<unk>``). ``val_path``, ``test_path``
            and ``predict_path`` without a ``train_path`` are read only with the vocabulary and labels of a
            checkpoint (``seqnorm predict --ckpt_path X --data.predict_path new.txt``); the embedded task is used
            when no file at all is given.
        val_fraction: share of the training examples held out when there is no ``val_path``.
        format: ``"tsv"`` (``label<TAB>text``) or ``"first_token"`` (``label text...``): how a line splits.
        level: ``"word"`` or ``"char"`` tokens.
        encoding: the text encoding of the files.
        batch_size: sequences per batch (1 or more).
        bucket: batch sequences of similar length together to reduce padding.
        min_freq: tokens seen fewer times in training map to ``<unk>``.
        max_vocab_size: the largest vocabulary, specials included; ``None`` for no limit.
        max_length: keep only the first ``max_length`` tokens of each text; ``None`` keeps all.
        seed: seeds the validation split, the embedded task and the batch order.
        num_workers: DataLoader worker processes.

    Batches are dicts: ``inputs`` ``(B, T)`` int64 padded with :attr:`pad_index`, ``lengths`` ``(B,)`` int64 and
    ``labels`` ``(B,)`` int64.

    Example:
        >>> data = LabeledText(batch_size=8)  # the embedded task, offline
        >>> data.num_classes, data.labels
        (2, ['invalid', 'valid'])
    """

    _collate = staticmethod(collate_classification)

    def __init__(
        self,
        train_path: str | None = None,
        val_path: str | None = None,
        test_path: str | None = None,
        predict_path: str | None = None,
        val_fraction: float = 0.1,
        format: Literal["tsv", "first_token"] = "tsv",
        level: Literal["word", "char"] = "word",
        encoding: str = "utf-8",
        batch_size: int = 32,
        bucket: bool = True,
        min_freq: int = 1,
        max_vocab_size: int | None = None,
        max_length: int | None = None,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, bucket, encoding, seed, num_workers)
        self.save_hyperparameters()
        check_fraction("val_fraction", val_fraction)
        check_at_least("min_freq", min_freq, 1)
        check_at_least("max_length", max_length, 1)
        check_at_least("max_vocab_size", max_vocab_size, 3)  # <pad>, <unk> and at least one token
        if format not in ("tsv", "first_token"):
            raise DataError(f"--data.format {format!r}: choose tsv or first_token")
        if level not in ("word", "char"):
            raise DataError(f"--data.level {level!r}: choose word or char")
        self.paths = {"train": train_path, "val": val_path, "test": test_path}
        self.predict_path = predict_path
        self.val_fraction = val_fraction
        self.format = format
        self.level: Literal["word", "char"] = level
        self.min_freq = min_freq
        self.max_vocab_size = max_vocab_size
        self.max_length = max_length
        self._examples: dict[str, list[Example]] | None = None
        self._labels: list[str] | None = None

    @property
    def labels(self) -> list[str]:
        """The class names; class id ``i`` is ``labels[i]``."""
        self.datasets  # noqa: B018 - building sets self._labels
        assert self._labels is not None
        return list(self._labels)

    @property
    def num_classes(self) -> int:
        """Number of classes (the classifier's output size)."""
        return len(self.labels)

    def _source_paths(self) -> list[str | None]:
        # the texts to label last: `predict --ckpt_path X --data.predict_path new.txt` is a run on new.txt
        return [*super()._source_paths(), self.predict_path]

    @property
    def _evaluation_only(self) -> bool:
        """Files to evaluate or label without a training file: read with a checkpoint's vocabulary and labels."""
        return self.paths["train"] is None and (any(self.paths.values()) or self.predict_path is not None)

    def _read(self) -> dict[str, list[Example]]:
        if self.paths["train"] is None and not self._evaluation_only:
            sizes = SYNTHETIC_CLASSIFICATION_SIZES
            return {
                split: [
                    Example(label, text, f"synthetic {split} example {number}")
                    for number, (label, text) in enumerate(
                        synthetic_labeled(sizes[split], self.seed + offset, separator=" ")
                    )
                ]
                for split, offset in (("train", 0), ("test", 1))
            } | {"val": []}
        examples: dict[str, list[Example]] = {}
        for split, path in self.paths.items():
            flag = f"--data.{split}_path"
            text = read_text(path, self.encoding, flag) if path is not None else None
            examples[split] = parse_labeled(text, path, self.format, flag) if text is not None else []
        return examples

    def _load_examples(self) -> dict[str, list[Example]]:
        if self._evaluation_only and (self._labels is None or self._vocab is None):
            raise DataError(
                "--data.val_path / --data.test_path / --data.predict_path need --data.train_path (the training file, "
                "from which the vocabulary and labels are built), unless a checkpoint supplies them (seqnorm "
                "validate|test|predict --ckpt_path)"
            )
        examples = self._read()
        if self._labels is None:
            # From the whole training file, so a rare label that falls into the held-out part still has an id.
            self._labels = sorted({example.label for example in examples["train"]})
            if len(self._labels) == 1:
                warnings.warn(
                    f"LabeledText: every training example has the label {self._labels[0]!r}: the classifier can "
                    "only ever predict it",
                    stacklevel=2,
                )
        if self.paths["val"] is None and self.val_fraction > 0 and not self._evaluation_only:
            train = examples["train"]
            order = list(range(len(train)))
            random.Random(self.seed).shuffle(order)
            n_val = max(1, round(len(train) * self.val_fraction))
            if n_val >= len(train):
                raise DataError(
                    f"{self.paths['train'] or 'the embedded task'}: {len(train)} examples are too few to hold out "
                    f"--data.val_fraction {self.val_fraction} and keep a training split; lower it or add data"
                )
            held_out = set(order[:n_val])
            # Both parts keep file order, so the split depends on the seed only, not on how it was shuffled.
            examples["val"] = [example for i, example in enumerate(train) if i in held_out]
            examples["train"] = [example for i, example in enumerate(train) if i not in held_out]
            source = f"--data.train_path {self.paths['train']}" if self.paths["train"] else "the embedded task"
            rank_zero_info(
                f"LabeledText: held out {n_val} of the {len(train)} examples of {source} for validation (--data."
                f"val_fraction {self.val_fraction}, drawn with --data.seed {self.seed}); {len(train) - n_val} left for "
                "training"
            )
        return examples

    def _tokens(self, text: str) -> list[str]:
        tokens = tokenize(text, self.level)
        return tokens[: self.max_length] if self.max_length is not None else tokens

    def _build(self) -> dict[str, Dataset]:
        if self._examples is None:
            self._examples = self._load_examples()
        assert self._labels is not None
        if self._vocab is None:
            train_tokens = (self._tokens(example.text) for example in self._examples["train"])
            self._vocab = Vocabulary.build(train_tokens, self.min_freq, self.max_vocab_size, bos_eos=False)
        label_ids = {label: index for index, label in enumerate(self._labels)}
        datasets = {}
        for split, examples in self._examples.items():
            sequences, labels = [], []
            for example in examples:
                if example.label not in label_ids:
                    raise DataError(
                        f"{example.origin}: label {example.label!r} does not occur in the training file "
                        f"(its labels: {', '.join(self._labels)}): fix the label or add training examples of it"
                    )
                sequences.append(torch.tensor(self._vocab.encode(self._tokens(example.text)), dtype=torch.int64))
                labels.append(label_ids[example.label])
            datasets[split] = ClassificationDataset(sequences, labels)
        if len(datasets["train"]) < self.batch_size and not self._evaluation_only:
            source = self.paths["train"] or "the embedded task"
            raise DataError(
                f"{source}: the training split has {len(datasets['train'])} examples but --data.batch_size is "
                f"{self.batch_size}: lower --data.batch_size or add examples"
            )
        return datasets

    def predict_dataloader(self) -> DataLoader:
        """``predict_path``'s texts in file order (each non-blank line one example, without a label), or without
        it the test split's, as for any DataModule."""
        if self.predict_path is None:
            return super().predict_dataloader()
        texts = [
            line.strip() for line in read_text(self.predict_path, self.encoding, "--data.predict_path").split("\n")
        ]
        texts = [text for text in texts if text]  # not empty: read_text refuses a blank file
        sequences = [torch.tensor(self.vocab.encode(self._tokens(text)), dtype=torch.int64) for text in texts]
        return DataLoader(
            ClassificationDataset(sequences, [NO_LABEL] * len(sequences)),
            batch_size=self.batch_size,
            shuffle=False,
            collate_fn=partial(collate_classification, pad_index=self.pad_index),
            num_workers=self.num_workers,
        )

    def state_dict(self) -> dict[str, Any]:
        """The vocabulary and the label names, saved in checkpoints so a resumed run keeps the same ids."""
        return {
            "vocab": self.vocab.to_dict(),
            "labels": self.labels,
            "level": self.level,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the vocabulary and labels of :meth:`state_dict`; the data is re-encoded on next use."""
        labels = state_dict.get("labels") if isinstance(state_dict, dict) else None
        if not isinstance(labels, list) or not labels:
            raise DataError("LabeledText: the checkpoint's datamodule state has no 'labels' list")
        self._check_level(state_dict)
        self._set_vocab(state_dict)
        self._labels = [str(label) for label in labels]
