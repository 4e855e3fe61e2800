"""Contiguous streams for stateful truncated BPTT (the char-rnn / AWD-LSTM "batchify").

A split's token ids are cut into ``B`` equally long contiguous streams (the remainder that does not fill all of them
is dropped), stacked as rows of a ``(B, N)`` tensor, and read in consecutive windows of ``window_length`` ids:
window ``k`` of every stream is one batch, input ``window[:, :-1]`` and target ``window[:, 1:]``. Consecutive windows
overlap by one id, so row ``b`` of batch ``k + 1`` continues row ``b`` of batch ``k`` exactly where its targets
ended, and every id of a stream after its first is a target exactly once. A model that carries its final state from
batch ``k`` into batch ``k + 1`` (detached) therefore reads each stream as one long sequence, with gradients
truncated at window boundaries.

These are plain tensor functions; :class:`StreamWindows` serves them as a map-style dataset (one item = one whole
batch) for :class:`~seqnorm.data.TextCorpus` with ``unit="stream"`` and for the experiment scripts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset

from seqnorm.data.errors import DataError

__all__ = ["StreamWindows", "collate_stream", "contiguous_streams", "num_windows", "stream_window"]


def contiguous_streams(ids: Tensor, num_streams: int, *, flag: str = "--data.batch_size") -> Tensor:
    """``ids`` ``(L,)`` cut into ``num_streams`` contiguous rows of equal length ``N = L // num_streams``.

    Row ``b`` is ``ids[b * N : (b + 1) * N]``; the last ``L - num_streams * N`` ids are dropped.

    Args:
        ids: a 1-D id tensor.
        num_streams: ``B``, the number of streams (the batch size).
        flag: the CLI flag named in the error when the ids are too few.

    Returns:
        A ``(B, N)`` view of ``ids``.

    Raises:
        DataError: if a stream would hold fewer than 2 ids (nothing to predict).

    Example:
        >>> contiguous_streams(torch.arange(7), 2)
        tensor([[0, 1, 2],
                [3, 4, 5]])
    """
    if ids.dim() != 1:
        raise DataError(f"contiguous_streams: expected 1-D ids, got shape {tuple(ids.shape)}")
    if num_streams < 1:
        raise DataError(f"{flag} must be at least 1, got {num_streams}")
    length = len(ids) // num_streams
    if length < 2:
        raise DataError(
            f"{len(ids)} tokens cannot fill {num_streams} streams of at least 2 tokens ({flag} {num_streams}): "
            f"lower {flag} or add text"
        )
    return ids[: num_streams * length].view(num_streams, length)


def num_windows(stream_length: int, window_length: int) -> int:
    """Windows of ``window_length`` ids overlapping by one that cover a stream of ``stream_length`` ids.

    The last window may be shorter (at least 2 ids). Example: ``num_windows(10, 4)`` is 3 (ids 0-3, 3-6, 6-9).
    """
    if window_length < 2:
        raise DataError(f"--data.window_length must be at least 2, got {window_length}")
    return max(0, math.ceil((stream_length - 1) / (window_length - 1)))


def stream_window(streams: Tensor, index: int, window_length: int) -> tuple[Tensor, Tensor]:
    """Window ``index`` of every stream: ``(inputs, targets)``, each ``(B, T)`` with ``T <= window_length - 1``.

    Inputs are stream positions ``index * (window_length - 1) + [0, T)``, targets the positions one later.
    """
    count = num_windows(streams.shape[1], window_length)
    if not 0 <= index < count:
        raise IndexError(f"stream_window: expected a window index in [0, {count}), got {index}")
    start = index * (window_length - 1)
    window = streams[:, start : start + window_length]  # (B, T + 1)
    return window[:, :-1], window[:, 1:]


class StreamWindows(Dataset):
    """The consecutive windows of ``B`` contiguous streams; item ``k`` is the whole batch ``k``.

    Args:
        streams: ``(B, N)`` ids, as :func:`contiguous_streams` returns them.
        window_length: ids per window (inputs and targets are ``window_length - 1`` long; the last may be shorter).

    Item ``k``: ``(inputs, targets, k, start)``: ``(B, T)`` tensors, the window index and the stream position of
    the window's first input (``k * (window_length - 1)``). Read them in order, one item per batch
    (:func:`collate_stream` unpacks a batch of one item).
    """

    def __init__(self, streams: Tensor, window_length: int) -> None:
        if streams.dim() != 2:
            raise DataError(f"StreamWindows: expected streams of shape (B, N), got {tuple(streams.shape)}")
        self.streams = streams
        self.window_length = window_length
        self.count = num_windows(streams.shape[1], window_length)

    @property
    def num_streams(self) -> int:
        return self.streams.shape[0]

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, int, int]:
        inputs, targets = stream_window(self.streams, index, self.window_length)
        return inputs, targets, index, index * (self.window_length - 1)


def collate_stream(batch: Sequence[tuple[Tensor, Tensor, int, int]], pad_index: int = 0) -> dict[str, Tensor]:
    """A batch of exactly one :class:`StreamWindows` item as a language-modelling batch dict.

    ``inputs``, ``targets`` ``(B, T)`` int64, ``lengths`` ``(B,)`` (all ``T``: streams are never padded), ``window``
    (0-d int64: the window's index in the epoch, 0 where every stream starts) and ``start`` (0-d int64: the stream
    position of the window's first input). ``pad_index`` is accepted for the collate interface and unused.
    """
    if len(batch) != 1:
        raise DataError(f"collate_stream: expected a batch of one stream window, got {len(batch)}")
    inputs, targets, index, start = batch[0]
    return {
        "inputs": inputs.contiguous(),  # (B, T)
        "targets": targets.contiguous(),  # (B, T)
        "lengths": torch.full((inputs.shape[0],), inputs.shape[1], dtype=torch.int64),  # (B,)
        "window": torch.tensor(index, dtype=torch.int64),
        "start": torch.tensor(start, dtype=torch.int64),
    }
