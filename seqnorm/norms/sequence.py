"""Sequence-wise batch normalization: statistics over batch × time (Cooijmans et al.'s BN-e*, Deep Speech 2).

One row of statistics for a whole sequence batch, taken over all its real ``(t, b)`` positions — far less noisy than
per-timestep statistics at small batch sizes, but it needs the whole sequence at once, so the cells use it for the
input term only (``input_stats="sequence"``).
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from seqnorm.norms.batch import TimestepBatchNorm
from seqnorm.norms.renorm import TimestepBatchRenorm

__all__ = ["SequenceBatchNorm", "SequenceBatchRenorm"]


class _OverTime:
    """Statistics over batch × time: a sequence batch is one batch of its real positions (one row of buffers)."""

    whole_sequence = True  # a cell cannot form these statistics one step at a time in training
    indexed_by_step = False  # one row of statistics for every step
    owner: str
    training: bool

    def forward(self, x: Tensor, step: int = 0, mask: Tensor | None = None) -> Tensor:
        """One step ``x`` ``(B, F)`` in evaluation, with the one row of running statistics (``step`` is ignored);
        in training a ``ValueError``: statistics over batch × time need :meth:`forward_sequence`."""
        if self.training:
            raise ValueError(
                f"{self.owner}: expected a whole sequence for input_stats='sequence' in training (its statistics "
                "are over batch × time), got one step; run the cell inside seqnorm.LSTM/GRU or call "
                "cell.input_terms(x) on the whole (T, B, input_size) sequence"
            )
        return super().forward(x, 0, mask)  # type: ignore[misc]

    def forward_step(self, x: Tensor, step: int = 0, mask: Tensor | None = None) -> Tensor:
        return self.forward(x, step, mask)

    def forward_sequence(self, x: Tensor, mask: Tensor | None = None, counts: list[int] | None = None) -> Tensor:
        steps, batch, features = x.shape
        total = steps * batch if mask is None else (int(mask.sum()) if counts is None else sum(counts))
        flat_mask = None if mask is None else mask.reshape(1, steps * batch)
        # One "step" of T*B rows: every base-class rule (masking, small batches, renorm's r/d) applies unchanged.
        flat = super().forward_sequence(x.reshape(1, steps * batch, features), flat_mask, [total])  # type: ignore[misc]
        return flat.view(steps, batch, features)


class SequenceBatchNorm(_OverTime, TimestepBatchNorm):
    """Sequence-wise batch normalization (Cooijmans et al.'s BN-e*, Deep Speech 2): moments over all real positions.

    Normalizes a whole ``(T, B, F)`` sequence with the mean and variance over its real ``(t, b)`` positions
    (:meth:`forward_sequence`); one row of running statistics serves every step in evaluation. Training needs the
    whole sequence, so a one-step call in training is a ``ValueError``; in evaluation one step works (streaming).
    Arguments as :class:`TimestepBatchNorm` (``max_steps`` is 1).
    """

    # Its statistics need the whole sequence: only the hoisted loop's forward_sequence, no per-step fast form.
    fast_forms: ClassVar[frozenset[str]] = frozenset({"loop"})

    def __init__(self, num_features: int, **kwargs: object) -> None:
        super().__init__(num_features, 1, **kwargs)  # type: ignore[arg-type]


class SequenceBatchRenorm(_OverTime, TimestepBatchRenorm):
    """:class:`SequenceBatchNorm` with Ioffe's r/d correction (arguments as :class:`TimestepBatchRenorm`)."""

    fast_forms: ClassVar[frozenset[str]] = frozenset({"loop"})  # as SequenceBatchNorm's

    def __init__(self, num_features: int, **kwargs: object) -> None:
        super().__init__(num_features, 1, **kwargs)  # type: ignore[arg-type]
