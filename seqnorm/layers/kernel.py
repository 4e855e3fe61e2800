"""The compiled kernels' form of a layer direction's recurrence and of the generation step (:mod:`seqnorm.kernels`).

:func:`run_recurrence` runs what the fast path's loop over hoisted input terms computes: the input terms of all
steps come from :meth:`~seqnorm.cells.base.RecurrentCell.input_terms` (one matmul and the input norm, under
autograd), then the recurrence — ``W_hh h`` into a preallocated buffer per step, the recurrent norm, the gates,
the cell-state norm — runs in C++ as one ``torch.autograd.Function`` whose backward through time is C++ as well. The
math of each piece is the kernels' own (``seqnorm/csrc``: a norm's statistics and their backward in ``norms.h``,
the gates in ``cells.h``); what they are given comes from what the modules declare (:meth:`kernel_norm` of each
norm: :class:`~seqnorm.kernels.KernelNorm`). Without a gradient to compute, the forward keeps only the current step.

:func:`compiled_step` is the generation step (:mod:`seqnorm.layers.stepping`) as one C++ call per cell.

:func:`seqnorm.layers.plan.plan_for` routes here (:func:`~seqnorm.layers.plan.kernel_blocker`); the plain-PyTorch
paths (:mod:`seqnorm.layers.bptt`, the loop, the reference) give the same outputs, states, gradients and running
statistics, and ``tests/test_kernels.py`` compares them for every cell and norm.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from seqnorm.cells.base import RecurrentCell
from seqnorm.kernels import NO_NORM, KernelNorm, native
from seqnorm.layers.plan import cell_kernel
from seqnorm.layers.stack import PaddingLayout

__all__ = ["compiled_step", "kernel_norm", "run_recurrence"]


def kernel_norm(norm: nn.Module | None, shift: Tensor | None) -> KernelNorm:
    """What the kernels need of ``norm`` (the module's own :meth:`kernel_norm`), followed by ``shift``."""
    if norm is None:
        return NO_NORM if shift is None else dataclasses.replace(NO_NORM, shift=shift)
    return norm.kernel_norm(shift)  # type: ignore[operator]


def _plus(first: Tensor | None, second: Tensor | None) -> Tensor | None:
    if first is None or second is None:
        return second if first is None else first
    return first + second


class _Call:
    """A call's non-tensor arguments: the kernels, the padding mask and the norms (for the backward, with their
    weight and shift replaced by the saved ones)."""

    def __init__(self, kernels: Any, mask: Tensor | None, norms: tuple[KernelNorm, ...]) -> None:
        self.kernels = kernels
        self.mask = mask
        self.norms = norms

    def native(self, weights: tuple[Tensor | None, ...] | None = None) -> list[Any]:
        """The C++ arguments of the norms (``weights``: each norm's weight and shift, in order, from the saved)."""
        norms = self.norms
        if weights is not None:
            pairs = zip(weights[::2], weights[1::2], strict=True)
            norms = tuple(dataclasses.replace(n, weight=w, shift=s) for n, (w, s) in zip(norms, pairs, strict=True))
        return [norm.native(self.kernels) for norm in norms]

    def count_fallbacks(self, fallbacks: list[int]) -> None:
        """Add the kernel's fallback steps (BatchNorm's running statistics on steps with < 2 real rows) to the norms."""
        for norm, steps in zip(self.norms, fallbacks, strict=True):
            if steps and norm.owner is not None:
                norm.owner.fallback_steps += steps


def run_recurrence(
    cell: RecurrentCell, sequence: Tensor, state: Any, weight_hh: Tensor | None, layout: PaddingLayout
) -> tuple[Tensor, Any]:
    """One direction of one layer on the kernels; returns ``(outputs (T, B, H), final state)``.

    Args:
        cell: a cell the plan routes here (:func:`~seqnorm.layers.plan.kernel_blocker` finds nothing against it).
        sequence: ``(T, B, input_size)``, input dropout applied.
        state: the initial state, ``(h, c)`` or ``h``, each ``(B, H)``.
        weight_hh: ``W_hh`` for every step if not the cell's own (DropConnect), else ``None``.
        layout: where the real rows are (:func:`~seqnorm.layers.stack.padding_layout`).
    """
    kernels = native(sequence.device.type)
    assert kernels is not None, "the plan routes here only where the kernels are loaded"
    terms = cell.input_terms(sequence, layout.active, layout.counts).contiguous()
    weight = (cell.weight_hh if weight_hh is None else weight_hh).contiguous()
    mask = None if layout.active is None else layout.active.contiguous()
    # The recurrent norm's shift: its β and the bias that follows it (a GRU's b_hh; an LSTM folds both biases into
    # the input terms).
    hh = kernel_norm(cell.norm_hh, _plus(None if cell.norm_hh is None else cell.norm_hh.bias, cell.recurrent_bias()))
    lstm = cell_kernel(cell) == "lstm"
    norms = (hh, kernel_norm(cell.norm_c, None if cell.norm_c is None else cell.norm_c.bias)) if lstm else (hh,)
    call = _Call(kernels, mask, norms)
    weights = tuple(tensor for norm in norms for tensor in (norm.weight, norm.shift))
    states = tuple(t.contiguous() for t in (state if lstm else (state,)))
    if not _wants_gradient(terms, weight, *states, *weights):
        if lstm:
            outputs, _, _, _, fallbacks = kernels.lstm_forward(terms, *states, weight, mask, *call.native(), False)
            call.count_fallbacks(fallbacks)
            return outputs[0], (outputs[1], outputs[2])
        outputs, _, _, _, fallbacks = kernels.gru_forward(terms, *states, weight, mask, *call.native(), False)
        call.count_fallbacks(fallbacks)
        return outputs[0], outputs[1]
    if lstm:
        hs, h_n, c_n = _LSTMKernel.apply(call, terms, *states, weight, *weights)
        return hs, (h_n, c_n)
    hs, h_n = _GRUKernel.apply(call, terms, *states, weight, *weights)
    return hs, h_n


def _wants_gradient(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _LSTMKernel(torch.autograd.Function):
    """The LSTM recurrence on the kernels: inputs ``terms, h0, c0, W_hh`` and each norm's weight and shift."""

    @staticmethod
    def forward(ctx: Any, call: _Call, terms: Tensor, h0: Tensor, c0: Tensor, weight_hh: Tensor, *weights: Any) -> Any:
        outputs, saved, hh_saved, c_saved, fallbacks = call.kernels.lstm_forward(
            terms, h0, c0, weight_hh, call.mask, *call.native(), True
        )
        call.count_fallbacks(fallbacks)
        hs, h_n, c_n = outputs
        ctx.call, ctx.sizes = call, (len(hh_saved), len(c_saved))
        # saved: cs, acts, tanh_cs, raw (None without a recurrent norm)
        ctx.save_for_backward(h0, c0, weight_hh, hs, *saved, *hh_saved, *c_saved, *weights)
        return hs, h_n, c_n

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_hs: Tensor, grad_h_n: Tensor, grad_c_n: Tensor) -> tuple[Tensor | None, ...]:
        call: _Call = ctx.call
        h0, c0, weight_hh, hs, cs, acts, tanh_cs, raw, *rest = ctx.saved_tensors
        hh_count, c_count = ctx.sizes
        hh_saved, c_saved, weights = rest[:hh_count], rest[hh_count : hh_count + c_count], rest[hh_count + c_count :]
        grads = call.kernels.lstm_backward(
            grad_hs.contiguous(),
            grad_h_n.contiguous(),
            grad_c_n.contiguous(),
            h0,
            c0,
            weight_hh,
            call.mask,
            hs,
            [cs, acts, tanh_cs],
            raw,
            hh_saved,
            c_saved,
            *call.native(tuple(weights)),
        )
        grad_terms, grad_h0, grad_c0, grad_weight_hh, *norm_grads = grads
        return None, grad_terms, grad_h0, grad_c0, grad_weight_hh, *norm_grads  # None: no such parameter


class _GRUKernel(torch.autograd.Function):
    """The GRU recurrence on the kernels: inputs ``terms, h0, W_hh`` and the recurrent norm's weight and shift."""

    @staticmethod
    def forward(ctx: Any, call: _Call, terms: Tensor, h0: Tensor, weight_hh: Tensor, *weights: Any) -> Any:
        outputs, saved, hh_saved, _, fallbacks = call.kernels.gru_forward(
            terms, h0, weight_hh, call.mask, *call.native(), True
        )
        call.count_fallbacks(fallbacks)
        hs, h_n = outputs
        ctx.call, ctx.size = call, len(hh_saved)
        ctx.save_for_backward(h0, weight_hh, hs, *saved, *hh_saved, *weights)  # saved: acts, raw
        return hs, h_n

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_hs: Tensor, grad_h_n: Tensor) -> tuple[Tensor | None, ...]:
        call: _Call = ctx.call
        h0, weight_hh, hs, acts, raw, *rest = ctx.saved_tensors
        hh_saved, weights = rest[: ctx.size], rest[ctx.size :]
        grads = call.kernels.gru_backward(
            grad_hs.contiguous(),
            grad_h_n.contiguous(),
            h0,
            weight_hh,
            call.mask,
            hs,
            [acts, raw],
            hh_saved,
            *call.native(tuple(weights)),
        )
        grad_terms, grad_h0, grad_weight_hh, *norm_grads = grads
        return None, grad_terms, grad_h0, grad_weight_hh, *norm_grads


# --- the generation step ---

CompiledStep = Callable[[Tensor, Tensor, "Tensor | None", int], tuple[Tensor, "Tensor | None"]]


def compiled_step(cell: RecurrentCell, kernels: Any) -> CompiledStep:
    """The no-grad step of ``cell`` as one kernel call, with everything that depends on parameters alone prepared
    once (weight norm's weights, the biases folded into the norms' shifts, the norms' C++ arguments).

    ``run(x, h, c, step) -> (h', c')`` with ``x`` ``(B, I)`` or ``(1, B, I)`` and ``h``, ``c`` ``(1, B, .)``.
    """
    weight_ih, weight_hh = cell.weight_ih.contiguous(), cell.weight_hh.contiguous()
    kind = cell_kernel(cell)
    assert kind is not None
    beta = {name: None if norm is None else norm.bias for name, norm in _norms(cell).items()}
    # LSTM: both biases follow the input norm (folded); GRU: b_ih follows the input norm, b_hh the recurrent one.
    ih = kernel_norm(cell.norm_ih, _plus(beta["ih"], cell.folded_bias()))
    hh = kernel_norm(cell.norm_hh, _plus(beta["hh"], cell.recurrent_bias()))
    state = kernel_norm(cell.norm_c, beta["c"])
    norms = [norm.native(kernels) for norm in (ih, hh, state)]
    step_kernel = kernels.generation_step

    def run(x: Tensor, h: Tensor, c: Tensor | None, step: int) -> tuple[Tensor, Tensor | None]:
        x = x if x.dim() == 2 else x.select(0, 0)
        h, c = h.select(0, 0).contiguous(), None if c is None else c.select(0, 0).contiguous()
        result = step_kernel(kind, x.contiguous(), h, c, weight_ih, weight_hh, *norms, step)
        return result[0].unsqueeze(0), (result[1].unsqueeze(0) if c is not None else None)

    return run


def _norms(cell: RecurrentCell) -> dict[str, nn.Module | None]:
    return {"ih": cell.norm_ih, "hh": cell.norm_hh, "c": cell.norm_c}
