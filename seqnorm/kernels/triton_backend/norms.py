"""The norms' statistics and their backward in Triton, once: LayerNorm and RMSNorm per row (``row_*``).

``@triton.jit`` pieces that the recurrence's fused kernels (:mod:`.recurrence`) call inside their own passes, and the
whole-block kernels that run a norm over every step at once (the input norm of all steps before the loop, and the
parameter gradients after it). The kinds are compile-time constants (:data:`KINDS`); the math matches the C++
kernels' ``norms.h`` and the Python modules in :mod:`seqnorm.norms`, against which the tests compare it.

Only what compiles on a GPU is used (``tests/kernels/test_triton_backend.py`` checks the source): no ``libdevice``, no
inline assembly, no block pointers; ``tl.dot`` is not needed (the matmuls are ``torch.mm``).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["KINDS", "row_apply", "row_backward", "row_stats", "rows_backward", "rows_forward"]

KINDS = {"none": 0, "layer": 1, "rms": 2, "batch": 3}
"""The norm kinds the Triton kernels take, as their compile-time constant (4: a BatchNorm folded for evaluation)."""


@triton.jit
def row_stats(x, valid, count, eps, KIND: tl.constexpr):
    """``(mean, rstd)`` of one row's features ``x`` (a tile of any shape, ``valid`` marking the features, ``count``
    of them): LayerNorm centres, RMSNorm does not (its mean is 0); ``rstd = 1 / sqrt(mean((x - mean)^2) + eps)``."""
    if KIND == 1:
        mean = tl.sum(tl.where(valid, x, 0.0)) / count
    else:
        mean = tl.sum(tl.where(valid, x, 0.0)) * 0.0
    if KIND == 4:  # folded: no statistics of its own
        return mean, mean + 1.0
    centred = tl.where(valid, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred) / count + eps)
    return mean, rstd


@triton.jit
def row_apply(x, mean, rstd, weight, shift, KIND: tl.constexpr, SHIFT: tl.constexpr):
    """``γ (x - mean) rstd + shift`` (``x + shift`` for no norm; ``x γ + shift`` for ``KIND`` 4, a per-timestep
    BatchNorm in evaluation whose statistics come folded into ``γ`` and ``shift``; ``shift`` only where ``SHIFT``)."""
    if KIND == 0:
        y = x
    elif KIND == 4:
        y = x * weight
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
        # the last program's rows past the end load zeros and add nothing. A scalar condition selects, not `&`:
        # Triton 3.9's interpreter makes `vector & scalar` an int32 mask and refuses it ("mask has unsupported dtype")
        here = tl.where(row < rows, valid, False)
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


# ---- per-timestep BatchNorm (and batch renormalization): statistics per feature over a step's real rows ---------
#
# A step's tile is (rows x columns): the batch's rows and a block of features. The running statistics of the step's
# row of statistics (``row``) are updated in place by the program that owns the columns, as the module's forward
# does; ``seen`` is how many updates that row had before this step (the caller counts them: several steps beyond
# max_steps share the last row). Each step saves (mean, rstd, r, d) per feature for the backward; with running
# statistics (evaluation, or fewer than 2 real rows in training: the module's fallback) they are the running ones,
# r = 1 and d = 0.


@triton.jit
def _lerp(start, end, weight):
    """torch.lerp's formula (the module updates its running moments with it)."""
    return tl.where(weight < 0.5, start + weight * (end - start), end - (end - start) * (1.0 - weight))


@triton.jit
def batch_forward(
    x, real, count, columns, valid, row, seen, slot, steps, features,
    weight_ptr, shift_ptr, running_mean_ptr, running_var_ptr, stats_ptr, options_ptr,
    SHIFT: tl.constexpr, TRAINING: tl.constexpr, RENORM: tl.constexpr, SAVE: tl.constexpr,
):  # fmt: skip
    """``γ (x̂ r + d) + shift`` of one step's tile ``x`` (``real``: its real rows, a column; ``count`` of them;
    ``columns``: the features, ``valid`` those that exist); updates the running statistics in training; saves the
    step's (mean, rstd, r, d) at ``slot`` of ``stats`` (4, steps, features) where ``SAVE``. ``options``: eps,
    momentum (< 0: a cumulative average), r_max, d_max, warmup, r_max_steps, d_max_steps, in ``x``'s dtype (a
    float argument would be float32)."""
    eps = tl.load(options_ptr)
    momentum = tl.load(options_ptr + 1)
    at = row * features + columns
    running_mean = tl.load(running_mean_ptr + at, mask=valid, other=0.0)
    running_var = tl.load(running_var_ptr + at, mask=valid, other=1.0)
    running_rstd = 1.0 / tl.sqrt(running_var + eps)
    mean = running_mean
    rstd = running_rstd
    r = running_rstd * 0.0 + 1.0
    d = running_rstd * 0.0
    if TRAINING:
        use_batch = count >= 2
        n = tl.maximum(count, 1).to(x.dtype)
        batch_mean = tl.sum(tl.where(real, x, 0.0), axis=0) / n
        centred = tl.where(real, x - batch_mean[None, :], 0.0)
        batch_var = tl.sum(centred * centred, axis=0) / n
        batch_rstd = 1.0 / tl.sqrt(batch_var + eps)
        # the k-th batch of a row weighs 1/k under a cumulative average (momentum < 0: momentum=None)
        step_weight = tl.where(momentum < 0, 1.0 / (seen + 1).to(x.dtype), momentum)
        unbias = n / tl.maximum(n - 1.0, 1.0)
        if RENORM:  # Ioffe's limits from the updates the row saw before this step
            ramp = tl.maximum(seen.to(x.dtype) - tl.load(options_ptr + 4), 0.0)
            r_limit = 1.0 + (tl.load(options_ptr + 2) - 1.0) * tl.minimum(ramp / tl.load(options_ptr + 5), 1.0)
            d_limit = tl.load(options_ptr + 3) * tl.minimum(ramp / tl.load(options_ptr + 6), 1.0)
            r = tl.where(use_batch, tl.minimum(tl.maximum(running_rstd / batch_rstd, 1.0 / r_limit), r_limit), r)
            d = tl.where(
                use_batch, tl.minimum(tl.maximum((batch_mean - running_mean) * running_rstd, -d_limit), d_limit), d
            )
        update = tl.where(use_batch, valid, False)  # not `valid & use_batch`: see rows_backward
        tl.store(running_mean_ptr + at, _lerp(running_mean, batch_mean, step_weight), mask=update)
        tl.store(running_var_ptr + at, _lerp(running_var, batch_var * unbias, step_weight), mask=update)
        mean = tl.where(use_batch, batch_mean, running_mean)
        rstd = tl.where(use_batch, batch_rstd, running_rstd)
    if SAVE:
        place = slot * features + columns
        block = steps * features
        tl.store(stats_ptr + place, mean, mask=valid)
        tl.store(stats_ptr + block + place, rstd, mask=valid)
        tl.store(stats_ptr + 2 * block + place, r, mask=valid)
        tl.store(stats_ptr + 3 * block + place, d, mask=valid)
    weight = tl.load(weight_ptr + columns, mask=valid, other=0.0)
    y = ((x - mean[None, :]) * (rstd * r)[None, :] + d[None, :]) * weight[None, :]
    if SHIFT:
        y = y + tl.load(shift_ptr + columns, mask=valid, other=0.0)[None, :]
    return y


@triton.jit
def batch_backward(
    dy, x, real, count, columns, valid, slot, steps, features, weight_ptr, stats_ptr, dweight_ptr, dshift_ptr,
    TRAINING: tl.constexpr, SHIFT: tl.constexpr,
):  # fmt: skip
    """dL/dx of one step's tile from dL/dy (zero on padded rows), adding the step's dL/dγ = Σ dy (x̂ r + d) and
    dL/dshift = Σ dy to the running totals of its columns. With batch statistics
    ``dx = γ r rstd (dy - Σ dy / n - x̂ Σ dy x̂ / n)`` over the real rows; with running ones ``dx = γ rstd dy``."""
    place = slot * features + columns
    block = steps * features
    mean = tl.load(stats_ptr + place, mask=valid, other=0.0)
    rstd = tl.load(stats_ptr + block + place, mask=valid, other=0.0)
    r = tl.load(stats_ptr + 2 * block + place, mask=valid, other=1.0)
    d = tl.load(stats_ptr + 3 * block + place, mask=valid, other=0.0)
    weight = tl.load(weight_ptr + columns, mask=valid, other=0.0)
    dy = tl.where(real, dy, 0.0)
    x_hat = (x - mean[None, :]) * rstd[None, :]
    sum_dy = tl.sum(dy, axis=0)
    sum_dyx = tl.sum(dy * x_hat, axis=0)
    tl.store(
        dweight_ptr + columns,
        tl.load(dweight_ptr + columns, mask=valid, other=0.0) + sum_dyx * r + sum_dy * d,
        mask=valid,
    )
    if SHIFT:
        tl.store(dshift_ptr + columns, tl.load(dshift_ptr + columns, mask=valid, other=0.0) + sum_dy, mask=valid)
    g = dy
    if TRAINING:
        n = tl.maximum(count, 1).to(x.dtype)
        batch_g = (dy - sum_dy[None, :] / n - x_hat * (sum_dyx / n)[None, :]) * r[None, :]
        g = tl.where(count >= 2, batch_g, dy)
    return tl.where(real, g * (rstd * weight)[None, :], 0.0)
