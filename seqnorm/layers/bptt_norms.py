"""The recurrent norms inside :mod:`seqnorm.layers.bptt`'s hand-written backward: forward and backward of one step.

:class:`StepNorm` wraps a cell's ``norm_hh`` or ``norm_c`` (LayerNorm, RMSNorm, per-timestep BatchNorm, or none) for
one call of the recurrence. Its forward computes what the module's ``forward_step`` computes — with the same
running-statistics updates for BatchNorm — and keeps each step's statistics; its backward is torch's own LayerNorm /
BatchNorm backward kernel where there is one (the ones autograd would run), and collects each step's ``γ``/``β``
gradients, which :meth:`StepNorm.parameter_grads` sums at the end.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from seqnorm.norms import LayerNorm, RMSNorm, TimestepBatchNorm

__all__ = ["KINDS", "StepNorm", "norm_kind"]

KINDS: dict[type[nn.Module], str] = {LayerNorm: "layer", RMSNorm: "rms", TimestepBatchNorm: "batch"}
# RMSNorm's fused forward kernel where torch has one (2.8+); its backward has no CPU kernel, so it is written out.
_FUSED_RMS = getattr(torch.ops.aten, "_fused_rms_norm", None)


def norm_kind(module: nn.Module | None) -> str | None:
    """``"none"``, ``"layer"``, ``"rms"`` or ``"batch"`` for a norm :class:`StepNorm` reproduces exactly, else None.

    Exact types only: a subclass (batch renormalization, say) may change what a step computes.
    """
    if module is None:
        return "none"
    kind = KINDS.get(type(module))
    if kind is None or module.weight is None:
        return None
    # Mean-only BN and pooled statistics beyond max_steps (beyond_max_steps="pooled") are the cell's own.
    return None if kind == "batch" and (not module.scale or module.beyond_max_steps != "last") else kind


class StepNorm:
    """One recurrent norm (or none) for one call: ``γ * N(x) + shift`` per step, its backward, ``γ``/shift grads.

    ``shift`` is the norm's ``β`` and, for a GRU's recurrent norm, the bias ``b_hh`` that follows it.
    """

    def __init__(self, module: nn.Module | None) -> None:
        self.module = module
        self.kind = norm_kind(module)
        self.eps: float = 0.0 if module is None else module.eps
        self.means: list[Tensor] = []  # per step: LayerNorm (B, 1), BatchNorm (F,); RMSNorm has none
        self.rstds: list[Tensor] = []
        self.batch_steps: list[bool] = []  # BatchNorm: whether step t used batch statistics (else running ones)
        self.fused_rows: list[int] = []  # BatchNorm: running rows torch's fused kernel updated, once per step
        self.stacked: list[Tensor] = []  # in the backward: the statistics of all steps, stacked
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
            y, mean, rstd = torch.native_layer_norm(x, features, weight, shift, self.eps)
            self.means.append(mean)
            self.rstds.append(rstd)
            return y
        if self.kind == "rms":
            if _FUSED_RMS is not None:
                y, rstd = _FUSED_RMS(x, features, weight, self.eps)
            else:
                rstd = torch.rsqrt(x.square().mean(1, keepdim=True) + self.eps)
                y = x * rstd * weight
            self.rstds.append(rstd)
            return y if shift is None else y + shift
        return self._batch_forward(x, t, mask, count, weight, shift)

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
            y, mean, rstd = torch.native_batch_norm(
                x, weight, shift, norm.running_mean[row], norm.running_var[row], True, norm.momentum, self.eps
            )
            self.means.append(mean)
            self.rstds.append(rstd)
            return y
        if use_batch:
            keep = mask.unsqueeze(1)
            mean = torch.where(keep, x, 0.0).sum(0) / count
            var = torch.where(keep, x - mean, 0.0).square().sum(0) / count
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

    def saved(self) -> list[Tensor]:
        """The statistics of every step, stacked for ``save_for_backward``."""
        return [torch.stack(stats) for stats in (self.means, self.rstds) if stats]

    def load(self, saved: list[Tensor]) -> None:
        """Take back what :meth:`saved` gave (at the start of a backward)."""
        self.weight_grads, self.shift_grads = [], []
        self.stacked = saved
        if self.kind in ("layer", "batch"):
            self.means, self.rstds = list(saved[0].unbind(0)), list(saved[1].unbind(0))
        elif self.kind == "rms":
            self.rstds = list(saved[0].unbind(0))

    def normalized(self, x: Tensor, features: slice) -> Tensor:
        """``N(x)`` (before ``γ`` and shift) of every step at once for ``x`` ``(T, B, F')``, the ``features`` of the
        norm's input, from the saved statistics; a new tensor."""
        if self.kind == "none":
            return x.clone()
        if self.kind == "rms":
            return x * self.stacked[0]
        mean, rstd = self.stacked
        if self.kind == "batch":  # statistics per feature (T, F), else per row (T, B, 1)
            mean, rstd = mean[:, None, features], rstd[:, None, features]
        return torch.sub(x, mean).mul_(rstd)

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
        if self.kind == "layer":
            dx, weight_grad, shift_grad = torch.ops.aten.native_layer_norm_backward(
                dy, x, [x.shape[-1]], self.means[t], rstd, weight, shift, [True, True, shift is not None]
            )
        elif self.kind == "batch" and self.batch_steps[t] and mask is None:
            dx, weight_grad, shift_grad = torch.ops.aten.native_batch_norm_backward(
                dy, x, weight, None, None, self.means[t], rstd, True, self.eps, [True, True, shift is not None]
            )
        else:
            dx, weight_grad, shift_grad = self._backward_written_out(dy, x, t, mask, count, weight, rstd, shift)
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
