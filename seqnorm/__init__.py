"""seqnorm: normalized recurrent networks for PyTorch.

``LSTMCell``/``GRUCell`` do one step with ``norm=`` none | layer | rms | weight | batch | batch_renorm;
``LSTM``/``GRU`` are drop-ins for ``torch.nn.LSTM``/``GRU`` with the same norms, ``lengths`` and a stepping interface.
A new cell subclasses ``RecurrentCell`` (its parameters and step), and ``RecurrentLayer`` with ``cell_class`` runs it.
"""

from seqnorm import kernels
from seqnorm.cells import CELLS, GatedCell, GRUCell, LSTMCell, RecurrentCell
from seqnorm.init import INITS
from seqnorm.layers import GRU, LAYERS, LSTM, RecurrentLayer, RecurrentState
from seqnorm.norms import NORMS
from seqnorm.norms.population import update_bn
from seqnorm.norms.sync import convert_sync_batchnorm

__all__ = [
    "CELLS",
    "GRU",
    "INITS",
    "LAYERS",
    "LSTM",
    "NORMS",
    "GRUCell",
    "GatedCell",
    "LSTMCell",
    "RecurrentCell",
    "RecurrentLayer",
    "RecurrentState",
    "convert_sync_batchnorm",
    "kernels",
    "update_bn",
]
__version__ = "0.1.0"
