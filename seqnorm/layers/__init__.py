"""The time loop: multi-layer, bidirectional :class:`LSTM` and :class:`GRU` over padded or packed sequences."""

from seqnorm.layers.base import RecurrentLayer, RecurrentState
from seqnorm.layers.gru import GRU
from seqnorm.layers.lstm import LSTM
from seqnorm.layers.sequence import reverse_padded

__all__ = ["GRU", "LAYERS", "LSTM", "RecurrentLayer", "RecurrentState", "reverse_padded"]

# The layer of each entry of seqnorm.CELLS, by the same name.
LAYERS: dict[str, type[RecurrentLayer]] = {"lstm": LSTM, "gru": GRU}
