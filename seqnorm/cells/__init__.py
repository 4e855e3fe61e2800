"""One time step of a normalized recurrent network: :class:`LSTMCell` and :class:`GRUCell`."""

from seqnorm.cells.base import RecurrentCell
from seqnorm.cells.gru import GRUCell
from seqnorm.cells.lstm import LSTMCell

__all__ = ["GRUCell", "LSTMCell", "RecurrentCell"]
