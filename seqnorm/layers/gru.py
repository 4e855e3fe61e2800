"""Multi-layer normalized GRU, a drop-in for ``torch.nn.GRU``."""

from __future__ import annotations

from torch import nn

from seqnorm.cells.gru import GRUCell
from seqnorm.layers.base import RecurrentLayer

__all__ = ["GRU"]


class GRU(RecurrentLayer):
    r"""A multi-layer GRU whose cells are :class:`~seqnorm.GRUCell` with ``norm=`` applied in every layer.

    Same signature, shapes, return values and state-dict keys as ``torch.nn.GRU``; with ``norm="none"`` the outputs
    match it. Arguments, ``lengths`` and :meth:`step` as :class:`~seqnorm.LSTM`, except that the state is a single
    tensor ``h`` of shape ``(D * num_layers, N, H)`` and there is no ``forget_bias`` (nor ``zoneout_c``: a GRU
    has no cell state).

    Example::

        >>> gru = seqnorm.GRU(10, 20, norm="rms", bidirectional=True)
        >>> output, h_n = gru(torch.randn(7, 3, 10), lengths=[7, 4, 1])
        >>> output.shape, h_n.shape
        (torch.Size([7, 3, 40]), torch.Size([2, 3, 20]))
    """

    cell_class = GRUCell

    @classmethod
    def from_torch(cls, module: nn.GRU, **kwargs: object) -> GRU:
        """A layer with ``module``'s weights: equivalent with the default ``norm="none"``; with another ``norm=``
        (and any other keyword of the constructor), the norms start from their initial values."""
        return cls._from_torch(module, nn.GRU, **kwargs)  # type: ignore[return-value]
