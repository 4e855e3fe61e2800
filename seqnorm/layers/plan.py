"""Which path a layer's call or step takes, decided in one place from what its cells and norms declare.

:func:`plan_for` returns a :class:`Plan`: the path and why. Forward paths:

- ``"torch_kernel"``: torch's fused LSTM/GRU over the whole sequence (:func:`seqnorm.layers.sequence.run_fused`). Needs
  cells that declare ``torch_kernel``, nothing normalized (``"none"``, or plain ``"weight"``), no random draws (their
  masks would differ from the reference's) and no autocast (torch's CPU LSTM kernel fails in bfloat16).
- ``"kernel"`` (``"triton"``): the input side of all steps at once, then the device's backend's recurrence, forward
  and backward through time (:mod:`seqnorm.layers.compiled`): the C++ kernels on the CPU, the Triton kernels on CUDA
  (or on the CPU with ``SEQNORM_BACKEND=triton``; the path is named after the backend's
  :attr:`~seqnorm.kernels.backend.Backend.name`). The kernels restate torch's LSTM/GRU step: they need
  ``torch_kernel``, the default norm placement, no variational recurrent dropout, zoneout or projection, recurrent
  and cell-state norms that declare the ``"kernel"`` form (an input norm that does not is applied before), and the
  kernels built and loaded for the input's device (:func:`seqnorm.kernels.native`); with or without a gradient.
  :attr:`Plan.cells` says which directions run them (the others run the loop) and :attr:`Plan.input_norms` whether
  each one's input norm runs inside them.
- ``"loop"``: the input side at once, then the cell's ``step_terms`` given each step's input term: needs cells
  that declare ``hoisted_step`` and norms that declare the ``"loop"`` form.
- ``"reference"``: the cell's own ``step_unchecked`` at every step. Anything that declares nothing runs it, as do
  ``impl="reference"``, hooked observers (they need every step's record) and a batch norm about to raise its
  small-batch error (so the error, and what was updated before it, are the reference's own), and a call starting
  at ``first_step > 0`` with a norm whose statistics depend on the step index (the fast paths number steps from 0;
  norms without per-timestep statistics ignore the index, so they keep their fast path).

:meth:`~seqnorm.layers.base.RecurrentLayer.step` paths: ``"lean_step"`` (no gradient: the cached step of
:mod:`seqnorm.layers.stepping`; per cell ``"kernel"``, the compiled generation step, where the cell's norms (if any)
declare the ``"kernel"`` form and the kernels are loaded, else ``"lean_step"``), else per cell ``"torch_kernel"``
(torch's cell kernel, nothing normalized) or ``"reference"``.

Declarations are class attributes, read from the class's *own* namespace (:func:`declared`): cells declare
``torch_kernel``, ``hoisted_step`` (and ``gate_layout``, ``has_cell_state``); norm modules ``fast_forms`` (an
instance configured beyond a form says why in ``fast_form_blocker``: :func:`norm_blocker`). A subclass inherits none
of them, because changing any method of the step would make a fast form
compute something else; one that keeps the math restates the claim in one line. Weight norm's parametrization
subclass is looked through. Set ``logging.getLogger("seqnorm.layers.plan")`` to DEBUG to see every forward's plan.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn
from torch.nn.utils.parametrize import type_before_parametrizations

from seqnorm import kernels
from seqnorm.kernels import NO_NORM, KernelNorm
from seqnorm.torch_ops import functorch_transforming

if TYPE_CHECKING:
    from seqnorm.cells.base import RecurrentCell
    from seqnorm.layers.protocol import Layer

__all__ = [
    "Path",
    "Plan",
    "cell_kernel",
    "cell_kernel_norms",
    "declared",
    "kernel_input_norm",
    "kernel_path",
    "kernel_route",
    "log",
    "norm_blocker",
    "plan_for",
]

Path = Literal["torch_kernel", "kernel", "triton", "loop", "lean_step", "reference"]
FastForm = Literal["loop", "generation", "kernel"]
log = logging.getLogger(__name__)

_FLOATS = (torch.float32, torch.float64)


@dataclass(frozen=True)
class Plan:
    """A path and why it was chosen; ``cells`` has each cell's path (layer-major, as ``layer.cells``) where they
    may differ (the kernels' or ``"loop"`` per direction; per cell for a step); ``input_norms``, per cell on the
    kernels, whether its input norm runs inside them (else :meth:`~seqnorm.cells.base.RecurrentCell.input_terms`
    applies it before)."""

    path: Path
    reason: str
    cells: tuple[Path, ...] = ()
    input_norms: tuple[bool, ...] = ()
    kernel_norms: tuple[tuple[KernelNorm, ...] | None, ...] = ()
    """Per cell on the kernels, what its norms hand them (:func:`cell_kernel_norms`, without their shifts), built
    once for the plan's checks and the run (``None`` for a cell on the loop)."""

    def __str__(self) -> str:
        per_cell = f" (cells: {', '.join(self.cells)})" if len(set(self.cells)) > 1 else ""
        return f"{self.path}: {self.reason}{per_cell}"


def declared(owner: nn.Module | type, name: str, default: Any) -> Any:
    """``name`` as declared by ``owner``'s own class (not inherited; weight norm's parametrization looked through)."""
    cls = owner if isinstance(owner, type) else type_before_parametrizations(owner)
    return cls.__dict__.get(name, default)


def cell_kernel(cell: RecurrentCell) -> Literal["lstm", "gru"] | None:
    """The torch kernel whose step ``cell``'s class declares it computes, if any."""
    return declared(cell, "torch_kernel", None)


def norm_blocker(module: nn.Module | None, form: FastForm) -> str | None:
    """Why ``module`` cannot run the ``form`` (``"loop"``, ``"generation"`` or ``"kernel"``), or ``None`` if it can (no
    norm can).

    The class declares the forms it implements (``fast_forms``); an instance configured beyond one says so through
    its optional ``fast_form_blocker(form)`` (mean-only or pooled BatchNorm, say). The form's math is the module's own
    (:class:`~seqnorm.norms.protocol.StepPieces`).
    """
    if module is None:
        return None
    name = type_before_parametrizations(module).__name__
    if form not in declared(module, "fast_forms", frozenset()):
        return f"{name} declares no {form!r} form"
    instance_check = getattr(module, "fast_form_blocker", None)
    blocker = None if instance_check is None else instance_check(form)
    if blocker is None and getattr(module, "weight", None) is None:
        return f"{name} without γ (affine=False)"
    return blocker


def plan_for(
    layer: Layer,
    x: Tensor,
    lengths: Tensor | None = None,
    *,
    step: bool = False,
    first_step: int = 0,
) -> Plan:
    """The path of ``layer`` for input ``x`` (``(T, B, I)``; with ``step=True`` one step, ``(B, I)``).

    Only facts are read from ``x``: batch size, dtype, device.
    ``first_step`` is the time index of the sequence's first step (:meth:`RecurrentLayer.forward`).
    """
    return _step_plan(layer, x) if step else _forward_plan(layer, x, lengths, first_step)


def kernel_route(
    layer: Layer | None, cell: RecurrentCell, dtype: torch.dtype, device: str
) -> tuple[str | None, tuple[KernelNorm, ...] | None]:
    """Why the device's kernels (:mod:`seqnorm.layers.compiled`) cannot run ``cell``'s recurrence exactly, and
    ``None``; or, where nothing blocks, ``None`` and the cell's :func:`cell_kernel_norms`, which the last check
    built (the plan carries them to the run).

    ``layer`` supplies the variational recurrent dropout (``None``: none drawn).
    """
    name = type_before_parametrizations(cell).__name__
    if cell_kernel(cell) is None:
        return f"{name} declares no torch_kernel, whose step the kernels restate", None
    if cell.norm_placement != "separate" or cell.state_norm != "output":
        return "norm_placement/state_norm other than the defaults", None
    if layer is not None and layer.training and layer.recurrent_dropout:
        return "variational recurrent dropout", None
    if cell.draws_random:
        return "zoneout", None
    if cell.weight_hr is not None:
        return "a projection", None
    for norm in (cell.norm_hh, cell.norm_c):
        blocker = norm_blocker(norm, "kernel")
        if blocker is not None:
            return f"a recurrent or cell-state norm: {blocker}", None
    built = cell_kernel_norms(cell)
    # the backend says what it runs of half precision and autocast (asked last: loading the kernels, it may build)
    untried = _compiled_blocker(device, cell, dtype, norms=built)
    return (untried, None) if untried is not None else (None, built)


def kernel_input_norm(cell: RecurrentCell) -> bool:
    """Whether the kernels run ``cell``'s input norm step by step (it declares the ``"kernel"`` form); else
    :meth:`~seqnorm.cells.base.RecurrentCell.input_terms` applies it beforehand (sequence-wise statistics, say)."""
    return cell.norm_ih is not None and norm_blocker(cell.norm_ih, "kernel") is None


def kernel_path(device: str) -> Path:
    """The path's name for the device's kernels: the backend's (``"kernel"`` on the CPU, ``"triton"`` on CUDA)."""
    backend = kernels.native(device)
    assert backend is not None, "asked only where the kernels run"
    return backend.name  # type: ignore[return-value]


def cell_kernel_norms(cell: RecurrentCell) -> tuple[KernelNorm, ...]:
    """What ``cell``'s norms hand the kernels, without their shifts (the run adds them): the input norm's where the
    kernels run it (else :data:`~seqnorm.kernels.NO_NORM`, ``input_terms`` applying it before), the recurrent norm's
    and, for an LSTM, the cell-state norm's. Each module's own ``kernel_norm``, asked once per call."""

    def of(norm: nn.Module | None) -> KernelNorm:
        return NO_NORM if norm is None else norm.kernel_norm(None)  # type: ignore[operator]

    recurrent = (of(cell.norm_hh), of(cell.norm_c)) if cell_kernel(cell) == "lstm" else (of(cell.norm_hh),)
    return (of(cell.norm_ih) if kernel_input_norm(cell) else NO_NORM, *recurrent)


def _compiled_blocker(
    device: str,
    cell: RecurrentCell,
    dtype: torch.dtype,
    step: bool = False,
    norms: tuple[KernelNorm, ...] | None = None,
) -> str | None:
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():  # opaque to both; the plain path traces
        return "torch.compile or torch.export is tracing"
    if functorch_transforming():
        return "a torch.func transform (grad, vmap, jvp) is running"
    backend = kernels.native(device)  # asked last: the first miss warns why
    if backend is None:
        return f"no compiled kernels for {device!r} ({kernels.status(device)})"
    # The norms the backend would be given (the others declare the form, or are None): an input norm it does not
    # run is applied before (input_terms).
    kinds = tuple(norm.kind for norm in (cell_kernel_norms(cell) if norms is None else norms))
    autocast = torch.is_autocast_enabled(device)
    if autocast:  # the recurrence runs in the parameters' dtype, its input projection under autocast
        dtype = cell.weight_hh.dtype
    unsupported = backend.unsupported(kinds, dtype, step=step, training=cell.training, autocast=autocast)
    return None if unsupported is None else f"the {backend.name} backend: {unsupported}"


# --- whole sequences ---


def _forward_plan(
    layer: Layer,
    x: Tensor,
    lengths: Tensor | None,
    first_step: int = 0,
) -> Plan:
    if layer.impl == "reference":
        return Plan("reference", "impl='reference'")
    chosen = _auto_forward_plan(layer, x, lengths, first_step)
    if layer.impl == "auto" or (layer.impl == chosen.path and set(chosen.cells) <= {chosen.path}):
        return chosen
    return _pinned_plan(layer, chosen, x)


def _pinned_plan(layer: Layer, chosen: Plan, x: Tensor) -> Plan:
    """The plan of a path ``impl=`` pins, where this call can run it; else a ``ValueError`` saying why, and what
    ``"auto"`` would run. ``"loop"`` runs wherever the hoisted input terms do (the kernels' calls and torch's
    kernel's, for cells that declare ``hoisted_step``); the kernels where every cell's recurrence can run on them;
    torch's kernel only where the plan would choose it."""
    cells: list[RecurrentCell] = list(layer.cells)
    pinned, count = layer.impl, len(cells)
    why = chosen.reason
    if pinned == "loop" and chosen.path != "reference":
        why = _hoisting_blocker(cells) or ""
        if not why:
            return Plan("loop", "impl='loop'", ("loop",) * count, (False,) * count, (None,) * count)
    elif pinned == "torch_kernel" and chosen.path != "reference":
        why = _torch_kernel_blocker(layer, cells, x) or why
    elif pinned in ("kernel", "triton") and chosen.path != "reference":
        checked = [kernel_route(layer, cell, x.dtype, x.device.type) for cell in cells]
        why = _hoisting_blocker(cells) or next((blocker for blocker, _ in checked if blocker is not None), "")
        if not why and kernel_path(x.device.type) != pinned:
            why = f"the kernels for {x.device.type!r} are the {kernel_path(x.device.type)!r} backend"
        if not why:
            inside = tuple(kernel_input_norm(cell) for cell in cells)
            return Plan(pinned, f"impl={pinned!r}", (pinned,) * count, inside, tuple(b for _, b in checked))
    raise ValueError(
        f"{type(layer).__name__}: impl={pinned!r} cannot run this call: {why}; impl='auto' runs {chosen.path!r} here"
    )


def _auto_forward_plan(layer: Layer, x: Tensor, lengths: Tensor | None, first_step: int) -> Plan:
    """The path the plan chooses by itself (``impl="auto"``)."""
    cells: list[RecurrentCell] = list(layer.cells)
    if first_step and any(cell.indexed_by_step for cell in cells):
        return Plan("reference", f"first_step={first_step} with per-timestep statistics (fast paths count from 0)")
    for index, cell in enumerate(cells):
        if cell.observer.active:
            return Plan("reference", f"an observer is hooked to cells[{index}] and needs every step's record")
    if layer.training and _would_raise_small_batch(cells, lengths, x.shape[1]):
        return Plan("reference", "a batch norm raises its small-batch error (a step or batch with < 2 real rows)")
    name = type_before_parametrizations(cells[0]).__name__
    kernel = cell_kernel(cells[0])
    blocked = _torch_kernel_blocker(layer, cells, x)
    if blocked is None:
        return Plan("torch_kernel", f"{name} declares torch_kernel={kernel!r} and nothing is normalized")
    if kernel is None:
        kernel_note = f"; {name} declares no torch_kernel"
    else:  # normalized cells are the common case, and need no note
        kernel_note = "" if any(c.has_norms for c in cells) else f"; not torch's kernel: {blocked}"
    undeclared = _hoisting_blocker(cells)
    if undeclared is not None:
        return Plan("reference", undeclared + kernel_note)
    checked = [kernel_route(layer, cell, x.dtype, x.device.type) for cell in cells]
    blockers, norms = [blocker for blocker, _ in checked], tuple(built for _, built in checked)
    if all(blocker is not None for blocker in blockers):
        reason = f"{name} declares hoisted_step; not the kernels: {blockers[0]}{kernel_note}"
        return Plan("loop", reason, ("loop",) * len(cells), (False,) * len(cells), (None,) * len(cells))
    backend = kernel_path(x.device.type)
    routes: tuple[Path, ...] = tuple(backend if blocker is None else "loop" for blocker in blockers)
    inside = tuple(blocker is None and kernel_input_norm(cell) for blocker, cell in zip(blockers, cells, strict=True))
    reason = f"{name} declares torch_kernel={kernel!r} and its norms the 'kernel' form: the {backend} backend"
    return Plan(backend, reason + kernel_note, routes, inside, norms)  # None where blocked (kernel_route)


def _torch_kernel_blocker(layer: Layer, cells: list[RecurrentCell], x: Tensor) -> str | None:
    """Why torch's fused LSTM/GRU kernel cannot run these cells' sequence exactly, or ``None``."""
    kernel = cell_kernel(cells[0])
    if kernel is None or any(cell_kernel(cell) != kernel for cell in cells):
        return f"{type_before_parametrizations(cells[0]).__name__} declares no torch_kernel"
    if any(cell.has_norms for cell in cells):
        return "torch's kernel normalizes nothing"
    if _draws_random(layer):
        return "random masks that torch's kernel would draw differently"
    if torch.is_autocast_enabled(x.device.type):
        return "autocast"
    if functorch_transforming():  # torch.func.vmap has no batching rule for it
        return "a torch.func transform (grad, vmap, jvp) is running"
    return None


def _hoisting_blocker(cells: list[RecurrentCell]) -> str | None:
    for cell in cells:
        name = type_before_parametrizations(cell).__name__
        if not declared(cell, "hoisted_step", False):
            return f"{name} declares no hoisted_step"
        for norm in (cell.norm_ih, cell.norm_hh, cell.norm_gates, cell.norm_c):
            if norm is not None and "loop" not in declared(norm, "fast_forms", frozenset()):
                return f"{type(norm).__name__} in {name} declares no 'loop' form"
    return None


def _draws_random(layer: Layer) -> bool:
    """Whether a call draws random numbers, which torch's kernel would draw differently (or not at all)."""
    if not layer.training:
        return False
    per_sequence = layer.recurrent_dropout or layer.input_dropout or layer.weight_dropout
    return bool(per_sequence or (layer.dropout and layer.num_layers > 1) or any(c.draws_random for c in layer.cells))


def _would_raise_small_batch(cells: list[RecurrentCell], lengths: Tensor | None, batch: int) -> bool:
    # Norms with batch statistics declare when they raise (`raises_small_batch`).
    checks = [getattr(m, "raises_small_batch", None) for cell in cells for m in cell.modules()]
    checks = [check for check in checks if check is not None]
    if not checks:
        return False
    # The fewest real rows at any step that runs: the rows as long as the longest sequence.
    fewest = batch if lengths is None else int((lengths == lengths.max()).sum())
    return any(check(batch, fewest) for check in checks)


# --- one step ---


def _step_plan(layer: Layer, x: Tensor) -> Plan:
    cells: list[RecurrentCell] = list(layer.cells)
    if layer.impl == "reference":
        return Plan("reference", "impl='reference'", ("reference",) * len(cells))
    if torch.compiler.is_exporting():
        return Plan("reference", "torch.export is capturing: the cells' own steps", ("reference",) * len(cells))
    autocast = torch.is_autocast_enabled(x.device.type)
    lean = None
    if not torch.is_grad_enabled() and not autocast:
        lean = _lean_blocker(layer, cells, x)
        if lean is None:
            routes = tuple(_lean_route(cell, x) for cell in cells)
            return Plan("lean_step", "no gradient: each cell's step prepared once and cached", routes)
    routes = tuple(_cell_step_route(cell, autocast) for cell in cells)
    path: Path = "torch_kernel" if all(route == "torch_kernel" for route in routes) else "reference"
    reason = "torch's cell kernel: nothing normalized" if path == "torch_kernel" else "the cells' own steps"
    # without gradients, why not the lean step (a norm that declares no "generation" form, say)
    return Plan(path, reason if lean is None else f"{reason}; not the lean step: {lean}", routes)


def _cell_step_route(cell: RecurrentCell, autocast: bool) -> Path:
    if cell_kernel(cell) is None:  # asked first: such a cell may have no weight_hr or norms to ask about
        return "reference"
    # torch's cell kernels have no projection and no zoneout.
    special = cell.observer.active or cell.draws_random or cell.weight_hr is not None or autocast
    if special or cell.has_norms:
        return "reference"
    return "torch_kernel"


def _lean_route(cell: RecurrentCell, x: Tensor) -> Path:
    """A lean step's cell: the compiled generation step where its norms (if any) declare the kernel form, else
    Python's (torch's cell kernel for a cell without norms). The compiled step also serves cells without norms: with
    its weights laid out for the BLAS it measured faster than torch's ``LSTMCell`` (docs/benchmarks-archive.md)."""
    norms = (cell.norm_ih, cell.norm_hh, cell.norm_c)
    if any(norm_blocker(norm, "kernel") is not None for norm in norms):
        return "lean_step"
    unbuilt = _compiled_blocker(x.device.type, cell, x.dtype, step=True)
    return kernel_path(x.device.type) if unbuilt is None else "lean_step"


def _lean_blocker(layer: Layer, cells: list[RecurrentCell], x: Tensor) -> str | None:
    if layer.training and layer.dropout and len(cells) > 1:
        return "inter-layer dropout in training"
    if x.dtype not in _FLOATS:
        return f"dtype {x.dtype}"
    for cell in cells:
        name = type_before_parametrizations(cell).__name__
        if cell_kernel(cell) is None:
            return f"{name} declares no torch_kernel, whose step the lean step restates"
        if cell.draws_random or cell.weight_hr is not None or cell.observer.active:
            return "zoneout, a projection or an observer"
        if cell.norm_placement != "separate" or cell.state_norm != "output":
            return "norm_placement/state_norm other than the defaults"
        for norm in (cell.norm_ih, cell.norm_hh, cell.norm_c):
            blocker = norm_blocker(norm, "generation")
            if blocker is not None:
                return blocker
    if any(t.is_inference() for t in (*layer.parameters(), *layer.buffers())):
        return "tensors made under torch.inference_mode (no version counter to tell when they change)"
    return None
