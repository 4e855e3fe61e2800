"""A warning when the gradient that reaches a layer's input through time is not finite.

Backpropagation through a long sequence multiplies one Jacobian per step. With per-timestep batch statistics in
training, each step's Jacobian includes the derivative through its batch mean and variance, which over a small batch
can exceed 1 in norm, so the product can grow about exponentially in T. Measured on ``LSTM(8, 16, norm="batch")``
in training, batch 4, random inputs: the input gradient at ``t = 0`` had norm 1e2 at T = 500, 6e7 at T = 1000, 0.1
at T = 2000 and 1e15 at T = 3000 (float64: 4e6 and 8e12 at T = 1000 and 3000, so the model's own gradient explodes
and float32 follows it roughly); at T = 3000 the same model has 0.03 in evaluation (running statistics), 0.4 with
batch 32, 10 with ``"layer"`` and 1.4 with ``"none"``. Float32 overflows to inf/NaN once the product passes 3e38.

Nothing in the forward pass shows it. The layers therefore check, once per backward, the gradient arriving at their
input (a single reduction: its sum, which is finite only where every element is) and warn, naming the remedies; they
do not raise, because mixed-precision training with a gradient scaler expects occasional infinite gradients and skips
those steps itself.

The hook sits on a view of the input made by each forward, so it lives and dies with that forward's graph. On the
input itself it would stay: a leaf fed to many forwards (a fixed batch, a benchmark's input) collected one more hook,
and one more check of the whole gradient, with every step.
"""

from __future__ import annotations

import warnings
from functools import partial

import torch
from torch import Tensor

__all__ = ["all_finite", "watch_input_gradient"]


def watch_input_gradient(owner: str, x: Tensor, steps: int, batch_statistics: bool) -> Tensor:
    """``x`` (the layer's ``(T, B, I)`` input) to run the forward on: where a gradient will reach it, a view of it that
    warns in backward if that gradient is not finite."""
    if not (x.requires_grad and torch.is_grad_enabled()) or torch.compiler.is_compiling():
        return x
    watched = x.view_as(x)
    watched.register_hook(partial(_check, owner, steps, batch_statistics))
    return watched


def all_finite(tensor: Tensor) -> bool:
    """Whether every element is finite. inf and NaN carry through a sum, so a finite sum means finite elements (one
    pass); a sum that overflowed from finite ones is told apart by the elementwise test (several passes and
    temporaries)."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def _check(owner: str, steps: int, batch_statistics: bool, grad: Tensor | None) -> None:
    if grad is None or all_finite(grad):  # None: an undefined gradient (gradcheck sends one)
        return
    cause = (
        "per-timestep batch statistics make gradients through time grow about exponentially with the length"
        if batch_statistics
        else "the gradient overflowed through time (or a non-finite loss or state reached it)"
    )
    warnings.warn(
        f"{owner}: expected a finite gradient at the input, got inf/NaN after backpropagating through {steps} "
        f"steps ({cause}); shorten the backpropagated windows (stateful truncated BPTT), lower the learning rate, "
        "or use norm='layer'",
        RuntimeWarning,
        stacklevel=2,
    )
