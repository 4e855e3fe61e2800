"""Shared fixtures and helpers for the seqnorm test suite."""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import seqnorm
from seqnorm.layers.plan import declared
from seqnorm.norms.specs import field_names
from tests import frame_stack

NORMS = list(seqnorm.NORMS)
BATCH_NORMS = [name for name, scheme in seqnorm.NORMS.items() if scheme.batch_statistics]
ROW_NORMS = [name for name in NORMS if name not in BATCH_NORMS]
# Cells and layers come from the registries: a new entry gets the contract, path and parity tests unedited.
CELLS = seqnorm.CELLS
LAYERS = seqnorm.LAYERS
KINDS = list(CELLS)
# The cells that declare torch's step: parity with torch.nn, torch's kernel, the compiled kernels, the lean step.
TORCH_KINDS = [kind for kind, cell in CELLS.items() if declared(cell, "torch_kernel", None)]

# Triton reads TRITON_INTERPRET when it is first imported (its own language functions are decorated then), and other
# parts of the suite may import it (torch's compiler, onnx export): set before anything does, so that the Triton
# backend's tests can run its kernels on CPU tensors through the interpreter (tests/kernels/test_triton_backend.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The Triton interpreter's kernels are deep Python calls; on CPython before 3.15 their time depended on where the
# frame stack's chunk boundaries fell under them (tests/frame_stack.py): a cache of those chunks makes it steady.
frame_stack.install()

# The suite's models are tiny: a second intra-op thread only adds synchronization, and on a busy 2-core machine a
# descheduled OpenMP worker stalls every small op for milliseconds. One thread keeps `make test` fast and steady.
torch.set_num_threads(1)


@pytest.fixture
def one_route() -> Iterator[None]:
    """Deterministic algorithms for the test: the kernels then use one fixed matmul route and weight layout, where
    the first calls of a shape otherwise time the candidates (csrc/product.h), which round differently: calls
    compared bit for bit must not depend on which of them a trial happened to run."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(deterministic)


def require_kernels() -> None:
    """Skip when this machine cannot build the compiled kernels (no C++ compiler); fail when it can and they did not
    load (``make venv`` builds them, or else the first layer does: a test run must not silently fall back to the
    plain paths)."""
    if seqnorm.kernels.native("cpu") is not None:
        return
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the compiled kernels cannot be built here")
    pytest.fail(f"the compiled kernels are not loaded: {seqnorm.kernels.status()}")


@pytest.fixture
def built_library() -> Path:
    """This machine's real build of the kernels, which a stubbed compile hands out
    (tests/kernels/test_kernel_build.py)."""
    require_kernels()
    return Path(seqnorm.kernels.native("cpu").__file__)  # type: ignore[union-attr]


def running_fallback(norm: str) -> str | seqnorm.norms.NormSpec:
    """``norm=`` for ``norm`` with ``small_batch="running"`` where it has batch statistics; other norms as they are
    (they refuse an option they lack)."""
    scheme = seqnorm.NORMS[norm]
    return scheme.spec(small_batch="running") if scheme.batch_statistics else norm  # type: ignore[call-arg]


def with_spec(norm: str, **kwargs: Any) -> dict[str, Any]:
    """A case's keyword arguments for a cell or layer: those that are fields of norm ``norm``'s spec (and the entries
    of ``norm_options``) go into ``norm=`` as its spec; ``max_steps`` stays beside it."""
    spec = seqnorm.NORMS[norm].spec
    fields = set(field_names(spec)) - {"max_steps"}
    options = {key: kwargs.pop(key) for key in list(kwargs) if key in fields}
    options.update(kwargs.pop("norm_options", None) or {})
    return {"norm": spec(**options) if options else norm, **kwargs}


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def perturb_norm_parameters(module: torch.nn.Module) -> None:
    """Move every norm gain/shift and running statistic away from its initial value, so tests can see them."""
    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            if "norm_" in name and tensor.is_floating_point():
                tensor.add_(torch.rand_like(tensor) * 0.5)


# ---- shared by the CLI tests (test_cli, test_crash_safety, test_resume, test_checkpoint_safety) ----------------------
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
WORDS = ["the", "cat", "dog", "sat", "ran", "on", "under", "a", "mat", "log", "big", "small", "red", "blue"]


def write_story(path: Path, *, lines: int = 600, words: list[str] = WORDS, seed: int = 0) -> Path:
    """A small text file of random sentences (one per line) over ``words``, the same for the same arguments."""
    rng = random.Random(seed)
    text = (" ".join(rng.choice(words) for _ in range(rng.randint(2, 8))) for _ in range(lines))
    path.write_text("\n".join(text) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def story(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``story.txt`` (:func:`write_story`) in a fresh working directory."""
    monkeypatch.chdir(tmp_path)
    return write_story(tmp_path / "story.txt")


SMALL_LM = [
    "--model", "LanguageModel", "--data", "TextCorpus", "--model.hidden_size", "16", "--model.embedding_dim", "8",
]  # fmt: skip
"""A small character LM on the embedded task: the CLI tests' model flags."""


def cli_usage_error(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    """The ``seqnorm`` command's standard error for ``args``, run in-process: a usage error (exit code 2), no
    traceback."""
    from seqnorm.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        main(args)
    error = capsys.readouterr().err
    assert stopped.value.code == 2, error
    assert "Traceback" not in error
    return error


HOISTED = ("loop", "kernel", "triton")
"""The plan's paths over hoisted input terms: the loop, or the device's kernels where they are built."""


def run_path(version: int = 0, root: Path | str = ".") -> Path:
    """``<root>/lightning_logs/<run name>/version_<version>``, the run of that number (the test's runs share a name)."""
    runs = sorted(Path(root).glob(f"lightning_logs/*/version_{version}"))
    assert len(runs) == 1, f"expected one run version_{version} under {root}/lightning_logs, found {runs}"
    return runs[0]


def evaluation_path(command: str, number: int = 0, root: Path | str = ".") -> Path:
    """``<run>/<command>_<number>``: the ``number``-th ``validate``/``test``/``predict`` of the checkpoint of
    ``run_path(0, root)``, which writes beside its training run, inside its folder."""
    return run_path(0, root) / f"{command}_{number}"


def last_checkpoint(root: Path | str = ".") -> Path:
    """``last.ckpt`` of ``run_path(0, root)``."""
    return run_path(0, root) / "checkpoints" / "last.ckpt"


def logged_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar a TensorBoard run directory holds: tag -> [(step, value), ...] in the order written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


# `make test-fast` (the inner loop) leaves these modules out: each runs processes (DDP groups, the `seqnorm` command,
# SIGKILL loops, fresh installs), trains end to end, exports, or runs Triton's interpreter, and together they are
# about three quarters of the suite's time. `make test` (and CI) runs everything.
SLOW_MODULES = {
    "test_triton_backend", "test_resume", "test_ddp", "test_crash_safety", "test_export", "test_cli_usability",
    "test_cli", "test_checkpoint_safety", "test_examples", "test_sync_batchnorm", "test_cli_evaluate",
    "test_placement", "test_kernel_cache", "test_cli_conventions", "test_configs", "test_kernel_build",
    "test_cli_checkpoints", "test_run_names", "test_packaging", "test_kernel_threads", "test_mixed_precision",
}  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: left out by `make test-fast` (tests/conftest.py: SLOW_MODULES)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.stem in SLOW_MODULES or item.path.parent.name == "scripts":
            item.add_marker(pytest.mark.slow)
