"""``docs/api.md`` is what ``scripts/api_reference.py`` makes of the current docstrings and covers every public name."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import api_reference
import pytest

DOCS = api_reference.OUTPUT


def test_api_reference_is_current() -> None:
    assert DOCS.read_text(encoding="utf-8") == api_reference.render(), (
        "docs/api.md is out of date: run python scripts/api_reference.py"
    )


def test_every_public_name_has_an_entry_with_its_docstring() -> None:
    text = DOCS.read_text(encoding="utf-8")
    for module_name in api_reference.MODULES:
        module = importlib.import_module(module_name)
        assert f"## `{module_name}`" in text
        for name in module.__all__:
            assert f"`{module_name}.{name}`" in text, f"{module_name}.{name}"
    assert " at 0x" not in text  # no reprs of objects: the file must not change from one run to the next
    for forward in (
        "forward(x: Tensor, state: tuple[Tensor, Tensor] | None = None, *, step: int | None = None",
        "-> tuple[Tensor | PackedSequence, tuple[Tensor, Tensor]]",
    ):
        assert forward in text


def test_check_mode(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # In another process, with another hash seed: sets and dicts keyed by strings must not reorder the output.
    environment = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(api_reference.ROOT)}
    script = str(api_reference.ROOT / "scripts" / "api_reference.py")
    current = subprocess.run([sys.executable, script, "--check"], env=environment, capture_output=True, text=True)
    assert current.returncode == 0, current.stderr
    stale = tmp_path / "api.md"
    stale.write_text("old\n")
    assert api_reference.main(["--check", "--out", str(stale)]) == 1
    assert "out of date: run python scripts/api_reference.py" in capsys.readouterr().err
    assert api_reference.main(["--out", str(stale)]) == 0 and api_reference.main(["--check", "--out", str(stale)]) == 0
