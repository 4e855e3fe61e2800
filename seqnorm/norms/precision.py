"""Normalization statistics in float32 under mixed precision and in half-precision models.

Under ``torch.autocast`` the projections ``W_ih x`` and ``W_hh h`` come out in bfloat16 (or float16). Means and
variances of such values lose most of their digits (bfloat16 keeps 8 bits), and the small differences a norm divides
by are exactly what rounds away. Every norm therefore computes in float32 whenever its input is a low-precision float
or autocast is on for its device: the input is upcast, autocast is switched off inside the norm, and the output is
float32, as autocast's own float32 ops (``layer_norm``, ``batch_norm`` on CUDA) return it.

A model converted to half precision (``.to(torch.bfloat16)``, Lightning's ``precision="bf16-true"``) gets the same
float32 statistics: the norm's own low-precision parameters and buffers are used as float32 copies for the call
(gradients flow back to the parameters; updated running statistics are written back, in the module's dtype), and
the output is cast back to the input's dtype, so the rest of the cell stays in the model's dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

__all__ = ["float32_statistics"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
Method = TypeVar("Method", bound=Callable[..., Tensor])


@contextmanager
def _own_tensors_in_float32(module: nn.Module) -> Iterator[None]:
    # The module's own tensors only (a norm has no submodules). torch.func.functional_call would do the swap, but
    # only around forward and through __call__ (hooks again); the decorated methods include forward_sequence.
    swapped = [
        (store, name, tensor)
        for store in (module._parameters, module._buffers)
        for name, tensor in store.items()
        if tensor is not None and tensor.dtype in _LOW_PRECISION
    ]
    for store, name, tensor in swapped:
        store[name] = tensor.float()  # differentiable for parameters: their gradient arrives in their own dtype
    try:
        yield
    finally:
        for store, name, tensor in swapped:
            upcast = store[name]
            store[name] = tensor
            if store is module._buffers:
                with torch.no_grad():
                    tensor.copy_(upcast)


def float32_statistics(method: Method) -> Method:
    """Decorate a norm method ``method(self, x, *args)`` to run in float32 under mixed precision (see above)."""

    @functools.wraps(method)
    def wrapper(self: Any, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        device_type = x.device.type
        autocast = torch.is_autocast_enabled(device_type)
        # Autocast leaves float64 alone (as it does torch's own ops): a float64 model computes in float64.
        if x.dtype not in _LOW_PRECISION and (not autocast or x.dtype == torch.float64):
            return method(self, x, *args, **kwargs)
        with torch.autocast(device_type, enabled=False), _own_tensors_in_float32(self):
            y = method(self, x.float(), *args, **kwargs)
        return y if autocast else y.to(x.dtype)

    return wrapper  # type: ignore[return-value]
