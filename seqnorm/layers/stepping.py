"""A lean single time step for generation: :meth:`~seqnorm.layers.base.RecurrentLayer.step` when no gradient is wanted.

At batch size 1 a step is a chain of tiny operations, so what counts is how many there are. Without autograd the
cell's parameters are constants between optimizer steps, so everything that depends on them alone is computed once
and cached: weight norm's ``g * v / ||v||``, the biases folded together, and whatever each norm's
:meth:`~seqnorm.norms.protocol.StepPieces.generation_step` computes once (for per-timestep BatchNorm in evaluation,
each step's ``γ / sqrt(running_var + eps)`` and shift for all steps at once). A step is then two matrix-vector
products and about ten fused element-wise operations (``addcmul``, ``F.layer_norm``, ``lerp``).

The cache is keyed on the storage and version counter of every parameter and buffer of the cell, so any in-place
update (an optimizer step, ``load_state_dict``, BN running statistics) or a move to another device rebuilds it. An
update through ``.data`` (``p.data -= lr * p.grad`` in a hand-written training loop) bumps no version counter, as it
escapes autograd's checks, so the cache is also dropped (:func:`forget`) at every forward or step with gradients and
every ``train()``/``eval()``: a loop that updates through ``.data`` after its backward gets fresh steps. (Editing
``.data`` between two generation steps, with neither in between, is not seen: call ``layer.eval()`` after it.) It
is used only while gradients are disabled (``torch.no_grad()``/``inference_mode``); otherwise, and for anything it
does not reproduce exactly (see :func:`lean_layer_step`), the cells' own steps run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import torch
from torch import Tensor, nn

from seqnorm import kernels
from seqnorm.cells.base import RecurrentCell
from seqnorm.kernels import native
from seqnorm.layers.compiled import compiled_step
from seqnorm.layers.plan import cell_kernel, plan_for
from seqnorm.torch_ops import CELL_KERNELS

__all__ = ["LayerStep", "Step", "forget", "lean_layer_step"]


# run(x, h, c, step) -> (h', c'): x (B, I) or (1, B, I); h, c (1, B, .); c is None for GRUs.
Step = Callable[[Tensor, Tensor, "Tensor | None", int], tuple[Tensor, "Tensor | None"]]
Term = Callable[[Tensor, int], Tensor]


LayerStep = Callable[[Tensor, Tensor, "Tensor | None", int], tuple[Tensor, Tensor, "Tensor | None"]]


@dataclass(frozen=True)
class _Snapshot:
    """A layer's lean step and what it was built from.

    Attributes:
        watched: ``(dict, name, tensor, version, storage)`` of every parameter and buffer of the layer's cells (the
            ``_parameters``/``_buffers`` dicts of every submodule, weight norm's and the norms' included).
        observers: the cells' observers (a hooked observer needs the cells' own steps).
        training, dtype, device_type: the layer's mode and the inputs it was built for.
        compiled: whether the compiled kernels were switched on (:func:`seqnorm.kernels.enabled`) when it was built.
        run: ``run(x, h, c, step) -> (output, h', c')``.
    """

    watched: tuple[tuple[dict[str, Tensor | None], str, Tensor, int, int], ...]
    observers: tuple[nn.Module, ...]
    training: bool
    dtype: torch.dtype
    device_type: str
    compiled: bool
    run: LayerStep

    def valid(self, training: bool, dtype: torch.dtype) -> bool:
        """Whether nothing was updated in place, moved, replaced or hooked since (this runs at every step)."""
        if training != self.training or dtype != self.dtype or torch.is_autocast_enabled(self.device_type):
            return False
        if self.compiled != kernels.enabled():  # switched on or off since: the plan may route the cells elsewhere
            return False
        for observer in self.observers:
            if observer.active:
                return False
        # One Python loop measured faster than C-level maps building tuples, for the handful of tensors of a cell.
        for store, name, tensor, version, storage in self.watched:
            if store.get(name) is not tensor or tensor._version != version or tensor.data_ptr() != storage:
                return False
        return True


_CACHE: WeakKeyDictionary[nn.Module, _Snapshot] = WeakKeyDictionary()


def lean_layer_step(layer: nn.Module, x: Tensor) -> LayerStep | None:
    """The cached lean step of every cell of ``layer`` (a unidirectional RecurrentLayer), or ``None``.

    It applies where :func:`~seqnorm.layers.plan.plan_for` plans ``"lean_step"``: gradients disabled, no autocast,
    float32/float64 inputs, no inter-layer dropout in training, cells and norms that declare the form. The cache is
    rebuilt when any parameter or buffer was updated in place, moved or replaced, or the layer switched between
    training and evaluation.
    """
    if torch.is_grad_enabled():
        forget(layer)
        return None
    cached = _CACHE.get(layer)
    if cached is not None and cached.valid(layer.training, x.dtype):
        return cached.run
    plan = plan_for(layer, x, step=True)  # type: ignore[arg-type]
    if plan.path != "lean_step":
        return None
    cells = list(layer.cells)
    stores = [
        (store, name, tensor)
        for module in layer.modules()
        for store in (module._parameters, module._buffers)
        for name, tensor in store.items()
        if tensor is not None
    ]
    watched = tuple((store, name, tensor, tensor._version, tensor.data_ptr()) for store, name, tensor in stores)
    rows = x.shape[-2] if x.dim() > 1 else 1
    run = _layer_run([_build(cell, route, x.device.type, rows) for cell, route in zip(cells, plan.cells, strict=True)])
    observers = tuple(cell.observer for cell in cells)
    _CACHE[layer] = _Snapshot(watched, observers, layer.training, x.dtype, x.device.type, kernels.enabled(), run)
    return run


def forget(layer: nn.Module) -> None:
    """Drop ``layer``'s cached step, so that the next no-grad step is built from the parameters as they are then.

    The layers call it at every forward or step with gradients and every ``train()``/``eval()``: parameters updated
    through ``.data`` after a backward (which no version counter records) are seen from there on."""
    _CACHE.pop(layer, None)


def _layer_run(steps: list[Step]) -> LayerStep:
    """Every cell's step in turn on ``(1, B, .)`` slices of the state (so one layer's new state is not stacked)."""
    if len(steps) == 1:
        only = steps[0]

        def single(x: Tensor, h: Tensor, c: Tensor | None, step: int) -> tuple[Tensor, Tensor, Tensor | None]:
            h, c = only(x, h, c, step)
            return h.select(0, 0), h, c

        return single

    def stacked(x: Tensor, h: Tensor, c: Tensor | None, step: int) -> tuple[Tensor, Tensor, Tensor | None]:
        h_next, c_next = [], []
        for index, run in enumerate(steps):
            h_layer, c_layer = run(x, h.narrow(0, index, 1), None if c is None else c.narrow(0, index, 1), step)
            h_next.append(h_layer)
            c_next.append(c_layer)
            x = h_layer
        return x.select(0, 0), torch.cat(h_next), None if c is None else torch.cat(c_next)

    return stacked


def _build(cell: RecurrentCell, route: str, device_type: str, rows: int) -> Step:
    if route in ("kernel", "triton"):  # the device's generation step (the plan found its backend loaded)
        return compiled_step(cell, native(device_type), rows)
    weight_ih, weight_hh = cell.weight_ih, cell.weight_hh  # weight norm evaluated here, once
    hidden = cell.hidden_size
    if cell.norm_ih is None and cell.norm_hh is None and cell.norm_c is None:
        return _kernel_step(cell, weight_ih, weight_hh)
    if cell_kernel(cell) == "lstm":
        # Both biases are added to the same pre-activations: they follow the input norm.
        input_term = _term(weight_ih.t(), cell.norm_ih, cell.folded_bias())
        return _lstm_step(input_term, _term(weight_hh.t(), cell.norm_hh, None), _term(None, cell.norm_c, None), hidden)
    # The GRU's b_hh follows the recurrent norm (its candidate part is gated by r).
    input_term = _term(weight_ih.t(), cell.norm_ih, cell.bias_ih)
    return _gru_step(input_term, _term(weight_hh.t(), cell.norm_hh, cell.bias_hh), hidden)


def _kernel_step(cell: RecurrentCell, weight_ih: Tensor, weight_hh: Tensor) -> Step:
    """Nothing normalizes: torch's fused cell kernel, with weight norm's weights computed once."""
    parameters = (weight_ih, weight_hh, cell.bias_ih, cell.bias_hh)
    kernel = CELL_KERNELS[cell_kernel(cell)]  # type: ignore[index]
    if cell_kernel(cell) == "lstm":

        def lstm(x: Tensor, h: Tensor, c: Tensor | None, step: int) -> tuple[Tensor, Tensor | None]:
            x = x if x.dim() == 2 else x.select(0, 0)
            h, c = kernel(x, (h.select(0, 0), c.select(0, 0)), *parameters)
            return h.unsqueeze(0), c.unsqueeze(0)

        return lstm

    def gru(x: Tensor, h: Tensor, c: Tensor | None, step: int) -> tuple[Tensor, Tensor | None]:
        x = x if x.dim() == 2 else x.select(0, 0)
        return kernel(x, h.select(0, 0), *parameters).unsqueeze(0), None

    return gru


def _term(weight_t: Tensor | None, norm: nn.Module | None, bias: Tensor | None) -> Term:
    """``N(v W^T) * γ + β + bias`` of a step (``weight_t`` ``None``: ``N(v)``); the norm's part is its own
    :meth:`~seqnorm.norms.protocol.StepPieces.generation_step`, whose parameter-only work is done here, once."""
    beta = None if norm is None else norm.bias
    shift = beta if bias is None else (bias if beta is None else beta + bias)
    if norm is None:
        if weight_t is None:
            return (lambda v, step: v) if shift is None else (lambda v, step: v + shift)
        if shift is None:
            return lambda v, step: torch.matmul(v, weight_t)
        return lambda v, step: torch.matmul(v, weight_t).add_(shift)
    normalize = norm.generation_step(shift)
    if weight_t is None:
        return normalize
    return lambda v, step: normalize(torch.matmul(v, weight_t), step)


def _lstm_step(input_term: Term, recurrent_term: Term, state_term: Term, hidden: int) -> Step:
    cell_gate = 2 * hidden  # where g starts: tanh, not σ

    def run(x: Tensor, h_prev: Tensor, c_prev: Tensor | None, step: int) -> tuple[Tensor, Tensor | None]:
        pre = recurrent_term(h_prev, step).add_(input_term(x, step))  # (1, B, 4H)
        i, f, _, o = torch.sigmoid(pre).chunk(4, -1)  # (σ of the g block is not used: one operation fewer)
        c = torch.addcmul(f * c_prev, i, torch.tanh(pre.narrow(-1, cell_gate, hidden)))
        return torch.mul(o, torch.tanh(state_term(c, step))), c

    return run


def _gru_step(input_term: Term, recurrent_term: Term, hidden: int) -> Step:
    cand = 2 * hidden  # where n starts

    def run(x: Tensor, h_prev: Tensor, c_prev: Tensor | None, step: int) -> tuple[Tensor, Tensor | None]:
        a, u = input_term(x, step), recurrent_term(h_prev, step)
        r, z, _ = torch.add(a, u).sigmoid_().chunk(3, -1)  # (the n block is not used: fewer views than narrowing)
        n = torch.addcmul(a.narrow(-1, cand, hidden), r, u.narrow(-1, cand, hidden))
        return torch.lerp(n.tanh_(), h_prev, z), None  # (1 - z) n + z h

    return run
