"""The norms' statistics and their backward in Triton, once: LayerNorm and RMSNorm per row (``row_*``).

``@triton.jit`` pieces that the recurrence's fused kernels (:mod:`.recurrence`) call inside their own passes, and the
whole-block kernels that run a norm over every step at once (the input norm of all steps before the loop, and the
parameter gradients after it). The kinds are compile-time constants (:data:`KINDS`); the math matches the C++
kernels' ``norms.h`` and the Python modules in :mod:`seqnorm.norms`, against which the tests compare it.

Only what compiles on a GPU is used (``tests/test_triton_backend.py`` checks the source): no ``libdevice``, no
inline assembly, no block pointers; ``tl.dot`` is not needed (the matmuls are ``torch.mm``).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["KINDS", "row_apply", "row_backward", "row_stats", "rows_backward", "rows_forward"]

KINDS = {"none": 0, "layer": 1, "rms": 2}
"""The norm kinds the Triton kernels take, as their compile-time constant."""


@triton.jit
def row_stats(x, valid, count, eps, KIND: tl.constexpr):
    """``(mean, rstd)`` of one row's features ``x`` (a tile of any shape, ``valid`` marking the features, ``count``
    of them): LayerNorm centres, RMSNorm does not (its mean is 0); ``rstd = 1 / sqrt(mean((x - mean)^2) + eps)``."""
    if KIND == 1:
        mean = tl.sum(tl.where(valid, x, 0.0)) / count
    else:
        mean = tl.sum(tl.where(valid, x, 0.0)) * 0.0
    centred = tl.where(valid, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred) / count + eps)
    return mean, rstd


@triton.jit
def row_apply(x, mean, rstd, weight, shift, KIND: tl.constexpr, SHIFT: tl.constexpr):
    """``γ (x - mean) rstd + shift`` (``x + shift`` for no norm; ``shift`` only where ``SHIFT``)."""
    if KIND == 0:
        y = x
    else:
        y = (x - mean) * rstd * weight
    if SHIFT:
        y = y + shift
    return y


@triton.jit
def row_backward(dy, x, valid, count, mean, rstd, weight, KIND: tl.constexpr):
    """dL/dx of one row from dL/dy: with ``x̂ = (x - mean) rstd`` and ``g = dy γ``,
    ``dx = rstd (g - mean(g) - x̂ mean(g x̂))`` (RMSNorm without the ``mean(g)`` term); ``dy`` for no norm."""
    if KIND == 0:
        dx = dy
    else:
        x_hat = tl.where(valid, (x - mean) * rstd, 0.0)
        g = tl.where(valid, dy * weight, 0.0)
        gx_mean = tl.sum(g * x_hat) / count
        if KIND == 1:
            dx = (g - tl.sum(g) / count - x_hat * gx_mean) * rstd
        else:
            dx = (g - x_hat * gx_mean) * rstd
    return dx


@triton.jit
def rows_forward(
    x_ptr, out_ptr, weight_ptr, shift_ptr, mean_ptr, rstd_ptr, features, eps,
    KIND: tl.constexpr, SHIFT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``out = γ N(x) + shift`` for every row of ``x`` (rows x features), one program a row; saves mean and rstd."""
    row = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    valid = offsets < features
    x = tl.load(x_ptr + row * features + offsets, mask=valid, other=0.0)
    weight = x
    shift = x
    if KIND != 0:
        weight = tl.load(weight_ptr + offsets, mask=valid, other=0.0)
    if SHIFT:
        shift = tl.load(shift_ptr + offsets, mask=valid, other=0.0)
    mean, rstd = row_stats(x, valid, features, eps, KIND)
    tl.store(out_ptr + row * features + offsets, row_apply(x, mean, rstd, weight, shift, KIND, SHIFT), mask=valid)
    if KIND != 0:
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)


@triton.jit
def rows_backward(
    dy_ptr, x_ptr, mean_ptr, rstd_ptr, weight_ptr, dx_ptr, dweight_ptr, dshift_ptr, rows, features,
    KIND: tl.constexpr, WRITE_DX: tl.constexpr, ROWS_EACH: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Each program takes ``ROWS_EACH`` rows: their dx (``WRITE_DX``) and its partial sums of dL/dγ = Σ dy x̂ and
    dL/dshift = Σ dy, one row of ``features`` per program (summed by the caller). Rows whose ``dy`` is zero (padding)
    add nothing."""
    program = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    valid = offsets < features
    dweight = tl.zeros([BLOCK], dy_ptr.dtype.element_ty)
    dshift = tl.zeros([BLOCK], dy_ptr.dtype.element_ty)
    weight = dweight
    if KIND != 0:
        weight = tl.load(weight_ptr + offsets, mask=valid, other=0.0)
    for index in range(0, ROWS_EACH):
        row = program * ROWS_EACH + index
        here = valid & (row < rows)  # the last program's rows past the end load zeros and add nothing
        dy = tl.load(dy_ptr + row * features + offsets, mask=here, other=0.0)
        dshift = dshift + dy
        if KIND != 0:
            x = tl.load(x_ptr + row * features + offsets, mask=here, other=0.0)
            mean = tl.load(mean_ptr + row, mask=row < rows, other=0.0)
            rstd = tl.load(rstd_ptr + row, mask=row < rows, other=0.0)
            dweight = dweight + dy * tl.where(here, (x - mean) * rstd, 0.0)
            if WRITE_DX:
                dx = row_backward(dy, x, valid, features, mean, rstd, weight, KIND)
                tl.store(dx_ptr + row * features + offsets, dx, mask=here)
    tl.store(dshift_ptr + program * features + offsets, dshift, mask=valid)
    if KIND != 0:
        tl.store(dweight_ptr + program * features + offsets, dweight, mask=valid)
