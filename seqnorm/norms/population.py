"""Exact population statistics for per-timestep batch normalization: :func:`update_bn`.

The running moments that per-timestep BN evaluates with are exponential moving averages of training batches. After
few updates they still hold much of their initial ``(0, 1)`` (``0.9^k`` of it after ``k`` batches with momentum 0.1),
and they average the statistics of weights that kept changing. :func:`update_bn` replaces them by the exact moments of
the current model's activations over a loader — "precise BN" (Wu & Johnson 2021), with the signature and calling
convention of :func:`torch.optim.swa_utils.update_bn`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from seqnorm.norms.batch import TimestepBatchNorm

__all__ = ["update_bn"]


def _first(batch: Any) -> Any:
    # torch's convention: a list/tuple batch gives its first element. A PackedSequence is a tuple too, but it is the
    # input itself.
    if isinstance(batch, (list, tuple)) and not isinstance(batch, PackedSequence):
        return batch[0]
    return batch


@torch.no_grad()
def update_bn(
    loader: Iterable[Any],
    model: nn.Module,
    device: torch.device | str | None = None,
    *,
    forward: Callable[[nn.Module, Any], Any] | None = None,
) -> None:
    """Recompute the running statistics of every per-timestep batch norm in ``model`` exactly over ``loader``.

    Each batch of ``loader``, or its first element if it is a list or tuple (a ``PackedSequence`` is passed whole),
    is moved to ``device`` (if given) and passed to ``model(...)`` in training mode, without gradients. Every
    :class:`~seqnorm.norms.TimestepBatchNorm` in ``model`` (batch renorm, sequence-wise BN and weight norm's mean-only
    BN included) then holds, for each time step, the mean and unbiased variance of its inputs over all the active
    rows that reached that step in the whole loader — padding excluded, every row weighted alike whatever the size of
    its batch (not an average of per-batch moments). Steps beyond ``max_steps`` pool into the last row (the norm's
    ``beyond_max_steps="last"``) or are not recorded (``"pooled"``), as in training.

    What is left alone: parameters; ``num_batches_tracked`` (it counts training batches, which batch renorm's schedule
    and the pooled moments read); the running moments of a step that fewer than 2 rows reached (the loader says
    nothing about it); and the train/eval mode of every module, restored as it was. Other modules run in training mode
    as in :func:`torch.optim.swa_utils.update_bn` (dropout included). During the pass no step raises the small-batch
    error: a step with one active row is normalized with its running statistics and its row still counts.

    Args:
        loader: any iterable of batches (a ``DataLoader``, a list).
        model: a module holding seqnorm batch norms; nothing happens if it holds none.
        device: where each batch is moved (``batch.to(device)``) before the call; ``None`` leaves it.
        forward: ``forward(model, batch)`` instead of ``model(first element)`` (a dict batch, or a model taking
            ``lengths``: ``forward=lambda m, b: m(b["inputs"], b["lengths"])``).

    Raises:
        ValueError: if ``loader`` yields no batch (nothing to compute the statistics from).

    Example:
        >>> import torch, seqnorm
        >>> lstm = seqnorm.LSTM(3, 8, norm="batch")
        >>> loader = [torch.randn(5, 4, 3) for _ in range(3)]  # (T, B, I) batches
        >>> seqnorm.update_bn(loader, lstm)
        >>> lstm.cells[0].norm_ih.running_mean.shape  # one row per time step
        torch.Size([100, 32])
    """
    norms = [module for module in model.modules() if isinstance(module, TimestepBatchNorm)]
    if not norms:
        return
    modes = {module: module.training for module in model.modules()}
    for norm in norms:
        norm.collect_population()
    try:
        model.train()
        seen = 0
        for batch in loader:
            if forward is not None:
                forward(model, batch if device is None else _to(batch, device))
            else:
                inputs = _first(batch)
                model(inputs if device is None else inputs.to(device))
            seen += 1
        if not seen:
            raise ValueError("update_bn: expected a loader with at least one batch, got an empty one")
        for norm in norms:
            norm.apply_population()
    finally:
        for norm in norms:
            norm.discard_population()
        for module, training in modes.items():
            module.training = training


def _to(batch: Any, device: torch.device | str) -> Any:
    """``batch`` on ``device``: tensors and PackedSequences moved, dicts, lists and tuples mapped."""
    if isinstance(batch, (torch.Tensor, PackedSequence)):
        return batch.to(device)
    if isinstance(batch, dict):
        return {key: _to(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(value, device) for value in batch)
    return batch
