"""``SequenceClassifier``: a thin LightningModule around :class:`~seqnorm.models.RNNClassifier`."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

from seqnorm.lightning.base import RNNOptions, TaskModule
from seqnorm.models import CellName, Pooling, RNNClassifier
from seqnorm.norms import DEFAULT_MAX_STEPS, DEFAULT_SMALL_BATCH, NormSpec, SmallBatchPolicy

__all__ = ["SequenceClassifier"]


class SequenceClassifier(TaskModule):
    """Variable-length text -> label. Logs ``train/loss`` (the mean over the last ``log_every_n_steps`` steps),
    ``train/loss_epoch`` (the mean over the epoch's examples), ``val/loss``, ``val/acc`` and the ``test/`` twins.

    Args:
        vocab_size: number of token ids; linked from the DataModule by the CLI.
        num_classes: number of labels; linked from the DataModule.
        pad_index: the padding id; linked from the DataModule.
        pooling: ``"last"`` (each sequence's final state at its real end), ``"mean"`` or ``"max"`` over the real
            positions.
        bidirectional: read the text in both directions.
        cell, norm, hidden_size, embedding_dim, num_layers, dropout, recurrent_dropout, init, norm_max_steps,
        small_batch, rnn_options, lr, weight_decay: as :class:`LanguageModel`.
    """

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        pad_index: int = 0,
        cell: CellName = "lstm",
        norm: str | NormSpec = "layer",
        hidden_size: int = 128,
        embedding_dim: int = 64,
        num_layers: int = 1,
        bidirectional: bool = False,
        pooling: Pooling = "last",
        dropout: float = 0.0,
        recurrent_dropout: float = 0.0,
        init: str = "default",
        norm_max_steps: int = DEFAULT_MAX_STEPS,
        small_batch: SmallBatchPolicy = DEFAULT_SMALL_BATCH,
        rnn_options: RNNOptions | None = None,
        lr: float = 2e-3,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = RNNClassifier(
            vocab_size,
            num_classes,
            embedding_dim,
            hidden_size,
            cell,
            num_layers,
            bidirectional,
            pooling,
            dropout,
            pad_index,
            **self._rnn_kwargs(self._norm_spec(norm)),
        )
        self._init_metrics("loss", "acc")

    def forward(self, inputs: Tensor, lengths: Tensor) -> Tensor:
        return self.model(inputs, lengths)

    def _shared_step(self, batch: dict[str, Tensor], stage: str) -> Tensor:
        logits = self(batch["inputs"], batch["lengths"])
        loss = F.cross_entropy(logits, batch["labels"])
        examples = batch["labels"].shape[0]
        if stage == "train":
            self._log_train_loss(loss, examples)
        else:
            self._update_metric(stage, "loss", loss, examples)
            accuracy = (logits.argmax(1) == batch["labels"]).float().mean()
            self._update_metric(stage, "acc", accuracy, examples)
        return loss

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._shared_step(batch, "train")

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._shared_step(batch, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._shared_step(batch, "test")

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """In the order of the predict dataloader: ``label``, the most likely class id ``(B,)``, its
        ``probability`` ``(B,)``, and ``probabilities`` over all classes ``(B, num_classes)``."""
        probabilities = self(batch["inputs"], batch["lengths"]).softmax(1)
        probability, label = probabilities.max(1)
        return {"label": label, "probability": probability, "probabilities": probabilities}

    def prediction_records(self, prediction: dict[str, Tensor], batch: dict[str, Tensor]) -> list[dict[str, Any]]:
        """One row per sequence of :meth:`predict_step`'s output, for
        :class:`~seqnorm.lightning.prediction_writer.PredictionWriter`: ``label``, the class name (from the
        DataModule's ``labels``; the class id when it has none), and its ``probability``."""
        datamodule = self._trainer.datamodule if self._trainer is not None else None
        names = getattr(datamodule, "labels", None)
        labels = prediction["label"].tolist()
        return [
            {"label": names[label] if names is not None else label, "probability": probability}
            for label, probability in zip(labels, prediction["probability"].tolist(), strict=True)
        ]

    def on_validation_epoch_end(self) -> None:
        self.log_dict({f"val/{key}": v for key, v in self._epoch_values("val").items()}, prog_bar=True, sync_dist=True)

    def on_test_epoch_end(self) -> None:
        self.log_dict({f"test/{key}": v for key, v in self._epoch_values("test").items()}, sync_dist=True)
