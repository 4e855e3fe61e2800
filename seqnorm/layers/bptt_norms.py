"""The recurrent norms inside :mod:`seqnorm.layers.bptt`'s hand-written backward, one call at a time.

:class:`StepNorm` wraps a cell's ``norm_ih``, ``norm_hh`` or ``norm_c`` (or none) for one call of the recurrence. The
math is the module's own (:class:`~seqnorm.norms.protocol.StepPieces`, which the plan made sure it declares): this
class keeps the call's per-step record (:class:`~seqnorm.norms.protocol.NormCall`), adds no norm's arithmetic, and
sums each step's ``γ``/shift gradients at the end.
"""

from __future__ import annotations

import torch
from torch import Tensor

from seqnorm.norms.protocol import NormCall, StepPieces

__all__ = ["StepNorm"]


class StepNorm:
    """One recurrent norm (or none) for one call: ``γ * N(x) + shift`` per step, its backward, ``γ``/shift grads.

    ``shift`` is the norm's ``β`` and whatever bias follows it (for a GRU's recurrent norm, ``b_hh``).
    """

    def __init__(self, module: StepPieces | None) -> None:
        self.module = module
        self.call = NormCall()
        self.weight_grads: list[Tensor] = []
        self.shift_grads: list[Tensor] = []

    @property
    def identity(self) -> bool:
        """Whether there is no norm (only the shift, if any)."""
        return self.module is None

    def forward(
        self, x: Tensor, t: int, mask: Tensor | None, count: int, weight: Tensor | None, shift: Tensor | None
    ) -> Tensor:
        """Step ``t`` of the norm; without norm and shift it returns ``x`` itself (callers must not write into it)."""
        if self.module is None:
            return x if shift is None else x + shift
        return self.module.bptt_step(x, t, mask, count, weight, shift, self.call)

    def finish_forward(self) -> None:
        if self.module is not None:
            self.module.bptt_finish(self.call)

    def saved(self) -> dict[str, Tensor]:
        """The statistics of every step, stacked and named, for ``save_for_backward``."""
        return self.call.saved()

    def load(self, saved: dict[str, Tensor]) -> None:
        """Take back what :meth:`saved` gave (at the start of a backward)."""
        self.weight_grads, self.shift_grads = [], []
        self.call.load(saved)

    def normalized(self, x: Tensor, features: slice) -> Tensor:
        """``N(x)`` of every step at once for ``x`` ``(T, B, F')``, the ``features`` of the norm's input; new."""
        if self.module is None:
            return x.clone()
        return self.module.bptt_normalized(x, features, self.call)

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
        if self.module is None:
            if shift is not None:
                self.shift_grads.append(dy.sum(0))
            return dy
        dx, weight_grad, shift_grad = self.module.bptt_backward(dy, x, t, mask, count, weight, shift, self.call)
        self.weight_grads.append(weight_grad)
        if shift is not None:
            self.shift_grads.append(shift_grad)
        return dx

    def parameter_grads(self) -> tuple[Tensor | None, Tensor | None]:
        """The gradients of ``γ`` and of the shift: the sums of every step's."""
        weight_grad = torch.stack(self.weight_grads).sum(0) if self.weight_grads else None
        shift_grad = torch.stack(self.shift_grads).sum(0) if self.shift_grads else None
        return weight_grad, shift_grad
