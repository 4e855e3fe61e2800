"""A hand-written backward through time for the fast path's recurrence (Haste's approach, in plain PyTorch ops).

:func:`run_recurrence` runs one direction of one layer — what the fast path's loop of
:meth:`~seqnorm.cells.base.RecurrentCell.step_unchecked` on hoisted input terms computes — as one
``torch.autograd.Function``. Its inputs are the projections ``W_ih x`` of all steps (one matmul with its own autograd
graph; their norm — LayerNorm, RMSNorm or per-timestep BatchNorm — and the biases are applied step by step inside;
without a norm, the input terms of :meth:`~seqnorm.cells.base.RecurrentCell.input_terms`), the initial state,
``W_hh^T`` and the norms' parameters.

- **Forward**: the loop runs without recording a graph and saves only what the backward needs: the raw recurrent
  terms ``W_hh h``, the activated gates, for LSTMs the cell states and ``tanh(N_c(c))``, each norm's per-step
  statistics, and the outputs ``h`` (saved as the output they are). Per-timestep BatchNorm updates its running
  statistics exactly as :meth:`~seqnorm.norms.TimestepBatchNorm.forward_step` does (torch's fused kernel); batch
  renormalization in training is the same with ``γ (x̂ r + d)``, ``r`` and ``d`` constants, and BatchNorm's backward
  with the weight ``γ r``.
- **Backward**: every step's local gate derivatives are computed at once, in place in the buffer of the input
  terms' gradient; the reverse walk through time then takes a few operations per step (the norms' backward are
  torch's LayerNorm / BatchNorm backward kernels, :mod:`seqnorm.layers.bptt_norms`); the gradient of ``W_hh`` is one
  matmul over all steps, and the norms' ``γ``/``β`` gradients one sum.

:func:`seqnorm.layers.plan.plan_for` sends here the cells and norms that declare this form
(:func:`~seqnorm.layers.plan.bptt_blocker`); everything else keeps the step-by-step loop of
:mod:`seqnorm.layers.fast`. Padded rows (``mask`` false) keep their state, enter no batch statistics and receive no
gradient from the step they skip.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from seqnorm.cells.base import RecurrentCell
from seqnorm.cells.projection import project
from seqnorm.layers.bptt_norms import StepNorm
from seqnorm.layers.plan import bptt_blocker, cell_kernel, norm_blocker
from seqnorm.layers.stack import PaddingLayout

__all__ = ["run_recurrence", "supports"]


def supports(cell: RecurrentCell, sequence: Tensor, state: Any, recurrent_mask: Tensor | None) -> bool:
    """Whether :func:`run_recurrence` computes exactly what the cell's hoisted steps would, and a gradient is wanted.

    The plan's own test (:func:`~seqnorm.layers.plan.bptt_blocker`) for one cell outside a layer.
    """
    if recurrent_mask is not None or bptt_blocker(None, cell, sequence.dtype, sequence.device.type) is not None:
        return False
    if not torch.is_grad_enabled():
        return False
    states = state if isinstance(state, tuple) else (state,)
    return sequence.requires_grad or any(t.requires_grad for t in (*states, *cell.parameters()))


def run_recurrence(
    cell: RecurrentCell, sequence: Tensor, state: Any, weight_hh: Tensor | None, layout: PaddingLayout
) -> tuple[Tensor, Any]:
    """The recurrent loop of the fast path as one autograd Function; returns ``(outputs (T, B, H), final state)``.

    Args:
        cell: a cell the plan routes here (:func:`~seqnorm.layers.plan.bptt_blocker` finds nothing against it).
        sequence: ``(T, B, input_size)``, input dropout applied.
        state: the initial state, ``(h, c)`` or ``h``, each ``(B, H)``.
        weight_hh: ``W_hh`` for every step if not the cell's own (DropConnect), else ``None``.
        layout: where the real rows are (:func:`~seqnorm.layers.stack.padding_layout`).
    """
    call = _Call(cell, layout)
    if call.norm_ih.identity:
        inputs, ih_weight, ih_shift = cell.input_terms(sequence, layout.active, layout.counts), None, None
    else:
        # The input norm runs inside the loop (INSIDE_INPUT_NORMS); the bias that follows it is its shift.
        inputs = project(sequence, cell.weight_ih)
        ih_weight, ih_shift, bias = cell.norm_ih.weight, cell.norm_ih.bias, cell.folded_bias()
        ih_shift = bias if ih_shift is None else (ih_shift if bias is None else ih_shift + bias)
    # Weight norm (and DropConnect): computed once per sequence, not once per step.
    weight_hh_t = (cell.weight_hh if weight_hh is None else weight_hh).t()
    norm_hh, norm_c = cell.norm_hh, cell.norm_c
    hh_weight = None if norm_hh is None else norm_hh.weight
    hh_shift = None if norm_hh is None else norm_hh.bias
    if cell_kernel(cell) == "gru":
        # b_hh follows the recurrent norm (its candidate part is gated by r), so it joins the norm's shift.
        if cell.bias_hh is not None:
            hh_shift = cell.bias_hh if hh_shift is None else hh_shift + cell.bias_hh
        params = (ih_weight, ih_shift, weight_hh_t, hh_weight, hh_shift)
        outputs, h_n = _GRURecurrence.apply(call, inputs, state, *params)
        return outputs, h_n
    c_weight = None if norm_c is None else norm_c.weight
    c_shift = None if norm_c is None else norm_c.bias
    params = (ih_weight, ih_shift, weight_hh_t, hh_weight, hh_shift, c_weight, c_shift)
    outputs, h_n, c_n = _LSTMRecurrence.apply(call, inputs, state[0], state[1], *params)
    return outputs, (h_n, c_n)


class _LSTMSaved(NamedTuple):
    """What :class:`_LSTMRecurrence` saves for its backward (``inputs`` only when the input norm runs inside)."""

    inputs: Tensor | None
    ih_weight: Tensor | None
    ih_shift: Tensor | None
    h0: Tensor
    c0: Tensor
    weight_hh_t: Tensor
    hh_weight: Tensor | None
    hh_shift: Tensor | None
    c_weight: Tensor | None
    c_shift: Tensor | None
    hs: Tensor
    cs: Tensor
    tanh_cs: Tensor
    acts: Tensor
    raw: Tensor | None


class _GRUSaved(NamedTuple):
    """What :class:`_GRURecurrence` saves for its backward."""

    inputs: Tensor | None
    ih_weight: Tensor | None
    ih_shift: Tensor | None
    h0: Tensor
    weight_hh_t: Tensor
    hh_weight: Tensor | None
    hh_shift: Tensor | None
    hs: Tensor
    acts: Tensor
    raw: Tensor


class _Call:
    """What a call needs besides tensors: the padding layout and the norms' per-call helpers."""

    def __init__(self, cell: RecurrentCell, layout: PaddingLayout) -> None:
        self.masks = layout.masks
        self.counts = layout.counts
        # The input norm runs inside the Function where it declares the form (measured faster than the vectorized
        # form, which allocates several fresh (T, B, G*H) tensors); otherwise input_terms applies it beforehand.
        inside = cell.norm_ih is not None and norm_blocker(cell.norm_ih, "bptt") is None
        self.norm_ih = StepNorm(cell.norm_ih if inside else None)
        self.norm_hh = StepNorm(cell.norm_hh)
        self.norm_c = StepNorm(cell.norm_c)

    def save(self, ctx: Any, saved: _LSTMSaved | _GRUSaved) -> None:
        """``save_for_backward`` of ``saved`` and the norms' statistics (so saved-tensor hooks see all of them)."""
        stats = {role: norm.saved() for role, norm in self._norms().items()}
        ctx.call, ctx.saved_type = self, type(saved)
        ctx.stat_names = {role: tuple(named) for role, named in stats.items()}
        ctx.save_for_backward(*saved, *(tensor for named in stats.values() for tensor in named.values()))

    @staticmethod
    def load(ctx: Any) -> tuple[_Call, Any]:
        """The call and the tensors :meth:`save` saved, by name, with the norms' statistics loaded back."""
        call: _Call = ctx.call
        tensors = iter(ctx.saved_tensors)
        saved = ctx.saved_type(*(next(tensors) for _ in ctx.saved_type._fields))
        for role, norm in call._norms().items():
            norm.load({name: next(tensors) for name in ctx.stat_names[role]})
        return call, saved

    def _norms(self) -> dict[str, StepNorm]:
        return {"ih": self.norm_ih, "hh": self.norm_hh, "c": self.norm_c}


def _input_grads(
    call: _Call, grad_terms: Tensor, inputs: Tensor | None, weight: Tensor | None, shift: Tensor | None
) -> tuple[Tensor, tuple[Tensor | None, Tensor | None]]:
    """The gradient w.r.t. the Function's ``inputs`` (through the input norm, if it runs inside) and its γ/shift."""
    norm = call.norm_ih
    if norm.identity:
        return grad_terms, (None, None)
    steps = [
        norm.backward(grad, x, t, mask, count, weight, shift)
        for t, (grad, x, mask, count) in enumerate(zip(grad_terms, inputs, call.masks, call.counts, strict=True))
    ]
    return torch.stack(steps), norm.parameter_grads()


def _gru_slices(hidden: int) -> tuple[tuple[int, int], ...]:
    """``(start, size)`` of ``r, z`` together, ``r``, ``z`` and ``n`` in the GRU's ``(B, 3H)`` gates."""
    return (0, 2 * hidden), (0, hidden), (hidden, hidden), (2 * hidden, hidden)


def _split_masked(grad: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """``(the part for the step's computation, the part a padded row passes to its previous state)``."""
    if mask is None:
        return grad, None
    keep = mask.unsqueeze(1)
    return torch.where(keep, grad, 0.0), torch.where(keep, 0.0, grad)


def _weight_hh_t_grad(h0: Tensor, hs: Tensor, grad_raw: Tensor) -> Tensor:
    """``sum_t h_{t-1}^T dL/d(W_hh h_{t-1})``: one matmul over all steps (``h_{-1}`` is ``h0``)."""
    hidden, gates = hs.shape[2], grad_raw.shape[2]
    first = torch.mm(h0.t(), grad_raw[0])
    return torch.addmm(first, hs[:-1].reshape(-1, hidden).t(), grad_raw[1:].reshape(-1, gates))


class _LSTMRecurrence(torch.autograd.Function):
    """``(i, f, g, o) = terms_t + N_hh(W_hh h)``, ``c' = σ(f) c + σ(i) tanh(g)``, ``h' = σ(o) tanh(N_c(c'))``."""

    @staticmethod
    def forward(
        ctx: Any,
        call: _Call,
        inputs: Tensor,
        h0: Tensor,
        c0: Tensor,
        ih_weight: Tensor | None,
        ih_shift: Tensor | None,
        weight_hh_t: Tensor,
        hh_weight: Tensor | None,
        hh_shift: Tensor | None,
        c_weight: Tensor | None,
        c_shift: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        steps, batch, gates = inputs.shape
        hidden = gates // 4
        norm_ih, norm_hh, norm_c = call.norm_ih, call.norm_hh, call.norm_c
        # Without a recurrent norm (nor its shift) the raw term is never needed again: addmm straight into the gates.
        raw = None if norm_hh.identity and hh_shift is None else inputs.new_empty(steps, batch, gates)
        acts = inputs.new_empty(steps, batch, gates)  # σ(i), σ(f), tanh(g), σ(o)
        cs = inputs.new_empty(steps, batch, hidden)
        tanh_cs = inputs.new_empty(steps, batch, hidden)  # tanh(N_c(c')), before the padded rows keep their state
        hs = inputs.new_empty(steps, batch, hidden)
        h, c = h0, c0
        # Per-step views made once (unbind is one call; indexing at every step is one call per view).
        i_t, f_t, g_t, o_t = (gate.unbind(0) for gate in acts.chunk(4, 2))
        raw_t = [None] * steps if raw is None else raw.unbind(0)
        views = zip(
            inputs.unbind(0),
            raw_t,
            acts.unbind(0),
            i_t,
            f_t,
            g_t,
            o_t,
            cs.unbind(0),
            tanh_cs.unbind(0),
            hs.unbind(0),
            strict=True,
        )
        for t, (x_t, r_t, act, i, f, g, o, c_t, tanh_t, h_t) in enumerate(views):
            mask, count = call.masks[t], call.counts[t]
            term = norm_ih.forward(x_t, t, mask, count, ih_weight, ih_shift)
            if r_t is None:
                pre = torch.addmm(term, h, weight_hh_t)
            else:
                torch.mm(h, weight_hh_t, out=r_t)
                pre = norm_hh.forward(r_t, t, mask, count, hh_weight, hh_shift).add_(term)
            torch.sigmoid(pre, out=act)
            torch.tanh(pre.narrow(1, 2 * hidden, hidden), out=g)
            c_new = torch.addcmul(f * c, i, g, out=c_t if mask is None else None)
            tanh_c = torch.tanh(norm_c.forward(c_new, t, mask, count, c_weight, c_shift), out=tanh_t)
            h_new = torch.mul(o, tanh_c, out=h_t if mask is None else None)
            if mask is not None:  # padded rows keep their state
                keep = mask.unsqueeze(1)
                torch.where(keep, c_new, c, out=c_t)
                torch.where(keep, h_new, h, out=h_t)
            h, c = h_t, c_t
        for norm in (norm_ih, norm_hh, norm_c):
            norm.finish_forward()
        inputs = None if norm_ih.identity else inputs  # needed only for the input norm's backward
        weights = (ih_weight, ih_shift, h0, c0, weight_hh_t, hh_weight, hh_shift, c_weight, c_shift)
        call.save(ctx, _LSTMSaved(inputs, *weights, hs, cs, tanh_cs, acts, raw))
        return hs, hs[-1].clone(), cs[-1].clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_hs: Tensor, grad_h_n: Tensor, grad_c_n: Tensor) -> tuple[Tensor | None, ...]:
        call, saved = _Call.load(ctx)
        inputs, ih_weight, ih_shift, h0, c0 = saved.inputs, saved.ih_weight, saved.ih_shift, saved.h0, saved.c0
        weight_hh_t, hh_weight, hh_shift = saved.weight_hh_t, saved.hh_weight, saved.hh_shift
        c_weight, c_shift = saved.c_weight, saved.c_shift
        hs, cs, tanh_cs, acts, raw = saved.hs, saved.cs, saved.tanh_cs, saved.acts, saved.raw
        norm_hh, norm_c = call.norm_hh, call.norm_c
        steps, _, gates = acts.shape
        hidden = gates // 4
        i, f, g, o = acts.chunk(4, 2)
        # Every step's local derivatives at once, written where the input terms' gradient goes: the loop then only
        # multiplies them by the incoming gradients, in place.
        grad_terms = torch.empty_like(acts)
        d_i, d_f, d_g, d_o = grad_terms.chunk(4, 2)
        one = acts.new_ones(())
        torch.addcmul(i, i, i, value=-1, out=d_i).mul_(g)  # dL/di = dL/dc * g σ'(i)
        torch.addcmul(f, f, f, value=-1, out=d_f)  # dL/df = dL/dc * c_prev σ'(f)
        d_f[0].mul_(c0)
        d_f[1:].mul_(cs[:-1])
        torch.addcmul(one, g, g, value=-1, out=d_g).mul_(i)  # dL/dg = dL/dc * i tanh'(g)
        torch.addcmul(o, o, o, value=-1, out=d_o).mul_(tanh_cs)  # dL/do = dL/dh * tanh(c_out) σ'(o)
        d_tanh = torch.addcmul(one, tanh_cs, tanh_cs, value=-1).mul_(o)  # dL/dc_out = dL/dh * d_tanh
        grad_raw: list[Tensor] = []
        weight_hh = weight_hh_t.t()
        dh, dc = grad_h_n + grad_hs[-1], grad_c_n
        raw_t = [None] * steps if raw is None else raw.unbind(0)
        grad_ifg = grad_terms.narrow(2, 0, 3 * hidden).unflatten(2, (3, hidden)).unbind(0)
        grad_o = grad_terms.narrow(2, 3 * hidden, hidden).unbind(0)
        previous = [None, *grad_hs.unbind(0)[:-1]]  # the output gradient that joins dh at step t - 1
        views = zip(
            grad_terms.unbind(0),
            grad_ifg,
            grad_o,
            raw_t,
            cs.unbind(0),
            d_tanh.unbind(0),
            f.unbind(0),
            previous,
            strict=True,
        )
        for t, (grad, grad_3, grad_1, r_t, c_t, d_tanh_t, f_t, grad_h) in reversed(list(enumerate(views))):
            mask, count = call.masks[t], call.counts[t]
            dh, dh_keep = _split_masked(dh, mask)
            dc, dc_keep = _split_masked(dc, mask)
            if norm_c.identity and c_shift is None:
                dc = torch.addcmul(dc, dh, d_tanh_t)
            else:
                dc = norm_c.backward(dh * d_tanh_t, c_t, t, mask, count, c_weight, c_shift).add_(dc)
            grad_3.mul_(dc.unsqueeze(1))
            grad_1.mul_(dh)
            dr = grad if r_t is None else norm_hh.backward(grad, r_t, t, mask, count, hh_weight, hh_shift)
            grad_raw.append(dr)
            dc = dc * f_t
            dh = torch.mm(dr, weight_hh) if grad_h is None else torch.addmm(grad_h, dr, weight_hh)
            if mask is not None:
                dh, dc = dh + dh_keep, dc + dc_keep
        grad_raw_all = grad_terms if raw is None else torch.stack(grad_raw[::-1])
        grad_weight_hh_t = _weight_hh_t_grad(h0, hs, grad_raw_all)
        grad_inputs, ih_grads = _input_grads(call, grad_terms, inputs, ih_weight, ih_shift)
        hh_grads, c_grads = norm_hh.parameter_grads(), norm_c.parameter_grads()
        return None, grad_inputs, dh, dc, *ih_grads, grad_weight_hh_t, *hh_grads, *c_grads


class _GRURecurrence(torch.autograd.Function):
    """``u = N_hh(W_hh h) + b_hh``, ``r, z = σ(terms + u)``, ``n = tanh(terms_n + r u_n)``, ``h' = (1 - z) n + z h``."""

    @staticmethod
    def forward(
        ctx: Any,
        call: _Call,
        inputs: Tensor,
        h0: Tensor,
        ih_weight: Tensor | None,
        ih_shift: Tensor | None,
        weight_hh_t: Tensor,
        hh_weight: Tensor | None,
        hh_shift: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        steps, batch, gates = inputs.shape
        hidden = gates // 3
        norm_ih, norm_hh = call.norm_ih, call.norm_hh
        raw = inputs.new_empty(steps, batch, gates)  # W_hh h
        acts = inputs.new_empty(steps, batch, gates)  # r, z, n
        hs = inputs.new_empty(steps, batch, hidden)
        h = h0
        rz_t, r_t, z_t, n_t = (acts.narrow(2, start, size).unbind(0) for start, size in _gru_slices(hidden))
        views = zip(inputs.unbind(0), raw.unbind(0), rz_t, r_t, z_t, n_t, hs.unbind(0), strict=True)
        for t, (x_t, raw_t, rz, r, z, n, h_t) in enumerate(views):
            mask, count = call.masks[t], call.counts[t]
            torch.mm(h, weight_hh_t, out=raw_t)
            u = norm_hh.forward(raw_t, t, mask, count, hh_weight, hh_shift)
            a = norm_ih.forward(x_t, t, mask, count, ih_weight, ih_shift)
            torch.add(a.narrow(1, 0, 2 * hidden), u.narrow(1, 0, 2 * hidden), out=rz).sigmoid_()
            torch.addcmul(a.narrow(1, 2 * hidden, hidden), r, u.narrow(1, 2 * hidden, hidden), out=n).tanh_()
            h_new = torch.lerp(n, h, z, out=h_t if mask is None else None)  # (1 - z) n + z h
            if mask is not None:  # padded rows keep their state
                torch.where(mask.unsqueeze(1), h_new, h, out=h_t)
            h = h_t
        norm_ih.finish_forward()
        norm_hh.finish_forward()
        inputs = None if norm_ih.identity else inputs  # needed only for the input norm's backward
        call.save(ctx, _GRUSaved(inputs, ih_weight, ih_shift, h0, weight_hh_t, hh_weight, hh_shift, hs, acts, raw))
        return hs, hs[-1].clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_hs: Tensor, grad_h_n: Tensor) -> tuple[Tensor | None, ...]:
        call, saved = _Call.load(ctx)
        inputs, ih_weight, ih_shift, h0 = saved.inputs, saved.ih_weight, saved.ih_shift, saved.h0
        weight_hh_t, hh_weight, hh_shift = saved.weight_hh_t, saved.hh_weight, saved.hh_shift
        hs, acts, raw = saved.hs, saved.acts, saved.raw
        norm_hh = call.norm_hh
        hidden = acts.shape[2] // 3
        gates = 3 * hidden
        r, z, n = acts.chunk(3, 2)
        # u_n, the normalized candidate term, is recomputed rather than saved: memory for one vectorized pass.
        candidate = slice(2 * hidden, gates)
        u_n = norm_hh.normalized(raw[..., candidate], candidate)
        if hh_weight is not None:
            u_n.mul_(hh_weight[candidate])
        if hh_shift is not None:
            u_n.add_(hh_shift[candidate])
        # Every step's local derivatives at once, in the buffer of the input terms' gradient (see the LSTM).
        grad_terms = torch.empty_like(acts)
        d_r, d_z, d_n = grad_terms.chunk(3, 2)
        torch.addcmul(acts.new_ones(()), n, n, value=-1, out=d_n).addcmul_(d_n, z, value=-1)  # (1 - z) tanh'
        torch.sub(h0, n[0], out=d_z[0])
        torch.sub(hs[:-1], n[1:], out=d_z[1:])
        d_z.mul_(torch.addcmul(z, z, z, value=-1, out=d_r))  # (h_prev - n) σ'(z)
        torch.addcmul(r, r, r, value=-1, out=d_r).mul_(u_n).mul_(d_n)  # dL/dr = dL/d(pre n) u_n σ'(r)
        grad_raw: list[Tensor] = []
        weight_hh = weight_hh_t.t()
        dh = grad_h_n + grad_hs[-1]
        previous = [None, *grad_hs.unbind(0)[:-1]]  # the output gradient that joins dh at step t - 1
        grad_3 = grad_terms.unflatten(2, (3, hidden)).unbind(0)
        views = zip(grad_terms.unbind(0), grad_3, raw.unbind(0), r.unbind(0), z.unbind(0), previous, strict=True)
        for t, (grad, grad_by_gate, raw_t, r_t, z_t, grad_h) in reversed(list(enumerate(views))):
            mask, count = call.masks[t], call.counts[t]
            dh, dh_keep = _split_masked(dh, mask)
            grad_by_gate.mul_(dh.unsqueeze(1))
            du = grad.clone()  # dL/du: as dL/d(terms), but r gates the candidate part
            du.narrow(1, 2 * hidden, hidden).mul_(r_t)
            dr = norm_hh.backward(du, raw_t, t, mask, count, hh_weight, hh_shift)
            grad_raw.append(dr)
            carry = dh * z_t if grad_h is None else torch.addcmul(grad_h, dh, z_t)
            dh = torch.addmm(carry, dr, weight_hh)
            if mask is not None:
                dh = dh + dh_keep
        grad_weight_hh_t = _weight_hh_t_grad(h0, hs, torch.stack(grad_raw[::-1]))
        grad_inputs, ih_grads = _input_grads(call, grad_terms, inputs, ih_weight, ih_shift)
        return None, grad_inputs, dh, *ih_grads, grad_weight_hh_t, *norm_hh.parameter_grads()
