"""Building the recurrent layer of a task model from plain, config-friendly arguments."""

from __future__ import annotations

import inspect
from typing import Any, Literal

from torch import nn

from seqnorm.layers import LAYERS, RecurrentLayer
from seqnorm.norms import REMOVED_KEYWORDS

__all__ = ["CellName", "build_rnn", "embedded_rnn"]

CellName = Literal["lstm", "gru"]
_LAYERS: dict[str, type[RecurrentLayer]] = LAYERS


def build_rnn(cell: str, input_size: int, hidden_size: int, **kwargs: Any) -> RecurrentLayer:
    """A batch-first :class:`~seqnorm.LSTM` or :class:`~seqnorm.GRU`; ``kwargs`` go to the layer (``dropout`` only
    with more than one layer: it acts between them)."""
    if cell not in _LAYERS:
        raise ValueError(f"build_rnn: expected cell to be one of {', '.join(map(repr, _LAYERS))}, got {cell!r}")
    layer = _LAYERS[cell]
    accepted = set(inspect.signature(layer.__init__).parameters) - {"self", "input_size", "hidden_size", "batch_first"}
    unknown = sorted(set(kwargs) - accepted - REMOVED_KEYWORDS)  # those: the layer names the spec field to set
    if unknown:
        raise ValueError(
            f"build_rnn: expected keyword arguments of seqnorm.{layer.__name__} ({', '.join(sorted(accepted))}), "
            f"got {', '.join(unknown)}"
        )
    if kwargs.get("num_layers", 1) == 1 and "dropout" in kwargs:
        # The layer's dropout sits between stacked layers; a task model's own dropout (embedding, output) covers
        # one layer, and passing it on would make the layer warn that it does nothing.
        kwargs["dropout"] = 0.0
    return layer(input_size, hidden_size, batch_first=True, **kwargs)


def embedded_rnn(
    vocab_size: int, embedding_dim: int, pad_index: int, cell: str, hidden_size: int, **kwargs: Any
) -> tuple[nn.Embedding, RecurrentLayer]:
    """What both task models start with: the token embedding (``pad_index`` embeds to zeros) and the batch-first
    RNN over it (:func:`build_rnn`; ``kwargs`` go to the layer)."""
    embedding = nn.Embedding(vocab_size, embedding_dim, padding_idx=pad_index)
    return embedding, build_rnn(cell, embedding_dim, hidden_size, **kwargs)
