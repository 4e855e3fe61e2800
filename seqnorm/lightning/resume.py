"""What exact resume needs beyond Lightning's own checkpoint: the global random states, and a loop-state repair.

* Dropout, recurrent dropout and zoneout draw from the global torch random state (and a user's code may draw from
  Python's or numpy's). :func:`random_states` captures them as plain lists, ints, strings and tensors, so a
  checkpoint still loads with ``torch.load(weights_only=True)``; :func:`set_random_states` puts them back.
* :func:`rewind_finished_epoch` repairs the loop state of a checkpoint written after the fit loop has closed the
  epoch (at the end of training, e.g. on ``max_steps``): see its docstring.
* :func:`rewind_unfinished_batch` and :func:`rewind_unfinished_validation` turn a checkpoint written by an exception
  (Ctrl-C, SIGTERM, an error) in the middle of a training step or a validation into one that redoes that step or
  that validation exactly once; :func:`settle_restart_totals` completes that repair when the run resumes.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = [
    "RANDOM_STATE_KEY",
    "random_states",
    "resumed_epoch",
    "rewind_finished_epoch",
    "rewind_unfinished_batch",
    "rewind_unfinished_validation",
    "set_random_states",
    "settle_restart_totals",
    "snapshot_random_states",
]

RANDOM_STATE_KEY = "seqnorm_random_states"
"""Checkpoint key of the global random states at the time of saving."""


def snapshot_random_states() -> tuple[Any, ...]:
    """The global random states as the libraries return them: cheap enough to take before every training step."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state(legacy=True)


def random_states(snapshot: tuple[Any, ...] | None = None) -> dict[str, Any]:
    """The global torch (CPU and CUDA), Python and numpy random states, as weights-only-loadable containers.

    Args:
        snapshot: what :func:`snapshot_random_states` returned earlier; by default the states now.
    """
    torch_state, cuda, (version, internal, gauss_next), numpy_state = snapshot or snapshot_random_states()
    name, keys, position, has_gauss, cached_gaussian = numpy_state
    return {
        "torch": torch_state,
        "torch_cuda": cuda,
        "python": [version, list(internal), gauss_next],
        "numpy": [name, keys.tolist(), int(position), int(has_gauss), float(cached_gaussian)],
    }


def set_random_states(states: dict[str, Any]) -> None:
    """Restore what :func:`random_states` returned."""
    torch.set_rng_state(states["torch"])
    if states["torch_cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["torch_cuda"])
    version, internal, gauss_next = states["python"]
    random.setstate((version, tuple(internal), gauss_next))
    name, keys, position, has_gauss, cached_gaussian = states["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), position, has_gauss, cached_gaussian))


def rewind_finished_epoch(loops: dict[str, Any]) -> None:
    """Make a checkpoint written after the fit loop closed its epoch look like one written after the last step, and
    one written in the validation at an epoch's end like one written before that epoch's end.

    When training stops (``max_steps``, ``max_epochs``) the fit loop counts the current epoch as done, even in the
    middle of it, and keeps the epoch's batch counters. A run resumed from that state (Lightning 2.6) starts the
    *next* epoch with the old batch count: after a stop mid-epoch the rest of the epoch is relabelled as the next
    epoch (whose sampler order differs), and after a stop at the end of an epoch the next epoch ends after one
    batch — shifting the validation schedule. This rewrites the counters to those of a checkpoint saved by an
    exception in ``on_train_batch_end`` of the last step, a state Lightning resumes from exactly: it finishes the
    epoch (or starts the next one if that step was its last) and counts ``_batches_that_stepped`` on.

    Args:
        loops: ``checkpoint["loops"]``, changed in place. Other states are left alone.
    """
    fit = loops.get("fit_loop")
    if not fit or "epoch_progress" not in fit or "epoch_loop.batch_progress" not in fit:
        return
    epochs, batches = fit["epoch_progress"], fit["epoch_loop.batch_progress"]
    current = epochs["current"]
    closed = current["ready"] == current["started"] == current["processed"] == current["completed"]
    trained = batches["current"]["completed"] == batches["current"]["processed"] > 0
    # Saved by the validation at the end of an epoch: every batch trained, the epoch counted processed but its end
    # (the epoch-end hooks, the schedulers' epoch step) still to come. Lightning resumed it by counting the epoch
    # processed a second time (the next epoch's sampler order was the one after it) and adding one to
    # `_batches_that_stepped`; uncounted, the resumed run runs that epoch end (as the stopped run did after the
    # save) and goes on exactly.
    closing = current["ready"] == current["started"] == current["processed"] == current["completed"] + 1
    if closing and trained and batches.get("is_last_batch"):
        for counters in (epochs["total"], epochs["current"]):
            counters["processed"] -= 1
        fit["epoch_loop.state_dict"]["_batches_that_stepped"] -= 1
        return
    if not (closed and trained and current["completed"] > 0):
        return
    for counters in (epochs["total"], epochs["current"]):
        counters["processed"] -= 1
        counters["completed"] -= 1
    for counters in (batches["total"], batches["current"]):
        counters["completed"] -= 1
    # Lightning adds one back when it resumes from `on_train_batch_end` (it was saved before its increment).
    fit["epoch_loop.state_dict"]["_batches_that_stepped"] -= 1


def resumed_epoch(checkpoint: dict[str, Any], current_epoch: int) -> int:
    """The epoch a run resumed from ``checkpoint`` continues in (its ``current_epoch`` at ``on_train_start``): the
    fit loop's completed epochs, as the rewinds above left them (a stop after an epoch's last step counts that epoch
    as unfinished); ``current_epoch`` for a checkpoint without them."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
    completed = progress.get("completed")
    return completed if isinstance(completed, int) else current_epoch


def rewind_unfinished_batch(loops: dict[str, Any], *, lightning_adds_step: bool, rewindable: list[bool]) -> bool:
    """Make a checkpoint written during a training step resume by redoing that step, exactly once.

    The batch was taken from the loader and counted ``ready`` (and ``started``) but not ``processed``; Lightning
    (2.6) redoes such a batch — its restart resets the epoch's ``current`` counters to ``completed`` — but the
    loader's state counts the batch as taken, and the restart adds one to ``_batches_that_stepped`` although the
    value saved already counts every step that ran. This takes the batch back from the loader states and
    subtracts that one; the ``total`` counters, which the restart does not reset, are repaired by
    :func:`settle_restart_totals`. The caller writes the random states and the optimizer progress (the training
    step and backward run inside ``optimizer_step``, which counts its calls) of the step's start.

    Not for an exception after the optimizer step has begun (inside ``optimizer.step()``): the parameters may
    already hold this batch's update, and it is trained on a second time.

    Args:
        loops: ``checkpoint["loops"]``, changed in place.
        lightning_adds_step: whether Lightning's restart will add one to ``_batches_that_stepped`` (it does unless
            the step accumulates gradients, ``not epoch_loop._should_accumulate()``).
        rewindable: for each loader state in the checkpoint, whether it is a
            :class:`~seqnorm.data.loader.ResumableDataLoader`'s; other states are left alone.

    Returns:
        Whether the checkpoint was written during a training step (and so was changed).
    """
    fit = loops.get("fit_loop")
    if not fit or "epoch_loop.batch_progress" not in fit:
        return False
    batches = fit["epoch_loop.batch_progress"]
    if batches["current"]["ready"] <= batches["current"]["processed"]:
        return False
    for state, ours in zip(fit.get("state_dict", {}).get("combined_loader", []), rewindable, strict=False):
        if ours and state["position"] > 0:
            state["position"] -= 1
    # The flag belongs to the batch being redone; before it was fetched the epoch had not reached its last batch.
    batches["is_last_batch"] = False
    if lightning_adds_step:
        fit["epoch_loop.state_dict"]["_batches_that_stepped"] -= 1
    return True


def rewind_unfinished_validation(loops: dict[str, Any]) -> bool:
    """Make a checkpoint written during a validation inside the fit loop resume by running that validation again.

    Left alone, Lightning (2.6) resumes such a checkpoint either by skipping the validation (its batch counters
    look like a save at the validation's end) or by running only as many batches as were left, from the first
    one, while the metric states of the batches done are gone. This rewrites the validation's counters to those
    of an exception in its first batch, the one state from which the restart runs the whole validation again
    ("restarted mid-evaluation"); :func:`settle_restart_totals` then drops that first batch from the totals.

    Args:
        loops: ``checkpoint["loops"]``, changed in place.

    Returns:
        Whether the checkpoint was written during a validation (and so was changed).
    """
    fit = loops.get("fit_loop")
    key = "epoch_loop.val_loop.batch_progress"
    if not fit or key not in fit or "epoch_loop.batch_progress" not in fit:
        return False
    train, progress = fit["epoch_loop.batch_progress"]["current"], fit[key]
    between_steps = train["ready"] == train["started"] == train["processed"] == train["completed"]
    current = progress["current"]
    if not (between_steps and current["ready"] > current["completed"]):
        return False
    before = progress["total"]["completed"] - current["completed"]  # the epoch's validation batches before this one
    progress["total"] = {"ready": before + 1, "started": before + 1, "processed": before, "completed": before}
    progress["current"] = {"ready": 1, "started": 1, "processed": 0, "completed": 0}
    progress["is_last_batch"] = False
    return True


def settle_restart_totals(fit_loop: Any) -> None:
    """Finish the repair of a resumed unfinished step or validation, once Lightning has read its restart stage.

    Lightning restarts an unfinished step or validation by resetting the ``current`` batch counters to
    ``completed``, but not the ``total`` ones: they would stay one batch ahead for good, and the next resume
    would take every checkpoint for one written in the middle of a step. Call this between the restart stage
    being set (``fit_loop.reset``) and the first batch, i.e. in ``on_train_start``.
    """
    epoch_loop = fit_loop.epoch_loop
    if not fit_loop.restarting:
        return
    for progress in (epoch_loop.batch_progress, epoch_loop.val_loop.batch_progress):
        if progress.total.ready > progress.total.processed:  # the batch is taken again; counted when it completes
            progress.total.reset_on_restart()
