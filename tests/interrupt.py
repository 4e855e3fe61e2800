"""A callback the tests name by class path on the ``seqnorm`` command line (``--trainer.callbacks+=...``) or pass to a
Trainer: a module of its own, so that naming it imports Lightning and this alone, not tests/conftest.py's helpers."""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback


class InterruptAfter(Callback):
    """Raises KeyboardInterrupt (what Ctrl-C does) after training step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            raise KeyboardInterrupt
