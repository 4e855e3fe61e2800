"""Installs ``tests/frame_stack.c``, a cache of CPython's frame-stack chunks, in a test process (tests/conftest.py).

Why (the C file says it at length): on CPython before 3.15 a loop whose calls cross a boundary between two chunks of
the frame stack maps and unmaps a chunk on every call. The Triton interpreter's kernels are such loops, and where the
boundary falls depends on how deep the test calls them: the same test took a fifth longer with one Python frame more
above it, and the Triton tests' system time was almost all ``mmap``/``munmap``. The cache changes no result, only
where memory blocks of up to 64 KiB come from. It is built with the system's C compiler into a temporary folder;
without a compiler, on another interpreter than CPython or on a free-threaded build, nothing is installed and the
tests run as they would without it.
"""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_suffix(".c")


class _ArenaAllocator(ctypes.Structure):
    # CPython's PyObjectArenaAllocator: a context and the two functions
    _fields_ = [("ctx", ctypes.c_void_p), ("alloc", ctypes.c_void_p), ("free", ctypes.c_void_p)]


LIBRARY: ctypes.CDLL | None = None
"""The installed cache (its counters: ``frame_stack_reused()``, ``frame_stack_kept()``), or ``None``."""
_tried = False


def install() -> ctypes.CDLL | None:
    """Build and install the cache once per process; :data:`LIBRARY`."""
    global LIBRARY, _tried
    if not _tried:
        _tried = True
        LIBRARY = _build_and_install()
    return LIBRARY


def _build_and_install() -> ctypes.CDLL | None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if platform.python_implementation() != "CPython" or sysconfig.get_config_var("Py_GIL_DISABLED") or not compiler:
        return None
    with tempfile.TemporaryDirectory(prefix="seqnorm-frame-stack-") as folder:
        library = Path(folder) / "frame_stack.so"
        built = subprocess.run(
            [compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(SOURCE)], capture_output=True, check=False
        )
        if built.returncode != 0:
            return None
        loaded = ctypes.CDLL(str(library))  # mapped: the file may go with its folder
    loaded.frame_stack_reused.restype = ctypes.c_long
    allocator = _ArenaAllocator(
        None,
        ctypes.cast(loaded.frame_stack_alloc, ctypes.c_void_p).value,
        ctypes.cast(loaded.frame_stack_free, ctypes.c_void_p).value,
    )
    ctypes.pythonapi.PyObject_SetArenaAllocator(ctypes.byref(allocator))  # copied by CPython
    return loaded
