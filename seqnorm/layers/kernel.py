"""The compiled kernels' form of a layer direction's recurrence and of the generation step (:mod:`seqnorm.kernels`).

:func:`run_recurrence` runs what the fast path's loop over hoisted input terms computes. The input projection
``W_ih x`` of all steps is one matmul (:func:`~seqnorm.cells.projection.project`, under autograd); then the
recurrence — the input norm on each step's projection (its shift carrying the biases), ``W_hh h`` into a
preallocated buffer, the recurrent norm, the gates, the cell-state norm — runs in C++ as one
``torch.autograd.Function`` whose backward through time is C++ as well. (An input norm that does not declare the
kernel form, sequence-wise statistics say, is applied beforehand by
:meth:`~seqnorm.cells.base.RecurrentCell.input_terms`.) The math of each piece is the kernels' own
(``seqnorm/csrc``: a norm's statistics and their backward in ``norms.h``, the gates in ``cells.h``); what they are
given comes from what the modules declare (:meth:`kernel_norm` of each norm: :class:`~seqnorm.kernels.KernelNorm`).
Without a gradient to compute, the forward keeps only the current step.

:func:`compiled_step` is the generation step (:mod:`seqnorm.layers.stepping`) as one C++ call per cell.

:func:`seqnorm.layers.plan.plan_for` routes here (:func:`~seqnorm.layers.plan.kernel_blocker`); the plain-PyTorch
paths (:mod:`seqnorm.layers.bptt`, the loop, the reference) give the same outputs, states, gradients and running
statistics, and ``tests/test_kernels.py`` compares them for every cell and norm.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from seqnorm.cells.base import RecurrentCell
from seqnorm.cells.projection import project
from seqnorm.kernels import NO_NORM, KernelNorm, native
from seqnorm.layers.plan import cell_kernel, norm_blocker
from seqnorm.layers.stack import PaddingLayout

__all__ = ["compiled_step", "faster_layout", "kernel_norm", "run_recurrence"]


def kernel_norm(norm: nn.Module | None, shift: Tensor | None, *, frozen: bool = False) -> KernelNorm:
    """What the kernels need of ``norm`` (the module's own :meth:`kernel_norm`), followed by ``shift``; ``frozen``
    for a cached generation step (nothing changes until it is rebuilt)."""
    if norm is None:
        return NO_NORM if shift is None else dataclasses.replace(NO_NORM, shift=shift)
    return norm.kernel_norm(shift, frozen=frozen)  # type: ignore[operator]


def _plus(first: Tensor | None, second: Tensor | None) -> Tensor | None:
    if first is None or second is None:
        return second if first is None else first
    return first + second


class _Call:
    """A call's non-tensor arguments: the kernels, the padding mask and the norms (for the backward, with their
    weight and shift replaced by the saved ones)."""

    def __init__(self, kernels: Any, mask: Tensor | None, norms: tuple[KernelNorm, ...], lstm: bool) -> None:
        self.kernels = kernels
        self.states = 2 if lstm else 1  # h0, c0 or h0
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
    lstm = cell_kernel(cell) == "lstm"
    beta = {name: None if norm is None else norm.bias for name, norm in _norms(cell).items()}
    if cell.norm_ih is not None and norm_blocker(cell.norm_ih, "kernel") is None:
        # The input norm runs step by step in the kernel, on W_ih x; the biases that follow it are its shift.
        inputs = project(sequence, cell.weight_ih)
        ih = kernel_norm(cell.norm_ih, _plus(beta["ih"], cell.folded_bias()))
    else:  # no input norm, or one the kernels do not run (sequence-wise statistics): the finished input terms
        inputs, ih = cell.input_terms(sequence, layout.active, layout.counts), NO_NORM
    # The recurrent norm's shift: its β and the bias that follows it (a GRU's b_hh; an LSTM folds both biases into
    # the input side).
    hh = kernel_norm(cell.norm_hh, _plus(beta["hh"], cell.recurrent_bias()))
    norms = (ih, hh, kernel_norm(cell.norm_c, beta["c"])) if lstm else (ih, hh)
    call = _Call(kernels, None if layout.active is None else layout.active.contiguous(), norms, lstm)
    weights = tuple(tensor for norm in norms for tensor in (norm.weight, norm.shift))
    weight = (cell.weight_hh if weight_hh is None else weight_hh).contiguous()
    inputs = inputs.contiguous()
    states = tuple(t.contiguous() for t in (state if lstm else (state,)))
    if _wants_gradient(inputs, weight, *states, *weights):
        outputs = _Recurrence.apply(call, inputs, *states, weight, *weights)
    else:
        forward = kernels.lstm_forward if lstm else kernels.gru_forward
        outputs, _, _, fallbacks = forward(inputs, *states, weight, call.mask, *call.native(), False)
        call.count_fallbacks(fallbacks)
    return outputs[0], ((outputs[1], outputs[2]) if lstm else outputs[1])


def _wants_gradient(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _Recurrence(torch.autograd.Function):
    """A direction's recurrence on the kernels. Inputs: ``inputs`` (W_ih x, or the finished input terms), the initial
    state (``h0, c0`` or ``h0``), ``W_hh``, then each norm's weight and shift (input, recurrent, cell state)."""

    @staticmethod
    def forward(ctx: Any, call: _Call, inputs: Tensor, *tensors: Any) -> Any:
        states, (weight_hh, *weights) = tensors[: call.states], tensors[call.states :]
        forward = call.kernels.lstm_forward if call.states == 2 else call.kernels.gru_forward
        outputs, saved, stats, fallbacks = forward(inputs, *states, weight_hh, call.mask, *call.native(), True)
        call.count_fallbacks(fallbacks)
        ctx.call, ctx.sizes = call, (len(saved), *(len(named) for named in stats))
        # The inputs where the backward reads them: the input norm's (LSTM, GRU), and the GRU's recomputed gates.
        kept_inputs = inputs if call.states == 1 or call.norms[0].kind != "none" else None
        flat_stats = [tensor for named in stats for tensor in named]
        ctx.save_for_backward(kept_inputs, *states, weight_hh, outputs[0], *saved, *flat_stats, *weights)
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
        weights = tuple(tensors)
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
            *call.native(weights),
        )
        return None, *result  # None for the parameters a norm does not have


# --- the generation step ---

CompiledStep = Callable[[Tensor, Tensor, "Tensor | None", int], tuple[Tensor, "Tensor | None"]]


def compiled_step(cell: RecurrentCell, kernels: Any, rows: int) -> CompiledStep:
    """The no-grad step of ``cell`` as one kernel call, with everything that depends on parameters alone prepared
    once (weight norm's weights, the biases folded into the norms' shifts, the norms' C++ arguments, the weights'
    layout for ``rows`` rows: :func:`faster_layout`).

    ``run(x, h, c, step) -> (h', c')`` with ``x`` ``(B, I)`` or ``(1, B, I)`` and ``h``, ``c``, ``h'``, ``c'``
    ``(1, B, .)`` (``c'`` ``None`` for a GRU).
    """
    weight_ih, weight_hh = faster_layout(cell.weight_ih, rows), faster_layout(cell.weight_hh, rows)
    kind = cell_kernel(cell)
    assert kind is not None
    beta = {name: None if norm is None else norm.bias for name, norm in _norms(cell).items()}
    # LSTM: both biases follow the input norm (folded); GRU: b_ih follows the input norm, b_hh the recurrent one.
    ih = kernel_norm(cell.norm_ih, _plus(beta["ih"], cell.folded_bias()), frozen=True)
    hh = kernel_norm(cell.norm_hh, _plus(beta["hh"], cell.recurrent_bias()), frozen=True)
    state = kernel_norm(cell.norm_c, beta["c"], frozen=True)
    norms = [norm.native(kernels) for norm in (ih, hh, state)]
    step_kernel = kernels.generation_step

    def run(x: Tensor, h: Tensor, c: Tensor | None, step: int) -> tuple[Tensor, Tensor | None]:
        return step_kernel(kind, x, h, c, weight_ih, weight_hh, *norms, step)  # type: ignore[no-any-return]

    return run


def faster_layout(weight: Tensor, rows: int, rounds: int = 5, calls: int = 2) -> Tensor:
    """``W^T`` as a step multiplies ``(rows, in) @ W^T``: a row-major copy or the transposed view (torch's own cells'
    layout), whichever MKL computed faster here, timed once when the step is prepared: the two alternate over
    ``rounds`` rounds of ``calls`` products each, and the lower median wins (0.5 ms for a ``1024 x 256`` weight,
    14 ms for a ``4096 x 1024`` one, copy included).

    Neither wins everywhere on this project's machines: at one row the copy took 10 µs against 19 µs for a
    ``256 x 1024`` weight, the view 64 µs against 76 µs for a GRU's pair at ``I=256, H=512`` (BENCHMARKS.md). Timed
    one candidate after the other, by the fastest of 5 single products, the choice for a GRU's ``1536 x 512``
    ``W_hh`` went to the copy in 2 processes of 6, whose steps then ran 1.16-1.27x torch's cell against
    0.93-0.97x with the view (BENCHMARKS.md, issue 14).

    With deterministic algorithms (``torch.use_deterministic_algorithms``) it is always the view: the two layouts
    round differently, and a timed choice depends on the machine's load.

    The choice is kept per shape, dtype, device, rows and thread count for the process: a step is prepared again
    after every training step and ``train()``/``eval()`` (:func:`seqnorm.layers.stepping.forget`), and a loop that
    alternates training and generation would otherwise time the products each time."""
    if torch.are_deterministic_algorithms_enabled():  # one layout: each rounds differently (see product.h)
        return weight.t()
    key = (tuple(weight.shape), weight.dtype, weight.device.type, rows, torch.get_num_threads())
    known = _LAYOUTS.get(key)
    if known is not None:
        return weight.t().contiguous() if known else weight.t()
    candidates = (weight.t().contiguous(), weight.t())
    probe = weight.new_full((rows, weight.shape[1]), 0.5)  # not drawn: the user's generator stays as it was
    times: tuple[list[float], list[float]] = ([], [])
    for candidate in candidates:
        torch.mm(probe, candidate)  # warm-up
    for _ in range(rounds):
        for candidate, samples in zip(candidates, times, strict=True):
            start = time.perf_counter()
            for _ in range(calls):
                torch.mm(probe, candidate)
            samples.append(time.perf_counter() - start)
    copy_wins = statistics.median(times[0]) <= statistics.median(times[1])
    _LAYOUTS[key] = copy_wins
    return candidates[0] if copy_wins else candidates[1]


# faster_layout's choices in this process: whether the row-major copy won, per shape, dtype, device, rows, threads.
_LAYOUTS: dict[tuple[Any, ...], bool] = {}


def _norms(cell: RecurrentCell) -> dict[str, nn.Module | None]:
    return {"ih": cell.norm_ih, "hh": cell.norm_hh, "c": cell.norm_c}
