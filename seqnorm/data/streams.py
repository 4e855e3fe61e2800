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

Under data parallelism the streams, not the windows, are shared out (:meth:`StreamWindows.share`): process ``r`` of
``W`` reads streams ``r * B/W .. (r + 1) * B/W - 1``, every window of them, in order, so each process carries the
states of its own streams, and the ``W`` processes together read exactly the batches of one process on all ``B``
streams. Sharding the windows instead would hand a stream's consecutive windows to different processes, whose carried
states could not follow them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset

from seqnorm.data.errors import DataError

__all__ = ["StreamItem", "StreamWindows", "collate_stream", "contiguous_streams", "num_windows", "stream_window"]


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
            + (f"lower {flag} or add text" if num_streams > 1 else "add text")
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


StreamItem = tuple[Tensor, Tensor, int, int, int, int]
"""One :class:`StreamWindows` item: ``(inputs, targets, window, start, first_stream, num_streams)``."""


class StreamWindows(Dataset):
    """The consecutive windows of ``B`` contiguous streams; item ``k`` is the whole batch ``k``.

    Args:
        streams: ``(B, N)`` ids, as :func:`contiguous_streams` returns them.
        window_length: ids per window (inputs and targets are ``window_length - 1`` long; the last may be shorter).
        first_stream: the index of row 0 among all the streams of the split (:meth:`share` sets it).
        total_streams: how many streams the split has in all; ``None``: ``B`` (these are all of them).

    Item ``k``: ``(inputs, targets, k, start, first_stream, total_streams)``: ``(B, T)`` tensors, the window index,
    the stream position of the window's first input (``k * (window_length - 1)``) and which of the split's streams
    the rows are. Read them in order, one item per batch (:func:`collate_stream` unpacks a batch of one item).
    """

    def __init__(
        self, streams: Tensor, window_length: int, *, first_stream: int = 0, total_streams: int | None = None
    ) -> None:
        if streams.dim() != 2:
            raise DataError(f"StreamWindows: expected streams of shape (B, N), got {tuple(streams.shape)}")
        total = streams.shape[0] if total_streams is None else total_streams
        if not 0 <= first_stream <= total - streams.shape[0]:
            raise DataError(
                f"StreamWindows: expected {streams.shape[0]} streams from first_stream within {total}, got "
                f"first_stream {first_stream}"
            )
        self.streams = streams
        self.window_length = window_length
        self.first_stream = first_stream
        self.total_streams = total
        self.count = num_windows(streams.shape[1], window_length)

    @property
    def num_streams(self) -> int:
        """``B``, the streams this dataset reads (a process's share under :meth:`share`)."""
        return self.streams.shape[0]

    def share(self, num_replicas: int, rank: int, *, flag: str = "--data.batch_size") -> StreamWindows:
        """Process ``rank``'s streams of ``num_replicas``: the ``rank``-th of ``num_replicas`` equal blocks of rows,
        every window of them (module docstring). One process (``num_replicas=1``) reads them all.

        Raises:
            DataError: if ``B`` is not a multiple of ``num_replicas`` (the processes' batches must be equal: DDP
                averages their gradients, which equals the gradient of the whole batch only for equal shares).
        """
        if num_replicas == 1:
            return self
        if self.num_streams % num_replicas:
            lower = self.num_streams // num_replicas * num_replicas
            suggestion = " or ".join(str(n) for n in (lower, lower + num_replicas) if n > 0)
            raise DataError(
                f"{flag} {self.num_streams} with --data.unit stream: expected a multiple of the world size "
                f"{num_replicas} (--trainer.devices x --trainer.num_nodes; each process reads {flag} / {num_replicas} "
                f"of the streams), got {self.num_streams}: pass {flag} {suggestion}"
            )
        per_process = self.num_streams // num_replicas
        rows = slice(rank * per_process, (rank + 1) * per_process)
        return StreamWindows(
            self.streams[rows],
            self.window_length,
            first_stream=self.first_stream + rows.start,
            total_streams=self.total_streams,
        )

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> StreamItem:
        inputs, targets = stream_window(self.streams, index, self.window_length)
        return inputs, targets, index, index * (self.window_length - 1), self.first_stream, self.total_streams


def collate_stream(batch: Sequence[StreamItem], pad_index: int = 0) -> dict[str, Tensor]:
    """A batch of exactly one :class:`StreamWindows` item as a language-modelling batch dict.

    ``inputs``, ``targets`` ``(B, T)`` int64, ``lengths`` ``(B,)`` (all ``T``: streams are never padded), ``window``
    (0-d int64: the window's index in the epoch, 0 where every stream starts), ``start`` (0-d int64: the stream
    position of the window's first input), ``first_stream`` and ``num_streams`` (0-d int64: row ``b`` is stream
    ``first_stream + b`` of the split's ``num_streams``, all processes together). ``pad_index`` is accepted for the
    collate interface and unused.
    """
    if len(batch) != 1:
        raise DataError(f"collate_stream: expected a batch of one stream window, got {len(batch)}")
    inputs, targets, index, start, first_stream, num_streams = batch[0]
    return {
        "inputs": inputs.contiguous(),  # (B, T)
        "targets": targets.contiguous(),  # (B, T)
        "lengths": torch.full((inputs.shape[0],), inputs.shape[1], dtype=torch.int64),  # (B,)
        "window": torch.tensor(index, dtype=torch.int64),
        "start": torch.tensor(start, dtype=torch.int64),
        "first_stream": torch.tensor(first_stream, dtype=torch.int64),
        "num_streams": torch.tensor(num_streams, dtype=torch.int64),
    }
