"""The cells whose gates are dense projections in torch's layout: :class:`GatedCell`, base of LSTMCell and GRUCell."""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrizations, parametrize

from seqnorm.cells.base import RecurrentCell
from seqnorm.init import init_recurrent_
from seqnorm.kernels.projection import project

__all__ = ["GatedCell"]


class GatedCell(RecurrentCell):
    """A cell whose ``G`` gate blocks are ``N_ih(W_ih x) + b_ih`` and ``N_hh(W_hh h) + b_hh``, in torch's layout.

    Parameters follow ``torch.nn.LSTMCell``/``GRUCell`` exactly (``weight_ih`` ``(G*H, I)``, ``weight_hh``
    ``(G*H, P)``, ``bias_ih``, ``bias_hh`` ``(G*H,)`` in torch's gate order, then ``weight_hr`` with a projection);
    norms are submodules ``norm_ih``, ``norm_hh`` and, with a cell state, ``norm_c`` (with
    ``norm_placement="joint"``, one ``norm_gates`` instead of ``norm_ih`` and ``norm_hh``). A subclass declares
    ``num_gates`` and writes its step from :meth:`gate_terms`; a cell without these dense weights subclasses
    :class:`~seqnorm.cells.base.RecurrentCell` directly.
    """

    num_gates: ClassVar[int]
    # Declared capabilities, read by :func:`seqnorm.layers.plan.plan_for` from the class's *own* namespace only: a
    # subclass that changes any part of the step must not run a fast form of its parent's math, so it gets none
    # unless it restates the claim (the restatement is its author's "same math" marker).
    gate_layout: ClassVar[tuple[str, ...]] = ()  # the gate blocks of W_ih/W_hh in order, e.g. ("i", "f", "g", "o")
    torch_kernel: ClassVar[Literal["lstm", "gru"] | None] = None  # the step is torch's LSTM/GRU step (norms aside)
    hoisted_step: ClassVar[bool] = False  # step_terms with input_term from input_terms is its own function

    def build(self, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        """``W_ih``, ``W_hh``, the biases and ``W_hr`` in torch's order, the norms, and weight norm if chosen."""
        gate_size = self.num_gates * self.hidden_size
        self.weight_ih = nn.Parameter(torch.empty(gate_size, self.input_size, device=device, dtype=dtype))
        self.weight_hh = nn.Parameter(torch.empty(gate_size, self.state_size, device=device, dtype=dtype))
        if self.bias:
            self.bias_ih = nn.Parameter(torch.empty(gate_size, device=device, dtype=dtype))
            self.bias_hh = nn.Parameter(torch.empty(gate_size, device=device, dtype=dtype))
        else:
            self.register_parameter("bias_ih", None)
            self.register_parameter("bias_hh", None)
        # Registered after the biases: torch.nn.LSTM's order (weight_ih, weight_hh, bias_ih, bias_hh, weight_hr).
        if self.proj_size:
            self.weight_hr = nn.Parameter(torch.empty(self.proj_size, self.hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight_hr", None)

        joint = self.norm_placement == "joint"
        self.norm_ih: nn.Module | None = None if joint else self.build_norm(gate_size, "input", device, dtype)
        self.norm_hh: nn.Module | None = None if joint else self.build_norm(gate_size, "recurrent", device, dtype)
        self.norm_gates: nn.Module | None = self.build_norm(gate_size, "gates", device, dtype) if joint else None
        self.norm_c: nn.Module | None = (
            self.build_norm(self.hidden_size, "state", device, dtype) if self.has_cell_state else None
        )
        if self.scheme.weight_norm:
            # W = g * v / ||v|| per output row (dim=0): parameters `parametrizations.weight_ih.original0/1`.
            parametrizations.weight_norm(self, "weight_ih", dim=0)
            parametrizations.weight_norm(self, "weight_hh", dim=0)

    def reset_parameters(self) -> None:
        """Initialize weights with ``init``, set the forget bias and reset every norm (running statistics too)."""
        weight_ih = torch.empty_like(self.weight_ih)
        weight_hh = torch.empty_like(self.weight_hh)
        biases = [bias.data for bias in (self.bias_ih, self.bias_hh) if bias is not None]
        # torch.nn.LSTM draws every parameter, weight_hr too, from U(-1/sqrt(H), 1/sqrt(H)) with H the hidden size
        # (not W_hh's P columns); the per-block schemes have no recipe for a projection and use the same for W_hr.
        bound = 1.0 / math.sqrt(self.hidden_size)
        if self.proj_size and self.init == "default":
            for tensor in (weight_ih, weight_hh, *biases):
                nn.init.uniform_(tensor, -bound, bound)
        else:
            init_recurrent_(self.init, weight_ih, weight_hh, biases, self.num_gates)
        if self.weight_hr is not None:
            nn.init.uniform_(self.weight_hr, -bound, bound)
        if self.forget_bias is not None and self.bias_ih is not None and self.bias_hh is not None:
            forget = slice(self.forget_gate * self.hidden_size, (self.forget_gate + 1) * self.hidden_size)
            with torch.no_grad():
                self.bias_ih[forget] = self.forget_bias
                self.bias_hh[forget] = 0.0
        with torch.no_grad():
            # Assigning through a weight-norm parametrization sets g = ||w|| and v = w (its right inverse).
            if parametrize.is_parametrized(self):
                for name, weight in (("weight_ih", weight_ih), ("weight_hh", weight_hh)):
                    zero_rows = int((weight == 0).all(dim=1).sum())
                    if zero_rows:  # its direction w / ||w|| would be 0/0: NaN weights from the start
                        raise ValueError(
                            f"{self._owner}: expected init={self.init!r} to leave no zero row in {name} under "
                            f"norm='weight' (a zero row has no direction to normalize), got {zero_rows} zero rows "
                            f"of {weight.shape[0]}; use another init" + (" or no projection" if self.proj_size else "")
                        )
                self.weight_ih = weight_ih
                self.weight_hh = weight_hh
            else:
                self.weight_ih.copy_(weight_ih)
                self.weight_hh.copy_(weight_hh)
        super().reset_parameters()  # the norms, running statistics too

    @property
    def has_norms(self) -> bool:
        """Whether any term or state is normalized (``False`` for ``"none"`` and plain weight norm)."""
        return any(norm is not None for norm in (self.norm_ih, self.norm_hh, self.norm_gates, self.norm_c))

    # --- one time step -------------------------------------------------------------------------------------------

    def step_unchecked(self, x: Tensor, state: Any, step: int, mask: Tensor | None) -> Any:
        """One step (:meth:`RecurrentCell.step_unchecked`): :meth:`step_terms` from ``x``."""
        return self.step_terms(x, state, step, mask)

    def step_terms(
        self,
        x: Tensor | None,
        state: Any,
        step: int,
        mask: Tensor | None,
        *,
        input_normed: Tensor | None = None,
        input_term: Tensor | None = None,
    ) -> Any:
        """A gated cell's step, also from an input term the layer computed beforehand (its hook for the layers'
        loops): ``input_normed``, this step's ``N_ih(W_ih x)`` where its statistics need the whole sequence
        (:meth:`sequence_input_norm`), or, for a cell that declares ``hoisted_step``, ``input_term``, this step's
        slice of :meth:`input_terms` (``x`` is then ``None``). Otherwise as :meth:`step_unchecked`; the terms are
        :meth:`gate_terms`'s."""
        raise NotImplementedError(f"{type(self).__name__}: a gated cell defines step_terms() (its step)")

    def gate_terms(
        self,
        x: Tensor | None,
        h: Tensor,
        step: int,
        mask: Tensor | None,
        record: dict[str, Any] | None = None,
        input_normed: Tensor | None = None,
        input_term: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The (normalized) input and recurrent terms ``N(W_ih x) + b_ih`` and ``N(W_hh h) + b_hh``.

        With ``norm_placement="joint"``: ``(N(W_ih x + W_hh h) + b_ih + b_hh, None)``. ``h`` is what enters the
        recurrent term (:meth:`recurrent_input`); ``W_hh`` is :meth:`recurrent_weight` (a layer's DropConnect copy,
        or the weight-normed one it computed once); ``input_normed`` is ``N_ih(W_ih x)`` when the layer computed it
        for the whole sequence (sequence-wise input statistics). ``input_term`` is the hoisted form's input term from
        :meth:`input_terms`, which carries :meth:`folded_bias` (``x`` is then not read, and the recurrent term carries
        :meth:`recurrent_bias`): the norms run through their ``forward_step`` and nothing is recorded (the layers hoist
        only while no observer is hooked).
        """
        lean = input_term is not None
        recorded = record is not None and not lean
        if input_term is None:
            input_raw = F.linear(x, self.weight_ih)  # type: ignore[arg-type]
            if input_normed is not None:
                input_term = input_normed
            else:
                norm_ih = self.norm_ih
                input_term = input_raw if norm_ih is None else self.step_norm(norm_ih, recorded)(input_raw, step, mask)
            if self.bias_ih is not None and self.norm_gates is None:  # (the joint norm's biases follow it, below)
                input_term = input_term + self.bias_ih
        recurrent_raw = torch.mm(h, self.recurrent_weight().t())
        recurrent_term: Tensor | None
        if self.norm_gates is not None:
            input_term = self.step_norm(self.norm_gates, recorded)(input_term + recurrent_raw, step, mask)
            recurrent_term = None
            if self.bias_ih is not None:
                input_term = input_term + self.bias_ih + self.bias_hh
        else:
            if self.norm_hh is None:
                recurrent_term = recurrent_raw
            else:
                recurrent_term = self.step_norm(self.norm_hh, recorded)(recurrent_raw, step, mask)
            bias = self.recurrent_bias() if lean else self.bias_hh
            if bias is not None:
                recurrent_term = recurrent_term + bias
        if recorded:
            record.update(
                step=step,
                mask=mask,
                input_raw=input_raw,
                recurrent_raw=recurrent_raw,
                input_term=input_term,
                recurrent_term=recurrent_term,
            )
        return input_term, recurrent_term

    def sequence_input_norm(self, x: Tensor, mask: Tensor | None, counts: list[int]) -> list[Tensor] | None:
        """``N_ih(W_ih x)`` per step of ``x`` ``(T, B, input_size)`` when its statistics need the whole sequence.

        ``None`` unless ``input_stats="sequence"``: then the reference loop passes each step's term to
        :meth:`step_terms`, since one step alone cannot form batch × time statistics.
        """
        if self.norm_ih is None or not getattr(self.norm_ih, "whole_sequence", False):
            return None
        return list(self.norm_ih.forward_sequence(project(x, self.weight_ih), mask, counts).unbind(0))

    # --- the hoisted form: a whole sequence's input terms at once, then lean recurrent steps ----------------------

    def input_terms(self, x: Tensor, mask: Tensor | None = None, counts: list[int] | None = None) -> Tensor:
        """``N_ih(W_ih x) + b`` for every step of ``x`` ``(T, B, input_size)`` at once: one matmul, one norm.

        ``mask`` ``(T, B)`` and its per-step sums ``counts`` mark the real rows for per-timestep batch statistics.
        Which biases are folded in is the subclass's choice (:meth:`folded_bias`, :meth:`recurrent_bias`).
        """
        weight_ih = self.weight_ih  # a weight-norm parametrization computes it here, once for all steps
        if self.norm_ih is None:
            return project(x, weight_ih, self.folded_bias())
        terms = self.norm_ih.forward_sequence(project(x, weight_ih), mask, counts)
        bias = self.folded_bias()
        return terms if bias is None else terms + bias

    def folded_bias(self) -> Tensor | None:
        """The bias added to the input term by :meth:`input_terms` (``b_ih``, plus what of ``b_hh`` may move there)."""
        return self.bias_ih

    def recurrent_bias(self) -> Tensor | None:
        """The bias added to the normalized recurrent term: ``b_hh``, unless :meth:`folded_bias` took it."""
        return self.bias_hh
