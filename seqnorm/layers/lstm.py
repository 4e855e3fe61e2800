"""Multi-layer normalized LSTM, a drop-in for ``torch.nn.LSTM``."""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from seqnorm.cells.lstm import LSTMCell
from seqnorm.layers.base import RecurrentLayer
from seqnorm.layers.keys import from_torch

__all__ = ["LSTM"]


class LSTM(RecurrentLayer):
    r"""A multi-layer LSTM whose cells are :class:`~seqnorm.LSTMCell` with ``norm=`` applied in every layer.

    Same signature, shapes, return values and state-dict keys as ``torch.nn.LSTM`` (``weight_ih_l0``,
    ``bias_hh_l1_reverse``, ...); with ``norm="none"`` the outputs match it. Beyond torch: ``lengths``,
    per-timestep statistics, variational input/recurrent dropout, DropConnect, zoneout and :meth:`step`.

    Args:
        input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional: as ``torch.nn.LSTM``.
        recurrent_dropout: variational dropout rate on ``h`` where it enters the recurrent term (one mask per
            sequence, layer and direction, the same at every step; Gal & Ghahramani 2016). Default: 0.
        input_dropout: variational dropout rate on every layer's input ``x_t`` (one mask per sequence, layer and
            direction, the same at every step; Gal & Ghahramani 2016). Default: 0.
        weight_dropout: DropConnect rate on ``W_hh`` (Merity et al. 2018: one mask on the weights per call, layer
            and direction, not per step). Default: 0.
        proj_size: as ``torch.nn.LSTM``: ``h = W_hr (o * tanh(N_c(c)))`` with ``weight_hr_l{k}``
            ``(proj_size, hidden_size)``; ``h`` and each direction's output then have ``proj_size`` features. In
            ``[1, hidden_size)``; 0 (default): no projection.
        zoneout_h, zoneout_c: zoneout rates of ``h`` and ``c`` (Krueger et al. 2016), fresh masks at every step; see
            :class:`~seqnorm.LSTMCell`. Default: 0.

        All regularizers draw from torch's random generator (``torch.manual_seed`` reproduces them), act in
        training only and leave evaluation exactly as with rates of 0; see :mod:`seqnorm.layers.sequence`. Rates
        outside ``[0, 1)`` are a ``ValueError``. ``dropout`` is torch's (between layers, a fresh mask per element).
        norm, max_steps, init, forget_bias, device, dtype: as :class:`~seqnorm.LSTMCell`, for every cell (a
            norm's options are fields of its spec: ``norm=BatchNormSpec(momentum=0.05)``).
        impl: ``"auto"`` (default): the fastest path with the reference's results (torch's fused kernel when
            nothing is normalized, else the compiled kernels or hoisted input terms and a lean loop; see
            :mod:`seqnorm.layers.plan`); ``"reference"``: the plain per-step loop; or a path pinned by the plan's own
            name, ``"loop"``, ``"kernel"`` (``"triton"`` on CUDA) or ``"torch_kernel"``, for a whole sequence (a
            call that path cannot run is a ``ValueError`` saying why). Observers hooked to a cell always get the
            reference loop.

    Inputs: ``input, hx=None, lengths=None``
        - **input** ``(L, N, H_in)`` (``(N, L, H_in)`` with ``batch_first``), ``(L, H_in)`` unbatched, or a
          ``PackedSequence``.
        - **hx** ``(h_0, c_0)``: ``h_0`` ``(D * num_layers, N, H_out)``, ``c_0`` ``(D * num_layers, N, H)``;
          zeros when ``None``.
        - **lengths** ``(N,)`` integers in ``[1, L]``: positions at or beyond a sequence's length are padding.

    Outputs: ``output, (h_n, c_n)``
        - **output** ``(L, N, D * H_out)`` (``batch_first``: ``(N, L, D * H_out)``), zero at padded positions; a
          ``PackedSequence`` for a packed input.
        - **h_n** ``(D * num_layers, N, H_out)``, **c_n** ``(D * num_layers, N, H)``: each sequence's state at its
          last real step.

    Legend: ``N`` batch, ``L`` sequence length, ``D`` 2 if bidirectional else 1, ``H`` hidden_size, ``H_out``
    proj_size if set, else hidden_size.

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

    def forward(
        self,
        input: Tensor | PackedSequence,
        hx: tuple[Tensor, Tensor] | None = None,
        lengths: Tensor | list[int] | None = None,
        *,
        first_step: int = 0,
    ) -> tuple[Tensor | PackedSequence, tuple[Tensor, Tensor]]:
        """Run every layer and direction over a whole sequence; returns what ``torch.nn.LSTM`` returns.

        Args:
            input: ``(L, N, H_in)`` (``(N, L, H_in)`` with ``batch_first``), ``(L, H_in)`` unbatched, or a
                ``PackedSequence``.
            hx: ``(h_0, c_0)``: ``h_0`` ``(D * num_layers, N, H_out)``, ``c_0`` ``(D * num_layers, N, H)`` (no
                ``N`` dimension for an unbatched input); ``None``: zeros.
            lengths: ``(N,)`` integers in ``[1, L]``: positions ``t >= lengths[n]`` are padding (they output zeros,
                enter no batch statistics, and ``h_n``/``c_n`` are each sequence's state at its last real step).
                Not with a ``PackedSequence``, which carries its own.
            first_step: the time index of the input's first step, as per-timestep norms see it: with ``hx`` the
                final state of the previous chunk, ``lstm(chunk, hx, first_step=k)`` continues a sequence cut into
                chunks (stateful truncated BPTT). Unidirectional layers only.

        Returns:
            ``(output, (h_n, c_n))``: ``output`` ``(L, N, D * H_out)`` (``(N, L, D * H_out)`` with
            ``batch_first``), zero at padded positions, or a ``PackedSequence`` for a packed input; ``h_n``
            ``(D * num_layers, N, H_out)`` and ``c_n`` ``(D * num_layers, N, H)``. ``D`` is 2 if bidirectional else
            1, ``H`` ``hidden_size``, ``H_out`` ``proj_size`` if set, else ``hidden_size``.

        Raises:
            ValueError: an input, state or ``lengths`` of the wrong shape, dtype or device, or ``first_step`` not
                an int ``>= 0`` (or not 0 with ``bidirectional``); a batch norm in training with fewer than 2
                real rows.
        """
        return super().forward(input, hx, lengths, first_step=first_step)  # type: ignore[return-value]

    @classmethod
    def from_torch(cls, module: nn.LSTM, **kwargs: object) -> LSTM:
        """A layer with ``module``'s weights: equivalent with the default ``norm="none"``; with another ``norm=``
        (and any other keyword of the constructor), the norms start from their initial values."""
        return from_torch(cls, module, nn.LSTM, **kwargs)  # type: ignore[return-value]
