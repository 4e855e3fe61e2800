"""What a layer's ``forward`` brings, checked at the boundary: its input, ``hx``, ``lengths`` and ``first_step``.
Every refusal is a ``ValueError`` naming the layer class and what it expected (``step()``'s state is checked with
:func:`seqnorm.validation.check_state_shape`, as ``hx`` is here).

:class:`~seqnorm.layers.base.RecurrentLayer` calls these; they read the layer's sizes and return what its time loop
takes: ``x`` ``(T, B, I)``, integer lengths on the CPU, ``h0``/``c0`` ``(layers * directions, B, .)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from seqnorm.validation import check_like_parameters, check_state_shape

if TYPE_CHECKING:
    from seqnorm.layers.protocol import Layer

__all__ = ["check_first_step", "prepare"]


def prepare(
    layer: Layer, input: Tensor | PackedSequence, hx: Any, lengths: Tensor | list[int] | None
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None, bool]:
    """Check ``layer.forward``'s arguments; ``x`` ``(T, B, I)``, lengths, ``h0``, ``c0`` and whether unbatched."""
    owner = type(layer).__name__
    if isinstance(input, PackedSequence):
        if lengths is not None:
            raise ValueError(f"{owner}: expected lengths=None with a PackedSequence input, got lengths")
        x, lengths = pad_packed_sequence(input)  # (T, B, I), original batch order
        unbatched = False
    else:
        if not isinstance(input, Tensor) or input.dim() not in (2, 3):
            got = f"shape {tuple(input.shape)}" if isinstance(input, Tensor) else type(input).__name__
            layout = "(batch, seq, features)" if layer.batch_first else "(seq, batch, features)"
            raise ValueError(f"{owner}: expected a 3-D input {layout} or 2-D (seq, features), got {got}")
        unbatched = input.dim() == 2
        x = input.unsqueeze(1) if unbatched else (input.transpose(0, 1) if layer.batch_first else input)
    if x.shape[-1] != layer.input_size:
        raise ValueError(f"{owner}: expected input with {layer.input_size} features, got {x.shape[-1]}")
    check_like_parameters(owner, "input", x, layer.cells[0].reference_parameter())
    steps, batch = x.shape[0], x.shape[1]
    if steps == 0:
        raise ValueError(f"{owner}: expected at least one time step, got an input of length 0")
    lengths = _check_lengths(owner, lengths, steps, batch)
    if lengths is not None and torch.is_grad_enabled() and int(lengths.min()) < steps:
        # Padding enters nothing, not even W_ih's gradient as 0 * NaN: a padded row's gradient is 0, but its input
        # (NaN or inf padding, which the outputs never show) multiplies it there. It costs little (docs/performance.md).
        padded = torch.arange(steps).unsqueeze(1) >= lengths.unsqueeze(0)  # (T, B)
        x = x.masked_fill(padded.to(x.device).unsqueeze(-1), 0)
    h0, c0 = _initial_state(layer, hx, batch, x, unbatched)
    return x, lengths, h0, c0, unbatched


def check_first_step(layer: Layer, first_step: object) -> int:
    """``first_step`` as an int ``>= 0``; only 0 for a bidirectional layer (a reverse direction has no continuation)."""
    owner = type(layer).__name__
    if isinstance(first_step, bool) or not isinstance(first_step, int) or first_step < 0:
        raise ValueError(f"{owner}: expected first_step to be an int >= 0, got {first_step!r}")
    if first_step and layer.bidirectional:
        raise ValueError(f"{owner}: expected first_step=0 with bidirectional=True, got {first_step}")
    return first_step


def _check_lengths(owner: str, lengths: Tensor | list[int] | None, steps: int, batch: int) -> Tensor | None:
    if lengths is None:
        return None
    if isinstance(lengths, Tensor):
        values = lengths.detach().cpu()
    else:
        try:
            values = torch.as_tensor(lengths)
        except (TypeError, ValueError, RuntimeError):  # a string, a ragged list, None inside
            raise ValueError(f"{owner}: expected lengths to be a tensor or list of ints, got {lengths!r}") from None
    if values.dim() != 1 or values.numel() != batch:
        raise ValueError(f"{owner}: expected lengths of shape ({batch},), got {tuple(values.shape)}")
    if values.dtype.is_floating_point or values.dtype == torch.bool or values.is_complex():
        raise ValueError(f"{owner}: expected integer lengths, got dtype {values.dtype}")
    low, high = int(values.min()), int(values.max())
    if low < 1 or high > steps:
        raise ValueError(f"{owner}: expected lengths in [1, {steps}] (the input's time steps), got {low}..{high}")
    return values.to(torch.long)


def _initial_state(layer: Layer, hx: Any, batch: int, x: Tensor, unbatched: bool) -> tuple[Tensor, Tensor | None]:
    owner = type(layer).__name__
    has_c = layer.cell_class.has_cell_state
    layers = layer.num_layers * layer.num_directions
    expected = (layers, layer.state_size) if unbatched else (layers, batch, layer.state_size)
    expected_c = (*expected[:-1], layer.hidden_size)
    if hx is None:
        h0 = x.new_zeros(layers, batch, layer.state_size)
        return h0, (x.new_zeros(layers, batch, layer.hidden_size) if has_c else None)
    if has_c:
        if not isinstance(hx, (tuple, list)) or len(hx) != 2:
            raise ValueError(f"{owner}: expected hx to be a tuple (h_0, c_0), got {type(hx)}")
        h0 = check_state_shape(owner, "h_0", hx[0], expected, x)
        c0 = check_state_shape(owner, "c_0", hx[1], expected_c, x)
        return (h0.unsqueeze(1), c0.unsqueeze(1)) if unbatched else (h0, c0)
    h0 = check_state_shape(owner, "h_0", hx, expected, x)
    return (h0.unsqueeze(1) if unbatched else h0), None
