"""GRU cell with a selectable normalization."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from seqnorm.cells.gated import GatedCell

__all__ = ["GRUCell"]


class GRUCell(GatedCell):
    r"""A gated recurrent unit with LayerNorm, RMSNorm, WeightNorm or per-timestep (re)BatchNorm.

    .. math::
        \begin{array}{ll}
        (a_r, a_z, a_n) = N_{ih}(W_{ih} x) + b_{ih}, \quad (u_r, u_z, u_n) = N_{hh}(W_{hh} h) + b_{hh} \\
        r = \sigma(a_r + u_r), \quad z = \sigma(a_z + u_z) \\
        n = \tanh(a_n + r \odot u_n) \\
        h' = (1 - z) \odot n + z \odot h
        \end{array}

    With ``N`` the identity (``norm="none"``) this is exactly ``torch.nn.GRUCell``. LayerNorm / RMSNorm normalize the
    ``3H`` input and recurrent terms separately (Ba et al. 2016, LN-GRU); ``"batch"``/``"batch_renorm"`` apply
    per-timestep BN to the same two terms (γ₀ = 0.1, β = 0, following Cooijmans et al.'s LSTM recipe); ``"weight"``
    reparametrizes ``W_ih`` and ``W_hh``. A GRU has no cell state, so there is no ``N_c``.

    With ``zoneout_h`` in training, ``h' <- d * h + (1 - d) * h'`` with a fresh ``d ~ Bernoulli(zoneout_h)`` per
    unit and step (Krueger et al. 2016); evaluation runs without it.

    Args: as :class:`~seqnorm.LSTMCell` (``forget_bias`` does not apply: a GRU has no forget gate; ``zoneout_c`` must
    be 0, and the spec's ``norm_placement`` ``"separate"``, ``state_norm`` ``"output"`` and ``beta_init`` 0: a GRU has
    no cell state, and its candidate gates the recurrent term by ``r``, so the two terms are never one sum).

    Inputs: ``x, h=None, *, step=None, mask=None`` with ``x`` ``(B, input_size)`` and ``h`` ``(B, hidden_size)``;
    ``step`` and ``mask`` as for :class:`~seqnorm.LSTMCell` (``step`` required by per-timestep norms; padding rows
    keep their state).

    Outputs: ``h'`` ``(B, hidden_size)``.

    Example::

        >>> cell = seqnorm.GRUCell(10, 20, norm="rms")
        >>> h = cell(torch.randn(3, 10))
        >>> h = cell(torch.randn(3, 10), h, step=1)
    """

    num_gates = 3
    has_cell_state = False
    gate_layout = ("r", "z", "n")
    torch_kernel = "gru"
    hoisted_step = True

    def forward(
        self, x: Tensor, state: Tensor | None = None, *, step: int | None = None, mask: Tensor | None = None
    ) -> Tensor:
        """Advance the cell by one time step.

        Args:
            x: the input at this step, ``(B, input_size)``, or ``(input_size,)`` unbatched (as torch's cells take
                it; the state and the outputs are then ``(H,)``).
            state: ``h`` ``(B, hidden_size)``; ``None``: zeros.
            step: the time index ``t >= 0`` of ``x`` in its sequence. Required when the norm keeps statistics per
                time step (``"batch"``, ``"batch_renorm"``, ``"weight"`` with mean-only BN: they normalize step
                ``t`` with step ``t``'s statistics, in training and in evaluation); other norms compute the same at
                every step and ignore it.
            mask: ``(B,)`` bool, ``False`` for rows that are padding at this step: they enter no batch statistics
                and keep their state. ``None``: every row is real.

        Returns:
            ``h'`` ``(B, hidden_size)``.

        Raises:
            ValueError: an input, state or mask of the wrong shape, dtype or device; ``step`` not an int ``>= 0``,
                or not given for a norm with per-timestep statistics; a batch norm in training with fewer than 2
                real rows (see ``small_batch``).
        """
        return super().forward(x, state, step=step, mask=mask)

    def step_terms(
        self,
        x: Tensor | None,
        state: Tensor,
        step: int,
        mask: Tensor | None,
        *,
        input_normed: Tensor | None = None,
        input_term: Tensor | None = None,
    ) -> Tensor:
        h_prev = state
        h_in = self.recurrent_input(h_prev)  # the layer's recurrent dropout, where it runs a sequence with one
        record: dict[str, Any] | None = {} if self.observer.active else None
        # b_hh stays on the recurrent side (recurrent_bias): its candidate part is gated by r.
        a, u = self.gate_terms(x, h_in, step, mask, record, input_normed, input_term)
        assert u is not None  # a GRU has no joint placement
        blocks = [2 * self.hidden_size, self.hidden_size]
        # split, not slicing: one backward node that joins the parts, where each slice's pads a zero (B, 3H) block
        (a_rz, a_n), (u_rz, u_n) = a.split(blocks, dim=1), u.split(blocks, dim=1)
        r, z = torch.sigmoid(a_rz + u_rz).chunk(2, dim=1)
        n = torch.tanh(a_n + r * u_n)
        h = self.settle((1 - z) * n + z * h_prev, h_prev, mask, self.zoneout_h)
        if record is not None:
            record.update(gates=torch.cat([r, z, n], dim=1), h=h)
            self.observer(record)
        return h
