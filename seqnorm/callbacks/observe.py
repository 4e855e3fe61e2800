"""Per-time-step statistics of seqnorm cells, gathered through their :class:`~seqnorm.cells.base.StepObserver` hooks.

Nothing here imports Lightning: :class:`Observation` hooks every cell of a module for the duration of one batch and
keeps each step's record; :meth:`Observation.summaries` reduces them over the *real* rows (the record's ``mask``;
``None`` means every row is real) to per-step profiles and time averages. Padding rows never enter a statistic: at a
padded step a row keeps its previous state, so counting it would count a sequence twice.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from seqnorm.cells.base import RecurrentCell
from seqnorm.cells.gated import GatedCell
from seqnorm.layers.base import RecurrentLayer
from seqnorm.layers.keys import cell_suffix
from seqnorm.norms import TimestepBatchNorm
from seqnorm.norms.sync import local_statistics

__all__ = ["CellSummary", "Observation", "ObservedCell", "find_cells", "logged_statistics", "train_eval_gap"]

TANH_GATES = {"lstm": 2, "gru": 2}  # LSTM g and GRU n, by the cell's torch_kernel; every other gate is a sigmoid
SIGMOID_BAND = (0.05, 0.95)
TANH_LIMIT = 0.95
HISTOGRAM_VALUES_PER_STEP = 2048  # strided subsample per tensor and step: a distribution needs no more


@dataclass(frozen=True)
class ObservedCell:
    """A cell and the name its tags carry: ``l0``, ``l1_reverse``, or ``<module path>/l0`` when a model has several
    recurrent layers; a cell outside any seqnorm layer is named by its module path."""

    name: str
    cell: RecurrentCell
    layer: RecurrentLayer | None

    @property
    def batch_statistics(self) -> bool:
        return any(isinstance(module, TimestepBatchNorm) for module in self.cell.modules())


def find_cells(module: nn.Module) -> list[ObservedCell]:
    """Every seqnorm cell in ``module`` (inside a :class:`RecurrentLayer` or on its own), layer-major."""
    layers = [(path, m) for path, m in module.named_modules() if isinstance(m, RecurrentLayer)]
    owned = {id(cell) for _, layer in layers for cell in layer.cells}
    loose = [(path, m) for path, m in module.named_modules() if isinstance(m, RecurrentCell) and id(m) not in owned]
    several = len(layers) + len(loose) > 1
    cells = []
    for path, layer in layers:
        prefix = f"{path or 'rnn'}/" if several else ""
        for index, cell in enumerate(layer.cells):
            cells.append(ObservedCell(prefix + cell_suffix(index, layer.num_directions), cell, layer))
    cells.extend(ObservedCell(path or "cell", cell, None) for path, cell in loose)
    for observed in cells:  # the statistics read the gate blocks and their norms
        if not isinstance(observed.cell, GatedCell):
            raise ValueError(
                f"HiddenStateStats: expected cells with gate blocks (seqnorm.GatedCell: LSTMCell, GRUCell), got "
                f"{type(observed.cell).__name__} at {observed.name!r}"
            )
    return cells


def _gate_names(cell: RecurrentCell) -> tuple[str, ...]:
    """The cell's ``gate_layout`` where it declares one of its ``num_gates`` blocks, else ``gate0``, ``gate1``, ..."""
    layout = tuple(getattr(cell, "gate_layout", ()))
    return layout if len(layout) == cell.num_gates else tuple(f"gate{k}" for k in range(cell.num_gates))


def _tanh_gate(cell: RecurrentCell) -> int | None:
    """The block of the tanh gate (saturated past ``|x| > TANH_LIMIT``) for torch's LSTM and GRU layouts; ``None``
    for a cell of another layout, whose gates are all counted as sigmoids (a custom cell's third block is no tanh
    gate of its own: two blocks were an IndexError, and three miscounted)."""
    return TANH_GATES.get(getattr(cell, "torch_kernel", None) or "")


def _moment_sources(cell: RecurrentCell) -> dict[str, str]:
    """statistic -> the step record's key it is computed from; moments (``_mean``, ``_std``) are reported for each."""
    sources = {"h": "h", "ih_pre": "input_raw", "hh_pre": "recurrent_raw"}
    if cell.has_cell_state:
        sources["c"] = "c"
    if cell.norm_ih is not None:
        sources.update(ih_post="input_term", hh_post="recurrent_term")
    if cell.norm_gates is not None:
        sources["gates_post"] = "input_term"  # the joint norm's output plus both biases
    if cell.has_cell_state and cell.norm_c is not None:
        sources["c_post"] = "c_out"
    return sources


def _batch_norms(cell: RecurrentCell) -> list[tuple[str, TimestepBatchNorm]]:
    """The cell's per-timestep batch norms, each with the prefix of its running-statistics scalars."""
    norms = (("ih", cell.norm_ih), ("hh", cell.norm_hh), ("gates", cell.norm_gates), ("c", cell.norm_c))
    return [(prefix, norm) for prefix, norm in norms if isinstance(norm, TimestepBatchNorm)]


def _value_group(name: str) -> str:
    if name.startswith("gate_"):
        return "gates"
    return "hidden" if name in ("h", "c") else "norm"


def logged_statistics(observed: ObservedCell) -> set[tuple[str, str]]:
    """``(group, statistic)`` of every scalar that observing ``observed`` logs: those of training steps, and the
    ``val_`` ones of the fixed validation batch (no gradients there; the train/eval gap of batch norms in a layer)."""
    cell = observed.cell
    train = {(_value_group(name), f"{name}_{moment}") for name in _moment_sources(cell) for moment in ("mean", "std")}
    train.add(("hidden", "h_zero_frac"))
    train.update(("gates", f"{gate}_sat") for gate in _gate_names(cell))
    if observed.batch_statistics:
        train.add(("norm", "active_rows_min"))
        for prefix, _ in _batch_norms(cell):
            train.update({("norm", f"{prefix}_running_mean"), ("norm", f"{prefix}_running_var")})
    validation = {(group, f"val_{statistic}") for group, statistic in train}
    if observed.batch_statistics and observed.layer is not None:
        validation.add(("norm", "val_train_eval_gap"))
    gradients = {("grad", statistic) for statistic in ("h_norm", "h_norm_first", "h_norm_last", "last_over_first")}
    return train | gradients | validation


@dataclass
class CellSummary:
    """What one observation saw in one cell.

    Attributes:
        profiles: ``(group, statistic) -> (T,)`` per-step values (NaN where a step had no real row).
        scalars: ``(group, statistic) -> value``, time averages weighting each step by its real rows.
        values: ``(group, name) -> 1-D tensor``, subsampled raw values for histograms (when kept).
        active_rows: ``(T,)`` real rows per step.
    """

    profiles: dict[tuple[str, str], Tensor] = field(default_factory=dict)
    scalars: dict[tuple[str, str], float] = field(default_factory=dict)
    values: dict[tuple[str, str], Tensor] = field(default_factory=dict)
    active_rows: Tensor | None = None


class _CellRecorder:
    """Keeps each step's record of one cell (detached references, no arithmetic) and reduces them all at once.

    The hook runs at every time step, so it only stores; the statistics are computed afterwards with a handful of
    vectorized operations over ``(entries, B, features)`` stacks, whatever the number of steps.
    """

    def __init__(self, observed: ObservedCell, threshold: float, keep_values: bool, gradients: bool) -> None:
        cell = observed.cell
        self.observed = observed
        self.threshold = threshold
        self.keep_values = keep_values
        self.gradients = gradients
        self.gates = _gate_names(cell)
        self.sources = _moment_sources(cell)
        self.entries: list[tuple[int, Tensor | None, dict[str, Tensor]]] = []
        self.grads: dict[int, Tensor] = {}  # entry index -> dL/dh of that step
        self.biases: dict[str, Tensor] = {}

    def on_step(self, module: nn.Module, args: tuple[dict[str, Any]], output: None) -> None:
        record = args[0]
        kept = {name: record[key].detach() for name, key in self.sources.items()}
        kept["gates"] = record["gates"].detach()
        if not self.biases:
            # copies: the summary is computed after the optimizer step has changed the parameters
            cell = self.observed.cell
            self.biases = {
                name: bias.detach().clone()
                for name, bias in (("ih_post", cell.bias_ih), ("hh_post", cell.bias_hh))
                if bias is not None
            }
        self.entries.append((int(record["step"]), record["mask"], kept))
        h = record["h"]
        if self.gradients and torch.is_grad_enabled() and h.requires_grad:
            h.register_hook(partial(self.on_grad, len(self.entries) - 1))

    def on_grad(self, index: int, grad: Tensor) -> None:
        self.grads[index] = grad.detach()

    def summary(self, grad_scale: float = 1.0) -> CellSummary:
        summary = CellSummary()
        if not self.entries:
            return summary
        cell = self.observed.cell
        steps = max(step for step, _, _ in self.entries) + 1
        sums: dict[str, Tensor] = {}
        widths: dict[str, int] = {}
        values: dict[str, list[Tensor]] = {}
        # entries of different batch sizes (several forwards in one observed batch) are reduced group by group
        for indices in _groups_by_batch_size(self.entries):
            index = torch.tensor([self.entries[i][0] for i in indices])
            first = self.entries[indices[0]][2]["h"]
            real = torch.stack(
                [
                    torch.ones(first.shape[0], dtype=torch.bool, device=first.device) if mask is None else mask
                    for _, mask, _ in (self.entries[i] for i in indices)
                ]
            ).unsqueeze(2)  # (N, B, 1)
            _scatter(sums, "rows", index, real.sum((1, 2)), steps)

            def stacked(name: str, indices: list[int] = indices) -> Tensor:
                return torch.stack([self.entries[i][2][name] for i in indices])  # (N, B, features)

            for name in self.sources:
                x = stacked(name)
                widths[name] = x.shape[2]  # h has proj_size features in a projected LSTM
                if name in self.biases:
                    x = x - self.biases[name]  # the norms' output, before the cell bias that follows them
                x = torch.where(real, x, 0.0)  # where, not a product: padding may hold inf or NaN
                _scatter(sums, f"{name}_sum", index, x.sum((1, 2)), steps)
                _scatter(sums, f"{name}_squares", index, x.square().sum((1, 2)), steps)
                if name == "h":
                    near_zero = (x.abs() < self.threshold) & real
                    _scatter(sums, "h_zeros", index, near_zero.sum((1, 2)), steps)
                if self.keep_values and name in ("h", "c", "ih_post" if "ih_post" in self.sources else "ih_pre"):
                    values.setdefault(name, []).append(_subsample(x[real.expand_as(x)], steps))
            gates = stacked("gates").unflatten(2, (len(self.gates), cell.hidden_size))  # (N, B, G, H)
            low, high = SIGMOID_BAND
            saturated = (gates < low) | (gates > high)
            tanh = _tanh_gate(cell)
            if tanh is not None:
                saturated[:, :, tanh] = gates[:, :, tanh].abs() > TANH_LIMIT
            counts = (saturated & real.unsqueeze(3)).sum((1, 3))  # (N, G)
            for gate_index, gate in enumerate(self.gates):
                _scatter(sums, f"{gate}_sat", index, counts[:, gate_index], steps)
                if self.keep_values:
                    kept = gates[:, :, gate_index][real.expand(-1, -1, cell.hidden_size)]
                    values.setdefault(f"gate_{gate}", []).append(_subsample(kept, steps))
            if self.grads:
                grads = torch.stack(
                    [self.grads[i] if i in self.grads else torch.zeros_like(first) for i in indices]
                )  # steps no gradient reached count as zero
                _scatter(sums, "grad_squares", index, torch.where(real, grads, 0.0).float().square().sum((1, 2)), steps)
        self._moments(summary, sums, widths)
        if self.observed.batch_statistics:
            summary.profiles[("norm", "active_rows")] = summary.active_rows  # type: ignore[assignment]
            summary.scalars[("norm", "active_rows_min")] = float(sums["rows"][sums["rows"] > 0].min())
            self._running_statistics(summary, steps)
        summary.values = {(_value_group(name), name): torch.cat(parts) for name, parts in values.items()}
        if "grad_squares" in sums:
            self._gradients(summary, sums, grad_scale)
        return summary

    def _moments(self, summary: CellSummary, sums: dict[str, Tensor], widths: dict[str, int]) -> None:
        cell = self.observed.cell
        rows = sums["rows"]
        summary.active_rows = rows
        seen = rows > 0
        weights = rows / rows.sum()
        for name in self.sources:
            entries = rows * widths[name]
            mean = sums[f"{name}_sum"] / entries
            std = (sums[f"{name}_squares"] / entries - mean.square()).clamp(min=0.0).sqrt()
            group = "hidden" if name in ("h", "c") else "norm"
            overall = sums[f"{name}_sum"].sum() / entries.sum()
            self._add(summary, group, f"{name}_mean", mean, overall)
            self._add(summary, group, f"{name}_std", std, (std[seen] * weights[seen]).sum())
        units = rows * widths["h"]
        zeros = sums["h_zeros"] / units
        self._add(summary, "hidden", "h_zero_frac", zeros, sums["h_zeros"].sum() / units.sum())
        units = rows * cell.hidden_size
        for gate in self.gates:
            saturated = sums[f"{gate}_sat"] / units
            self._add(summary, "gates", f"{gate}_sat", saturated, sums[f"{gate}_sat"].sum() / units.sum())

    def _running_statistics(self, summary: CellSummary, steps: int) -> None:
        for prefix, norm in _batch_norms(self.observed.cell):
            index = torch.arange(steps).clamp(max=norm.max_steps - 1)
            for stat, buffer in (("running_mean", norm.running_mean), ("running_var", norm.running_var)):
                profile = buffer.detach()[index].mean(1).to(torch.float64).cpu()
                self._add(summary, "norm", f"{prefix}_{stat}", profile, profile.mean())

    def _gradients(self, summary: CellSummary, sums: dict[str, Tensor], grad_scale: float) -> None:
        rows = sums["rows"]
        seen = torch.nonzero(rows > 0).flatten()
        # root mean square over real rows of ||dL/dh_t||: shrinking batches do not look like vanishing gradients
        norms = (sums["grad_squares"] / rows.clamp(min=1.0)).sqrt() / grad_scale
        first, last = norms[seen[0]], norms[seen[-1]]
        summary.profiles[("grad", "h_norm")] = norms
        summary.scalars[("grad", "h_norm")] = float(norms[seen].mean())
        summary.scalars[("grad", "h_norm_first")] = float(first)
        summary.scalars[("grad", "h_norm_last")] = float(last)
        summary.scalars[("grad", "last_over_first")] = float(last / first) if first > 0 else math.inf
        summary.values[("grad", "h_norm_per_step")] = norms[seen].float()

    @staticmethod
    def _add(summary: CellSummary, group: str, stat: str, profile: Tensor, average: Tensor | float) -> None:
        summary.profiles[(group, stat)] = profile
        summary.scalars[(group, stat)] = float(average)


def _groups_by_batch_size(entries: list[tuple[int, Tensor | None, dict[str, Tensor]]]) -> list[list[int]]:
    groups: dict[int, list[int]] = {}
    for index, (_, _, kept) in enumerate(entries):
        groups.setdefault(kept["h"].shape[0], []).append(index)
    return list(groups.values())


def _scatter(sums: dict[str, Tensor], name: str, steps: Tensor, values: Tensor, length: int) -> None:
    """Add ``values`` (one per entry) into ``sums[name]`` at their time steps (float64, on the CPU)."""
    total = sums.setdefault(name, torch.zeros(length, dtype=torch.float64))
    total.index_add_(0, steps, values.detach().to("cpu", torch.float64))


def _subsample(values: Tensor, steps: int) -> Tensor:
    """At most ``HISTOGRAM_VALUES_PER_STEP`` values per time step, evenly strided: a histogram needs no more."""
    flat = values.flatten()
    stride = max(1, math.ceil(flat.numel() / (HISTOGRAM_VALUES_PER_STEP * steps)))
    return flat[::stride].float().cpu()


class Observation:
    """Hooks every cell of ``cells`` while active; ``summaries()`` reduces what they saw.

    Args:
        cells: from :func:`find_cells`.
        threshold: ``|h|`` below this counts as a near-zero unit.
        keep_values: keep subsampled raw values for histograms.
        gradients: register tensor hooks on each step's ``h`` when it requires grad, for ``||dL/dh_t||``.
    """

    def __init__(
        self, cells: list[ObservedCell], *, threshold: float = 0.01, keep_values: bool = False, gradients: bool = False
    ) -> None:
        self.recorders = [_CellRecorder(cell, threshold, keep_values, gradients) for cell in cells]
        self.handles: list[Any] = []
        self.layers = {id(r.observed.layer): r.observed.layer for r in self.recorders if r.observed.layer is not None}
        self.layer_inputs: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def start(self, replayed: bool = False) -> None:
        """Hook the cells, in place: the forward itself is observed (a training step's gradients through time need
        its own graph). ``replayed``: capture each layer's inputs instead and leave its cells unhooked, for
        :meth:`replay` after the forward; a hooked observer sends its layer down the reference loop (it needs every
        step's record), whose rounding is not the compiled kernels', so only this way does the observed forward
        give exactly the numbers of an unobserved one. Cells outside a layer are hooked in place either way (no
        layer, no path to change)."""
        for recorder in self.recorders:
            if not replayed or recorder.observed.layer is None:
                self.handles.append(recorder.observed.cell.observer.register_forward_hook(recorder.on_step))
        if replayed:
            for key, layer in self.layers.items():
                hook = partial(self._capture, key)
                self.handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))

    def _capture(self, key: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.layer_inputs.setdefault(key, (args, kwargs))  # the first call, if the model calls a layer twice

    def stop(self) -> None:
        """Remove the forward hooks (gradient hooks on recorded tensors go with their graph)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def replay(self) -> None:
        """Run each layer again on the inputs it received (``start(replayed=True)``), with its cells hooked, and
        leave it exactly as it was (:func:`_preserved`): the records of the captured forward, without hooking it."""
        for key, (args, kwargs) in self.layer_inputs.items():
            layer = self.layers[key]
            recorders = [recorder for recorder in self.recorders if recorder.observed.layer is layer]
            # local_statistics: a diagnostic one process makes alone must not wait on synchronized norms' collectives
            with _preserved(layer), local_statistics(layer):
                handles = [r.observed.cell.observer.register_forward_hook(r.on_step) for r in recorders]
                try:
                    layer(*args, **kwargs)
                finally:
                    for handle in handles:
                        handle.remove()

    def summaries(self, grad_scale: float = 1.0) -> dict[str, CellSummary]:
        return {recorder.observed.name: recorder.summary(grad_scale) for recorder in self.recorders}


def _keep_h(
    seen: dict[int, tuple[Tensor, Tensor | None]], module: nn.Module, args: tuple[Any, ...], output: None
) -> None:
    record = args[0]
    seen[int(record["step"])] = (record["h"].detach(), record["mask"])


@contextmanager
def _preserved(layer: RecurrentLayer) -> Iterator[None]:
    """Run something on ``layer`` and leave its buffers, module modes, batch norms' fallback counts and the RNG
    exactly as they were."""
    buffers = [(buffer, buffer.detach().clone()) for buffer in layer.buffers()]
    modes = [(module, module.training) for module in layer.modules()]
    fallbacks = [(norm, norm.fallback_steps) for norm in layer.modules() if isinstance(norm, TimestepBatchNorm)]
    devices = sorted({b.device.index for b, _ in buffers if b.device.type == "cuda" and b.device.index is not None})
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for module, training in modes:
            module.training = training
        for norm, count in fallbacks:
            norm.fallback_steps = count


def train_eval_gap(
    layer: RecurrentLayer, cells: list[ObservedCell], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, tuple[Tensor, float]]:
    """RMS difference of ``h`` over real entries between batch-norm train mode and eval mode on the same input.

    Returns, per cell name, the per-step profile and the RMS over every real entry of every step.

    Only the batch norms switch to training (dropout stays off, so the gap is the norms' alone); running statistics
    and the RNG state are restored afterwards.
    """
    mine = [cell for cell in cells if cell.layer is layer]
    runs: list[dict[str, dict[int, tuple[Tensor, Tensor | None]]]] = []
    # local_statistics: a diagnostic one process may make alone must not wait on synchronized norms' collectives.
    with _preserved(layer), local_statistics(layer):
        for train_norms in (False, True):
            layer.eval()
            for module in layer.modules():
                if isinstance(module, TimestepBatchNorm):
                    module.train(train_norms)
            seen: dict[str, dict[int, tuple[Tensor, Tensor | None]]] = {cell.name: {} for cell in mine}

            handles = [cell.cell.observer.register_forward_hook(partial(_keep_h, seen[cell.name])) for cell in mine]
            try:
                layer(*args, **kwargs)
            finally:
                for handle in handles:
                    handle.remove()
            runs.append(seen)
    gaps = {}
    for cell in mine:
        evaluated, trained = runs[0][cell.name], runs[1][cell.name]
        profile = torch.full((max(evaluated, default=-1) + 1,), math.nan, dtype=torch.float64)
        squares, entries = 0.0, 0
        for step, (h_eval, mask) in evaluated.items():
            difference = trained[step][0] - h_eval
            if mask is not None:
                difference = difference[mask]
            square = float(difference.double().square().sum())
            profile[step] = math.sqrt(square / max(difference.numel(), 1))
            squares, entries = squares + square, entries + difference.numel()
        gaps[cell.name] = (profile, math.sqrt(squares / max(entries, 1)))
    return gaps
