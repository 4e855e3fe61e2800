"""What the LightningModules share: the optimizer default, epoch-level metrics, and the data state in checkpoints."""

from __future__ import annotations

import argparse
import math
import os
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypedDict

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torchmetrics import MeanMetric

from seqnorm.checkpoint_io import (
    CheckpointError,
    checked_stream,
    corrupt_checkpoint,
    read_checkpoint,
    read_hparams_file,
    refuse_unsafe_load,
    shown,
    subclasses,
    task_class,
)
from seqnorm.data.loader import ResumableDataLoader
from seqnorm.layers.sequence import Impl
from seqnorm.lightning.old_hparams import current_hparams
from seqnorm.lightning.resume import (
    RANDOM_STATE_KEY,
    random_states,
    resumed_epoch,
    rewind_finished_epoch,
    rewind_unfinished_batch,
    rewind_unfinished_validation,
    set_random_states,
    settle_restart_totals,
    snapshot_random_states,
)
from seqnorm.norms import DEFAULT_SMALL_BATCH, NORMS, NormSpec, TimestepBatchNorm, resolve_norm, spec_from_dict
from seqnorm.norms.specs import checked, field_names
from seqnorm.validation import check_non_negative, check_positive_int, check_rate

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["DATA_STATE_KEY", "RNNOptions", "TaskModule"]

DATA_STATE_KEY = "seqnorm_data"
"""Checkpoint key holding the DataModule's state (vocabulary, level, unit), read back by ``seqnorm generate``."""

FALLBACK_TOTAL_KEY = "seqnorm_fallback_total"
"""Checkpoint key of the run's count of BN fallback steps (``norm/fallback_total`` continues after a resume)."""
RECENT_LOSSES_KEY = "seqnorm_recent_losses"
"""Checkpoint key of the window ``train/loss`` averages (so the first points after a resume are the same)."""
EPOCH_LOSS_KEY = "seqnorm_epoch_loss"
"""Checkpoint key of the epoch's weighted loss sum and weight so far (``train/loss_epoch`` of a resumed epoch covers
all of it, not the steps after the resume)."""
EVAL_STAGES = ("val", "test")
RNN_ARGUMENTS = {
    "norm": "norm",
    "recurrent_dropout": "recurrent_dropout",
    "init": "init",
    "max_steps": "norm_max_steps",
    "small_batch": "small_batch",
}
"""The recurrent layer's keyword arguments that both task modules take, each with the module's name for it
(``small_batch`` is folded into the norm's spec)."""


class RNNOptions(TypedDict, total=False):
    """Further keyword arguments of :class:`seqnorm.LSTM` / :class:`seqnorm.GRU` for the task modules.

    ``--model.rnn_options '{"zoneout_h": 0.1, "proj_size": 64}'``: typed, so jsonargparse checks every key and value
    on the command line and in configs (an unknown key or a value outside its choices is refused before anything is
    built). The norm's options, where it sits included, are fields of its spec (``--model.norm.init_args.momentum
    0.05``, ``--model.norm.init_args.norm_placement joint``).
    """

    # The regularizers and the layer's other arguments.
    zoneout_h: float
    zoneout_c: float
    input_dropout: float
    weight_dropout: float
    forget_bias: float | None
    proj_size: int
    impl: Impl
    # The model's own arguments (RNN_ARGUMENTS): listed so that the model, not the parser, refuses them, naming the
    # flag to use.
    norm: Any
    recurrent_dropout: Any
    init: Any
    max_steps: Any
    small_batch: Any


class TaskModule(pl.LightningModule):
    """Base of :class:`LanguageModel` and :class:`SequenceClassifier`.

    The optimizer is Adam (``lr``, ``weight_decay``) unless the CLI's ``--optimizer`` / ``--lr_scheduler`` say
    otherwise; gradient clipping is the Trainer's ``gradient_clip_val``. Validation and test metrics are means over
    the whole epoch weighted by tokens (language models) or examples (classifiers), not means of batch means.
    """

    _step_start: tuple[Any, ...] = (None, None, None)  # see on_train_batch_start

    @classmethod
    def load_from_checkpoint(  # type: ignore[override]
        cls,
        checkpoint_path: str | os.PathLike[str],
        map_location: Any = None,
        hparams_file: str | os.PathLike[str] | None = None,
        strict: bool | None = None,
        weights_only: bool | None = None,
        **kwargs: Any,
    ) -> Self:
        """Lightning's ``load_from_checkpoint``, for a file that passes :func:`read_checkpoint`.

        The file is read once, with ``weights_only=True``, and checked: its ``_class_path`` must name this class or
        one of its subclasses, and its hyperparameters must hold plain values only. A crafted or foreign file is a
        :class:`~seqnorm.checkpoint_io.CheckpointError` and nothing in it runs. The model is built from
        the checked contents, never from a second read of the path. ``hparams_file`` (a YAML file) replaces the saved
        hyperparameters and passes the same checks; ``kwargs`` replace single hyperparameters, as in Lightning.
        ``weights_only`` may only be ``True`` (or left out): anything else is refused.
        """
        flag = f"{cls.__name__}.load_from_checkpoint"
        refuse_unsafe_load(weights_only, flag)
        checkpoint = read_checkpoint(checkpoint_path, flag)
        if hparams_file is not None:
            checkpoint["hyper_parameters"] = read_hparams_file(hparams_file, f"{flag}: hparams_file")
        return cls._from_checked(checkpoint, checkpoint_path, flag, map_location, strict, **kwargs)

    @classmethod
    def _from_checked(
        cls,
        checkpoint: dict[str, Any],
        checkpoint_path: str | os.PathLike[str],
        flag: str,
        map_location: Any = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Self:
        """The model of ``checkpoint``, a dict :func:`read_checkpoint` returned for ``checkpoint_path`` (its
        hyperparameters checked there, or by :func:`read_hparams_file`); errors name the file as ``flag``
        (``--ckpt_path`` for the CLI)."""
        where = f"{flag} {checkpoint_path}"
        task_class(checkpoint, subclasses(cls), checkpoint_path, flag)
        # Keys of before norm specs read as today's (the built model is the same); Lightning reads this dict.
        saved = checkpoint["hyper_parameters"] = current_hparams(checkpoint["hyper_parameters"])
        norm = saved.get("norm")
        if "norm" not in kwargs and isinstance(norm, Mapping):
            # A spec saved as plain data: made here by the registry, handed over as an object (jsonargparse, which
            # Lightning builds CLI checkpoints with, checks `norm` against its type and would refuse the dict).
            kwargs["norm"] = spec_from_dict(norm, f"{where}: hyper_parameters.norm")
        try:
            # Lightning builds from the checked dict, serialized into memory: the path is not read again.
            return super().load_from_checkpoint(
                checked_stream(checkpoint), map_location, None, strict, weights_only=True, **kwargs
            )
        except argparse.ArgumentError as error:  # jsonargparse refused a saved hyperparameter's value
            detail = " ".join(str(error).split())
            what = f"its hyper_parameters do not describe a {cls.__name__} ({detail})"
            raise corrupt_checkpoint(where, what) from None
        except CheckpointError:
            raise
        except ValueError as error:  # the model refused a value jsonargparse let through (hidden_size=-1, say)
            raise corrupt_checkpoint(where, str(error)) from None

    def _norm_spec(self, norm: str | NormSpec | Mapping[str, Any]) -> NormSpec:
        """The spec of ``norm`` with the model's ``norm_max_steps`` and ``small_batch``; ``hparams.norm`` becomes data.

        Call it right after ``save_hyperparameters()``. Checkpoints hold plain values only (they are read with
        ``weights_only=True``, and a ``class_path`` in their hyperparameters is refused:
        :mod:`~seqnorm.checkpoint_io`), so a spec is saved as ``spec.to_dict()``, which only seqnorm's
        registry turns back into a spec; a name stays a name, as the shipped configs write it.
        """
        owner = type(self).__name__
        # Checked here under the module's own names (the norm and the optimizer would name max_steps, or nothing).
        if self.hparams.norm_max_steps is not None:
            check_positive_int(owner, "norm_max_steps", self.hparams.norm_max_steps)
        check_non_negative(owner, "lr", self.hparams.lr)  # 0: a frozen run, as torch allows
        check_non_negative(owner, "weight_decay", self.hparams.weight_decay)
        check_rate(owner, "dropout", self.hparams.dropout)  # torch.nn.Dropout's own error names no flag
        check_rate(owner, "recurrent_dropout", self.hparams.recurrent_dropout)  # the layer's error would name LSTM
        if isinstance(norm, Mapping):  # what a checkpoint holds
            norm = spec_from_dict(norm, owner)
        plain = norm.to_dict() if isinstance(norm, NormSpec) else norm
        self.hparams["norm"] = plain
        if hasattr(self, "_hparams_initial"):  # what loggers record (hparams.yaml): the same plain data
            self._hparams_initial["norm"] = plain
        spec = resolve_norm(owner, norm, self.hparams.norm_max_steps)
        small_batch = self.hparams.small_batch
        if small_batch == DEFAULT_SMALL_BATCH or small_batch == getattr(spec, "small_batch", None):
            return spec
        if "small_batch" not in field_names(spec):
            having = ", ".join(
                repr(name) for name, scheme in NORMS.items() if "small_batch" in field_names(scheme.spec)
            )
            raise ValueError(
                f"{owner}: expected norm to be one of {having} for small_batch={small_batch!r}, got norm={spec.name!r}"
            )
        if spec.small_batch != DEFAULT_SMALL_BATCH:  # type: ignore[attr-defined]
            raise ValueError(
                f"{owner}: expected small_batch={spec.small_batch!r} as norm={spec!r} sets it (or no small_batch "  # type: ignore[attr-defined]
                f"beside the spec), got small_batch={small_batch!r}"
            )
        return checked(owner, spec, small_batch=small_batch)

    def _rnn_kwargs(self, norm: NormSpec) -> dict[str, Any]:
        """The recurrent layer's keyword arguments: ``norm`` (:meth:`_norm_spec`), the model's own
        (:data:`RNN_ARGUMENTS`) and ``rnn_options``.

        Read from the saved hyperparameters, so call it after ``save_hyperparameters()``.
        """
        named = {name: self.hparams[own] for name, own in RNN_ARGUMENTS.items() if name != "small_batch"}
        options = dict(self.hparams.rnn_options or {})
        clash = sorted(set(options) & set(RNN_ARGUMENTS))
        if clash:
            raise ValueError(
                f"{type(self).__name__}: expected rnn_options without arguments the model takes itself, got "
                f"{', '.join(clash)} (use --model.{RNN_ARGUMENTS[clash[0]]})"
            )
        return {**named, "norm": norm, **options}

    def _log_train_loss(self, loss: Tensor, weight: int) -> None:
        """``train/loss``: the mean loss over the last ``log_every_n_steps`` steps, weighted by ``weight`` (tokens or
        examples), shown in the progress bar and written every ``log_every_n_steps``, so each point of the curve
        covers every step since the one before; ``train/loss_epoch``: the epoch's weighted mean, written at its end.

        One step's loss alone is a noisy sample: bucketed batches differ in length and so in loss (0.9 to 1.8 nats
        on one corpus), and a point every 50 steps showed whichever batch came last. Lightning's
        ``on_step``/``on_epoch`` pair would rename the step value ``train/loss_step``, so each has its own ``log``
        call and ``train/loss`` keeps its name.
        """
        # log_every_n_steps counts optimizer steps; with gradient accumulation each takes several batches.
        window = max(1, self.trainer.log_every_n_steps) * max(1, self.trainer.accumulate_grad_batches)
        recent = getattr(self, "_recent_losses", None)
        if recent is None or recent.maxlen != window:
            self._recent_losses: deque[tuple[Tensor | float, int]] = deque(recent or (), maxlen=window)
        self._recent_losses.append((loss.detach().float() * weight, weight))
        # A resumed run's window starts with the checkpoint's values, as floats (exact: float32 widened).
        weighted = [torch.as_tensor(value, dtype=torch.float32, device=loss.device) for value, _ in self._recent_losses]
        total = torch.stack(weighted).sum()
        mean = total / sum(count for _, count in self._recent_losses)
        self.log("train/loss", mean, on_step=True, on_epoch=False, prog_bar=True, batch_size=weight, sync_dist=True)
        # The epoch's sum is kept here, not by `self.log(on_epoch=True)`, whose sum no checkpoint holds: after a
        # resume it averaged the steps since the resume only.
        total_so_far, weight_so_far = getattr(self, "_epoch_loss", None) or (0.0, 0)  # a step outside fit's epochs
        self._epoch_loss = (total_so_far + loss.detach().double() * weight, weight_so_far + weight)

    def on_train_epoch_start(self) -> None:  # not called for an epoch a resumed run continues (on_train_start)
        self._epoch_loss = (torch.zeros((), dtype=torch.float64, device=self.device), 0)

    def on_train_epoch_end(self) -> None:
        total, weight = self._epoch_loss
        if weight:
            self.log("train/loss_epoch", (total / weight).float(), on_step=False, on_epoch=True, sync_dist=True)

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
                # Fresh states made under validate/test's inference mode would be inference tensors, which a later
                # fit's validation (run under no_grad) cannot update in place: `trainer.validate(model)` followed by
                # `trainer.fit(model)` raised "Inplace update to inference tensor outside InferenceMode".
                with torch.inference_mode(False):
                    metric.reset()
        return values

    def population_forward(self, batch: dict[str, Tensor]) -> Tensor:
        """The forward pass :class:`~seqnorm.lightning.PreciseBN` runs on a training batch (in training mode, without
        gradients) to collect exact BN statistics: the model on the batch's inputs and lengths."""
        return self(batch["inputs"], batch["lengths"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)

    def setup(self, stage: str) -> None:
        """Before anything runs (the model summary, the sanity validation, the first step), refuse a per-timestep
        BN that cannot train at the data's batch size, with the error its first training step would raise. One
        process only: synchronized statistics span the processes' rows."""
        batch = getattr(getattr(self.trainer, "datamodule", None), "batch_size", None)
        if stage != "fit" or not isinstance(batch, int) or self.trainer.world_size > 1:
            return
        for module in self.modules():
            if isinstance(module, TimestepBatchNorm):
                module.check_batch_size(batch)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning saves the DataModule state too, but under its class name; one fixed key lets `generate`
        # rebuild the vocabulary from the checkpoint alone.
        datamodule = self._trainer.datamodule if self._trainer is not None else None
        if datamodule is not None and hasattr(datamodule, "state_dict"):
            checkpoint[DATA_STATE_KEY] = datamodule.state_dict()
        # Exact resume: the dropout masks after the resume must be those the uninterrupted run draws, and the loop
        # must continue in the epoch it stopped in (see seqnorm.lightning.resume).
        checkpoint[RANDOM_STATE_KEY] = random_states()
        checkpoint[FALLBACK_TOTAL_KEY] = getattr(self, "fallback_total", 0)
        checkpoint[RECENT_LOSSES_KEY] = _as_floats(getattr(self, "_recent_losses", None) or ())
        epoch_loss = getattr(self, "_epoch_loss", None)
        trainer = self._trainer
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and "loops" in checkpoint:
            rewind_finished_epoch(checkpoint["loops"])
            if self._rewind_unfinished(trainer, checkpoint):
                epoch_loss = self._epoch_loss_at_step_start  # the redone step adds its loss again
        checkpoint[EPOCH_LOSS_KEY] = _epoch_entry(resumed_epoch(checkpoint, self.current_epoch), epoch_loss)

    def _rewind_unfinished(self, trainer: pl.Trainer, checkpoint: dict[str, Any]) -> bool:
        """A save on an exception inside a training step or a validation: make the resume redo it exactly once.

        Returns whether a training step was rewound (its batch is trained on again after the resume).
        """
        if trainer.sanity_checking:
            return False
        epoch_loop = trainer.fit_loop.epoch_loop
        combined = trainer.fit_loop._combined_loader
        # the loader states in the checkpoint are those of Lightning's stateful train loaders, in this order (`is not
        # None`: `if combined` asks the length, which a spent CombinedLoader refuses: a save after fit)
        loaders = combined.flattened if combined is not None else []
        stateful = [loader for loader in loaders if isinstance(loader, _Stateful)]
        rewound = rewind_unfinished_batch(
            checkpoint["loops"],
            lightning_adds_step=not epoch_loop._should_accumulate(),
            rewindable=[isinstance(loader, ResumableDataLoader) for loader in stateful],
        )
        if not rewound:
            rewind_unfinished_validation(checkpoint["loops"])
            return False
        taken, states, optimization = self._step_start
        # Without a snapshot of this batch the step never began (an exception in a callback's on_train_batch_start):
        # nothing of it has drawn random numbers or counted optimizer calls yet.
        if taken == epoch_loop.batch_progress.total.ready:
            checkpoint[RANDOM_STATE_KEY] = random_states(states)
            checkpoint["loops"]["fit_loop"]["epoch_loop.automatic_optimization.optim_progress"] = optimization
            checkpoint[RECENT_LOSSES_KEY] = _as_floats(self._losses_at_step_start)  # the redone step adds its loss
            # The step's forward has updated BN's running statistics in place; the redone step updates them again.
            keys = {id(value): key for key, value in self.state_dict(keep_vars=True).items()}
            for buffer, before in zip(self.buffers(), self._buffers_at_step_start, strict=True):
                if id(buffer) in keys:
                    checkpoint["state_dict"][keys[id(buffer)]] = before.clone()
        return True

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # What a checkpoint written before this step finishes must hold (see _rewind_unfinished); the batch counter
        # tells which step they belong to. Cheap next to the smallest step (docs/performance.md).
        epoch_loop = self.trainer.fit_loop.epoch_loop
        optimization = epoch_loop.automatic_optimization.optim_progress.state_dict()
        self._step_start = (epoch_loop.batch_progress.total.ready, snapshot_random_states(), optimization)
        self._losses_at_step_start = list(getattr(self, "_recent_losses", None) or ())
        self._epoch_loss_at_step_start = getattr(self, "_epoch_loss", None)
        # The buffers too (per-timestep BN's running statistics), copied into the same tensors every step: cheap
        # next to the step (docs/performance.md).
        buffers = list(self.buffers())
        kept = getattr(self, "_buffers_at_step_start", [])
        if [(b.shape, b.dtype, b.device) for b in buffers] != [(k.shape, k.dtype, k.device) for k in kept]:
            kept = [torch.empty_like(buffer) for buffer in buffers]
        for copy, buffer in zip(kept, buffers, strict=True):
            copy.copy_(buffer)
        self._buffers_at_step_start = kept

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Log per-timestep BN's fallback steps (``small_batch="tail"``/``"running"``: steps normalized with running
        statistics because fewer than 2 rows were active): ``norm/fallback_steps`` in this batch (the most any one
        norm had: all norms of a layer see the same steps) and ``norm/fallback_total`` since the run began (also in
        the progress bar). Nothing is logged for a model without per-timestep BN."""
        norms = self._batch_norms()
        if not norms:
            return
        counts = [norm.fallback_steps for norm in norms]
        previous = getattr(self, "_fallback_counts", [0] * len(counts))
        self._fallback_counts = counts
        steps = max(now - before for now, before in zip(counts, previous, strict=True))
        self.fallback_total = getattr(self, "fallback_total", 0) + steps
        self.log("norm/fallback_steps", float(steps), on_step=True, on_epoch=False)
        self.log("norm/fallback_total", float(self.fallback_total), on_step=True, on_epoch=False, prog_bar=True)

    def _batch_norms(self) -> list[TimestepBatchNorm]:
        if not hasattr(self, "_batch_norm_modules"):
            self._batch_norm_modules = [m for m in self.modules() if isinstance(m, TimestepBatchNorm)]
        return self._batch_norm_modules

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Restored in on_train_start, not now: between here and the first training step Lightning builds the
        # optimizer, runs the sanity check and makes the train iterator.
        self._random_states_to_restore = checkpoint.get(RANDOM_STATE_KEY)
        fallback_total = checkpoint.get(FALLBACK_TOTAL_KEY, 0)
        recent = checkpoint.get(RECENT_LOSSES_KEY, ())
        if not _is_count(fallback_total):
            raise self._corrupt(FALLBACK_TOTAL_KEY, "a count", fallback_total)
        if not isinstance(recent, list | tuple) or not all(_is_loss_entry(entry) for entry in recent):
            raise self._corrupt(RECENT_LOSSES_KEY, "a list of (loss, token count) pairs", recent)
        self.fallback_total = fallback_total
        self._recent_losses = deque(recent)  # _log_train_loss sets its length
        epoch_loss = checkpoint.get(EPOCH_LOSS_KEY)
        if epoch_loss is not None and not _is_epoch_entry(epoch_loss):
            raise self._corrupt(EPOCH_LOSS_KEY, "an (epoch, loss sum, weight) triple", epoch_loss)
        self._epoch_loss_restored = epoch_loss
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        key = type(datamodule).__qualname__  # where Lightning saves the DataModule's state, restored after this hook
        saved = checkpoint.get(key) if datamodule is not None and DATA_STATE_KEY in checkpoint else None
        if saved is not None and not _same_state(saved, checkpoint[DATA_STATE_KEY]):
            # the CLI checked and adopted the vocabulary of DATA_STATE_KEY; Lightning would swap in this one
            raise self._corrupt(key, f"the data state saved beside it as {DATA_STATE_KEY}", saved)

    def on_train_start(self) -> None:
        states, self._random_states_to_restore = getattr(self, "_random_states_to_restore", None), None
        if states is not None:
            try:
                set_random_states(states)
            except (TypeError, ValueError, KeyError, IndexError, RuntimeError) as error:
                raise self._corrupt(
                    RANDOM_STATE_KEY, f"states torch, Python and numpy restore ({error})", states
                ) from None
        settle_restart_totals(self.trainer.fit_loop)
        restored, self._epoch_loss_restored = getattr(self, "_epoch_loss_restored", None), None
        if restored is not None and restored[0] == self.current_epoch:  # the epoch the checkpoint stopped in
            self._epoch_loss = (torch.tensor(restored[1], dtype=torch.float64, device=self.device), restored[2])
        self._check_optimizer_state()

    def _check_optimizer_state(self) -> None:
        """Refuse a restored optimizer state whose per-parameter tensors (Adam's moments) do not have their
        parameter's shape: torch restores them unchecked, and the first step failed deep inside ``Adam.step``."""
        for optimizer in self.trainer.optimizers:
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    for name, value in optimizer.state.get(parameter, {}).items():
                        if name in PER_PARAMETER_STATE and value.shape != parameter.shape:
                            got = (
                                f"{name} of shape {list(value.shape)} for a parameter of shape {list(parameter.shape)}"
                            )
                            raise corrupt_checkpoint(
                                self._saved_at(),
                                f"expected its optimizer_states to fit the model's parameters, got {got}",
                            )

    def _corrupt(self, key: str, expected: str, got: object) -> CheckpointError:
        """The error for a resume state this module wrote, found unusable in the checkpoint being loaded."""
        return corrupt_checkpoint(self._saved_at(), f"expected its {key} to be {expected}, got {shown(got)}")

    def _saved_at(self) -> str:
        """The checkpoint being loaded, as errors name it."""
        trainer = self._trainer
        return f"--ckpt_path {trainer.ckpt_path}" if trainer is not None and trainer.ckpt_path else "the checkpoint"


PER_PARAMETER_STATE = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "sum", "exp_inf"}
    | {"grad_avg", "prev", "step_size", "ax"}
)
"""The state torch's optimizers keep per parameter in the parameter's shape (Adam's moments, SGD's momentum, ...);
not Adafactor's factored variances, nor the scalars (``step``)."""


def _same_state(first: object, second: object) -> bool:
    """Whether two saved data states are equal (plain values; a tensor inside either is compared as a tensor)."""
    try:
        return bool(first == second)
    except (RuntimeError, TypeError, ValueError):  # tensors of other shapes, or `==` of tensors left ambiguous
        return False


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_loss_entry(entry: object) -> bool:
    """A ``(loss, weight)`` pair of the ``train/loss`` window as :func:`_as_floats` writes it."""
    if not isinstance(entry, list | tuple) or len(entry) != 2:
        return False
    loss, weight = entry
    number = isinstance(loss, float | int) and not isinstance(loss, bool)
    return number and math.isfinite(loss) and _is_count(weight)  # a NaN there was logged as train/loss


def _epoch_entry(epoch: int, epoch_loss: tuple[Tensor, int] | None) -> tuple[int, float, int]:
    """The checkpoint's record of the epoch's loss so far (:data:`EPOCH_LOSS_KEY`): plain numbers."""
    total, weight = epoch_loss if epoch_loss is not None else (0.0, 0)
    return (int(epoch), float(total), int(weight))


def _is_epoch_entry(entry: object) -> bool:
    if not isinstance(entry, list | tuple) or len(entry) != 3:
        return False
    epoch, total, weight = entry
    return _is_count(epoch) and isinstance(total, float) and math.isfinite(total) and _is_count(weight)


def _as_floats(losses: Any) -> list[tuple[float, int]]:
    """The ``train/loss`` window as plain numbers for a checkpoint (read with ``weights_only=True``)."""
    return [(float(value), int(count)) for value, count in losses]
