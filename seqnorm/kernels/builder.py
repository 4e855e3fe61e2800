"""Building and loading the C++ kernels (:mod:`seqnorm.kernels`): the cache folder and its key, one build at a time
under a file lock, a build published whole with its manifest, and the checks before a library is mapped.

:mod:`seqnorm.kernels` decides when (the layers' first use, ``python -m seqnorm.kernels``, :func:`status`) and says
why not; this module does the work.
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
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from seqnorm.kernels import cpu

__all__ = ["BUILD_TIME", "ENV_SWITCH", "MANIFEST", "NAME", "SOURCES", "build", "cache_dir", "load_library"]

SOURCES = Path(__file__).resolve().parent.parent / "csrc"
"""The C++ sources (``seqnorm/csrc``): every file there is part of a build's key."""
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
"""How long a cold build takes, for the first-use notice: a compile of ``recurrence.cpp`` and ``bindings.cpp``, side
by side (docs/performance.md)."""


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


def _compiler() -> bool:
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def load_library(path: Path) -> ModuleType:
    """The built library at ``path`` as a module (raises ``ImportError`` where it does not load here). Check it
    first (:func:`_broken`): a truncated library is a bus error when mapped, not an exception."""
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
    spec = importlib.util.spec_from_file_location(NAME, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
