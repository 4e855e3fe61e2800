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
with fewer than 2 active rows has no batch variance; by default that is a ``ValueError`` (batch size 1 is the common
cause). ``small_batch="running"`` is the documented fallback: such a step is normalized with its running statistics,
as in evaluation, and does not update them.

:meth:`TimestepBatchNorm.forward_sequence` normalizes a whole sequence ``(T, B, F)`` in one vectorized pass (the
layers' fast path uses it for the input term): the same outputs and buffer updates as calling ``forward`` step by
step, without a Python loop over the steps that own a row of statistics.

Under ``torch.autocast``, statistics, normalization and running buffers are float32
(:func:`~seqnorm.norms.precision.float32_statistics`).

The pieces of :class:`~seqnorm.norms.protocol.StepPieces` (the hand-written BPTT's step and backward, generation's
folded scale and offset per step) are in :mod:`seqnorm.norms.batch_pieces`, which this module's class inherits.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seqnorm.norms.batch_pieces import BatchNormPieces, masked_moments
from seqnorm.norms.precision import float32_statistics

__all__ = ["DEFAULT_MAX_STEPS", "BeyondMaxSteps", "SmallBatchPolicy", "TimestepBatchNorm", "masked_moments"]

DEFAULT_MAX_STEPS = 100
"""Time steps with their own batch statistics unless ``max_steps`` says otherwise: the one place the default is."""

SmallBatchPolicy = Literal["error", "running"]
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
        momentum: weight of the new batch in the running moments. Default: 0.1.
        gain: initial value of :math:`\gamma` (Cooijmans et al. use 0.1). Default: 0.1.
        center: learn :math:`\beta`. The gate terms of a cell use ``False`` (β fixed at 0, the cell bias follows).
        scale: divide by the standard deviation; ``False`` gives mean-only BN (Salimans & Kingma 2016).
        affine: learn :math:`\gamma` (if ``scale``) and :math:`\beta` (if ``center``); ``False``: neither.
        shift: initial value of :math:`\beta`. Default: 0.0.
        small_batch: ``"error"`` or ``"running"``, what a training step with fewer than 2 active rows does.
        beyond_max_steps: ``"last"`` or ``"pooled"``, the statistics of steps ``t >= max_steps`` (module docstring).
        owner: name used in error messages (the cell that holds this norm).

    The ``"bptt"`` and ``"generation"`` forms (see :class:`~seqnorm.norms.LayerNorm`) need ``scale``, a γ and
    ``beyond_max_steps="last"``; generation's folds the running statistics, so it serves evaluation only.

    Inputs: ``x`` of shape ``(B, F)``, ``step`` (int), ``mask`` ``(B,)`` bool or ``None`` (all rows active).

    Attributes:
        running_mean, running_var: buffers of shape ``(max_steps, F)``.
        num_batches_tracked: buffer ``(max_steps,)``, training batches seen per step.
    """

    fast_forms: ClassVar[frozenset[str]] = frozenset({"loop", "bptt", "generation"})

    def __init__(
        self,
        num_features: int,
        max_steps: int = DEFAULT_MAX_STEPS,
        *,
        eps: float = 1e-5,
        momentum: float = 0.1,
        gain: float = 0.1,
        center: bool = True,
        scale: bool = True,
        affine: bool = True,
        shift: float = 0.0,
        small_batch: SmallBatchPolicy = "error",
        beyond_max_steps: BeyondMaxSteps = "last",
        owner: str = "TimestepBatchNorm",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if max_steps < 1:
            raise ValueError(f"{name}: expected max_steps >= 1, got {max_steps}")
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"{name}: expected momentum in [0, 1], got {momentum}")
        if small_batch not in ("error", "running"):
            raise ValueError(f"{name}: expected small_batch to be 'error' or 'running', got {small_batch!r}")
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
        second = (weights * (self.running_var + self.running_mean.square())).sum(0)
        return mean, (second - mean.square()).clamp(min=0.0)

    @float32_statistics
    def forward(self, x: Tensor, step: int = 0, mask: Tensor | None = None) -> Tensor:
        if not self.training:
            return self._forward_rows(x.unsqueeze(0), None, [x.shape[0]], step)[0]
        active = x.shape[0] if mask is None else int(mask.sum())
        return self._forward_rows(x.unsqueeze(0), None if mask is None else mask.unsqueeze(0), [active], step)[0]

    @float32_statistics
    def forward_step(self, x: Tensor, step: int = 0, mask: Tensor | None = None) -> Tensor:
        """``forward`` for the layers' loop: the same result and buffer updates.

        An unmasked training step of plain BN is torch's fused ``batch_norm`` (one kernel, which updates the step's
        running row in place with the same rule: momentum, unbiased variance); no math is restated here. Kept only
        for speed: without it a training forward+backward of ``LSTM(128, 256, norm="batch")`` on the loop path
        (T=100, B=32, 1 thread, CPU) took ~150-154 ms instead of ~123-126 ms (best of 10, alternating runs).
        Everything else is :meth:`forward`.
        """
        if (
            self.training
            and mask is None
            and self.scale
            and x.shape[0] >= 2
            and (step < self.max_steps or self.beyond_max_steps == "last")
            and type(self)._normalize_batch_steps is TimestepBatchNorm._normalize_batch_steps
        ):
            t = min(step, self.max_steps - 1)
            # Copies: autograd saves the running tensors it is given, and a later step may update the same row.
            running_mean, running_var = self.running_mean[t].clone(), self.running_var[t].clone()
            y = F.batch_norm(x, running_mean, running_var, self.weight, self.bias, True, self.momentum, self.eps)
            with torch.no_grad():
                self.running_mean[t] = running_mean
                self.running_var[t] = running_var
                self.num_batches_tracked[t] += 1
            return y
        return self.forward(x, step, mask)

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
        steps, batch = x.shape[0], x.shape[1]
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
        use_batch = [count >= 2 for count in counts]
        if not all(use_batch) and self.small_batch == "error":
            index = use_batch.index(False)
            raise self._small_batch_error(first + index, counts[index], batch)
        # A step with no real row divides by 1, not 0: its NaN would reach the gradient through the fallback's where.
        active = torch.tensor([max(count, 1) for count in counts], dtype=x.dtype, device=x.device).view(steps, 1, 1)
        mean, var = masked_moments(x, mask, active, dim=1)  # (T, 1, F)
        x_hat = self._normalize_batch_steps(x, mean, var, rows, running_mean, running_var)
        if not all(use_batch):
            fallback = self._normalize_running_steps(x, running_mean, running_var)
            x_hat = torch.where(torch.tensor(use_batch, device=x.device).view(steps, 1, 1), x_hat, fallback)
        if not pooled:  # pooled statistics come from the per-step rows; a long-range step owns none
            self._update_running_steps(mean, var, active, use_batch, rows)
        return self._affine(x_hat)

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
        new_mean = torch.lerp(self.running_mean[rows], mean.squeeze(1).to(self.running_mean.dtype), self.momentum)
        new_var = torch.lerp(self.running_var[rows], unbiased.squeeze(1).to(self.running_var.dtype), self.momentum)
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
        return ValueError(
            f"{self.owner}: expected at least 2 active (non-padding) rows at step {step} to form per-timestep "
            f"batch statistics in training, got {active} (batch size {batch}). The batch variance of a "
            'single sample is undefined; use norm="layer" (or "rms"/"weight"), which works at batch size 1, '
            'or pass small_batch="running" to normalize such steps with their running statistics.'
        )

    def _affine(self, x_hat: Tensor) -> Tensor:
        if self.weight is not None:
            x_hat = x_hat * self.weight
        return x_hat if self.bias is None else x_hat + self.bias

    def _update_running(self, mean: Tensor, var: Tensor, active: int, step: int) -> None:
        """One step's update (the hand-written BPTT's masked steps): :meth:`_update_running_steps` on one row."""
        if step >= self.max_steps and self.beyond_max_steps == "pooled":
            return
        t = min(step, self.max_steps - 1)
        count = torch.tensor(float(active), dtype=var.dtype, device=var.device)
        self._update_running_steps(mean.view(1, 1, -1), var.view(1, 1, -1), count, [True], slice(t, t + 1))
