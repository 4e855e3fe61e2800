"""What the layer's helper modules share: :class:`Layer`, the structure and regularizers of a
:class:`~seqnorm.layers.base.RecurrentLayer` as they read it, and :class:`PaddingLayout`, where a batch's real rows
are.

``base.py`` imports the helpers (``arguments``, ``sequence``, ``compiled``, ``keys``, ``plan``, ...), which take the
layer as this Protocol instead of importing ``base.py`` back, so that ``seqnorm/layers/`` has no import circle
(``tests/test_layout.py``). This module imports nothing of the package.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import Tensor, nn

if TYPE_CHECKING:
    from seqnorm.cells.base import RecurrentCell

__all__ = ["Layer", "PaddingLayout"]


@runtime_checkable
class Layer(Protocol):
    """A multi-layer, optionally bidirectional recurrent layer as its helpers see it (torch.nn.LSTM's structural
    arguments, the regularizers, and the cells, layer-major: ``cells[layer * num_directions + direction]``)."""

    input_size: int
    hidden_size: int
    num_layers: int
    bias: bool
    batch_first: bool
    bidirectional: bool
    dropout: float
    """Between stacked layers, in training."""
    recurrent_dropout: float
    input_dropout: float
    weight_dropout: float
    impl: str
    """``"auto"``, ``"reference"``, ... (:data:`seqnorm.layers.sequence.IMPLS`)."""
    training: bool
    cells: nn.ModuleList
    """The :class:`~seqnorm.cells.base.RecurrentCell` of each layer and direction."""
    cell_class: type[RecurrentCell]

    @property
    def num_directions(self) -> int: ...

    @property
    def state_size(self) -> int:
        """Features of ``h``: ``proj_size`` if set, else ``hidden_size``."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]: ...

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]: ...


@dataclass(frozen=True)
class PaddingLayout:
    """Where the real positions of a ``(T, B)`` batch are.

    Attributes:
        steps: time steps that are run: ``max(lengths)``, since later steps are padding for every row.
        active: ``(steps, B)`` bool on the input's device, ``None`` when every row is real at every step.
        counts: real rows at each step (host ints, so no device sync per step).
        masks: per step, the ``(B,)`` row of ``active``, or ``None`` where every row is real (no mask needed).
        lengths: the lengths when some row is padded (for reversing), else ``None`` (a plain flip).
    """

    steps: int
    active: Tensor | None
    counts: list[int]
    masks: list[Tensor | None]
    lengths: Tensor | None
