"""The per-sequence dropout masks of the layers: variational input and recurrent dropout, DropConnect on ``W_hh``.

Each is drawn once per call, layer and direction, from torch's random generator, and is the same at every step:

- ``input_dropout`` (Gal & Ghahramani 2016): ``x_t <- x_t * m_x / (1 - p)``, ``m_x ~ Bernoulli(1 - p)`` of shape
  ``(B, input features of the layer)``.
- ``recurrent_dropout`` (Gal & Ghahramani 2016): ``h_{t-1} <- h_{t-1} * m_h / (1 - p)`` where ``h`` enters the
  recurrent term ``W_hh h`` only (the carried state is not dropped).
- ``weight_dropout`` (DropConnect on the recurrent weights, Merity et al. 2018):
  ``W_hh <- W_hh * M / (1 - p)``, ``M ~ Bernoulli(1 - p)`` of ``W_hh``'s shape (after weight norm, if any).

Both the reference loop and the fast path call :func:`draw_sequence_masks` at the same point of the computation, so
they draw the same numbers. Zoneout is drawn at every step and belongs to the cells.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from seqnorm.cells.base import RecurrentCell

if TYPE_CHECKING:
    from seqnorm.layers.protocol import Layer

__all__ = ["SequenceMasks", "draw_sequence_masks", "variational_mask"]


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
