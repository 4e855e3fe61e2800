"""What the ``seqnorm`` command changes in the Trainer it builds, so Lightning's own flags keep their meaning.

seqnorm's default callbacks (a :class:`~seqnorm.lightning.checkpoint.ResumableCheckpoint`) and its run layout
(everything of a run in ``lightning_logs/<run name>/version_N``, :mod:`seqnorm.cli.runs`) must not turn Lightning's
switches into errors:

- ``--trainer.enable_checkpointing false`` drops the default checkpoint callback (Lightning refuses a
  ModelCheckpoint among the callbacks when checkpointing is off). A ModelCheckpoint the user added is still refused,
  by Lightning, with an error naming both (:func:`seqnorm.cli.main` shows it as one paragraph, exit 2).
- ``--trainer.logger false``: without a logger Lightning writes config.yaml and ``checkpoints/`` straight into
  ``--trainer.default_root_dir``. When that is not set (the working directory), the run gets a folder of its own
  instead, ``lightning_logs/<run name>/version_N`` as the default logger would number it (config.yaml and
  checkpoints, no TensorBoard files): no stray ``./checkpoints``, and a second run does not stop on the first one's
  config.yaml. When it is set, Lightning's layout is kept, and a folder that already holds a run's config.yaml is
  refused before training with a message naming both flags (Lightning would raise a RuntimeError there).
- The progress bar is :class:`~seqnorm.lightning.progress.SeqnormProgressBar` ("Epoch 0", not "Epoch 0/-2", for
  runs bounded by ``max_steps``) unless it is disabled or the user gave one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE

from seqnorm.cli.runs import run_dir
from seqnorm.lightning.checkpoint import ResumableCheckpoint
from seqnorm.lightning.progress import SeqnormProgressBar

__all__ = ["CONFIG_FILENAME", "adjust_trainer_config"]

CONFIG_FILENAME = "config.yaml"
"""What LightningCLI's SaveConfigCallback writes into the run's folder (its default ``config_filename``)."""


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _no_logger(logger: Any) -> bool:
    # None is Trainer's default (TensorBoard); False or an empty list mean none
    return logger is False or (isinstance(logger, list | tuple) and not logger)


def adjust_trainer_config(config: dict[str, Any], name: str | None = None) -> None:
    """Edit the Trainer's keyword arguments (callbacks already instantiated) as the module docstring says; ``name``
    is the run's name (:func:`seqnorm.cli.runs.run_name`)."""
    accumulate = config.get("accumulate_grad_batches", 1)
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        # Lightning divides by it in its loop: a ZeroDivisionError traceback mid-run
        raise ValueError(f"--trainer.accumulate_grad_batches {accumulate}: expected an int >= 1")
    callbacks = _as_list(config.get("callbacks"))
    if config.get("enable_checkpointing") is False:
        callbacks = [callback for callback in callbacks if not isinstance(callback, ResumableCheckpoint)]
    if (
        config.get("enable_progress_bar") is not False
        and _RICH_AVAILABLE
        and not any(isinstance(callback, ProgressBar) for callback in callbacks)
    ):
        callbacks.append(SeqnormProgressBar())
    config["callbacks"] = callbacks
    if _no_logger(config.get("logger")) and not config.get("fast_dev_run"):
        root = config.get("default_root_dir")
        if root is None:
            # only the Trainer's copy: the saved config.yaml keeps what the user wrote, so it reruns the same way
            config["default_root_dir"] = run_dir(root, name)
        elif "://" not in root and (Path(root) / CONFIG_FILENAME).is_file():
            raise ValueError(
                f"--trainer.logger false: --trainer.default_root_dir {root} already holds a run "
                f"({CONFIG_FILENAME}; without a logger, config.yaml and checkpoints/ go straight into that folder): "
                "pass another --trainer.default_root_dir, or leave it unset (each run then gets its own "
                "lightning_logs/<run name>/version_N)"
            )
