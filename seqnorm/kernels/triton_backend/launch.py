"""Launching the Triton kernels: :func:`launch` is ``kernel[grid](*args, **constexprs)``, made cheaper for the
launches a time loop repeats.

Triton's own launch (``JITFunction.run``) reads its knobs, binds the arguments with its native binder (each
argument's type and specialization: a pointer's 16-byte alignment, an integer's divisibility by 16 or its being 1),
formats a cache key of the specialization and the options, finds the compiled kernel and launches it; the launcher
then asks the CUDA driver about every pointer argument (``cuPointerGetAttribute``), some twenty a step kernel. A time
loop makes the same launch T times on other slices. Here the first launch of a kernel's specialization goes through
Triton (which compiles it if needed) and keeps the compiled kernel Triton returns; a later launch whose arguments
Triton's own binder specializes the same way calls that compiled kernel's launcher directly, with the arguments in
the order Triton passes them and the pointers as integers (which the launcher takes as they are, asking the driver
nothing).

It applies to a JIT-compiled kernel with CUDA tensors, while no launch hook is set (a profiler's hooks see every
launch through Triton), unless ``SEQNORM_DIRECT_LAUNCH=0``; the interpreter's kernels launch as usual. The compiled
kernels kept assume that Triton's knobs that enter its options (``TRITON_DEBUG``, instrumentation) stay as they were
in the process.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["ENV", "LAUNCHES", "DirectLaunches", "binder_of", "launch"]

ENV = "SEQNORM_DIRECT_LAUNCH"
"""``0`` sends every launch through Triton's own ``kernel[grid](...)``."""

Binder = Callable[..., tuple[dict[str, Any], list[Any], dict[str, Any]]]


def binder_of(kernel: Any) -> tuple[Any, Binder] | None:
    """``(device, binder)`` of a JIT-compiled kernel on the current device: the binder Triton's own launch calls
    (``device_caches``), or ``None`` for the interpreter's kernels or a Triton whose internals differ."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, JITFunction):
        return None
    device = driver.active.get_current_device()
    caches = kernel.device_caches[device]
    if not isinstance(caches, tuple) or len(caches) != 5 or not callable(caches[4]):
        return None
    return device, caches[4]


def _cuda_binder(kernel: Any, first: torch.Tensor) -> tuple[Any, Binder] | None:
    return binder_of(kernel) if first.is_cuda else None


def _stream(device: Any) -> Any:
    from triton.runtime import driver

    return driver.active.get_current_stream(device)


def _hooked() -> bool:
    """Whether a launch hook is set (Triton 3.6: a callable or ``None``; later: a chain of callables)."""
    from triton import knobs

    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(hook is not None and getattr(hook, "calls", True) for hook in hooks)


class DirectLaunches:
    """The compiled kernels kept for direct launches, by kernel, device and Triton's specialization of the arguments.

    Args:
        binder: ``(kernel, first tensor argument) -> (device, binder)``, or ``None`` where Triton launches
            (:func:`binder_of` for CUDA tensors).
        stream: the device's current stream.
        hooked: whether a launch hook is set.
    """

    def __init__(
        self,
        binder: Callable[[Any, torch.Tensor], tuple[Any, Binder] | None] = _cuda_binder,
        stream: Callable[[Any], Any] = _stream,
        hooked: Callable[[], bool] = _hooked,
    ) -> None:
        self.binder, self.stream, self.hooked = binder, stream, hooked
        self.compiled: dict[tuple[Any, ...], Any] = {}

    def __call__(self, kernel: Any, grid: Sequence[int], *args: Any, **constexprs: Any) -> None:
        first = next((arg for arg in args if isinstance(arg, torch.Tensor)), None)
        found = None if first is None or os.environ.get(ENV, "1") == "0" else self.binder(kernel, first)
        if found is None or self.hooked():
            kernel[grid](*args, **constexprs)
            return
        device, binder = found
        bound, specialization, _ = binder(*args, **constexprs)
        key = (id(kernel), device, tuple(specialization))  # (a kernel hashes its source under a lock: id is cheap)
        compiled = self.compiled.get(key)
        if compiled is None:  # Triton compiles it (or finds it) and launches it; it returns the compiled kernel
            self.compiled[key] = kernel[grid](*args, **constexprs)
            return
        values = [value.data_ptr() if isinstance(value, torch.Tensor) else value for value in bound.values()]
        x, y, z = (*grid, 1, 1)[:3]
        run = compiled.run  # (its first read loads the module: before ``function`` is read)
        run(x, y, z, self.stream(device), compiled.function, compiled.packed_metadata, None, None, None, *values)


LAUNCHES = DirectLaunches()
"""The process's compiled kernels for direct launches."""


launch = LAUNCHES.__call__
"""``launch(kernel, grid, *args, **constexprs)``: ``kernel[grid](*args, **constexprs)``, directly where it can be
(:class:`DirectLaunches`). The bound method itself, not a function that calls it: one Python call less per launch.
(In the interpreter's tests a frame more here once cost a fifth of their time: CPython before 3.15 maps and unmaps a
chunk of its frame stack on every call that crosses a chunk's end, gh-142183. The test processes now keep those chunks,
``tests/frame_stack.py``.)"""
