"""Per-timestep batch normalization synchronized across processes: :func:`convert_sync_batchnorm`.

Under data parallelism (DDP) each process holds a share of the batch. Normalizing with the statistics of that share
alone is BatchNorm at a smaller batch — the regime where it suffers — and lets the running statistics drift apart
across processes. A synchronized norm gathers every process's active-row counts, batch size and per-step means and
variances over its active rows, and merges them as Chan et al.'s parallel variance (no sum of squares is differenced,
so float32 keeps the variance of inputs whose mean is large next to their spread): one collective per call (the input
term's: one for all steps at once; each process contributes its row of a zero block, so the message grows with the
number of processes), whose autograd backward all-reduces the gradients of the gathered moments, so the backward is
exact, as :class:`torch.nn.SyncBatchNorm`'s. Statistics, the small-batch rule (global rows), running statistics and
:func:`~seqnorm.update_bn`'s population moments are then those of the global batch, identical on every process.

Every process must make the same collectives in the same order. So a synchronized norm declares no fast form (its
layer runs the reference path on every process, whatever a process's own data or hooks), and a layer holding one pads
its input to the longest sequence of any process before running (steps without an active row on a process still take
part). Without an initialized process group, or with one process, nothing is communicated and the numbers are those
of the unsynchronized norm. Cost per training step of an LSTM layer with ``norm="batch"`` and ``T <= max_steps``
steps: ``2T + 2`` collectives forward (one finds the longest input) and ``2T + 1`` backward (GRU: ``T + 2`` and
``T + 1``), each of a few kilobytes per process: latency-bound.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from seqnorm.norms.batch import TimestepBatchNorm
from seqnorm.norms.batch_pieces import masked_moments
from seqnorm.norms.renorm import TimestepBatchRenorm
from seqnorm.norms.sequence import SequenceBatchNorm, SequenceBatchRenorm

__all__ = [
    "SyncSequenceBatchNorm",
    "SyncSequenceBatchRenorm",
    "SyncTimestepBatchNorm",
    "SyncTimestepBatchRenorm",
    "convert_sync_batchnorm",
    "local_statistics",
    "revert_sync_batchnorm",
    "synchronized_steps",
]


class _AllReduce(torch.autograd.Function):
    """Sum over the processes of a group. Every process's loss depends on the sum, so the gradient of the total
    loss with respect to one process's term is the sum of every process's gradient of the sum: the same all-reduce."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any) -> Tensor:
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


def _all_reduce(tensor: Tensor, group: Any) -> Tensor:
    """Sum over the processes of ``group`` (``None``: the default group), differentiable."""
    return _AllReduce.apply(tensor, group if group is not None else dist.group.WORLD)


class _Synchronized:
    """Batch moments over every process of ``process_group`` (``None``: the default group)."""

    # No fast form: every process runs the reference path, so all make the same collectives in the same order.
    fast_forms: ClassVar[frozenset[str]] = frozenset()
    process_group: Any = None
    local_only = False  # set by local_statistics()
    training: bool

    @property
    def synchronizing(self) -> bool:
        """Whether calls communicate: an initialized process group of more than one process, not switched off by
        :func:`local_statistics`."""
        if self.local_only or not (dist.is_available() and dist.is_initialized()):
            return False
        return dist.get_world_size(self.process_group) > 1

    @property
    def whole_sequence(self) -> bool:
        # While synchronizing, the reference loop normalizes an input term for all steps at once (the cell's
        # sequence_input_norm): one collective for the whole sequence instead of one per step, on every process.
        return self.synchronizing or getattr(super(), "whole_sequence", False)

    @property
    def fused_update(self) -> bool:
        # torch's fused kernel forms local statistics: never while synchronizing.
        return not self.synchronizing and super().fused_update  # type: ignore[misc]

    def _batch_moments(
        self, x: Tensor, mask: Tensor | None, counts: list[int]
    ) -> tuple[Tensor, Tensor, list[int], Tensor, int]:
        if not self.synchronizing:
            return super()._batch_moments(x, mask, counts)  # type: ignore[misc]
        steps, batch, features = x.shape
        # Each process's own moments, gathered: a process fills its row of a zero (world, ...) block and one
        # differentiable all-reduce sums the blocks. They are then merged as Chan et al.'s parallel variance
        # (within-process squared deviations plus those of the process means from the global mean), so no sum of
        # squares is ever differenced: float32 keeps the variance of inputs whose mean is large next to their spread.
        local_mean, local_var = masked_moments(x, mask, self._divisors(counts, x), dim=1)
        local_counts = torch.tensor([*counts, batch], dtype=x.dtype, device=x.device)
        row = torch.cat([local_mean.flatten(), local_var.flatten(), local_counts])
        world = dist.get_world_size(self.process_group)
        block = row.new_zeros(world, row.numel()).index_copy(0, self._rank_index(row.device), row.unsqueeze(0))
        gathered = _all_reduce(block, self.process_group)
        size = steps * features
        means = gathered[:, :size].view(world, steps, 1, features)
        variances = gathered[:, size : 2 * size].view(world, steps, 1, features)
        process_counts = gathered[:, 2 * size : 2 * size + steps].view(world, steps, 1, 1)
        totals = gathered[:, 2 * size :].sum(0).tolist()
        *global_counts, global_batch = (round(value) for value in totals)
        active = self._divisors(global_counts, x)
        mean = (process_counts * means).sum(0) / active
        var = (process_counts * (variances + (means - mean).square())).sum(0) / active
        return mean, var, global_counts, active, global_batch

    def _rank_index(self, device: torch.device) -> Tensor:
        return torch.tensor([dist.get_rank(self.process_group)], device=device)


class SyncTimestepBatchNorm(_Synchronized, TimestepBatchNorm):
    """:class:`~seqnorm.norms.TimestepBatchNorm` with statistics over every process (module docstring)."""


class SyncTimestepBatchRenorm(_Synchronized, TimestepBatchRenorm):
    """:class:`~seqnorm.norms.TimestepBatchRenorm` with statistics over every process."""


class SyncSequenceBatchNorm(_Synchronized, SequenceBatchNorm):
    """:class:`~seqnorm.norms.SequenceBatchNorm` with statistics over every process."""


class SyncSequenceBatchRenorm(_Synchronized, SequenceBatchRenorm):
    """:class:`~seqnorm.norms.SequenceBatchRenorm` with statistics over every process."""


_SYNCHRONIZED: dict[type, type] = {
    TimestepBatchNorm: SyncTimestepBatchNorm,
    TimestepBatchRenorm: SyncTimestepBatchRenorm,
    SequenceBatchNorm: SyncSequenceBatchNorm,
    SequenceBatchRenorm: SyncSequenceBatchRenorm,
}


def convert_sync_batchnorm(module: nn.Module, process_group: Any = None) -> nn.Module:
    """Synchronize every seqnorm batch norm in ``module`` across ``process_group``; returns ``module``.

    The counterpart of :meth:`torch.nn.SyncBatchNorm.convert_sync_batchnorm` for per-timestep BN, batch renorm and
    the sequence-wise input BN (weight norm's mean-only BN included). The norms are converted in place (same
    parameters, buffers and hooks; references to them stay valid), so a ``state_dict`` is unchanged and loads into
    either form. Converting twice only sets the group. ``torch.nn`` BatchNorm modules are left to torch's own
    conversion.

    Args:
        module: any module holding seqnorm layers or cells.
        process_group: the group to synchronize over; ``None``: the default (all processes).

    Raises:
        ValueError: for a subclass of a seqnorm batch norm, whose statistics this cannot know how to synchronize.
    """
    for norm in module.modules():
        if isinstance(norm, _Synchronized):
            norm.process_group = process_group
            continue
        if not isinstance(norm, TimestepBatchNorm):
            continue
        synchronized = _SYNCHRONIZED.get(type(norm))
        if synchronized is None:
            known = ", ".join(cls.__name__ for cls in _SYNCHRONIZED)
            raise ValueError(
                f"convert_sync_batchnorm: expected seqnorm's own batch norms ({known}), got a subclass "
                f"{type(norm).__name__}; synchronize it by subclassing seqnorm.norms.sync's classes"
            )
        norm.__class__ = synchronized
        norm.process_group = process_group
    return module


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Undo :func:`convert_sync_batchnorm` in place (the norms compute local statistics again); returns ``module``."""
    unsynchronized = {synchronized: plain for plain, synchronized in _SYNCHRONIZED.items()}
    for norm in module.modules():
        plain = unsynchronized.get(type(norm))
        if plain is not None:
            norm.__class__ = plain
            del norm.process_group
    return module


@contextmanager
def local_statistics(module: nn.Module) -> Iterator[None]:
    """Within the block, the synchronized norms of ``module`` use this process's statistics only: for a computation
    one process makes alone (a diagnostic on rank 0), where a collective would wait for the others forever."""
    norms = [m for m in module.modules() if isinstance(m, _Synchronized)]
    previous = [norm.local_only for norm in norms]
    for norm in norms:
        norm.local_only = True
    try:
        yield
    finally:
        for norm, value in zip(norms, previous, strict=True):
            norm.local_only = value


def synchronized_steps(module: nn.Module, steps: int, device: torch.device) -> int | None:
    """The most steps (``steps`` here) any process runs ``module`` for, or ``None`` if ``module`` holds no norm that
    synchronizes now (in training, with several processes): every process must run as many steps as the longest, so
    its norms make the same collectives."""
    if not (dist.is_available() and dist.is_initialized()):
        return None  # the common case, on every forward: no walk over the modules
    norms = [m for m in module.modules() if isinstance(m, _Synchronized) and m.training and m.synchronizing]
    if not norms:
        return None
    longest = torch.tensor([steps], device=device)
    group = norms[0].process_group
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group if group is not None else dist.group.WORLD)
    return int(longest)
