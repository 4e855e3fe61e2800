"""Per-timestep Batch Renormalization (Ioffe 2017): :class:`~seqnorm.norms.batch.TimestepBatchNorm` with the r/d
correction that ties training-time batch statistics to the running ones."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from seqnorm.norms.batch import TimestepBatchNorm

__all__ = ["TimestepBatchRenorm"]


class TimestepBatchRenorm(TimestepBatchNorm):
    r"""Per-timestep Batch Renormalization (Ioffe 2017).

    In training, :math:`\hat x = \frac{x - \mu_B}{\sigma_B} r + d` with
    :math:`r = \mathrm{clip}_{[1/r_{max}, r_{max}]}(\sigma_B / \sigma_t)` and
    :math:`d = \mathrm{clip}_{[-d_{max}, d_{max}]}((\mu_B - \mu_t) / \sigma_t)`, both treated as constants in the
    backward pass, where :math:`\mu_t, \sigma_t` are the running moments of the step. Evaluation is BN with running
    moments, so training and evaluation agree once ``r`` and ``d`` are unclipped.

    Schedule (per step, counted in training batches ``n`` of that step, as in the paper): plain BN
    (``r_max = 1``, ``d_max = 0``) for ``n < warmup``; then ``r_max`` grows linearly to its final value over
    ``r_max_steps`` batches and ``d_max`` over ``d_max_steps`` batches.

    Args:
        r_max: final bound of ``r``. Default: 3.0.
        d_max: final bound of ``d``. Default: 5.0.
        warmup: batches of plain BN before the correction starts. Default: 5000 (the paper's value).
        r_max_steps: batches over which ``r_max`` ramps from 1. Default: 40000.
        d_max_steps: batches over which ``d_max`` ramps from 0. Default: 25000.
        **kwargs: as for :class:`TimestepBatchNorm`.
    """

    fast_forms: ClassVar[frozenset[str]] = frozenset({"loop", "bptt", "generation"})  # as TimestepBatchNorm's
    fast_kind: ClassVar[str | None] = "batch_renorm"

    def __init__(
        self,
        num_features: int,
        max_steps: int = 100,
        *,
        r_max: float = 3.0,
        d_max: float = 5.0,
        warmup: int = 5000,
        r_max_steps: int = 40000,
        d_max_steps: int = 25000,
        **kwargs: object,
    ) -> None:
        super().__init__(num_features, max_steps, **kwargs)  # type: ignore[arg-type]
        name = type(self).__name__
        if r_max < 1.0:
            raise ValueError(f"{name}: expected r_max >= 1, got {r_max}")
        if d_max < 0.0:
            raise ValueError(f"{name}: expected d_max >= 0, got {d_max}")
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
        seen = (self.num_batches_tracked[row] - self.warmup).clamp(min=0).float()
        r_max = 1.0 + (self.r_max - 1.0) * (seen / self.r_max_steps).clamp(max=1.0)
        d_max = self.d_max * (seen / self.d_max_steps).clamp(max=1.0)
        return r_max, d_max

    def _normalize_batch(self, x: Tensor, mean: Tensor, var: Tensor, step: int) -> Tensor:
        r_max, d_max = (limit.to(x.dtype) for limit in self.limits(step))
        running_mean, running_var = self.running_moments(step)
        std_batch = torch.sqrt(var + self.eps)
        std_running = torch.sqrt(running_var + self.eps)
        r = (std_batch / std_running).detach().clamp(min=1.0 / r_max, max=r_max)
        d = ((mean - running_mean) / std_running).detach().clamp(min=-d_max, max=d_max)
        if not self.scale:
            return x - mean + d * std_running
        return (x - mean) / std_batch * r + d

    def _normalize_batch_steps(self, x: Tensor, mean: Tensor, var: Tensor, steps: int) -> Tensor:
        # As _normalize_batch, with each step's own limits and running moments (rows 0..T-1, before this update).
        r_max, d_max = (limit.to(x.dtype).view(steps, 1, 1) for limit in self.limits(slice(0, steps)))
        std_batch = torch.sqrt(var + self.eps)
        std_running = torch.sqrt(self.running_var[:steps].unsqueeze(1) + self.eps)
        r = torch.minimum(torch.maximum((std_batch / std_running).detach(), 1.0 / r_max), r_max)
        d = torch.minimum(
            torch.maximum(((mean - self.running_mean[:steps].unsqueeze(1)) / std_running).detach(), -d_max), d_max
        )
        if not self.scale:
            return x - mean + d * std_running
        return (x - mean) / std_batch * r + d
