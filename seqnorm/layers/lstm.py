"""Multi-layer normalized LSTM, a drop-in for ``torch.nn.LSTM``."""

from __future__ import annotations

from torch import nn

from seqnorm.cells.lstm import LSTMCell
from seqnorm.layers.base import RecurrentLayer

__all__ = ["LSTM"]


class LSTM(RecurrentLayer):
    r"""A multi-layer LSTM whose cells are :class:`~seqnorm.LSTMCell` with ``norm=`` applied in every layer.

    Same signature, shapes, return values and state-dict keys as ``torch.nn.LSTM`` (``weight_ih_l0``,
    ``bias_hh_l1_reverse``, ...); with ``norm="none"`` the outputs match it. Beyond torch: ``lengths``,
    per-timestep statistics, recurrent dropout and :meth:`step`.

    Args:
        input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional: as ``torch.nn.LSTM``.
        recurrent_dropout: variational dropout rate on ``h`` where it enters the recurrent term (one mask per
            sequence and layer, the same at every step; Gal & Ghahramani 2016). Default: 0.
        norm, max_steps, init, forget_bias, eps, momentum, small_batch, norm_options, device, dtype: as
            :class:`~seqnorm.LSTMCell`, for every cell.
        impl: ``"auto"`` (default): the fastest path with the reference's results (torch's fused kernel when
            nothing is normalized, else hoisted input terms and a lean loop; see :mod:`seqnorm.layers.fast`);
            ``"reference"``: the plain per-step loop. Observers hooked to a cell always get the reference loop.

    Inputs: ``input, hx=None, lengths=None``
        - **input** ``(L, N, H_in)`` (``(N, L, H_in)`` with ``batch_first``), ``(L, H_in)`` unbatched, or a
          ``PackedSequence``.
        - **hx** ``(h_0, c_0)``, each ``(D * num_layers, N, H)``; zeros when ``None``.
        - **lengths** ``(N,)`` integers in ``[1, L]``: positions at or beyond a sequence's length are padding.

    Outputs: ``output, (h_n, c_n)``
        - **output** ``(L, N, D * H)`` (``batch_first``: ``(N, L, D * H)``), zero at padded positions; a
          ``PackedSequence`` for a packed input.
        - **h_n**, **c_n** ``(D * num_layers, N, H)``: each sequence's state at its last real step.

    Legend: ``N`` batch, ``L`` sequence length, ``D`` 2 if bidirectional else 1, ``H`` hidden_size.

    Attributes:
        cells: the :class:`~seqnorm.LSTMCell` of every layer and direction, layer-major (``cells[2 * l + d]``).

    Example::

        >>> lstm = seqnorm.LSTM(10, 20, num_layers=2, norm="layer", batch_first=True)
        >>> x = torch.randn(3, 7, 10)
        >>> output, (h_n, c_n) = lstm(x, lengths=torch.tensor([7, 5, 2]))
        >>> output.shape, h_n.shape
        (torch.Size([3, 7, 20]), torch.Size([2, 3, 20]))
    """

    cell_class = LSTMCell

    @classmethod
    def from_torch(cls, module: nn.LSTM, **kwargs: object) -> LSTM:
        """An equivalent ``norm="none"`` layer with ``module``'s weights (extra keyword arguments pass through)."""
        return cls._from_torch(module, nn.LSTM, **kwargs)  # type: ignore[return-value]
