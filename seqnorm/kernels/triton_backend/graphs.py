"""The Triton backend's time loops as CUDA graphs: one capture per loop and shape, replayed afterwards.

A loop here is a function of tensors only (:mod:`.rows`: ``lstm_forward_loop`` and the rest, and the generation
step's ``lstm_generation_loop``/``gru_generation_loop``; :mod:`.column_layout`'s for per-timestep BatchNorm): it
allocates its outputs, runs its launches (two a time step) and returns its outputs; its other arguments are
compile-time settings (flags, ``eps``), which are part of the key. A loop may also update inputs in place
(BatchNorm's running statistics): the caller names them, and after a replay they are copied back from the graph's
static inputs. :meth:`LoopGraphs.run` of :data:`GRAPHS` calls it (:func:`run` is the same):

- the first :data:`WARMUPS` calls of a key run it eagerly (the warm-up: Triton compiles its kernels, cuBLAS makes its
  handles; and a shape seen once, a batch's rare longest length, is not worth a graph);
- the next captures it into a graph over *static* inputs (copies of the call's tensors, made outside the capture)
  and checks the graph once: its replay must give what the eager loop gives for the same inputs, else the key runs
  eagerly from then on, with one warning;
- every later call copies its tensors into the static inputs, replays the graph and returns *copies* of the static
  outputs. The copies are what make two forwards before one backward, or two layers and directions of one shape,
  correct: the next replay overwrites the static outputs, never what an earlier call returned.

A capture that fails (an operation a graph cannot hold) warns once and leaves that key eager. Graphs are kept for at
most :data:`MAX_GRAPHS` keys, least recently used first out (varying ``max(lengths)`` makes a key per length).
``SEQNORM_CUDA_GRAPHS=0`` turns them off. Only CUDA tensors are graphed; the interpreter's CPU tensors run eagerly
(the tests put a stand-in graph in their place).

The autocast state, TF32 and deterministic settings join the key: cuBLAS picks its kernels under them at capture.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = ["ENV", "MAX_GRAPHS", "WARMUPS", "LoopGraphs", "run"]

ENV = "SEQNORM_CUDA_GRAPHS"
"""``0`` turns the loops' CUDA graphs off (anything else, or unset: on)."""

MAX_GRAPHS = 8
"""Graphs kept at once; each holds its loop's outputs for one shape (its activations) in its own memory pool."""

WARMUPS = 2
"""Eager calls of a key before its capture."""

Loop = Callable[..., tuple[Tensor, ...]]
Inputs = Sequence[Tensor | None]


class Graph(Protocol):
    """A captured loop: ``outputs`` (static), refreshed in place by :meth:`replay` from the static inputs."""

    outputs: tuple[Tensor, ...]

    def replay(self) -> None: ...


def _cuda_graph(loop: Loop, inputs: Inputs, settings: dict[str, Any]) -> Graph:
    """Capture ``loop`` on the static ``inputs`` into a CUDA graph (after a warm-up on the capture's stream)."""

    class Captured:
        def __init__(self) -> None:
            self.graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                loop(*inputs, **settings)  # lazy initialization on the capture's stream, outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(self.graph, stream=stream):
                self.outputs = loop(*inputs, **settings)

        def replay(self) -> None:
            self.graph.replay()

    return Captured()


@dataclass
class _Entry:
    graph: Graph
    inputs: list[Tensor | None]  # the static inputs the graph reads


def _static(tensor: Tensor | None) -> Tensor | None:
    """A static input buffer like ``tensor`` (its strides kept), holding its values."""
    if tensor is None:
        return None
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device).copy_(tensor)


def _dense(tensor: Tensor) -> bool:
    """Every element in memory once and no gaps: contiguous once its dimensions are ordered by stride."""
    order = sorted(range(tensor.dim()), key=lambda dim: -tensor.stride(dim))
    return tensor.permute(order).is_contiguous()


def _describe(tensor: Tensor | None) -> tuple[Any, ...] | None:
    return None if tensor is None else (tuple(tensor.shape), tensor.stride(), tensor.dtype, str(tensor.device))


class LoopGraphs:
    """The graphs of the loops, by key (:func:`run`'s module docstring).

    Args:
        capture: makes a graph of a loop on static inputs (a stand-in in the tests).
        devices: the device types whose tensors are graphed.
        limit: graphs kept at once (least recently used out first).
    """

    def __init__(
        self,
        capture: Callable[[Loop, Inputs, dict[str, Any]], Graph] = _cuda_graph,
        devices: tuple[str, ...] = ("cuda",),
        limit: int = MAX_GRAPHS,
    ) -> None:
        self.capture, self.devices, self.limit = capture, devices, limit
        self._graphs: OrderedDict[tuple[Any, ...], _Entry] = OrderedDict()
        self._calls: Counter[tuple[Any, ...]] = Counter()  # eager calls of each key so far
        self._eager: set[tuple[Any, ...]] = set()  # keys whose capture failed or whose graph disagreed: eager for good

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()
        self._calls.clear()
        self._eager.clear()

    def _key(self, name: str, inputs: Inputs, settings: dict[str, Any]) -> tuple[Any, ...]:
        device = next(tensor.device for tensor in inputs if tensor is not None)
        flags = (
            torch.is_autocast_enabled(device.type),
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.are_deterministic_algorithms_enabled(),
        )
        return (name, tuple(_describe(tensor) for tensor in inputs), tuple(sorted(settings.items())), flags)

    def wanted(self, inputs: Inputs) -> bool:
        """Whether this call may be graphed: the switch is on, its tensors are on a graphed device type, and each is
        dense without overlaps (contiguous up to a permutation, as a transposed weight is): a static copy with its
        strides then stands for it, where an expanded tensor's could not be written."""
        if os.environ.get(ENV, "1") == "0":
            return False
        tensors = [tensor for tensor in inputs if tensor is not None]
        return (
            bool(tensors)
            and tensors[0].device.type in self.devices
            and all(_dense(tensor) for tensor in tensors)
            and not torch.compiler.is_compiling()
        )

    def run(
        self, name: str, loop: Loop, inputs: Inputs, *, updated: Sequence[int] = (), **settings: Any
    ) -> tuple[Tensor, ...]:
        """``loop(*inputs, **settings)``, through its graph where there is one (module docstring). ``updated``: the
        indices of the inputs the loop updates in place (BatchNorm's running statistics), copied back from the
        graph's static inputs after a replay."""
        if not self.wanted(inputs):
            return loop(*inputs, **settings)
        key = self._key(name, inputs, settings)
        entry = self._graphs.get(key)
        if entry is None:
            if key in self._eager:
                return loop(*inputs, **settings)
            if self._calls[key] < WARMUPS:
                self._calls[key] += 1
                return loop(*inputs, **settings)
            return self._first_replay(key, name, loop, inputs, settings, updated)
        self._graphs.move_to_end(key)
        for static, tensor in zip(entry.inputs, inputs, strict=True):
            if static is not None:
                static.copy_(tensor)
        entry.graph.replay()
        for index in updated:
            inputs[index].copy_(entry.inputs[index])  # type: ignore[union-attr, arg-type]
        return tuple(output.clone() for output in entry.graph.outputs)

    def _first_replay(
        self, key: tuple[Any, ...], name: str, loop: Loop, inputs: Inputs, settings: dict[str, Any],
        updated: Sequence[int],
    ) -> tuple[Tensor, ...]:  # fmt: skip
        """Capture, replay once, and keep the graph only if it gives what the eager loop gives (its outputs, and the
        inputs it updates in place)."""
        static = [_static(tensor) for tensor in inputs]
        before = {index: _static(inputs[index]) for index in updated}  # as the eager call will not leave them
        eager = loop(*inputs, **settings)
        try:
            graph = self.capture(loop, static, settings)
            for index, (buffer, tensor) in enumerate(zip(static, inputs, strict=True)):
                if buffer is not None:
                    buffer.copy_(before.get(index, tensor))  # type: ignore[arg-type]
            graph.replay()
            replayed = tuple(output.clone() for output in graph.outputs)
            replayed += tuple(static[index] for index in updated)  # type: ignore[misc]
            eager_now = (*eager, *(inputs[index] for index in updated))
        except Exception as error:
            self._eager.add(key)
            warnings.warn(
                f"seqnorm: the Triton backend's {name} loop runs without a CUDA graph for this shape: capturing it "
                f"failed ({type(error).__name__}: {str(error)[:200]}); {ENV}=0 turns graphs off",
                RuntimeWarning,
                stacklevel=3,
            )
            return eager
        agree = len(replayed) == len(eager_now) and all(
            a.shape == b.shape and torch.allclose(a, b, rtol=1e-3, atol=1e-4, equal_nan=True)
            for a, b in zip(replayed, eager_now, strict=False)  # type: ignore[arg-type]
        )
        if not agree:
            self._eager.add(key)
            warnings.warn(
                f"seqnorm: the Triton backend's {name} loop runs without a CUDA graph for this shape: its graph's "
                "replay differed from the eager loop",
                RuntimeWarning,
                stacklevel=3,
            )
            return eager
        self._graphs[key] = _Entry(graph, static)
        while len(self._graphs) > self.limit:
            self._graphs.popitem(last=False)  # the least recently used
        return eager


GRAPHS = LoopGraphs()
"""The process's graphs (the backend's loops run through it)."""


def run(name: str, loop: Loop, inputs: Inputs, *, updated: Sequence[int] = (), **settings: Any) -> tuple[Tensor, ...]:
    """:meth:`LoopGraphs.run` of :data:`GRAPHS`."""
    return GRAPHS.run(name, loop, inputs, updated=updated, **settings)
