"""The fast paths of :class:`~seqnorm.layers.base.RecurrentLayer`, beside its plain per-step reference loop.

Which path runs is decided in one place, :func:`seqnorm.layers.plan.plan_for`, from what the cells and norms
declare (its module docstring lists the conditions):

- ``"torch_kernel"``: torch's own LSTM/GRU kernel (variable lengths through packing), :func:`run_fused`.
- ``"loop"``: everything that does not depend on the recurrence is done for all time steps at once — the input
  projection ``W_ih x`` is one matmul, its norm one vectorized call (LayerNorm per position; per-timestep batch
  statistics over the ``(T, B)`` grid with the padding masked out; :meth:`forward_sequence` of the norms), the
  biases are folded in — and the loop runs the cell's own step, :meth:`~seqnorm.cells.gated.GatedCell.step_terms`,
  with each step's precomputed term (``unbind``, never ``x[t]``, whose backward writes a full-size gradient at every
  step). Every regularizer runs here exactly as in the reference: the per-sequence masks come from the same
  :func:`~seqnorm.layers.dropout.draw_sequence_masks` call at the same point, and zoneout is drawn by the same step.
- ``"kernel"`` (``"triton"``): as ``"loop"``, but the recurrence, forward and backward through time, is the device's
  compiled kernels' (:mod:`seqnorm.layers.compiled`), which also run the input norm step by step where it declares
  their form.

:meth:`RecurrentLayer.step` without gradients runs the lean step of :mod:`seqnorm.layers.stepping` (each cell's step
prepared once from its parameters and cached); otherwise :func:`step_cell`, each cell on its planned path.

All of them give the same outputs, states, gradients and running statistics up to floating-point rounding; the
``tests/layers/test_fast_path.py`` suite compares them for every cell and norm.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from seqnorm.cells.base import RecurrentCell, SequenceRegularizers
from seqnorm.kernels import KernelNorm
from seqnorm.layers import compiled
from seqnorm.layers.dropout import draw_sequence_masks
from seqnorm.layers.plan import Path, Plan, cell_kernel, plan_for
from seqnorm.layers.stack import PaddingLayout, padding_layout, run_stack
from seqnorm.torch_ops import CELL_KERNELS, SEQUENCE_KERNELS

if TYPE_CHECKING:
    from seqnorm.layers.protocol import Layer

__all__ = ["Impl", "choose_path", "run_direction", "run_fast", "run_fused", "step_cell"]

Impl = Literal["auto", "reference", "loop", "kernel", "triton", "torch_kernel"]
IMPLS: tuple[str, ...] = ("auto", "reference", "loop", "kernel", "triton", "torch_kernel")
"""``impl=`` of a layer: ``"auto"`` (the plan's choice) or one of the plan's own path names, which pins the path of
a whole sequence (:func:`seqnorm.layers.plan.plan_for`: a call that path cannot run is an error that says why)."""


def choose_path(layer: Layer, lengths: Tensor | None, batch: int) -> Path:
    """The path :func:`~seqnorm.layers.plan.plan_for` picks for a sequence of a batch of ``batch`` (its name:
    ``"torch_kernel"``, ``"kernel"``/``"triton"``, ``"loop"`` or ``"reference"``)."""
    weight = layer.cells[0].reference_parameter()  # only where inputs would live and their dtype matter
    facts = weight.new_empty(0, batch, layer.input_size)
    return plan_for(layer, facts, lengths).path


# --- torch's fused kernel ---


def run_fused(
    layer: Layer, x: Tensor, h0: Tensor, c0: Tensor | None, lengths: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The cells' declared torch kernel over ``x`` ``(T, B, I)``; variable lengths go through a ``PackedSequence``."""
    weights: list[Tensor] = []
    for cell in layer.cells:
        weights += [cell.weight_ih, cell.weight_hh]  # weight norm: computed once here
        if layer.bias:
            weights += [cell.bias_ih, cell.bias_hh]
        if cell.weight_hr is not None:
            weights.append(cell.weight_hr)  # torch tells projections from h_0 and c_0 of different sizes
    kernel = SEQUENCE_KERNELS[cell_kernel(layer.cells[0])]  # type: ignore[index]
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
    layer: Layer, x: Tensor, h0: Tensor, c0: Tensor | None, lengths: Tensor | None, plan: Plan
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The same computation as the reference loop, with the input side of every step done at once per direction;
    each direction runs the kernels or the loop, as ``plan.cells`` says (``plan.input_norms``: with its input norm
    inside the kernels)."""
    layout = padding_layout(lengths, x.shape[0], x.shape[1], x.device)
    routes = dict(zip(layer.cells, zip(plan.cells, plan.input_norms, plan.kernel_norms, strict=True), strict=True))
    return run_stack(layer, x, h0, c0, layout, partial(run_direction, layer, routes))


Route = tuple[str, bool, "tuple[KernelNorm, ...] | None"]
"""A direction's path as the plan set it: its name, whether the kernels run its input norm, its kernel norms."""
_REFERENCE: Route = ("reference", False, None)


def run_direction(
    layer: Layer,
    routes: dict[RecurrentCell, Route] | None,
    cell: RecurrentCell,
    sequence: Tensor,
    state: Any,
    layout: PaddingLayout,
    first_step: int = 0,
) -> tuple[Tensor, Any]:
    """One direction of one layer over ``sequence`` ``(T, B, I)`` from ``state``; returns ``(outputs (T, B, H),
    final state)``. The one loop of the reference path (``routes`` ``None``: the cell's own step at every step, from
    ``first_step``) and of the plan's ``"loop"`` (its hoisted input terms: :meth:`GatedCell.step_terms`), or the
    device's kernels where the plan routes the direction there.

    The layer's regularizers are applied here, drawn once per sequence at the same point of the random stream on
    every path (:func:`~seqnorm.layers.dropout.draw_sequence_masks`): input dropout on the sequence, and recurrent
    dropout and DropConnect through the cell's :meth:`~RecurrentCell.recurrent_input` and
    :meth:`~RecurrentCell.recurrent_weight`; a cell whose step never asks for one that was drawn is refused, not
    run without it."""
    dropped = draw_sequence_masks(layer, cell, sequence, state)
    if dropped.input is not None:
        sequence = sequence * dropped.input
    route, input_norm_inside, norms = _REFERENCE if routes is None else routes[cell]
    if route in ("kernel", "triton"):  # the device's backend, as the plan found it
        assert norms is not None, "the plan carries the norms of every cell it routes to the kernels"
        return compiled.run_recurrence(cell, sequence, state, dropped.weight_hh, layout, input_norm_inside, norms)
    masks = layout.masks
    if route == "loop":  # GatedCell: the input side of every step at once
        terms: list[Tensor] | None = list(cell.input_terms(sequence, layout.active, layout.counts).unbind(0))
        # Weight norm (and DropConnect): computed once per sequence, not once per step.
        weight_hh = cell.weight_hh if dropped.weight_hh is None else dropped.weight_hh
        normed = None
    else:
        terms, weight_hh = None, dropped.weight_hh
        # Sequence-wise input statistics (input_stats="sequence") need every step before the first one runs.
        normed = cell.sequence_input_norm(sequence, layout.active, layout.counts)
    outputs = []
    with cell.running_sequence(SequenceRegularizers(dropped.recurrent, weight_hh)) as drawn:
        # unbind, not x[t]: indexing makes every step's backward write a full-size gradient.
        for index, x_t in enumerate(sequence.unbind(0)):
            step = first_step + index
            if terms is not None:  # the reference's step with the hoisted input term; zoneout drawn as there
                state = cell.step_terms(None, state, step, masks[index], input_term=terms[index])  # type: ignore[attr-defined]
            elif normed is not None:
                state = cell.step_terms(x_t, state, step, masks[index], input_normed=normed[index])  # type: ignore[attr-defined]
            else:
                state = cell.step_unchecked(x_t, state, step, masks[index])
            outputs.append(state if isinstance(state, Tensor) else state[0])
    _check_regularizers_read(layer, cell, dropped.recurrent is not None, dropped.weight_hh is not None, drawn)
    return torch.stack(outputs), state


def _check_regularizers_read(
    layer: Layer, cell: RecurrentCell, recurrent: bool, weight: bool, drawn: SequenceRegularizers
) -> None:
    """Refuse a cell whose step never asked for what the layer drew: recurrent dropout or DropConnect would have
    been lost without a word (a cell of the user's that reads its state or ``weight_hh`` directly)."""
    missing = []
    if recurrent and not drawn.inputs_read:
        missing.append("recurrent_dropout (take h through self.recurrent_input(h) where it enters the recurrent term)")
    if weight and not drawn.weights_read:
        missing.append("weight_dropout (take the recurrent weight as self.recurrent_weight())")
    if missing:
        raise ValueError(
            f"{type(layer).__name__}: {cell._owner}'s step_unchecked() never used the layer's "
            f"{' or '.join(missing)}: it would have run without it"
        )


# --- one step (generation) ---


def step_cell(
    route: str, cell: RecurrentCell, x: Tensor, h: Tensor, c: Tensor | None, step: int
) -> tuple[Tensor, Tensor | None]:
    """One step of ``cell`` for :meth:`RecurrentLayer.step` on states ``(1, B, .)``; returns the new ``h``, ``c``.

    ``route`` is the cell's planned path: ``"torch_kernel"`` (its declared cell kernel) or ``"reference"``. ``x`` is
    ``(B, I)`` or ``(1, B, I)``. Without gradients, :meth:`RecurrentLayer.step` runs the lean step of
    :mod:`seqnorm.layers.stepping` instead, where it applies.
    """
    x = x if x.dim() == 2 else x[0]
    state = h[0] if c is None else (h[0], c[0])
    if route == "torch_kernel":
        kernel = CELL_KERNELS[cell_kernel(cell)]  # type: ignore[index]
        state = kernel(x, state, cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)
    else:
        state = cell.step_unchecked(x, state, step, None)
    if isinstance(state, Tensor):
        return state.unsqueeze(0), None
    return state[0].unsqueeze(0), state[1].unsqueeze(0)
