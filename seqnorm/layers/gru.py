"""Multi-layer normalized GRU, a drop-in for ``torch.nn.GRU``."""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from seqnorm.cells.gru import GRUCell
from seqnorm.layers.base import RecurrentLayer
from seqnorm.layers.keys import from_torch

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

    def forward(
        self,
        input: Tensor | PackedSequence,
        hx: Tensor | None = None,
        lengths: Tensor | list[int] | None = None,
        *,
        first_step: int = 0,
    ) -> tuple[Tensor | PackedSequence, Tensor]:
        """Run every layer and direction over a whole sequence; returns what ``torch.nn.GRU`` returns.

        Args:
            input: ``(L, N, H_in)`` (``(N, L, H_in)`` with ``batch_first``), ``(L, H_in)`` unbatched, or a
                ``PackedSequence``.
            hx: ``h_0`` ``(D * num_layers, N, H)`` (no ``N`` dimension for an unbatched input); ``None``: zeros.
            lengths: ``(N,)`` integers in ``[1, L]``: positions ``t >= lengths[n]`` are padding (they output zeros,
                enter no batch statistics, and ``h_n`` is each sequence's state at its last real step). Not with a
                ``PackedSequence``, which carries its own.
            first_step: the time index of the input's first step, as per-timestep norms see it: with ``hx`` the
                final state of the previous chunk, ``gru(chunk, hx, first_step=k)`` continues a sequence cut into
                chunks (stateful truncated BPTT). Unidirectional layers only.

        Returns:
            ``(output, h_n)``: ``output`` ``(L, N, D * H)`` (``(N, L, D * H)`` with ``batch_first``), zero at
            padded positions, or a ``PackedSequence`` for a packed input; ``h_n`` ``(D * num_layers, N, H)``. ``D``
            is 2 if bidirectional else 1, ``H`` ``hidden_size``.

        Raises:
            ValueError: an input, state or ``lengths`` of the wrong shape, dtype or device, or ``first_step`` not
                an int ``>= 0`` (or not 0 with ``bidirectional``); a batch norm in training with fewer than 2
                real rows.
        """
        return super().forward(input, hx, lengths, first_step=first_step)  # type: ignore[return-value]

    @classmethod
    def from_torch(cls, module: nn.GRU, **kwargs: object) -> GRU:
        """A layer with ``module``'s weights: equivalent with the default ``norm="none"``; with another ``norm=``
        (and any other keyword of the constructor), the norms start from their initial values."""
        return from_torch(cls, module, nn.GRU, **kwargs)  # type: ignore[return-value]
