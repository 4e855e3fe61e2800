"""Datasets of token-id sequences and the collate functions that pad them into batches.

Batches are dicts of CPU tensors, padded on the right with ``pad_index`` (batch first):

* language modelling: ``{"inputs": (B, T) int64, "targets": (B, T) int64, "lengths": (B,) int64}``; targets are
  padded with ``pad_index`` too, so ``cross_entropy(..., ignore_index=pad_index)`` skips padding;
* classification: ``{"inputs": (B, T) int64, "lengths": (B,) int64, "labels": (B,) int64}``.

``lengths`` holds each row's number of real positions; ``T`` is the longest in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

__all__ = [
    "ClassificationDataset",
    "LanguageModelingDataset",
    "chunk_sequence",
    "collate_classification",
    "collate_lm",
]


def chunk_sequence(ids: torch.Tensor, window_length: int) -> list[torch.Tensor]:
    """Cut a 1-D id sequence into windows of at most ``window_length`` ids that overlap by one.

    The overlap makes the last target of one window the first input of the next, so every position after the
    first is predicted exactly once. A final window shorter than two ids (nothing to predict) is dropped. The
    windows are views of ``ids``; no memory is copied.
    """
    stride = window_length - 1
    return [ids[start : start + window_length] for start in range(0, max(len(ids) - 1, 0), stride)]


class LanguageModelingDataset(Dataset):
    """Next-token pairs: item ``i`` is ``(sequence[:-1], sequence[1:])`` of the ``i``-th sequence.

    Args:
        sequences: 1-D int64 tensors of at least two ids each.
        units: for each sequence, the index of the text unit (line, sentence, paragraph) it was cut from, which
            ``predict`` writes beside each row (:class:`~seqnorm.lightning.prediction_writer.PredictionWriter`);
            ``None`` for windows of one stream.
    """

    def __init__(self, sequences: Sequence[torch.Tensor], units: Sequence[int] | None = None) -> None:
        self.sequences = list(sequences)
        self.lengths = [len(sequence) - 1 for sequence in self.sequences]
        if units is not None and len(units) != len(self.sequences):
            raise ValueError(f"LanguageModelingDataset: {len(self.sequences)} sequences but {len(units)} units")
        self.units = None if units is None else list(units)

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        sequence = self.sequences[index]
        return sequence[:-1], sequence[1:]


class ClassificationDataset(Dataset):
    """Labelled sequences: item ``i`` is ``(ids, label)``.

    Args:
        sequences: 1-D int64 tensors of at least one id each.
        labels: class ids, one per sequence.
    """

    def __init__(self, sequences: Sequence[torch.Tensor], labels: Sequence[int]) -> None:
        if len(sequences) != len(labels):
            raise ValueError(f"ClassificationDataset: {len(sequences)} sequences but {len(labels)} labels")
        self.sequences = list(sequences)
        self.labels = list(labels)
        self.lengths = [len(sequence) for sequence in self.sequences]

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.sequences[index], self.labels[index]


def _lengths(sequences: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([len(sequence) for sequence in sequences], dtype=torch.int64)


def collate_lm(batch: Sequence[tuple[torch.Tensor, torch.Tensor]], pad_index: int = 0) -> dict[str, torch.Tensor]:
    """Pad ``(inputs, targets)`` pairs into a language-modelling batch (see the module docstring)."""
    inputs = [pair[0] for pair in batch]
    targets = [pair[1] for pair in batch]
    return {
        "inputs": pad_sequence(inputs, batch_first=True, padding_value=pad_index),  # [B, T]
        "targets": pad_sequence(targets, batch_first=True, padding_value=pad_index),  # [B, T]
        "lengths": _lengths(inputs),  # [B]
    }


def collate_classification(batch: Sequence[tuple[torch.Tensor, int]], pad_index: int = 0) -> dict[str, torch.Tensor]:
    """Pad ``(ids, label)`` pairs into a classification batch (see the module docstring)."""
    inputs = [pair[0] for pair in batch]
    return {
        "inputs": pad_sequence(inputs, batch_first=True, padding_value=pad_index),  # [B, T]
        "lengths": _lengths(inputs),  # [B]
        "labels": torch.tensor([pair[1] for pair in batch], dtype=torch.int64),  # [B]
    }
