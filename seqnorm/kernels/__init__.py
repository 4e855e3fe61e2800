"""seqnorm's kernels: fused loops for the normalized LSTM/GRU recurrence and generation step, per device.

The C++ sources are in ``seqnorm/csrc`` (``norms.h``: each norm's step and backward; ``cells.h``: the gates;
``recurrence.cpp``: the time loops, and one norm's step alone for a cell's training step in a user's own loop;
``bindings.cpp``: their checked Python bindings, and ``norm_step``, that step as one autograd node made in C++, which
per-timestep BN's ``forward_step`` calls). They are compiled once per machine with torch's ``cpp_extension``
(:mod:`seqnorm.kernels.builder`) by the first layer that needs them (or ahead of time by ``python -m seqnorm.kernels``,
which ``make venv`` runs) into a cache directory (:func:`cache_dir`), keyed by the sources, the torch version and the
CPU's vector instructions, and loaded from there. A build is published whole (a temporary folder renamed into place)
with a manifest of the library's size and SHA-256 and the torch it was built for (:data:`MANIFEST`), which every load
checks first: a truncated, empty, replaced or stale library is rebuilt once (or, where it cannot be, the plain path runs
with a warning), never loaded. A first-use build prints one notice (what, where, how long, how to opt out) and holds a
file lock, so that processes starting together (DDP ranks, pytest-xdist workers) build once and the others wait and then
load it. Without a build — no compiler, a failed build (recorded beside the cache and not retried by later processes),
``SEQNORM_KERNELS=0`` — every layer runs its plain-PyTorch path (the loop over the cell's step, or the reference loop),
which is also what the tests compare the kernels with, and one warning says why.

Memory: the large tensors of the recurrences (a training step's saved activations, the input projection) come from
blocks the kernels keep between calls, up to :data:`CACHE_ENV` MiB (``csrc/buffers.h``; :func:`empty_cache`,
:func:`cache_info`, :func:`set_cache_limit`). They do not raise the peak: a call of a shape no kept block serves
lets go of them all before it allocates.

Threads: the entry points run without the GIL; the kept memory, the route trials and the route setting may be used
from several threads, and a fork leaves their locks usable in the child (``csrc/process_mutex.h``).

Arguments: every entry point checks all its arguments before it touches their memory (``csrc/checks.h``; each norm's
``NormArgs`` in one place, ``NormArgs::validate`` in ``csrc/norms.h``): the cell (``"lstm"`` or ``"gru"``), one
floating dtype (float32 or float64) for the call, the CPU, contiguity where rows are indexed densely, every shape
against the others, and the optional tensors the cell and norms need. A call they cannot run raises ``ValueError``
(``TypeError`` for a dtype) naming the entry point and the argument, e.g. ``seqnorm kernels: generation_step:
expected c (the LSTM cell state) of shape (1, B, H) = (1, 4, 32), got None``.

Aliasing: every result is a fresh tensor, never an argument or a view of one. The only arguments written are a
per-timestep BatchNorm's ``running_mean``, ``running_var`` and ``num_batches_tracked`` in training (the forwards,
the norm step and the generation step update them in place, as the module's forward does); they may share memory
with no other argument (checked). Everything else is read only. Inside a call a norm's output may be written over
its addend, never over its own input (``StepNorm::forward_row``).

Devices: :func:`native` returns a device type's :class:`~seqnorm.kernels.backend.Backend` (:data:`BACKENDS`): the C++
kernels above on the CPU (:class:`~seqnorm.kernels.cpu.CpuBackend`), the Triton kernels on CUDA
(:mod:`seqnorm.kernels.triton_backend`, imported only when a CUDA tensor, or ``SEQNORM_BACKEND=triton``, asks for
it), with the same entry points; the autograd Function in :mod:`seqnorm.layers.compiled` and the plan serve both.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
import warnings
from collections.abc import Callable, Iterator

from seqnorm.kernels import cpu
from seqnorm.kernels.backend import NO_NORM, Backend, KernelNorm
from seqnorm.kernels.builder import (
    BUILD_TIME,
    ENV_SWITCH,
    MANIFEST,
    _broken,
    _build_key,
    _compiler,
    _failed,
    _library,
    build,
    cache_dir,
    load_library,
)
from seqnorm.kernels.cpu import CACHE_ENV, DEFAULT_CACHE_MB, CacheInfo, CpuBackend

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "CACHE_ENV",
    "DEFAULT_CACHE_MB",
    "MANIFEST",
    "NO_NORM",
    "Backend",
    "CacheInfo",
    "KernelNorm",
    "build",
    "cache_dir",
    "cache_info",
    "disabled",
    "empty_cache",
    "enabled",
    "native",
    "set_cache_limit",
    "set_enabled",
    "status",
]

_LOADED: dict[str, Backend | None] = {}
_WHY_NOT: dict[str, str] = {}
_ENABLED: list[bool] = [os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")]


BACKEND_ENV = "SEQNORM_BACKEND"
"""``SEQNORM_BACKEND=triton``: the Triton backend for CPU tensors too, through Triton's interpreter (needs
``TRITON_INTERPRET=1`` set before Triton is imported; how the tests run the GPU kernels without a GPU). ``auto``, the
default: the C++ kernels on the CPU, Triton on CUDA."""


def _backend_setting() -> str:
    value = os.environ.get(BACKEND_ENV, "").strip().lower() or "auto"
    if value not in ("auto", "triton"):
        raise ValueError(f"{BACKEND_ENV}: expected auto or triton, got {value!r}")
    return value


def _load_triton(device_type: str) -> Backend | None:
    if importlib.util.find_spec("triton") is None:
        _WHY_NOT[device_type] = 'Triton is not installed: pip install "seqnorm[gpu]"'
        return None
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET", "") != "1":
        _WHY_NOT[device_type] = (
            f"{BACKEND_ENV}=triton runs CPU tensors through Triton's interpreter: set TRITON_INTERPRET=1"
        )
        return None
    from seqnorm.kernels import triton_backend  # imported here: `import seqnorm` never imports triton

    return triton_backend  # type: ignore[return-value]  # the module has the Protocol's attributes


def _load_cpu(build_missing: bool = True) -> Backend | None:
    """The C++ kernels, built first when they are missing and can be (``build_missing``: the layers' first use;
    :func:`status` only looks)."""
    if _backend_setting() == "triton":
        return _load_triton("cpu")
    directory = cache_dir() / _build_key(cpu.capability())
    path = _library(directory)
    broken = _broken(directory)
    if (broken is not None or not path.exists()) and build_missing and _compiler() and not _failed(directory).exists():
        try:
            build(first_use=True)  # a broken build is rebuilt (once: under the lock, then checked again)
        except Exception as error:  # recorded beside the build (the warning names it), unless that failed too
            if not _failed(directory).exists():
                _WHY_NOT["cpu"] = f"the C++ kernels could not be built ({type(error).__name__}: {error})"
                return None
        broken = _broken(directory)
    if broken is not None:  # never mapped: a truncated library is a bus error, not an exception
        _WHY_NOT["cpu"] = (
            f"the C++ kernels in {directory} fail their check ({broken}), so they are not loaded; rebuild them: "
            "`python -m seqnorm.kernels`"
        )
        return None
    if not path.exists():
        if _failed(directory).exists():
            reason = _failed(directory).read_text(encoding="utf-8")
            how = f"their last build failed: {reason}; fix that, then `python -m seqnorm.kernels`"
        elif not _compiler():
            how = "no C++ compiler was found"
        else:
            how = f"the first layer to use them builds them, about {BUILD_TIME}; or `python -m seqnorm.kernels`"
        _WHY_NOT["cpu"] = f"the C++ kernels are not built for this machine and source version ({how})"
        return None
    try:
        module = load_library(path)
    except ImportError as error:  # whole and as built, yet it does not load here (a system library changed, say)
        _WHY_NOT["cpu"] = (
            f"the C++ kernels at {path} failed to load ({error}); rebuild them: `python -m seqnorm.kernels --force`"
        )
        return None
    module.set_cache_limit(cpu.cache_limit())
    return CpuBackend(module)


# --- the memory the kernels keep between calls for their saved activations (csrc/buffers.h) ---


def set_cache_limit(megabytes: float) -> None:
    """Keep at most ``megabytes`` MiB between calls for the saved activations (0: none; blocks beyond it are let go
    at once, the least recently used first)."""
    limit = cpu.set_cache_limit(megabytes)
    module = _LOADED.get("cpu")
    if module is not None:
        module.set_cache_limit(limit)


def empty_cache() -> None:
    """Let go of all the memory the kernels keep between calls (as ``torch.cuda.empty_cache()`` does on a GPU): for
    a process that has finished training and goes on with other work."""
    module = _LOADED.get("cpu")
    if module is not None:
        module.empty_cache()


def cache_info() -> CacheInfo:
    """What the kernels keep now, their limit, and how many blocks were reused and made (zeros before they load)."""
    module = _LOADED.get("cpu")
    return CacheInfo(*module.cache_info()) if module is not None else CacheInfo(0, 0, 0, 0)


BACKENDS: dict[str, Callable[..., Backend | None]] = {
    "cpu": _load_cpu,
    "cuda": lambda build_missing=True: _load_triton("cuda"),
}
"""Per device type, a loader of its :class:`~seqnorm.kernels.backend.Backend` (``None`` when it cannot run;
``status`` says why). ``build_missing=False``: look only, build nothing (:func:`status`)."""
_LOADING = threading.Lock()  # two threads' first layers: one builds and loads, the other then finds it loaded
if hasattr(os, "register_at_fork"):  # a fork while another thread builds must not leave the child's lock held
    os.register_at_fork(after_in_child=lambda: globals().update(_LOADING=threading.Lock()))


def native(device_type: str) -> Backend | None:
    """The kernels (:class:`~seqnorm.kernels.backend.Backend`) for ``device_type``, or ``None`` (switched off, not
    built, or none for that device).

    The first ``None`` for a device that has a loader warns once, saying why and that the plain path runs.
    """
    if not _ENABLED[0]:
        return None
    if device_type not in _LOADED:
        with _LOADING:
            if device_type not in _LOADED:
                _load(device_type)
    return _LOADED[device_type]


def _load(device_type: str) -> None:
    loader = BACKENDS.get(device_type)
    module = None if loader is None else loader()
    _LOADED[device_type] = module
    if module is None and loader is not None:
        warnings.warn(
            f"seqnorm: {_WHY_NOT[device_type]}; the normalized layers run their plain-PyTorch path (same "
            "results, slower).",
            RuntimeWarning,
            stacklevel=4,
        )


def status(device_type: str = "cpu") -> str:
    """One line: whether the kernels run on ``device_type``, and if not, why."""
    if not _ENABLED[0]:
        return f"off ({ENV_SWITCH}=0 or seqnorm.kernels.set_enabled(False))"
    module = _LOADED.get(device_type)
    if device_type not in _LOADED:  # asked without caching a miss, so that the layers' first miss still warns
        loader = BACKENDS.get(device_type)
        module = None if loader is None else loader(build_missing=False)  # `seqnorm --version` must not compile
        if module is not None:
            _LOADED[device_type] = module
    if module is not None:
        return f"on ({module.__file__})"
    return f"off: {_WHY_NOT.get(device_type, f'no kernels for {device_type!r}')}"


def enabled() -> bool:
    """Whether the layers may use the kernels (the switch only; :func:`native` says whether they are there)."""
    return _ENABLED[0]


def set_enabled(flag: bool) -> None:
    """Let the layers use the kernels, or make them run the plain-PyTorch path (for comparisons and debugging)."""
    _ENABLED[0] = bool(flag)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """``with seqnorm.kernels.disabled():`` the plain-PyTorch paths run inside."""
    previous = _ENABLED[0]
    _ENABLED[0] = False
    try:
        yield
    finally:
        _ENABLED[0] = previous
