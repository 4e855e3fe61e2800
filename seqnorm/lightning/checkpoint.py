"""``ResumableCheckpoint``: Lightning's ModelCheckpoint whose ``last.ckpt`` is always the final training step."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

__all__ = ["ResumableCheckpoint"]


class ResumableCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that also writes ``last.ckpt`` when training ends between two regular saves.

    Lightning's ModelCheckpoint saves ``last.ckpt`` whenever it saves (after validation, on an exception with
    ``save_on_exception=True``), but a run stopped by ``max_steps`` in the middle of an epoch would leave a
    ``last.ckpt`` that is several steps old — and resuming from it would silently redo those steps. This subclass
    saves the final state too, so ``--ckpt_path .../last.ckpt`` always continues exactly where the run ended.
    All arguments are ModelCheckpoint's.
    """

    _saved_at_step: int | None = None

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._saved_at_step = trainer.global_step
        return super().on_save_checkpoint(trainer, pl_module, checkpoint)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if self.save_last and self.dirpath is not None and self._saved_at_step != trainer.global_step:
            path = os.path.join(self.dirpath, self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)
            self.last_model_path = path
            trainer.save_checkpoint(path, self.save_weights_only)
