"""The package's layout: no import circles, and the layer's helpers do not import the layer back.

Imports are read from the source with ``ast`` (every ``import`` statement: at the top, under ``TYPE_CHECKING``, inside
functions), so a circle that only a type checker or a late call would walk still counts: a reader follows it all the
same.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

import seqnorm
from seqnorm.layers import LAYERS
from seqnorm.layers.protocol import Layer

PACKAGE = Path(seqnorm.__file__).resolve().parent
BASE = "seqnorm.layers.base"


def _module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


MODULES = _module_names()


def _imports(name: str, tree: ast.Module) -> dict[str, int]:
    """The seqnorm modules that ``name`` imports, each with the line of its first import (``from a.b import c``
    imports ``a.b.c`` when that is a module, else ``a.b``)."""
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            origin = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join([*anchor, *([origin] if origin else [])])
            targets = [f"{origin}.{alias.name}" for alias in node.names]
            targets = [target if target in MODULES else origin for target in targets]
        for target in targets:
            if target in MODULES and target != name:
                found.setdefault(target, node.lineno)
    return found


TREES = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in MODULES.items()}
GRAPH = {name: _imports(name, tree) for name, tree in TREES.items()}


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Import circles, each as ``[a, b, ..., a]`` (``a`` imports ``b`` ...), until none is left: each found circle's
    last import is set aside to look for the next."""
    # graphlib reads the mapping as node -> predecessors: an import is a predecessor, the circle comes out reversed.
    remaining = {name: set(targets) for name, targets in graph.items()}
    found = []
    while True:
        try:
            TopologicalSorter(remaining).prepare()
        except CycleError as error:
            cycle = list(reversed(error.args[1]))[:-1]
            start = cycle.index(min(cycle))
            cycle = cycle[start:] + cycle[: start + 1]
            found.append(cycle)
            remaining[cycle[-2]].discard(cycle[-1])
        else:
            return found


def test_no_module_of_seqnorm_is_in_an_import_circle() -> None:
    circles = [" -> ".join(cycle) for cycle in _cycles(GRAPH)]
    assert not circles, "import circles:\n" + "\n".join(circles)


def _package(name: str) -> str:
    """The package a module belongs to as docs/architecture.md draws them: ``seqnorm.<package>`` for a module of a
    subpackage (``seqnorm.kernels.triton_backend.rows`` -> ``seqnorm.kernels``), a top-level module as itself."""
    parts = name.split(".")
    if len(parts) == 1:
        return name
    top = ".".join(parts[:2])
    return top if (PACKAGE / parts[1]).is_dir() else name


def _packages(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """``graph`` collapsed onto packages: package A imports package B where a module of A imports one of B."""
    collapsed: dict[str, dict[str, int]] = {}
    for name, targets in graph.items():
        edges = collapsed.setdefault(_package(name), {})
        for target, line in targets.items():
            if _package(target) != _package(name):
                edges.setdefault(_package(target), line)
    return collapsed


PACKAGES = _packages(GRAPH)


def test_no_package_of_seqnorm_is_in_an_import_circle() -> None:
    """Imports point downward between packages too: no module circle can hide one (cells -> norms -> kernels ->
    cells went through function-local imports of different modules; data -> lightning -> data likewise)."""
    circles = [" -> ".join(cycle) for cycle in _cycles(PACKAGES)]
    assert not circles, "package import circles:\n" + "\n".join(circles)


def test_kernels_import_nothing_of_seqnorm() -> None:
    """docs/architecture.md: ``seqnorm/kernels/`` imports nothing of seqnorm outside itself, so the norms can name its
    types."""
    outside = {
        f"{name} -> {target} (line {line})"
        for name, targets in GRAPH.items()
        if _package(name) == "seqnorm.kernels"
        for target, line in targets.items()
        if _package(target) != "seqnorm.kernels"
    }
    assert not outside, "seqnorm/kernels/ imports from outside it:\n" + "\n".join(sorted(outside))


def test_the_package_check_reads_packages() -> None:
    """The two checks above see what they should: submodules fold into their package, top-level modules stay."""
    assert _package("seqnorm.kernels.triton_backend.rows") == "seqnorm.kernels"
    assert _package("seqnorm.checkpoint_io") == "seqnorm.checkpoint_io" and _package("seqnorm") == "seqnorm"
    folded = _packages({"seqnorm.cells.a": {"seqnorm.norms.b": 3}, "seqnorm.norms.b": {"seqnorm.cells.c": 7}})
    assert _cycles(folded) == [["seqnorm.cells", "seqnorm.norms", "seqnorm.cells"]]
    assert {"seqnorm.norms", "seqnorm.kernels"} <= set(PACKAGES["seqnorm.layers"])


def _builds_on_the_base(tree: ast.Module) -> bool:
    """Whether the module defines a subclass of RecurrentLayer (a layer: LSTM, GRU): it imports the base by design."""
    return any(
        isinstance(node, ast.ClassDef)
        and any(ast.unparse(base).rpartition(".")[2] == "RecurrentLayer" for base in node.bases)
        for node in ast.walk(tree)
    )


def test_the_layer_helpers_do_not_import_the_base_back() -> None:
    """``layers/base.py`` uses the helpers (arguments, plan, fast, stack, keys, ...); they take the layer as
    :class:`~seqnorm.layers.protocol.Layer`. Only the package's ``__init__`` and the layers built on the base
    import it."""
    importers = {
        f"{name} (line {GRAPH[name][BASE]})"
        for name in GRAPH
        if name.startswith("seqnorm.layers.") and BASE in GRAPH[name] and not _builds_on_the_base(TREES[name])
    }
    assert not importers, f"modules of seqnorm/layers/ that import {BASE} back: {', '.join(sorted(importers))}"


def test_the_layers_import_their_base_and_the_check_sees_it() -> None:
    """The two checks above read what they should: LSTM and GRU import the base, which imports its helpers."""
    assert {"seqnorm.layers.lstm", "seqnorm.layers.gru"} <= {name for name in GRAPH if BASE in GRAPH[name]}
    assert {"seqnorm.layers.plan", "seqnorm.layers.sequence", "seqnorm.layers.keys"} <= set(GRAPH[BASE])
    assert _cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c", "a"]]


@pytest.mark.parametrize("cls", LAYERS.values(), ids=lambda cls: cls.__name__)
def test_every_layer_is_what_its_helpers_read(cls: type) -> None:
    assert isinstance(cls(3, 4, num_layers=2, bidirectional=True), Layer)
