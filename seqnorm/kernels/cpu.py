"""The CPU backend: seqnorm's C++ kernels (``seqnorm/csrc``) behind :class:`~seqnorm.kernels.backend.Backend`, with
the tuning only the CPU needs: the vector instructions and OpenMP flags of the build (:func:`capability`,
:func:`compile_flags`), the memory kept between calls (:data:`CACHE_ENV`, :func:`cache_limit`), and the weights'
layout for a generation step and an input projection, measured on the calls themselves (the per-step matmul's route
is measured inside the C++, ``product.h``). Building and loading the library is :mod:`seqnorm.kernels`'s.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import torch
from torch import Tensor

from seqnorm.kernels.projection import project

__all__ = [
    "CACHE_ENV",
    "DEFAULT_CACHE_MB",
    "CacheInfo",
    "CpuBackend",
    "LayoutChoice",
    "cache_limit",
    "capability",
    "compile_flags",
    "set_cache_limit",
]


# --- the build's flags ---


def capability() -> str:
    """The vector instructions the build targets: AVX2 where torch found AVX2 or AVX512 (both machine kinds of this
    project have AVX2; 256-bit vectors keep the clock up), else the compiler's default."""
    capability = torch.backends.cpu.get_cpu_capability()
    return "AVX2" if capability in ("AVX2", "AVX512") else "DEFAULT"


def compile_flags(capability: str) -> list[str]:
    """The compiler's flags for the build that targets ``capability`` (:func:`capability`)."""
    # OpenMP: at::parallel_for is a header template whose `#pragma omp parallel` is compiled into the extension;
    # without -fopenmp it silently runs on one thread (torch's own libgomp is the one loaded at run time).
    flags = ["-O3", "-fopenmp"]
    if capability == "AVX2":
        # at::vec selects its AVX2 implementations (Sleef's vectorized exp) from these macros.
        flags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return flags


# --- the memory the kernels keep between calls for their saved activations (csrc/buffers.h) ---

CACHE_ENV = "SEQNORM_KERNEL_CACHE_MB"
"""``SEQNORM_KERNEL_CACHE_MB=N``: the most memory, in MiB, that the kernels keep between calls for their large tensors
(a training step's saved activations, the input projection; :func:`seqnorm.kernels.set_cache_limit`; default 1024,
0 keeps none). What is kept is what the latest calls used: a call that no kept block serves lets go of them before
it allocates."""
DEFAULT_CACHE_MB = 1024
_CACHE_LIMIT: list[int | None] = [None]  # bytes, once seqnorm.kernels.set_cache_limit was called


class CacheInfo(NamedTuple):
    """What the kernels keep between calls for their saved activations (``seqnorm/csrc/buffers.h``)."""

    kept_bytes: int  # held now for the next calls
    limit_bytes: int  # the most that is kept
    reused: int  # blocks handed out again
    made: int  # blocks allocated


def _megabytes_to_bytes(value: object, owner: str) -> int:
    try:
        megabytes = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        megabytes = math.nan
    if not math.isfinite(megabytes) or megabytes < 0:
        raise ValueError(f"{owner}: expected a number of MiB >= 0, got {value!r}")
    if megabytes >= 1 << 43:  # its bytes would not fit the kernels' int64 (pybind's TypeError at the binding)
        raise ValueError(f"{owner}: expected a number of MiB below 2**43 (8 EiB), got {value!r}")
    return int(megabytes * (1 << 20))


def cache_limit() -> int:
    """The most bytes the kernels keep: the last :func:`seqnorm.kernels.set_cache_limit`'s, else
    :data:`CACHE_ENV`'s, else :data:`DEFAULT_CACHE_MB`."""
    if _CACHE_LIMIT[0] is not None:
        return _CACHE_LIMIT[0]
    text = os.environ.get(CACHE_ENV, "").strip()
    return _megabytes_to_bytes(text, CACHE_ENV) if text else DEFAULT_CACHE_MB << 20


def set_cache_limit(megabytes: float) -> int:
    """Record ``megabytes`` as the limit for this process (:func:`seqnorm.kernels.set_cache_limit` applies it to
    the loaded kernels); the limit in bytes."""
    _CACHE_LIMIT[0] = _megabytes_to_bytes(megabytes, "seqnorm.kernels.set_cache_limit")
    return _CACHE_LIMIT[0]


class CpuBackend:
    """The compiled C++ kernels of this machine as a :class:`~seqnorm.kernels.backend.Backend`: the entry points
    are the extension's own (every attribute not defined here is the extension module's)."""

    name = "kernel"
    """The plan's path for this backend (``layer.plan(x).path``)."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.__file__ = module.__file__

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)

    def unsupported(
        self,
        kinds: tuple[str, ...],
        dtype: torch.dtype,
        *,
        step: bool = False,
        training: bool = False,
        autocast: bool = False,
    ) -> str | None:
        """Every norm kind of :class:`~seqnorm.kernels.KernelNorm`, in any mix, runs here in float32 and float64;
        not under autocast (torch's CPU LSTM kernel fails in bfloat16, and the plain path is autocast's reference)."""
        del kinds, step, training
        if autocast or dtype not in (torch.float32, torch.float64):
            return "half precision or autocast"
        return None

    def empty_like_saved(self, sizes: list[int], like: Tensor) -> Tensor:
        """An uninitialized tensor for a recurrence's large saved tensors, on a kept block where one fits."""
        return self.module.saved_empty(sizes, like.dtype)

    def project_kept(self, sequence: Tensor, weight: Tensor, out: Tensor) -> Tensor:
        """The recurrence's input projection ``W x`` of the whole sequence into ``out``
        (:func:`~seqnorm.kernels.projection.project`), ``W^T`` as a row-major copy or as the transposed view,
        whichever multiplied faster here for the shape (:class:`ProjectionLayout`)."""
        rows = sequence.numel() // max(1, sequence.shape[-1])
        choice = ProjectionLayout.of(weight, rows)
        if choice.copy_wins is not None:
            return project(sequence, weight, out=out, copy=choice.copy_wins)
        trials = _PROJECTION_TRIALS.setdefault(choice, self.module.Trials(2))  # by identity, as LayoutChoice
        turn = trials.turn()
        start = time.perf_counter()
        result = project(sequence, weight, out=out, copy=turn == _COPY)
        trials.record(turn, time.perf_counter() - start)
        if choice.copy_wins is None and trials.chosen is not None:
            choice.copy_wins = trials.chosen == _COPY
            del _PROJECTION_TRIALS[choice]
        return result

    def prepare_step(self, weights: tuple[Tensor, Tensor], rows: int, fixed: Callable[[Tensor, Tensor], Any]) -> Any:
        """The generation step ``fixed(W_ih^T, W_hh^T)`` with each ``W^T`` in the layout measured fastest here for
        ``rows`` rows (:class:`LayoutChoice`), the copies written and the choice timed on the first steps."""
        choices = [LayoutChoice.of(weight, rows) for weight in weights]
        if all(choice.copy_wins is False for choice in choices):
            return fixed(*(weight.t() for weight in weights))
        return _preparing_step(self.module, weights, choices, fixed)


_VIEW, _COPY = 0, 1  # the layouts' candidate numbers in the kernels' Trials


def _preparing_step(
    kernels: Any,
    weights: tuple[Tensor, Tensor],
    choices: list[LayoutChoice],
    fixed: Callable[[Tensor, Tensor], Any],
) -> Any:
    """The steps until each weight is in its chosen layout (:class:`LayoutChoice`), with no step paying for the
    preparation at once.

    A row-major copy is wanted for a weight whose choice is the copy or is still to be made; it is written a chunk
    per step (:class:`_ChunkedCopy`), and the weight's view serves until it is complete. A shape still undecided has
    its layouts timed on these steps by the rule the kernels' products are (``kernels.Trials``, product.h): the view
    while the copy is written, then the two in blocks of a few steps, rounds of one block each, the first step of
    each block untimed (24 steps for two layouts).
    The timings are this step's own (another cell's steps cost another amount); the first step to decide a shape
    decides it for all. Then the steps run :func:`fixed`'s form, holding only the layouts they use."""
    slots = [(_ChunkedCopy(weight), choice) for weight, choice in zip(weights, choices, strict=True)]
    timings = {choice: kernels.Trials(2) for choice in choices}  # LayoutChoice hashes by identity
    settled: list[Any] = []

    def run(x: Tensor, h: Tensor, c: Tensor | None, step: int) -> tuple[Tensor, Tensor | None]:
        if settled:
            return settled[0](x, h, c, step)
        measured = next((choice for choice in choices if choice.copy_wins is None), None)
        pending = next((copy for copy, choice in slots if choice.copy_wins is not False and not copy.ready), None)
        if measured is None and pending is None:
            settled.append(fixed(*(copy.tensor if choice.copy_wins else copy.weight.t() for copy, choice in slots)))
            slots.clear()  # the layouts not chosen are let go
            return settled[0](x, h, c, step)
        ready = all(copy.ready for copy, choice in slots if choice is measured)
        trial = measured is not None and ready and timings[measured].turn() == _COPY
        pair = [
            copy.tensor if (trial if choice is measured else choice.copy_wins and copy.ready) else copy.weight.t()
            for copy, choice in slots
        ]
        if measured is None:
            result = fixed(*pair)(x, h, c, step)
        else:
            start = time.perf_counter()
            result = fixed(*pair)(x, h, c, step)
            timing = timings[measured]
            timing.record(_COPY if trial else _VIEW, time.perf_counter() - start)
            if measured.copy_wins is None and timing.chosen is not None:  # another step may have decided it meanwhile
                measured.copy_wins = timing.chosen == _COPY
        if pending is not None:
            pending.advance()
        return result

    return run


class _ChunkedCopy:
    """``weight.t()`` copied row-major a chunk of about ``CHUNK`` elements per :meth:`advance`: made at once, the
    strided transpose paused a step by several ms for a large weight (docs/benchmarks-archive.md)."""

    CHUNK = 1 << 17

    def __init__(self, weight: Tensor) -> None:
        self.weight = weight
        self.tensor = torch.empty(weight.shape[1], weight.shape[0], dtype=weight.dtype, device=weight.device)
        self.done = 0  # rows of the copy written

    @property
    def ready(self) -> bool:
        return self.done == self.tensor.shape[0]

    def advance(self) -> None:
        end = min(self.tensor.shape[0], self.done + max(1, self.CHUNK // max(1, self.tensor.shape[1])))
        self.tensor[self.done : end].copy_(self.weight[:, self.done : end].t())
        self.done = end


class LayoutChoice:
    """Which layout of ``W^T`` a generation step multiplies ``(rows, in) @ W^T`` by: a row-major copy or the
    transposed view (torch's own cells' layout), whichever MKL computed faster here, per weight shape, dtype, device,
    rows and thread count for the process (:meth:`of`); ``copy_wins`` is ``None`` until it is decided.

    Neither wins everywhere (docs/benchmarks-archive.md). The choice is measured on the generation steps themselves
    (:func:`_preparing_step`), not on probe products when the step is prepared, which paused the first step
    (docs/performance.md, "First calls do not pause"). Prepared again (after every training step and
    ``train()``/``eval()``: :func:`seqnorm.layers.stepping.forget`), a step reuses the choice, its copy again written
    a chunk per step.

    With deterministic algorithms (``torch.use_deterministic_algorithms``) it is always the view: the two layouts
    round differently, and a measured choice depends on the machine's load.
    """

    def __init__(self, copy_wins: bool | None = None) -> None:
        self.copy_wins = copy_wins

    @classmethod
    def of(cls, weight: Tensor, rows: int) -> LayoutChoice:
        """The choice for ``weight``'s shape (decided or still to be measured)."""
        if torch.are_deterministic_algorithms_enabled():  # one layout: each rounds differently (see product.h)
            return cls(copy_wins=False)
        key = (tuple(weight.shape), weight.dtype, weight.device.type, rows, torch.get_num_threads())
        return _LAYOUTS.setdefault(key, cls())


# The layout choices in this process, per weight shape, dtype, device, rows and threads.
_LAYOUTS: dict[tuple[Any, ...], LayoutChoice] = {}


class ProjectionLayout(LayoutChoice):
    """:class:`LayoutChoice` for the input projection of a whole sequence (:meth:`CpuBackend.project_kept`), per
    weight shape, dtype, rows and thread count, measured on the projections themselves (``kernels.Trials``: 24 calls).

    The copy of ``W^T`` is made at every call (a cached one would go stale where ``W.data`` is written in place), and
    it pays only where the product is long enough and the machine's BLAS prefers it: twice as fast on an Intel Xeon,
    a loss on an AMD EPYC (docs/performance.md). With deterministic algorithms it is always the copy, as before the
    choice."""

    @classmethod
    def of(cls, weight: Tensor, rows: int) -> LayoutChoice:
        if torch.are_deterministic_algorithms_enabled():  # the layout it always had: each rounds differently
            return cls(copy_wins=True)
        key = (tuple(weight.shape), weight.dtype, weight.device.type, rows, torch.get_num_threads())
        return _PROJECTION_LAYOUTS.setdefault(key, cls())


# The input projection's layout choices in this process, per weight shape, dtype, device, rows and threads, and the
# trials of those still undecided.
_PROJECTION_LAYOUTS: dict[tuple[Any, ...], LayoutChoice] = {}
_PROJECTION_TRIALS: dict[LayoutChoice, Any] = {}
