"""One time step of a normalized recurrent network: :class:`LSTMCell` and :class:`GRUCell`.

Every cell is a :class:`RecurrentCell` (the step contract, state checks, zoneout, padding, observers); the LSTM and
GRU are :class:`GatedCell` s, whose gates are dense ``W_ih x`` and ``W_hh h`` in torch's layout. A new cell subclasses
:class:`RecurrentCell` and defines its own parameters and step (``tests/cells/test_custom_cell.py`` has an IndRNN).
"""

from seqnorm.cells.base import RecurrentCell
from seqnorm.cells.gated import GatedCell
from seqnorm.cells.gru import GRUCell
from seqnorm.cells.lstm import LSTMCell

__all__ = ["CELLS", "GRUCell", "GatedCell", "LSTMCell", "RecurrentCell"]

# The cells by the names configs and the CLI use (`cell: lstm`); tests iterate it, so a new cell is tested too.
CELLS: dict[str, type[RecurrentCell]] = {"lstm": LSTMCell, "gru": GRUCell}
