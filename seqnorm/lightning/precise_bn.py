"""``PreciseBN``: exact population statistics for per-timestep BN during ``fit`` (Wu & Johnson 2021)."""

from __future__ import annotations

import itertools
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn

from seqnorm.norms import TimestepBatchNorm
from seqnorm.norms.population import update_bn

__all__ = ["PreciseBN"]


class PreciseBN(pl.Callback):
    """Before every validation inside ``fit``, and at the end of ``fit``, recompute the running statistics of every
    per-timestep batch norm with :func:`seqnorm.update_bn` over the first ``num_batches`` training batches.

    Validation then measures BatchNorm with the population statistics of the current weights instead of an
    exponential moving average that lags behind them (after ``k`` updates with momentum 0.1, ``0.9^k`` of the initial
    ``(0, 1)`` is still in it), and the checkpoint written after that validation holds them. The batches come from a
    fresh ``datamodule.train_dataloader()`` (its first epoch's order: the same batches each time), run in training
    mode without gradients through the task module's ``population_forward`` (stream windows carry their state as in
    training); the random number generators are forked, so the training run draws exactly what it would without the
    callback. Training itself normalizes with batch statistics, so the new running statistics change only what reads
    them: steps that fall back to them (``small_batch="tail"``) and batch renorm's correction. The checkpoint written
    at the end of ``fit`` holds the population statistics and, in this callback's state, the running averages they
    replaced: a fit resumed from it restores those, and trains on exactly as the run that did not stop.

    From the CLI: ``seqnorm fit ... --trainer.callbacks+=seqnorm.lightning.PreciseBN
    --trainer.callbacks.init_args.num_batches 100``.

    Args:
        num_batches: training batches to average over; ``None``: the whole training loader. Default: 200.
    """

    def __init__(self, num_batches: int | None = 200) -> None:
        if num_batches is not None and (isinstance(num_batches, bool) or not isinstance(num_batches, int)):
            raise ValueError(f"PreciseBN: expected num_batches to be a positive int or None, got {num_batches!r}")
        if num_batches is not None and num_batches < 1:
            raise ValueError(f"PreciseBN: expected num_batches >= 1 or None, got {num_batches}")
        self.num_batches = num_batches
        self._updated_at: int | None = None
        self._before_final: dict[str, torch.Tensor] | None = None  # the running statistics the end of fit replaced
        self._to_restore: dict[str, torch.Tensor] | None = None

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._update(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The last checkpoint holds the population statistics (what evaluating it reads), and beside them, in this
        # callback's state, the running averages they replaced: a fit resumed from it trains on with those, as the
        # run that never stopped does (it had not updated them at that step).
        if self._updated_at != trainer.global_step:
            self._before_final = {name: buffer.clone() for name, buffer in _running_statistics(pl_module)}
        self._update(trainer, pl_module)

    def state_dict(self) -> dict[str, Any]:
        return {} if self._before_final is None else {"running_before_final_update": self._before_final}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._to_restore = state_dict.get("running_before_final_update")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        restore, self._to_restore, self._before_final = self._to_restore, None, None  # a fit of its own
        if restore is None:
            return
        buffers = dict(_running_statistics(pl_module))
        if (
            not isinstance(restore, dict)
            or set(restore) != set(buffers)
            or not all(_fits(restore[name], buffer) for name, buffer in buffers.items())
        ):
            raise ValueError(
                f"PreciseBN: expected the checkpoint's running statistics before its final update to be the model's "
                f"({len(buffers)} buffers), got others: resume without PreciseBN, or from another checkpoint"
            )
        with torch.no_grad():
            for name, buffer in buffers.items():
                buffer.copy_(restore[name])

    def _update(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._updated_at == trainer.global_step:  # nothing trained since the last update
            return
        datamodule = trainer.datamodule
        if datamodule is None:
            raise ValueError(
                "PreciseBN: expected the trainer to have a DataModule (its train_dataloader() gives the batches), "
                "got fit() without one"
            )
        batches = itertools.islice(datamodule.train_dataloader(), self.num_batches)
        device = pl_module.device
        forked = [device.index or 0] if device.type == "cuda" else []
        # Under the trainer's precision (bf16-mixed: autocast), as the training and validation forwards run.
        with torch.random.fork_rng(devices=forked), trainer.precision_plugin.forward_context():
            update_bn(batches, pl_module, device, forward=_task_forward)
        self._updated_at = trainer.global_step


def _fits(saved: object, buffer: torch.Tensor) -> bool:
    """Whether ``saved`` can stand for the running moments ``buffer``: a finite tensor of its shape."""
    return isinstance(saved, torch.Tensor) and saved.shape == buffer.shape and bool(torch.isfinite(saved).all())


def _running_statistics(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers :func:`~seqnorm.update_bn` may replace: every per-timestep batch norm's running moments."""
    return [
        (f"{name}.{buffer_name}", buffer)
        for name, norm in module.named_modules()
        if isinstance(norm, TimestepBatchNorm)
        for buffer_name, buffer in norm.named_buffers(recurse=False)
        if buffer_name in ("running_mean", "running_var")
    ]


def _task_forward(module: Any, batch: dict[str, torch.Tensor]) -> Any:
    population_forward = getattr(module, "population_forward", None)  # seqnorm's task modules (stream windows carry)
    return population_forward(batch) if population_forward is not None else module(batch["inputs"], batch["lengths"])
