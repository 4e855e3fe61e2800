"""What the LightningModules share: the optimizer default, epoch-level metrics, and the data state in checkpoints."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torchmetrics import MeanMetric

from seqnorm.lightning.resume import RANDOM_STATE_KEY, random_states, rewind_finished_epoch, set_random_states

__all__ = ["DATA_STATE_KEY", "TaskModule"]

DATA_STATE_KEY = "seqnorm_data"
"""Checkpoint key holding the DataModule's state (vocabulary, level, unit), read back by ``seqnorm generate``."""

EVAL_STAGES = ("val", "test")
RNN_ARGUMENTS = ("norm", "recurrent_dropout", "init", "max_steps", "small_batch")
"""Arguments of both task modules that go to the recurrent layer as they are."""


class TaskModule(pl.LightningModule):
    """Base of :class:`LanguageModel` and :class:`SequenceClassifier`.

    The optimizer is Adam (``lr``, ``weight_decay``) unless the CLI's ``--optimizer`` / ``--lr_scheduler`` say
    otherwise; gradient clipping is the Trainer's ``gradient_clip_val``. Validation and test metrics are means over
    the whole epoch weighted by tokens (language models) or examples (classifiers), not means of batch means.
    """

    def _rnn_kwargs(self) -> dict[str, Any]:
        """The recurrent layer's keyword arguments: the model's own (:data:`RNN_ARGUMENTS`) plus ``rnn_options``.

        Read from the saved hyperparameters, so call it after ``save_hyperparameters()``.
        """
        named = {name: self.hparams[name] for name in RNN_ARGUMENTS}
        options = dict(self.hparams.rnn_options or {})
        clash = sorted(set(options) & set(named))
        if clash:
            raise ValueError(
                f"{type(self).__name__}: expected rnn_options without arguments the model takes itself, got "
                f"{', '.join(clash)} (use --model.{clash[0]})"
            )
        return {**named, **options}

    def _init_metrics(self, *names: str) -> None:
        self.epoch_metrics = nn.ModuleDict({f"{stage}_{name}": MeanMetric() for stage in EVAL_STAGES for name in names})

    def _update_metric(self, stage: str, name: str, value: Tensor, weight: Tensor | float) -> None:
        self.epoch_metrics[f"{stage}_{name}"].update(value.detach(), weight)

    def _epoch_values(self, stage: str) -> dict[str, Tensor]:
        """The epoch means of ``stage`` (and reset them for the next epoch)."""
        values = {}
        for key, metric in self.epoch_metrics.items():
            if key.startswith(f"{stage}_") and metric.update_called:
                values[key[len(stage) + 1 :]] = metric.compute()
                metric.reset()
        return values

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning saves the DataModule state too, but under its class name; one fixed key lets `generate`
        # rebuild the vocabulary from the checkpoint alone.
        datamodule = self._trainer.datamodule if self._trainer is not None else None
        if datamodule is not None and hasattr(datamodule, "state_dict"):
            checkpoint[DATA_STATE_KEY] = datamodule.state_dict()
        # Exact resume: the dropout masks after the resume must be those the uninterrupted run draws, and the loop
        # must continue in the epoch it stopped in (see seqnorm.lightning.resume).
        checkpoint[RANDOM_STATE_KEY] = random_states()
        if self._trainer is not None and self._trainer.state.fn == TrainerFn.FITTING and "loops" in checkpoint:
            rewind_finished_epoch(checkpoint["loops"])

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Restored in on_train_start, not now: between here and the first training step Lightning builds the
        # optimizer, runs the sanity check and makes the train iterator.
        self._random_states_to_restore = checkpoint.get(RANDOM_STATE_KEY)

    def on_train_start(self) -> None:
        states, self._random_states_to_restore = getattr(self, "_random_states_to_restore", None), None
        if states is not None:
            set_random_states(states)
