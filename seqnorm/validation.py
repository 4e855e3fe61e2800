"""Checks at the boundary, each a ``ValueError`` naming the class and what it expected: constructor arguments, and
what a call brings against what the module holds (shapes, dtype and device of input, state and parameters)."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "check_finite",
    "check_like_input",
    "check_like_parameters",
    "check_momentum",
    "check_non_negative",
    "check_positive_int",
    "check_proj_size",
    "check_rate",
    "check_state_shape",
    "check_step",
]


def check_like_parameters(owner: str, name: str, x: Tensor, parameter: Tensor) -> None:
    """``x`` on ``parameter``'s device and in its dtype; a ``ValueError`` naming both otherwise.

    Under ``torch.autocast`` for ``x``'s device any floating dtype is accepted: autocast feeds lower-precision
    activations to float32 parameters (and the norms compute their statistics in float32 then).
    """
    if x.device != parameter.device:
        raise ValueError(f"{owner}: expected {name} on {parameter.device} (the parameters' device), got {x.device}")
    if x.dtype == parameter.dtype or (x.is_floating_point() and torch.is_autocast_enabled(x.device.type)):
        return
    if not x.is_floating_point():
        raise ValueError(f"{owner}: expected a floating-point {name} of dtype {parameter.dtype}, got {x.dtype}")
    raise ValueError(
        f"{owner}: expected {name} of dtype {parameter.dtype} (the parameters' dtype: convert the {name}, or the "
        f"model with .to({x.dtype})), got {x.dtype}"
    )


def check_like_input(owner: str, name: str, tensor: Tensor, x: Tensor) -> None:
    """A state ``tensor`` on the input's device and, outside autocast, in its dtype; ``ValueError`` otherwise."""
    if tensor.device != x.device:
        raise ValueError(f"{owner}: expected {name} on {x.device} (the input's device), got {tensor.device}")
    if tensor.dtype == x.dtype or (tensor.is_floating_point() and torch.is_autocast_enabled(x.device.type)):
        return
    raise ValueError(f"{owner}: expected {name} of dtype {x.dtype} (the input's), got {tensor.dtype}")


def check_step(owner: str, step: object, name: str = "step") -> int:
    """``step`` as an int ``>= 0``, the time index a per-timestep norm reads its statistics at (``name``: what the
    caller calls it)."""
    if isinstance(step, bool) or (isinstance(step, Tensor) and (step.dim() or step.is_floating_point())):
        index = None
    else:
        try:
            index = operator.index(step)  # ints, numpy ints, 0-d integer tensors
        except TypeError:
            index = None
    if index is None or index < 0:
        raise ValueError(f"{owner}: expected {name} to be an int >= 0 (the time index), got {step!r}")
    return index


def check_state_shape(owner: str, name: str, tensor: object, expected: tuple[int, ...], like: Tensor) -> Tensor:
    """A state ``tensor`` of shape ``expected``, on ``like``'s device and in its dtype (:func:`check_like_input`)."""
    if not isinstance(tensor, Tensor) or tuple(tensor.shape) != expected:
        got = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
        raise ValueError(f"{owner}: expected {name} of shape {expected}, got {got}")
    check_like_input(owner, name, tensor, like)
    return tensor


def check_proj_size(owner: str, proj_size: object, hidden_size: int, supported: bool) -> int:
    """``0`` (no projection) or an int in ``[1, hidden_size)``; ``supported`` is whether ``owner`` has projections."""
    if isinstance(proj_size, bool) or not isinstance(proj_size, int) or not 0 <= proj_size < hidden_size:
        raise ValueError(
            f"{owner}: expected proj_size to be an int in [0, hidden_size={hidden_size}), got {proj_size!r}"
        )
    if proj_size and not supported:
        raise ValueError(f"{owner}: expected proj_size=0 (projections are for LSTMs, as in torch), got {proj_size}")
    return proj_size


def check_finite(
    owner: str,
    name: str,
    value: object,
    expected: str = "a finite number",
    within: Callable[[float], bool] | None = None,
) -> float:
    """``value`` if it is a finite real number (an int or a float, not a bool) for which ``within`` holds; otherwise
    ``ValueError("<owner>: expected <name> to be <expected>, got <value>")``.

    Every float option is checked here, so NaN and ±inf are refused in one place: a NaN option passes every
    comparison it is range-checked with (``nan < 1`` and ``nan >= 1`` are both false) and then makes every output
    NaN. ``expected`` words the whole expectation, bounds included, so NaN and an out-of-range value read the same.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or (within is not None and not within(value))
    ):
        raise ValueError(f"{owner}: expected {name} to be {expected}, got {value!r}")
    return value


def check_rate(owner: str, name: str, value: object) -> float:
    """A probability in ``[0, 1)`` (dropout and zoneout rates); a ``ValueError`` naming ``owner`` and ``name``."""
    return float(check_finite(owner, name, value, "a finite number in [0, 1)", lambda rate: 0 <= rate < 1))


def check_eps(owner: str, value: object) -> float:
    """A norm's ``eps``: a positive finite number. 0 is refused: a cell's recurrent term ``W_hh h_0`` is exactly 0
    for the default zero state, so its normalization would divide 0 by sqrt(0) at the first step (as would any
    constant feature)."""
    return check_finite(owner, "eps", value, "a positive finite number", lambda eps: eps > 0)


def check_momentum(owner: str, value: object) -> float | None:
    """A batch norm's ``momentum``: a number in ``[0, 1]``, or ``None`` (a cumulative average)."""
    if value is None:
        return None
    return check_finite(owner, "momentum", value, "a finite number in [0, 1] or None", lambda m: 0 <= m <= 1)


def check_positive_int(owner: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: expected {name} to be a positive int, got {value!r}")
    return value


def check_non_negative(owner: str, name: str, value: object) -> float:
    """A finite number ``>= 0`` (a learning rate, a weight decay); a ``ValueError`` naming ``owner`` and ``name``
    (inf would train to NaN weights, saved as if nothing went wrong)."""
    return check_finite(owner, name, value, "finite and >= 0", lambda number: number >= 0)
