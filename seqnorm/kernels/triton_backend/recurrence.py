"""The recurrence's fused step kernels in Triton, composed from the norms' pieces (:mod:`.norms`) and the cells'
gates (:mod:`.cells`).

A forward step is ``torch.mm`` (``h W_hh^T`` into a preallocated buffer) and one launch of a step kernel, a program
per row of the batch taking the row from ``W_hh h`` through the recurrent norm, the gates, the cell update and the
cell-state norm to ``h'``; the backward step is one launch and one ``torch.mm``. Padded rows (``mask`` false) keep
their state and pass its gradient on unchanged.
"""

from __future__ import annotations

import triton
import triton.language as tl

from seqnorm.kernels.triton_backend.cells import (
    gate,
    gru_backward,
    gru_gates,
    lstm_activation,
    lstm_backward,
    lstm_cell,
    lstm_output_backward,
    tanh,
)
from seqnorm.kernels.triton_backend.norms import row_apply, row_backward, row_stats

__all__ = ["gru_step", "gru_step_backward", "lstm_step", "lstm_step_backward", "store_half"]


@triton.jit
def store_half(pointer, offsets, x, mask):
    """Store ``x`` at ``pointer + offsets`` in ``pointer``'s half-precision dtype, rounded to nearest even: the left
    operand of the next per-step product under autocast (:class:`~seqnorm.kernels.triton_backend.common.StepProduct`).
    Through float32, as torch's casts go; bfloat16's rounding is made exact in float32 first, since the
    interpreter's cast truncates."""
    half: tl.constexpr = pointer.dtype.element_ty
    x = x.to(tl.float32)
    if half == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        x = bits.to(tl.float32, bitcast=True)
    tl.store(pointer + offsets, x.to(half), mask=mask)


@triton.jit
def _tile(hidden, GATES: tl.constexpr, BLOCK: tl.constexpr):
    """A row's gates as a (4, BLOCK) tile: the gate index (a column), the feature index, each element's offset in the
    row, which elements exist (``GATES`` gates of ``hidden`` features), which features exist."""
    rows = tl.arange(0, 4)[:, None]
    columns = tl.arange(0, BLOCK)
    gate_offsets = rows * hidden + columns[None, :]
    return rows, columns, gate_offsets, (columns[None, :] < hidden) & (rows < GATES), columns < hidden


@triton.jit
def _load_param(pointer, offsets, valid, USED: tl.constexpr, like):
    """A norm's γ or shift where ``USED``, else a placeholder of ``like``'s shape (never read)."""
    if USED:
        return tl.load(pointer + offsets, mask=valid, other=0.0)
    return like


@triton.jit
def _normalized(x, valid, count, eps, weight_ptr, shift_ptr, offsets, KIND: tl.constexpr, SHIFT: tl.constexpr):
    """``γ N(x) + shift`` of one row and its ``(mean, rstd)``."""
    weight = _load_param(weight_ptr, offsets, valid, KIND != 0, x)
    shift = _load_param(shift_ptr, offsets, valid, SHIFT, x)
    mean, rstd = row_stats(x, valid, count, eps, KIND)
    return row_apply(x, mean, rstd, weight, shift, KIND, SHIFT), mean, rstd


@triton.jit
def lstm_step(
    input_ptr, raw_ptr, h_prev_ptr, c_prev_ptr, mask_ptr,
    ih_weight_ptr, ih_shift_ptr, hh_weight_ptr, hh_shift_ptr, c_weight_ptr, c_shift_ptr,
    h_ptr, c_ptr, acts_ptr, tanh_ptr, hh_mean_ptr, hh_rstd_ptr, c_mean_ptr, c_rstd_ptr, h_half_ptr,
    hidden, ih_eps, hh_eps, c_eps,
    IH: tl.constexpr, IH_SHIFT: tl.constexpr, HH: tl.constexpr, HH_SHIFT: tl.constexpr,
    C: tl.constexpr, C_SHIFT: tl.constexpr, HAS_MASK: tl.constexpr, SAVE: tl.constexpr, HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """One LSTM step of row ``program_id(0)``: pre = [N_ih(input) +] N_hh(raw) (+ shifts), the gates, c', N_c(c'),
    h'. ``input`` is the finished input term, or with ``IH`` (a generation step) W_ih x, normalized here. With
    ``HALF`` h' is written in ``h_half``'s half-precision dtype too, for the next step's product."""
    row = tl.program_id(0)
    rows, columns, gate_offsets, gate_valid, valid = _tile(hidden, 4, BLOCK)
    width = 4 * hidden
    term = tl.load(input_ptr + row * width + gate_offsets, mask=gate_valid, other=0.0)
    if IH != 0 or IH_SHIFT:
        term, _, _ = _normalized(
            term, gate_valid, width, ih_eps, ih_weight_ptr, ih_shift_ptr, gate_offsets, IH, IH_SHIFT
        )
    raw = tl.load(raw_ptr + row * width + gate_offsets, mask=gate_valid, other=0.0)
    recurrent, hh_mean, hh_rstd = _normalized(
        raw, gate_valid, width, hh_eps, hh_weight_ptr, hh_shift_ptr, gate_offsets, HH, HH_SHIFT
    )
    acts = lstm_activation(term + recurrent, rows == 2)
    c_prev = tl.load(c_prev_ptr + row * hidden + columns, mask=valid, other=0.0)
    c = lstm_cell(gate(acts, rows, 0), gate(acts, rows, 1), gate(acts, rows, 2), c_prev)
    c_out, c_mean, c_rstd = _normalized(c, valid, hidden, c_eps, c_weight_ptr, c_shift_ptr, columns, C, C_SHIFT)
    tanh_c = tanh(c_out)
    h = gate(acts, rows, 3) * tanh_c
    if HAS_MASK:
        real = tl.load(mask_ptr + row) != 0
        h = tl.where(real, h, tl.load(h_prev_ptr + row * hidden + columns, mask=valid, other=0.0))
        c = tl.where(real, c, c_prev)
    tl.store(h_ptr + row * hidden + columns, h, mask=valid)
    tl.store(c_ptr + row * hidden + columns, c, mask=valid)
    if HALF:
        store_half(h_half_ptr, row * hidden + columns, h, valid)
    if SAVE:
        tl.store(acts_ptr + row * width + gate_offsets, acts, mask=gate_valid)
        tl.store(tanh_ptr + row * hidden + columns, tanh_c, mask=valid)
        if HH != 0:
            tl.store(hh_mean_ptr + row, hh_mean)
            tl.store(hh_rstd_ptr + row, hh_rstd)
        if C != 0:
            tl.store(c_mean_ptr + row, c_mean)
            tl.store(c_rstd_ptr + row, c_rstd)


@triton.jit
def lstm_step_backward(
    grad_h_ptr, recurrent_ptr, carry_ptr, dc_ptr, mask_ptr,
    acts_ptr, tanh_ptr, c_ptr, c_prev_ptr, raw_ptr,
    hh_weight_ptr, c_weight_ptr, hh_mean_ptr, hh_rstd_ptr, c_mean_ptr, c_rstd_ptr,
    d_pre_ptr, d_raw_ptr, d_c_out_ptr, d_half_ptr,
    hidden,
    HH: tl.constexpr, C: tl.constexpr, KEEP_C_OUT: tl.constexpr, HAS_MASK: tl.constexpr, HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """One LSTM step's backward of row ``program_id(0)``: dh = grad_h + recurrent (dL/d(W_hh h) W_hh of the step
    after) + carry (what a padded row passed on); writes the pre-activations' gradient, W_hh h's (through N_hh;
    with ``HALF`` also into ``d_half``, in half precision, for the step's product), N_c's output gradient
    (``KEEP_C_OUT``, for its parameters), and updates dc and carry in place."""
    row = tl.program_id(0)
    rows, columns, gate_offsets, gate_valid, valid = _tile(hidden, 4, BLOCK)
    width = 4 * hidden
    at = row * hidden + columns
    dh = tl.load(grad_h_ptr + at, mask=valid, other=0.0)
    dh += tl.load(recurrent_ptr + at, mask=valid, other=0.0) + tl.load(carry_ptr + at, mask=valid, other=0.0)
    dc = tl.load(dc_ptr + at, mask=valid, other=0.0)
    acts = tl.load(acts_ptr + row * width + gate_offsets, mask=gate_valid, other=0.0)
    tanh_c = tl.load(tanh_ptr + at, mask=valid, other=0.0)
    c_prev = tl.load(c_prev_ptr + at, mask=valid, other=0.0)
    d_o, d_c_out = lstm_output_backward(dh, gate(acts, rows, 3), tanh_c)
    d_c = d_c_out
    if C != 0:
        c = tl.load(c_ptr + at, mask=valid, other=0.0)
        weight = tl.load(c_weight_ptr + columns, mask=valid, other=0.0)
        d_c = row_backward(d_c_out, c, valid, hidden, tl.load(c_mean_ptr + row), tl.load(c_rstd_ptr + row), weight, C)
    d_i, d_f, d_g, dc_prev = lstm_backward(
        dc + d_c, gate(acts, rows, 0), gate(acts, rows, 1), gate(acts, rows, 2), c_prev
    )
    d_pre = tl.where(
        rows == 0, d_i[None, :], tl.where(rows == 1, d_f[None, :], tl.where(rows == 2, d_g[None, :], d_o[None, :]))
    )
    real = columns >= 0
    if HAS_MASK:
        real = tl.load(mask_ptr + row) != 0
        d_pre = tl.where(real, d_pre, 0.0)
        d_c_out = tl.where(real, d_c_out, 0.0)
        dc_prev = tl.where(real, dc_prev, dc)
    tl.store(d_pre_ptr + row * width + gate_offsets, d_pre, mask=gate_valid)
    if KEEP_C_OUT:
        tl.store(d_c_out_ptr + at, d_c_out, mask=valid)
    if HH != 0:
        raw = tl.load(raw_ptr + row * width + gate_offsets, mask=gate_valid, other=0.0)
        weight = tl.load(hh_weight_ptr + gate_offsets, mask=gate_valid, other=0.0)
        mean = tl.load(hh_mean_ptr + row)
        rstd = tl.load(hh_rstd_ptr + row)
        d_raw = row_backward(d_pre, raw, gate_valid, width, mean, rstd, weight, HH)
        tl.store(d_raw_ptr + row * width + gate_offsets, d_raw, mask=gate_valid)
        if HALF:
            store_half(d_half_ptr, row * width + gate_offsets, d_raw, gate_valid)
    elif HALF:
        store_half(d_half_ptr, row * width + gate_offsets, d_pre, gate_valid)
    tl.store(dc_ptr + at, dc_prev, mask=valid)
    tl.store(carry_ptr + at, tl.where(real, 0.0, dh), mask=valid)


@triton.jit
def gru_step(
    input_ptr, raw_ptr, h_prev_ptr, mask_ptr,
    ih_weight_ptr, ih_shift_ptr, hh_weight_ptr, hh_shift_ptr,
    h_ptr, acts_ptr, u_ptr, hh_mean_ptr, hh_rstd_ptr, h_half_ptr,
    hidden, ih_eps, hh_eps,
    IH: tl.constexpr, IH_SHIFT: tl.constexpr, HH: tl.constexpr, HH_SHIFT: tl.constexpr,
    HAS_MASK: tl.constexpr, SAVE: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One GRU step of row ``program_id(0)``: u = N_hh(raw) + shift, the gates, h'; ``input`` and ``HALF`` as for
    :func:`lstm_step`. Saves the gates (r, z, n) and u for the backward."""
    row = tl.program_id(0)
    rows, columns, gate_offsets, gate_valid, valid = _tile(hidden, 3, BLOCK)
    width = 3 * hidden
    term = tl.load(input_ptr + row * width + gate_offsets, mask=gate_valid, other=0.0)
    if IH != 0 or IH_SHIFT:
        term, _, _ = _normalized(
            term, gate_valid, width, ih_eps, ih_weight_ptr, ih_shift_ptr, gate_offsets, IH, IH_SHIFT
        )
    raw = tl.load(raw_ptr + row * width + gate_offsets, mask=gate_valid, other=0.0)
    u, hh_mean, hh_rstd = _normalized(
        raw, gate_valid, width, hh_eps, hh_weight_ptr, hh_shift_ptr, gate_offsets, HH, HH_SHIFT
    )
    h_prev = tl.load(h_prev_ptr + row * hidden + columns, mask=valid, other=0.0)
    r, z, n, h = gru_gates(
        gate(term, rows, 0),
        gate(term, rows, 1),
        gate(term, rows, 2),
        gate(u, rows, 0),
        gate(u, rows, 1),
        gate(u, rows, 2),
        h_prev,
    )
    if HAS_MASK:
        h = tl.where(tl.load(mask_ptr + row) != 0, h, h_prev)
    tl.store(h_ptr + row * hidden + columns, h, mask=valid)
    if HALF:
        store_half(h_half_ptr, row * hidden + columns, h, valid)
    if SAVE:
        acts = tl.where(rows == 0, r[None, :], tl.where(rows == 1, z[None, :], n[None, :]))
        tl.store(acts_ptr + row * width + gate_offsets, acts, mask=gate_valid)
        tl.store(u_ptr + row * width + gate_offsets, u, mask=gate_valid)
        if HH != 0:
            tl.store(hh_mean_ptr + row, hh_mean)
            tl.store(hh_rstd_ptr + row, hh_rstd)


@triton.jit
def gru_step_backward(
    grad_h_ptr, recurrent_ptr, carry_ptr, mask_ptr,
    acts_ptr, u_ptr, h_prev_ptr, raw_ptr, hh_weight_ptr, hh_mean_ptr, hh_rstd_ptr,
    d_input_ptr, d_u_ptr, d_raw_ptr, d_half_ptr,
    hidden,
    HH: tl.constexpr, HAS_MASK: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One GRU step's backward of row ``program_id(0)`` (dh and ``HALF`` as in :func:`lstm_step_backward`): the
    input terms' gradient, u's (for N_hh's parameters) and W_hh h's through N_hh; the carry dh z (dh for a padded
    row)."""
    row = tl.program_id(0)
    rows, columns, gate_offsets, gate_valid, valid = _tile(hidden, 3, BLOCK)
    width = 3 * hidden
    at = row * hidden + columns
    dh = tl.load(grad_h_ptr + at, mask=valid, other=0.0)
    dh += tl.load(recurrent_ptr + at, mask=valid, other=0.0) + tl.load(carry_ptr + at, mask=valid, other=0.0)
    acts = tl.load(acts_ptr + row * width + gate_offsets, mask=gate_valid, other=0.0)
    u = tl.load(u_ptr + row * width + gate_offsets, mask=gate_valid, other=0.0)
    h_prev = tl.load(h_prev_ptr + at, mask=valid, other=0.0)
    d_r, d_z, d_n, d_u_n, carry = gru_backward(
        dh, gate(acts, rows, 0), gate(acts, rows, 1), gate(acts, rows, 2), gate(u, rows, 2), h_prev
    )
    d_a = tl.where(rows == 0, d_r[None, :], tl.where(rows == 1, d_z[None, :], d_n[None, :]))
    d_u = tl.where(rows == 2, d_u_n[None, :], d_a)
    if HAS_MASK:
        real = tl.load(mask_ptr + row) != 0
        d_a = tl.where(real, d_a, 0.0)
        d_u = tl.where(real, d_u, 0.0)
        carry = tl.where(real, carry, dh)
    tl.store(d_input_ptr + row * width + gate_offsets, d_a, mask=gate_valid)
    tl.store(d_u_ptr + row * width + gate_offsets, d_u, mask=gate_valid)
    if HH != 0:
        raw = tl.load(raw_ptr + row * width + gate_offsets, mask=gate_valid, other=0.0)
        weight = tl.load(hh_weight_ptr + gate_offsets, mask=gate_valid, other=0.0)
        d_raw = row_backward(
            d_u, raw, gate_valid, width, tl.load(hh_mean_ptr + row), tl.load(hh_rstd_ptr + row), weight, HH
        )
        tl.store(d_raw_ptr + row * width + gate_offsets, d_raw, mask=gate_valid)
        if HALF:
            store_half(d_half_ptr, row * width + gate_offsets, d_raw, gate_valid)
    elif HALF:
        store_half(d_half_ptr, row * width + gate_offsets, d_u, gate_valid)
    tl.store(carry_ptr + at, carry, mask=valid)
