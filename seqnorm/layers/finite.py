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

On a CUDA GPU that check is deferred. Reading its answer in the hook would make the host wait at every backward for the
device to finish everything queued before it, stalling the queue it keeps ahead. The hook instead reduces the gradient
on the device (its minimum and maximum, which are finite only where every element is and cannot overflow), copies the
flag without waiting into pinned host memory, records an event after the copy and queues the pending check; the next
forward that watches an input, or :func:`flush_pending_checks`, reports the checks whose events have completed, the
warning naming the layer and saying the backward was an earlier one. The queue holds at most ``MAX_PENDING`` checks.
On the CPU there is nothing to wait for and the check is immediate.

The hook sits on a view of the input made by each forward, so it lives and dies with that forward's graph. On the
input itself it would stay: a leaf fed to many forwards (a fixed batch, a benchmark's input) collected one more hook,
and one more check of the whole gradient, with every step.
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
from torch import Tensor

__all__ = ["MAX_PENDING", "all_finite", "flush_pending_checks", "watch_input_gradient"]

MAX_PENDING = 64
"""Deferred checks kept at most; a backward that finds the queue full waits for the oldest and reports it."""


def watch_input_gradient(owner: str, x: Tensor, steps: int, batch_statistics: bool) -> Tensor:
    """``x`` (the layer's ``(T, B, I)`` input) to run the forward on: where a gradient will reach it, a view of it that
    warns in backward if that gradient is not finite. Reports the deferred checks of earlier backwards that are done."""
    if not (x.requires_grad and torch.is_grad_enabled()) or torch.compiler.is_compiling():
        return x
    if _pending:
        flush_pending_checks()
    watched = x.view_as(x)
    watched.register_hook(partial(_check, owner, steps, batch_statistics))
    return watched


def all_finite(tensor: Tensor) -> bool:
    """Whether every element is finite. inf and NaN carry through a sum, so a finite sum means finite elements (one
    pass); a sum that overflowed from finite ones is told apart by the elementwise test (several passes and
    temporaries)."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def flush_pending_checks(block: bool = False) -> None:
    """Warn for the deferred checks (GPU backwards) whose answers have reached the host; with ``block``, wait for all
    of them first. Called by each forward that watches its input; call it with ``block=True`` to see the last
    backward's check (at the end of training, or in a test)."""
    while True:
        with _lock:
            if not _pending or not (block or _pending[0].done.query()):
                return
            pending = _pending.popleft()
        _report(pending)


class _Marker(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class _Completed:
    """An event that has already happened: the CPU's copies are done when ``copy_`` returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@dataclass(frozen=True)
class _Pending:
    done: _Marker  # completes once ``finite`` holds the device's answer
    finite: Tensor  # a host bool
    owner: str
    steps: int
    batch_statistics: bool


_pending: deque[_Pending] = deque()
_lock = threading.Lock()  # hooks run on autograd's device threads, the polls on the caller's


def _deferred(tensor: Tensor) -> bool:
    """Whether to check ``tensor`` later: reading its finiteness now would make the host wait for its CUDA (or ROCm)
    device. Other accelerators keep the immediate check, as their pinned memory and events vary."""
    return tensor.device.type == "cuda"


def _to_host(flag: Tensor) -> tuple[Tensor, _Marker]:
    """``flag`` copied to the host without waiting, and a marker that completes when the copy has landed."""
    if flag.device.type == "cpu":
        return flag, _Completed()
    host = torch.empty((), dtype=torch.bool, pin_memory=True)
    host.copy_(flag, non_blocking=True)
    event = torch.Event(flag.device)
    event.record()  # on the current stream, after the copy: autograd runs the hook on the gradient's stream
    return host, event


def _check(owner: str, steps: int, batch_statistics: bool, grad: Tensor | None) -> None:
    if grad is None or grad.numel() == 0:  # None: an undefined gradient (gradcheck sends one)
        return
    if not _deferred(grad):
        if not all_finite(grad):
            warnings.warn(_message(owner, steps, batch_statistics), RuntimeWarning, stacklevel=2)
        return
    low, high = torch.aminmax(grad.detach())  # inf and NaN carry through both; unlike a sum, neither overflows
    finite, done = _to_host(torch.isfinite(low) & torch.isfinite(high))
    with _lock:
        oldest = _pending.popleft() if len(_pending) >= MAX_PENDING else None
        _pending.append(_Pending(done, finite, owner, steps, batch_statistics))
    if oldest is not None:
        _report(oldest)


def _report(pending: _Pending) -> None:
    pending.done.synchronize()
    if not bool(pending.finite):
        message = _message(pending.owner, pending.steps, pending.batch_statistics)
        warnings.warn(
            f"{message} [reported late: found by the device-side check of an earlier backward]",
            RuntimeWarning,
            stacklevel=3,
        )


def _message(owner: str, steps: int, batch_statistics: bool) -> str:
    cause = (
        "per-timestep batch statistics make gradients through time grow about exponentially with the length"
        if batch_statistics
        else "the gradient overflowed through time (or a non-finite loss or state reached it)"
    )
    return (
        f"{owner}: expected a finite gradient at the input, got inf/NaN after backpropagating through {steps} "
        f"steps ({cause}); shorten the backpropagated windows (stateful truncated BPTT), lower the learning rate, "
        "or use norm='layer'"
    )
