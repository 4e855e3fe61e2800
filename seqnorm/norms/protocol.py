"""What a norm module provides so that every execution form can run it: :class:`StepPieces`, and :class:`NodePieces`.

The forms (which one runs is :mod:`seqnorm.layers.plan`'s choice):

- **reference** and **loop**: the module itself — ``forward(x, step, mask)``, and for the loop ``forward_step`` (the
  same function, fewer operations) and ``forward_sequence`` (every step of ``(T, B, F)`` at once).
- **generation**: the lean no-grad step (:mod:`seqnorm.layers.stepping`) calls :meth:`StepPieces.generation_step`
  once per cached step and the function it returns at every step.
- **kernel**: the compiled kernels (:mod:`seqnorm.layers.compiled`) are given what the module's ``kernel_norm`` returns
  (:class:`~seqnorm.kernels.KernelNorm`); the math is the kernels' own.

A norm declares the forms it implements in ``fast_forms`` (the plan reads that declaration, never this Protocol);
declaring ``"generation"`` promises :class:`StepPieces`. An instance configured beyond what its pieces cover may say
why in an optional ``fast_form_blocker(form) -> str | None`` (per-timestep BatchNorm: mean-only, pooled statistics,
generation in training); the plan then runs another path. In every piece ``weight`` is ``γ`` and ``shift`` the
norm's ``β`` plus whatever bias follows the norm (the caller folds them; either may be ``None``).

A norm's own ``forward_step`` may also run one step as a single autograd node (:func:`step_node`) from the
:class:`NodePieces` it declares with the ``"step"`` form: per-timestep BatchNorm does, for a cell's masked training
step in a loop of the user's own. Nothing outside the norm chooses it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = ["NodePieces", "StepPieces", "step_node"]


@runtime_checkable
class StepPieces(Protocol):
    """The piece of a recurrent norm ``y = γ N(x) + shift`` that the generation step calls."""

    eps: float
    weight: Tensor | None
    bias: Tensor | None

    def generation_step(self, shift: Tensor | None) -> Callable[[Tensor, int], Tensor]:
        """``(y, step) -> γ N(y) + shift`` for evaluation without gradients, with everything that depends on the
        parameters and buffers alone computed once here (for per-timestep BN: each step's folded scale and offset).
        ``y`` is ``(..., F)``; the result is a new tensor."""
        ...


@runtime_checkable
class NodePieces(Protocol):
    """A norm step's forward and hand-written backward, which :func:`step_node` runs as one autograd node."""

    weight: Tensor | None

    def step_forward(
        self, x: Tensor, step: int, mask: Tensor | None, count: int, weight: Tensor, shift: Tensor | None
    ) -> tuple[Tensor, Any]:
        """``(y, record)``: step ``step`` in the current mode, equal to ``forward_step`` (running-statistics updates
        included), and what :meth:`step_backward` needs of it. ``count`` is the number of real rows (``mask``)."""
        ...

    def step_backward(
        self, dy: Tensor, x: Tensor, mask: Tensor | None, weight: Tensor, shift: Tensor | None, record: Any
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``(dL/dx, dL/dγ, dL/dshift)`` of the step :meth:`step_forward` recorded, given ``dy``; the rows ``mask``
        marks padding get no gradient. ``None`` (or anything) for a ``shift`` that is ``None``."""
        ...


class _StepNode(torch.autograd.Function):
    """One step of a norm's :class:`NodePieces` as one autograd node: ``step_forward`` forward, ``step_backward``
    backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        shift: Tensor | None,
        module: NodePieces,
        step: int,
        mask: Tensor | None,
        count: int,
    ) -> Tensor:
        y, record = module.step_forward(x, step, mask, count, weight, shift)
        ctx.save_for_backward(x, weight, shift, mask)  # a mask written in place before the backward is an error
        ctx.module, ctx.record = module, record
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, shift, mask = ctx.saved_tensors
        dx, weight_grad, shift_grad = ctx.module.step_backward(dy, x, mask, weight, shift, ctx.record)
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
    module: NodePieces, x: Tensor, step: int, mask: Tensor | None, count: int, shift: Tensor | None
) -> Tensor:
    """``γ N(x) + shift`` at time index ``step`` by ``module``'s own pieces, as one autograd node.

    For a cell's step (a norm's ``forward_step``): one node in the graph instead of the dozen of a masked batch
    norm's operations. Its backward is ``step_backward``, which takes the rows ``mask`` marks padding to receive no
    gradient — as in a cell, which keeps their state and never reads their output. ``count`` is the number of real
    rows; ``γ`` is ``module.weight`` (a norm whose ``"step"`` form is not blocked has one).
    """
    return _StepNode.apply(x, module.weight, shift, module, step, mask, count)
