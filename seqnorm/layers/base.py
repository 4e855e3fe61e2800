"""The time loop shared by :class:`~seqnorm.LSTM` and :class:`~seqnorm.GRU`: stacking, direction, lengths, packing.

Cells do one step; this module owns time. Variable lengths are explicit: at step ``t`` the rows with
``t >= lengths[b]`` are masked, so they enter no batch statistics, keep their state (the final state is each
sequence's state at its last real step) and output zeros. A reverse direction runs over each sequence's real part
reversed (padding stays at the end), as ``torch.nn.LSTM`` does with packed sequences.

Every path runs a sequence through :mod:`seqnorm.layers.sequence` (the padding layout, the stack of layers and
directions, one direction's loop); the plain reference is that loop with each cell's own step. By default
(``impl="auto"``) layers run a faster path with the same results — torch's fused kernel when nothing is normalized,
otherwise the input side of all steps at once and a lean loop or the device's kernels — chosen in one place,
:func:`seqnorm.layers.plan.plan_for`, from what the cells and norms declare (see :meth:`RecurrentLayer.plan`);
``impl="reference"`` forces the reference, and the plan's other path names pin theirs.
"""

from __future__ import annotations

import logging
import warnings
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

from seqnorm.cells.base import RecurrentCell
from seqnorm.init import InitName, resolve_init
from seqnorm.layers.arguments import check_first_step, prepare
from seqnorm.layers.finite import watch_input_gradient
from seqnorm.layers.keys import TORCH_KEY, from_torch_keys, to_torch_keys, torch_keys_in_errors
from seqnorm.layers.plan import Plan, log, plan_for
from seqnorm.layers.sequence import (
    IMPLS,
    Impl,
    padding_layout,
    run_direction,
    run_fast,
    run_fused,
    run_stack,
    step_cell,
)
from seqnorm.layers.stepping import forget, lean_layer_step
from seqnorm.norms import DEFAULT_MAX_STEPS, NormName, NormSpec, check_placement, refuse_removed_keywords, resolve_norm
from seqnorm.norms.sync import synchronized_steps
from seqnorm.torch_capture import captured_by_export, refuse_scripting
from seqnorm.validation import (
    check_finite,
    check_positive_int,
    check_proj_size,
    check_rate,
    check_state_shape,
    check_step,
)

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["RecurrentLayer", "RecurrentState"]


class RecurrentState(NamedTuple):
    """State carried by :meth:`RecurrentLayer.step` between calls.

    Attributes:
        h: ``(num_layers, B, H_out)`` (``H_out``: ``proj_size`` if set, else ``H``).
        c: ``(num_layers, B, H)`` for LSTMs, ``None`` for GRUs.
        step: index of the next time step (selects per-timestep batch statistics).
    """

    h: Tensor
    c: Tensor | None
    step: int


class RecurrentLayer(nn.Module):
    """Base of the multi-layer, optionally bidirectional recurrent layers, of any :class:`~seqnorm.RecurrentCell`:
    ``class IndRNN(seqnorm.RecurrentLayer): cell_class = IndRNNCell`` is a layer with ``torch.nn.LSTM``'s arguments,
    ``lengths``, packed sequences, :meth:`step` and the cells' parameters under torch's state-dict keys
    (``weight_hh_l0``), running the cell's own step (the reference path) unless the cell declares a fast form.
    """

    cell_class: ClassVar[type[RecurrentCell]]

    @refuse_removed_keywords
    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        *,
        recurrent_dropout: float = 0.0,
        input_dropout: float = 0.0,
        weight_dropout: float = 0.0,
        zoneout_h: float = 0.0,
        zoneout_c: float = 0.0,
        proj_size: int = 0,
        norm: NormName | NormSpec = "none",
        max_steps: int = DEFAULT_MAX_STEPS,
        init: InitName = "default",
        forget_bias: float | None = None,
        impl: Impl = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        if impl not in IMPLS:
            raise ValueError(f"{owner}: expected impl to be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
        self.impl: Impl = impl
        self.input_size = check_positive_int(owner, "input_size", input_size)
        self.hidden_size = check_positive_int(owner, "hidden_size", hidden_size)
        self.num_layers = check_positive_int(owner, "num_layers", num_layers)
        # Resolved and checked here, once, so that errors name the layer: the cells get the spec.
        self.norm_spec = resolve_norm(owner, norm, max_steps)
        init = resolve_init(init, owner)
        check_placement(owner, self.norm_spec, has_cell_state=self.cell_class.has_cell_state)
        self.dropout = check_rate(owner, "dropout", dropout)
        if self.dropout and self.num_layers == 1:  # torch.nn.LSTM warns the same
            warnings.warn(
                f"{owner}: dropout={dropout} has no effect with num_layers=1 (it applies between stacked layers; "
                "recurrent_dropout and input_dropout act within a layer)",
                stacklevel=2,
            )
        self.recurrent_dropout = check_rate(owner, "recurrent_dropout", recurrent_dropout)
        self.input_dropout = check_rate(owner, "input_dropout", input_dropout)
        self.weight_dropout = check_rate(owner, "weight_dropout", weight_dropout)
        self.zoneout_h = check_rate(owner, "zoneout_h", zoneout_h)
        self.zoneout_c = check_rate(owner, "zoneout_c", zoneout_c)
        if self.zoneout_c and not self.cell_class.has_cell_state:
            raise ValueError(f"{owner}: expected zoneout_c=0 (there is no cell state), got {zoneout_c!r}")
        if forget_bias is not None:  # here too, so that the error names the layer rather than its cells
            check_finite(owner, "forget_bias", forget_bias)
        self.bias = bool(bias)
        self.batch_first = bool(batch_first)
        self.bidirectional = bool(bidirectional)
        self.proj_size = check_proj_size(owner, proj_size, hidden_size, self.cell_class.supports_projection)
        self.norm = self.norm_spec.name
        directions = 2 if bidirectional else 1
        self.cells = nn.ModuleList(
            self.cell_class(
                input_size if layer == 0 else self.state_size * directions,
                hidden_size,
                bias,
                norm=self.norm_spec,
                max_steps=max_steps,  # for the norms that ignore it (the spec holds it for those that use it)
                init=init,
                forget_bias=forget_bias,
                zoneout_h=zoneout_h,
                zoneout_c=zoneout_c,
                proj_size=proj_size,
                device=device,
                dtype=dtype,
            )
            for layer in range(num_layers)
            for _ in range(directions)
        )
        self.register_state_dict_post_hook(to_torch_keys)
        self.register_load_state_dict_pre_hook(from_torch_keys)
        self.register_load_state_dict_post_hook(torch_keys_in_errors)

    @property
    def num_directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def state_size(self) -> int:
        """Features of ``h`` (and of each direction's output): ``proj_size`` if set, else ``hidden_size``."""
        return self.proj_size or self.hidden_size

    def extra_repr(self) -> str:
        shown = self.norm_spec if self.norm_spec.options() else self.norm
        text = f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, norm={shown!r}"
        for name in ("batch_first", "bidirectional"):
            if getattr(self, name):
                text += f", {name}=True"
        if self.proj_size:
            text += f", proj_size={self.proj_size}"
        for name in ("dropout", "recurrent_dropout", "input_dropout", "weight_dropout", "zoneout_h", "zoneout_c"):
            if getattr(self, name):
                text += f", {name}={getattr(self, name)}"
        if self.impl != "auto":
            text += f", impl={self.impl!r}"
        return text

    def __prepare_scriptable__(self) -> nn.Module:
        refuse_scripting(self)
        return self

    def train(self, mode: bool = True) -> Self:
        """``nn.Module.train``; also drops the cached generation step (:func:`seqnorm.layers.stepping.forget`)."""
        forget(self)
        return super().train(mode)

    def flatten_parameters(self) -> None:
        """Nothing to do; here so that code written for ``torch.nn.LSTM``/``GRU`` (which calls it to lay the weights
        out for cuDNN) runs unchanged: no path of these layers reads a flattened copy of the weights."""

    @property
    def all_weights(self) -> list[list[Tensor]]:
        """As ``torch.nn.LSTM.all_weights``: per layer and direction, ``[weight_ih, weight_hh, bias_ih, bias_hh]``
        (those that exist), then ``weight_hr`` with ``proj_size`` (weight norm: the computed weights). The norms'
        own parameters are in :meth:`parameters`, under the cells' names."""
        names = ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr")
        return [[w for w in (getattr(cell, name, None) for name in names) if w is not None] for cell in self.cells]

    def reset_parameters(self) -> None:
        """Reinitialize every cell (:meth:`RecurrentCell.reset_parameters`: weights, forget bias, norms)."""
        for cell in self.cells:
            cell.reset_parameters()

    def __getattr__(self, name: str) -> Any:
        # torch.nn.LSTM exposes `weight_ih_l0` etc. as attributes; resolve them to the cell that holds them.
        try:
            return super().__getattr__(name)
        except AttributeError:
            held = self._torch_named(name)
            if held is None:
                raise
            value = getattr(*held)
            if value is None:  # as torch's: no weight_hr_l0 without proj_size, no bias_ih_l0 without bias
                raise
            return value

    def __setattr__(self, name: str, value: Any) -> None:
        # `lstm.weight_hh_l0 = nn.Parameter(...)` replaces the cell's weight, as in torch.nn.LSTM (it set a new
        # attribute of the layer that the cells never read, silently).
        held = self._torch_named(name) if name not in self.__dict__ else None
        if held is None:
            super().__setattr__(name, value)
        else:
            setattr(*held, value)

    def __delattr__(self, name: str) -> None:
        held = self._torch_named(name)
        if held is None:
            super().__delattr__(name)
        else:
            delattr(*held)

    def _torch_named(self, name: str) -> tuple[RecurrentCell, str] | None:
        """The cell and attribute that torch's name ``name`` (``weight_ih_l0``, ``bias_hh_l1_reverse``) stands for;
        ``None`` for any other name, or one past the layers and directions there are."""
        match = TORCH_KEY.fullmatch(name)
        cells = self.__dict__.get("_modules", {}).get("cells")
        if match is None or match["rest"] or cells is None:
            return None
        index = int(match["layer"]) * self.num_directions + (1 if match["reverse"] else 0)
        if index >= len(cells) or (match["reverse"] and not self.bidirectional):
            return None
        return cells[index], match["name"]

    # --- whole sequences -----------------------------------------------------------------------------------------

    def forward(
        self,
        input: Tensor | PackedSequence,
        hx: Any = None,
        lengths: Tensor | list[int] | None = None,
        *,
        first_step: int = 0,
    ) -> tuple[Tensor | PackedSequence, Any]:
        """Run the whole sequence; returns what ``torch.nn.LSTM``/``GRU`` return.

        ``first_step`` is the time index of the input's first step, as seen by per-timestep norms (step ``t`` of
        ``input`` uses the statistics of step ``first_step + t``). With ``hx`` the final state of the previous
        chunk, ``layer(chunk, hx, first_step=k)`` continues a sequence cut into chunks, as stateful truncated
        BPTT does. Unidirectional layers only (a reverse direction has no continuation).
        """
        x, lengths, h0, c0, unbatched = prepare(self, input, hx, lengths)
        first_step = check_first_step(self, first_step)
        exporting = captured_by_export(self)
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            forget(self)  # a training step: its update may go through .data, which the step cache cannot see
        x = watch_input_gradient(type(self).__name__, x, x.shape[0], self.cells[0].scheme.batch_statistics)
        output, h_n, c_n = self._run(x, h0, c0, lengths, first_step, exporting=exporting)
        state: Any = h_n if c_n is None else (h_n, c_n)
        if isinstance(input, PackedSequence):
            return _repack(output, lengths, input), state
        if unbatched:
            return output.squeeze(1), (h_n.squeeze(1) if c_n is None else (h_n.squeeze(1), c_n.squeeze(1)))
        return (output.transpose(0, 1) if self.batch_first else output), state

    def plan(
        self,
        input: Tensor | PackedSequence,
        hx: Any = None,
        lengths: Tensor | list[int] | None = None,
        *,
        first_step: int = 0,
    ) -> Plan:
        """The path a call with these arguments takes now, and why (:mod:`seqnorm.layers.plan`); runs nothing.

        With a 2-D ``input`` ``(B, input_size)`` and no ``hx``/``lengths``: the path of :meth:`step` instead.
        """
        if isinstance(input, Tensor) and input.dim() == 2 and hx is None and lengths is None and not first_step:
            return plan_for(self, input, step=True)
        x, lengths, *_ = prepare(self, input, hx, lengths)  # hx checked as a call would check it
        return plan_for(self, x, lengths, first_step=check_first_step(self, first_step))

    def _run(
        self,
        x: Tensor,
        h0: Tensor,
        c0: Tensor | None,
        lengths: Tensor | None,
        first_step: int = 0,
        exporting: bool = False,
    ) -> tuple[Tensor, ...]:
        """Run ``x`` ``(T, B, I)`` on the path :func:`~seqnorm.layers.plan.plan_for` picks; output, h_n, c_n.

        ``exporting``: torch.export is capturing the call (:mod:`seqnorm.torch_capture`), so torch's kernel or the
        reference loop, never the fast paths' hand-written autograd."""
        steps = x.shape[0]
        # Outside a distributed run no norm synchronizes: the common case asks nothing of seqnorm.norms.sync.
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        longest = synchronized_steps(self, steps, x.device) if distributed else None
        if longest is not None:
            # Norms synchronized across processes (they declare no fast form: the reference path): every process runs
            # as many steps as the longest input of any, the extra ones padding (no active row here; the collectives
            # of those steps still need this process).
            if lengths is None:
                lengths = torch.full((x.shape[1],), steps, dtype=torch.long)
            x = torch.cat([x, x.new_zeros(longest - steps, *x.shape[1:])])
            output, *final = self._run_reference(x, h0, c0, lengths, first_step, run_every_step=True)
            return (output[:steps], *final)
        plan = plan_for(self, x, lengths, first_step=first_step)
        if exporting and plan.path != "torch_kernel":
            return self._run_reference(x, h0, c0, lengths, first_step)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s.forward: %s", type(self).__name__, plan)
        if plan.path == "torch_kernel":
            return run_fused(self, x, h0, c0, lengths)
        if plan.path in ("kernel", "triton", "loop"):
            return run_fast(self, x, h0, c0, lengths, plan)
        return self._run_reference(x, h0, c0, lengths, first_step)

    def _run_reference(
        self,
        x: Tensor,
        h0: Tensor,
        c0: Tensor | None,
        lengths: Tensor | None,
        first_step: int = 0,
        run_every_step: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """The reference time loop over ``x`` ``(T, B, I)``; returns output ``(T, B, D*H)``, ``h_n``, ``c_n``.

        Steps after the longest sequence are skipped unless ``run_every_step``."""
        layout = padding_layout(lengths, x.shape[0], x.shape[1], x.device, run_every_step)
        return run_stack(self, x, h0, c0, layout, partial(run_direction, self, None, first_step=first_step))

    # --- one step at a time ----------------------------------------------------------------------------------------

    def step(self, x: Tensor, state: RecurrentState | None = None) -> tuple[Tensor, RecurrentState]:
        """Advance every layer by one time step, for streaming and generation (batch size 1 included).

        Args:
            x: ``(B, input_size)``, the input at the next time step.
            state: what the previous call returned, or ``None`` to start from zeros at step 0.

        Returns:
            ``(output, state)``: the top layer's ``h`` ``(B, P)`` (``P``: ``proj_size`` or ``hidden_size``) and
            the new :class:`RecurrentState`, whose ``step`` has advanced by one. Inter-layer dropout and zoneout
            apply in training; the per-sequence masks (recurrent, input and weight dropout) do not: they need one
            mask for a whole sequence.
        """
        owner = type(self).__name__
        if self.bidirectional:
            raise ValueError(f"{owner}: expected a unidirectional layer for step(), got bidirectional=True")
        cells = self._modules["cells"]  # not self.cells (two __getattr__ calls) nor cells[0]: slow at every step
        first = next(iter(cells._modules.values()))
        first.check_input(x, None, owner)
        batch = x.shape[0]
        if state is None:
            h = x.new_zeros(self.num_layers, batch, self.state_size)
            c = x.new_zeros(self.num_layers, batch, self.hidden_size) if first.has_cell_state else None
            state = RecurrentState(h, c, 0)
        elif not isinstance(state, RecurrentState):
            raise ValueError(f"{owner}: expected state to be the RecurrentState step() returned, got {type(state)}")
        else:
            check_state_shape(owner, "state.h", state.h, (self.num_layers, batch, self.state_size), x)
            if first.has_cell_state:
                check_state_shape(owner, "state.c", state.c, (self.num_layers, batch, self.hidden_size), x)
            if type(state.step) is not int or state.step < 0:  # the C++ step indexes BN's statistics with it
                state = state._replace(step=check_step(owner, state.step, "state.step"))
        # Under torch.export the cells' own steps (the cached step reads storage addresses, which export's stand-in
        # tensors do not have); captured_by_export also refuses what it refuses for forward.
        exporting = captured_by_export(self)
        lean = None if exporting else lean_layer_step(self, x)  # without gradients: each cell's step prepared once
        if lean is not None:
            output, h, c = lean(x, state.h, state.c, state.step)
            return output, RecurrentState(h, c, state.step + 1)
        plan = plan_for(self, x, step=True)
        # Every layer steps on (1, B, .) slices of the state, so the new state needs no stacking for one layer.
        single = self.num_layers == 1
        h_next, c_next = [], []
        layer_input = x
        for layer, cell in enumerate(cells):
            h = state.h if single else state.h.narrow(0, layer, 1)
            c = state.c if single or state.c is None else state.c.narrow(0, layer, 1)
            h, c = step_cell(plan.cells[layer], cell, layer_input, h, c, state.step)
            h_next.append(h)
            c_next.append(c)
            layer_input = h
            if self.dropout and self.training and layer < self.num_layers - 1:
                layer_input = F.dropout(layer_input, self.dropout, training=True)
        if not single:
            h = torch.cat(h_next)
            c = None if c is None else torch.cat(c_next)
        return h_next[-1].select(0, 0), RecurrentState(h, c, state.step + 1)


def _repack(output: Tensor, lengths: Tensor, like: PackedSequence) -> PackedSequence:
    """Pack ``output`` ``(T, B, F)`` (original batch order) with the batch layout of the input ``like``."""
    if like.sorted_indices is not None:
        output = output.index_select(1, like.sorted_indices)
        lengths = lengths.index_select(0, like.sorted_indices.cpu())
    data = pack_padded_sequence(output, lengths, enforce_sorted=True).data
    return PackedSequence(data, like.batch_sizes, like.sorted_indices, like.unsorted_indices)
