"""What every path of the layers shares: the padding layout of a batch, and stacking layers and directions.

The reference loop and the fast path differ only in how they run one direction of one layer over a sequence; both
hand that to :func:`run_stack`, which owns the rest: padding masks, reversing only the real part of each sequence,
concatenating directions, inter-layer dropout, zeroing padded outputs and collecting the final states.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from seqnorm.cells.base import RecurrentCell
    from seqnorm.layers.protocol import Layer

__all__ = ["PaddingLayout", "padding_layout", "reverse_padded", "run_stack"]

DirectionRunner = Callable[["RecurrentCell", Tensor, Any, "PaddingLayout"], tuple[Tensor, Any]]


def reverse_padded(x: Tensor, lengths: Tensor | None) -> Tensor:
    """Reverse ``x`` ``(T, B, *)`` along time within each sequence's first ``lengths[b]`` steps; padding stays."""
    if lengths is None:
        return x.flip(0)
    steps = torch.arange(x.shape[0], device=x.device).unsqueeze(1)  # (T, 1)
    real = lengths.to(x.device).unsqueeze(0)  # (1, B)
    index = torch.where(steps < real, real - 1 - steps, steps)  # (T, B)
    return x.gather(0, index.view(*index.shape, *([1] * (x.dim() - 2))).expand_as(x))


@dataclass(frozen=True)
class PaddingLayout:
    """Where the real positions of a ``(T, B)`` batch are.

    Attributes:
        steps: time steps that are run: ``max(lengths)``, since later steps are padding for every row.
        active: ``(steps, B)`` bool on the input's device, ``None`` when every row is real at every step.
        counts: real rows at each step (host ints, so no device sync per step).
        masks: per step, the ``(B,)`` row of ``active``, or ``None`` where every row is real (no mask needed).
        lengths: the lengths when some row is padded (for reversing), else ``None`` (a plain flip).
    """

    steps: int
    active: Tensor | None
    counts: list[int]
    masks: list[Tensor | None]
    lengths: Tensor | None


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
