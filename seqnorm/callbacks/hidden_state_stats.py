"""``HiddenStateStats``: what normalization does to a recurrent network, through time and layers, in TensorBoard."""

from __future__ import annotations

import itertools
import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.loggers import TensorBoardLogger
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from seqnorm.callbacks.observe import (
    CellSummary,
    Observation,
    ObservedCell,
    find_cells,
    logged_statistics,
    train_eval_gap,
)
from seqnorm.callbacks.render import custom_scalars_layout, layer_of, render_lines, render_profiles
from seqnorm.validation import check_finite

__all__ = ["HiddenStateStats", "fixed_batch_index"]

GROUPS = ("hidden", "gates", "grad", "norm")
# Per-step profiles drawn as images (line plots or heatmaps); the rest of each group's statistics are scalars only.
IMAGE_STATISTICS = {
    "hidden": ("h_mean", "h_std", "h_zero_frac", "c_mean", "c_std"),
    "grad": ("h_norm",),
    "norm": (
        "ih_pre_std",
        "hh_pre_std",
        "ih_post_std",
        "hh_post_std",
        "c_post_std",
        "active_rows",
        "ih_running_var",
        "hh_running_var",
        "c_running_var",
        "train_eval_gap",
    ),
}


class HiddenStateStats(Callback):
    """Logs hidden-state, gate, gradient and normalization statistics of every seqnorm cell through time.

    The callback observes the model through each cell's ``observer`` hook (no model code is patched) on every
    ``every_n_steps``-th training step and on one fixed validation batch of every validation run: the longest one
    (:func:`fixed_batch_index`), so that the last steps, where batch statistics rest on few real rows, are seen
    (under length bucketing the first batch is the shortest). Between observations no hook is registered, so layers
    keep their fast path. An observed training step runs the reference loop (its gradients through time need that
    step's own graph), whose float32 rounding differs from the compiled kernels' in the last bits; the validation
    batch is not observed in place but replayed: each layer runs again on the inputs it received, its cells hooked,
    after the batch, so validation metrics are bitwise those of a run without the callback. Padding rows
    (``lengths`` / ``mask``) are excluded from every statistic.

    Tags are ``{group}/{cell}/{statistic}``; ``{cell}`` is ``l{layer}`` or ``l{layer}_reverse``, prefixed by the
    module path (``encoder.rnn/l0``) when the model holds more than one seqnorm layer; a cell used on its own is
    named by its module path. Statistics of the fixed validation batch carry ``val_`` before the statistic name.

    - ``hidden/{cell}/h_mean, h_std, c_mean, c_std, h_zero_frac``: moments of ``h_t`` and ``c_t`` over real rows and
      units, and the fraction with ``|h| < zero_threshold``.
    - ``gates/{cell}/{gate}_sat``: fraction saturated, sigmoid gates outside [0.05, 0.95], tanh ``|x| > 0.95``
      (LSTM ``i, f, g, o``; GRU ``r, z, n``).
    - ``grad/{cell}/h_norm, h_norm_first, h_norm_last, last_over_first``: ``||dL/dh_t||`` (root mean square over
      the real rows of the per-row norm) averaged over steps, at the first and last step, and their ratio (training
      steps only).
    - ``norm/{cell}/ih_pre_*, hh_pre_*``: moments of ``W_ih x`` and ``W_hh h``; ``ih_post_*, hh_post_*, c_post_*``
      the same after the norm (before the cell bias); for per-timestep batch norms ``{ih,hh,c}_running_mean/var``
      (feature means, averaged over the observed steps), ``active_rows_min`` and ``val_train_eval_gap`` (RMS
      difference of ``h`` with the batch norms in train vs eval mode, on the fixed validation batch, with running
      statistics and RNG state left untouched).

    Scalars averaged "over time" weight each step by its real rows. Per-step profiles are images
    ``{group}/profile`` and ``{group}/val_profile``, one panel per statistic: a line plot of value against time step
    for a one-layer model (a line per direction), a heatmap (time step × cell) for several layers; histograms are
    ``hidden/{cell}/h``, ``c``, ``gates/{cell}/gate_{gate}``, ``norm/{cell}/ih_post`` (``ih_pre`` without a norm),
    ``grad/{cell}/h_norm_per_step`` and ``norm/{cell}/active_rows`` (bucket ``t`` holds the real rows at step
    ``t``). Custom-scalars charts put the cells side by side, one statistic per chart, at most
    :data:`~seqnorm.callbacks.render.MAX_CHART_CELLS` cells a chart. Scalars go to every logger of the trainer; images,
    histograms and the layout need a :class:`~lightning.pytorch.loggers.TensorBoardLogger`.

    Args:
        every_n_steps: observe every this many optimizer steps (scalars). Default: 50, which keeps the overhead
            under 10% (docs/benchmarks.md).
        media_every_n_steps: also write images and histograms on training steps that are multiples of this;
            ``None`` for validation batches only. Default: 500.
        validation_batch: observe the fixed (longest) validation batch of each validation run. Default: ``True``.
        zero_threshold: ``|h|`` below this counts as a near-zero unit. Default: 0.01.

    Example::

        trainer = pl.Trainer(callbacks=[HiddenStateStats(every_n_steps=100)], logger=TensorBoardLogger("runs"))
        # or: seqnorm fit ... --trainer.callbacks+=seqnorm.callbacks.HiddenStateStats
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        media_every_n_steps: int | None = 500,
        validation_batch: bool = True,
        zero_threshold: float = 0.01,
    ) -> None:
        super().__init__()
        for name, value in (("every_n_steps", every_n_steps), ("media_every_n_steps", media_every_n_steps)):
            if value is None and name == "media_every_n_steps":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"HiddenStateStats: expected {name} to be a positive int, got {value!r}")
        if not isinstance(validation_batch, bool):
            raise ValueError(f"HiddenStateStats: expected validation_batch to be a bool, got {validation_batch!r}")
        check_finite("HiddenStateStats", "zero_threshold", zero_threshold, "a positive finite number", lambda t: t > 0)
        self.every_n_steps = every_n_steps
        self.media_every_n_steps = media_every_n_steps
        self.validation_batch = validation_batch
        self.zero_threshold = float(zero_threshold)
        self._cells: list[ObservedCell] = []
        self._tensorboard: TensorBoardLogger | None = None
        self._enabled = True
        self._observation: Observation | None = None
        self._phase = ""
        self._media = False
        self._step = -1
        self._last_train_step = -1
        self._grad_scale = 1.0
        self._one_layer = False
        self._val_index: int | None = None

    # --- checks ------------------------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._cells = find_cells(pl_module)
        self._one_layer = len({layer_of(cell.name) for cell in self._cells}) == 1
        self._val_index = None  # chosen at the first validation run of this fit, validate, ...
        if not self._cells:
            raise ValueError(
                f"HiddenStateStats: expected the model to contain a seqnorm layer or cell (seqnorm.LSTM, seqnorm.GRU, "
                f"seqnorm.LSTMCell, seqnorm.GRUCell), found none in {type(pl_module).__name__}; torch.nn.LSTM/GRU "
                "cannot be observed: convert them with seqnorm.LSTM.from_torch / seqnorm.GRU.from_torch"
            )
        if trainer.fast_dev_run:
            rank_zero_info("HiddenStateStats: fast_dev_run disables the loggers, so nothing will be logged")
            self._enabled = False
            return
        tensorboards = [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]
        if not tensorboards:
            present = ", ".join(type(logger).__name__ for logger in trainer.loggers) or "no logger"
            raise ValueError(
                "HiddenStateStats: expected a TensorBoardLogger among the trainer's loggers (it writes the images, "
                f"histograms and custom-scalars layout), got {present}; add "
                "lightning.pytorch.loggers.TensorBoardLogger (scalars also go to the other loggers)"
            )
        self._tensorboard = tensorboards[0]
        instances = [callback for callback in trainer.callbacks if isinstance(callback, HiddenStateStats)]
        # A shipped config turns the callback on; `--trainer.callbacks+=...HiddenStateStats` appends another one.
        # The one given last wins, so command-line settings override the config's.
        self._enabled = instances[-1] is self
        if not self._enabled:
            rank_zero_warn("HiddenStateStats: several instances on one trainer; only the last one given is active")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._enabled or not trainer.is_global_zero or self._tensorboard is None:
            return
        logged = {cell.name: logged_statistics(cell) for cell in self._cells}
        self._tensorboard.experiment.add_custom_scalars(custom_scalars_layout(logged))

    # --- observed training steps ---------------------------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        # with gradient accumulation several batches share a global step: observe the first of them only
        if not self._enabled or self._observation is not None or step == self._last_train_step:
            return
        media = self.media_every_n_steps is not None and step % self.media_every_n_steps == 0
        if step % self.every_n_steps != 0 and not media:
            return
        self._last_train_step = step
        self._begin("train", step, media)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        # The forward is over; stop now so that a recomputing backward (checkpointing) is not counted twice.
        if self._observation is not None and self._phase == "train":
            self._observation.stop()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._observation is not None and self._phase == "train":
            scaler = getattr(trainer.precision_plugin, "scaler", None)  # AMP: gradients are still scaled here
            scale = float(scaler.get_scale()) if scaler is not None else 1.0
            if pl_module.automatic_optimization:  # Lightning divided the loss by it: ∂L/∂h of the batch's own loss
                scale /= trainer.accumulate_grad_batches
            self._grad_scale = scale

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._observation is not None and self._phase == "train":
            self._finish(trainer)

    # --- the fixed validation batch --------------------------------------------------------------------------------

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._enabled and self.validation_batch and not trainer.sanity_checking and self._val_index is None:
            loaders = trainer.val_dataloaders
            loader = loaders[0] if isinstance(loaders, list | tuple) else loaders
            limit = trainer.num_val_batches[0] if trainer.num_val_batches else math.inf
            self._val_index = fixed_batch_index(loader, None if math.isinf(limit) else int(limit))

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if (
            not self._enabled
            or not self.validation_batch
            or trainer.sanity_checking
            or batch_idx != self._val_index
            or dataloader_idx != 0
            or self._observation is not None
        ):
            return
        # At Lightning's step for this validation's metrics (val/loss): the last trained batch's, from 0.
        self._begin("val", max(trainer.global_step - 1, 0), media=True)

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._observation is not None and self._phase == "val":
            self._finish(trainer)

    # --- cleanup -----------------------------------------------------------------------------------------------------

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._abandon()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._abandon()

    def _abandon(self) -> None:
        if self._observation is not None:
            self._observation.stop()
            self._observation = None

    # --- observing and logging -----------------------------------------------------------------------------------

    def _begin(self, phase: str, step: int, media: bool) -> None:
        self._phase, self._step, self._media, self._grad_scale = phase, step, media, 1.0
        self._observation = Observation(
            self._cells, threshold=self.zero_threshold, keep_values=media, gradients=phase == "train"
        )
        # The validation batch is replayed: its metrics must be exactly an unobserved run's (Observation.start).
        self._observation.start(replayed=phase == "val")

    def _finish(self, trainer: pl.Trainer) -> None:
        observation, self._observation = self._observation, None
        if observation is None:
            return
        observation.stop()
        if self._phase == "val":
            observation.replay()
        summaries = observation.summaries(self._grad_scale)
        gaps: dict[str, tuple[Tensor, float]] = {}
        if self._phase == "val":
            layers = {id(cell.layer): cell.layer for cell in self._cells if cell.batch_statistics and cell.layer}
            for key, layer in layers.items():
                if key in observation.layer_inputs:
                    args, kwargs = observation.layer_inputs[key]
                    gaps.update(train_eval_gap(layer, self._cells, args, kwargs))
        self._log(trainer, summaries, gaps)

    def _log(
        self, trainer: pl.Trainer, summaries: dict[str, CellSummary], gaps: dict[str, tuple[Tensor, float]]
    ) -> None:
        prefix = "val_" if self._phase == "val" else ""
        scalars: dict[str, float] = {}
        for name, summary in summaries.items():
            for (group, statistic), value in summary.scalars.items():
                scalars[f"{group}/{name}/{prefix}{statistic}"] = value
        for name, (_, overall) in gaps.items():
            scalars[f"norm/{name}/val_train_eval_gap"] = overall
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step=self._step)
        if not self._media or not trainer.is_global_zero or self._tensorboard is None:
            return
        experiment = self._tensorboard.experiment
        for name, summary in summaries.items():
            for (group, value_name), values in summary.values.items():
                # A diverged run's NaN/inf: TensorBoard's histogram of them raises ("The histogram is empty") and
                # stopped training at its next validation; the scalars (NaN) show the divergence.
                values = values[torch.isfinite(values)]
                if values.numel():
                    experiment.add_histogram(f"{group}/{name}/{prefix}{value_name}", values, self._step)
            if summary.active_rows is not None and ("norm", "active_rows") in summary.profiles:
                _add_step_histogram(experiment, f"norm/{name}/{prefix}active_rows", summary.active_rows, self._step)
        title = f"fixed validation batch {self._val_index}" if self._phase == "val" else f"training step {self._step}"
        render = render_lines if self._one_layer else render_profiles
        for group in GROUPS:
            panels: dict[str, dict[str, Tensor]] = {}
            for name, summary in summaries.items():
                for (profile_group, statistic), profile in summary.profiles.items():
                    wanted = IMAGE_STATISTICS.get(group)
                    if profile_group == group and (wanted is None or statistic in wanted):
                        panels.setdefault(statistic, {})[name] = profile
            if group == "norm":
                for name, (profile, _) in gaps.items():
                    panels.setdefault("train_eval_gap", {})[name] = profile
            if panels:
                image = render(f"{group}: {title}", panels)
                experiment.add_image(f"{group}/{prefix}profile", image, self._step, dataformats="HWC")


def fixed_batch_index(loader: Any, limit: int | None = None) -> int:
    """Which validation batch :class:`HiddenStateStats` observes: among the first ``limit`` batches, the one with the
    longest sequence among those with the most rows (a full batch; a last, smaller batch of longer sequences would
    show a few rows only). Ties go to the earlier batch.

    The batches are read from the loader's ``batch_sampler`` (lists of example indices, as evaluation runs them;
    nothing is loaded) and the lengths from its dataset's ``lengths`` (one per example, as seqnorm's datasets and
    :class:`~seqnorm.data.BucketBatchSampler` declare them). Under length bucketing evaluation batches come
    shortest first: the first batch of TREC's questions had 5 steps, too few to show how batch statistics fare at
    the late steps where few rows are still real. A loader that declares neither gets batch 0, the first.
    """
    batch_sampler = getattr(loader, "batch_sampler", None)
    lengths = getattr(getattr(loader, "dataset", None), "lengths", None)
    if batch_sampler is None or lengths is None:
        return 0
    best, best_key = 0, (-1, -1)
    for index, indices in enumerate(itertools.islice(batch_sampler, limit)):
        key = (len(indices), max((int(lengths[i]) for i in indices), default=0))
        if key > best_key:
            best, best_key = index, key
    return best


def _add_step_histogram(experiment: Any, tag: str, counts: Tensor, step: int) -> None:
    """A histogram whose bucket ``t`` holds ``counts[t]``: how the real rows spread over the time steps."""
    values = counts.double()
    positions = values.new_tensor(range(len(values)))
    experiment.add_histogram_raw(
        tag,
        min=0.0,
        max=float(len(values) - 1),
        num=float(values.sum()),
        sum=float((positions * values).sum()),
        sum_squares=float((positions.square() * values).sum()),
        bucket_limits=[t + 0.5 for t in range(len(values))],
        bucket_counts=values.tolist(),
        global_step=step,
    )
