"""What every cell shares: the constructor's checks, the step contract, state checks, zoneout, padding, observers."""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from seqnorm.init import InitName, resolve_init
from seqnorm.norms import (
    DEFAULT_MAX_STEPS,
    NORMS,
    NormContext,
    NormName,
    NormSpec,
    Role,
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

__all__ = ["RecurrentCell", "SequenceRegularizers", "StepObserver"]


class SequenceRegularizers:
    """What a layer drew for one sequence of one cell (:func:`seqnorm.layers.sequence.draw_sequence_masks`), which
    the cell's step reads through :meth:`RecurrentCell.recurrent_input` and :meth:`RecurrentCell.recurrent_weight`,
    and how often it did: a layer refuses a cell that never asked for what was drawn (it would be lost silently)."""

    __slots__ = ("inputs_read", "recurrent", "weight_hh", "weights_read")

    def __init__(self, recurrent: Tensor | None, weight_hh: Tensor | None) -> None:
        self.recurrent = recurrent  # (B, P), scaled by 1/(1-p): variational recurrent dropout
        self.weight_hh = weight_hh  # W_hh for every step: DropConnect's copy, or weight norm's computed once
        self.inputs_read = 0
        self.weights_read = 0


_RUNNING = threading.local()  # per thread: cell -> the SequenceRegularizers of the sequence it is running


class StepObserver(nn.Module):
    """A tap through which a cell shows each step's intermediates — only while someone has hooked it.

    Observers (e.g. :class:`seqnorm.callbacks.HiddenStateStats`) use the standard torch API,
    ``cell.observer.register_forward_hook(fn)``; ``fn(module, (record,), None)`` then receives, at every step, a
    dict with ``step`` (int), ``mask`` (``(B,)`` bool or ``None``: all rows real), ``input_raw`` / ``recurrent_raw``
    (``W_ih x`` and ``W_hh h`` before their norms), ``input_term`` / ``recurrent_term`` (after norm and bias; with
    ``norm_placement="joint"``, ``input_term`` is the normalized sum plus both biases and ``recurrent_term`` ``None``),
    ``gates`` (the activated gates, ``(B, G*H)`` in torch's gate order), ``h`` and, for LSTMs, ``c`` and
    ``c_out`` (the cell state as it enters the output ``tanh``, after ``norm_c``): a gated cell's record. A cell of
    one's own whose step hands over none gets one from :meth:`RecurrentCell.observed_step`: ``step``, ``mask``,
    ``h`` (and ``c``). Without hooks the cell builds no record at all, and layers may use faster paths that never
    call the cell step by step.
    """

    records = 0  # records handed over so far (observed_step: whether a step handed one)

    def forward(self, record: dict[str, Any]) -> None:
        self.records += 1

    @property
    def active(self) -> bool:
        return bool(self._forward_hooks or self._forward_pre_hooks)


class RecurrentCell(PicklableParametrizations):
    """Base of every cell. A cell defines its parameters and norms in :meth:`build` (``self.build_norm(H, "input",
    device, dtype)`` gives the ``norm=`` of the registry), initializes them in :meth:`reset_parameters` (then
    ``super().reset_parameters()`` resets the norms) and does one step in :meth:`step_unchecked` (ending with
    :meth:`settle`: zoneout, and padded rows keep their state); ``has_cell_state = True`` if its state is ``(h, c)``.
    The base takes the constructor's arguments and checks them, checks :meth:`forward`'s inputs and states, and gives
    the zero state and the :class:`StepObserver`. ``class MyRNN(seqnorm.RecurrentLayer): cell_class = MyCell`` runs
    it over sequences (layers, directions, ``lengths``, packing, ``step()``) on the reference path.

    A cell declares no fast form unless it says so: :class:`~seqnorm.cells.gated.GatedCell`, the dense
    ``W_ih``/``W_hh`` gate blocks of the LSTM and GRU, declares those the layers' faster paths read
    (:mod:`seqnorm.layers.plan`). ``tests/cells/test_custom_cell.py`` builds an IndRNN cell (a diagonal recurrent
    weight) this way.
    """

    has_cell_state: ClassVar[bool] = False  # the state is (h, c) rather than h
    forget_gate: ClassVar[int | None] = None  # index of the forget gate block, if the cell has one (forget_bias)
    supports_projection: ClassVar[bool] = False  # proj_size, as torch.nn.LSTM's

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
        if forget_bias is not None and (self.forget_gate is None or not bias):  # one the user passed
            warnings.warn(f"{owner}: forget_bias={forget_bias} has no effect without a forget gate bias", stacklevel=2)
            forget_bias = None
        elif forget_bias is None and self.norm != "none" and self.forget_gate is not None and bias:
            forget_bias = 1.0
        self.forget_bias = forget_bias
        self.build(device, dtype)
        if self.scheme.weight_norm and not parametrize.is_parametrized(self):
            raise ValueError(
                f"{owner}: expected a norm this cell applies, got norm='weight' (its build() reparametrized no weight)"
            )
        self.observer = StepObserver()
        self.reset_parameters()

    def build(self, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        """Register the cell's parameters and norms (called once by ``__init__``, after the checks; the
        attributes set there, ``input_size``, ``hidden_size``, ``bias``, ``scheme``..., are available)."""
        raise NotImplementedError(f"{type(self).__name__}: a cell defines build() (its parameters and norms)")

    def build_norm(
        self, features: int, role: Role, device: torch.device | str | None, dtype: torch.dtype | None
    ) -> nn.Module | None:
        """The norm of this cell's ``norm=`` for a term of ``features`` (``role``: ``"input"``, ``"recurrent"``,
        ``"gates"`` or ``"state"``), or ``None`` where the norm applies nothing (``"none"``, ``"weight"``)."""
        return self.scheme.build(features, role, NormContext(self._owner, self.norm_spec, device, dtype))

    def reset_parameters(self) -> None:
        """Reset every submodule that can (the norms, running statistics too); a cell initializes its own
        parameters, then calls this."""
        for module in self.children():
            reset = getattr(module, "reset_parameters", None)
            if reset is not None:
                reset()

    def __prepare_scriptable__(self) -> nn.Module:
        refuse_scripting(self)
        return self

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
        """The zero state for ``batch_size`` rows, on ``like``'s device and in its dtype: ``h`` ``(B, P)`` (``P``:
        :attr:`state_size`), and ``c`` ``(B, hidden_size)`` beside it for a cell with ``has_cell_state``."""
        h = like.new_zeros(batch_size, self.state_size)
        return (h, like.new_zeros(batch_size, self.hidden_size)) if self.has_cell_state else h

    def forward(self, x: Tensor, state: Any = None, *, step: int | None = None, mask: Tensor | None = None) -> Any:
        """Advance the cell by one time step: ``x`` ``(B, input_size)`` (or ``(input_size,)`` unbatched), the
        state (``None``: zeros), the time index ``step`` and the padding ``mask`` ``(B,)`` bool, all checked here;
        then :meth:`step_unchecked`. Returns the new state, shaped as ``state``."""
        if isinstance(x, Tensor) and x.dim() == 1:
            return self.unbatched(x, state, step, mask)
        self.check_input(x, mask)
        step = self.check_step(step)
        batch = x.shape[0]
        if state is None:
            state = self.initial_state(batch, x)
        elif not self.has_cell_state:
            state = self.check_state_tensor("h", state, batch, x)
        elif not isinstance(state, (tuple, list)) or len(state) != 2:
            raise ValueError(f"{self._owner}: expected state to be a tuple (h, c), got {type(state).__name__}")
        else:
            state = (self.check_state_tensor("h", state[0], batch, x), self.check_state_tensor("c", state[1], batch, x))
        return self.observed_step(x, state, step, mask)

    def observed_step(self, x: Tensor, state: Any, step: int, mask: Tensor | None) -> Any:
        """:meth:`step_unchecked`, and where the step handed its hooked :attr:`observer` no record of its own (a
        cell of one's own that builds none) the record of its result: ``step``, ``mask``, ``h`` (and ``c``). The
        layers' reference loop and :meth:`forward` call this."""
        observer = self.observer
        if not observer.active:
            return self.step_unchecked(x, state, step, mask)
        handed = observer.records
        new = self.step_unchecked(x, state, step, mask)
        if observer.records == handed:
            h, c = (new, None) if isinstance(new, Tensor) else new
            self.observer({"step": step, "mask": mask, "h": h, **({"c": c} if c is not None else {})})
        return new

    def step_unchecked(self, x: Tensor, state: Any, step: int, mask: Tensor | None) -> Any:
        """One step without input checks: :meth:`forward` and the layers' loops call it.

        ``x`` ``(B, input_size)``; ``state`` as :meth:`initial_state` makes it; ``step`` the time index (for
        per-timestep norms); ``mask`` ``(B,)`` bool or ``None``, ``False`` for padded rows, which keep their state
        (:meth:`settle`) and must enter no batch statistics (pass it to the norms). Where the state enters the
        recurrent term, take it through :meth:`recurrent_input`, and the recurrent weight through
        :meth:`recurrent_weight`: the layers' variational recurrent dropout and DropConnect, drawn once per
        sequence, reach the step there (a layer refuses a cell that never asks while they are on). Zoneout, drawn
        at every step, is the cell's (:meth:`settle`).
        """
        raise NotImplementedError(f"{type(self).__name__}: a cell defines step_unchecked() (its step)")

    def recurrent_input(self, h: Tensor) -> Tensor:
        """``h`` where it enters the recurrent term: with the layer's variational recurrent dropout applied while a
        layer runs a sequence with it (its mask drawn once per sequence), else ``h`` itself. The carried state is
        not dropped: only what the recurrent weight multiplies."""
        drawn = self._running()
        if drawn is None or drawn.recurrent is None:
            return h
        drawn.inputs_read += 1
        return h * drawn.recurrent

    def recurrent_weight(self) -> Tensor:
        """The recurrent weight for this step: the layer's DropConnect copy of ``weight_hh`` (drawn once per
        sequence), or the one the layer computed once for the sequence (weight norm), else ``self.weight_hh``."""
        drawn = self._running()
        if drawn is None or drawn.weight_hh is None:
            return self.weight_hh
        drawn.weights_read += 1
        return drawn.weight_hh

    def _running(self) -> SequenceRegularizers | None:
        running = getattr(_RUNNING, "cells", None)
        return None if not running else running.get(self)

    @contextlib.contextmanager
    def running_sequence(self, drawn: SequenceRegularizers) -> Iterator[SequenceRegularizers]:
        """While a layer runs one sequence of this cell (in this thread): what it drew, for
        :meth:`recurrent_input` and :meth:`recurrent_weight` to hand the steps."""
        running = getattr(_RUNNING, "cells", None)
        if running is None:
            running = _RUNNING.cells = {}
        running[self] = drawn
        try:
            yield drawn
        finally:
            del running[self]

    def settle(self, new: Tensor, old: Tensor, mask: Tensor | None, rate: float = 0.0) -> Tensor:
        """A state tensor after a step: :meth:`zoneout` at ``rate`` (a fresh draw in training), then the padded rows
        (``mask`` ``False``) keep ``old``, so a loop over a padded batch ends at each row's last real step."""
        new = self.zoneout(new, old, rate)
        return new if mask is None else torch.where(mask.unsqueeze(1), new, old)

    def sequence_input_norm(self, x: Tensor, mask: Tensor | None, counts: list[int]) -> list[Tensor] | None:
        """Per step of ``x`` ``(T, B, input_size)``, the normalized input term where its statistics need the whole
        sequence (``input_stats="sequence"``), which a gated cell's step takes as ``input_normed``
        (:meth:`~seqnorm.cells.gated.GatedCell.step_terms`); ``None`` (here): each step normalizes its own input."""
        return None

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
