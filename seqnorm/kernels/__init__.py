"""seqnorm's kernels: fused loops for the normalized LSTM/GRU recurrence and generation step, per device.

The C++ sources are in ``seqnorm/csrc`` (``norms.h``: each norm's step and backward; ``cells.h``: the gates;
``recurrence.cpp``: the time loops). They are compiled once per machine with torch's ``cpp_extension`` by the
first layer that needs them (or ahead of time by ``python -m seqnorm.kernels``, which ``make venv`` runs) into a cache
directory (:func:`cache_dir`), keyed by the sources, the torch version and the CPU's vector instructions, and loaded
from there. A build is published whole (a temporary folder renamed into place) with a manifest of the library's size
and SHA-256 and the torch it was built for (:data:`MANIFEST`), which every load checks first: a truncated, empty,
replaced or stale library is rebuilt once (or, where it cannot be, the plain path runs with a warning), never
loaded. A first-use build prints one notice (what, where, how long, how to opt out) and holds a file lock, so that
processes starting together (DDP ranks, pytest-xdist workers) build once and the others wait and then load it.
Without a build — no compiler, a failed build (recorded beside the cache and not retried by later processes),
``SEQNORM_KERNELS=0`` — every layer runs its plain-PyTorch path (the loop over the cell's step, or the reference
loop), which is also what the tests compare the kernels with, and one warning says why.

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
per-timestep BatchNorm's ``running_mean``, ``running_var`` and ``num_batches_tracked`` in training (the forwards and
the generation step update them in place, as the module's forward does); they may share memory with no other
argument (checked). Everything else is read only. Inside a call a norm's output may be written over its addend,
never over its own input (``StepNorm::forward_row``).

Devices: :func:`native` returns a device type's :class:`~seqnorm.kernels.backend.Backend` (:data:`BACKENDS`): the C++
kernels above on the CPU (:class:`~seqnorm.kernels.cpu.CpuBackend`), the Triton kernels on CUDA
(:mod:`seqnorm.kernels.triton_backend`, imported only when a CUDA tensor, or ``SEQNORM_BACKEND=triton``, asks for
it), with the same entry points; the autograd Function in :mod:`seqnorm.layers.compiled` and the plan serve both.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from seqnorm.kernels import cpu
from seqnorm.kernels.backend import NO_NORM, Backend, KernelNorm
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

SOURCES = Path(__file__).resolve().parent.parent / "csrc"
NAME = "seqnorm_kernels"
ENV_SWITCH = "SEQNORM_KERNELS"
"""``SEQNORM_KERNELS=0`` turns the kernels off for a process (the plain-PyTorch paths run)."""


# --- building and loading -------------------------------------------------------------------------------------------


def _sources() -> list[Path]:
    return sorted(SOURCES.glob("*.cpp")) + sorted(SOURCES.glob("*.h"))


def _build_key(capability: str) -> str:
    digest = hashlib.sha256()
    for path in _sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(" ".join(cpu.compile_flags(capability)).encode())
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return f"{python}-torch{torch.__version__}-{capability}-{digest.hexdigest()[:16]}".replace("+", "_")


def cache_dir() -> Path:
    """Where builds live: ``$SEQNORM_KERNELS_DIR``, else ``$XDG_CACHE_HOME/seqnorm/kernels`` (``~/.cache``)."""
    configured = os.environ.get("SEQNORM_KERNELS_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "seqnorm" / "kernels"


def _library(directory: Path) -> Path:
    # The name torch's cpp_extension gives the library it builds.
    return directory / (f"{NAME}.pyd" if sys.platform == "win32" else f"{NAME}.so")


BUILD_TIME = "1-3 minutes"
"""How long a cold build takes, for the first-use notice: one compile of ``recurrence.cpp`` (docs/performance.md)."""


def _failed(directory: Path) -> Path:
    return directory.with_name(directory.name + ".failed")


MANIFEST = "manifest.json"
"""Beside the library in a build: its size and SHA-256, and the torch, compiler and Python it was built with.
Written last into the build's temporary folder, which one rename then publishes; checked before every load."""


def _torch_identity() -> str:
    # the commit too: a torch rebuilt from other sources can keep the version string (the build key's)
    return f"{torch.__version__} ({torch.version.git_version})"


def _compiler_version() -> str:
    try:
        compiler = os.environ.get("CXX", "c++")
        result = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return next(iter(result.stdout.splitlines()), "unknown").strip()


def _write_manifest(directory: Path) -> None:
    library = _library(directory).read_bytes()
    manifest = {
        "library": _library(directory).name,
        "size": len(library),
        "sha256": hashlib.sha256(library).hexdigest(),
        "torch": _torch_identity(),
        "compiler": _compiler_version(),
        "python": sys.version.split()[0],
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


def _broken(directory: Path) -> str | None:
    """Why the build in ``directory`` must not be loaded, or ``None``: it is not there at all (no library: nothing
    to load, whatever a broken build left beside it), or it is exactly what its manifest says (size, SHA-256, this
    torch). Checked before the library is mapped: a truncated one killed every process that loaded it (bus error)."""
    library = _library(directory)
    if not library.exists():
        return None
    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
        size, digest, built_for = manifest["size"], manifest["sha256"], manifest["torch"]
        data = library.read_bytes()
    except (OSError, ValueError, KeyError, TypeError) as error:  # ValueError: not JSON, or not UTF-8
        return f"no readable {MANIFEST} ({type(error).__name__})"
    if len(data) != size:
        return f"{library.name} holds {len(data)} bytes, its {MANIFEST} says {size}"
    if hashlib.sha256(data).hexdigest() != digest:
        return f"{library.name} is not the file its {MANIFEST} describes (SHA-256)"
    if built_for != _torch_identity():
        return f"built for torch {built_for}, this is torch {_torch_identity()}"
    return None


def _ready(directory: Path) -> bool:
    return _library(directory).exists() and _broken(directory) is None


def build(verbose: bool = False, *, first_use: bool = False, force: bool = False) -> Path:
    """Compile the kernels for this machine into :func:`cache_dir` (a no-op when that build exists and passes its
    check, unless ``force``); its path.

    A build is written into a fresh temporary folder, its :data:`MANIFEST` last, and published by one rename over
    whatever was there (a broken build, a half-built folder), so a reader finds a whole build or none. One process
    at a time builds (a file lock beside the build): a process that finds another building waits for it, says so,
    and takes its build. ``first_use`` (the layers' call, :func:`native`) prints the notice of what is being built,
    where, for how long and how to opt out, and does not retry a build that failed before (an explicit ``python -m
    seqnorm.kernels`` does). Raises whatever torch's ``cpp_extension`` raises when there is no compiler or the build
    fails, after noting the failure beside the build (:func:`status` and the layers' warning then say why, not only
    "not built").
    """
    capability = cpu.capability()
    directory = cache_dir() / _build_key(capability)
    if not force and _ready(directory):
        return _library(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory):
        if not force and _ready(directory):  # another process built it while this one waited
            return _library(directory)
        if first_use:
            if _failed(directory).exists():  # another process's build just failed: do not repeat it
                raise RuntimeError(_failed(directory).read_text(encoding="utf-8"))
            broken = _broken(directory)
            _notice(
                f"seqnorm: building the C++ kernels for this machine into {directory} (once per torch and seqnorm "
                f"version; about {BUILD_TIME}"
                + (f"; the build there fails its check: {broken}" if broken else "")
                + f"). Set {ENV_SWITCH}=0 to skip them and run the plain-PyTorch path."
            )
        started = time.perf_counter()
        path = _compile(directory, capability, verbose)
        if first_use:
            _notice(f"seqnorm: the C++ kernels are built ({time.perf_counter() - started:.0f} s).")
        return path


def _compile(directory: Path, capability: str, verbose: bool) -> Path:
    from torch.utils import cpp_extension

    # A directory of this process's own, renamed into place whole: a build interrupted halfway is never loaded.
    work = directory.with_name(f"{directory.name}.partial-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        with _interpreter_tools_on_path():
            cpp_extension.load(
                NAME,
                [str(path) for path in sorted(SOURCES.glob("*.cpp"))],
                extra_cflags=cpu.compile_flags(capability),
                extra_ldflags=["-fopenmp"],
                build_directory=str(work),
                verbose=verbose,
                # dlopen'ed only, not imported as a module: imported, it was the module _load_cpu got back too
                # (CPython keeps an extension's first module), with the __file__ of this directory, renamed below
                is_python_module=False,
            )
    except BaseException as error:  # an interrupted build (Ctrl-C) leaves nothing behind and is not a failure
        shutil.rmtree(work, ignore_errors=True)
        if isinstance(error, Exception):
            reason = f"{type(error).__name__}: {error}".splitlines()[0][:500]
            _failed(directory).write_text(reason, encoding="utf-8")
        raise
    _write_manifest(work)
    _failed(directory).unlink(missing_ok=True)
    if directory.exists():  # a broken or half-built one (under the lock: no build of this seqnorm is writing it)
        stale = directory.with_name(f"{directory.name}.stale-{os.getpid()}")
        shutil.rmtree(stale, ignore_errors=True)
        directory.rename(stale)  # a process that mapped its library keeps it: the file lives until unmapped
        shutil.rmtree(stale, ignore_errors=True)
    try:
        work.rename(directory)
    except OSError:  # a build that holds no lock finished first (an older seqnorm sharing the cache): same sources
        shutil.rmtree(work, ignore_errors=True)
    return _library(directory)


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """Hold ``<build>.lock`` (``filelock``: released by the system when a process dies, so never stale)."""
    from filelock import FileLock, Timeout

    lock = FileLock(directory.with_name(directory.name + ".lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        _notice(f"seqnorm: waiting for another process to finish building the C++ kernels in {directory} ...")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _notice(message: str) -> None:
    # stderr, not a warning: it must show even where warnings are filtered, and a filter must not turn it into an
    # error in the middle of a build.
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _interpreter_tools_on_path() -> Iterator[None]:
    """The running interpreter's scripts folder on ``PATH`` while torch builds: ``ninja`` (a dependency) is
    installed there, and torch looks for it on ``PATH``, which a venv's python run by its path does not change. Then
    the folder the ``ninja`` package found its program in (``pip install --user`` puts it in ``~/.local/bin``, often
    not on ``PATH``)."""
    folders = [str(Path(sys.executable).parent)]
    with contextlib.suppress(ImportError):
        import ninja

        folders += [ninja.BIN_DIR] if ninja.BIN_DIR and ninja.BIN_DIR not in folders else []
    previous = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([*folders, previous])
    try:
        yield
    finally:
        os.environ["PATH"] = previous


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
        loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
        spec = importlib.util.spec_from_file_location(NAME, path, loader=loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
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


def _compiler() -> bool:
    return shutil.which(os.environ.get("CXX", "c++")) is not None


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
