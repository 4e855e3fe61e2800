"""The shared body of the normalized cells: parameters in torch's layout, norms from the registry, input checks."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrizations, parametrize

from seqnorm.cells.projection import project
from seqnorm.init import InitName, init_recurrent_, resolve_init
from seqnorm.norms import (
    DEFAULT_MAX_STEPS,
    NORMS,
    NormContext,
    NormName,
    NormSpec,
    check_placement,
    refuse_removed_keywords,
    resolve_norm,
)
from seqnorm.pickling import PicklableParametrizations
from seqnorm.torch_capture import refuse_scripting
from seqnorm.validation import (
    check_finite,
    check_like_parameters,
    check_positive_int,
    check_proj_size,
    check_rate,
    check_state_shape,
    check_step,
)

__all__ = ["RecurrentCell", "StepObserver"]


class StepObserver(nn.Module):
    """A tap through which a cell shows each step's intermediates — only while someone has hooked it.

    Observers (e.g. :class:`seqnorm.callbacks.HiddenStateStats`) use the standard torch API,
    ``cell.observer.register_forward_hook(fn)``; ``fn(module, (record,), None)`` then receives, at every step, a
    dict with ``step`` (int), ``mask`` (``(B,)`` bool or ``None``: all rows real), ``input_raw`` / ``recurrent_raw``
    (``W_ih x`` and ``W_hh h`` before their norms), ``input_term`` / ``recurrent_term`` (after norm and bias; with
    ``norm_placement="joint"``, ``input_term`` is the normalized sum plus both biases and ``recurrent_term`` ``None``),
    ``gates`` (the activated gates, ``(B, G*H)`` in torch's gate order), ``h`` and, for LSTMs, ``c`` and
    ``c_out`` (the cell state as it enters the output ``tanh``, after ``norm_c``). Without hooks the cell builds
    no record at all, and layers may use faster paths that never call the cell step by step.
    """

    def forward(self, record: dict[str, Any]) -> None:
        return None

    @property
    def active(self) -> bool:
        return bool(self._forward_hooks or self._forward_pre_hooks)


class RecurrentCell(PicklableParametrizations):
    """Base of :class:`~seqnorm.LSTMCell` and :class:`~seqnorm.GRUCell`; a subclass declares its gates and step.

    Parameters follow ``torch.nn.LSTMCell``/``GRUCell`` exactly (``weight_ih``, ``weight_hh``, ``bias_ih``,
    ``bias_hh`` in torch's gate order); norms are submodules ``norm_ih``, ``norm_hh`` and, for LSTMs, ``norm_c``
    (with ``norm_placement="joint"``, one ``norm_gates`` instead of ``norm_ih`` and ``norm_hh``).
    """

    num_gates: ClassVar[int]
    has_cell_state: ClassVar[bool]
    forget_gate: ClassVar[int | None] = None  # index of the forget gate block, if the cell has one
    supports_projection: ClassVar[bool] = False  # proj_size, as torch.nn.LSTM's
    # Declared capabilities, read by :func:`seqnorm.layers.plan.plan_for` from the class's *own* namespace only: a
    # subclass that changes any part of the step must not run a fast form of its parent's math, so it gets none
    # unless it restates the claim (the restatement is its author's "same math" marker).
    gate_layout: ClassVar[tuple[str, ...]] = ()  # the gate blocks of W_ih/W_hh in order, e.g. ("i", "f", "g", "o")
    torch_kernel: ClassVar[Literal["lstm", "gru"] | None] = None  # the step is torch's LSTM/GRU step (norms aside)
    hoisted_step: ClassVar[bool] = False  # step_unchecked with input_term from input_terms is its own function

    @refuse_removed_keywords
    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        bias: bool = True,
        *,
        norm: NormName | NormSpec = "none",
        max_steps: int = DEFAULT_MAX_STEPS,
        init: InitName = "default",
        forget_bias: float | None = None,
        zoneout_h: float = 0.0,
        zoneout_c: float = 0.0,
        proj_size: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        self.input_size = check_positive_int(owner, "input_size", input_size)
        self.hidden_size = check_positive_int(owner, "hidden_size", hidden_size)
        self.proj_size = check_proj_size(owner, proj_size, hidden_size, self.supports_projection)
        self.zoneout_h = check_rate(owner, "zoneout_h", zoneout_h)
        self.zoneout_c = check_rate(owner, "zoneout_c", zoneout_c)
        if self.zoneout_c and not self.has_cell_state:
            raise ValueError(f"{owner}: expected zoneout_c=0 (there is no cell state), got {zoneout_c!r}")
        # A layer passes the spec it resolved: then this is a lookup, not a second validation.
        self.norm_spec = resolve_norm(owner, norm, max_steps)
        self.scheme = NORMS[self.norm_spec.name]
        self.init = resolve_init(init, owner)
        self.placement = check_placement(owner, self.norm_spec, has_cell_state=self.has_cell_state)
        self.norm_placement = self.placement.norm_placement
        self.state_norm = self.placement.state_norm
        self.max_steps: int = getattr(self.norm_spec, "max_steps", max_steps)
        self.bias = bool(bias)
        self.norm = self.norm_spec.name  # the registry name, as before specs (paths and reprs read it)
        if forget_bias is not None:  # checked before the no-effect warning: a NaN is wrong whatever the cell
            check_finite(owner, "forget_bias", forget_bias)
        if forget_bias is None and self.norm != "none" and self.forget_gate is not None:
            forget_bias = 1.0
        if forget_bias is not None and (self.forget_gate is None or not bias):
            warnings.warn(f"{owner}: forget_bias={forget_bias} has no effect without a forget gate bias", stacklevel=2)
            forget_bias = None
        self.forget_bias = forget_bias

        factory = {"device": device, "dtype": dtype}
        gate_size = self.num_gates * hidden_size
        self.weight_ih = nn.Parameter(torch.empty(gate_size, input_size, **factory))
        self.weight_hh = nn.Parameter(torch.empty(gate_size, self.state_size, **factory))
        if bias:
            self.bias_ih = nn.Parameter(torch.empty(gate_size, **factory))
            self.bias_hh = nn.Parameter(torch.empty(gate_size, **factory))
        else:
            self.register_parameter("bias_ih", None)
            self.register_parameter("bias_hh", None)
        # Registered after the biases: torch.nn.LSTM's order (weight_ih, weight_hh, bias_ih, bias_hh, weight_hr).
        if self.proj_size:
            self.weight_hr = nn.Parameter(torch.empty(self.proj_size, hidden_size, **factory))
        else:
            self.register_parameter("weight_hr", None)

        context = NormContext(owner, self.norm_spec, device, dtype)
        joint = self.norm_placement == "joint"
        self.norm_ih: nn.Module | None = None if joint else self.scheme.build(gate_size, "input", context)
        self.norm_hh: nn.Module | None = None if joint else self.scheme.build(gate_size, "recurrent", context)
        self.norm_gates: nn.Module | None = self.scheme.build(gate_size, "gates", context) if joint else None
        self.norm_c: nn.Module | None = (
            self.scheme.build(hidden_size, "state", context) if self.has_cell_state else None
        )
        self.observer = StepObserver()
        if self.scheme.weight_norm:
            # W = g * v / ||v|| per output row (dim=0): parameters `parametrizations.weight_ih.original0/1`.
            parametrizations.weight_norm(self, "weight_ih", dim=0)
            parametrizations.weight_norm(self, "weight_hh", dim=0)
        self.reset_parameters()

    def __prepare_scriptable__(self) -> nn.Module:
        refuse_scripting(self)
        return self

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
        for norm in (self.norm_ih, self.norm_hh, self.norm_gates, self.norm_c):
            if norm is not None:
                norm.reset_parameters()

    def extra_repr(self) -> str:
        text = f"{self.input_size}, {self.hidden_size}, norm={self.norm!r}, init={self.init!r}"
        if not self.bias:
            text += ", bias=False"
        if self.proj_size:
            text += f", proj_size={self.proj_size}"
        if self.forget_bias is not None:
            text += f", forget_bias={self.forget_bias}"
        if self.scheme.batch_statistics:
            text += f", max_steps={self.max_steps}"
        for name in ("zoneout_h", "zoneout_c"):
            if getattr(self, name):
                text += f", {name}={getattr(self, name)}"
        for name, value in self.norm_spec.options().items():
            if name != "max_steps":  # shown above for the norms that use it
                text += f", {name}={value!r}"
        return text

    @property
    def state_size(self) -> int:
        """Features of ``h``: ``proj_size`` with a projection, else ``hidden_size``."""
        return self.proj_size or self.hidden_size

    @property
    def has_norms(self) -> bool:
        """Whether any term or state is normalized (``False`` for ``"none"`` and plain weight norm)."""
        return any(norm is not None for norm in (self.norm_ih, self.norm_hh, self.norm_gates, self.norm_c))

    @property
    def draws_random(self) -> bool:
        """Whether a training step draws random numbers (zoneout), so must run through the cell's own step."""
        return self.training and bool(self.zoneout_h or self.zoneout_c)

    def zoneout(self, new: Tensor, old: Tensor, rate: float) -> Tensor:
        """Zoneout (Krueger et al. 2016): in training each unit keeps its previous value with probability ``rate``.

        ``new`` where ``torch.rand_like(new) >= rate``, else ``old``; one fresh draw per call (per step). In
        evaluation the identity on ``new`` (no draw): the model evaluates as if zoneout were off.
        """
        if not rate or not self.training:
            return new
        return torch.where(torch.rand_like(new) < rate, old, new)

    # --- one time step -------------------------------------------------------------------------------------------

    def gate_terms(
        self,
        x: Tensor | None,
        h: Tensor,
        step: int,
        mask: Tensor | None,
        record: dict[str, Any] | None = None,
        weight_hh: Tensor | None = None,
        input_normed: Tensor | None = None,
        input_term: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The (normalized) input and recurrent terms ``N(W_ih x) + b_ih`` and ``N(W_hh h) + b_hh``.

        With ``norm_placement="joint"``: ``(N(W_ih x + W_hh h) + b_ih + b_hh, None)``. ``weight_hh`` replaces
        ``W_hh`` for this step (the layers pass a DropConnect-masked copy, or the weight-normed one computed once);
        ``input_normed`` is ``N_ih(W_ih x)`` when the layer computed it for the whole sequence (sequence-wise input
        statistics). ``input_term`` is the hoisted form's input term from :meth:`input_terms`, which carries
        :meth:`folded_bias` (``x`` is then not read, and the recurrent term carries :meth:`recurrent_bias`): the norms
        run through their ``forward_step`` and nothing is recorded (the layers hoist only while no observer is hooked).
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
        recurrent_raw = torch.mm(h, (self.weight_hh if weight_hh is None else weight_hh).t())
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

    @staticmethod
    def step_norm(norm: nn.Module, recorded: bool) -> Callable[[Tensor, int, Tensor | None], Tensor]:
        """How a step calls ``norm``: its ``forward_step`` where the norm's class declares the ``"loop"`` form (the
        same function, for a caller that keeps the padded rows' state, as every step does), else the module. The
        module too while the step is recorded for an observer, or where hooks are registered on the norm (they
        fire on module calls only): what is watched is the reference."""
        if recorded or "loop" not in type(norm).__dict__.get("fast_forms", ()):
            return norm
        if norm._forward_hooks or norm._forward_pre_hooks:
            return norm
        return norm.forward_step  # type: ignore[return-value]

    def initial_state(self, batch_size: int, like: Tensor) -> Any:
        """The zero state for ``batch_size`` rows, on ``like``'s device and in its dtype."""
        raise NotImplementedError

    def step_unchecked(
        self,
        x: Tensor | None,
        state: Any,
        step: int,
        mask: Tensor | None,
        recurrent_mask: Tensor | None = None,
        weight_hh: Tensor | None = None,
        input_normed: Tensor | None = None,
        *,
        input_term: Tensor | None = None,
    ) -> Any:
        """One step without input checks: the reference loop and the hoisted loop both call this.

        ``recurrent_mask`` ``(B, H)`` is a variational dropout mask (already scaled by ``1/(1-p)``) applied to the
        state where it enters the recurrent term; ``weight_hh`` replaces ``W_hh`` (DropConnect, drawn by the layer
        once per sequence); ``input_normed`` is this step's ``N_ih(W_ih x)`` from :meth:`sequence_input_norm`;
        ``input_term`` is this step's slice of :meth:`input_terms` (then ``x`` is ``None``: see :meth:`gate_terms`).
        Zoneout, drawn at every step, is the cell's own.
        """
        raise NotImplementedError

    def sequence_input_norm(self, x: Tensor, mask: Tensor | None, counts: list[int]) -> list[Tensor] | None:
        """``N_ih(W_ih x)`` per step of ``x`` ``(T, B, input_size)`` when its statistics need the whole sequence.

        ``None`` unless ``input_stats="sequence"``: then the reference loop passes each step's term to
        :meth:`step_unchecked`, since one step alone cannot form batch × time statistics.
        """
        if self.norm_ih is None or not getattr(self.norm_ih, "whole_sequence", False):
            return None
        return list(self.norm_ih.forward_sequence(project(x, self.weight_ih), mask, counts).unbind(0))

    # --- the fast path: a whole sequence's input terms at once, then lean recurrent steps --------------------------

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

    # --- input checks --------------------------------------------------------------------------------------------

    @functools.cached_property
    def _owner(self) -> str:
        """The name errors start with: the cell's class, also under weight norm (whose parametrization makes the
        module an instance of a generated ``Parametrized<Class>``). Cached: every call's checks name it."""
        return parametrize.type_before_parametrizations(self).__name__

    def unbatched(self, x: Tensor, state: Any, step: int | None, mask: Tensor | None) -> Any:
        """torch's unbatched cell call: ``x`` ``(input_size,)`` and states ``(H,)``, run as a batch of one (a batch
        norm in training refuses it as it refuses batch size 1). The outputs are ``(H,)``."""
        owner = self._owner
        if mask is not None:
            raise ValueError(f"{owner}: expected mask=None with an unbatched input (a mask marks rows), got a mask")
        states = state if isinstance(state, (tuple, list)) else (state,)
        for name, tensor in zip(("h", "c"), states, strict=False):
            if tensor is not None and (not isinstance(tensor, Tensor) or tensor.dim() != 1):
                got = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
                raise ValueError(f"{owner}: expected {name} of shape (hidden,) with an unbatched input, got {got}")
        if state is not None:
            state = tuple(t.unsqueeze(0) for t in state) if isinstance(state, (tuple, list)) else state.unsqueeze(0)
        output = self(x.unsqueeze(0), state, step=step)
        return tuple(t.squeeze(0) for t in output) if isinstance(output, tuple) else output.squeeze(0)

    def check_input(self, x: Tensor, mask: Tensor | None, owner: str | None = None) -> None:
        """``x`` ``(B, input_size)`` like the parameters, ``mask`` ``(B,)`` bool or ``None``; errors name ``owner``
        (default: this cell's class; a layer's ``step()`` names itself)."""
        owner = owner or self._owner
        if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != self.input_size:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{owner}: expected input of shape (batch, {self.input_size}), got {got}")
        check_like_parameters(owner, "input", x, self.reference_parameter())
        if mask is not None and (
            not isinstance(mask, Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (x.shape[0],)
        ):
            got = f"{tuple(mask.shape)} {mask.dtype}" if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(f"{owner}: expected mask of shape ({x.shape[0]},) and dtype torch.bool, got {got}")

    def check_state_tensor(self, name: str, tensor: object, batch_size: int, like: Tensor) -> Tensor:
        expected = (batch_size, self.state_size if name == "h" else self.hidden_size)
        return check_state_shape(self._owner, name, tensor, expected, like)

    def check_step(self, step: object) -> int:
        """The time index of a call: ``step`` as an int ``>= 0``; ``None`` (not given) is a ``ValueError`` for a
        cell whose norms keep statistics per time step (:attr:`indexed_by_step`), and step 0 for the others, which
        compute the same at every step."""
        if step is None:
            if self.indexed_by_step:
                raise ValueError(
                    f"{self._owner}: expected step=<time index> (norm={self.norm!r} keeps statistics per "
                    "time step: call cell(x_t, state, step=t) in a loop over t), got none"
                )
            return 0
        return check_step(self._owner, step)

    @property
    def indexed_by_step(self) -> bool:
        """Whether the step index changes what this cell computes: one of its norms declares ``indexed_by_step``
        (per-timestep batch statistics: ``"batch"``, ``"batch_renorm"``, ``"weight"`` with mean-only BN)."""
        return any(getattr(module, "indexed_by_step", False) for module in self.modules() if module is not self)

    def reference_parameter(self) -> Tensor:
        """A parameter whose dtype and device all of this cell's share (one held directly when there is one)."""
        for parameter in self._parameters.values():  # no recursion, no weight-norm computation: a per-step check
            if parameter is not None:
                return parameter
        return next(self.parameters())
