"""The recurrent norms inside :mod:`seqnorm.layers.bptt`'s hand-written backward: forward and backward of one step.

:class:`StepNorm` wraps a cell's ``norm_hh`` or ``norm_c`` (LayerNorm, RMSNorm, per-timestep BatchNorm, or none) for
one call of the recurrence. Its forward computes what the module's ``forward_step`` computes — with the same
running-statistics updates for BatchNorm — and keeps each step's statistics; its backward is torch's own LayerNorm /
BatchNorm backward kernel where there is one (the ones autograd would run), and collects each step's ``γ``/``β``
gradients, which :meth:`StepNorm.parameter_grads` sums at the end.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from seqnorm.layers import torch_ops
from seqnorm.layers.plan import norm_kind
from seqnorm.norms import TimestepBatchNorm, TimestepBatchRenorm
from seqnorm.norms.batch import masked_moments

__all__ = ["StepNorm"]

_BATCH_KINDS = ("batch", "batch_renorm")


class StepNorm:
    """One recurrent norm (or none) for one call: ``γ * N(x) + shift`` per step, its backward, ``γ``/shift grads.

    ``shift`` is the norm's ``β`` and, for a GRU's recurrent norm, the bias ``b_hh`` that follows it.
    """

    def __init__(self, module: nn.Module | None) -> None:
        self.module = module
        kind = norm_kind(module, "bptt")
        # Batch renormalization in evaluation is BatchNorm with the running moments.
        self.kind = "batch" if kind == "batch_renorm" and not module.training else kind
        self.eps: float = 0.0 if module is None else module.eps
        self.means: list[Tensor] = []  # per step: LayerNorm (B, 1), BatchNorm (F,); RMSNorm has none
        self.rstds: list[Tensor] = []
        self.batch_steps: list[bool] = []  # BatchNorm: whether step t used batch statistics (else running ones)
        self.fused_rows: list[int] = []  # BatchNorm: running rows torch's fused kernel updated, once per step
        self.rs: list[Tensor] = []  # batch renorm: per step the (detached) r and d, (F,); 1 and 0 on running steps
        self.ds: list[Tensor] = []
        self.rms_constants: tuple[Tensor, Tensor] | None = None  # RMSNorm: sqrt(F), sqrt(F eps)
        self.limits: list[tuple[Tensor, Tensor, Tensor]] | None = None  # renorm: (1/r_max, r_max, d_max) per row
        self.stacked: dict[str, Tensor] = {}  # in the backward: the statistics of all steps, stacked
        self.weight_grads: list[Tensor] = []
        self.shift_grads: list[Tensor] = []

    # --- forward ---

    def forward(
        self, x: Tensor, t: int, mask: Tensor | None, count: int, weight: Tensor | None, shift: Tensor | None
    ) -> Tensor:
        """Step ``t`` of the norm; without norm and shift it returns ``x`` itself (callers must not write into it)."""
        if self.kind == "none":
            return x if shift is None else x + shift
        features = [x.shape[-1]]
        if self.kind == "layer":
            y, mean, rstd = torch_ops.layer_norm_with_stats(x, features, weight, shift, self.eps)
            self.means.append(mean)
            self.rstds.append(rstd)
            return y
        if self.kind == "rms":
            # rstd = 1 / sqrt(mean(x^2) + eps) = sqrt(F) / hypot(||x||, sqrt(F eps)): measured about twice as fast
            # as torch's CPU rms_norm kernel at these sizes, and equal to float rounding.
            if self.rms_constants is None:
                features = x.shape[1]
                root, floor = math.sqrt(features), math.sqrt(features * self.eps)
                self.rms_constants = (x.new_tensor(root), x.new_tensor(floor))
            root, floor = self.rms_constants
            rstd = torch.div(root, torch.hypot(torch.linalg.vector_norm(x, dim=1, keepdim=True), floor))
            self.rstds.append(rstd)
            x_hat = torch.mul(x, rstd)
            return x_hat.mul_(weight) if shift is None else torch.addcmul(shift, x_hat, weight)
        if self.kind == "batch_renorm":
            return self._renorm_forward(x, t, mask, count, weight, shift)
        return self._batch_forward(x, t, mask, count, weight, shift)

    def _renorm_limits(self, t: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """``(1/r_max, r_max, d_max)`` of step ``t``, from the batch counts before this step's update."""
        norm: TimestepBatchRenorm = self.module  # type: ignore[assignment]
        if t < norm.max_steps:
            if self.limits is None:
                # Rows below max_steps are each updated by their own step only: read all of them once, up front.
                r_max, d_max = (limit.to(dtype) for limit in norm.limits(slice(0, norm.max_steps)))
                limits = torch.reciprocal(r_max).unbind(0), r_max.unbind(0), d_max.unbind(0)
                self.limits = list(zip(*limits, strict=True))
            return self.limits[t]
        # Later steps share the last row and read what the previous steps counted there.
        self.finish_forward()
        r_max, d_max = (limit.to(dtype) for limit in norm.limits(t))
        return 1.0 / r_max, r_max, d_max

    def _renorm_forward(
        self, x: Tensor, t: int, mask: Tensor | None, count: int, weight: Tensor, shift: Tensor | None
    ) -> Tensor:
        """Batch renormalization in training: ``γ (x̂ r + d) + shift`` with ``r``, ``d`` constants (as
        :meth:`~seqnorm.norms.TimestepBatchRenorm.forward`); running steps are BatchNorm's."""
        norm: TimestepBatchRenorm = self.module  # type: ignore[assignment]
        if count < 2:  # the "running" fallback, as BatchNorm's
            self.rs.append(torch.ones_like(weight))
            self.ds.append(torch.zeros_like(weight))
            return self._batch_forward(x, t, mask, count, weight, shift)
        lower, upper, d_max = self._renorm_limits(t, x.dtype)
        row = min(t, norm.max_steps - 1)
        running_mean, running_var = norm.running_mean[row], norm.running_var[row]
        running_rstd = torch.rsqrt(running_var + self.eps)  # the running moments before this step's update
        previous_mean = running_mean.clone()  # both branches below update the row in place
        if mask is None:
            # The fused kernel updates the running row in place with BN's rule (momentum, unbiased variance).
            x_hat, mean, rstd = torch_ops.batch_norm_with_stats(
                x, None, None, running_mean, running_var, True, norm.momentum, self.eps
            )
            self.fused_rows.append(row)
        else:
            mean, var = masked_moments(x, mask, count)
            rstd = torch.rsqrt(var + self.eps)
            x_hat = (x - mean) * rstd
            norm._update_running(mean, var, count, t)
        r = torch.div(running_rstd, rstd).clamp_(lower, upper)  # σ_B / σ_run
        d = torch.sub(mean, previous_mean).mul_(running_rstd).clamp_(-d_max, d_max)
        self.batch_steps.append(True)
        self.means.append(mean)
        self.rstds.append(rstd)
        self.rs.append(r)
        self.ds.append(d)
        offset = torch.mul(d, weight) if shift is None else torch.addcmul(shift, d, weight)
        return torch.addcmul(offset, x_hat, weight * r)

    def _batch_forward(
        self, x: Tensor, t: int, mask: Tensor | None, count: int, weight: Tensor, shift: Tensor | None
    ) -> Tensor:
        norm: TimestepBatchNorm = self.module  # type: ignore[assignment]
        row = min(t, norm.max_steps - 1)
        # Fewer than 2 rows in training: the "running" fallback (choose_path sends the erroring policy elsewhere).
        use_batch = norm.training and count >= 2
        self.batch_steps.append(use_batch)
        if use_batch and mask is None:
            # torch's fused kernel updates the running row in place with BN's rule (momentum, unbiased variance),
            # as TimestepBatchNorm.forward_step does.
            self.fused_rows.append(row)
            y, mean, rstd = torch_ops.batch_norm_with_stats(
                x, weight, shift, norm.running_mean[row], norm.running_var[row], True, norm.momentum, self.eps
            )
            self.means.append(mean)
            self.rstds.append(rstd)
            return y
        if use_batch:
            mean, var = masked_moments(x, mask, count)
            rstd = torch.rsqrt(var + self.eps)
            norm._update_running(mean, var, count, t)  # takes the step: it finds the row itself
        else:
            running_mean, running_var = norm.running_moments(t)
            mean = running_mean.clone()  # a later step (t >= max_steps) may update this row in place
            rstd = torch.rsqrt(running_var + self.eps)
        self.means.append(mean)
        self.rstds.append(rstd)
        y = (x - mean) * rstd * weight
        return y if shift is None else y + shift

    def finish_forward(self) -> None:
        """After the loop: count the batches of the fused kernel's steps (the masked steps counted their own)."""
        if self.fused_rows:
            tracked = self.module.num_batches_tracked
            index = torch.tensor(self.fused_rows, device=tracked.device)
            tracked.index_add_(0, index, torch.ones_like(index))
            self.fused_rows = []

    def saved(self) -> dict[str, Tensor]:
        """The statistics of every step, stacked and named, for ``save_for_backward``."""
        stats = {"means": self.means, "rstds": self.rstds, "rs": self.rs, "ds": self.ds}
        return {name: torch.stack(steps) for name, steps in stats.items() if steps}

    def load(self, saved: dict[str, Tensor]) -> None:
        """Take back what :meth:`saved` gave (at the start of a backward)."""
        self.weight_grads, self.shift_grads = [], []
        self.stacked = saved
        for name in saved:
            setattr(self, name, list(saved[name].unbind(0)))

    def normalized(self, x: Tensor, features: slice) -> Tensor:
        """``N(x)`` (before ``γ`` and shift) of every step at once for ``x`` ``(T, B, F')``, the ``features`` of the
        norm's input, from the saved statistics; a new tensor."""
        if self.kind == "none":
            return x.clone()
        if self.kind == "rms":
            return x * self.stacked["rstds"]
        mean, rstd = self.stacked["means"], self.stacked["rstds"]
        if self.kind == "layer":  # statistics per row (T, B, 1), else per feature (T, F)
            return torch.sub(x, mean).mul_(rstd)
        x_hat = torch.sub(x, mean[:, None, features]).mul_(rstd[:, None, features])
        if self.kind == "batch_renorm":
            r, d = self.stacked["rs"], self.stacked["ds"]
            x_hat.mul_(r[:, None, features]).add_(d[:, None, features])
        return x_hat

    # --- backward ---

    def backward(
        self,
        dy: Tensor,
        x: Tensor,
        t: int,
        mask: Tensor | None,
        count: int,
        weight: Tensor | None,
        shift: Tensor | None,
    ) -> Tensor:
        """The gradient w.r.t. step ``t``'s input ``x`` given ``dy`` (zero on padded rows); keeps γ/shift grads."""
        if self.kind == "none":
            if shift is not None:
                self.shift_grads.append(dy.sum(0))
            return dy
        rstd = self.rstds[t]
        if self.kind == "batch_renorm":
            return self._renorm_backward(dy, x, t, mask, count, weight, rstd, shift)
        if self.kind == "layer":
            dx, weight_grad, shift_grad = torch_ops.layer_norm_backward(
                dy, x, [x.shape[-1]], self.means[t], rstd, weight, shift, [True, True, shift is not None]
            )
        elif self.kind == "batch" and self.batch_steps[t] and mask is None:
            dx, weight_grad, shift_grad = torch_ops.batch_norm_backward(
                dy, x, weight, None, None, self.means[t], rstd, True, self.eps, [True, True, shift is not None]
            )
        else:
            dx, weight_grad, shift_grad = self._backward_written_out(dy, x, t, mask, count, weight, rstd, shift)
        self.weight_grads.append(weight_grad)
        if shift is not None:
            self.shift_grads.append(shift_grad)
        return dx

    def _renorm_backward(
        self,
        dy: Tensor,
        x: Tensor,
        t: int,
        mask: Tensor | None,
        count: int,
        weight: Tensor,
        rstd: Tensor,
        shift: Tensor | None,
    ) -> Tensor:
        """Batch renormalization: BatchNorm's backward with the weight ``γ r``; ``dγ = Σ dy (x̂ r + d)``."""
        r, d = self.rs[t], self.ds[t]
        if not self.batch_steps[t]:  # a running step (r = 1, d = 0): BatchNorm's
            dx, weight_grad, shift_grad = self._backward_written_out(dy, x, t, mask, count, weight, rstd, shift)
        elif mask is None:
            dx, weight_grad, shift_grad = torch_ops.batch_norm_backward(
                dy, x, weight * r, None, None, self.means[t], rstd, True, self.eps, [True, True, True]
            )
            weight_grad = torch.addcmul(weight_grad * r, shift_grad, d)
        else:
            dx, weight_grad, _ = self._backward_written_out(dy, x, t, mask, count, weight * r, rstd, shift)
            shift_grad = dy.sum(0)
            weight_grad = torch.addcmul(weight_grad * r, shift_grad, d)
        self.weight_grads.append(weight_grad)
        if shift is not None:
            self.shift_grads.append(shift_grad)
        return dx

    def _backward_written_out(
        self,
        dy: Tensor,
        x: Tensor,
        t: int,
        mask: Tensor | None,
        count: int,
        weight: Tensor,
        rstd: Tensor,
        shift: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """RMSNorm, and BatchNorm's masked and running-statistics steps."""
        scaled = dy * weight
        shift_grad = None if shift is None else dy.sum(0)
        if self.kind == "rms":
            x_hat = x * rstd
            dx = (scaled - x_hat * torch.linalg.vecdot(scaled, x_hat).unsqueeze(1) / x.shape[1]) * rstd
            return dx, (dy * x_hat).sum(0), shift_grad
        x_hat = (x - self.means[t]) * rstd
        if not self.batch_steps[t]:
            return scaled * rstd, (dy * x_hat).sum(0), shift_grad
        # Padded rows have dy = 0, so sums over all rows are sums over the real ones; they get no gradient.
        dx = (scaled - scaled.sum(0) / count - x_hat * ((scaled * x_hat).sum(0) / count)) * rstd
        return torch.where(mask.unsqueeze(1), dx, 0.0), (dy * x_hat).sum(0), shift_grad

    def parameter_grads(self) -> tuple[Tensor | None, Tensor | None]:
        """The gradients of ``γ`` and of the shift: the sums of every step's."""
        weight_grad = torch.stack(self.weight_grads).sum(0) if self.weight_grads else None
        shift_grad = torch.stack(self.shift_grads).sum(0) if self.shift_grads else None
        return weight_grad, shift_grad
