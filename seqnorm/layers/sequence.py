"""Running a sequence through a layer: every path's shared pieces, one direction's loop, and the fast paths.

One call of :class:`~seqnorm.layers.base.RecurrentLayer` runs here, in this order:

- :func:`padding_layout`: where the real rows of the ``(T, B)`` batch are (masks, per-step counts).
- :func:`run_stack`: every layer and direction (reversing only the real part of each sequence, concatenating
  directions, inter-layer dropout, zeroing padded outputs, collecting the final states), each direction handed to
- :func:`run_direction`: one direction of one layer over the sequence; the one loop of the reference path and of
  the plan's ``"loop"``, or the device's compiled kernels (:mod:`seqnorm.layers.compiled`). It applies the
  layer's regularizers, drawn once per sequence by :func:`draw_sequence_masks` (below).

Which path runs is decided in one place, :func:`seqnorm.layers.plan.plan_for`, from what the cells and norms
declare (its module docstring lists the conditions):

- ``"reference"``: the cell's own step at every step.
- ``"torch_kernel"``: torch's own LSTM/GRU kernel (variable lengths through packing), :func:`run_fused`.
- ``"loop"``: everything that does not depend on the recurrence is done for all time steps at once — the input
  projection ``W_ih x`` is one matmul, its norm one vectorized call (LayerNorm per position; per-timestep batch
  statistics over the ``(T, B)`` grid with the padding masked out; :meth:`forward_sequence` of the norms), the
  biases are folded in — and the loop runs the cell's own step, :meth:`~seqnorm.cells.gated.GatedCell.step_terms`,
  with each step's precomputed term (``unbind``, never ``x[t]``, whose backward writes a full-size gradient at every
  step). Every regularizer runs here exactly as in the reference: the per-sequence masks come from the same
  :func:`draw_sequence_masks` call at the same point, and zoneout is drawn by the same step.
- ``"kernel"`` (``"triton"``): as ``"loop"``, but the recurrence, forward and backward through time, is the device's
  compiled kernels' (:mod:`seqnorm.layers.compiled`), which also run the input norm step by step where it declares
  their form.

:meth:`RecurrentLayer.step` without gradients runs the lean step of :mod:`seqnorm.layers.stepping` (each cell's step
prepared once from its parameters and cached); otherwise :func:`step_cell`, each cell on its planned path.

All of them give the same outputs, states, gradients and running statistics up to floating-point rounding; the
``tests/layers/test_fast_path.py`` suite compares them for every cell and norm.

**The dropout masks** of the layers (variational input and recurrent dropout, DropConnect on ``W_hh``) are each
drawn once per call, layer and direction, from torch's random generator, and are the same at every step:

- ``input_dropout`` (Gal & Ghahramani 2016): ``x_t <- x_t * m_x / (1 - p)``, ``m_x ~ Bernoulli(1 - p)`` of shape
  ``(B, input features of the layer)``.
- ``recurrent_dropout`` (Gal & Ghahramani 2016): ``h_{t-1} <- h_{t-1} * m_h / (1 - p)`` where ``h`` enters the
  recurrent term ``W_hh h`` only (the carried state is not dropped).
- ``weight_dropout`` (DropConnect on the recurrent weights, Merity et al. 2018):
  ``W_hh <- W_hh * M / (1 - p)``, ``M ~ Bernoulli(1 - p)`` of ``W_hh``'s shape (after weight norm, if any).

Every path draws them by the same :func:`draw_sequence_masks` call at the same point of the computation, so they
draw the same numbers. Zoneout is drawn at every step and belongs to the cells.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from seqnorm.cells.base import RecurrentCell, SequenceRegularizers
from seqnorm.kernels import KernelNorm
from seqnorm.layers import compiled
from seqnorm.layers.plan import Path, Plan, cell_kernel, plan_for
from seqnorm.layers.protocol import PaddingLayout
from seqnorm.torch_ops import CELL_KERNELS, SEQUENCE_KERNELS

if TYPE_CHECKING:
    from seqnorm.layers.protocol import Layer

__all__ = [
    "IMPLS",
    "Impl",
    "SequenceMasks",
    "choose_path",
    "draw_sequence_masks",
    "padding_layout",
    "reverse_padded",
    "run_direction",
    "run_fast",
    "run_fused",
    "run_stack",
    "step_cell",
    "variational_mask",
]

DirectionRunner = Callable[["RecurrentCell", Tensor, Any, "PaddingLayout"], tuple[Tensor, Any]]


def reverse_padded(x: Tensor, lengths: Tensor | None) -> Tensor:
    """Reverse ``x`` ``(T, B, *)`` along time within each sequence's first ``lengths[b]`` steps; padding stays."""
    if lengths is None:
        return x.flip(0)
    steps = torch.arange(x.shape[0], device=x.device).unsqueeze(1)  # (T, 1)
    real = lengths.to(x.device).unsqueeze(0)  # (1, B)
    index = torch.where(steps < real, real - 1 - steps, steps)  # (T, B)
    return x.gather(0, index.view(*index.shape, *([1] * (x.dim() - 2))).expand_as(x))


def padding_layout(
    lengths: Tensor | None, total_steps: int, batch: int, device: torch.device, run_every_step: bool = False
) -> PaddingLayout:
    """The layout of a batch of ``batch`` sequences padded to ``total_steps`` (``lengths`` on the CPU, or None).

    Steps after the longest sequence are not run, unless ``run_every_step`` (synchronized norms: every process runs
    every step of the longest input of any)."""
    if lengths is None:
        return PaddingLayout(total_steps, None, [batch] * total_steps, [None] * total_steps, None)
    steps = total_steps if run_every_step else int(lengths.max())
    real = torch.arange(steps).unsqueeze(1) < lengths.unsqueeze(0)  # (T, B), on the CPU like lengths
    counts = real.sum(1).tolist()
    if min(counts) == batch:
        return PaddingLayout(steps, None, counts, [None] * steps, None)
    active = real.to(device)
    masks = [None if count == batch else mask for count, mask in zip(counts, active.unbind(0), strict=True)]
    return PaddingLayout(steps, active, counts, masks, lengths)


def run_stack(
    layer: Layer,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    layout: PaddingLayout,
    run_direction: DirectionRunner,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Every layer and direction over ``x`` ``(T, B, I)``; returns output ``(T, B, D*H)``, ``h_n``, ``c_n``."""
    h_n: list[Tensor] = []
    c_n: list[Tensor] = []
    layer_input = x[: layout.steps]
    for index_layer in range(layer.num_layers):
        outputs = []
        for direction in range(layer.num_directions):
            index = index_layer * layer.num_directions + direction
            sequence = layer_input if direction == 0 else reverse_padded(layer_input, layout.lengths)
            state: Any = h0[index] if c0 is None else (h0[index], c0[index])
            output, state = run_direction(layer.cells[index], sequence, state, layout)
            outputs.append(output if direction == 0 else reverse_padded(output, layout.lengths))
            if c0 is None:
                h_n.append(state)
            else:
                h_n.append(state[0])
                c_n.append(state[1])
        layer_input = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
        if layer.dropout and layer.training and index_layer < layer.num_layers - 1:
            layer_input = F.dropout(layer_input, layer.dropout, training=True)
    output = layer_input
    if layout.active is not None:
        output = torch.where(layout.active.unsqueeze(2), output, 0.0)
    if layout.steps < x.shape[0]:
        output = F.pad(output, (0, 0, 0, 0, 0, x.shape[0] - layout.steps))
    return output, torch.stack(h_n), (torch.stack(c_n) if c_n else None)


class SequenceMasks(NamedTuple):
    """What :func:`draw_sequence_masks` drew for one layer and direction; ``None`` where nothing is dropped."""

    input: Tensor | None  # (B, I) scaled by 1/(1-p)
    recurrent: Tensor | None  # (B, H) scaled by 1/(1-p)
    weight_hh: Tensor | None  # the masked and rescaled W_hh itself, (G*H, H)


def variational_mask(like: Tensor, rate: float) -> Tensor:
    """A mask of ``like``'s shape: ``1 / (1 - rate)`` with probability ``1 - rate``, else 0 (inverted dropout)."""
    keep = 1.0 - rate
    return torch.bernoulli(torch.full_like(like, keep)) / keep


def draw_sequence_masks(layer: Layer, cell: RecurrentCell, sequence: Tensor, state: Any) -> SequenceMasks:
    """Draw, in this fixed order, the recurrent, input and weight masks that ``layer`` applies to ``cell``.

    Nothing is drawn in evaluation or for rates of 0. ``sequence`` is ``(T, B, I)``; ``state`` the cell's initial
    state.
    """
    if not layer.training:
        return SequenceMasks(None, None, None)
    h = state if isinstance(state, Tensor) else state[0]
    recurrent = variational_mask(h, layer.recurrent_dropout) if layer.recurrent_dropout else None
    inputs = variational_mask(sequence[0], layer.input_dropout) if layer.input_dropout else None
    weight_hh = None
    if layer.weight_dropout:
        weight = getattr(cell, "weight_hh", None)  # weight norm computes it here: DropConnect acts on g * v / ||v||
        if not isinstance(weight, Tensor):
            raise ValueError(
                f"{type(layer).__name__}: expected weight_dropout=0 ({cell._owner} has no weight_hh to drop from), "
                f"got {layer.weight_dropout}"
            )
        weight_hh = weight * variational_mask(weight, layer.weight_dropout)
    return SequenceMasks(inputs, recurrent, weight_hh)


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
    if torch.compiler.is_compiling():
        # run as it is, a graph break, as torch.nn.LSTM/GRU are (Dynamo does not trace RNN modules): the fake-tensor
        # trace of the CPU's fused LSTM with gradients fails (`expected Tensor() for op: aten.mkldnn_rnn_layer`)
        kernel = torch.compiler.disable(kernel)
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
    every path (:func:`draw_sequence_masks`): input dropout on the sequence, and recurrent
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
                state = cell.observed_step(x_t, state, step, masks[index])
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
        state = cell.observed_step(x, state, step, None)
    if isinstance(state, Tensor):
        return state.unsqueeze(0), None
    return state[0].unsqueeze(0), state[1].unsqueeze(0)
