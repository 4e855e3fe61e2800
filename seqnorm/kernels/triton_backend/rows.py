"""The Triton backend's row layout: a program per row of the batch, for cells whose norms keep their statistics per
row (none, LayerNorm, RMSNorm), and the generation step (where per-timestep BatchNorm comes folded into a scale and
an offset per feature). Launches the kernels of :mod:`.recurrence`."""

from __future__ import annotations

import torch
from torch import Tensor

from seqnorm.kernels.backend import KernelNorm
from seqnorm.kernels.triton_backend import graphs, recurrence
from seqnorm.kernels.triton_backend.common import (
    StepProduct,
    block,
    code,
    gru_outputs,
    identity,
    lstm_outputs,
    mask_arg,
    normalize_rows,
    param,
    previous_states,
    projection_grads,
    rows_backward_all,
)
from seqnorm.kernels.triton_backend.launch import launch

# --- LSTM ---


def lstm_forward(
    inputs: Tensor, h0: Tensor, c0: Tensor, weight_hh: Tensor, mask: Tensor | None,
    ih: KernelNorm, hh: KernelNorm, c_norm: KernelNorm, save: bool, *, half: torch.dtype | None = None,
) -> tuple[list[Tensor], list[Tensor | None], list[list[Tensor]], list[int]]:  # fmt: skip
    """The C++ ``lstm_forward``'s contract: ``([hs, h_n, c_n], saved, stats, fallbacks)``; ``half``: the per-step
    product's operands' dtype (:class:`~seqnorm.kernels.triton_backend.common.StepProduct`)."""
    terms, ih_stats = normalize_rows(inputs, ih)
    tensors = (terms, h0, c0, weight_hh, mask, hh.weight, hh.shift, c_norm.weight, c_norm.shift)
    settings = {"hh": code(hh), "c_norm": code(c_norm), "hh_eps": hh.eps, "c_eps": c_norm.eps, "save": save,
                "half": half}  # fmt: skip
    hs, cs, acts, tanh_cs, raw, *rest = graphs.GRAPHS.run("lstm_forward", lstm_forward_loop, tensors, **settings)
    hh_stats, c_stats = rest[: 2 if code(hh) else 0], rest[2 if code(hh) else 0 :]
    steps = inputs.shape[0]
    h_n, c_n = hs[-1].clone(), cs[-1 if save else (steps - 1) % 2].clone()
    saved: list[Tensor | None] = [cs, acts, tanh_cs, raw if code(hh) else None] if save else []
    stats = [ih_stats, hh_stats, c_stats] if save else []
    return [hs, h_n, c_n], saved, stats, [0, 0, 0]


def lstm_forward_loop(
    terms: Tensor, h0: Tensor, c0: Tensor, weight_hh: Tensor, mask: Tensor | None, hh_weight: Tensor | None,
    hh_shift: Tensor | None, c_weight: Tensor | None, c_shift: Tensor | None,
    *, hh: int, c_norm: int, hh_eps: float, c_eps: float, save: bool, half: torch.dtype | None,
) -> tuple[Tensor, ...]:  # fmt: skip
    """The forward time loop, a function of its tensors (:mod:`.graphs` may capture it): ``hs, cs, acts, tanh_cs,
    raw``, then the recurrent norm's statistics and the cell-state norm's (each a mean and a 1/std, where it has
    them). ``hh``/``c_norm``: the norms' kinds (:func:`code`); ``half``: the product's operands' dtype."""
    steps, rows, width = terms.shape
    hidden = width // 4
    kept, hs, cs, acts, tanh_cs, raw = lstm_outputs(terms, save)
    hh_stats = [terms.new_empty(kept, rows), terms.new_empty(kept, rows)] if hh else []
    c_stats = [terms.new_empty(kept, rows), terms.new_empty(kept, rows)] if c_norm else []
    scratch = h0  # what a pointer the kernel does not read points at (small: the interpreter copies each argument)
    product = StepProduct.forward(weight_hh, h0, half)
    for t in range(steps):
        slot = t if save else 0
        c_slot = t if save else t % 2
        h_prev = h0 if t == 0 else hs[t - 1]
        c_prev = c0 if t == 0 else cs[t - 1 if save else (t - 1) % 2]
        product(h_prev, t - 1, raw[slot])
        launch(
            recurrence.lstm_step, (rows,),
            terms[t], raw[slot], h_prev, c_prev, mask_arg(None if mask is None else mask[t], scratch),
            scratch, scratch, param(hh_weight, scratch), param(hh_shift, scratch),
            param(c_weight, scratch), param(c_shift, scratch),
            hs[t], cs[c_slot], acts[slot], tanh_cs[slot],
            *_at(hh_stats, slot, scratch), *_at(c_stats, slot, scratch), product.operand(t),
            hidden, 0.0, hh_eps, c_eps,
            IH=0, IH_SHIFT=False, HH=hh, HH_SHIFT=hh_shift is not None,
            C=c_norm, C_SHIFT=c_shift is not None, HAS_MASK=mask is not None, SAVE=save, HALF=half is not None,
            BLOCK=block(hidden),
        )  # fmt: skip
    return (hs, cs, acts, tanh_cs, raw, *hh_stats, *c_stats)


def lstm_backward(
    grad_hs: Tensor, grad_h_n: Tensor, grad_c_n: Tensor, inputs: Tensor, h0: Tensor, c0: Tensor,
    weight_hh: Tensor, mask: Tensor | None, hs: Tensor, saved: list[Tensor], raw: Tensor | None,
    stats: list[list[Tensor]], ih: KernelNorm, hh: KernelNorm, c_norm: KernelNorm,
    sequence: Tensor | None, weight_ih: Tensor | None, want_input: bool, want_weight_ih: bool,
    *, half: torch.dtype | None = None,
) -> list[Tensor | None]:  # fmt: skip
    """The C++ ``lstm_backward``'s contract: gradients of the input (x with a projection), h0, c0, W_hh, (γ, shift)
    of the input, recurrent and cell-state norms, then W_ih (with a projection); ``half`` as for the forward."""
    cs, acts, tanh_cs = saved
    ih_stats, hh_stats, c_stats = stats
    hidden = acts.shape[2] // 4
    keep_c_out = not identity(c_norm)
    tensors = (grad_hs, grad_h_n, grad_c_n, c0, mask, cs, acts, tanh_cs, raw, hh.weight, c_norm.weight,
               *(hh_stats or (None, None)), *(c_stats or (None, None)), weight_hh)  # fmt: skip
    settings = {"hh": code(hh), "c_norm": code(c_norm), "keep_c_out": keep_c_out, "half": half}
    d_pre, recurrent, carry, dc, *rest = graphs.GRAPHS.run("lstm_backward", lstm_backward_loop, tensors, **settings)
    d_raw = rest.pop(0) if code(hh) else d_pre
    d_c_out = rest.pop(0) if keep_c_out else d_pre
    grad_h0 = recurrent + carry
    width = acts.shape[2]
    grad_weight_hh = d_raw.reshape(-1, width).t() @ previous_states(h0, hs).reshape(-1, hidden)
    _, hh_weight, hh_shift = rows_backward_all(d_pre, raw if raw is not None else d_pre, hh_stats, hh, False)
    _, c_weight, c_shift = rows_backward_all(d_c_out, cs, c_stats, c_norm, False) if keep_c_out else (None, None, None)
    grad_inputs, ih_weight, ih_shift = rows_backward_all(d_pre, inputs, ih_stats, ih, True)
    grad_x, grad_weight_ih = projection_grads(grad_inputs, sequence, weight_ih, want_input, want_weight_ih)
    return [grad_x, grad_h0, dc, grad_weight_hh, ih_weight, ih_shift, hh_weight, hh_shift, c_weight, c_shift,
            grad_weight_ih]  # fmt: skip


def lstm_backward_loop(
    grad_hs: Tensor, grad_h_n: Tensor, grad_c_n: Tensor, c0: Tensor, mask: Tensor | None, cs: Tensor, acts: Tensor,
    tanh_cs: Tensor, raw: Tensor | None, hh_weight: Tensor | None, c_weight: Tensor | None,
    hh_mean: Tensor | None, hh_rstd: Tensor | None, c_mean: Tensor | None, c_rstd: Tensor | None, weight_hh: Tensor,
    *, hh: int, c_norm: int, keep_c_out: bool, half: torch.dtype | None,
) -> tuple[Tensor, ...]:  # fmt: skip
    """The backward time loop, a function of its tensors (:mod:`.graphs` may capture it): ``d_pre``, the gradient
    reaching ``h0`` through ``W_hh`` (``recurrent``) and the one carried past the loop (``carry``), ``c0``'s
    gradient, then ``d_raw`` where the recurrent term is normalized and ``d_c_out`` where the cell state is."""
    steps, rows, width = acts.shape
    hidden = width // 4
    d_pre = acts.new_empty(steps, rows, width)
    d_raw = acts.new_empty(steps, rows, width) if hh else d_pre
    d_c_out = acts.new_empty(steps, rows, hidden) if keep_c_out else d_pre
    recurrent = torch.zeros_like(grad_h_n)
    carry = grad_h_n.clone()
    dc = grad_c_n.clone()
    scratch = grad_h_n
    product = StepProduct(weight_hh, rows, acts, half)
    for t in range(steps - 1, -1, -1):
        c_prev = c0 if t == 0 else cs[t - 1]
        launch(
            recurrence.lstm_step_backward, (rows,),
            grad_hs[t], recurrent, carry, dc, mask_arg(None if mask is None else mask[t], scratch),
            acts[t], tanh_cs[t], cs[t], c_prev, raw[t] if raw is not None else scratch,
            param(hh_weight, scratch), param(c_weight, scratch),
            *((hh_mean[t], hh_rstd[t]) if hh_mean is not None and hh_rstd is not None else (scratch, scratch)),
            *((c_mean[t], c_rstd[t]) if c_mean is not None and c_rstd is not None else (scratch, scratch)),
            d_pre[t], d_raw[t], d_c_out[t] if keep_c_out else scratch, product.operand(t),
            hidden,
            HH=hh, C=c_norm, KEEP_C_OUT=keep_c_out, HAS_MASK=mask is not None, HALF=half is not None,
            BLOCK=block(hidden),
        )  # fmt: skip
        product(d_raw[t], t, recurrent)
    return (d_pre, recurrent, carry, dc, *((d_raw,) if hh else ()), *((d_c_out,) if keep_c_out else ()))


# --- GRU ---


def gru_forward(
    inputs: Tensor, h0: Tensor, weight_hh: Tensor, mask: Tensor | None, ih: KernelNorm, hh: KernelNorm, save: bool,
    *, half: torch.dtype | None = None,
) -> tuple[list[Tensor], list[Tensor], list[list[Tensor]], list[int]]:  # fmt: skip
    """The C++ ``gru_forward``'s contract: ``([hs, h_n], saved, stats, fallbacks)``; ``half`` as for an LSTM."""
    terms, ih_stats = normalize_rows(inputs, ih)
    settings = {"hh": code(hh), "hh_eps": hh.eps, "save": save, "half": half}
    tensors = (terms, h0, weight_hh, mask, hh.weight, hh.shift)
    hs, acts, us, raw, *hh_stats = graphs.GRAPHS.run("gru_forward", gru_forward_loop, tensors, **settings)
    saved = [acts, us, raw] if save else []
    stats = [ih_stats, hh_stats] if save else []
    return [hs, hs[-1].clone()], saved, stats, [0, 0]


def gru_forward_loop(
    terms: Tensor, h0: Tensor, weight_hh: Tensor, mask: Tensor | None, hh_weight: Tensor | None,
    hh_shift: Tensor | None, *, hh: int, hh_eps: float, save: bool, half: torch.dtype | None,
) -> tuple[Tensor, ...]:  # fmt: skip
    """The forward time loop, a function of its tensors (:mod:`.graphs` may capture it): ``hs, acts, us, raw``,
    then the recurrent norm's statistics where it has them."""
    steps, rows, width = terms.shape
    hidden = width // 3
    kept, hs, acts, us, raw = gru_outputs(terms, save)
    hh_stats = [terms.new_empty(kept, rows), terms.new_empty(kept, rows)] if hh else []
    scratch = h0
    product = StepProduct.forward(weight_hh, h0, half)
    for t in range(steps):
        slot = t if save else 0
        h_prev = h0 if t == 0 else hs[t - 1]
        product(h_prev, t - 1, raw[slot])
        launch(
            recurrence.gru_step, (rows,),
            terms[t], raw[slot], h_prev, mask_arg(None if mask is None else mask[t], scratch),
            scratch, scratch, param(hh_weight, scratch), param(hh_shift, scratch),
            hs[t], acts[slot], us[slot], *_at(hh_stats, slot, scratch), product.operand(t),
            hidden, 0.0, hh_eps,
            IH=0, IH_SHIFT=False, HH=hh, HH_SHIFT=hh_shift is not None, HAS_MASK=mask is not None, SAVE=save,
            HALF=half is not None, BLOCK=block(hidden),
        )  # fmt: skip
    return (hs, acts, us, raw, *hh_stats)


def gru_backward(
    grad_hs: Tensor, grad_h_n: Tensor, inputs: Tensor, h0: Tensor, weight_hh: Tensor, mask: Tensor | None,
    hs: Tensor, saved: list[Tensor], stats: list[list[Tensor]], ih: KernelNorm, hh: KernelNorm,
    sequence: Tensor | None, weight_ih: Tensor | None, want_input: bool, want_weight_ih: bool,
    *, half: torch.dtype | None = None,
) -> list[Tensor | None]:  # fmt: skip
    """The C++ ``gru_backward``'s contract: gradients of the input (x with a projection), h0, W_hh, (γ, shift) of the
    input and recurrent norms, then W_ih (with a projection); ``half`` as for the forward."""
    acts, us, raw = saved
    ih_stats, hh_stats = stats
    width = acts.shape[2]
    hidden = width // 3
    tensors = (grad_hs, grad_h_n, h0, hs, mask, acts, us, raw, hh.weight, *(hh_stats or (None, None)), weight_hh)
    settings = {"hh": code(hh), "half": half}
    d_input, d_u, recurrent, carry, *rest = graphs.GRAPHS.run("gru_backward", gru_backward_loop, tensors, **settings)
    d_raw = rest[0] if code(hh) else d_u
    grad_h0 = recurrent + carry
    grad_weight_hh = d_raw.reshape(-1, width).t() @ previous_states(h0, hs).reshape(-1, hidden)
    _, hh_weight, hh_shift = rows_backward_all(d_u, raw, hh_stats, hh, False)
    grad_inputs, ih_weight, ih_shift = rows_backward_all(d_input, inputs, ih_stats, ih, True)
    grad_x, grad_weight_ih = projection_grads(grad_inputs, sequence, weight_ih, want_input, want_weight_ih)
    return [grad_x, grad_h0, grad_weight_hh, ih_weight, ih_shift, hh_weight, hh_shift, grad_weight_ih]


def gru_backward_loop(
    grad_hs: Tensor, grad_h_n: Tensor, h0: Tensor, hs: Tensor, mask: Tensor | None, acts: Tensor, us: Tensor,
    raw: Tensor, hh_weight: Tensor | None, hh_mean: Tensor | None, hh_rstd: Tensor | None, weight_hh: Tensor,
    *, hh: int, half: torch.dtype | None,
) -> tuple[Tensor, ...]:  # fmt: skip
    """The backward time loop, a function of its tensors (:mod:`.graphs` may capture it): ``d_input``, ``d_u``, the
    gradient reaching ``h0`` through ``W_hh`` and the one carried past the loop, then ``d_raw`` where the recurrent
    term is normalized."""
    steps, rows, width = acts.shape
    hidden = width // 3
    d_input = acts.new_empty(steps, rows, width)
    d_u = acts.new_empty(steps, rows, width)
    d_raw = acts.new_empty(steps, rows, width) if hh else d_u
    recurrent = torch.zeros_like(grad_h_n)
    carry = grad_h_n.clone()
    scratch = grad_h_n
    product = StepProduct(weight_hh, rows, acts, half)
    for t in range(steps - 1, -1, -1):
        h_prev = h0 if t == 0 else hs[t - 1]
        launch(
            recurrence.gru_step_backward, (rows,),
            grad_hs[t], recurrent, carry, mask_arg(None if mask is None else mask[t], scratch),
            acts[t], us[t], h_prev, raw[t], param(hh_weight, scratch),
            *((hh_mean[t], hh_rstd[t]) if hh_mean is not None and hh_rstd is not None else (scratch, scratch)),
            d_input[t], d_u[t], d_raw[t], product.operand(t), hidden,
            HH=hh, HAS_MASK=mask is not None, HALF=half is not None, BLOCK=block(hidden),
        )  # fmt: skip
        product(d_raw[t], t, recurrent)
    return (d_input, d_u, recurrent, carry, *((d_raw,) if hh else ()))


# --- the generation step ---


def _at(stats: list[Tensor], slot: int, scratch: Tensor) -> tuple[Tensor, Tensor]:
    """A norm's mean and 1/std rows of step ``slot`` for the kernel to write, or ``scratch`` twice where the norm
    keeps none (not indexed: a scratch of ``rows`` rows indexed by the step failed past ``rows`` steps)."""
    return (stats[0][slot], stats[1][slot]) if stats else (scratch, scratch)


def _step_norm(norm: KernelNorm, step: int) -> tuple[int, Tensor | None, Tensor | None]:
    """A norm for the generation step: (kind, γ, shift); a per-timestep BatchNorm in evaluation as its step's row of
    folded scale and offset (the offset holds the shift)."""
    if norm.kind == "batch":
        assert norm.folded_scale is not None and norm.folded_offset is not None, "unsupported() refuses the rest"
        row = min(step, norm.folded_scale.shape[0] - 1)
        return 4, norm.folded_scale[row], norm.folded_offset[row]
    return code(norm), norm.weight, norm.shift


def generation_step(
    cell: str, x: Tensor, h: Tensor, c: Tensor | None, weight_ih_t: Tensor, weight_hh_t: Tensor,
    ih: KernelNorm, hh: KernelNorm, c_norm: KernelNorm, step: int,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The C++ ``generation_step``'s contract: ``x`` ``(B, I)`` or ``(1, B, I)``, ``h``/``c`` ``(1, B, H)``;
    returns ``(h', c')`` ``(1, B, H)`` (``c'`` ``None`` for a GRU). Three launches, two products and one step, run
    through :mod:`.graphs` (one graph per shape replays them)."""
    x = x[0] if x.dim() == 3 else x
    ih_kind, ih_weight, ih_shift = _step_norm(ih, step)
    hh_kind, hh_weight, hh_shift = _step_norm(hh, step)
    c_kind, c_weight, c_shift = _step_norm(c_norm, step) if cell == "lstm" else (0, None, None)
    tensors = (x, h[0], None if c is None else c[0], weight_ih_t, weight_hh_t,
               ih_weight, ih_shift, hh_weight, hh_shift, c_weight, c_shift)  # fmt: skip
    settings = {"ih": ih_kind, "hh": hh_kind, "c_norm": c_kind, "ih_eps": ih.eps, "hh_eps": hh.eps}
    if cell == "gru":
        (h_new,) = graphs.GRAPHS.run("gru_generation", gru_generation_loop, tensors, **settings)
        return h_new.unsqueeze(0), None
    assert c is not None
    h_new, c_new = graphs.GRAPHS.run("lstm_generation", lstm_generation_loop, tensors, c_eps=c_norm.eps, **settings)
    return h_new.unsqueeze(0), c_new.unsqueeze(0)


def gru_generation_loop(
    x: Tensor, h: Tensor, c: None, weight_ih_t: Tensor, weight_hh_t: Tensor, ih_weight: Tensor | None,
    ih_shift: Tensor | None, hh_weight: Tensor | None, hh_shift: Tensor | None, c_weight: None, c_shift: None,
    *, ih: int, hh: int, c_norm: int, ih_eps: float, hh_eps: float,
) -> tuple[Tensor, ...]:  # fmt: skip
    """One GRU generation step, a function of its tensors (:mod:`.graphs` may capture it): ``(h',)`` ``(B, H)``."""
    rows, hidden = x.shape[0], weight_hh_t.shape[0]
    term = x @ weight_ih_t
    raw = h @ weight_hh_t
    h_new = h.new_empty(rows, hidden)
    scratch = h_new
    launch(
        recurrence.gru_step, (rows,),
        term, raw, h, scratch, param(ih_weight, scratch), param(ih_shift, scratch), param(hh_weight, scratch),
        param(hh_shift, scratch), h_new, scratch, scratch, scratch, scratch, scratch, hidden, ih_eps, hh_eps,
        IH=ih, IH_SHIFT=ih_shift is not None, HH=hh, HH_SHIFT=hh_shift is not None, HAS_MASK=False, SAVE=False,
        HALF=False, BLOCK=block(hidden),
    )  # fmt: skip
    return (h_new,)


def lstm_generation_loop(
    x: Tensor, h: Tensor, c: Tensor, weight_ih_t: Tensor, weight_hh_t: Tensor, ih_weight: Tensor | None,
    ih_shift: Tensor | None, hh_weight: Tensor | None, hh_shift: Tensor | None, c_weight: Tensor | None,
    c_shift: Tensor | None, *, ih: int, hh: int, c_norm: int, ih_eps: float, hh_eps: float, c_eps: float,
) -> tuple[Tensor, ...]:  # fmt: skip
    """One LSTM generation step, a function of its tensors (:mod:`.graphs` may capture it): ``(h', c')``, each
    ``(B, H)``."""
    rows, hidden = x.shape[0], weight_hh_t.shape[0]
    term = x @ weight_ih_t
    raw = h @ weight_hh_t
    h_new = h.new_empty(rows, hidden)
    c_new = h.new_empty(rows, hidden)
    scratch = h_new
    launch(
        recurrence.lstm_step, (rows,),
        term, raw, h, c, scratch, param(ih_weight, scratch), param(ih_shift, scratch), param(hh_weight, scratch),
        param(hh_shift, scratch), param(c_weight, scratch), param(c_shift, scratch),
        h_new, c_new, scratch, scratch, scratch, scratch, scratch, scratch, scratch,
        hidden, ih_eps, hh_eps, c_eps,
        IH=ih, IH_SHIFT=ih_shift is not None, HH=hh, HH_SHIFT=hh_shift is not None, C=c_norm,
        C_SHIFT=c_shift is not None, HAS_MASK=False, SAVE=False, HALF=False, BLOCK=block(hidden),
    )  # fmt: skip
    return (h_new, c_new)
