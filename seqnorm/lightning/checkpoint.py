"""``ResumableCheckpoint``: Lightning's ModelCheckpoint made crash-safe, whose ``last.ckpt`` is always the newest."""

from __future__ import annotations

import os
import posixpath
from typing import Any
from weakref import proxy

import lightning.pytorch as pl
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

from seqnorm.checkpoint_io import corrupt_checkpoint, shown
from seqnorm.lightning.atomic_io import AtomicCheckpointIO, atomic_copy, is_disk_full, local_path

__all__ = ["ResumableCheckpoint"]


class ResumableCheckpoint(ModelCheckpoint):
    """ModelCheckpoint whose files survive crashes, signals and full disks, and whose ``last.ckpt`` is the newest.

    All arguments are ModelCheckpoint's. What it changes:

    - **Atomic writes.** In ``setup`` it replaces the strategy's default TorchCheckpointIO by
      :class:`~seqnorm.lightning.atomic_io.AtomicCheckpointIO` (temporary file beside the target, fsync, rename), so
      every checkpoint the run writes is either the previous complete file or the new one. A CheckpointIO plugin
      of the user's own is left alone.
    - **last before best.** When a save produces a top-k file and ``last.ckpt`` at the same step (``save_last=True``),
      ``last.ckpt`` is written first and the top-k file is then made from it (a hard link renamed into place: no
      second serialization, same content). A kill between the two leaves ``last.ckpt`` newer, never older, than
      every top-k file.
    - **Exceptions and signals write only last.** Lightning's ``save_on_exception`` writes a file named by
      ``filename`` (``best-...ckpt`` here) although nothing was validated; here a run ending in an exception, Ctrl-C
      or SIGTERM writes only ``last.ckpt`` (``interrupted.ckpt`` when ``save_last`` is off), and only while fitting.
      If that save fails too, a warning is logged (not when both are a full disk: the exception says it) and the
      original exception propagates.
    - **last.ckpt at every validation.** Lightning rewrites ``last.ckpt`` only when a top-k file is saved; here
      every validation refreshes it, so a killed run loses at most one validation interval.
    - **last.ckpt at the final step.** A run stopped by ``max_steps`` between two validations still saves its final
      state, so ``--ckpt_path .../last.ckpt`` continues exactly where the run ended.
    - **A moved run resumes in place.** Resumed from a checkpoint in its own ``dirpath`` (``seqnorm fit`` continues
      a checkpoint's run directory) after that directory was moved or copied, the saved state names the same files
      under the old path: it is rebased onto ``dirpath``, so the top-k files are still tracked and ``last.ckpt`` is
      rewritten, where Lightning would drop the state and write a new ``last-v1.ckpt`` beside a stale ``last.ckpt``.
    """

    CHECKPOINT_NAME_INTERRUPTED = "interrupted"

    _last_written_at_step: int | None = None
    _held_back: list[tuple[str, str]] | None = None
    _restoring_from: str | None = None  # the checkpoint file whose state load_state_dict receives
    _restoring_to_fit = True

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        strategy = trainer.strategy
        checkpoint_io = strategy.checkpoint_io  # Lightning's default TorchCheckpointIO when none was configured
        wrapped = checkpoint_io.checkpoint_io if isinstance(checkpoint_io, _WrappingCheckpointIO) else None
        # `type(...) is`, not isinstance: a subclass is a plugin of the user's own, with its own way of writing.
        if type(checkpoint_io) is TorchCheckpointIO:
            strategy.checkpoint_io = AtomicCheckpointIO()
        elif type(wrapped) is TorchCheckpointIO:  # e.g. AsyncCheckpointIO over the default writer
            checkpoint_io._checkpoint_io = AtomicCheckpointIO()

    # ---- resuming ---------------------------------------------------------------------------------------------

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        super().on_load_checkpoint(trainer, pl_module, checkpoint)
        self._restoring_from = str(trainer.ckpt_path) if trainer.ckpt_path is not None else None
        self._restoring_to_fit = trainer.state.fn == TrainerFn.FITTING

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_saved(state_dict)
        if not self._restoring_to_fit:
            # validate/test/predict save nothing: only best_model_path (ckpt_path="best") matters, and Lightning's
            # warning that the other state is not reloaded from another run's folder would only puzzle
            self.best_model_path = state_dict["best_model_path"]
            return
        saved, source = state_dict.get("dirpath"), local_path(self._restoring_from) if self._restoring_from else None
        here = os.path.abspath(self.dirpath) if self.dirpath is not None and local_path(self.dirpath) else None
        if saved and here and source and saved != self.dirpath and os.path.dirname(os.path.abspath(source)) == here:
            state_dict = {key: _rebased(value, str(saved), here) for key, value in state_dict.items()}
        super().load_state_dict(state_dict)
        self._forget_foreign_files()

    def _check_saved(self, state: dict[str, Any]) -> None:
        """Refuse a saved state whose entries are not of the kinds ModelCheckpoint writes: a missing
        ``best_model_path`` was a ``KeyError`` traceback, a score saved as a string a ``TypeError`` at the first
        comparison, steps into the resumed run."""
        where = f"--ckpt_path {self._restoring_from}" if self._restoring_from else "the checkpoint"

        def score(value: object) -> bool:
            if isinstance(value, Tensor):
                return value.numel() == 1 and not value.dtype.is_complex
            return value is None or (isinstance(value, int | float) and not isinstance(value, bool))

        best = state.get("best_k_models", {})
        checks = [
            ("best_model_path", "a path", isinstance(state.get("best_model_path"), str)),
            ("kth_best_model_path", "a path", isinstance(state.get("kth_best_model_path", ""), str)),
            ("last_model_path", "a path", isinstance(state.get("last_model_path", ""), str)),
            ("dirpath", "a folder or None", state.get("dirpath") is None or isinstance(state.get("dirpath"), str)),
            ("best_model_score", "a score", score(state.get("best_model_score"))),
            ("kth_value", "a score", score(state.get("kth_value"))),
            (
                "best_k_models",
                "a dict of paths to scores",
                isinstance(best, dict) and all(isinstance(path, str) and score(value) for path, value in best.items()),
            ),
        ]
        for key, expected, fits in checks:
            if not fits:
                what = f"expected the {type(self).__name__} state's {key} to be {expected}, got "
                raise corrupt_checkpoint(where, what + shown(state.get(key, "nothing")))

    def _owns(self, filepath: str) -> bool:
        """Whether ``filepath`` is inside ``dirpath`` (a file, or a sharded checkpoint's folder, at any depth, as
        filename templates with a ``/`` make them): after resolving links and ``..`` for a local ``dirpath``; for a
        remote one, on the same filesystem and under it once normalized. A remote path recorded by a local run, or
        one of a filesystem that cannot be opened here, is not this run's."""
        if self.dirpath is None:
            return False
        try:
            local, folder = local_path(filepath), local_path(self.dirpath)
        except (ImportError, ValueError):  # e.g. s3:// without s3fs installed
            return False
        if folder is not None:
            if local is None:
                return False
            inside, root = os.path.realpath(local), os.path.realpath(folder)
        elif local is None and _protocol(filepath) == _protocol(self.dirpath):
            inside, root = posixpath.normpath(str(filepath)), posixpath.normpath(str(self.dirpath))
        else:
            return False
        return inside != root and inside.startswith(root.rstrip("/") + "/")

    def _forget_foreign_files(self) -> None:
        # A checkpoint is a file one may receive from someone else, and its state names the files Lightning will
        # later delete (the previous last.ckpt, top-k files that drop out), recursively: a path that leads out of
        # dirpath ("<dirpath>/../../elsewhere") would delete there. Such entries are dropped, never acted on.
        foreign = [
            path
            for path in (self.best_model_path, self.kth_best_model_path, self.last_model_path, *self.best_k_models)
            if path and not self._owns(path)
        ]
        if not foreign:
            return
        for name in ("best_model_path", "kth_best_model_path"):
            if getattr(self, name) in foreign:
                setattr(self, name, "")
        if self.last_model_path in foreign:
            # the run's own last file, which the next save replaces (an empty record would make it last-v1.ckpt)
            own_last = os.path.join(str(self.dirpath), self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)
            self.last_model_path = own_last if "{" not in self.CHECKPOINT_NAME_LAST else ""
        self.best_k_models = {path: score for path, score in self.best_k_models.items() if path not in foreign}
        rank_zero_warn(
            f"ResumableCheckpoint: the checkpoint's record names files outside {self.dirpath}: {sorted(set(foreign))}; "
            "they are forgotten (never replaced or deleted)"
        )

    # ---- last before best -------------------------------------------------------------------------------------

    def _save_topk_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, Tensor]) -> None:
        if self.monitor is not None and self.monitor not in monitor_candidates and not _validated(trainer):
            # A run that ends before its first validation has no best to keep (last.ckpt holds its state);
            # Lightning would warn as if the metric were misnamed. After a validation a missing key is still its error.
            return
        if self.save_last is not True:  # no last.ckpt to write first ("link" makes last point at the top-k file)
            super()._save_topk_checkpoint(trainer, monitor_candidates)
            return
        # Lightning decides the top-k file names and which files drop out of the top k; its writes and removals
        # are held back here and done after last.ckpt, in an order where an interruption loses nothing newer.
        self._held_back = []
        try:
            super()._save_topk_checkpoint(trainer, monitor_candidates)
        finally:
            held_back, self._held_back = self._held_back, None
        saves = [path for action, path in held_back if action == "save"]
        if saves:
            self._save_last_checkpoint(trainer, monitor_candidates)
            for path in saves:
                self._copy_last_to(trainer, path)
        for action, path in held_back:
            if action == "remove":
                self._remove_own(trainer, path)

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        if self._held_back is not None:
            self._held_back.append(("save", filepath))
            return
        super()._save_checkpoint(trainer, filepath)

    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        if self._held_back is not None:
            self._held_back.append(("remove", filepath))
            return
        self._remove_own(trainer, filepath)

    def _remove_own(self, trainer: pl.Trainer, filepath: str) -> None:
        """Lightning's removal (recursive), only of a file of this callback's own (:meth:`_owns`)."""
        if not self._owns(filepath):
            rank_zero_warn(f"ResumableCheckpoint: not removing {filepath}: not inside {self.dirpath}")
            return
        super()._remove_checkpoint(trainer, filepath)

    def _save_last_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, Tensor]) -> None:
        if self._last_written_at_step == trainer.global_step:
            return  # written first by _save_topk_checkpoint; Lightning asks again right after
        super()._save_last_checkpoint(trainer, monitor_candidates)
        if self.save_last:
            self._last_written_at_step = trainer.global_step

    def _copy_last_to(self, trainer: pl.Trainer, filepath: str) -> None:
        """Make top-k file ``filepath`` from the ``last.ckpt`` just written (same step, same content)."""
        source, target = local_path(self.last_model_path), local_path(filepath)
        # A hard link is safe only while every write of last.ckpt is a rename (AtomicCheckpointIO's); a plugin that
        # rewrote it in place would change the top-k file too, so then the checkpoint is serialized again.
        if not isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO) or source is None or target is None:
            trainer.save_checkpoint(filepath, self.save_weights_only)
        elif trainer.is_global_zero:
            atomic_copy(source, target)
        trainer.strategy.barrier()
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        # Lightning (>= 2.2) refreshes last.ckpt only when a top-k file was saved at this step: after a validation
        # that did not improve, a SIGKILL would then lose every step back to the last improvement. Here every
        # validation refreshes it, so a kill loses at most one validation interval.
        if (
            self.save_last is True
            and not self._should_skip_saving_checkpoint(trainer)
            and not self._should_save_on_train_epoch_end(trainer)
        ):  # a new best saved at this step (last.ckpt first) makes the skip test true
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    # ---- exceptions, signals, the end of training --------------------------------------------------------------

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Not super(): it would write a `filename` (best-...) checkpoint of a state that was never validated.
        if trainer.state.fn != TrainerFn.FITTING or not self._should_save_on_exception(trainer):
            return
        name = self.CHECKPOINT_NAME_LAST if self.save_last else self.CHECKPOINT_NAME_INTERRUPTED
        try:
            if self.save_last:
                self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
                filepath = self.last_model_path
            else:
                filepath = self.format_checkpoint_name(self._monitor_candidates(trainer), name)
                super()._save_checkpoint(trainer, filepath)
        except Exception as error:  # a full disk, say: report it, and let the original exception through
            if not (is_disk_full(exception) and is_disk_full(error)):  # both: the exception says it already
                failed = type(exception).__name__
                rank_zero_warn(f"ResumableCheckpoint: could not save {name} after {failed}: {error!r}")
            return
        step = trainer.global_step
        rank_zero_info(f"ResumableCheckpoint: {type(exception).__name__} at step {step}; saved {filepath}")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if self.save_last and self.dirpath is not None and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


def _protocol(path: Any) -> str:
    """The fsspec protocol of a URL (``"s3"``, ``"memory"``), ``""`` for a plain path."""
    text = str(path)
    return text.split("://", 1)[0] if "://" in text else ""


def _validated(trainer: pl.Trainer) -> bool:
    """Whether this fit has run a validation loop (Lightning's own test before it calls a missing monitor an error)."""
    return bool(getattr(trainer.fit_loop.epoch_loop.val_loop, "_has_run", True))


def _rebased(value: Any, old: str, new: str) -> Any:
    """A path of ModelCheckpoint's state (or a dict keyed by them) in folder ``old``, read in folder ``new``."""
    if isinstance(value, dict):
        return {_rebased(key, old, new): item for key, item in value.items()}
    old = old.rstrip(os.sep)
    if isinstance(value, str) and (value == old or value.startswith(old + os.sep)):
        return new + value[len(old) :]
    return value
