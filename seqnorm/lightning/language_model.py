"""``LanguageModel``: a thin LightningModule around :class:`~seqnorm.models.RNNLanguageModel`."""

from __future__ import annotations

import math
from typing import Any, Literal

import torch.nn.functional as F
from torch import Tensor

from seqnorm.lightning.base import RNNOptions, TaskModule
from seqnorm.models import CellName, RNNLanguageModel
from seqnorm.norms import DEFAULT_MAX_STEPS, DEFAULT_SMALL_BATCH, NormSpec, SmallBatchPolicy

__all__ = ["LanguageModel"]


class LanguageModel(TaskModule):
    """Character- or word-level language modelling over variable-length sequences.

    Logs ``train/loss`` (nats per token, each step), ``val/loss`` and ``val/bpc`` (bits per character, character
    level) or ``val/ppl`` (perplexity, word level), and the ``test/`` twins. Padding is ignored by the loss.

    Args:
        vocab_size: number of token ids; linked from the DataModule by the CLI.
        pad_index: the padding id; linked from the DataModule.
        level: ``"char"`` (reports bpc) or ``"word"`` (reports perplexity); linked from the DataModule.
        cell: ``"lstm"`` or ``"gru"``.
        norm: normalization inside every cell: a registry name (``--model.norm layer``) or a spec carrying its
            options (``--model.norm.class_path seqnorm.norms.BatchNormSpec --model.norm.init_args.momentum 0.05``;
            see :mod:`seqnorm.norms.specs`). Checkpoints keep a spec as plain data (``spec.to_dict()``).
        hidden_size: recurrent state size.
        embedding_dim: token embedding size.
        num_layers: stacked recurrent layers.
        dropout: dropout on embeddings, between layers and before the output projection.
        recurrent_dropout: variational dropout on the recurrent state.
        init: weight initialization scheme (see :mod:`seqnorm.init`).
        max_steps: time steps with their own batch-norm statistics (per-timestep BN only; folded into the spec,
            accepted whatever the norm).
        small_batch: what per-timestep BN does at a step with fewer than 2 active rows (the tail of the longest
            sequence of a variable-length batch): ``"tail"`` (default: normalize it with the running statistics of
            the step and count it, ``norm/fallback_steps``; a batch of one row raises), ``"error"`` (strict) or
            ``"running"`` (batch size 1 too). Folded into the spec; with a norm without batch statistics, a
            non-default value is a ``ValueError``.
        tie_weights: share the embedding and output matrices (``embedding_dim`` must equal ``hidden_size``).
        rnn_options: further keyword arguments of :class:`seqnorm.LSTM` / :class:`seqnorm.GRU` that are not norm
            options: the cell switches ``norm_placement`` and ``state_norm``, regularizers (``zoneout_h``,
            ``zoneout_c``, ``input_dropout``, ``weight_dropout``), ``forget_bias``, ``proj_size``, ``impl``. The
            norm keywords (``eps``, ``momentum``, ``affine``, ``beyond_max_steps``, ``norm_options``, ...) still
            work here for existing configs; ``norm``'s spec is where they belong. Typed (:class:`RNNOptions`): the
            CLI checks every key and value while parsing.
        lr: Adam learning rate (the CLI's ``--optimizer`` replaces Adam entirely).
        weight_decay: Adam weight decay.
    """

    def __init__(
        self,
        vocab_size: int,
        pad_index: int = 0,
        level: Literal["char", "word"] = "char",
        cell: CellName = "lstm",
        norm: str | NormSpec = "layer",
        hidden_size: int = 256,
        embedding_dim: int = 64,
        num_layers: int = 1,
        dropout: float = 0.0,
        recurrent_dropout: float = 0.0,
        init: str = "default",
        max_steps: int = DEFAULT_MAX_STEPS,
        small_batch: SmallBatchPolicy = DEFAULT_SMALL_BATCH,
        tie_weights: bool = False,
        rnn_options: RNNOptions | None = None,
        lr: float = 2e-3,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        if level not in ("char", "word"):
            raise ValueError(f"LanguageModel: expected level to be 'char' or 'word', got {level!r}")
        self.save_hyperparameters()
        self.model = RNNLanguageModel(
            vocab_size,
            embedding_dim,
            hidden_size,
            cell,
            num_layers,
            dropout,
            pad_index,
            tie_weights,
            **self._rnn_kwargs(self._norm_spec(norm)),
        )
        self._init_metrics("loss")

    def forward(self, inputs: Tensor, lengths: Tensor | None = None) -> Tensor:
        return self.model(inputs, lengths)

    def _loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Mean loss per real target token, and the number of those tokens."""
        logits = self(batch["inputs"], batch["lengths"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=self.hparams.pad_index)
        return loss, batch["lengths"].sum()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss, tokens = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=int(tokens), sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss, tokens = self._loss(batch)
        self._update_metric("val", "loss", loss, tokens)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss, tokens = self._loss(batch)
        self._update_metric("test", "loss", loss, tokens)

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """Per-sequence loss in nats per token (padding excluded), in the order of the predict dataloader."""
        logits = self(batch["inputs"], batch["lengths"])
        losses = F.cross_entropy(
            logits.transpose(1, 2), batch["targets"], ignore_index=self.hparams.pad_index, reduction="none"
        )
        return losses.sum(1) / batch["lengths"].to(losses.dtype)

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val")

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    def _log_epoch(self, stage: str) -> None:
        values = self._epoch_values(stage)
        if "loss" not in values:
            return
        loss = values["loss"]
        logged: dict[str, Any] = {f"{stage}/loss": loss}
        if self.hparams.level == "char":
            logged[f"{stage}/bpc"] = loss / math.log(2)
        else:
            logged[f"{stage}/ppl"] = loss.exp()
        self.log_dict(logged, prog_bar=stage == "val", sync_dist=True)  # already global (torchmetrics): silences DDP
