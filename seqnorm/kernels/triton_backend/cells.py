"""The cells' gates in Triton, once: torch's LSTM step (gate order i, f, g, o) and GRU step (r, z, n) and their
backward, for the recurrence's fused kernels (:mod:`.recurrence`). A step's gates are a ``(4, BLOCK)`` tile, one row
per gate (a GRU's fourth row unused); :func:`gate` takes one row out as a vector."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["gate", "gru_backward", "gru_gates", "lstm_activations", "lstm_backward", "lstm_output_backward", "tanh"]


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def tanh(x):
    # 2σ(2x) - 1: tl.math's tanh is libdevice's, which Triton's CPU interpreter does not run
    return 2.0 * sigmoid(2.0 * x) - 1.0


@triton.jit
def gate(tile, rows, k):
    """Row ``k`` of a gates tile (``rows``: the tile's row index, a column vector)."""
    return tl.sum(tl.where(rows == k, tile, 0.0), axis=0)


# ---- LSTM: (i, f, g, o) = pre, c' = σ(f) c + σ(i) tanh(g), h' = σ(o) tanh(N_c(c')) ---------------------------------


@triton.jit
def lstm_activations(pre, rows):
    """``(σ(i), σ(f), tanh(g), σ(o))`` of the pre-activations tile."""
    return tl.where(rows == 2, tanh(pre), sigmoid(pre))


@triton.jit
def lstm_output_backward(dh, o, tanh_c):
    """From dh: the output gate's pre-activation gradient and the gradient reaching N_c's output."""
    return dh * tanh_c * o * (1.0 - o), dh * o * (1.0 - tanh_c * tanh_c)


@triton.jit
def lstm_backward(dc, acts, rows, c_prev, d_o):
    """Given dL/dc' (carried plus through N_c) and the output gate's gradient ``d_o``: the pre-activations'
    gradient tile and dc for the previous step, σ(f) dc'."""
    i = gate(acts, rows, 0)
    f = gate(acts, rows, 1)
    g = gate(acts, rows, 2)
    d_i = dc * g * i * (1.0 - i)
    d_f = dc * c_prev * f * (1.0 - f)
    d_g = dc * i * (1.0 - g * g)
    d_pre = tl.where(rows == 0, d_i[None, :], tl.where(rows == 1, d_f[None, :], tl.where(rows == 2, d_g, d_o)))
    return d_pre, dc * f


# ---- GRU: u = N_hh(W_hh h) + b_hh, (r, z) = σ(a + u), n = tanh(a_n + r u_n), h' = (1 - z) n + z h -----------------


@triton.jit
def gru_gates(a, u, rows, h_prev):
    """``(r, z, n, h')`` from the input terms ``a`` and the recurrent terms ``u`` (tiles)."""
    r = sigmoid(gate(a, rows, 0) + gate(u, rows, 0))
    z = sigmoid(gate(a, rows, 1) + gate(u, rows, 1))
    n = tanh(gate(a, rows, 2) + r * gate(u, rows, 2))
    return r, z, n, (1.0 - z) * n + z * h_prev


@triton.jit
def gru_backward(dh, r, z, n, u_n, h_prev, rows):
    """From dh: the input terms' gradient tile, the recurrent terms' gradient tile (its n row gated by r) and the
    carry dh z to the previous state."""
    d_n = dh * (1.0 - z) * (1.0 - n * n)
    d_z = dh * (h_prev - n) * z * (1.0 - z)
    d_r = d_n * u_n * r * (1.0 - r)
    d_a = tl.where(rows == 0, d_r[None, :], tl.where(rows == 1, d_z[None, :], d_n[None, :]))
    d_u = tl.where(rows == 2, (d_n * r)[None, :], d_a)
    return d_a, d_u, dh * z
