"""Padding collate functions and window cutting."""

from __future__ import annotations

import torch

from seqnorm.data import collate_classification, collate_lm
from seqnorm.data.collate import chunk_sequence


def _pair(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    sequence = torch.tensor(ids)
    return sequence[:-1], sequence[1:]


def test_collate_lm_shapes_padding_and_lengths() -> None:
    batch = collate_lm([_pair([2, 5, 6, 3]), _pair([2, 7, 3]), _pair([2, 8, 9, 10, 11, 3])], pad_index=0)
    assert set(batch) == {"inputs", "targets", "lengths"}
    assert batch["inputs"].shape == batch["targets"].shape == (3, 5)
    assert batch["inputs"].dtype == batch["targets"].dtype == torch.int64
    assert batch["lengths"].tolist() == [3, 2, 5]
    assert batch["lengths"].dtype == torch.int64 and batch["lengths"].device.type == "cpu"
    assert batch["inputs"][1].tolist() == [2, 7, 0, 0, 0]
    assert batch["targets"][1].tolist() == [7, 3, 0, 0, 0]
    for row, length in enumerate(batch["lengths"].tolist()):
        assert (batch["inputs"][row, length:] == 0).all()
        assert (batch["targets"][row, length:] == 0).all()
        # targets are the inputs shifted by one position
        assert torch.equal(batch["inputs"][row, 1:length], batch["targets"][row, : length - 1])


def test_collate_lm_uses_the_given_pad_index() -> None:
    batch = collate_lm([_pair([1, 2, 3]), _pair([1, 2])], pad_index=7)
    assert batch["inputs"][1].tolist() == [1, 7]
    assert batch["targets"][1].tolist() == [2, 7]


def test_collate_classification() -> None:
    batch = collate_classification([(torch.tensor([4, 5]), 1), (torch.tensor([6]), 0), (torch.tensor([7, 8, 9]), 2)])
    assert set(batch) == {"inputs", "lengths", "labels"}
    assert batch["inputs"].tolist() == [[4, 5, 0], [6, 0, 0], [7, 8, 9]]
    assert batch["lengths"].tolist() == [2, 1, 3]
    assert batch["labels"].tolist() == [1, 0, 2]
    assert batch["labels"].dtype == torch.int64


def test_chunk_sequence_predicts_every_position_once() -> None:
    ids = torch.arange(20)
    chunks = chunk_sequence(ids, 6)
    assert all(2 <= len(chunk) <= 6 for chunk in chunks)
    assert torch.equal(torch.cat([chunk[1:] for chunk in chunks]), ids[1:])
    assert torch.equal(torch.cat([chunk[:-1] for chunk in chunks]), ids[:-1])
    assert chunk_sequence(torch.arange(1), 4) == []
    assert [len(c) for c in chunk_sequence(torch.arange(5), 5)] == [5]
