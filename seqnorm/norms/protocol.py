"""What a norm module provides so that every execution form can run it: :class:`StepPieces`, and :class:`NormCall`.

The forms (which one runs is :mod:`seqnorm.layers.plan`'s choice):

- **reference** and **loop**: the module itself — ``forward(x, step, mask)``, and for the loop ``forward_step`` (the
  same function, fewer operations) and ``forward_sequence`` (every step of ``(T, B, F)`` at once). A norm's
  ``forward_step`` may run its own pieces below as one autograd node per step (:func:`step_node`).
- **bptt**: the hand-written backward through time (:mod:`seqnorm.layers.bptt`) calls :meth:`StepPieces.bptt_step`
  at every step of its forward, :meth:`~StepPieces.bptt_finish` after it, and :meth:`~StepPieces.bptt_backward`
  (and, for a GRU's recurrent norm, :meth:`~StepPieces.bptt_normalized`) in its backward.
- **generation**: the lean no-grad step (:mod:`seqnorm.layers.stepping`) calls :meth:`StepPieces.generation_step`
  once per cached step and the function it returns at every step.

A norm declares the forms it implements in ``fast_forms`` (the plan reads that declaration, never this Protocol);
declaring ``"bptt"`` or ``"generation"`` promises the matching methods here. An instance configured beyond what its
pieces cover may say why in an optional ``fast_form_blocker(form) -> str | None`` (per-timestep BatchNorm: mean-only,
pooled statistics, generation in training); the plan then runs another path. In every piece ``weight`` is ``γ`` and
``shift`` the norm's ``β`` plus whatever bias follows the norm (the caller folds them; either may be ``None``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = ["NormCall", "StepPieces", "step_node"]


class NormCall:
    """One norm's record over one call of the hand-written BPTT.

    Attributes:
        steps: per name, one tensor per step, appended by :meth:`StepPieces.bptt_step` (e.g. ``"means"``,
            ``"rstds"``); saved for the backward by name (:meth:`saved`, :meth:`load`).
        stacked: in the backward, each name's steps stacked ``(T, ...)``.
        scratch: what is not a saved tensor: per-call constants and per-step facts (which steps used batch
            statistics, say); it lives on the Python object from the forward to the backward.
    """

    def __init__(self) -> None:
        self.steps: dict[str, list[Tensor]] = {}
        self.stacked: dict[str, Tensor] = {}
        self.scratch: dict[str, Any] = {}

    def keep(self, **tensors: Tensor) -> None:
        """Append one step's tensors under their names."""
        for name, tensor in tensors.items():
            self.steps.setdefault(name, []).append(tensor)

    def saved(self) -> dict[str, Tensor]:
        """Every name's steps stacked, for ``save_for_backward``."""
        return {name: torch.stack(steps) for name, steps in self.steps.items() if steps}

    def load(self, saved: dict[str, Tensor]) -> None:
        """Take back what :meth:`saved` gave (at the start of a backward)."""
        self.stacked = saved
        self.steps = {name: list(tensor.unbind(0)) for name, tensor in saved.items()}


@runtime_checkable
class StepPieces(Protocol):
    """The pieces of a recurrent norm ``y = γ N(x) + shift`` that the hand-written BPTT and generation call."""

    eps: float
    weight: Tensor | None
    bias: Tensor | None

    def bptt_step(
        self,
        x: Tensor,
        step: int,
        mask: Tensor | None,
        count: int,
        weight: Tensor | None,
        shift: Tensor | None,
        call: NormCall,
    ) -> Tensor:
        """Step ``step`` in the current mode, equal to ``forward_step`` (running-statistics updates included),
        keeping in ``call`` what :meth:`bptt_backward` needs. ``count`` is the number of real rows (``mask``)."""
        ...

    def bptt_finish(self, call: NormCall) -> None:
        """After the forward loop: any bookkeeping deferred from the steps (once per call, not per step)."""
        ...

    def bptt_backward(
        self,
        dy: Tensor,
        x: Tensor,
        step: int,
        mask: Tensor | None,
        count: int,
        weight: Tensor | None,
        shift: Tensor | None,
        call: NormCall,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``(dL/dx, dL/dγ, dL/dshift)`` of step ``step`` given ``dy`` (zero on padded rows); ``None`` for a
        ``weight`` or ``shift`` that is ``None``. ``step`` is the step's position among those ``call`` recorded: the
        time index in a layer's call, which numbers its steps from 0; 0 for :func:`step_node`'s call of one step."""
        ...

    def bptt_normalized(self, x: Tensor, features: slice, call: NormCall) -> Tensor:
        """``N(x)`` (before ``γ`` and shift) of every step at once for ``x`` ``(T, B, F')``, the ``features`` of the
        norm's input, from the statistics ``call`` saved; a new tensor."""
        ...

    def generation_step(self, shift: Tensor | None) -> Callable[[Tensor, int], Tensor]:
        """``(y, step) -> γ N(y) + shift`` for evaluation without gradients, with everything that depends on the
        parameters and buffers alone computed once here (for per-timestep BN: each step's folded scale and offset).
        ``y`` is ``(..., F)``; the result is a new tensor."""
        ...


class _StepNode(torch.autograd.Function):
    """One step of a norm's :class:`StepPieces` as one autograd node: ``bptt_step`` (and ``bptt_finish``) forward,
    ``bptt_backward`` backward, with a :class:`NormCall` of this one step."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        shift: Tensor | None,
        module: StepPieces,
        step: int,
        mask: Tensor | None,
        count: int,
    ) -> Tensor:
        call = NormCall()
        y = module.bptt_step(x, step, mask, count, weight, shift, call)
        module.bptt_finish(call)
        ctx.save_for_backward(x, weight, shift)
        ctx.module, ctx.call, ctx.mask, ctx.count = module, call, mask, count
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, shift = ctx.saved_tensors
        dx, weight_grad, shift_grad = ctx.module.bptt_backward(dy, x, 0, ctx.mask, ctx.count, weight, shift, ctx.call)
        wanted = ctx.needs_input_grad
        return (
            dx if wanted[0] else None,
            weight_grad if wanted[1] else None,
            shift_grad if wanted[2] else None,  # (a piece may return one for a shift that is None)
            None,
            None,
            None,
            None,
        )


def step_node(
    module: StepPieces, x: Tensor, step: int, mask: Tensor | None, count: int, shift: Tensor | None
) -> Tensor:
    """``γ N(x) + shift`` at time index ``step`` by ``module``'s own pieces, as one autograd node.

    For a cell's step (a norm's ``forward_step``): one node in the graph instead of the dozen of a masked batch
    norm's operations. Its backward is ``bptt_backward``, which takes the rows ``mask`` marks padding to receive no
    gradient — as in a cell, which keeps their state and never reads their output. ``count`` is the number of real
    rows; ``γ`` is ``module.weight`` (a norm whose ``"bptt"`` form is not blocked has one).
    """
    return _StepNode.apply(x, module.weight, shift, module, step, mask, count)
