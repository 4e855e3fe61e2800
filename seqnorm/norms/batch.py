"""Per-timestep batch normalization for recurrent networks (Cooijmans et al. 2016).

Recurrent BN keeps separate running statistics for every time step ``t < max_steps`` (rows of the
``running_mean``/``running_var`` buffers) and shares its affine parameters across steps. What steps
``t >= max_steps`` use is ``beyond_max_steps``:

- ``"last"`` (default): the statistics of step ``max_steps - 1``. In evaluation they read that row, and in training
  they update it, so the last row summarizes every long-range step. Right when the hidden-state statistics settle
  after a transient (the usual case); but in variable-length data few sequences reach the last rows, so their
  estimates are the noisiest.
- ``"pooled"``: the moments of all rows pooled, each weighted by the training batches its step has seen (the mean
  of the mixture, and its variance: within-step variance plus the spread of the step means). Steps beyond
  ``max_steps`` are normalized with their own batch statistics in training and update no row. Robust to a noisy
  last row, at the price of blending in the first steps' transient (``h_0 = 0`` makes the recurrent term at step 0
  constant).

Batch Renormalization (Ioffe 2017) builds on it in :mod:`seqnorm.norms.renorm`; the sequence-wise variants (statistics
over batch × time, Cooijmans et al.'s BN-e*) in :mod:`seqnorm.norms.sequence`.

In training, batch statistics are taken over the *active* rows only (``mask``), so padding never enters them. A step
with fewer than 2 active rows has no batch variance; what happens then is ``small_batch``:

- ``"tail"`` (default): in a batch of 2 or more rows, such a step — the tail of the longest sequence of a
  variable-length batch, where the others are padding — is normalized with the running statistics of that step, as
  in evaluation, and does not update them. The running moments are the estimate of that step's population
  statistics, the very ones evaluation uses, so the lone row is normalized as it will be at test time; one row has no
  variance, and its value as a "batch mean" would drag the running mean toward one sequence (normalizing it with its
  own mean would zero it). In the backward pass the running moments are constants, as in evaluation. Every such step
  is counted in :attr:`TimestepBatchNorm.fallback_steps`. A *batch* of one row in training is still a ``ValueError``:
  per-timestep BN cannot train at batch size 1 (use ``norm="layer"``).
- ``"error"``: the strict form, any step with fewer than 2 active rows is a ``ValueError``.
- ``"running"``: every such step falls back to the running statistics, batch size 1 included (then nothing is ever
  normalized with batch statistics, nor updates them: BN degenerates into a fixed affine map).

``momentum=None`` makes the running moments cumulative averages (each step's row weights every batch alike), as in
``torch.nn.BatchNorm1d``. :func:`seqnorm.update_bn` recomputes them exactly over a loader
(:meth:`TimestepBatchNorm.collect_population`).

:meth:`TimestepBatchNorm.forward_sequence` normalizes a whole sequence ``(T, B, F)`` in one vectorized pass (the
layers' fast path uses it for the input term): the same outputs and buffer updates as calling ``forward`` step by
step, without a Python loop over the steps that own a row of statistics.

Under ``torch.autocast``, statistics, normalization and running buffers are float32
(:func:`~seqnorm.norms.precision.float32_statistics`).

The pieces of :mod:`seqnorm.norms.protocol` (the one-node cell step's forward and backward, generation's folded
scale and offset per step) are in :mod:`seqnorm.norms.batch_pieces`, which this module's class inherits.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, get_args

import torch
import torch.autograd.forward_ad as forward_ad
from torch import Tensor, nn

from seqnorm import kernels, torch_ops
from seqnorm.norms.batch_pieces import BatchNormPieces, PopulationMoments, masked_moments, real_index, real_rows
from seqnorm.norms.precision import float32_statistics
from seqnorm.norms.protocol import step_node
from seqnorm.validation import check_eps, check_finite, check_momentum

__all__ = [
    "DEFAULT_MAX_STEPS",
    "DEFAULT_SMALL_BATCH",
    "SMALL_BATCH_POLICIES",
    "BeyondMaxSteps",
    "PopulationMoments",
    "SmallBatchPolicy",
    "TimestepBatchNorm",
    "masked_moments",
]

DEFAULT_MAX_STEPS = 100
"""Time steps with their own batch statistics unless ``max_steps`` says otherwise: the one place the default is."""

SmallBatchPolicy = Literal["tail", "error", "running"]
SMALL_BATCH_POLICIES: tuple[str, ...] = get_args(SmallBatchPolicy)
DEFAULT_SMALL_BATCH: SmallBatchPolicy = "tail"
"""What a training step with fewer than 2 active rows does unless ``small_batch`` says otherwise (module docstring)."""
BeyondMaxSteps = Literal["last", "pooled"]


class TimestepBatchNorm(BatchNormPieces, nn.Module):
    r"""Batch normalization with per-time-step statistics.

    .. math::
        y = \gamma \odot \frac{x - \mu_t}{\sqrt{\sigma_t^2 + \epsilon}} + \beta

    where :math:`\mu_t, \sigma^2_t` are the batch moments over the active rows at step ``t`` in training and the
    running moments of step ``t`` in evaluation (beyond ``max_steps``: see ``beyond_max_steps``).

    Args:
        num_features: feature size ``F``.
        max_steps: number of time steps with their own statistics. Default: 100.
        eps: added to the variance. Default: 1e-5.
        momentum: weight of the new batch in the running moments; ``None``: cumulative average (each batch of a step
            weighs alike, as ``torch.nn.BatchNorm1d``'s). Default: 0.1.
        gain: initial value of :math:`\gamma` (Cooijmans et al. use 0.1). Default: 0.1.
        center: learn :math:`\beta`. The gate terms of a cell use ``False`` (β fixed at 0, the cell bias follows).
        scale: divide by the standard deviation; ``False`` gives mean-only BN (Salimans & Kingma 2016).
        affine: learn :math:`\gamma` (if ``scale``) and :math:`\beta` (if ``center``); ``False``: neither.
        shift: initial value of :math:`\beta`. Default: 0.0.
        small_batch: ``"tail"`` (default), ``"error"`` or ``"running"``: what a training step with fewer than 2
            active rows does (module docstring).
        beyond_max_steps: ``"last"`` or ``"pooled"``, the statistics of steps ``t >= max_steps`` (module docstring).
        owner: name used in error messages (the cell that holds this norm).

    The ``"step"`` form (``forward_step``'s one autograd node, :mod:`seqnorm.norms.protocol`) and the
    ``"generation"`` form need ``scale``, a γ and ``beyond_max_steps="last"``; generation's folds the running
    statistics, so it serves evaluation only.

    Inputs: ``x`` of shape ``(B, F)``, ``step`` (int), ``mask`` ``(B,)`` bool or ``None`` (all rows active).

    Attributes:
        running_mean, running_var: buffers of shape ``(max_steps, F)``.
        num_batches_tracked: buffer ``(max_steps,)``, training batches seen per step.
        fallback_steps: training steps normalized with running statistics because fewer than 2 rows were active
            (a count kept since construction, :func:`seqnorm.update_bn`'s passes excluded; not saved).
    """

    fast_forms: ClassVar[frozenset[str]] = frozenset({"loop", "step", "generation", "kernel"})
    indexed_by_step: ClassVar[bool] = True
    """The step index selects the statistics (a layer started at ``first_step > 0`` must pass it on)."""
    spec_name: ClassVar[str] = "BatchNormSpec"
    """The spec whose options the errors' advice names (``norm=BatchNormSpec(small_batch="running")``)."""

    def __init__(
        self,
        num_features: int,
        max_steps: int = DEFAULT_MAX_STEPS,
        *,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        gain: float = 0.1,
        center: bool = True,
        scale: bool = True,
        affine: bool = True,
        shift: float = 0.0,
        small_batch: SmallBatchPolicy = DEFAULT_SMALL_BATCH,
        beyond_max_steps: BeyondMaxSteps = "last",
        owner: str = "TimestepBatchNorm",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        check_eps(name, eps)
        if max_steps < 1:
            raise ValueError(f"{name}: expected max_steps >= 1, got {max_steps}")
        check_momentum(name, momentum)
        check_finite(name, "gain", gain)
        check_finite(name, "shift", shift)
        if small_batch not in SMALL_BATCH_POLICIES:
            raise ValueError(f"{name}: expected small_batch to be 'tail', 'error' or 'running', got {small_batch!r}")
        if beyond_max_steps not in ("last", "pooled"):
            raise ValueError(f"{name}: expected beyond_max_steps to be 'last' or 'pooled', got {beyond_max_steps!r}")
        factory = {"device": device, "dtype": dtype}
        self.num_features = num_features
        self.max_steps = max_steps
        self.eps = eps
        self.momentum = momentum
        self.gain_init = gain
        self.shift_init = shift
        self.scale = scale
        self.small_batch = small_batch
        self.beyond_max_steps = beyond_max_steps
        self.owner = owner
        self.fallback_steps = 0
        self._population: PopulationMoments | None = None
        self.weight = nn.Parameter(torch.empty(num_features, **factory)) if scale and affine else None
        self.bias = nn.Parameter(torch.empty(num_features, **factory)) if center and affine else None
        self.register_buffer("running_mean", torch.zeros(max_steps, num_features, **factory))
        self.register_buffer("running_var", torch.ones(max_steps, num_features, **factory))
        self.register_buffer("num_batches_tracked", torch.zeros(max_steps, dtype=torch.long, device=device))
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        self.running_mean.zero_()
        self.running_var.fill_(1.0)
        self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        if self.weight is not None:
            nn.init.constant_(self.weight, self.gain_init)
        if self.bias is not None:
            nn.init.constant_(self.bias, self.shift_init)

    def extra_repr(self) -> str:
        text = (
            f"{self.num_features}, max_steps={self.max_steps}, eps={self.eps}, momentum={self.momentum}, "
            f"gain={self.gain_init}, center={self.bias is not None}, scale={self.scale}, "
            f"small_batch={self.small_batch!r}"
        )
        if self.weight is None and self.bias is None:
            text += ", affine=False"
        elif self.bias is not None and self.shift_init:
            text += f", shift={self.shift_init}"
        return text + (", beyond_max_steps='pooled'" if self.beyond_max_steps == "pooled" else "")

    def running_moments(self, step: int) -> tuple[Tensor, Tensor]:
        """The running ``(mean, var)`` that ``step`` normalizes with in evaluation, each ``(F,)``."""
        if step < self.max_steps or self.beyond_max_steps == "last":
            t = min(step, self.max_steps - 1)
            return self.running_mean[t], self.running_var[t]
        return self.pooled_moments()

    def pooled_moments(self) -> tuple[Tensor, Tensor]:
        """Moments of the mixture of all steps' running statistics, weighted by the batches each step has seen."""
        seen = self.num_batches_tracked.to(self.running_mean.dtype)
        # Before any training every row counts alike (no host sync to test for that: a where on the device).
        weights = torch.where(seen.sum() > 0, seen, torch.ones_like(seen))
        weights = (weights / weights.sum()).unsqueeze(1)
        mean = (weights * self.running_mean).sum(0)
        # Within-step variance plus the spread of the step means around the mixture's mean, written as deviations
        # (E[var + mean²] - E[mean]² cancels to nothing in float32 when the means are large next to their spread).
        spread = (weights * (self.running_mean - mean).square()).sum(0)
        return mean, (weights * self.running_var).sum(0) + spread

    @property
    def fused_update(self) -> bool:
        """Whether torch's fused kernel may form a training step's statistics: it updates the running row itself, by
        a float momentum, and no population moments are being collected (:meth:`collect_population`)."""
        return self.momentum is not None and self._population is None

    def raises_small_batch(self, batch: int, fewest: int) -> bool:
        """Whether a training call on ``batch`` rows, ``fewest`` of them active at some step, raises the small-batch
        ``ValueError`` (the layers' plan reads this to run such a call on the reference path)."""
        if not self.training or self._population is not None:
            return False
        if self.small_batch == "error":
            return fewest < 2
        return self.small_batch == "tail" and batch < 2

    def check_batch_size(self, batch: int) -> None:
        """Raise now the error a training call on ``batch`` rows would raise at its first step (a run checks its
        batch size before anything runs)."""
        if self.raises_small_batch(batch, batch):
            raise self._small_batch_error(0, batch, batch)

    # --- population statistics (seqnorm.update_bn) ---

    def collect_population(self) -> None:
        """Start collecting exact population moments: from now on training calls accumulate every step's moments
        over its active rows (float64) instead of updating the running ones, and never raise the small-batch error
        (a step with one active row still counts: its row is part of the population). :meth:`apply_population`
        ends it."""
        self._population = PopulationMoments(self.max_steps, self.num_features, self.running_mean.device)

    def apply_population(self) -> None:
        """Replace the running moments of every step seen on at least 2 rows by the collected exact mean and
        unbiased variance, and stop collecting. Steps seen on fewer keep their running moments;
        ``num_batches_tracked`` is left as it is (it counts training batches: batch renorm's schedule and the
        ``"pooled"`` weights read it)."""
        population, self._population = self._population, None
        if population is None:
            raise RuntimeError(f"{self.owner}: apply_population() without collect_population()")
        mean, var, known = population.moments()
        with torch.no_grad():
            keep = known.unsqueeze(1)
            self.running_mean.copy_(torch.where(keep, mean.to(self.running_mean.dtype), self.running_mean))
            self.running_var.copy_(torch.where(keep, var.to(self.running_var.dtype), self.running_var))

    def discard_population(self) -> None:
        """Stop collecting without changing anything (an interrupted :func:`seqnorm.update_bn`)."""
        self._population = None

    @float32_statistics
    def forward(self, x: Tensor, step: int = 0, mask: Tensor | None = None) -> Tensor:
        """Normalize ``x`` ``(B, F)``, the term at time step ``step``, with that step's statistics.

        In training: the moments of the rows that ``mask`` ``(B,)`` marks real (all rows if ``None``), which also
        update the running moments of ``step`` (steps with fewer than 2 real rows: ``small_batch``); in evaluation:
        the running moments of ``step`` (beyond ``max_steps``: ``beyond_max_steps``). Cells pass ``step``; the
        default 0 is for calling a norm on its own.
        """
        if not self.training:
            return self._forward_rows(x.unsqueeze(0), None, [x.shape[0]], step)[0]
        active = x.shape[0] if mask is None else int(mask.sum())
        return self._forward_rows(x.unsqueeze(0), None if mask is None else mask.unsqueeze(0), [active], step)[0]

    @float32_statistics
    def forward_step(self, x: Tensor, step: int = 0, mask: Tensor | None = None) -> Tensor:
        """``forward`` for a cell's step (the layers' loop, a cell called in the user's own loop): the same result and
        buffer updates, for a caller that, like every cell, keeps the state of the rows ``mask`` marks padding and so
        passes them no gradient (the gradient of their output is not ``forward``'s: none reaches the statistics).

        In training, where the compiled CPU kernels are loaded and the class declares the ``"kernel"`` form, a step
        is the kernels' own norm as one autograd node (:meth:`_kernel_step`, running statistics and tail steps
        included). Otherwise a step of plain BN with at least 2 real rows is torch's fused kernel
        (:meth:`_fused_forward_step`: the real rows' moments update the step's running row in place by the same rule,
        momentum and unbiased variance); any other step of a norm whose class declares the pieces (batch renorm's
        r/d correction, a cumulative average) is its own :class:`~seqnorm.norms.protocol.NodePieces` as one autograd
        node (:func:`~seqnorm.norms.protocol.step_node`). No math is restated here; all are kept for speed
        (docs/performance.md, "A cell in your own loop"). Everything else (evaluation, a small-batch error to raise,
        what the forms do not cover) is :meth:`forward`.
        """
        if not self.training:
            return self.forward(x, step, mask)
        batch = x.shape[0]
        count = batch if mask is None else real_rows(mask)
        if count == batch:
            mask = None  # every row real: the unmasked step's moments
        native = self._step_kernels(x, batch, count)
        if native is not None:
            args = self._kernel_step_args(native)
            y = None if args is None else self._kernel_step(x, step, mask, count, native, args)
            if y is not None:
                return y
        if (
            count >= 2
            and self.scale
            and self.fused_update
            and (step < self.max_steps or self.beyond_max_steps == "last")
            and type(self)._normalize_batch_steps is TimestepBatchNorm._normalize_batch_steps
        ):
            return self._fused_forward_step(x, min(step, self.max_steps - 1), mask)
        if self._steps_by_pieces(x, batch, count):
            return step_node(self, x, step, mask, count, self.bias)
        return self.forward(x, step, mask)

    def _fused_forward_step(self, x: Tensor, row: int, mask: Tensor | None) -> Tensor:
        """A training step by torch's fused kernel: ``native_batch_norm`` normalizes the real rows with their moments
        and updates running row ``row`` in place by BN's rule (momentum, unbiased variance), in one pass; its backward
        is torch's. The padded rows take the same moments (no gradient). No autograd node of ours."""
        index = None if mask is None else real_index(mask)
        real = x if index is None else x.index_select(0, index)
        # A dense γ: aten's CPU BatchNorm backward reads a strided one (load_state_dict(assign=True)) as dense rows.
        weight = None if self.weight is None else self.weight.contiguous()
        # Autograd saves the running tensors it is handed (the training backward does not read them). Row views of
        # the buffers share the buffers' version counter, which any later in-place write to them moves (forward()'s
        # update of another step, reset_running_stats), and the backward would then refuse them as modified; `.data`
        # is the same storage under a counter of its own.
        normalized, mean, rstd = torch_ops.batch_norm_with_stats(
            real,
            weight,
            self.bias,
            self.running_mean.data[row],
            self.running_var.data[row],
            True,
            self.momentum,
            self.eps,
        )
        with torch.no_grad():
            self.num_batches_tracked[row].add_(1)  # in place through the row's view (`+=` also writes it back)
            if index is None:
                return normalized
            padded = self._affine((x - mean) * rstd)
        # Rows by index, gathered and put back (index_select, index_copy): the boolean-mask forms (x[mask],
        # masked_scatter) cost a training step's masked norm about a fifth more, mostly in masked_scatter's backward.
        return padded.index_copy(0, index, normalized)

    def _step_kernels(self, x: Tensor, batch: int, count: int) -> Any:
        """The compiled CPU kernels where a training step of ``count`` real rows of ``batch`` may run them
        (:meth:`_kernel_step`, where :meth:`_kernel_step_args` also finds the instance within the form): this class
        itself declares the ``"kernel"`` form, ``x`` is a CPU tensor in γ's dtype, float32 or float64, no
        small-batch error is to be raised, and the C++ kernels are loaded (not switched off by
        :func:`seqnorm.kernels.disabled`, nor replaced by Triton's interpreter); else ``None``."""
        weight = self.weight
        if (
            "kernel" not in type(self).__dict__.get("fast_forms", ())
            or weight is None
            or x.device.type != "cpu"
            or x.dtype != weight.dtype
            or x.dtype not in (torch.float32, torch.float64)
            or self.raises_small_batch(batch, count)
        ):
            return None
        backend = kernels.native("cpu")
        # the C++ backend's one-node step; the CPU's backend may be Triton's interpreter (SEQNORM_BACKEND=triton),
        # which has none: the step then runs its torch-op form
        return backend if getattr(backend, "norm_step", None) is not None else None

    def _steps_by_pieces(self, x: Tensor, batch: int, count: int) -> bool:
        """Whether a training step of ``count`` real rows of ``batch`` may run :func:`step_node`: this class itself
        declares the ``"step"`` form (a subclass that changes the math does not), the instance is within it (with a
        γ), no small-batch error is to be raised (:meth:`forward` raises it), and none of ``x``, γ and β is a dual
        tensor: the node has no forward-mode derivative, :meth:`forward`'s torch ops have (the kernels' node declines
        the same three, ``norm_step``)."""
        return (
            "step" in type(self).__dict__.get("fast_forms", ())
            and self.weight is not None
            and self.fast_form_blocker("step") is None
            and not self.raises_small_batch(batch, count)
            and all(forward_ad.unpack_dual(t).tangent is None for t in (x, self.weight, self.bias) if t is not None)
        )

    @float32_statistics
    def forward_sequence(self, x: Tensor, mask: Tensor | None = None, counts: list[int] | None = None) -> Tensor:
        """Steps ``0..T-1`` of ``x`` ``(T, B, F)`` at once, equal to ``forward(x[t], t, mask[t])`` for every ``t``.

        ``mask`` ``(T, B)`` bool marks the real rows; ``counts`` (optional) is its per-step sum, which callers that
        already know it pass to avoid a device synchronization. Buffers end up as after the step-by-step calls.
        """
        steps, batch = x.shape[0], x.shape[1]
        if counts is None:
            counts = [batch] * steps if mask is None else mask.sum(1).tolist()
        # Steps below max_steps own a row of statistics: one block. Later steps share the last row and (renorm) read
        # what the previous step wrote there, so they run one at a time, each a block of one step.
        head = min(steps, self.max_steps)
        outputs = [self._forward_rows(x[:head], None if mask is None else mask[:head], counts[:head], 0)]
        for step in range(head, steps):
            mask_t = None if mask is None or counts[step] == batch else mask[step : step + 1]
            outputs.append(self._forward_rows(x[step : step + 1], mask_t, counts[step : step + 1], step))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _forward_rows(self, x: Tensor, mask: Tensor | None, counts: list[int], first: int) -> Tensor:
        """Steps ``first..first+T-1`` of ``x`` ``(T, B, F)``: the one place the training and evaluation math is.

        Below ``max_steps`` step ``t`` uses row ``t`` of the statistics. A step beyond (blocks of one) uses the last
        row (``"last"``) or, with ``"pooled"``, the pooled moments as its running ones and updates no row.
        """
        steps = x.shape[0]
        pooled = first >= self.max_steps and self.beyond_max_steps == "pooled"
        start = min(first, self.max_steps - 1)
        rows = slice(start, start + steps)
        if pooled:
            running_mean, running_var = (moment.view(1, 1, -1) for moment in self.pooled_moments())
        else:
            running_mean = self.running_mean[rows].unsqueeze(1)  # (T, 1, F)
            running_var = self.running_var[rows].unsqueeze(1)
        if not self.training:
            return self._affine(self._normalize_running_steps(x, running_mean, running_var))
        mean, var, counts, active, batch = self._batch_moments(x, mask, counts)  # (T, 1, F)
        use_batch = [count >= 2 for count in counts]
        if not all(use_batch) and self.raises_small_batch(batch, min(counts)):
            index = use_batch.index(False)
            raise self._small_batch_error(first + index, counts[index], batch)
        x_hat = self._normalize_batch_steps(x, mean, var, rows, running_mean, running_var)
        if not all(use_batch):
            fallback = self._normalize_running_steps(x, running_mean, running_var)
            x_hat = torch.where(torch.tensor(use_batch, device=x.device).view(steps, 1, 1), x_hat, fallback)
            if self._population is None:  # training steps only, not seqnorm.update_bn's passes
                self.fallback_steps += use_batch.count(False)
        if pooled:  # pooled statistics come from the per-step rows; a long-range step owns none
            return self._affine(x_hat)
        if self._population is not None:
            self._population.add(rows, mean, var, counts)
        else:
            self._update_running_steps(mean, var, active, use_batch, rows)
        return self._affine(x_hat)

    def _batch_moments(
        self, x: Tensor, mask: Tensor | None, counts: list[int]
    ) -> tuple[Tensor, Tensor, list[int], Tensor, int]:
        """Each step's mean and biased variance ``(T, 1, F)`` over the active rows of ``x`` ``(T, B, F)``, the active
        rows per step (a list, and as a ``(T, 1, 1)`` divisor, at least 1) and the batch size they come from (here
        the local ones; across processes in :mod:`seqnorm.norms.sync`)."""
        active = self._divisors(counts, x)
        mean, var = masked_moments(x, mask, active, dim=1)
        return mean, var, counts, active, x.shape[1]

    @staticmethod
    def _divisors(counts: list[int], like: Tensor) -> Tensor:
        """``counts`` as a ``(T, 1, 1)`` tensor of divisors: a step with no real row divides by 1, not 0 (its NaN
        would reach the gradient through the fallback's where)."""
        return torch.tensor([max(count, 1) for count in counts], dtype=like.dtype, device=like.device).view(-1, 1, 1)

    def _normalize_running_steps(self, x: Tensor, running_mean: Tensor, running_var: Tensor) -> Tensor:
        centered = x - running_mean
        return centered * torch.rsqrt(running_var + self.eps) if self.scale else centered

    def _normalize_batch_steps(
        self, x: Tensor, mean: Tensor, var: Tensor, rows: slice, running_mean: Tensor, running_var: Tensor
    ) -> Tensor:
        """``x`` normalized with its batch moments; ``rows`` and the running moments are for renorm's correction."""
        centered = x - mean
        return centered * torch.rsqrt(var + self.eps) if self.scale else centered

    @torch.no_grad()
    def _update_running_steps(
        self, mean: Tensor, var: Tensor, active: Tensor, use_batch: list[bool], rows: slice
    ) -> None:
        """Rows ``rows`` of the running moments take a momentum step toward the steps' batch moments ``(T, 1, F)``
        (the unbiased variance, as in torch.nn.BatchNorm1d); steps not in ``use_batch`` leave theirs."""
        unbiased = var * (active / (active - 1))  # inf/NaN on fallback steps (1 row): discarded below
        if self.momentum is None:  # cumulative average: the k-th batch of a step weighs 1/k
            weight: float | Tensor = 1.0 / (self.num_batches_tracked[rows] + 1).to(self.running_mean.dtype)
            weight = weight.unsqueeze(1)
        else:
            weight = self.momentum
        new_mean = torch.lerp(self.running_mean[rows], mean.squeeze(1).to(self.running_mean.dtype), weight)
        new_var = torch.lerp(self.running_var[rows], unbiased.squeeze(1).to(self.running_var.dtype), weight)
        if all(use_batch):
            self.running_mean[rows] = new_mean
            self.running_var[rows] = new_var
            self.num_batches_tracked[rows] += 1
            return
        keep = torch.tensor(use_batch, device=mean.device)
        self.running_mean[rows] = torch.where(keep.unsqueeze(1), new_mean, self.running_mean[rows])
        self.running_var[rows] = torch.where(keep.unsqueeze(1), new_var, self.running_var[rows])
        self.num_batches_tracked[rows] += keep.long()

    def _small_batch_error(self, step: int, active: int, batch: int) -> ValueError:
        if batch < 2:
            return ValueError(
                f"{self.owner}: expected a batch of at least 2 rows to form per-timestep batch statistics in "
                f"training, got batch size {batch}. The batch variance of fewer than 2 samples is undefined: "
                'per-timestep BN cannot train at batch size 1; use norm="layer" (or "rms"/"weight"), which works '
                f'at batch size 1, or pass norm={self.spec_name}(small_batch="running") to normalize every step '
                "with running statistics."
            )
        return ValueError(
            f"{self.owner}: expected at least 2 active (non-padding) rows at step {step} to form per-timestep "
            f"batch statistics in training, got {active} (batch size {batch}). The batch variance of a "
            'single sample is undefined; use norm="layer" (or "rms"/"weight"), which works at batch size 1, '
            f'or pass norm={self.spec_name}(small_batch="tail") (the default) to normalize such steps with their '
            "running statistics."
        )

    def _affine(self, x_hat: Tensor) -> Tensor:
        if self.weight is not None:
            x_hat = x_hat * self.weight
        return x_hat if self.bias is None else x_hat + self.bias

    def _update_running(self, mean: Tensor, var: Tensor, active: int, step: int) -> None:
        """One step's update (the one-node step's masked steps): :meth:`_update_running_steps` on one row."""
        if step >= self.max_steps and self.beyond_max_steps == "pooled":
            return
        t = min(step, self.max_steps - 1)
        if self._population is not None:
            self._population.add(slice(t, t + 1), mean.view(1, 1, -1), var.view(1, 1, -1), [active])
            return
        count = torch.tensor(float(active), dtype=var.dtype, device=var.device)
        self._update_running_steps(mean.view(1, 1, -1), var.view(1, 1, -1), count, [True], slice(t, t + 1))
