"""Which of seqnorm's files one call enters, and how often the call moves between them: the route a reader follows.

Two calls are traced with ``sys.setprofile`` (Python-level calls and returns; C++ and torch's own code are not
counted), after a warm-up call so that caches and the built kernels are in place:

- ``layer``: ``seqnorm.LSTM(8, 16, norm="layer")(x, lengths)``, forward and backward;
- ``step``: one training step of ``seqnorm fit`` on the embedded character corpus (its third batch).

A *switch* is one move from a frame in one file to a frame in another. ``docs/architecture.md`` ("The route of one
call") gives what this prints.

    python scripts/trace_route.py            # both
    python scripts/trace_route.py layer      # the layer call only (a second)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import seqnorm

ROOT = Path(seqnorm.__file__).parent


@dataclass
class Route:
    """The seqnorm files a traced call entered and the switches between them."""

    files: set[str] = field(default_factory=set)
    switches: int = 0
    last: str | None = None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        name = frame.f_code.co_filename
        if not name.startswith(str(ROOT)):
            return
        file = Path(name).relative_to(ROOT).as_posix()
        self.files.add(file)
        if self.last is not None and file != self.last:
            self.switches += 1
        self.last = file

    def __str__(self) -> str:
        return f"{len(self.files)} files, {self.switches} switches: {', '.join(sorted(self.files))}"


def traced(call: Callable[[], Any]) -> Route:
    """The route of ``call()``."""
    route = Route()
    sys.setprofile(route)
    try:
        call()
    finally:
        sys.setprofile(None)
    return route


def layer_route() -> tuple[Route, str]:
    """The route of ``LSTM(8, 16, norm="layer")(x, lengths)`` forward and backward, and the plan's path."""
    torch.manual_seed(0)
    layer = seqnorm.LSTM(8, 16, norm="layer")
    x, lengths = torch.randn(5, 3, 8, requires_grad=True), torch.tensor([5, 3, 4])

    def call() -> None:
        layer(x, lengths=lengths)[0].sum().backward()

    call()  # warm: kernels loaded, caches made
    return traced(call), layer.plan(x, lengths=lengths).path


def step_route() -> Route:
    """The route of the third training step of a small ``seqnorm fit`` (the embedded character LM)."""
    from lightning.pytorch import Callback

    from seqnorm.cli import app, main

    route = Route()

    class Trace(Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
            if index == 2:
                sys.setprofile(route)

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, index: int) -> None:
            if index == 2:
                sys.setprofile(None)

    instantiate = app.SeqnormCLI.instantiate_trainer

    def with_trace(self: Any, **kwargs: Any) -> Any:
        trainer = instantiate(self, **kwargs)
        trainer.callbacks.append(Trace())
        return trainer

    app.SeqnormCLI.instantiate_trainer = with_trace  # type: ignore[method-assign]
    here = os.getcwd()
    try:
        with tempfile.TemporaryDirectory() as folder:
            os.chdir(folder)
            main(["fit", "--model", "LanguageModel", "--data", "TextCorpus", "--model.hidden_size", "16",
                  "--model.embedding_dim", "8", "--trainer.max_steps", "4", "--trainer.limit_val_batches", "1",
                  "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"])  # fmt: skip
    finally:
        os.chdir(here)
        app.SeqnormCLI.instantiate_trainer = instantiate  # type: ignore[method-assign]
    return route


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("calls", nargs="*", metavar="layer|step", help="which calls to trace (default: both)")
    calls = parser.parse_args(argv).calls or ["layer", "step"]
    if unknown := [call for call in calls if call not in ("layer", "step")]:
        parser.error(f"expected layer or step, got {' '.join(unknown)}")
    if "layer" in calls:
        route, path = layer_route()
        print(f'LSTM(8, 16, norm="layer")(x, lengths), path {path!r}: {route}')
    if "step" in calls:
        print(f"one training step of seqnorm fit: {step_route()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
