"""Normalization statistics in float32 under mixed precision.

Under ``torch.autocast`` the projections ``W_ih x`` and ``W_hh h`` come out in bfloat16 (or float16). Means and
variances of such values lose most of their digits (bfloat16 keeps 8 bits), and the small differences a norm divides
by are exactly what rounds away. Every norm therefore computes in float32 whenever its input is a low-precision float
or autocast is on for its device: the input is upcast, autocast is switched off inside the norm, and the output is
float32, as autocast's own float32 ops (``layer_norm``, ``batch_norm`` on CUDA) return it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

__all__ = ["float32_statistics"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
Method = TypeVar("Method", bound=Callable[..., Tensor])


def float32_statistics(method: Method) -> Method:
    """Decorate a norm method ``method(self, x, *args)`` to run in float32 under mixed precision (see above)."""

    @functools.wraps(method)
    def wrapper(self: Any, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        device_type = x.device.type
        if x.dtype not in _LOW_PRECISION and not torch.is_autocast_enabled(device_type):
            return method(self, x, *args, **kwargs)
        with torch.autocast(device_type, enabled=False):
            return method(self, x.float(), *args, **kwargs)

    return wrapper  # type: ignore[return-value]
