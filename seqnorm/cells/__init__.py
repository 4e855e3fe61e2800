"""One time step of a normalized recurrent network: :class:`LSTMCell` and :class:`GRUCell`."""

from seqnorm.cells.base import RecurrentCell
from seqnorm.cells.gru import GRUCell
from seqnorm.cells.lstm import LSTMCell

__all__ = ["CELLS", "GRUCell", "LSTMCell", "RecurrentCell"]

# The cells by the names configs and the CLI use (`cell: lstm`); tests iterate it, so a new cell is tested too.
CELLS: dict[str, type[RecurrentCell]] = {"lstm": LSTMCell, "gru": GRUCell}
