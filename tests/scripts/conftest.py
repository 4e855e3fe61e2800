"""Make ``scripts/`` importable (the scripts import their helper as ``_common``), keep torch's settings intact, and
read the scripts' CSV output."""

from __future__ import annotations

import csv
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    # The scripts set torch's thread count (--threads) and turn on deterministic algorithms; the rest of the suite
    # should inherit neither.
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _finite(text: str) -> bool:
    return text != "" and math.isfinite(float(text))


@pytest.fixture
def read_csv() -> Callable[[Path], list[dict[str, str]]]:
    """Rows of a CSV file as dicts of strings."""
    return _read_csv


@pytest.fixture
def finite() -> Callable[[str], bool]:
    """Whether a CSV cell holds a finite number."""
    return _finite


def _table_after(text: str, heading: str) -> list[list[str]]:
    """The body rows of the Markdown table under ``heading`` (up to the next ``###``), each as its stripped cells."""
    section = text.split(heading, 1)[1].split("###", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")][1:]  # the header row goes
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]


@pytest.fixture
def table_after() -> Callable[[str, str], list[list[str]]]:
    """The body rows of the Markdown table under a heading in a script's output, as lists of cells."""
    return _table_after
