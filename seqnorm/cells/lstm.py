"""LSTM cell with a selectable normalization."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from seqnorm.cells.gated import GatedCell

__all__ = ["LSTMCell"]


class LSTMCell(GatedCell):
    r"""A long short-term memory cell with LayerNorm, RMSNorm, WeightNorm or per-timestep (re)BatchNorm.

    .. math::
        \begin{array}{ll}
        (i, f, g, o) = N_{ih}(W_{ih} x) + b_{ih} + N_{hh}(W_{hh} h) + b_{hh} \\
        c' = \sigma(f) \odot c + \sigma(i) \odot \tanh(g) \\
        h' = \sigma(o) \odot \tanh(N_c(c'))
        \end{array}

    With ``proj_size > 0`` (as ``torch.nn.LSTM``) ``h' = W_{hr} (\sigma(o) \odot \tanh(N_c(c')))`` has
    ``proj_size`` features, and ``W_{hh}`` has ``proj_size`` columns.

    With zoneout in training (Krueger et al. 2016) the new state is then mixed with the old one unit by unit,
    ``h' <- d_h * h + (1 - d_h) * h'`` and ``c' <- d_c * c + (1 - d_c) * c'``, with fresh Bernoulli masks
    ``d_h ~ B(zoneout_h)``, ``d_c ~ B(zoneout_c)`` at every step.

    ``N`` is the identity for ``norm="none"`` (exactly ``torch.nn.LSTMCell``) and ``"weight"`` (``W = g v/||v||``
    per row; with ``WeightNormSpec(mean_only_bn=True)`` ``N_{ih}, N_{hh}`` subtract per-timestep batch means);
    LayerNorm / RMSNorm over the ``4H`` gate features and the ``H`` state features for ``"layer"``/``"rms"``
    (Ba et al. 2016); per-timestep BatchNorm with γ initialized to 0.1 and β fixed at 0 on the gate terms for
    ``"batch"`` (Cooijmans et al. 2016), with Ioffe's r/d correction for ``"batch_renorm"``. The carried cell state
    ``c'`` stays unnormalized; only its path to ``h'`` is normalized.

    The norm's options are fields of its spec (:mod:`seqnorm.norms.specs`), where the norm sits included
    (:class:`~seqnorm.norms.Placement`): ``norm_placement="joint"`` gives
    ``(i, f, g, o) = N(W_{ih} x + W_{hh} h) + b_{ih} + b_{hh}`` (one norm, ``norm_gates``); ``state_norm="carried"``
    gives ``c' <- N_c(c')``, ``h' = \sigma(o) \odot \tanh(c')`` (the normalized cell state is the state);
    ``affine=False`` drops every γ and β; ``gamma_init`` / ``beta_init`` set their initial values;
    ``input_stats="sequence"`` takes ``N_{ih}``'s batch statistics over batch × time; ``beyond_max_steps="pooled"``
    normalizes steps ``t >= max_steps`` with the pooled statistics of all steps. E.g.
    ``LSTMCell(10, 20, norm=LayerNormSpec(norm_placement="joint"))``.

    Args:
        input_size: features of ``x``.
        hidden_size: features of ``c`` (and of ``h`` without a projection).
        bias: use ``b_ih`` and ``b_hh``. Default: ``True``.
        norm: ``"none" | "layer" | "rms" | "weight" | "batch" | "batch_renorm"`` (that norm's default options), or a
            spec from :mod:`seqnorm.norms.specs` carrying its options, e.g. ``BatchNormSpec(momentum=0.05)``: the
            one place a norm is configured (``eps``, ``momentum``, ``small_batch``, ``affine``, ``gamma_init``,
            ``beta_init``, ``input_stats``, ``beyond_max_steps``, ``norm_placement``, ``state_norm``, ...; passed
            here as keywords they are a ``TypeError`` naming the spec field). Default: ``"none"``.
        max_steps: time steps with their own batch statistics; later steps follow the spec's ``beyond_max_steps``.
            Default: 100. Accepted whatever the norm (ignored by norms without per-timestep statistics); folded into
            a spec that has it (a spec that sets another value is a ``ValueError``).
        init: ``"default" | "xavier" | "kaiming" | "orthogonal" | "identity"`` (see :mod:`seqnorm.init`).
        forget_bias: value of the forget gate bias after initialization. Default: 1.0 for normalized cells,
            ``None`` (torch's initialization untouched) for ``norm="none"``.
        zoneout_h, zoneout_c: zoneout rates in ``[0, 1)`` of ``h`` and ``c`` (Krueger et al. 2016), drawn from
            torch's random generator at every training step. In evaluation zoneout is off (no draw, the same
            outputs as rates of 0), where Krueger et al. use the expectation ``rate * h + (1 - rate) * h'``: a model
            trained with zoneout evaluates on the plain recurrence, like inverted dropout. Default: 0.
        proj_size: features of ``h`` after the projection ``weight_hr`` ``(proj_size, hidden_size)``, in
            ``[1, hidden_size)``; 0 (default): no projection. It follows every norm (``N_c`` acts on ``c``).
        device, dtype: of the parameters.

    Inputs: ``x, state=None, *, step=None, mask=None``
        - **x** ``(B, input_size)``.
        - **state** ``(h, c)``: ``h`` ``(B, P)``, ``c`` ``(B, hidden_size)``; zeros when ``None``. ``P`` is
          ``proj_size`` if set, else ``hidden_size``.
        - **step** the time index, which selects per-timestep statistics: required by ``"batch"``,
          ``"batch_renorm"`` and ``"weight"`` with mean-only BN (a ``ValueError`` without it), ignored by the others.
        - **mask** ``(B,)`` bool: ``False`` rows are padding at this step. They enter no batch statistics and keep
          their state unchanged, so a loop over a padded batch ends with each row's state at its last real step.

    Outputs: ``(h', c')``, shaped as the state.

    Example::

        >>> cell = seqnorm.LSTMCell(10, 20, norm="layer")
        >>> x = torch.randn(5, 3, 10)  # (T, B, I)
        >>> state = None
        >>> for t in range(5):
        ...     state = cell(x[t], state, step=t)
        >>> state[0].shape
        torch.Size([3, 20])
    """

    num_gates = 4
    has_cell_state = True
    forget_gate = 1
    supports_projection = True
    gate_layout = ("i", "f", "g", "o")
    torch_kernel = "lstm"
    hoisted_step = True

    def forward(
        self,
        x: Tensor,
        state: tuple[Tensor, Tensor] | None = None,
        *,
        step: int | None = None,
        mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Advance the cell by one time step.

        Args:
            x: the input at this step, ``(B, input_size)``, or ``(input_size,)`` unbatched (as torch's cells take
                it; the state and the outputs are then ``(H,)``).
            state: ``(h, c)`` with ``h`` ``(B, P)`` and ``c`` ``(B, hidden_size)`` (``P``: ``proj_size`` if set,
                else ``hidden_size``); ``None``: zeros.
            step: the time index ``t >= 0`` of ``x`` in its sequence. Required when the norm keeps statistics per
                time step (``"batch"``, ``"batch_renorm"``, ``"weight"`` with mean-only BN: they normalize step
                ``t`` with step ``t``'s statistics, in training and in evaluation); other norms compute the same at
                every step and ignore it.
            mask: ``(B,)`` bool, ``False`` for rows that are padding at this step: they enter no batch statistics
                and keep their state. ``None``: every row is real.

        Returns:
            ``(h', c')``, shaped as ``state``.

        Raises:
            ValueError: an input, state or mask of the wrong shape, dtype or device; ``step`` not an int ``>= 0``,
                or not given for a norm with per-timestep statistics; a batch norm in training with fewer than 2
                real rows (see ``small_batch``).
        """
        return super().forward(x, state, step=step, mask=mask)

    def step_terms(
        self,
        x: Tensor | None,
        state: tuple[Tensor, Tensor],
        step: int,
        mask: Tensor | None,
        *,
        input_normed: Tensor | None = None,
        input_term: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        h_prev, c_prev = state
        h_in = self.recurrent_input(h_prev)  # the layer's recurrent dropout, where it runs a sequence with one
        record: dict[str, Any] | None = {} if self.observer.active else None
        terms = self.gate_terms(x, h_in, step, mask, record, input_normed, input_term)
        pre = terms[0] if terms[1] is None else terms[0] + terms[1]  # None: the joint norm's sum
        i, f, g, o = pre.chunk(4, dim=1)
        i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
        c = f * c_prev + i * g
        if self.norm_c is None:
            c_out = c
        else:
            c_out = self.step_norm(self.norm_c, record is not None and input_term is None)(c, step, mask)
        if self.state_norm == "carried":
            c = c_out
        h = o * torch.tanh(c_out)
        if self.weight_hr is not None:
            # in h's own dtype: under autocast the product is bfloat16, and the state stays in float32 as without a
            # projection (carried out of autocast, a bfloat16 h_n was refused as another dtype than the input's)
            h = F.linear(h, self.weight_hr).to(h.dtype)
        h, c = self.settle(h, h_prev, mask, self.zoneout_h), self.settle(c, c_prev, mask, self.zoneout_c)
        if record is not None:
            record.update(gates=torch.cat([i, f, g, o], dim=1), h=h, c=c, c_out=c_out)
            self.observer(record)
        return h, c

    def folded_bias(self) -> Tensor | None:
        # Both biases are added to the same pre-activations, so the input term carries their sum — unless a joint
        # norm comes between (then gate_terms adds them after it).
        if self.bias_ih is None or self.norm_gates is not None:
            return None
        return self.bias_ih + self.bias_hh

    def recurrent_bias(self) -> Tensor | None:
        return None  # folded into the input term (or added after the joint norm)
