"""``LanguageModel``: a thin LightningModule around :class:`~seqnorm.models.RNNLanguageModel`."""

from __future__ import annotations

import math
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from seqnorm.lightning.base import RNNOptions, TaskModule
from seqnorm.models import CellName, RNNLanguageModel
from seqnorm.norms import DEFAULT_MAX_STEPS, DEFAULT_SMALL_BATCH, NormSpec, SmallBatchPolicy

__all__ = ["STREAM_STATE_KEY", "LanguageModel"]

STREAM_STATE_KEY = "seqnorm_stream_state"
"""Checkpoint key of the recurrent state carried between training windows (``unit="stream"``)."""


class LanguageModel(TaskModule):
    """Character- or word-level language modelling over variable-length sequences.

    Logs ``train/loss`` (nats per token, the mean over the last ``log_every_n_steps`` steps) and
    ``train/loss_epoch`` (the mean over the epoch's tokens), ``val/loss`` and ``val/bpc`` (bits per character,
    character level) or ``val/ppl`` (perplexity, word level), and the ``test/`` twins. Padding is ignored by the loss.

    Stateful truncated BPTT: batches of ``TextCorpus(unit="stream")`` carry a ``window`` index. Then the final state
    of each window, detached, starts the next window of the same stage (train, val and test each keep their own),
    and window 0 (every epoch's first) starts from zeros. The training carry is saved in checkpoints, so a resumed
    run continues the streams where it stopped. ``predict`` runs every window from zeros.

    Under DDP each process reads its own block of the streams (``first_stream`` in the batch) and carries their
    states, in training and evaluation alike; a checkpoint holds the carry of every stream (gathered from all
    processes), and each process of a resumed run, whatever their number, takes the rows of its own streams.

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
        norm_max_steps: time steps with their own batch-norm statistics (per-timestep BN only; folded into the
            spec, accepted whatever the norm). Not the length of training: that is the Trainer's ``max_steps``.
        small_batch: what per-timestep BN does at a step with fewer than 2 active rows (the tail of the longest
            sequence of a variable-length batch): ``"tail"`` (default: normalize it with the running statistics of
            the step and count it, ``norm/fallback_steps``; a batch of one row raises), ``"error"`` (strict) or
            ``"running"`` (batch size 1 too). Folded into the spec; with a norm without batch statistics, a
            non-default value is a ``ValueError``.
        stream_steps: the time index per-timestep BN sees in stream windows. ``"restart"``: steps ``0 .. T-1`` in
            every window, so each position of a window has its own statistics (all ``T`` of them trained in every
            batch, and evaluation sees the same positions as training). ``"continue"``: the stream position, so
            window ``k`` has steps ``k*T .. k*T+T-1``, and steps beyond ``norm_max_steps`` follow the norm's
            ``beyond_max_steps`` policy. Norms without per-timestep statistics ignore it.
        tie_weights: share the embedding and output matrices (``embedding_dim`` must equal ``hidden_size``, or
            ``rnn_options.proj_size`` when set).
        rnn_options: further keyword arguments of :class:`seqnorm.LSTM` / :class:`seqnorm.GRU` that are not norm
            options: regularizers (``zoneout_h``, ``zoneout_c``, ``input_dropout``, ``weight_dropout``),
            ``forget_bias``, ``proj_size``, ``impl``. A norm's options, ``norm_placement`` and ``state_norm``
            included, are fields of ``norm``'s spec. Typed (:class:`RNNOptions`): the CLI checks every key and
            value while parsing. Checkpoints that saved norm options here load with them folded into the spec
            (:mod:`seqnorm.lightning.old_hparams`).
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
        norm_max_steps: int = DEFAULT_MAX_STEPS,
        small_batch: SmallBatchPolicy = DEFAULT_SMALL_BATCH,
        stream_steps: Literal["restart", "continue"] = "restart",
        tie_weights: bool = False,
        rnn_options: RNNOptions | None = None,
        lr: float = 2e-3,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        if level not in ("char", "word"):
            raise ValueError(f"LanguageModel: expected level to be 'char' or 'word', got {level!r}")
        if stream_steps not in ("restart", "continue"):
            raise ValueError(
                f"LanguageModel: expected stream_steps to be 'restart' or 'continue', got {stream_steps!r}"
            )
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
        self.carried: dict[str, Any] = {}
        """Per stage, the detached final state of the latest stream window (``None``/absent: start from zeros)."""
        self._carried_streams: dict[str, tuple[int, int]] = {}
        """Per stage, which streams :attr:`carried` holds: ``(first_stream, num_streams)``, its row 0 and the split's
        total (absent: the rows of the next window)."""
        # (training batch counter, the carry before that batch and its streams)
        self._carry_undo: tuple[int, Any, tuple[int, int] | None] = (-1, None, None)

    def forward(self, inputs: Tensor, lengths: Tensor | None = None) -> Tensor:
        return self.model(inputs, lengths)

    def _logits(self, batch: dict[str, Tensor], stage: str) -> Tensor:
        """The batch's logits; stream windows start from the stage's carried state and leave theirs behind."""
        if "window" not in batch:
            return self(batch["inputs"], batch["lengths"])
        rows = batch["inputs"].shape[0]
        streams = (int(batch.get("first_stream", 0)), int(batch.get("num_streams", rows)))
        state = self.carried.get(stage) if int(batch["window"]) > 0 else None
        if state is not None:
            state = _rows_of(_to(state, batch["inputs"]), self._carried_streams.get(stage, streams), streams, rows)
        first_step = int(batch["start"]) if self.hparams.stream_steps == "continue" else 0
        # Streams are never padded: no lengths, so no masks on the way.
        logits, final = self.model.forward_with_state(batch["inputs"], None, state, first_step=first_step)
        if stage == "train" and self._trainer is not None:
            # A checkpoint written on an exception inside this step redoes it: it must keep the carry before it.
            counter = self.trainer.fit_loop.epoch_loop.batch_progress.total.ready
            self._carry_undo = (counter, self.carried.get(stage), self._carried_streams.get(stage))
        # Detached: gradients stop at the window boundary (truncated BPTT); the values flow on.
        self.carried[stage] = _detach(final)
        self._carried_streams[stage] = streams
        return logits

    def population_forward(self, batch: dict[str, Tensor]) -> Tensor:
        # Stream windows carry their state as in training (a stage of its own, from zeros at window 0), so the
        # statistics are those of the states training sees, not of windows that all start from zeros.
        return self._logits(batch, "population")

    def _loss(self, batch: dict[str, Tensor], stage: str = "train") -> tuple[Tensor, Tensor]:
        """Mean loss per real target token, and the number of those tokens."""
        logits = self._logits(batch, stage)
        loss = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=self.hparams.pad_index)
        return loss, batch["lengths"].sum()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss, tokens = self._loss(batch, "train")
        self._log_train_loss(loss, int(tokens))
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss, tokens = self._loss(batch, "val")
        self._update_metric("val", "loss", loss, tokens)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss, tokens = self._loss(batch, "test")
        self._update_metric("test", "loss", loss, tokens)

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """In the order of the predict dataloader: each sequence's ``loss``, the mean over its target tokens in nats
        (padding excluded) ``(B,)``, and its number of ``tokens`` ``(B,)``."""
        logits = self(batch["inputs"], batch["lengths"])
        losses = F.cross_entropy(
            logits.transpose(1, 2), batch["targets"], ignore_index=self.hparams.pad_index, reduction="none"
        )
        return {"loss": losses.sum(1) / batch["lengths"].to(losses.dtype), "tokens": batch["lengths"]}

    def prediction_records(self, prediction: dict[str, Tensor], batch: dict[str, Tensor]) -> list[dict[str, Any]]:
        """One row per sequence of :meth:`predict_step`'s output, for
        :class:`~seqnorm.lightning.prediction_writer.PredictionWriter`: ``tokens``, ``loss`` (nats per token), and
        ``bpc`` (character level) or ``ppl`` (word level) as the metrics logged in training; stream windows
        (``unit="stream"``, each window started from zeros) add ``window`` and ``stream``, the row's position (its
        index among all the streams, under DDP too)."""
        losses, tokens = prediction["loss"].tolist(), prediction["tokens"].tolist()
        records: list[dict[str, Any]] = []
        for row, (loss, count) in enumerate(zip(losses, tokens, strict=True)):
            record: dict[str, Any] = {"tokens": count, "loss": loss}
            if self.hparams.level == "char":
                record["bpc"] = loss / math.log(2)
            else:
                record["ppl"] = math.exp(loss)
            if "window" in batch:
                record.update(window=int(batch["window"]), stream=int(batch.get("first_stream", 0)) + row)
            records.append(record)
        return records

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._batch_rewound = False
        super().on_save_checkpoint(checkpoint)
        carried, streams = self.carried.get("train"), self._carried_streams.get("train")
        if self._batch_rewound and self._carry_undo[0] == self.trainer.fit_loop.epoch_loop.batch_progress.total.ready:
            _, carried, streams = self._carry_undo  # the rewound step had already carried its state on
        if carried is not None:
            checkpoint[STREAM_STATE_KEY] = {"train": self._every_stream(_as_dict(carried), streams)}

    def _every_stream(self, carried: dict[str, Tensor], streams: tuple[int, int] | None) -> dict[str, Tensor]:
        """The carry of every stream: each process's own rows, gathered in stream order (a collective: Lightning
        calls ``on_save_checkpoint`` on every process, which all save together)."""
        if self._trainer is None or self.trainer.world_size == 1 or streams is None:
            return carried
        # torch.distributed itself: LightningModule.all_gather goes through a deprecated autograd gather (a warning
        # per call).
        world_size, total = self.trainer.world_size, streams[1]
        firsts = [torch.zeros((), dtype=torch.int64, device=self.device) for _ in range(world_size)]
        dist.all_gather(firsts, torch.tensor(streams[0], device=self.device))
        whole = {}
        for name, state in carried.items():  # (num_layers, B / world_size, H) each
            shares = [torch.empty_like(state) for _ in range(world_size)]
            dist.all_gather(shares, state.contiguous())
            whole[name] = state.new_zeros(state.shape[0], total, state.shape[2])
            for first, share in zip(firsts, shares, strict=True):
                whole[name][:, int(first) : int(first) + share.shape[1]] = share
        return whole

    def _rewind_unfinished(self, trainer: pl.Trainer, checkpoint: dict[str, Any]) -> bool:
        self._batch_rewound = super()._rewind_unfinished(trainer, checkpoint)
        return self._batch_rewound

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        streams = checkpoint.get(STREAM_STATE_KEY, {})
        saved = streams.get("train") if isinstance(streams, dict) else None
        if not isinstance(streams, dict) or not (saved is None or _is_state(saved)):
            expected = "a dict whose 'train' holds the carried 'h' (and an LSTM's 'c'), 3-D tensors of one shape"
            raise self._corrupt(STREAM_STATE_KEY, expected, streams)
        self.carried = {} if saved is None else {"train": _from_dict(saved)}
        # Every stream of the split (_every_stream): each process takes its own rows at its first window.
        self._carried_streams = {} if saved is None else {"train": (0, _rows(self.carried["train"]))}

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


# The carried state: ``(h, c)`` for LSTMs, ``h`` for GRUs, each ``(num_layers, B, H)``.


def _detach(state: Any) -> Any:
    return state.detach() if isinstance(state, Tensor) else tuple(t.detach() for t in state)


def _to(state: Any, like: Tensor) -> Any:
    return state.to(like.device) if isinstance(state, Tensor) else tuple(t.to(like.device) for t in state)


def _rows(state: Any) -> int:
    return (state if isinstance(state, Tensor) else state[0]).shape[1]


def _rows_of(state: Any, held: tuple[int, int], wanted: tuple[int, int], rows: int) -> Any:
    """The rows of ``state`` for the ``rows`` streams from ``wanted = (first_stream, num_streams)``, where row 0 of
    ``state`` is stream ``held[0]`` of ``held[1]``; ``None`` (start from zeros) where ``state`` lacks them: another
    number of streams (a resumed run with another ``--data.batch_size``)."""
    offset = wanted[0] - held[0]
    if held[1] != wanted[1] or offset < 0 or offset + rows > _rows(state):
        return None
    if offset == 0 and rows == _rows(state):
        return state
    pick = slice(offset, offset + rows)
    return state[:, pick].contiguous() if isinstance(state, Tensor) else tuple(t[:, pick].contiguous() for t in state)


def _as_dict(state: Any) -> dict[str, Tensor]:
    # Plain tensors under names: checkpoints are read with weights_only=True.
    return {"h": state} if isinstance(state, Tensor) else {"h": state[0], "c": state[1]}


def _is_state(saved: object) -> bool:
    """Whether ``saved`` is a carried state as :func:`_as_dict` writes it."""
    if not isinstance(saved, dict) or not set(saved) <= {"h", "c"} or not isinstance(saved.get("h"), Tensor):
        return False
    shape = saved["h"].shape
    return len(shape) == 3 and all(isinstance(t, Tensor) and t.shape == shape for t in saved.values())


def _from_dict(saved: dict[str, Tensor]) -> Any:
    return saved["h"] if "c" not in saved else (saved["h"], saved["c"])
