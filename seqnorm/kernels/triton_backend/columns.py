"""The recurrence's fused step kernels for norms whose statistics span the rows (per-timestep BatchNorm and batch
renormalization), one program per block of hidden units taking every row of the batch: a step's BN of ``W_ih x``,
of ``W_hh h`` and of the cell state are per-feature reductions over the real rows, all inside the program's
columns. The norms' math is :mod:`.norms`' (``batch_forward``/``batch_backward``), the gates :mod:`.cells`'.

Each norm here is ``NONE`` (``x`` plus its shift, if any) or ``BATCH``; an input norm per row (LayerNorm, RMSNorm)
is applied to all steps before the loop and arrives as the finished input term (``IH = NONE``).

The arguments that change from step to step (``slot``, ``steps``, a norm's ``row``) are not specialized on: one
compiled kernel serves every step, where Triton would compile another for a step index of 1 or a multiple of 16.
"""

from __future__ import annotations

import triton
import triton.language as tl

from seqnorm.kernels.triton_backend.cells import (
    gru_backward,
    gru_gates,
    lstm_activation,
    lstm_backward,
    lstm_cell,
    lstm_output_backward,
    tanh,
)
from seqnorm.kernels.triton_backend.norms import batch_backward, batch_forward
from seqnorm.kernels.triton_backend.recurrence import store_half

__all__ = ["gru_columns", "gru_columns_backward", "lstm_columns", "lstm_columns_backward"]


@triton.jit
def _rows(mask_ptr, rows, BLOCK_B: tl.constexpr, HAS_MASK: tl.constexpr):
    """The batch's rows as a column, which of them are real at this step, and how many."""
    batch = tl.arange(0, BLOCK_B)[:, None]
    real = batch < rows
    if HAS_MASK:
        real = real & (tl.load(mask_ptr + batch, mask=batch < rows, other=0) != 0)
    return batch, real, tl.sum(real.to(tl.int32))


@triton.jit
def _tile(mask_ptr, rows, hidden, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr):
    """The program's hidden units (``program_id(0) * BLOCK + [0, BLOCK)``) and which exist; the batch's rows (a
    column), which are real at this step and how many; which elements of the (rows x units) tile exist."""
    units = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = units < hidden
    batch, real, count = _rows(mask_ptr, rows, BLOCK_B, HAS_MASK)
    return units, valid, batch, real, count, (batch < rows) & valid[None, :]


@triton.jit
def _norm(
    x, real, count, columns, valid, row, seen, slot, steps, features,
    weight_ptr, shift_ptr, mean_ptr, var_ptr, stats_ptr, options_ptr,
    KIND: tl.constexpr, SHIFT: tl.constexpr, TRAINING: tl.constexpr, RENORM: tl.constexpr, SAVE: tl.constexpr,
):  # fmt: skip
    """One norm of a step's tile: BatchNorm (``KIND`` 3), or nothing but the shift."""
    if KIND == 3:
        return batch_forward(
            x, real, count, columns, valid, row, seen, slot, steps, features, weight_ptr, shift_ptr, mean_ptr,
            var_ptr, stats_ptr, options_ptr, SHIFT, TRAINING, RENORM, SAVE,
        )  # fmt: skip
    if SHIFT:
        return x + tl.load(shift_ptr + columns, mask=valid, other=0.0)[None, :]
    return x


@triton.jit
def _terms(
    k: tl.constexpr, input_ptr, raw_ptr, batch, real, count, tile, units, valid, hidden, width, slot, steps,
    ih_weight, ih_shift, ih_mean, ih_var, ih_stats, ih_options, ih_row, ih_seen,
    hh_weight, hh_shift, hh_mean, hh_var, hh_stats, hh_options, hh_row, hh_seen,
    IH: tl.constexpr, IH_SHIFT: tl.constexpr, IH_RENORM: tl.constexpr,
    HH: tl.constexpr, HH_SHIFT: tl.constexpr, HH_RENORM: tl.constexpr, TRAINING: tl.constexpr, SAVE: tl.constexpr,
):  # fmt: skip
    """Gate ``k``'s input and recurrent terms: N_ih(W_ih x) and N_hh(W_hh h), each with its shift."""
    columns = k * hidden + units
    at = batch * width + columns[None, :]
    term = _norm(
        tl.load(input_ptr + at, mask=tile, other=0.0), real, count, columns, valid, ih_row, ih_seen, slot, steps,
        width, ih_weight, ih_shift, ih_mean, ih_var, ih_stats, ih_options, IH, IH_SHIFT,
        TRAINING, IH_RENORM, SAVE,
    )  # fmt: skip
    recurrent = _norm(
        tl.load(raw_ptr + at, mask=tile, other=0.0), real, count, columns, valid, hh_row, hh_seen, slot, steps,
        width, hh_weight, hh_shift, hh_mean, hh_var, hh_stats, hh_options, HH, HH_SHIFT,
        TRAINING, HH_RENORM, SAVE,
    )  # fmt: skip
    return term, recurrent


@triton.jit
def _seen(pointer, KIND: tl.constexpr):
    """How many updates the step's row of running statistics saw before this step (BatchNorm only), as int64 on
    both branches (a GPU build refuses a function whose returns differ in type)."""
    if KIND == 3:
        return tl.load(pointer).to(tl.int64)
    return tl.full((), 0, tl.int64)


@triton.jit(do_not_specialize=["ih_row", "hh_row", "c_row", "slot", "steps"])
def lstm_columns(
    input_ptr, raw_ptr, h_prev_ptr, c_prev_ptr, mask_ptr, h_ptr, c_ptr, acts_ptr, tanh_ptr, h_half_ptr,
    ih_weight, ih_shift, ih_mean, ih_var, ih_stats, ih_options, ih_row, ih_seen,
    hh_weight, hh_shift, hh_mean, hh_var, hh_stats, hh_options, hh_row, hh_seen,
    c_weight, c_shift, c_mean, c_var, c_stats, c_options, c_row, c_seen,
    rows, hidden, slot, steps,
    IH: tl.constexpr, IH_SHIFT: tl.constexpr, IH_RENORM: tl.constexpr,
    HH: tl.constexpr, HH_SHIFT: tl.constexpr, HH_RENORM: tl.constexpr,
    C: tl.constexpr, C_SHIFT: tl.constexpr, C_RENORM: tl.constexpr, TRAINING: tl.constexpr, HAS_MASK: tl.constexpr,
    SAVE: tl.constexpr, HALF: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One LSTM step of the hidden units ``program_id(0) * BLOCK + [0, BLOCK)`` for every row (``HALF``: h' also
    in ``h_half``'s half precision, for the next step's product)."""
    units, valid, batch, real, count, tile = _tile(mask_ptr, rows, hidden, BLOCK_B, BLOCK, HAS_MASK)
    width = 4 * hidden
    ih_seen = _seen(ih_seen, IH)
    hh_seen = _seen(hh_seen, HH)
    norms = (
        ih_weight, ih_shift, ih_mean, ih_var, ih_stats, ih_options, ih_row, ih_seen,
        hh_weight, hh_shift, hh_mean, hh_var, hh_stats, hh_options, hh_row, hh_seen,
    )  # fmt: skip
    place = (input_ptr, raw_ptr, batch, real, count, tile, units, valid, hidden, width, slot, steps)
    flags = (IH, IH_SHIFT, IH_RENORM, HH, HH_SHIFT, HH_RENORM, TRAINING, SAVE)
    term, recurrent = _terms(0, *place, *norms, *flags)
    i = lstm_activation(term + recurrent, False)
    term, recurrent = _terms(1, *place, *norms, *flags)
    f = lstm_activation(term + recurrent, False)
    term, recurrent = _terms(2, *place, *norms, *flags)
    g = lstm_activation(term + recurrent, True)
    term, recurrent = _terms(3, *place, *norms, *flags)
    o = lstm_activation(term + recurrent, False)
    at = batch * hidden + units[None, :]
    c_prev = tl.load(c_prev_ptr + at, mask=tile, other=0.0)
    c = lstm_cell(i, f, g, c_prev)
    c_out = _norm(
        c, real, count, units, valid, c_row, _seen(c_seen, C), slot, steps, hidden, c_weight, c_shift, c_mean, c_var,
        c_stats, c_options, C, C_SHIFT, TRAINING,
        C_RENORM, SAVE,
    )  # fmt: skip
    tanh_c = tanh(c_out)
    h = o * tanh_c
    h = tl.where(real, h, tl.load(h_prev_ptr + at, mask=tile, other=0.0))
    c = tl.where(real, c, c_prev)
    tl.store(h_ptr + at, h, mask=tile)
    tl.store(c_ptr + at, c, mask=tile)
    if HALF:
        store_half(h_half_ptr, at, h, tile)
    if SAVE:
        gates = batch * width + units[None, :]
        tl.store(acts_ptr + gates, i, mask=tile)
        tl.store(acts_ptr + gates + hidden, f, mask=tile)
        tl.store(acts_ptr + gates + 2 * hidden, g, mask=tile)
        tl.store(acts_ptr + gates + 3 * hidden, o, mask=tile)
        tl.store(tanh_ptr + at, tanh_c, mask=tile)


@triton.jit
def _norm_backward(
    dy, x_ptr, at, tile, real, count, columns, valid, slot, steps, features, weight_ptr, stats_ptr, dweight_ptr,
    dshift_ptr, KIND: tl.constexpr, SHIFT: tl.constexpr, TRAINING: tl.constexpr,
):  # fmt: skip
    """dL/dx of one norm of a step's tile (BatchNorm, or the shift alone: its gradient summed here too)."""
    if KIND == 3:
        x = tl.load(x_ptr + at, mask=tile, other=0.0)
        return batch_backward(
            dy, x, real, count, columns, valid, slot, steps, features, weight_ptr, stats_ptr, dweight_ptr,
            dshift_ptr, TRAINING, SHIFT,
        )  # fmt: skip
    if SHIFT:
        total = tl.load(dshift_ptr + columns, mask=valid, other=0.0) + tl.sum(tl.where(real, dy, 0.0), axis=0)
        tl.store(dshift_ptr + columns, total, mask=valid)
    return dy


@triton.jit
def _gate_backward(
    k: tl.constexpr, d_term, d_recurrent, input_ptr, raw_ptr, d_input_ptr, d_raw_ptr, d_half_ptr, batch, real,
    count, tile, units, valid, hidden, width, slot, steps,
    ih_weight, ih_stats, ih_dweight, ih_dshift, hh_weight, hh_stats, hh_dweight, hh_dshift,
    IH: tl.constexpr, IH_SHIFT: tl.constexpr, HH: tl.constexpr, HH_SHIFT: tl.constexpr, TRAINING: tl.constexpr,
    HALF: tl.constexpr,
):  # fmt: skip
    """Gate ``k``'s terms' gradients through the recurrent norm (into ``d_raw``: W_hh h's; with ``HALF`` also into
    ``d_half``, for the step's product) and the input norm (into ``d_input``: W_ih x's, or the finished input
    term's)."""
    columns = k * hidden + units
    at = batch * width + columns[None, :]
    d_raw = _norm_backward(
        d_recurrent, raw_ptr, at, tile, real, count, columns, valid, slot, steps, width, hh_weight, hh_stats,
        hh_dweight, hh_dshift, HH, HH_SHIFT, TRAINING,
    )  # fmt: skip
    tl.store(d_raw_ptr + at, d_raw, mask=tile)
    if HALF:
        store_half(d_half_ptr, at, d_raw, tile)
    d_input = _norm_backward(
        d_term, input_ptr, at, tile, real, count, columns, valid, slot, steps, width, ih_weight, ih_stats,
        ih_dweight, ih_dshift, IH, IH_SHIFT, TRAINING,
    )  # fmt: skip
    tl.store(d_input_ptr + at, d_input, mask=tile)


@triton.jit(do_not_specialize=["slot", "steps"])
def lstm_columns_backward(
    grad_h_ptr, recurrent_ptr, carry_ptr, dc_ptr, mask_ptr, acts_ptr, tanh_ptr, c_ptr, c_prev_ptr,
    input_ptr, raw_ptr, d_input_ptr, d_raw_ptr, d_half_ptr,
    ih_weight, ih_stats, ih_dweight, ih_dshift, hh_weight, hh_stats, hh_dweight, hh_dshift,
    c_weight, c_stats, c_dweight, c_dshift,
    rows, hidden, slot, steps,
    IH: tl.constexpr, IH_SHIFT: tl.constexpr, HH: tl.constexpr, HH_SHIFT: tl.constexpr, C: tl.constexpr,
    C_SHIFT: tl.constexpr, TRAINING: tl.constexpr, HAS_MASK: tl.constexpr, HALF: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One LSTM step's backward of the hidden units ``program_id(0) * BLOCK + [0, BLOCK)`` for every row: dh and
    dc as :func:`seqnorm.kernels.triton_backend.recurrence.lstm_step_backward` takes them; writes the gradients of
    W_ih x (or the input term) and W_hh h (``HALF``: also in half precision), adds the norms' parameter gradients
    of the step."""
    units, valid, batch, real, count, tile = _tile(mask_ptr, rows, hidden, BLOCK_B, BLOCK, HAS_MASK)
    width = 4 * hidden
    at = batch * hidden + units[None, :]
    dh = tl.load(grad_h_ptr + at, mask=tile, other=0.0)
    dh += tl.load(recurrent_ptr + at, mask=tile, other=0.0) + tl.load(carry_ptr + at, mask=tile, other=0.0)
    dc = tl.load(dc_ptr + at, mask=tile, other=0.0)
    gates = batch * width + units[None, :]
    i = tl.load(acts_ptr + gates, mask=tile, other=0.0)
    f = tl.load(acts_ptr + gates + hidden, mask=tile, other=0.0)
    g = tl.load(acts_ptr + gates + 2 * hidden, mask=tile, other=0.0)
    o = tl.load(acts_ptr + gates + 3 * hidden, mask=tile, other=0.0)
    tanh_c = tl.load(tanh_ptr + at, mask=tile, other=0.0)
    d_o, d_c_out = lstm_output_backward(dh, o, tanh_c)
    d_c_out = tl.where(real, d_c_out, 0.0)
    d_c = _norm_backward(
        d_c_out, c_ptr, at, tile, real, count, units, valid, slot, steps, hidden, c_weight, c_stats, c_dweight,
        c_dshift, C, C_SHIFT, TRAINING,
    )  # fmt: skip
    dc_total = dc + d_c
    c_prev = tl.load(c_prev_ptr + at, mask=tile, other=0.0)
    place = (input_ptr, raw_ptr, d_input_ptr, d_raw_ptr, d_half_ptr, batch, real, count, tile, units, valid, hidden,
             width, slot, steps, ih_weight, ih_stats, ih_dweight, ih_dshift, hh_weight, hh_stats, hh_dweight,
             hh_dshift)  # fmt: skip
    flags = (IH, IH_SHIFT, HH, HH_SHIFT, TRAINING, HALF)
    d_i, d_f, d_g, dc_prev = lstm_backward(dc_total, i, f, g, c_prev)
    d_i = tl.where(real, d_i, 0.0)
    d_f = tl.where(real, d_f, 0.0)
    d_g = tl.where(real, d_g, 0.0)
    d_o = tl.where(real, d_o, 0.0)
    _gate_backward(0, d_i, d_i, *place, *flags)
    _gate_backward(1, d_f, d_f, *place, *flags)
    _gate_backward(2, d_g, d_g, *place, *flags)
    _gate_backward(3, d_o, d_o, *place, *flags)
    tl.store(dc_ptr + at, tl.where(real, dc_prev, dc), mask=tile)
    tl.store(carry_ptr + at, tl.where(real, 0.0, dh), mask=tile)


@triton.jit(do_not_specialize=["ih_row", "hh_row", "slot", "steps"])
def gru_columns(
    input_ptr, raw_ptr, h_prev_ptr, mask_ptr, h_ptr, acts_ptr, u_ptr, h_half_ptr,
    ih_weight, ih_shift, ih_mean, ih_var, ih_stats, ih_options, ih_row, ih_seen,
    hh_weight, hh_shift, hh_mean, hh_var, hh_stats, hh_options, hh_row, hh_seen,
    rows, hidden, slot, steps,
    IH: tl.constexpr, IH_SHIFT: tl.constexpr, IH_RENORM: tl.constexpr,
    HH: tl.constexpr, HH_SHIFT: tl.constexpr, HH_RENORM: tl.constexpr, TRAINING: tl.constexpr,
    HAS_MASK: tl.constexpr, SAVE: tl.constexpr, HALF: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One GRU step of the hidden units ``program_id(0) * BLOCK + [0, BLOCK)`` for every row (``HALF`` as for
    :func:`lstm_columns`); saves the gates (r, z, n) and the recurrent terms u for the backward."""
    units, valid, batch, real, count, tile = _tile(mask_ptr, rows, hidden, BLOCK_B, BLOCK, HAS_MASK)
    width = 3 * hidden
    ih_seen = _seen(ih_seen, IH)
    hh_seen = _seen(hh_seen, HH)
    norms = (
        ih_weight, ih_shift, ih_mean, ih_var, ih_stats, ih_options, ih_row, ih_seen,
        hh_weight, hh_shift, hh_mean, hh_var, hh_stats, hh_options, hh_row, hh_seen,
    )  # fmt: skip
    place = (input_ptr, raw_ptr, batch, real, count, tile, units, valid, hidden, width, slot, steps)
    flags = (IH, IH_SHIFT, IH_RENORM, HH, HH_SHIFT, HH_RENORM, TRAINING, SAVE)
    a_r, u_r = _terms(0, *place, *norms, *flags)
    a_z, u_z = _terms(1, *place, *norms, *flags)
    a_n, u_n = _terms(2, *place, *norms, *flags)
    at = batch * hidden + units[None, :]
    h_prev = tl.load(h_prev_ptr + at, mask=tile, other=0.0)
    r, z, n, h = gru_gates(a_r, a_z, a_n, u_r, u_z, u_n, h_prev)
    h = tl.where(real, h, h_prev)
    tl.store(h_ptr + at, h, mask=tile)
    if HALF:
        store_half(h_half_ptr, at, h, tile)
    if SAVE:
        gates = batch * width + units[None, :]
        tl.store(acts_ptr + gates, r, mask=tile)
        tl.store(acts_ptr + gates + hidden, z, mask=tile)
        tl.store(acts_ptr + gates + 2 * hidden, n, mask=tile)
        tl.store(u_ptr + gates, u_r, mask=tile)
        tl.store(u_ptr + gates + hidden, u_z, mask=tile)
        tl.store(u_ptr + gates + 2 * hidden, u_n, mask=tile)


@triton.jit(do_not_specialize=["slot", "steps"])
def gru_columns_backward(
    grad_h_ptr, recurrent_ptr, carry_ptr, mask_ptr, acts_ptr, u_ptr, h_prev_ptr,
    input_ptr, raw_ptr, d_input_ptr, d_raw_ptr, d_half_ptr,
    ih_weight, ih_stats, ih_dweight, ih_dshift, hh_weight, hh_stats, hh_dweight, hh_dshift,
    rows, hidden, slot, steps,
    IH: tl.constexpr, IH_SHIFT: tl.constexpr, HH: tl.constexpr, HH_SHIFT: tl.constexpr, TRAINING: tl.constexpr,
    HAS_MASK: tl.constexpr, HALF: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One GRU step's backward of the hidden units ``program_id(0) * BLOCK + [0, BLOCK)`` for every row (dh as for
    :func:`lstm_columns_backward`)."""
    units, valid, batch, real, count, tile = _tile(mask_ptr, rows, hidden, BLOCK_B, BLOCK, HAS_MASK)
    width = 3 * hidden
    at = batch * hidden + units[None, :]
    dh = tl.load(grad_h_ptr + at, mask=tile, other=0.0)
    dh += tl.load(recurrent_ptr + at, mask=tile, other=0.0) + tl.load(carry_ptr + at, mask=tile, other=0.0)
    gates = batch * width + units[None, :]
    r = tl.load(acts_ptr + gates, mask=tile, other=0.0)
    z = tl.load(acts_ptr + gates + hidden, mask=tile, other=0.0)
    n = tl.load(acts_ptr + gates + 2 * hidden, mask=tile, other=0.0)
    u_n = tl.load(u_ptr + gates + 2 * hidden, mask=tile, other=0.0)
    h_prev = tl.load(h_prev_ptr + at, mask=tile, other=0.0)
    d_r, d_z, d_n, d_u_n, carry = gru_backward(dh, r, z, n, u_n, h_prev)
    d_r = tl.where(real, d_r, 0.0)
    d_z = tl.where(real, d_z, 0.0)
    place = (input_ptr, raw_ptr, d_input_ptr, d_raw_ptr, d_half_ptr, batch, real, count, tile, units, valid, hidden,
             width, slot, steps, ih_weight, ih_stats, ih_dweight, ih_dshift, hh_weight, hh_stats, hh_dweight,
             hh_dshift)  # fmt: skip
    flags = (IH, IH_SHIFT, HH, HH_SHIFT, TRAINING, HALF)
    _gate_backward(0, d_r, d_r, *place, *flags)
    _gate_backward(1, d_z, d_z, *place, *flags)
    _gate_backward(2, tl.where(real, d_n, 0.0), tl.where(real, d_u_n, 0.0), *place, *flags)
    tl.store(carry_ptr + at, tl.where(real, carry, dh), mask=tile)
