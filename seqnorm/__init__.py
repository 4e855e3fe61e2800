"""seqnorm: normalized recurrent networks for PyTorch.

``LSTMCell``/``GRUCell`` do one step with ``norm=`` none | layer | rms | weight | batch | batch_renorm;
``LSTM``/``GRU`` are drop-ins for ``torch.nn.LSTM``/``GRU`` with the same norms, ``lengths`` and a stepping interface.
"""

from seqnorm import kernels
from seqnorm.cells import CELLS, GRUCell, LSTMCell
from seqnorm.init import INITS
from seqnorm.layers import GRU, LAYERS, LSTM, RecurrentState
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
    "LSTMCell",
    "RecurrentState",
    "convert_sync_batchnorm",
    "kernels",
    "update_bn",
]
__version__ = "0.1.0"
