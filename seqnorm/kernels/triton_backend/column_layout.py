"""The Triton backend's column layout: a program per block of hidden units over every row of the batch, for cells
with per-timestep BatchNorm (or batch renormalization) on ``W_hh h`` or the cell state, whose statistics span the
rows. Launches the kernels of :mod:`.columns`; an input norm per row runs on all steps before the loop
(:func:`~seqnorm.kernels.triton_backend.common.normalize_rows`), a BatchNorm on the input inside each step.

A BatchNorm's running statistics are updated in place by the steps, as the module's forward does; how many updates a
row of statistics saw before each step (its ``num_batches_tracked``, which batch renormalization's limits and a
cumulative average read) is counted on the device before the loop, and the counts are added after it. Steps with
fewer than 2 real rows in training use the running statistics (the module's fallback), counted once after the loop.
The loops themselves (``lstm_forward_loop`` and the rest) are functions of their tensors, which :mod:`.graphs` may
capture; the running statistics they update in place are named to it, and copied back after a replay.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from torch import Tensor

from seqnorm.kernels.backend import KernelNorm
from seqnorm.kernels.triton_backend import columns, graphs
from seqnorm.kernels.triton_backend.common import (
    StepProduct,
    code,
    gru_outputs,
    lstm_outputs,
    mask_arg,
    normalize_rows,
    param,
    previous_states,
    projection_grads,
    rows_backward_all,
)
from seqnorm.kernels.triton_backend.launch import launch

__all__ = ["gru_backward", "gru_forward", "lstm_backward", "lstm_forward"]

_BLOCK = 32  # hidden units a program takes


class _Norm:
    """A norm's arguments for the column kernels, made before the loop (BatchNorm's options, and how many updates
    its rows of running statistics saw before each step), and what comes after it (:meth:`finish`)."""

    def __init__(self, norm: KernelNorm, counts: Tensor, like: Tensor) -> None:
        self.norm = norm
        self.batch = norm.kind == "batch"
        self.seen: Tensor | None = None
        self.options: Tensor | None = None
        self.last: int | None = None  # the last row of running statistics: a BatchNorm's, else None
        if self.batch:
            assert norm.running_mean is not None and norm.num_batches_tracked is not None
            steps, last = counts.shape[0], norm.running_mean.shape[0] - 1
            time = torch.arange(steps, device=counts.device)
            self.rows = time.clamp(max=last)  # steps beyond max_steps share the last row of statistics
            self.updates = (counts >= 2) & norm.training
            shared = self.updates & (time >= last)  # the updates of the shared row, in order
            self.seen = norm.num_batches_tracked[self.rows] + torch.cumsum(shared, 0) - shared.long()
            self.last = last
            options = (norm.eps, norm.momentum, norm.r_max, norm.d_max, norm.warmup, norm.r_max_steps, norm.d_max_steps)
            self.options = like.new_empty(len(options))
            for index, value in enumerate(options):  # filled on the device: no copy from the host (graph capture)
                self.options[index] = value

    def flags(self) -> tuple[int, bool, bool]:
        """(KIND, SHIFT, RENORM)."""
        return code(self.norm), self.norm.shift is not None, self.norm.renorm

    def tensors(self) -> tuple[Tensor | None, ...]:
        """What the forward loop reads of the norm (:data:`_NORM_TENSORS` of them): γ, shift, the running mean and
        variance (which it updates in place in training), the options, the updates seen before each step."""
        norm = self.norm
        return norm.weight, norm.shift, norm.running_mean, norm.running_var, self.options, self.seen

    def finish(self, full_rows: int | None) -> int:
        """After the loop: the rows' update counts added; the fallback steps, known on the host where every step has
        all ``full_rows`` rows (no mask), else one read of the device."""
        if not self.batch:
            return 0
        self.norm.num_batches_tracked.index_add_(0, self.rows, self.updates.long())  # type: ignore[union-attr]
        if not self.norm.training:
            return 0
        if full_rows is not None:
            return 0 if full_rows >= 2 else self.rows.shape[0]
        return int((~self.updates).sum())


_NORM_TENSORS = 6  # a norm's tensors among a forward loop's arguments (:meth:`_Norm.tensors`)


def _prepared(
    norms: list[_Norm], head: tuple[Tensor | None, ...]
) -> tuple[tuple[Tensor | None, ...], tuple[int, ...], dict[str, Any]]:
    """A forward loop's inputs (``head``, then each norm's :meth:`_Norm.tensors`), the indices of those the loop
    updates in place (BatchNorm's running statistics in training) and its settings."""
    tensors = (*head, *(tensor for norm in norms for tensor in norm.tensors()))
    updated = tuple(
        len(head) + _NORM_TENSORS * index + offset
        for index, norm in enumerate(norms)
        if norm.batch and norm.norm.training
        for offset in (2, 3)
    )
    settings = {
        "flags": tuple(flag for norm in norms for flag in norm.flags()),
        "lasts": tuple(norm.last for norm in norms),
        "training": any(norm.norm.training for norm in norms if norm.batch),
    }
    return tensors, updated, settings


def _step_args(
    tensors: tuple[Tensor | None, ...], stats: Tensor | None, last: int | None, t: int, like: Tensor
) -> tuple:
    """A norm's arguments for step ``t`` of a forward kernel (``like`` where it has no such tensor)."""
    weight, shift, mean, var, options, seen = tensors
    batch = last is not None and stats is not None and seen is not None
    return (
        param(weight, like), param(shift, like), param(mean, like), param(var, like), stats if batch else like,
        param(options, like), min(t, last) if batch else 0, seen[t:] if batch else like,
    )  # fmt: skip


def _loop_norms(
    norm_tensors: tuple[Tensor | None, ...], lasts: tuple[int | None, ...], kept: int, widths: tuple[int, ...],
    like: Tensor,
) -> tuple[list[tuple[Tensor | None, ...]], list[Tensor | None]]:  # fmt: skip
    """Each norm's tensors, and the statistics its steps save, ``(4, kept, features)`` — mean, rstd, r, d — for a
    BatchNorm (``None`` for the others)."""
    tensors = [norm_tensors[i : i + _NORM_TENSORS] for i in range(0, len(norm_tensors), _NORM_TENSORS)]
    stats = [
        None if last is None else like.new_empty(4, kept, width) for last, width in zip(lasts, widths, strict=True)
    ]
    return tensors, stats


def _counts(mask: Tensor | None, steps: int, rows: int, like: Tensor) -> Tensor:
    """Each step's number of real rows, on the device."""
    if mask is None:
        return torch.full((steps,), rows, dtype=torch.long, device=like.device)
    return mask.sum(1)


def _input_terms(inputs: Tensor, ih: KernelNorm) -> tuple[Tensor, list[Tensor], KernelNorm]:
    """The input the steps take and the input norm they apply: W_ih x and a BatchNorm, or the finished terms of a
    norm per row (applied here to all steps at once) and no norm."""
    if ih.kind == "batch":
        return inputs, [], ih
    terms, stats = normalize_rows(inputs, ih)
    return terms, stats, KernelNorm("none")


def _grid(hidden: int) -> tuple[int]:
    return (triton.cdiv(hidden, _BLOCK),)


def _block_rows(rows: int) -> int:
    return triton.next_power_of_2(rows)


# --- LSTM ---


def lstm_forward(
    inputs: Tensor, h0: Tensor, c0: Tensor, weight_hh: Tensor, mask: Tensor | None,
    ih: KernelNorm, hh: KernelNorm, c_norm: KernelNorm, save: bool, *, half: torch.dtype | None = None,
) -> tuple[list[Tensor], list[Tensor | None], list[list[Tensor]], list[int]]:  # fmt: skip
    steps, rows, _ = inputs.shape
    terms, ih_row_stats, step_ih = _input_terms(inputs, ih)
    counts = _counts(mask, steps, rows, inputs)
    norms = [_Norm(step_ih, counts, inputs), _Norm(hh, counts, inputs), _Norm(c_norm, counts, inputs)]
    tensors, updated, settings = _prepared(norms, (terms, h0, c0, weight_hh, mask))
    hs, cs, acts, tanh_cs, raw, *stats = graphs.GRAPHS.run(
        "lstm_columns", lstm_forward_loop, tensors, updated=updated, save=save, half=half, **settings
    )
    fallbacks = [norm.finish(rows if mask is None else None) for norm in norms]
    saved: list[Tensor | None] = [cs, acts, tanh_cs, raw] if save else []
    batch_stats = [[stats.pop(0)] if norm.batch else [] for norm in norms]
    kept = [ih_row_stats or batch_stats[0], batch_stats[1], batch_stats[2]] if save else []
    return [hs, hs[-1].clone(), cs[-1 if save else (steps - 1) % 2].clone()], saved, kept, fallbacks


def lstm_forward_loop(
    terms: Tensor, h0: Tensor, c0: Tensor, weight_hh: Tensor, mask: Tensor | None, *norm_tensors: Tensor | None,
    flags: tuple[int, ...], lasts: tuple[int | None, ...], training: bool, save: bool, half: torch.dtype | None,
) -> tuple[Tensor, ...]:  # fmt: skip
    """The forward time loop, a function of its tensors (:mod:`.graphs` may capture it; it updates the BatchNorms'
    running statistics in place): ``hs, cs, acts, tanh_cs, raw``, then each BatchNorm's saved statistics."""
    steps, rows, width = terms.shape
    hidden = width // 4
    kept, hs, cs, acts, tanh_cs, raw = lstm_outputs(terms, save)
    norms, stats = _loop_norms(norm_tensors, lasts, kept, (width, width, hidden), terms)
    product = StepProduct.forward(weight_hh, h0, half)
    for t in range(steps):
        slot = t if save else 0
        h_prev = h0 if t == 0 else hs[t - 1]
        c_prev = c0 if t == 0 else cs[t - 1 if save else (t - 1) % 2]
        product(h_prev, t - 1, raw[slot])
        launch(
            columns.lstm_columns, _grid(hidden),
            terms[t], raw[slot], h_prev, c_prev, mask_arg(None if mask is None else mask[t], h0),
            hs[t], cs[t if save else t % 2], acts[slot], tanh_cs[slot], product.operand(t),
            *(arg for norm in zip(norms, stats, lasts, strict=True) for arg in _step_args(*norm, t, h0)),
            rows, hidden, slot, kept,
            IH=flags[0], IH_SHIFT=flags[1], IH_RENORM=flags[2], HH=flags[3], HH_SHIFT=flags[4], HH_RENORM=flags[5],
            C=flags[6], C_SHIFT=flags[7], C_RENORM=flags[8], TRAINING=training,
            HAS_MASK=mask is not None, SAVE=save, HALF=half is not None, BLOCK_B=_block_rows(rows), BLOCK=_BLOCK,
        )  # fmt: skip
    return (hs, cs, acts, tanh_cs, raw, *(stat for stat in stats if stat is not None))


def _backward_args(weight: Tensor | None, stats: Tensor | None, features: int, like: Tensor) -> tuple:
    """A norm's arguments for a backward step kernel: (γ, statistics, dγ, dshift), the last two the totals the steps
    add to."""
    return param(weight, like), param(stats, like), like.new_zeros(features), like.new_zeros(features)


def _batch_stats(norm: KernelNorm, stats: list[Tensor]) -> Tensor | None:
    """A BatchNorm's saved statistics (``(4, T, F)``), ``None`` for another norm."""
    return stats[0] if norm.kind == "batch" else None


def lstm_backward(
    grad_hs: Tensor, grad_h_n: Tensor, grad_c_n: Tensor, inputs: Tensor, h0: Tensor, c0: Tensor,
    weight_hh: Tensor, mask: Tensor | None, hs: Tensor, saved: list[Tensor], raw: Tensor | None,
    stats: list[list[Tensor]], ih: KernelNorm, hh: KernelNorm, c_norm: KernelNorm,
    sequence: Tensor | None, weight_ih: Tensor | None, want_input: bool, want_weight_ih: bool,
    *, half: torch.dtype | None = None,
) -> list[Tensor | None]:  # fmt: skip
    cs, acts, tanh_cs = saved
    assert raw is not None
    step_ih = ih if ih.kind == "batch" else KernelNorm("none")
    tensors = (
        grad_hs, grad_h_n, grad_c_n, mask, acts, tanh_cs, cs, c0, inputs if step_ih.kind == "batch" else None, raw,
        weight_hh, step_ih.weight, _batch_stats(step_ih, stats[0]), hh.weight, _batch_stats(hh, stats[1]),
        c_norm.weight, _batch_stats(c_norm, stats[2]),
    )  # fmt: skip
    settings = {
        "flags": tuple(flag for norm in (step_ih, hh, c_norm) for flag in (code(norm), norm.shift is not None)),
        "training": any(norm.training for norm in (ih, hh, c_norm) if norm.kind == "batch"),
        "half": half,
    }
    d_input, d_raw, recurrent, carry, dc, *totals = graphs.GRAPHS.run(
        "lstm_columns_backward", lstm_backward_loop, tensors, **settings
    )
    grad_x, grad_h0, grad_weight_hh, ih_grads, grad_weight_ih = _after_the_loop(
        recurrent, carry, d_raw, d_input, h0, hs, inputs, stats[0], ih, (totals[0], totals[1]), sequence, weight_ih,
        want_input, want_weight_ih,
    )  # fmt: skip
    return [grad_x, grad_h0, dc, grad_weight_hh, *ih_grads, *_results(hh, totals[2], totals[3]),
            *_results(c_norm, totals[4], totals[5]), grad_weight_ih]  # fmt: skip


def lstm_backward_loop(
    grad_hs: Tensor, grad_h_n: Tensor, grad_c_n: Tensor, mask: Tensor | None, acts: Tensor, tanh_cs: Tensor,
    cs: Tensor, c0: Tensor, inputs: Tensor | None, raw: Tensor, weight_hh: Tensor, ih_weight: Tensor | None,
    ih_stats: Tensor | None, hh_weight: Tensor | None, hh_stats: Tensor | None, c_weight: Tensor | None,
    c_stats: Tensor | None, *, flags: tuple[int, ...], training: bool, half: torch.dtype | None,
) -> tuple[Tensor, ...]:  # fmt: skip
    """The backward time loop, a function of its tensors (:mod:`.graphs` may capture it): ``d_input``, ``d_raw``, the
    gradient reaching ``h0`` through ``W_hh`` and the one carried past the loop, ``c0``'s gradient, then (dγ, dshift)
    of the input, recurrent and cell-state norms. ``inputs``: W_ih x where the input norm is a BatchNorm."""
    steps, rows, width = acts.shape
    hidden = width // 4
    like = grad_h_n  # what a pointer the kernel does not read points at (small: the interpreter copies each)
    ih_args = _backward_args(ih_weight, ih_stats, width, like)
    hh_args = _backward_args(hh_weight, hh_stats, width, like)
    c_args = _backward_args(c_weight, c_stats, hidden, like)
    d_input = acts.new_empty(steps, rows, width)
    d_raw = acts.new_empty(steps, rows, width)
    recurrent = torch.zeros_like(grad_h_n)
    carry = grad_h_n.clone()
    dc = grad_c_n.clone()
    product = StepProduct(weight_hh, rows, acts, half)
    for t in range(steps - 1, -1, -1):
        launch(
            columns.lstm_columns_backward, _grid(hidden),
            grad_hs[t], recurrent, carry, dc, mask_arg(None if mask is None else mask[t], like), acts[t], tanh_cs[t],
            cs[t], c0 if t == 0 else cs[t - 1], like if inputs is None else inputs[t], raw[t], d_input[t],
            d_raw[t], product.operand(t), *ih_args, *hh_args, *c_args, rows, hidden, t, steps,
            IH=flags[0], IH_SHIFT=flags[1], HH=flags[2], HH_SHIFT=flags[3], C=flags[4], C_SHIFT=flags[5],
            TRAINING=training, HAS_MASK=mask is not None, HALF=half is not None, BLOCK_B=_block_rows(rows),
            BLOCK=_BLOCK,
        )  # fmt: skip
        product(d_raw[t], t, recurrent)
    return (d_input, d_raw, recurrent, carry, dc, *(total for args in (ih_args, hh_args, c_args) for total in args[2:]))


def _after_the_loop(
    recurrent: Tensor, carry: Tensor, d_raw: Tensor, d_input: Tensor, h0: Tensor, hs: Tensor, inputs: Tensor,
    ih_stats: list[Tensor], ih: KernelNorm, ih_totals: tuple[Tensor, Tensor], sequence: Tensor | None,
    weight_ih: Tensor | None, want_input: bool, want_weight_ih: bool,
) -> tuple[Tensor | None, Tensor, Tensor, tuple[Tensor | None, Tensor | None], Tensor | None]:  # fmt: skip
    """The backward's large products and the input side: (the input's gradient, h0's, W_hh's, the input norm's
    (γ, shift), W_ih's)."""
    width, hidden = d_raw.shape[-1], hs.shape[-1]
    grad_weight_hh = d_raw.reshape(-1, width).t() @ previous_states(h0, hs).reshape(-1, hidden)
    if ih.kind == "batch":  # BatchNorm on W_ih x: its gradient and parameters' came from the steps
        grad_inputs, ih_grads = d_input, _results(ih, *ih_totals)
    else:  # the finished input terms' gradient, through the norm per row applied before the loop
        grad_inputs, *ih_grads = rows_backward_all(d_input, inputs, ih_stats, ih, True)
    grad_x, grad_weight_ih = projection_grads(grad_inputs, sequence, weight_ih, want_input, want_weight_ih)
    return grad_x, recurrent + carry, grad_weight_hh, tuple(ih_grads), grad_weight_ih  # type: ignore[return-value]


def _results(norm: KernelNorm, dweight: Tensor, dshift: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """(dL/dγ, dL/dshift) where the norm has them."""
    return (dweight if norm.weight is not None else None), (dshift if norm.shift is not None else None)


# --- GRU ---


def gru_forward(
    inputs: Tensor, h0: Tensor, weight_hh: Tensor, mask: Tensor | None, ih: KernelNorm, hh: KernelNorm, save: bool,
    *, half: torch.dtype | None = None,
) -> tuple[list[Tensor], list[Tensor], list[list[Tensor]], list[int]]:  # fmt: skip
    steps, rows, _ = inputs.shape
    terms, ih_row_stats, step_ih = _input_terms(inputs, ih)
    counts = _counts(mask, steps, rows, inputs)
    norms = [_Norm(step_ih, counts, inputs), _Norm(hh, counts, inputs)]
    tensors, updated, settings = _prepared(norms, (terms, h0, weight_hh, mask))
    hs, acts, us, raw, *stats = graphs.GRAPHS.run(
        "gru_columns", gru_forward_loop, tensors, updated=updated, save=save, half=half, **settings
    )
    fallbacks = [norm.finish(rows if mask is None else None) for norm in norms]
    saved = [acts, us, raw] if save else []
    batch_stats = [[stats.pop(0)] if norm.batch else [] for norm in norms]
    kept = [ih_row_stats or batch_stats[0], batch_stats[1]] if save else []
    return [hs, hs[-1].clone()], saved, kept, fallbacks


def gru_forward_loop(
    terms: Tensor, h0: Tensor, weight_hh: Tensor, mask: Tensor | None, *norm_tensors: Tensor | None,
    flags: tuple[int, ...], lasts: tuple[int | None, ...], training: bool, save: bool, half: torch.dtype | None,
) -> tuple[Tensor, ...]:  # fmt: skip
    """The forward time loop, a function of its tensors (as :func:`lstm_forward_loop`): ``hs, acts, us, raw``,
    then each BatchNorm's saved statistics."""
    steps, rows, width = terms.shape
    hidden = width // 3
    kept, hs, acts, us, raw = gru_outputs(terms, save)
    norms, stats = _loop_norms(norm_tensors, lasts, kept, (width, width), terms)
    product = StepProduct.forward(weight_hh, h0, half)
    for t in range(steps):
        slot = t if save else 0
        h_prev = h0 if t == 0 else hs[t - 1]
        product(h_prev, t - 1, raw[slot])
        launch(
            columns.gru_columns, _grid(hidden),
            terms[t], raw[slot], h_prev, mask_arg(None if mask is None else mask[t], h0), hs[t], acts[slot],
            us[slot], product.operand(t),
            *(arg for norm in zip(norms, stats, lasts, strict=True) for arg in _step_args(*norm, t, h0)),
            rows, hidden, slot, kept,
            IH=flags[0], IH_SHIFT=flags[1], IH_RENORM=flags[2], HH=flags[3], HH_SHIFT=flags[4], HH_RENORM=flags[5],
            TRAINING=training, HAS_MASK=mask is not None, SAVE=save, HALF=half is not None,
            BLOCK_B=_block_rows(rows), BLOCK=_BLOCK,
        )  # fmt: skip
    return (hs, acts, us, raw, *(stat for stat in stats if stat is not None))


def gru_backward(
    grad_hs: Tensor, grad_h_n: Tensor, inputs: Tensor, h0: Tensor, weight_hh: Tensor, mask: Tensor | None,
    hs: Tensor, saved: list[Tensor], stats: list[list[Tensor]], ih: KernelNorm, hh: KernelNorm,
    sequence: Tensor | None, weight_ih: Tensor | None, want_input: bool, want_weight_ih: bool,
    *, half: torch.dtype | None = None,
) -> list[Tensor | None]:  # fmt: skip
    acts, us, raw = saved
    step_ih = ih if ih.kind == "batch" else KernelNorm("none")
    tensors = (
        grad_hs, grad_h_n, mask, acts, us, h0, hs, inputs if step_ih.kind == "batch" else None, raw, weight_hh,
        step_ih.weight, _batch_stats(step_ih, stats[0]), hh.weight, _batch_stats(hh, stats[1]),
    )  # fmt: skip
    settings = {
        "flags": tuple(flag for norm in (step_ih, hh) for flag in (code(norm), norm.shift is not None)),
        "training": any(norm.training for norm in (ih, hh) if norm.kind == "batch"),
        "half": half,
    }
    d_input, d_raw, recurrent, carry, *totals = graphs.GRAPHS.run(
        "gru_columns_backward", gru_backward_loop, tensors, **settings
    )
    grad_x, grad_h0, grad_weight_hh, ih_grads, grad_weight_ih = _after_the_loop(
        recurrent, carry, d_raw, d_input, h0, hs, inputs, stats[0], ih, (totals[0], totals[1]), sequence, weight_ih,
        want_input, want_weight_ih,
    )  # fmt: skip
    return [grad_x, grad_h0, grad_weight_hh, *ih_grads, *_results(hh, totals[2], totals[3]), grad_weight_ih]


def gru_backward_loop(
    grad_hs: Tensor, grad_h_n: Tensor, mask: Tensor | None, acts: Tensor, us: Tensor, h0: Tensor, hs: Tensor,
    inputs: Tensor | None, raw: Tensor, weight_hh: Tensor, ih_weight: Tensor | None, ih_stats: Tensor | None,
    hh_weight: Tensor | None, hh_stats: Tensor | None, *, flags: tuple[int, ...], training: bool,
    half: torch.dtype | None,
) -> tuple[Tensor, ...]:  # fmt: skip
    """The backward time loop, a function of its tensors (as :func:`lstm_backward_loop`): ``d_input``, ``d_raw``,
    the gradient reaching ``h0`` through ``W_hh`` and the one carried past the loop, then (dγ, dshift) of the input
    and recurrent norms."""
    steps, rows, width = acts.shape
    hidden = width // 3
    like = grad_h_n  # what a pointer the kernel does not read points at (small: the interpreter copies each)
    ih_args = _backward_args(ih_weight, ih_stats, width, like)
    hh_args = _backward_args(hh_weight, hh_stats, width, like)
    d_input = acts.new_empty(steps, rows, width)
    d_raw = acts.new_empty(steps, rows, width)
    recurrent = torch.zeros_like(grad_h_n)
    carry = grad_h_n.clone()
    product = StepProduct(weight_hh, rows, acts, half)
    for t in range(steps - 1, -1, -1):
        launch(
            columns.gru_columns_backward, _grid(hidden),
            grad_hs[t], recurrent, carry, mask_arg(None if mask is None else mask[t], like), acts[t], us[t],
            h0 if t == 0 else hs[t - 1], like if inputs is None else inputs[t], raw[t], d_input[t], d_raw[t],
            product.operand(t), *ih_args, *hh_args, rows, hidden, t, steps,
            IH=flags[0], IH_SHIFT=flags[1], HH=flags[2], HH_SHIFT=flags[3], TRAINING=training,
            HAS_MASK=mask is not None, HALF=half is not None, BLOCK_B=_block_rows(rows), BLOCK=_BLOCK,
        )  # fmt: skip
        product(d_raw[t], t, recurrent)
    return (d_input, d_raw, recurrent, carry, *(total for args in (ih_args, hh_args) for total in args[2:]))
