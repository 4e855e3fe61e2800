"""The test processes' cache of CPython's frame-stack chunks (tests/frame_stack.py): installed, and serving chunks."""

from __future__ import annotations

import ctypes
import shutil

import pytest

from tests import frame_stack


def _crossing_calls(depth: int) -> None:
    """At ``depth`` frames more, three calls one level deeper: somewhere on the way down, a call that needs the
    next chunk of the frame stack and returns from it, three times over."""
    if depth:
        _crossing_calls(depth - 1)
        return
    for _ in range(3):
        _leaf(0, 1, 2, 3)


def _leaf(a: int, b: int, c: int, d: int) -> int:
    return (a + b) * (c + d)


def test_the_chunk_cache_is_installed_and_hands_chunks_out_again() -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the tests run without the cache")
    library = frame_stack.install()
    assert library is not None
    current = frame_stack._ArenaAllocator()
    ctypes.pythonapi.PyObject_GetArenaAllocator(ctypes.byref(current))
    assert current.alloc == ctypes.cast(library.frame_stack_alloc, ctypes.c_void_p).value
    assert current.free == ctypes.cast(library.frame_stack_free, ctypes.c_void_p).value
    before = library.frame_stack_reused()
    for depth in range(300):  # 300 frames more than the test's own: past the first chunk's end for most depths
        _crossing_calls(depth)
    # each descent past a chunk's end takes a chunk, which the return gives back: from the cache after the first
    assert library.frame_stack_reused() - before >= 100
    assert 0 < library.frame_stack_kept() <= 64
