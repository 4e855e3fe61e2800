"""Checkpoint files that are either the previous complete file or the new complete one, never a partial write.

Lightning's own ``_atomic_save`` goes through an fsspec transaction whose temporary file lives in ``$TMPDIR``: when
the run directory is on another filesystem the "commit" is a copy, and a kill during that copy truncates the target
(the previous good file included). Here the temporary file is made next to the target, so the commit is one
``os.replace`` — a rename within one directory, atomic on POSIX filesystems.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import secrets
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH

__all__ = ["TEMP_SUFFIX", "AtomicCheckpointIO", "AtomicTextFile", "atomic_copy", "is_disk_full", "local_path"]

TEMP_SUFFIX = ".tmp"
"""Temporary files are ``.<target name>.<random hex>.tmp``: hidden, and never matching ``*.ckpt``, so a file left by a
SIGKILL mid-write is not taken for a checkpoint by Lightning's ``last*.ckpt`` search or a ``*.ckpt`` glob."""


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` is a write refused for lack of room: a full device (ENOSPC) or a used-up quota (EDQUOT)."""
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


def local_path(path: _PATH) -> str | None:
    """``path`` as a plain local path, or None when it names a remote (fsspec URL) location."""
    filesystem, stripped = fsspec.core.url_to_fs(str(path))
    return stripped if isinstance(filesystem, LocalFileSystem) else None


def _temp_path(target: str) -> str:
    directory, name = os.path.split(target)
    return os.path.join(directory, f".{name}.{secrets.token_hex(8)}{TEMP_SUFFIX}")


def _fsync_directory(directory: str) -> None:
    # Makes the rename itself durable (a power cut after it must not bring the old directory entry back). Not
    # possible on every platform (Windows cannot open a directory), where the rename is still atomic.
    with contextlib.suppress(OSError):
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def _publish(temp: str, target: str) -> None:
    """Move the complete ``temp`` file onto ``target`` (the only step that changes what ``target`` holds)."""
    os.replace(temp, target)
    _fsync_directory(os.path.dirname(target))


def _write_durably(temp: str, payload: memoryview) -> None:
    # "x": a new file (never someone else's), created with the usual umask permissions, unlike mkstemp's 0600
    with open(temp, "xb") as file:
        file.write(payload)
        file.flush()
        os.fsync(file.fileno())


def _discard(temp: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(temp)


def atomic_copy(source: str, target: str) -> None:
    """Make local file ``target`` a copy of local file ``source``, atomically.

    A hard link when the filesystem has them (no data written: ``source`` is only ever replaced by a rename, never
    rewritten in place, so the link keeps today's content), else a durable copy; either is renamed onto ``target``.
    """
    temp = _temp_path(target)
    try:
        try:
            os.link(source, temp)
        except OSError:  # no hard links here (some network and FUSE filesystems): copy the bytes
            _discard(temp)
            with open(source, "rb") as reader:
                _write_durably(temp, memoryview(reader.read()))
        _publish(temp, target)
    except BaseException:
        _discard(temp)
        raise


class AtomicTextFile:
    """A text file written under a new temporary name beside ``target`` (created exclusively: never through a link)
    and renamed onto ``target`` by :meth:`commit`, so that a link planted at ``target`` is replaced, not written
    through, and a failed or interrupted run (:meth:`discard`) leaves whatever ``target`` held before."""

    def __init__(self, target: str | os.PathLike[str]) -> None:
        self.target = os.path.abspath(target)
        self._temp = _temp_path(self.target)
        self._file = open(self._temp, "x", encoding="utf-8")  # noqa: SIM115 - closed by commit or discard

    def write(self, text: str) -> None:
        self._file.write(text)

    def commit(self) -> None:
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            _publish(self._temp, self.target)
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        self._file.close()
        _discard(self._temp)


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO whose local writes are atomic in the destination directory.

    A checkpoint is serialized in memory, written to a temporary file beside the target, flushed and fsynced, then
    renamed onto the target, and the directory is fsynced. If anything fails or interrupts the write (a full disk,
    Ctrl-C), the temporary file is removed, the previous file at the target is untouched and the error propagates.
    A SIGKILL can leave only a temporary file (see :data:`TEMP_SUFFIX`), never a partial ``.ckpt``.

    Remote paths (fsspec URLs such as ``s3://``) go through Lightning's own code unchanged. Loading and removing
    are TorchCheckpointIO's.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        target = local_path(path)
        if target is None or storage_options is not None:  # remote, or options only Lightning can reject
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        target = os.path.abspath(target)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        # Serialize before creating the file: an object torch cannot save then leaves nothing behind.
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        temp = _temp_path(target)
        try:
            _write_durably(temp, buffer.getbuffer())
            _publish(temp, target)
        except BaseException:
            _discard(temp)
            raise
