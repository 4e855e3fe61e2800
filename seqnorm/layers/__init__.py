"""The time loop: multi-layer, bidirectional :class:`LSTM` and :class:`GRU` over padded or packed sequences."""

from seqnorm.layers.base import RecurrentLayer, RecurrentState, reverse_padded
from seqnorm.layers.gru import GRU
from seqnorm.layers.lstm import LSTM

__all__ = ["GRU", "LSTM", "RecurrentLayer", "RecurrentState", "reverse_padded"]
