"""Helpers for the data tests: small text files written into ``tmp_path``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def write(tmp_path: Path) -> Callable[..., str]:
    """Write ``content`` (str, or bytes written as-is) to ``tmp_path/name`` and return the path as a string."""

    def _write(name: str, content: str | bytes, encoding: str = "utf-8") -> str:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding=encoding)
        return str(path)

    return _write
