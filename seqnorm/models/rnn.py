"""Building the recurrent layer of a task model from plain, config-friendly arguments."""

from __future__ import annotations

import inspect
from typing import Any, Literal

from seqnorm.layers import LAYERS, RecurrentLayer

__all__ = ["CellName", "build_rnn"]

CellName = Literal["lstm", "gru"]
_LAYERS: dict[str, type[RecurrentLayer]] = LAYERS


def build_rnn(cell: str, input_size: int, hidden_size: int, **kwargs: Any) -> RecurrentLayer:
    """A batch-first :class:`~seqnorm.LSTM` or :class:`~seqnorm.GRU`; ``kwargs`` go to the layer."""
    if cell not in _LAYERS:
        raise ValueError(f"build_rnn: expected cell to be one of {', '.join(map(repr, _LAYERS))}, got {cell!r}")
    layer = _LAYERS[cell]
    accepted = set(inspect.signature(layer.__init__).parameters) - {"self", "input_size", "hidden_size", "batch_first"}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ValueError(
            f"build_rnn: expected keyword arguments of seqnorm.{layer.__name__} ({', '.join(sorted(accepted))}), "
            f"got {', '.join(unknown)}"
        )
    return layer(input_size, hidden_size, batch_first=True, **kwargs)
