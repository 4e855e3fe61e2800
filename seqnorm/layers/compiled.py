"""The compiled kernels' form of a layer direction's recurrence and of the generation step (:mod:`seqnorm.kernels`).

:func:`run_recurrence` runs what the fast path's loop over hoisted input terms computes. The input projection
``W_ih x`` of all steps is one matmul (:func:`~seqnorm.kernels.projection.project`); then the recurrence — the input
norm on each step's projection (its shift carrying the biases), ``W_hh h`` into a preallocated buffer, the recurrent
norm, the gates, the cell-state norm — runs in C++ as one ``torch.autograd.Function`` whose backward through time is
C++ as well. The Function makes the projection itself, so that its backward can turn the input norm's gradient into
those of ``x`` and ``W_ih`` a chunk of steps at a time rather than hand over a fresh ``(T, B, G)`` gradient (the same
for ``W_hh``'s; ``StepChunks`` in ``recurrence.cpp``). (An input norm that does not declare the
kernel form, sequence-wise statistics say, is applied beforehand by
:meth:`~seqnorm.cells.base.RecurrentCell.input_terms`.) The math of each piece is the kernels' own
(``seqnorm/csrc``: a norm's statistics and their backward in ``norms.h``, the gates in ``cells.h``); what they are
given comes from what the modules declare (:meth:`kernel_norm` of each norm: :class:`~seqnorm.kernels.KernelNorm`).
Without a gradient to compute, the forward keeps only the current step.

:func:`compiled_step` is the generation step (:mod:`seqnorm.layers.stepping`) as one C++ call per cell.

:func:`seqnorm.layers.plan.plan_for` routes here (:func:`~seqnorm.layers.plan.kernel_route`) and says whether
the input norm runs inside; this module runs what the plan decided. The plain-PyTorch paths (the loop, the reference)
give the same outputs, states, gradients and running statistics, and ``tests/kernels/test_kernels.py`` compares them for
every cell and norm.
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
from seqnorm.layers.protocol import PaddingLayout

__all__ = ["compiled_step", "kernel_norm", "run_recurrence"]


def kernel_norm(norm: nn.Module | None, shift: Tensor | None, *, frozen: bool = False) -> KernelNorm:
    """What the kernels need of ``norm`` (the module's own :meth:`kernel_norm`), followed by ``shift``; ``frozen``
    for a cached generation step (nothing changes until it is rebuilt)."""
    if norm is None:
        return NO_NORM if shift is None else dataclasses.replace(NO_NORM, shift=shift)
    return norm.kernel_norm(shift, frozen=frozen)  # type: ignore[operator]


def _shifted(norm: KernelNorm, shift: Tensor | None) -> KernelNorm:
    """``norm`` followed by ``shift`` (the plan builds the norms without the biases that follow them)."""
    return norm if shift is None else dataclasses.replace(norm, shift=shift)


def _plus(first: Tensor | None, second: Tensor | None) -> Tensor | None:
    if first is None or second is None:
        return second if first is None else first
    return first + second


class _Call:
    """A call's non-tensor arguments: the kernels, the padding mask and the norms (for the backward, with their
    weight and shift replaced by the saved ones)."""

    def __init__(
        self, kernels: Any, mask: Tensor | None, norms: tuple[KernelNorm, ...], lstm: bool, options: dict[str, Any]
    ) -> None:
        self.kernels = kernels
        self.states = 2 if lstm else 1  # h0, c0 or h0
        self.mask = mask
        self.norms = norms
        self.options = options  # the entry points' keywords: under autocast, ``half`` (:func:`_half_products`)

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
    cell: RecurrentCell,
    sequence: Tensor,
    state: Any,
    weight_hh: Tensor | None,
    layout: PaddingLayout,
    input_norm_inside: bool,
    norms: tuple[KernelNorm, ...],
) -> tuple[Tensor, Any]:
    """One direction of one layer on the kernels; returns ``(outputs (T, B, H), final state)``.

    Args:
        cell: a cell the plan routes here (:func:`~seqnorm.layers.plan.kernel_route` finds nothing against it).
        sequence: ``(T, B, input_size)``, input dropout applied.
        state: the initial state, ``(h, c)`` or ``h``, each ``(B, H)``.
        weight_hh: ``W_hh`` for every step if not the cell's own (DropConnect), else ``None``.
        layout: where the real rows are (:func:`~seqnorm.layers.sequence.padding_layout`).
        input_norm_inside: whether the kernels run the input norm (the plan's
            :func:`~seqnorm.layers.plan.kernel_input_norm`); else ``input_terms`` applies it first.
        norms: what the cell's norms hand the kernels, as the plan built them
            (:func:`~seqnorm.layers.plan.cell_kernel_norms`: input, recurrent and, for an LSTM, cell-state norm,
            without shifts); the biases that follow each norm become its shift here.
    """
    kernels = native(sequence.device.type)  # the backend the plan found for the device
    assert kernels is not None, "the plan routes here only where the kernels are loaded"
    options: dict[str, Any] = {}
    if torch.is_autocast_enabled(sequence.device.type):  # a backend that runs autocast: in the parameters' dtype
        dtype = cell.weight_hh.dtype
        sequence = sequence.to(dtype)
        state = tuple(t.to(dtype) for t in state) if isinstance(state, tuple) else state.to(dtype)
        options = _half_products(sequence.device.type, dtype)
    lstm = cell_kernel(cell) == "lstm"
    beta = {name: None if norm is None else norm.bias for name, norm in _norms(cell).items()}
    weight_ih: Tensor | None = None
    if input_norm_inside:
        # The input norm runs step by step in the kernel, on W_ih x; the biases that follow it are its shift. The
        # recurrence takes x and W_ih and projects itself, so that its backward can hand the projection's
        # gradients the input norm's dx a chunk of steps at a time (csrc/recurrence.cpp, StepChunks).
        inputs, weight_ih = sequence, cell.weight_ih
        ih = _shifted(norms[0], _plus(beta["ih"], cell.folded_bias()))
    else:  # no input norm, or one the kernels do not run (sequence-wise statistics): the finished input terms
        inputs, ih = cell.input_terms(sequence, layout.active, layout.counts), NO_NORM
    # The recurrent norm's shift: its β and the bias that follows it (a GRU's b_hh; an LSTM folds both biases into
    # the input side).
    hh = _shifted(norms[1], _plus(beta["hh"], cell.recurrent_bias()))
    norms = (ih, hh, _shifted(norms[2], beta["c"])) if lstm else (ih, hh)
    call = _Call(kernels, None if layout.active is None else layout.active.contiguous(), norms, lstm, options)
    weights = tuple(tensor for norm in norms for tensor in (norm.weight, norm.shift))
    weight = (cell.weight_hh if weight_hh is None else weight_hh).contiguous()
    inputs = inputs.contiguous()
    states = tuple(t.contiguous() for t in (state if lstm else (state,)))
    if _wants_gradient(inputs, weight_ih, weight, *states, *weights):
        outputs = _Recurrence.apply(call, inputs, *states, weight, *weights, weight_ih)
    else:
        if weight_ih is not None:
            inputs = _kept_projection(kernels, inputs, weight_ih)
        forward = kernels.lstm_forward if lstm else kernels.gru_forward
        outputs, _, _, fallbacks = forward(inputs, *states, weight, call.mask, *call.native(), False, **options)
        call.count_fallbacks(fallbacks)
    return outputs[0], ((outputs[1], outputs[2]) if lstm else outputs[1])


def _half_products(device_type: str, dtype: torch.dtype) -> dict[str, Any]:
    """The backend's keywords under autocast: the dtype of the per-step products' operands (``W_hh h`` and its
    backward), autocast's own for float32 parameters (summed in float32 by the backend); nothing for float64, which
    autocast does not lower either."""
    half = torch.get_autocast_dtype(device_type)
    return {"half": half} if dtype == torch.float32 and half in (torch.bfloat16, torch.float16) else {}


def _kept_projection(kernels: Any, sequence: Tensor, weight_ih: Tensor) -> Tensor:
    """``W_ih x`` of the whole sequence, in memory the kernels keep between calls (``csrc/buffers.h``): a training
    step saves it, and at the sizes where that matters a fresh block paid its page faults at every call."""
    out = kernels.empty_like_saved([*sequence.shape[:-1], weight_ih.shape[0]], sequence)
    return kernels.project_kept(sequence, weight_ih, out)  # the backend's choice of the operands' layout


def _wants_gradient(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _Recurrence(torch.autograd.Function):
    """A direction's recurrence on the kernels. Inputs: ``inputs`` (the finished input terms, or with ``weight_ih``
    the sequence x whose projection W_ih x the recurrence makes itself, for the input norm), the initial state
    (``h0, c0`` or ``h0``), ``W_hh``, each norm's weight and shift (input, recurrent, cell state), then ``weight_ih``
    (``None`` for finished input terms)."""

    @staticmethod
    def forward(ctx: Any, call: _Call, inputs: Tensor, *tensors: Any) -> Any:
        states, (weight_hh, *weights, weight_ih) = tensors[: call.states], tensors[call.states :]
        sequence = None
        if weight_ih is not None:
            sequence, inputs = inputs, _kept_projection(call.kernels, inputs, weight_ih)
        forward = call.kernels.lstm_forward if call.states == 2 else call.kernels.gru_forward
        outputs, saved, stats, fallbacks = forward(
            inputs, *states, weight_hh, call.mask, *call.native(), True, **call.options
        )
        call.count_fallbacks(fallbacks)
        ctx.call, ctx.sizes = call, (len(saved), *(len(named) for named in stats))
        # The inputs where the backward reads them: the input norm's (LSTM, GRU), and the GRU's recomputed gates.
        kept_inputs = inputs if call.states == 1 or call.norms[0].kind != "none" else None
        flat_stats = [tensor for named in stats for tensor in named]
        ctx.save_for_backward(
            kept_inputs, *states, weight_hh, outputs[0], *saved, *flat_stats, *weights, sequence, weight_ih
        )
        return tuple(outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        call: _Call = ctx.call
        tensors = iter(ctx.saved_tensors)
        inputs = next(tensors)
        states = [next(tensors) for _ in range(call.states)]
        weight_hh, hs = next(tensors), next(tensors)
        saved_count, *stat_counts = ctx.sizes
        saved = [next(tensors) for _ in range(saved_count)]
        stats = [[next(tensors) for _ in range(count)] for count in stat_counts]
        *weights, sequence, weight_ih = tuple(tensors)
        if inputs is None:
            inputs = hs.new_empty(0)  # the kernels read it only for an input norm
        backward = call.kernels.lstm_backward if call.states == 2 else call.kernels.gru_backward
        if call.states == 2:  # LSTM: saved is cs, acts, tanh_cs, raw (None without a recurrent norm)
            extra = [saved[:3], saved[3]]
        else:  # GRU: raw (the gates are recomputed from it and the inputs)
            extra = [saved]
        result = backward(
            *(grad.contiguous() for grad in grads),
            inputs,
            *states,
            weight_hh,
            call.mask,
            hs,
            *extra,
            stats,
            *call.native(tuple(weights)),
            sequence,
            weight_ih,
            ctx.needs_input_grad[1],
            ctx.needs_input_grad[-1],
            **call.options,
        )
        return None, *result  # None for the parameters a norm does not have, and for weight_ih without a projection


# --- the generation step ---

CompiledStep = Callable[[Tensor, Tensor, "Tensor | None", int], tuple[Tensor, "Tensor | None"]]


def compiled_step(cell: RecurrentCell, kernels: Any, rows: int) -> CompiledStep:
    """The no-grad step of ``cell`` as one kernel call, with everything that depends on parameters alone prepared
    once (weight norm's weights, the biases folded into the norms' shifts, the norms' kernel arguments, the weights'
    layout for ``rows`` rows: the backend's ``prepare_step``, e.g. the CPU backend's measured layouts).

    ``run(x, h, c, step) -> (h', c')`` with ``x`` ``(B, I)`` or ``(1, B, I)`` and ``h``, ``c``, ``h'``, ``c'``
    ``(1, B, .)`` (``c'`` ``None`` for a GRU).
    """
    kind = cell_kernel(cell)
    assert kind is not None
    beta = {name: None if norm is None else norm.bias for name, norm in _norms(cell).items()}
    # LSTM: both biases follow the input norm (folded); GRU: b_ih follows the input norm, b_hh the recurrent one.
    ih = kernel_norm(cell.norm_ih, _plus(beta["ih"], cell.folded_bias()), frozen=True)
    hh = kernel_norm(cell.norm_hh, _plus(beta["hh"], cell.recurrent_bias()), frozen=True)
    state = kernel_norm(cell.norm_c, beta["c"], frozen=True)
    norms = [norm.native(kernels) for norm in (ih, hh, state)]
    step_kernel = kernels.generation_step
    weights = (cell.weight_ih, cell.weight_hh)

    folds = [norm.fold_through for norm in (ih, hh, state) if norm.fold_through is not None]
    unfolded = [0]  # the first time index whose BN rows are not all folded yet

    def fixed(weight_ih: Tensor, weight_hh: Tensor) -> CompiledStep:
        def run(x: Tensor, h: Tensor, c: Tensor | None, step: int) -> tuple[Tensor, Tensor | None]:
            return step_kernel(kind, x, h, c, weight_ih, weight_hh, *norms, step)  # type: ignore[no-any-return]

        if not folds:
            return run

        def folding(x: Tensor, h: Tensor, c: Tensor | None, step: int) -> tuple[Tensor, Tensor | None]:
            if step >= unfolded[0]:
                unfolded[0] = min(through(step) for through in folds)
            return run(x, h, c, step)

        return folding

    return kernels.prepare_step(weights, rows, fixed)  # the weights' layout: the backend's own tuning, if any


def _norms(cell: RecurrentCell) -> dict[str, nn.Module | None]:
    return {"ih": cell.norm_ih, "hh": cell.norm_hh, "c": cell.norm_c}
