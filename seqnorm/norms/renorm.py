"""Per-timestep Batch Renormalization (Ioffe 2017): :class:`~seqnorm.norms.batch.TimestepBatchNorm` with the r/d
correction that ties training-time batch statistics to the running ones."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import Tensor

from seqnorm import torch_ops
from seqnorm.kernels import KernelNorm
from seqnorm.norms.batch import DEFAULT_MAX_STEPS, TimestepBatchNorm
from seqnorm.norms.batch_pieces import StepRecord, masked_moments
from seqnorm.validation import check_finite

__all__ = ["TimestepBatchRenorm", "renorm_correction"]


def renorm_correction(
    batch_rstd: Tensor, running_rstd: Tensor, mean: Tensor, running_mean: Tensor, r_max: Tensor, d_max: Tensor
) -> tuple[Tensor, Tensor]:
    """Ioffe's ``r = clip(σ_B / σ_run, 1/r_max, r_max)`` and ``d = clip((μ_B - μ_run) / σ_run, -d_max, d_max)``,
    constants of the backward pass (detached), from the inverse standard deviations ``1/σ``; the one place the
    correction is computed (the reference, the vectorized loop and the one-node cell step call it)."""
    r = torch.div(running_rstd, batch_rstd.detach())
    r = torch.minimum(torch.maximum(r, torch.reciprocal(r_max)), r_max)
    d = torch.sub(mean.detach(), running_mean).mul_(running_rstd)
    return r, torch.minimum(torch.maximum(d, -d_max), d_max)


class TimestepBatchRenorm(TimestepBatchNorm):
    r"""Per-timestep Batch Renormalization (Ioffe 2017).

    In training, :math:`\hat x = \frac{x - \mu_B}{\sigma_B} r + d` with
    :math:`r = \mathrm{clip}_{[1/r_{max}, r_{max}]}(\sigma_B / \sigma_t)` and
    :math:`d = \mathrm{clip}_{[-d_{max}, d_{max}]}((\mu_B - \mu_t) / \sigma_t)`, both treated as constants in the
    backward pass, where :math:`\mu_t, \sigma_t` are the running moments of the step. Evaluation is BN with running
    moments, so training and evaluation agree once ``r`` and ``d`` are unclipped.

    Schedule (per step, counted in the updates ``n`` of that step's running moments, the paper's training batches):
    plain BN (``r_max = 1``, ``d_max = 0``) for ``n < warmup``; then ``r_max`` grows linearly to its final value
    over ``r_max_steps`` updates and ``d_max`` over ``d_max_steps``. A step below ``max_steps`` is updated once per
    training batch; the last row, which every step at or beyond ``max_steps`` shares (``beyond_max_steps="last"``),
    once per such step, so its schedule advances ``T - max_steps + 1`` times per batch of length ``T``: the
    warm-up waits for the running moments the correction uses, and those of that row mature as fast.

    Args:
        r_max: final bound of ``r``. Default: 3.0.
        d_max: final bound of ``d``. Default: 5.0.
        warmup: batches of plain BN before the correction starts. Default: 5000 (the paper's value).
        r_max_steps: batches after ``warmup`` over which ``r_max`` ramps from 1. Default: 35000 (so it reaches
            its final value at batch 40000, as in the paper).
        d_max_steps: batches after ``warmup`` over which ``d_max`` ramps from 0. Default: 20000 (final at batch
            25000, as in the paper).
        **kwargs: as for :class:`TimestepBatchNorm`.
    """

    fast_forms: ClassVar[frozenset[str]] = frozenset({"loop", "step", "generation", "kernel"})  # as BatchNorm's
    spec_name: ClassVar[str] = "BatchRenormSpec"

    def __init__(
        self,
        num_features: int,
        max_steps: int = DEFAULT_MAX_STEPS,
        *,
        r_max: float = 3.0,
        d_max: float = 5.0,
        warmup: int = 5000,
        r_max_steps: int = 35000,
        d_max_steps: int = 20000,
        **kwargs: object,
    ) -> None:
        super().__init__(num_features, max_steps, **kwargs)  # type: ignore[arg-type]
        name = type(self).__name__
        check_finite(name, "r_max", r_max, "a finite number >= 1", lambda bound: bound >= 1)
        check_finite(name, "d_max", d_max, "a finite number >= 0", lambda bound: bound >= 0)
        if warmup < 0 or r_max_steps < 1 or d_max_steps < 1:
            raise ValueError(
                f"{name}: expected warmup >= 0 and r_max_steps, d_max_steps >= 1, "
                f"got warmup={warmup}, r_max_steps={r_max_steps}, d_max_steps={d_max_steps}"
            )
        self.r_max = r_max
        self.d_max = d_max
        self.warmup = warmup
        self.r_max_steps = r_max_steps
        self.d_max_steps = d_max_steps

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, r_max={self.r_max}, d_max={self.d_max}, warmup={self.warmup}, "
            f"r_max_steps={self.r_max_steps}, d_max_steps={self.d_max_steps}"
        )

    def limits(self, t: int | slice) -> tuple[Tensor, Tensor]:
        """The current ``(r_max, d_max)`` of step ``t`` (tensors, so reading them never synchronizes a device).

        A ``slice`` of steps below ``max_steps`` gives one value per step.
        """
        row = t if isinstance(t, slice) else min(t, self.max_steps - 1)
        # In the statistics' precision (float64 limits for a float64 model), at least float32 (counts in the
        # thousands lose their last digits in half precision).
        dtype = torch.promote_types(self.running_mean.dtype, torch.float32)
        seen = (self.num_batches_tracked[row] - self.warmup).clamp(min=0).to(dtype)
        r_max = 1.0 + (self.r_max - 1.0) * (seen / self.r_max_steps).clamp(max=1.0)
        d_max = self.d_max * (seen / self.d_max_steps).clamp(max=1.0)
        return r_max, d_max

    def _normalize_batch_steps(
        self, x: Tensor, mean: Tensor, var: Tensor, rows: slice, running_mean: Tensor, running_var: Tensor
    ) -> Tensor:
        # Each step's own limits and running moments (before this update; pooled beyond max_steps: given).
        r_max, d_max = (limit.to(x.dtype).view(-1, 1, 1) for limit in self.limits(rows))
        rstd = torch.rsqrt(var + self.eps)
        running_rstd = torch.rsqrt(running_var + self.eps)
        r, d = renorm_correction(rstd, running_rstd, mean, running_mean, r_max, d_max)
        if not self.scale:
            return x - mean + d / running_rstd
        return (x - mean) * rstd * r + d

    # --- NodePieces in training (in evaluation renormalization is BatchNorm with the running moments: inherited) ---

    def step_forward(
        self, x: Tensor, step: int, mask: Tensor | None, count: int, weight: Tensor, shift: Tensor | None
    ) -> tuple[Tensor, StepRecord]:
        """``γ (x̂ r + d) + shift`` with ``r``, ``d`` constants (as :meth:`forward`); running steps are BatchNorm's."""
        if not self.training or count < 2:  # evaluation, or the "running" fallback (r = 1, d = 0): BatchNorm's
            return super().step_forward(x, step, mask, count, weight, shift)
        r_max, d_max = (limit.to(x.dtype) for limit in self.limits(step))  # the batch count before this update
        row = min(step, self.max_steps - 1)
        running_mean, running_var = self.running_mean[row], self.running_var[row]
        running_rstd = torch.rsqrt(running_var + self.eps)  # the running moments before this step's update
        previous_mean = running_mean.clone()  # both branches below update the row in place
        if self.fused_update:
            # The fused kernel updates the running row in place with BN's rule (momentum, unbiased variance).
            x_hat, mean, rstd = self._fused_step(x, mask, row)
            self.num_batches_tracked[row].add_(1)
        else:
            mean, var = masked_moments(x, mask, count)
            rstd = torch.rsqrt(var + self.eps)
            x_hat = (x - mean) * rstd
            self._update_running(mean, var, count, step)
        r, d = renorm_correction(rstd, running_rstd, mean, previous_mean, r_max, d_max)
        offset = torch.mul(d, weight) if shift is None else torch.addcmul(shift, d, weight)
        return torch.addcmul(offset, x_hat, weight * r), StepRecord(mean, rstd, True, r, d)

    def step_backward(
        self, dy: Tensor, x: Tensor, mask: Tensor | None, weight: Tensor, shift: Tensor | None, record: StepRecord
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """BatchNorm's backward with the weight ``γ r``; ``dγ = Σ dy (x̂ r + d)``."""
        if record.r is None or record.d is None:
            return super().step_backward(dy, x, mask, weight, shift, record)
        mean, rstd, r, d = record.mean, record.rstd, record.r, record.d
        if mask is None:
            dx, weight_grad, shift_grad = torch_ops.batch_norm_backward(
                dy, x, weight * r, None, None, mean, rstd, True, self.eps, [True, True, True]
            )
        else:
            dx, weight_grad, _ = self._masked_backward(dy, x, mask, weight * r, mean, rstd, shift, True)
            shift_grad = dy.sum(0)
        return dx, torch.addcmul(weight_grad * r, shift_grad, d), shift_grad

    def kernel_norm(self, shift: Tensor | None, *, frozen: bool = False) -> KernelNorm:
        """BatchNorm's, with the r/d correction and its schedule (:meth:`limits`, computed by the kernel from each
        step's batch count as it goes)."""
        r_max, d_max, warmup, r_max_steps, d_max_steps = self._kernel_options()
        return dataclasses.replace(
            super().kernel_norm(shift, frozen=frozen),
            renorm=True,
            r_max=r_max,
            d_max=d_max,
            warmup=warmup,
            r_max_steps=r_max_steps,
            d_max_steps=d_max_steps,
        )

    def _kernel_options(self) -> tuple[object, ...]:
        """Renormalization's schedule: ``(r_max, d_max, warmup, r_max_steps, d_max_steps)``."""
        return self.r_max, self.d_max, self.warmup, self.r_max_steps, self.d_max_steps
