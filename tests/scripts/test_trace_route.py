"""``scripts/trace_route.py``: the route of one layer call, as docs/architecture.md states it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import trace_route

import seqnorm

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def test_the_architecture_page_states_the_route_the_trace_measures() -> None:
    route, path = trace_route.layer_route()
    if path != "kernel":
        pytest.skip(f"the page traces the compiled kernels' route; here the plan takes {path!r}")
    text = " ".join(ARCHITECTURE.read_text(encoding="utf-8").split())
    stated = re.search(r"enters (\d+) of seqnorm's files \((\d+) switches", text)
    assert stated is not None, "docs/architecture.md lost its route of one call"
    assert (len(route.files), route.switches) == (int(stated.group(1)), int(stated.group(2))), route
    named = set(re.findall(r"`((?:[a-z_]+/)?[a-z_]+\.py)`", text[stated.start() : text.index("One training step")]))
    # every file of the route is named in the paragraph (by its folder, or as the last folder named before it)
    assert {Path(file).name for file in route.files} <= {Path(file).name for file in named}, named


def test_a_route_counts_only_seqnorms_files_and_the_moves_between_them() -> None:
    assert trace_route.traced(lambda: sorted([3, 1, 2])).files == set()  # outside seqnorm: nothing counted
    route = trace_route.traced(lambda: seqnorm.LSTM(2, 3)(torch.zeros(1, 1, 2)))
    assert {"layers/base.py", "layers/lstm.py"} <= route.files
    assert route.switches >= len(route.files) - 1  # entering each file after the first is a move
