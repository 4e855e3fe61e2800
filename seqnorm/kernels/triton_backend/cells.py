"""The cells' gates in Triton, once: torch's LSTM step (gate order i, f, g, o) and GRU step (r, z, n) and their
backward, for both layouts of the recurrence's fused kernels (:mod:`.recurrence`, a row of the batch a program;
:mod:`.columns`, a block of features a program). Each piece takes the gates as separate tensors of one shape; the row
kernels hold a step's gates as a ``(4, BLOCK)`` tile, one row per gate, and take one out with :func:`gate`."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "gate",
    "gru_backward",
    "gru_gates",
    "lstm_activation",
    "lstm_backward",
    "lstm_cell",
    "lstm_output_backward",
    "sigmoid",
    "tanh",
]


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
def lstm_activation(pre, candidate):
    """σ of a gate's pre-activation, tanh for the candidate g (``candidate``: which elements are g's)."""
    return tl.where(candidate, tanh(pre), sigmoid(pre))


@triton.jit
def lstm_cell(i, f, g, c_prev):
    """c' = σ(f) c + σ(i) tanh(g), from the activations."""
    return f * c_prev + i * g


@triton.jit
def lstm_output_backward(dh, o, tanh_c):
    """From dh: the output gate's pre-activation gradient and the gradient reaching N_c's output."""
    return dh * tanh_c * o * (1.0 - o), dh * o * (1.0 - tanh_c * tanh_c)


@triton.jit
def lstm_backward(dc, i, f, g, c_prev):
    """Given dL/dc' (carried plus through N_c): the pre-activation gradients of i, f, g and dc for the previous step,
    σ(f) dc'."""
    return dc * g * i * (1.0 - i), dc * c_prev * f * (1.0 - f), dc * i * (1.0 - g * g), dc * f


# ---- GRU: u = N_hh(W_hh h) + b_hh, (r, z) = σ(a + u), n = tanh(a_n + r u_n), h' = (1 - z) n + z h -----------------


@triton.jit
def gru_gates(a_r, a_z, a_n, u_r, u_z, u_n, h_prev):
    """``(r, z, n, h')`` from the input terms ``a`` and the recurrent terms ``u``."""
    r = sigmoid(a_r + u_r)
    z = sigmoid(a_z + u_z)
    n = tanh(a_n + r * u_n)
    return r, z, n, (1.0 - z) * n + z * h_prev


@triton.jit
def gru_backward(dh, r, z, n, u_n, h_prev):
    """From dh: the pre-activation gradients of r, z, n (the input terms'; the recurrent terms' are the same for r and
    z), the recurrent candidate term's r d_n, and the carry dh z to the previous state."""
    d_n = dh * (1.0 - z) * (1.0 - n * n)
    d_z = dh * (h_prev - n) * z * (1.0 - z)
    d_r = d_n * u_n * r * (1.0 - r)
    return d_r, d_z, d_n, d_n * r, dh * z
