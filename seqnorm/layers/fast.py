"""The fast paths of :class:`~seqnorm.layers.base.RecurrentLayer`, beside its plain per-step reference loop.

Which path runs is decided in one place, :func:`choose_path`:

- ``"reference"``: the plain loop, one :meth:`~seqnorm.cells.base.RecurrentCell.step_unchecked` per step, exactly as
  written in the cells. Chosen with ``impl="reference"``, whenever an observer is hooked to a cell (it needs each
  step's record), and when a per-timestep batch norm is about to raise its small-batch error (so the error and what
  was updated before it are the reference's own).
- ``"fused"``: torch's own LSTM/GRU kernel (``torch._VF.lstm``/``gru``, variable lengths through packing) when no cell
  normalizes anything (``norm="none"``, or ``"weight"`` whose ``g * v / ||v||`` is computed once per call) and no
  regularizer draws random numbers (training with ``dropout`` between layers, ``recurrent_dropout``,
  ``input_dropout``, ``weight_dropout`` or zoneout): torch would draw different masks than the reference (or
  none), and results must not depend on the path. Nor under ``torch.autocast``, where torch's CPU LSTM kernel
  fails in bfloat16.
- ``"fast"``: everything that does not depend on the recurrence is done for all time steps at once — the input
  projection ``W_ih x`` is one matmul, its norm one vectorized call (LayerNorm per position; per-timestep batch
  statistics over the ``(T, B)`` grid with the padding masked out; :meth:`forward_sequence` of the norms), the
  biases are folded in — and the loop runs a lean :meth:`~seqnorm.cells.base.RecurrentCell.recurrent_step` over
  ``unbind`` of the precomputed terms (never ``x[t]``, whose backward writes a full-size gradient at every step).
  Every regularizer runs here exactly as in the reference: the per-sequence masks come from the same
  :func:`~seqnorm.layers.dropout.draw_sequence_masks` call at the same point, and zoneout is drawn per step by the
  cell's ``recurrent_step`` in the order its ``step_unchecked`` draws it. When a gradient is wanted and
  :func:`seqnorm.layers.bptt.supports` accepts the cell (LayerNorm, RMSNorm, per-timestep BatchNorm or nothing on the
  recurrence; no zoneout, recurrent dropout or projection), the loop is instead one autograd Function with a
  hand-written backward through time (:mod:`seqnorm.layers.bptt`), which also runs an input BatchNorm/RMSNorm step by
  step.

:meth:`RecurrentLayer.step` without gradients runs the lean step of :mod:`seqnorm.layers.stepping` (each cell's step
prepared once from its parameters and cached); otherwise :func:`step_cell`.

All three give the same outputs, states, gradients and running statistics up to floating-point rounding; the
``tests/test_fast_path.py`` suite compares them for every cell and norm.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from seqnorm.cells.base import RecurrentCell
from seqnorm.layers import bptt
from seqnorm.layers.dropout import draw_sequence_masks
from seqnorm.layers.stack import PaddingLayout, padding_layout, run_stack
from seqnorm.norms import TimestepBatchNorm

if TYPE_CHECKING:
    from seqnorm.layers.base import RecurrentLayer

__all__ = ["Impl", "Path", "choose_path", "run_fast", "run_fused", "step_cell"]

Impl = Literal["auto", "reference"]
Path = Literal["reference", "fused", "fast"]
IMPLS: tuple[str, ...] = ("auto", "reference")


def choose_path(layer: RecurrentLayer, lengths: Tensor | None, batch: int) -> Path:
    """The path :meth:`RecurrentLayer.forward` takes for this call (see the module docstring)."""
    cells: list[RecurrentCell] = list(layer.cells)
    if layer.impl == "reference" or any(cell.observer.active for cell in cells):
        return "reference"
    if layer.training and _would_raise_small_batch(cells, lengths, batch):
        return "reference"
    # Under autocast the fused kernels are out too: on CPU, oneDNN has no bfloat16 LSTM primitive for torch's call.
    autocast = torch.is_autocast_enabled(cells[0].weight_ih.device.type)
    if _is_plain(cells) and not _draws_random(layer) and not autocast:
        return "fused"
    return "fast"


def _draws_random(layer: RecurrentLayer) -> bool:
    """Whether a call draws random numbers, which torch's kernel would draw differently (or not at all)."""
    if not layer.training:
        return False
    per_sequence = layer.recurrent_dropout or layer.input_dropout or layer.weight_dropout
    return bool(per_sequence or (layer.dropout and layer.num_layers > 1) or any(c.draws_random for c in layer.cells))


def _would_raise_small_batch(cells: list[RecurrentCell], lengths: Tensor | None, batch: int) -> bool:
    strict = any(
        isinstance(module, TimestepBatchNorm) and module.small_batch == "error"
        for cell in cells
        for module in cell.modules()
    )
    if not strict:
        return False
    # The fewest real rows at any step that runs: the rows as long as the longest sequence.
    fewest = batch if lengths is None else int((lengths == lengths.max()).sum())
    return fewest < 2


def _is_plain(cells: list[RecurrentCell]) -> bool:
    return not any(cell.has_norms for cell in cells)


# --- torch's fused kernel ---


def run_fused(
    layer: RecurrentLayer, x: Tensor, h0: Tensor, c0: Tensor | None, lengths: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``torch._VF.lstm``/``gru`` over ``x`` ``(T, B, I)``; variable lengths go through a ``PackedSequence``."""
    weights: list[Tensor] = []
    for cell in layer.cells:
        weights += [cell.weight_ih, cell.weight_hh]  # weight norm: computed once here
        if layer.bias:
            weights += [cell.bias_ih, cell.bias_hh]
        if cell.weight_hr is not None:
            weights.append(cell.weight_hr)  # torch tells projections from h_0 and c_0 of different sizes
    kernel = torch._VF.lstm if c0 is not None else torch._VF.gru
    hx: Any = (h0, c0) if c0 is not None else h0
    flags = (layer.bias, layer.num_layers, 0.0, layer.training, layer.bidirectional)
    if lengths is None or int(lengths.min()) == x.shape[0]:
        result = kernel(x, hx, weights, *flags, False)
        return result[0], result[1], (result[2] if c0 is not None else None)
    packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
    order, unorder = packed.sorted_indices, packed.unsorted_indices
    hx = (h0.index_select(1, order), c0.index_select(1, order)) if c0 is not None else h0.index_select(1, order)
    result = kernel(packed.data, packed.batch_sizes, hx, weights, *flags)
    output, _ = pad_packed_sequence(
        PackedSequence(result[0], packed.batch_sizes, order, unorder), total_length=x.shape[0]
    )
    h_n = result[1].index_select(1, unorder)
    return output, h_n, (result[2].index_select(1, unorder) if c0 is not None else None)


# --- hoisted input terms and a lean loop ---


def run_fast(
    layer: RecurrentLayer, x: Tensor, h0: Tensor, c0: Tensor | None, lengths: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The same computation as the reference loop, with the input side of every step done at once per direction."""
    layout = padding_layout(lengths, x.shape[0], x.shape[1], x.device)
    return run_stack(layer, x, h0, c0, layout, partial(_run_direction, layer))


def _run_direction(
    layer: RecurrentLayer, cell: RecurrentCell, sequence: Tensor, state: Any, layout: PaddingLayout
) -> tuple[Tensor, Any]:
    # Drawn at the same point of the random stream as the reference loop draws them.
    dropped = draw_sequence_masks(layer, cell, sequence, state)
    if dropped.input is not None:
        sequence = sequence * dropped.input
    if bptt.supports(cell, sequence, state, dropped.recurrent):
        return bptt.run_recurrence(cell, sequence, state, dropped.weight_hh, layout)
    terms = cell.input_terms(sequence, layout.active, layout.counts)  # (T, B, G*H)
    # Weight norm (and DropConnect): computed once per sequence, not once per step.
    weight_hh_t = (cell.weight_hh if dropped.weight_hh is None else dropped.weight_hh).t()
    outputs = []
    for step, (term, mask) in enumerate(zip(terms.unbind(0), layout.masks, strict=True)):
        # Zoneout is drawn inside recurrent_step, at the point of the stream where step_unchecked draws it.
        state = cell.recurrent_step(term, state, step, mask, dropped.recurrent, weight_hh_t)
        outputs.append(state if isinstance(state, Tensor) else state[0])
    return torch.stack(outputs), state


# --- one step (generation) ---


def step_cell(
    layer: RecurrentLayer, cell: RecurrentCell, x: Tensor, h: Tensor, c: Tensor | None, step: int
) -> tuple[Tensor, Tensor | None]:
    """One step of ``cell`` for :meth:`RecurrentLayer.step` on states ``(1, B, .)``; returns the new ``h``, ``c``.

    ``x`` is ``(B, I)`` or ``(1, B, I)``. Without gradients, :meth:`RecurrentLayer.step` runs the lean step of
    :mod:`seqnorm.layers.stepping` instead, where it applies.
    """
    x = x if x.dim() == 2 else x[0]
    state = h[0] if c is None else (h[0], c[0])
    # torch's cell kernels have no projection and no zoneout.
    autocast = torch.is_autocast_enabled(x.device.type)
    special = cell.observer.active or cell.draws_random or cell.weight_hr is not None or autocast
    if layer.impl == "reference" or special or not _is_plain([cell]):
        state = cell.step_unchecked(x, state, step, None)
    elif cell.has_cell_state:
        state = torch._VF.lstm_cell(x, state, cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)
    else:
        state = torch._VF.gru_cell(x, state, cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)
    if isinstance(state, Tensor):
        return state.unsqueeze(0), None
    return state[0].unsqueeze(0), state[1].unsqueeze(0)
