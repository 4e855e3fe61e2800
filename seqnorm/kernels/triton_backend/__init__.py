"""seqnorm's Triton backend: the normalized LSTM/GRU recurrence for CUDA tensors (and, with ``TRITON_INTERPRET=1``,
CPU tensors through Triton's interpreter, which is how the tests run it).

The split is haste's: the input projection and the input norm of all steps at once; per step one ``torch.mm``
(cuBLAS on a GPU) into a preallocated buffer and one fused Triton kernel; the backward the same way in reverse, with
the weight and input gradients as large matmuls after the loop. The entry points have the C++ kernels' signatures
(:class:`seqnorm.kernels.backend.Backend`), so the autograd Function of :mod:`seqnorm.layers.kernel` and the plan run
unchanged. Nothing here reads a value back to the host inside the loops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
from torch import Tensor

from seqnorm.kernels import KernelNorm
from seqnorm.kernels.triton_backend import recurrence
from seqnorm.kernels.triton_backend.norms import KINDS, rows_backward, rows_forward

__all__ = [
    "NormArgs",
    "cache_info",
    "empty_cache",
    "empty_like_saved",
    "generation_step",
    "gru_backward",
    "gru_forward",
    "lstm_backward",
    "lstm_forward",
    "name",
    "prepare_step",
    "set_cache_limit",
    "unsupported",
]

_ROWS_EACH = 64  # rows a program of the whole-block backward sums its parameter gradients over


def NormArgs(**fields: Any) -> KernelNorm:
    """A norm's arguments (:meth:`seqnorm.kernels.KernelNorm.native`): for this backend, the ``KernelNorm`` itself."""
    return KernelNorm(**fields)


def _code(norm: KernelNorm) -> int:
    return KINDS[norm.kind]


def _identity(norm: KernelNorm) -> bool:
    """No norm and no shift: the output is the input."""
    return norm.kind == "none" and norm.shift is None


name = "triton"
"""The plan's path for this backend (``layer.plan(x).path``)."""


def unsupported(kind: str, dtype: torch.dtype) -> str | None:
    """Why this backend cannot run a norm of ``kind`` in ``dtype`` (``None``: it can)."""
    if kind not in KINDS:
        return f"the Triton backend runs no {kind!r} norm yet"
    return None if dtype in (torch.float32, torch.float64) else f"dtype {dtype}"


def prepare_step(weights: tuple[Tensor, Tensor], rows: int, fixed: Callable[[Tensor, Tensor], Any]) -> Any:
    """The generation step on the transposed views of the weights (cuBLAS takes either layout alike)."""
    del rows
    return fixed(*(weight.t() for weight in weights))


# --- memory: torch's caching allocator keeps CUDA memory; nothing is kept here ---


def empty_like_saved(sizes: list[int], like: Tensor) -> Tensor:
    return like.new_empty(sizes)


def empty_cache() -> None:
    """Nothing to let go: this backend keeps no memory of its own (torch's allocator does)."""


def set_cache_limit(nbytes: int) -> None:
    del nbytes


def cache_info() -> tuple[int, int, int, int]:
    return (0, 0, 0, 0)


# --- helpers ---


def _block(hidden: int) -> int:
    return triton.next_power_of_2(hidden)


def _param(tensor: Tensor | None, like: Tensor) -> Tensor:
    """A norm's γ or shift, or ``like`` where it has none (the kernels do not read it then)."""
    return like if tensor is None else tensor


def _normalize_rows(x: Tensor, norm: KernelNorm) -> tuple[Tensor, list[Tensor]]:
    """``γ N(x) + shift`` of every row of ``x`` (..., F) at once, and the statistics its backward needs."""
    if _identity(norm):
        return x, []
    features = x.shape[-1]
    flat = x.reshape(-1, features)
    out = torch.empty_like(flat)
    mean = flat.new_empty(flat.shape[0])
    rstd = flat.new_empty(flat.shape[0])
    rows_forward[(flat.shape[0],)](
        flat, out, _param(norm.weight, flat), _param(norm.shift, flat), mean, rstd, features, norm.eps,
        KIND=_code(norm), SHIFT=norm.shift is not None, BLOCK=_block(features),
    )  # fmt: skip
    stats = [mean.view(x.shape[:-1]), rstd.view(x.shape[:-1])] if _code(norm) else []
    return out.view(x.shape), stats


def _rows_backward(
    dy: Tensor, x: Tensor, stats: list[Tensor], norm: KernelNorm, want_dx: bool
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """dx (``want_dx``), dL/dγ and dL/dshift of a norm applied to every row of ``x`` (..., F), given dL/dy."""
    if _identity(norm):
        return dy if want_dx else None, None, None
    features = x.shape[-1]
    flat_dy, flat_x = dy.reshape(-1, features), x.reshape(-1, features)
    rows = flat_dy.shape[0]
    programs = triton.cdiv(rows, _ROWS_EACH)
    dweight = flat_dy.new_empty(programs, features)
    dshift = flat_dy.new_empty(programs, features)
    write_dx = want_dx and _code(norm) != 0
    dx = torch.empty_like(flat_dy) if write_dx else flat_dy
    mean, rstd = (stats[0].reshape(-1), stats[1].reshape(-1)) if _code(norm) else (flat_dy, flat_dy)
    rows_backward[(programs,)](
        flat_dy, flat_x, mean, rstd, _param(norm.weight, flat_dy), dx, dweight, dshift, rows, features,
        KIND=_code(norm), WRITE_DX=write_dx, ROWS_EACH=_ROWS_EACH, BLOCK=_block(features),
    )  # fmt: skip
    grad_weight = dweight.sum(0) if norm.weight is not None and _code(norm) else None
    grad_shift = dshift.sum(0) if norm.shift is not None else None
    return (dx.view(dy.shape) if want_dx else None), grad_weight, grad_shift


def _mask_arg(mask: Tensor | None, like: Tensor) -> Tensor:
    return like if mask is None else mask


def _projection_grads(
    grad_inputs: Tensor, sequence: Tensor | None, weight_ih: Tensor | None, want_input: bool, want_weight: bool
) -> tuple[Tensor | None, Tensor | None]:
    """The input's gradient (of x with a projection W_ih x, else of the input terms) and W_ih's, as large matmuls."""
    if sequence is None or weight_ih is None:
        return (grad_inputs if want_input else None), None
    flat = grad_inputs.reshape(-1, grad_inputs.shape[-1])
    grad_x = (flat @ weight_ih).view(*sequence.shape[:-1], weight_ih.shape[1]) if want_input else None
    grad_w = flat.t() @ sequence.reshape(-1, sequence.shape[-1]) if want_weight else None
    return grad_x, grad_w


def _previous_states(h0: Tensor, hs: Tensor) -> Tensor:
    """Each step's h_{t-1}, (T, B, H): h0, then hs but the last."""
    return torch.cat([h0.unsqueeze(0), hs[:-1]])


# --- LSTM ---


def lstm_forward(
    inputs: Tensor, h0: Tensor, c0: Tensor, weight_hh: Tensor, mask: Tensor | None,
    ih: KernelNorm, hh: KernelNorm, c_norm: KernelNorm, save: bool,
) -> tuple[list[Tensor], list[Tensor | None], list[list[Tensor]], list[int]]:  # fmt: skip
    """The C++ ``lstm_forward``'s contract: ``([hs, h_n, c_n], saved, stats, fallbacks)``."""
    steps, rows, width = inputs.shape
    hidden = width // 4
    terms, ih_stats = _normalize_rows(inputs, ih)
    kept = steps if save else 1
    hs = inputs.new_empty(steps, rows, hidden)
    cs = inputs.new_empty(steps if save else 2, rows, hidden)
    acts = inputs.new_empty(kept, rows, width)
    tanh_cs = inputs.new_empty(kept, rows, hidden)
    raw = inputs.new_empty(kept, rows, width)
    hh_stats = [inputs.new_empty(kept, rows), inputs.new_empty(kept, rows)] if _code(hh) else []
    c_stats = [inputs.new_empty(kept, rows), inputs.new_empty(kept, rows)] if _code(c_norm) else []
    scratch = hs  # what a pointer the kernel does not read points at
    weight_t = weight_hh.t()
    for t in range(steps):
        slot = t if save else 0
        c_slot = t if save else t % 2
        h_prev = h0 if t == 0 else hs[t - 1]
        c_prev = c0 if t == 0 else cs[t - 1 if save else (t - 1) % 2]
        torch.mm(h_prev, weight_t, out=raw[slot])
        recurrence.lstm_step[(rows,)](
            terms[t], raw[slot], h_prev, c_prev, _mask_arg(None if mask is None else mask[t], scratch),
            scratch, scratch, _param(hh.weight, scratch), _param(hh.shift, scratch),
            _param(c_norm.weight, scratch), _param(c_norm.shift, scratch),
            hs[t], cs[c_slot], acts[slot], tanh_cs[slot],
            *(stat[slot] for stat in hh_stats or (scratch, scratch)),
            *(stat[slot] for stat in c_stats or (scratch, scratch)),
            hidden, 0.0, hh.eps, c_norm.eps,
            IH=0, IH_SHIFT=False, HH=_code(hh), HH_SHIFT=hh.shift is not None,
            C=_code(c_norm), C_SHIFT=c_norm.shift is not None, HAS_MASK=mask is not None, SAVE=save,
            BLOCK=_block(hidden),
        )  # fmt: skip
    h_n, c_n = hs[-1].clone(), cs[-1 if save else (steps - 1) % 2].clone()
    saved: list[Tensor | None] = [cs, acts, tanh_cs, raw if _code(hh) else None] if save else []
    stats = [ih_stats, hh_stats, c_stats] if save else []
    return [hs, h_n, c_n], saved, stats, [0, 0, 0]


def lstm_backward(
    grad_hs: Tensor, grad_h_n: Tensor, grad_c_n: Tensor, inputs: Tensor, h0: Tensor, c0: Tensor,
    weight_hh: Tensor, mask: Tensor | None, hs: Tensor, saved: list[Tensor], raw: Tensor | None,
    stats: list[list[Tensor]], ih: KernelNorm, hh: KernelNorm, c_norm: KernelNorm,
    sequence: Tensor | None, weight_ih: Tensor | None, want_input: bool, want_weight_ih: bool,
) -> list[Tensor | None]:  # fmt: skip
    """The C++ ``lstm_backward``'s contract: gradients of the input (x with a projection), h0, c0, W_hh, (γ, shift)
    of the input, recurrent and cell-state norms, then W_ih (with a projection)."""
    cs, acts, tanh_cs = saved
    ih_stats, hh_stats, c_stats = stats
    steps, rows, width = acts.shape
    hidden = width // 4
    d_pre = acts.new_empty(steps, rows, width)
    d_raw = acts.new_empty(steps, rows, width) if _code(hh) else d_pre
    keep_c_out = not _identity(c_norm)
    d_c_out = acts.new_empty(steps, rows, hidden) if keep_c_out else d_pre
    recurrent = torch.zeros_like(h0)
    carry = grad_h_n.clone()
    dc = grad_c_n.clone()
    scratch = hs
    for t in range(steps - 1, -1, -1):
        c_prev = c0 if t == 0 else cs[t - 1]
        recurrence.lstm_step_backward[(rows,)](
            grad_hs[t], recurrent, carry, dc, _mask_arg(None if mask is None else mask[t], scratch),
            acts[t], tanh_cs[t], cs[t], c_prev, raw[t] if raw is not None else scratch,
            _param(hh.weight, scratch), _param(c_norm.weight, scratch),
            *(stat[t] for stat in hh_stats or (scratch, scratch)),
            *(stat[t] for stat in c_stats or (scratch, scratch)),
            d_pre[t], d_raw[t], d_c_out[t] if keep_c_out else scratch,
            hidden,
            HH=_code(hh), C=_code(c_norm), KEEP_C_OUT=keep_c_out, HAS_MASK=mask is not None, BLOCK=_block(hidden),
        )  # fmt: skip
        torch.mm(d_raw[t], weight_hh, out=recurrent)
    grad_h0 = recurrent + carry
    grad_weight_hh = d_raw.reshape(-1, width).t() @ _previous_states(h0, hs).reshape(-1, hidden)
    _, hh_weight, hh_shift = _rows_backward(d_pre, raw if raw is not None else d_pre, hh_stats, hh, False)
    _, c_weight, c_shift = _rows_backward(d_c_out, cs, c_stats, c_norm, False) if keep_c_out else (None, None, None)
    grad_inputs, ih_weight, ih_shift = _rows_backward(d_pre, inputs, ih_stats, ih, True)
    grad_x, grad_weight_ih = _projection_grads(grad_inputs, sequence, weight_ih, want_input, want_weight_ih)
    return [grad_x, grad_h0, dc, grad_weight_hh, ih_weight, ih_shift, hh_weight, hh_shift, c_weight, c_shift,
            grad_weight_ih]  # fmt: skip


# --- GRU ---


def gru_forward(
    inputs: Tensor, h0: Tensor, weight_hh: Tensor, mask: Tensor | None, ih: KernelNorm, hh: KernelNorm, save: bool
) -> tuple[list[Tensor], list[Tensor], list[list[Tensor]], list[int]]:
    """The C++ ``gru_forward``'s contract: ``([hs, h_n], saved, stats, fallbacks)``."""
    steps, rows, width = inputs.shape
    hidden = width // 3
    terms, ih_stats = _normalize_rows(inputs, ih)
    kept = steps if save else 1
    hs = inputs.new_empty(steps, rows, hidden)
    acts = inputs.new_empty(kept, rows, width)
    us = inputs.new_empty(kept, rows, width)
    raw = inputs.new_empty(kept, rows, width)
    hh_stats = [inputs.new_empty(kept, rows), inputs.new_empty(kept, rows)] if _code(hh) else []
    scratch = hs
    weight_t = weight_hh.t()
    for t in range(steps):
        slot = t if save else 0
        h_prev = h0 if t == 0 else hs[t - 1]
        torch.mm(h_prev, weight_t, out=raw[slot])
        recurrence.gru_step[(rows,)](
            terms[t], raw[slot], h_prev, _mask_arg(None if mask is None else mask[t], scratch),
            scratch, scratch, _param(hh.weight, scratch), _param(hh.shift, scratch),
            hs[t], acts[slot], us[slot], *(stat[slot] for stat in hh_stats or (scratch, scratch)),
            hidden, 0.0, hh.eps,
            IH=0, IH_SHIFT=False, HH=_code(hh), HH_SHIFT=hh.shift is not None, HAS_MASK=mask is not None, SAVE=save,
            BLOCK=_block(hidden),
        )  # fmt: skip
    saved = [acts, us, raw] if save else []
    stats = [ih_stats, hh_stats] if save else []
    return [hs, hs[-1].clone()], saved, stats, [0, 0]


def gru_backward(
    grad_hs: Tensor, grad_h_n: Tensor, inputs: Tensor, h0: Tensor, weight_hh: Tensor, mask: Tensor | None,
    hs: Tensor, saved: list[Tensor], stats: list[list[Tensor]], ih: KernelNorm, hh: KernelNorm,
    sequence: Tensor | None, weight_ih: Tensor | None, want_input: bool, want_weight_ih: bool,
) -> list[Tensor | None]:  # fmt: skip
    """The C++ ``gru_backward``'s contract: gradients of the input (x with a projection), h0, W_hh, (γ, shift) of the
    input and recurrent norms, then W_ih (with a projection)."""
    acts, us, raw = saved
    ih_stats, hh_stats = stats
    steps, rows, width = acts.shape
    hidden = width // 3
    d_input = acts.new_empty(steps, rows, width)
    d_u = acts.new_empty(steps, rows, width)
    d_raw = acts.new_empty(steps, rows, width) if _code(hh) else d_u
    recurrent = torch.zeros_like(h0)
    carry = grad_h_n.clone()
    scratch = hs
    for t in range(steps - 1, -1, -1):
        h_prev = h0 if t == 0 else hs[t - 1]
        recurrence.gru_step_backward[(rows,)](
            grad_hs[t], recurrent, carry, _mask_arg(None if mask is None else mask[t], scratch),
            acts[t], us[t], h_prev, raw[t], _param(hh.weight, scratch),
            *(stat[t] for stat in hh_stats or (scratch, scratch)),
            d_input[t], d_u[t], d_raw[t], hidden,
            HH=_code(hh), HAS_MASK=mask is not None, BLOCK=_block(hidden),
        )  # fmt: skip
        torch.mm(d_raw[t], weight_hh, out=recurrent)
    grad_h0 = recurrent + carry
    grad_weight_hh = d_raw.reshape(-1, width).t() @ _previous_states(h0, hs).reshape(-1, hidden)
    _, hh_weight, hh_shift = _rows_backward(d_u, raw, hh_stats, hh, False)
    grad_inputs, ih_weight, ih_shift = _rows_backward(d_input, inputs, ih_stats, ih, True)
    grad_x, grad_weight_ih = _projection_grads(grad_inputs, sequence, weight_ih, want_input, want_weight_ih)
    return [grad_x, grad_h0, grad_weight_hh, ih_weight, ih_shift, hh_weight, hh_shift, grad_weight_ih]


# --- the generation step ---


def generation_step(
    cell: str, x: Tensor, h: Tensor, c: Tensor | None, weight_ih_t: Tensor, weight_hh_t: Tensor,
    ih: KernelNorm, hh: KernelNorm, c_norm: KernelNorm, step: int,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The C++ ``generation_step``'s contract: ``x`` ``(B, I)`` or ``(1, B, I)``, ``h``/``c`` ``(1, B, H)``;
    returns ``(h', c')`` ``(1, B, H)`` (``c'`` ``None`` for a GRU). Three launches: two products and one step."""
    del step  # the row norms have no per-step statistics
    x = x[0] if x.dim() == 3 else x
    rows, hidden = x.shape[0], weight_hh_t.shape[0]
    term = x @ weight_ih_t
    raw = h[0] @ weight_hh_t
    h_new = h.new_empty(1, rows, hidden)
    scratch = h_new
    norms = (_code(ih), ih.shift is not None, _code(hh), hh.shift is not None)
    if cell == "gru":
        recurrence.gru_step[(rows,)](
            term, raw, h[0], scratch, _param(ih.weight, scratch), _param(ih.shift, scratch),
            _param(hh.weight, scratch), _param(hh.shift, scratch),
            h_new, scratch, scratch, scratch, scratch, hidden, ih.eps, hh.eps,
            IH=norms[0], IH_SHIFT=norms[1], HH=norms[2], HH_SHIFT=norms[3], HAS_MASK=False, SAVE=False,
            BLOCK=_block(hidden),
        )  # fmt: skip
        return h_new, None
    assert c is not None
    c_new = h.new_empty(1, rows, hidden)
    recurrence.lstm_step[(rows,)](
        term, raw, h[0], c[0], scratch, _param(ih.weight, scratch), _param(ih.shift, scratch),
        _param(hh.weight, scratch), _param(hh.shift, scratch), _param(c_norm.weight, scratch),
        _param(c_norm.shift, scratch), h_new, c_new, scratch, scratch, scratch, scratch, scratch, scratch,
        hidden, ih.eps, hh.eps, c_norm.eps,
        IH=norms[0], IH_SHIFT=norms[1], HH=norms[2], HH_SHIFT=norms[3],
        C=_code(c_norm), C_SHIFT=c_norm.shift is not None, HAS_MASK=False, SAVE=False, BLOCK=_block(hidden),
    )  # fmt: skip
    return h_new, c_new


def describe() -> dict[str, Any]:
    """What this backend is (for ``status``)."""
    return {"name": "triton", "triton": triton.__version__}
