"""What exact resume needs beyond Lightning's own checkpoint: the global random states, and a loop-state repair.

* Dropout, recurrent dropout and zoneout draw from the global torch random state (and a user's code may draw from
  Python's or numpy's). :func:`random_states` captures them as plain lists, ints, strings and tensors, so a
  checkpoint still loads with ``torch.load(weights_only=True)``; :func:`set_random_states` puts them back.
* :func:`rewind_finished_epoch` repairs the loop state of a checkpoint written after the fit loop has closed the
  epoch (at the end of training, e.g. on ``max_steps``): see its docstring.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["RANDOM_STATE_KEY", "random_states", "rewind_finished_epoch", "set_random_states"]

RANDOM_STATE_KEY = "seqnorm_random_states"
"""Checkpoint key of the global random states at the time of saving."""


def random_states() -> dict[str, Any]:
    """The global torch (CPU and CUDA), Python and numpy random states, as weights-only-loadable containers."""
    version, internal, gauss_next = random.getstate()
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
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
    """Make a checkpoint written after the fit loop closed its epoch look like one written after the last step.

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
    if not (closed and trained and current["completed"] > 0):
        return
    for counters in (epochs["total"], epochs["current"]):
        counters["processed"] -= 1
        counters["completed"] -= 1
    for counters in (batches["total"], batches["current"]):
        counters["completed"] -= 1
    # Lightning adds one back when it resumes from `on_train_batch_end` (it was saved before its increment).
    fit["epoch_loop.state_dict"]["_batches_that_stepped"] -= 1
