"""Per-timestep BatchNorm's pieces for the one-node cell step and the generation step (:mod:`seqnorm.norms.protocol`).

:class:`BatchNormPieces` is a base of :class:`~seqnorm.norms.TimestepBatchNorm` (and, through it, of
:class:`~seqnorm.norms.TimestepBatchRenorm`, which overrides the training pieces): its methods read the module's own
buffers and options. :meth:`~BatchNormPieces.step_forward` computes what ``forward_step`` computes, with the same
running-statistics updates (torch's fused kernel on a training step's real rows, masked steps included), and records
the step's mean and ``1/std``; :meth:`~BatchNormPieces.step_backward` is torch's BatchNorm backward kernel (on a masked
step's real rows), written out for running-statistics steps. :func:`~seqnorm.norms.protocol.step_node` runs them as
one autograd node: a cell's masked training step in a loop of the user's own (``forward_step``).

The statistics helpers beside it: :func:`masked_moments` (a batch's moments over its active rows) and
:class:`PopulationMoments` (exact moments over many batches, for :func:`seqnorm.update_bn`).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from seqnorm import torch_ops
from seqnorm.kernels import KernelNorm

__all__ = ["BatchNormPieces", "PopulationMoments", "StepRecord", "masked_moments", "real_index", "real_rows"]

_read: tuple[weakref.ref[Tensor], int, Tensor] | None = None  # the last mask read: it, its version, its real rows


def real_index(mask: Tensor) -> Tensor:
    """The indices ``(B_real,)`` of the rows ``mask`` ``(B,)`` marks real, read from the device once per mask: a
    cell's step hands one mask to its two or three norms, and each read is a host sync (``nonzero``). A mask written
    in place since (its version moved) or a new tensor is read again."""
    global _read
    seen = _read
    if seen is not None and seen[0]() is mask and seen[1] == mask._version:
        return seen[2]
    index = mask.nonzero().squeeze(1)
    _read = (weakref.ref(mask), mask._version, index)
    return index


def real_rows(mask: Tensor) -> int:
    """The number of rows ``mask`` marks real (:func:`real_index`'s length, read once per mask)."""
    return real_index(mask).shape[0]


def masked_moments(x: Tensor, mask: Tensor | None, active: int | Tensor, dim: int = 0) -> tuple[Tensor, Tensor]:
    """Mean and biased variance over the batch dimension ``dim`` of ``x``, counting only rows where ``mask`` is true.

    ``x`` is ``(B, F)`` with ``dim=0`` (one step; the moments are ``(F,)``) or ``(T, B, F)`` with ``dim=1`` (a block of
    steps; the moments keep that dimension, ``(T, 1, F)``). ``mask`` is ``x``'s shape without ``F`` (``None``: every
    row), ``active`` the number of real rows (per step, shaped ``(T, 1, 1)``, for a block).
    """
    keepdim = dim != 0
    if mask is None:
        # Sums, not torch.var_mean(x, dim=0): on CPU that strided reduction is several times slower at RNN sizes.
        mean = x.sum(dim, keepdim=True) / active
        var = (x - mean).square().sum(dim, keepdim=keepdim) / active
    else:
        keep = mask.unsqueeze(-1)
        # where, not multiplication by the mask: an inf or NaN in a padded row must not reach the statistics
        mean = torch.where(keep, x, 0.0).sum(dim, keepdim=True) / active
        var = torch.where(keep, x - mean, 0.0).square().sum(dim, keepdim=keepdim) / active
    return (mean if keepdim else mean.squeeze(dim)), var


class PopulationMoments:
    """Exact moments of every row's inputs over many batches: counts, means and sums of squared deviations in float64,
    merged batch by batch with Chan et al.'s pairwise update (no catastrophic cancellation, any batch sizes).

    Attributes:
        count: ``(R, 1)`` active rows seen per row of statistics.
        mean, m2: ``(R, F)`` their mean and sum of squared deviations from it.
    """

    def __init__(self, rows: int, features: int, device: torch.device) -> None:
        self.count = torch.zeros(rows, 1, dtype=torch.float64, device=device)
        self.mean = torch.zeros(rows, features, dtype=torch.float64, device=device)
        self.m2 = torch.zeros(rows, features, dtype=torch.float64, device=device)

    def add(self, rows: slice, mean: Tensor, var: Tensor, counts: list[int]) -> None:
        """Merge steps of batch moments ``mean``, ``var`` (biased, ``(T, 1, F)``, over ``counts`` rows) into rows."""
        count_b = torch.tensor(counts, dtype=torch.float64, device=self.count.device).unsqueeze(1)  # (T, 1)
        mean_b, m2_b = mean.squeeze(1).double(), var.squeeze(1).double() * count_b
        count_a, mean_a = self.count[rows], self.mean[rows]
        total = count_a + count_b
        delta = mean_b - mean_a
        share = count_b / total.clamp(min=1.0)  # a step with no active row (count 0) changes nothing
        self.mean[rows] = mean_a + delta * share
        self.m2[rows] += m2_b + delta.square() * count_a * share
        self.count[rows] = total

    def moments(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(mean, unbiased var, known)``: ``known`` ``(R,)`` marks the rows with at least 2 rows seen."""
        known = self.count.squeeze(1) >= 2
        return self.mean, self.m2 / (self.count - 1).clamp(min=1.0), known


class StepRecord(NamedTuple):
    """What a BatchNorm step's backward needs of its forward (:meth:`BatchNormPieces.step_forward`)."""

    mean: Tensor
    rstd: Tensor
    batch_step: bool  # batch statistics (else the running ones, constants)
    r: Tensor | None = None  # batch renormalization's correction in training (else None: BatchNorm's)
    d: Tensor | None = None


# Each module's kept _kernel_step_args(), beside the module rather than in it (a module is pickled and deep-copied with
# its __dict__; the kernels' NormArgs are neither).
_KERNEL_STEP_ARGS: weakref.WeakKeyDictionary[object, tuple[tuple[object, ...], tuple[object, ...], Any]] = (
    weakref.WeakKeyDictionary()
)


class BatchNormPieces:
    """:class:`~seqnorm.norms.protocol.StepPieces` and :class:`~seqnorm.norms.protocol.NodePieces` of per-timestep
    BatchNorm."""

    # Provided by TimestepBatchNorm.
    eps: float
    momentum: float | None
    max_steps: int
    training: bool
    weight: Tensor | None
    scale: bool
    beyond_max_steps: str
    fallback_steps: int
    fused_update: bool
    _population: object | None
    running_mean: Tensor
    running_var: Tensor
    num_batches_tracked: Tensor

    def fast_form_blocker(self, form: str) -> str | None:
        """What of this instance the pieces below do not cover (read by :func:`seqnorm.layers.plan.norm_blocker`)."""
        if self._population is not None:
            return "collecting population statistics (seqnorm.update_bn)"
        if not self.scale:
            return "mean-only BatchNorm (scale=False)"
        if self.beyond_max_steps != "last":
            return "pooled statistics beyond max_steps"
        if form == "generation" and self.training:
            return "batch statistics in training"  # generation folds the running statistics
        if form == "kernel" and not self._dense_buffers():
            return "running statistics not dense or not in the parameters' dtype (the kernels update them in place)"
        return None

    def _dense_buffers(self) -> bool:
        # what the compiled kernels index as dense rows of the model's dtype (a state dict loaded with assign=True
        # can leave strided or other-dtype buffers, which the plain paths handle)
        dtype = self.weight.dtype if self.weight is not None else self.running_mean.dtype
        moments = (self.running_mean, self.running_var)
        return (
            all(moment.is_contiguous() and moment.dtype == dtype for moment in moments)
            and self.num_batches_tracked.is_contiguous()
            and self.num_batches_tracked.dtype == torch.long
        )

    def _kernel_step(
        self, x: Tensor, step: int, mask: Tensor | None, count: int, kernels: Any, args: Any
    ) -> Tensor | None:
        """A training step (a cell's, :meth:`TimestepBatchNorm.forward_step`) by the compiled CPU kernels' norm: what
        :meth:`step_forward` computes, running statistics and fallback count included, as one autograd node made in
        C++ (``NormStepBackward``, by ``kernels.norm_step``) whose forward and backward are one kernel call each; under
        ``create_graph`` its backward is :meth:`_kernel_step_backward`. ``None``, having done nothing, for a tensor of
        forward-mode AD or of a ``torch.func`` transform (the caller then runs its torch-op form, which supports them).
        ``kernels``: :func:`seqnorm.kernels.native`'s; ``args``: :meth:`_kernel_step_args`'."""
        y = kernels.norm_step(x.contiguous(), self.weight, self.bias, mask, args, step, self)
        # the "running" fallback, as step_forward counts it (the kernel normalizes with the running statistics)
        if y is not None and count < 2:
            self.fallback_steps += 1
        return y

    def _kernel_step_backward(
        self, dy: Tensor, x: Tensor, mask: Tensor | None, weight: Tensor, shift: Tensor | None, saved: list[Tensor]
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The backward of :meth:`_kernel_step`'s node under ``create_graph`` (a second derivative), which its C++
        node calls: :meth:`step_backward` in differentiable torch ops, on the statistics the kernel's forward
        saved (``saved``: mean, rstd, r, d (empty but for batch renormalization's batch steps), batch step or
        not, each with a leading row)."""
        mean, rstd, r, d, batch = saved
        batch_step = bool(batch[0])
        renormed = batch_step and r.numel() != 0  # batch renormalization's r and d (a running step has none)
        record = StepRecord(mean[0], rstd[0], batch_step, *((r[0], d[0]) if renormed else (None, None)))
        return self.step_backward(dy, x, mask, weight, shift, record)

    def _kernel_step_args(self, kernels: Any) -> Any:
        """The kernels' ``NormArgs`` for :meth:`_kernel_step`, or ``None`` where this instance's ``"kernel"`` form is
        blocked (:meth:`fast_form_blocker`) or its γ or β is not dense (the kernels would read a dense copy, which an
        optimizer's update would not reach). Kept between steps while what they hold and say is the same: the same
        tensors (γ and β at the same memory), mode and options. Built anew at every step, they cost a cell's BN
        step more than the kernel saved (``kernel_norm`` and ``native`` read a dozen module attributes)."""
        weight, bias, buffers = self.weight, self.bias, self._buffers  # type: ignore[attr-defined]
        tensors = (weight, bias, buffers["running_mean"], buffers["running_var"], buffers["num_batches_tracked"])
        key = (
            kernels,
            *map(id, tensors),
            None if weight is None else weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            self.training,
            self._population is None,  # type: ignore[attr-defined]
            self.momentum,
            self.eps,
            self.scale,
            self.beyond_max_steps,
            *self._kernel_options(),
        )
        kept = _KERNEL_STEP_ARGS.get(self)
        if kept is not None and kept[0] == key:
            return kept[2]
        dense = weight is not None and weight.is_contiguous() and (bias is None or bias.is_contiguous())
        args = None
        if dense and self.fast_form_blocker("kernel") is None:
            args = self.kernel_norm(bias).native(kernels)
        _KERNEL_STEP_ARGS[self] = (key, tensors, args)  # the tensors kept alive: their ids stay theirs
        return args

    def _kernel_options(self) -> tuple[object, ...]:
        """The options :meth:`kernel_norm` passes beyond BatchNorm's own (batch renormalization's schedule)."""
        return ()

    def step_forward(
        self, x: Tensor, step: int, mask: Tensor | None, count: int, weight: Tensor, shift: Tensor | None
    ) -> tuple[Tensor, StepRecord]:
        # Fewer than 2 rows in training: the "running" fallback (forward raises the erroring policy's error).
        use_batch = self.training and count >= 2
        if self.training and not use_batch:
            self.fallback_steps += 1
        # A batch step of plain BN never comes here: forward_step runs it by torch's fused kernels
        # (TimestepBatchNorm._fused_forward_step); batch renorm's batch steps are its own step_forward.
        if use_batch:
            mean, var = masked_moments(x, mask, count)
            rstd = torch.rsqrt(var + self.eps)
            self._update_running(mean, var, count, step)  # type: ignore[attr-defined]
        else:
            running_mean, running_var = self.running_moments(step)  # type: ignore[attr-defined]
            mean = running_mean.clone()  # a later step (t >= max_steps) may update this row in place
            rstd = torch.rsqrt(running_var + self.eps)
        y = (x - mean) * rstd * weight
        return (y if shift is None else y + shift), StepRecord(mean, rstd, use_batch)

    def _fused_step(self, x: Tensor, mask: Tensor | None, row: int) -> tuple[Tensor, Tensor, Tensor]:
        """``(x̂, mean, 1/std)`` of a training step with batch statistics, which torch's fused kernel forms over the
        real rows (``mask``; ``None``: all), updating running row ``row`` in place by BN's rule; padded rows are
        normalized with the same moments. Needs :attr:`fused_update`. Batch renorm's step calls it, and applies its
        correction and ``γ`` to ``x̂``."""
        running = self.running_mean[row], self.running_var[row]
        if mask is None:
            return torch_ops.batch_norm_with_stats(x, None, None, *running, True, self.momentum, self.eps)
        # The real rows gathered: one kernel for their moments and the update, instead of a dozen masked operations.
        real = x.index_select(0, real_index(mask))
        _, mean, rstd = torch_ops.batch_norm_with_stats(real, None, None, *running, True, self.momentum, self.eps)
        return (x - mean) * rstd, mean, rstd

    def step_backward(
        self, dy: Tensor, x: Tensor, mask: Tensor | None, weight: Tensor, shift: Tensor | None, record: StepRecord
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        if record.batch_step and mask is None:
            wanted = [True, True, shift is not None]
            return torch_ops.batch_norm_backward(
                dy, x, weight, None, None, record.mean, record.rstd, True, self.eps, wanted
            )
        return self._masked_backward(dy, x, mask, weight, record.mean, record.rstd, shift, record.batch_step)

    @staticmethod
    def _masked_backward(
        dy: Tensor,
        x: Tensor,
        mask: Tensor | None,
        weight: Tensor,
        mean: Tensor,
        rstd: Tensor,
        shift: Tensor | None,
        batch_step: bool,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Masked batch-statistics steps, and running-statistics steps (constants: a scaling)."""
        shift_grad = None if shift is None else dy.sum(0)
        if not batch_step:
            return dy * weight * rstd, (dy * ((x - mean) * rstd)).sum(0), shift_grad
        # torch's BatchNorm backward kernel on the real rows: padded rows have dy = 0 (so every sum is over the real
        # rows) and get no gradient.
        real = real_index(mask)  # type: ignore[arg-type]
        dx, weight_grad, _ = torch_ops.batch_norm_backward(
            dy[real], x[real], weight, None, None, mean, rstd, True, 0.0, [True, True, False]
        )
        return x.new_zeros(x.shape).index_copy_(0, real, dx), weight_grad, shift_grad

    def folded_statistics(self, shift: Tensor | None, rows: slice = slice(None)) -> tuple[Tensor, Tensor]:
        """In evaluation ``(y - mean_t) / sqrt(var_t + eps) * γ + shift = y * scale_t + offset_t``: the scale and
        offset of the running statistics' ``rows`` (all: ``(max_steps, F)`` each; steps beyond ``max_steps`` use the
        last row)."""
        running_mean = self.running_mean[rows]
        scales = torch.rsqrt(self.running_var[rows] + self.eps) * self.weight
        offsets = -running_mean * scales if shift is None else shift - running_mean * scales
        return scales, offsets

    def generation_step(self, shift: Tensor | None) -> Callable[[Tensor, int], Tensor]:
        # Each step's scale and offset folded once, as the steps reach them (FoldedRows), one row per step: views
        # into the rows FoldedRows fills in place.
        folded, last = FoldedRows(self, shift), self.max_steps - 1
        rows = list(zip(folded.offset.unbind(0), folded.scale.unbind(0), strict=True))

        def batch(y: Tensor, step: int) -> Tensor:
            folded.through(step)
            offset, scale = rows[min(step, last)]
            return torch.addcmul(offset, y, scale)

        return batch

    def kernel_norm(self, shift: Tensor | None, *, frozen: bool = False) -> KernelNorm:
        """What the compiled kernels need (:mod:`seqnorm.kernels`): the module's mode, options and buffers, which the
        kernel updates in place in training by the module's rule (:meth:`forward_step`). ``frozen``: nothing changes
        until the caller rebuilds (a cached generation step), so evaluation's statistics come folded
        (:meth:`folded_statistics`)."""
        folded = FoldedRows(self, shift) if frozen and not self.training else None
        return KernelNorm(
            "batch",
            self.eps,
            self.weight,
            shift,
            self.running_mean,
            self.running_var,
            self.num_batches_tracked,
            momentum=-1.0 if self.momentum is None else self.momentum,
            training=self.training,
            folded_scale=None if folded is None else folded.scale,
            folded_offset=None if folded is None else folded.offset,
            fold_through=None if folded is None else folded.through,
            owner=self,
        )


class FoldedRows:
    """A per-timestep BN's :meth:`~BatchNormPieces.folded_statistics` for a cached generation step (the compiled
    one's and the plain one's), ``scale`` and ``offset`` ``(max_steps, F)``, folded as the steps' time index reaches
    them (:meth:`through`): folding every row at once paused each rebuild of the step, which a loop that samples
    between training updates pays after every update (docs/benchmarks-archive.md)."""

    def __init__(self, norm: BatchNormPieces, shift: Tensor | None) -> None:
        self._norm, self._shift = norm, shift
        self.scale = norm.running_var.new_empty(norm.running_var.shape)
        self.offset = norm.running_var.new_empty(norm.running_var.shape)
        self._done = 0  # rows folded

    def through(self, step: int) -> int:
        """Folds the row a step at time index ``step`` reads (the last row beyond ``max_steps``) and those before
        it, at least doubling what is folded; returns the first time index whose row is not folded yet (none: a
        number no step reaches)."""
        rows = self.scale.shape[0]
        if min(step, rows - 1) >= self._done:
            block = slice(self._done, min(rows, max(step + 1, 2 * self._done, 8)))
            self.scale[block], self.offset[block] = self._norm.folded_statistics(self._shift, block)
            self._done = block.stop
        return self._done if self._done < rows else sys.maxsize
