"""The Triton backend's column layout: a program per block of hidden units over every row of the batch, for cells
with per-timestep BatchNorm (or batch renormalization) on ``W_hh h`` or the cell state, whose statistics span the
rows. Launches the kernels of :mod:`.columns`; an input norm per row runs on all steps before the loop
(:func:`~seqnorm.kernels.triton_backend.common.normalize_rows`), a BatchNorm on the input inside each step.

A BatchNorm's running statistics are updated in place by the steps, as the module's forward does; how many updates a
row of statistics saw before each step (its ``num_batches_tracked``, which batch renormalization's limits and a
cumulative average read) is counted on the device before the loop, and the counts are added after it. Steps with
fewer than 2 real rows in training use the running statistics (the module's fallback), counted once after the loop.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from seqnorm.kernels.backend import KernelNorm
from seqnorm.kernels.triton_backend import columns
from seqnorm.kernels.triton_backend.common import (
    StepProduct,
    code,
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
    """A norm's arguments for the column kernels: BatchNorm's tensors, options and its steps' statistics (4, kept,
    features) — mean, rstd, r, d — or just a shift (or nothing)."""

    def __init__(self, norm: KernelNorm, counts: Tensor, kept: int, features: int, like: Tensor) -> None:
        self.norm = norm
        self.batch = norm.kind == "batch"
        self.like = like
        self.stats = like.new_empty(4, kept, features) if self.batch else like
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
        else:
            self.options = like

    def flags(self) -> tuple[int, bool, bool]:
        """(KIND, SHIFT, RENORM)."""
        return code(self.norm), self.norm.shift is not None, self.norm.renorm

    def forward_args(self, t: int) -> tuple:
        norm, like = self.norm, self.like
        return (
            param(norm.weight, like), param(norm.shift, like), param(norm.running_mean, like),
            param(norm.running_var, like), self.stats, self.options, min(t, self.last) if self.batch else 0,
            self.seen[t:] if self.batch else like,
        )  # fmt: skip

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
    steps, rows, width = inputs.shape
    hidden = width // 4
    terms, ih_row_stats, step_ih = _input_terms(inputs, ih)
    kept = steps if save else 1
    counts = _counts(mask, steps, rows, inputs)
    norms = [_Norm(step_ih, counts, kept, width, inputs), _Norm(hh, counts, kept, width, inputs),
             _Norm(c_norm, counts, kept, hidden, inputs)]  # fmt: skip
    hs = inputs.new_empty(steps, rows, hidden)
    cs = inputs.new_empty(steps if save else 2, rows, hidden)
    acts = inputs.new_empty(kept, rows, width)
    tanh_cs = inputs.new_empty(kept, rows, hidden)
    raw = inputs.new_empty(kept, rows, width)
    product = StepProduct.forward(weight_hh, h0, half)
    flags = [flag for norm in norms for flag in norm.flags()]
    for t in range(steps):
        slot = t if save else 0
        h_prev = h0 if t == 0 else hs[t - 1]
        c_prev = c0 if t == 0 else cs[t - 1 if save else (t - 1) % 2]
        product(h_prev if half is None else product.operand(t - 1), raw[slot])
        launch(
            columns.lstm_columns, _grid(hidden),
            terms[t], raw[slot], h_prev, c_prev, mask_arg(None if mask is None else mask[t], hs),
            hs[t], cs[t if save else t % 2], acts[slot], tanh_cs[slot], product.operand(t),
            *(arg for norm in norms for arg in norm.forward_args(t)),
            rows, hidden, slot, kept,
            IH=flags[0], IH_SHIFT=flags[1], IH_RENORM=flags[2], HH=flags[3], HH_SHIFT=flags[4], HH_RENORM=flags[5],
            C=flags[6], C_SHIFT=flags[7], C_RENORM=flags[8], TRAINING=any(n.norm.training for n in norms if n.batch),
            HAS_MASK=mask is not None, SAVE=save, HALF=half is not None, BLOCK_B=_block_rows(rows), BLOCK=_BLOCK,
        )  # fmt: skip
    fallbacks = [norm.finish(rows if mask is None else None) for norm in norms]
    saved: list[Tensor | None] = [cs, acts, tanh_cs, raw] if save else []
    stats = [ih_row_stats or [norms[0].stats], [norms[1].stats], [norms[2].stats]] if save else []
    return [hs, hs[-1].clone(), cs[-1 if save else (steps - 1) % 2].clone()], saved, stats, fallbacks


def _backward_args(norm: KernelNorm, stats: list[Tensor], features: int, like: Tensor) -> tuple[tuple, Tensor, Tensor]:
    """A norm's arguments for a backward step kernel: (γ, statistics, dγ, dshift), and the two totals."""
    dweight, dshift = like.new_zeros(features), like.new_zeros(features)  # the totals the steps add to
    statistics = stats[0] if norm.kind == "batch" else like
    return (param(norm.weight, like), statistics, dweight, dshift), dweight, dshift


def lstm_backward(
    grad_hs: Tensor, grad_h_n: Tensor, grad_c_n: Tensor, inputs: Tensor, h0: Tensor, c0: Tensor,
    weight_hh: Tensor, mask: Tensor | None, hs: Tensor, saved: list[Tensor], raw: Tensor | None,
    stats: list[list[Tensor]], ih: KernelNorm, hh: KernelNorm, c_norm: KernelNorm,
    sequence: Tensor | None, weight_ih: Tensor | None, want_input: bool, want_weight_ih: bool,
    *, half: torch.dtype | None = None,
) -> list[Tensor | None]:  # fmt: skip
    cs, acts, tanh_cs = saved
    assert raw is not None
    steps, rows, width = acts.shape
    hidden = width // 4
    step_ih = ih if ih.kind == "batch" else KernelNorm("none")
    ih_args, ih_dweight, ih_dshift = _backward_args(step_ih, stats[0], width, acts)
    hh_args, hh_dweight, hh_dshift = _backward_args(hh, stats[1], width, acts)
    c_args, c_dweight, c_dshift = _backward_args(c_norm, stats[2], hidden, acts)
    d_input = acts.new_empty(steps, rows, width)
    d_raw = acts.new_empty(steps, rows, width)
    recurrent = torch.zeros_like(h0)
    carry = grad_h_n.clone()
    dc = grad_c_n.clone()
    training = any(norm.training for norm in (ih, hh, c_norm) if norm.kind == "batch")
    product = StepProduct(weight_hh, rows, acts, half)
    for t in range(steps - 1, -1, -1):
        launch(
            columns.lstm_columns_backward, _grid(hidden),
            grad_hs[t], recurrent, carry, dc, mask_arg(None if mask is None else mask[t], hs), acts[t], tanh_cs[t],
            cs[t], c0 if t == 0 else cs[t - 1], inputs[t] if step_ih.kind == "batch" else hs, raw[t], d_input[t],
            d_raw[t], product.operand(t), *ih_args, *hh_args, *c_args, rows, hidden, t, steps,
            IH=code(step_ih), IH_SHIFT=step_ih.shift is not None,
            HH=code(hh), HH_SHIFT=hh.shift is not None,
            C=code(c_norm), C_SHIFT=c_norm.shift is not None, TRAINING=training, HAS_MASK=mask is not None,
            HALF=half is not None, BLOCK_B=_block_rows(rows), BLOCK=_BLOCK,
        )  # fmt: skip
        product(d_raw[t] if half is None else product.operand(t), recurrent)
    grad_x, grad_h0, grad_weight_hh, ih_grads, grad_weight_ih = _after_the_loop(
        recurrent, carry, d_raw, d_input, h0, hs, inputs, stats[0], ih, (ih_dweight, ih_dshift), sequence, weight_ih,
        want_input, want_weight_ih,
    )  # fmt: skip
    return [grad_x, grad_h0, dc, grad_weight_hh, *ih_grads, *_results(hh, hh_dweight, hh_dshift),
            *_results(c_norm, c_dweight, c_dshift), grad_weight_ih]  # fmt: skip


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
    steps, rows, width = inputs.shape
    hidden = width // 3
    terms, ih_row_stats, step_ih = _input_terms(inputs, ih)
    kept = steps if save else 1
    counts = _counts(mask, steps, rows, inputs)
    norms = [_Norm(step_ih, counts, kept, width, inputs), _Norm(hh, counts, kept, width, inputs)]
    hs = inputs.new_empty(steps, rows, hidden)
    acts = inputs.new_empty(kept, rows, width)
    us = inputs.new_empty(kept, rows, width)
    raw = inputs.new_empty(kept, rows, width)
    product = StepProduct.forward(weight_hh, h0, half)
    flags = [flag for norm in norms for flag in norm.flags()]
    for t in range(steps):
        slot = t if save else 0
        h_prev = h0 if t == 0 else hs[t - 1]
        product(h_prev if half is None else product.operand(t - 1), raw[slot])
        launch(
            columns.gru_columns, _grid(hidden),
            terms[t], raw[slot], h_prev, mask_arg(None if mask is None else mask[t], hs), hs[t], acts[slot],
            us[slot], product.operand(t), *(arg for norm in norms for arg in norm.forward_args(t)),
            rows, hidden, slot, kept,
            IH=flags[0], IH_SHIFT=flags[1], IH_RENORM=flags[2], HH=flags[3], HH_SHIFT=flags[4], HH_RENORM=flags[5],
            TRAINING=any(n.norm.training for n in norms if n.batch), HAS_MASK=mask is not None, SAVE=save,
            HALF=half is not None, BLOCK_B=_block_rows(rows), BLOCK=_BLOCK,
        )  # fmt: skip
    fallbacks = [norm.finish(rows if mask is None else None) for norm in norms]
    saved = [acts, us, raw] if save else []
    stats = [ih_row_stats or [norms[0].stats], [norms[1].stats]] if save else []
    return [hs, hs[-1].clone()], saved, stats, fallbacks


def gru_backward(
    grad_hs: Tensor, grad_h_n: Tensor, inputs: Tensor, h0: Tensor, weight_hh: Tensor, mask: Tensor | None,
    hs: Tensor, saved: list[Tensor], stats: list[list[Tensor]], ih: KernelNorm, hh: KernelNorm,
    sequence: Tensor | None, weight_ih: Tensor | None, want_input: bool, want_weight_ih: bool,
    *, half: torch.dtype | None = None,
) -> list[Tensor | None]:  # fmt: skip
    acts, us, raw = saved
    steps, rows, width = acts.shape
    hidden = width // 3
    step_ih = ih if ih.kind == "batch" else KernelNorm("none")
    ih_args, ih_dweight, ih_dshift = _backward_args(step_ih, stats[0], width, acts)
    hh_args, hh_dweight, hh_dshift = _backward_args(hh, stats[1], width, acts)
    d_input = acts.new_empty(steps, rows, width)
    d_raw = acts.new_empty(steps, rows, width)
    recurrent = torch.zeros_like(h0)
    carry = grad_h_n.clone()
    training = any(norm.training for norm in (ih, hh) if norm.kind == "batch")
    product = StepProduct(weight_hh, rows, acts, half)
    for t in range(steps - 1, -1, -1):
        launch(
            columns.gru_columns_backward, _grid(hidden),
            grad_hs[t], recurrent, carry, mask_arg(None if mask is None else mask[t], hs), acts[t], us[t],
            h0 if t == 0 else hs[t - 1], inputs[t] if step_ih.kind == "batch" else hs, raw[t], d_input[t], d_raw[t],
            product.operand(t), *ih_args, *hh_args, rows, hidden, t, steps,
            IH=code(step_ih), IH_SHIFT=step_ih.shift is not None,
            HH=code(hh), HH_SHIFT=hh.shift is not None, TRAINING=training, HAS_MASK=mask is not None,
            HALF=half is not None, BLOCK_B=_block_rows(rows), BLOCK=_BLOCK,
        )  # fmt: skip
        product(d_raw[t] if half is None else product.operand(t), recurrent)
    grad_x, grad_h0, grad_weight_hh, ih_grads, grad_weight_ih = _after_the_loop(
        recurrent, carry, d_raw, d_input, h0, hs, inputs, stats[0], ih, (ih_dweight, ih_dshift), sequence, weight_ih,
        want_input, want_weight_ih,
    )  # fmt: skip
    return [grad_x, grad_h0, grad_weight_hh, *ih_grads, *_results(hh, hh_dweight, hh_dshift), grad_weight_ih]
