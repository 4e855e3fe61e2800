"""The input projection ``x W^T (+ b)`` of a whole sequence, with operands laid out the way the CPU BLAS is fastest.

On an Intel Xeon MKL multiplied by a transposed view (what ``F.linear`` passes it) about half as fast as by a
row-major matrix (docs/benchmarks-archive.md). :func:`project` copies ``W^T`` once per call (``W`` is small next to
the sequence) and computes the backward in the fast layouts too (``dx = g W``, ``dW = g^T x``). It is the same
arithmetic as ``F.linear``; under autocast, in half precision and off the CPU it is ``F.linear`` itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["project"]

_FLOATS = (torch.float32, torch.float64)


def project(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, *, out: Tensor | None = None, copy: bool = True
) -> Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` ``(..., in)``, ``weight`` ``(out, in)``.

    ``out``: a contiguous tensor of the result's shape to write it into, for a caller that computes the projection's
    gradients itself (autograd records nothing then): :mod:`seqnorm.layers.compiled`'s recurrence, whose projection
    goes into the kernels' kept memory. ``copy=False`` (with ``out``): multiply by the transposed view of ``W``
    rather than a row-major copy of ``W^T``, for a caller that measured it faster here
    (:meth:`seqnorm.kernels.cpu.CpuBackend.project_kept`)."""
    fast = x.device.type == "cpu" and x.dtype in _FLOATS and not torch.is_autocast_enabled("cpu") and x.dim() >= 2
    if out is not None:
        with torch.no_grad():
            return _multiply(x, weight, bias, out, copy) if fast else out.copy_(F.linear(x, weight, bias))
    if not fast:
        return F.linear(x, weight, bias)
    return _Projection.apply(x, weight, bias)


def _multiply(x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor | None = None, copy: bool = True) -> Tensor:
    """``x W^T (+ b)`` with ``W^T`` copied row-major (the module's docstring; ``copy=False``: the transposed view),
    into ``out`` if given."""
    rows = x.reshape(-1, x.shape[-1])
    weight_t = weight.t().contiguous() if copy else weight.t()
    flat = None if out is None else out.view(-1, weight.shape[0])
    if bias is None:
        result = torch.mm(rows, weight_t, out=flat)
    else:
        result = torch.addmm(bias, rows, weight_t, out=flat)
    return result.view(*x.shape[:-1], weight.shape[0])


class _Projection(torch.autograd.Function):
    # forward and setup_context apart, with a generated vmap rule: torch.func's transforms (grad, vmap) take
    # only such Functions (an old-style one ended torch.func.grad of any normalized layer)
    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return _multiply(x, weight, bias)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor | None], output: Tensor) -> None:
        x, weight, bias = inputs
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_rows = grad.reshape(-1, weight.shape[0])
        grad_x = torch.mm(grad_rows, weight).view_as(x) if ctx.needs_input_grad[0] else None
        grad_weight = torch.mm(grad_rows.t(), x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_bias = grad_rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias
