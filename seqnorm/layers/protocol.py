"""What the layer's helper modules read of a layer: :class:`Layer`, the structure and regularizers of a
:class:`~seqnorm.layers.base.RecurrentLayer`.

``base.py`` imports the helpers (``arguments``, ``dropout``, ``fast``, ``keys``, ``plan``, ``stack``, ...), which
take the layer as this Protocol instead of importing ``base.py`` back, so that ``seqnorm/layers/`` has no import
circle (``tests/test_layout.py``). This module imports nothing of the package.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import Tensor, nn

if TYPE_CHECKING:
    from seqnorm.cells.base import RecurrentCell

__all__ = ["Layer"]


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
    """``"auto"``, ``"reference"``, ... (:data:`seqnorm.layers.fast.IMPLS`)."""
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
