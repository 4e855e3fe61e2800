"""Checks of what a call brings against what the module holds: dtype and device of input, state and parameters."""

from __future__ import annotations

import operator

import torch
from torch import Tensor

__all__ = ["check_like_input", "check_like_parameters", "check_step"]


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


def check_step(owner: str, step: object) -> int:
    """``step`` as an int ``>= 0``, the time index a per-timestep norm reads its statistics at."""
    if isinstance(step, bool) or (isinstance(step, Tensor) and (step.dim() or step.is_floating_point())):
        index = None
    else:
        try:
            index = operator.index(step)  # ints, numpy ints, 0-d integer tensors
        except TypeError:
            index = None
    if index is None or index < 0:
        raise ValueError(f"{owner}: expected step to be an int >= 0 (the time index), got {step!r}")
    return index
