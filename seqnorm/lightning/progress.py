"""``SeqnormProgressBar``: Lightning's RichProgressBar without the "Epoch 0/-2" of runs bounded by steps."""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar

__all__ = ["SeqnormProgressBar"]


class SeqnormProgressBar(RichProgressBar):
    """RichProgressBar whose training description names the last epoch only when there is one.

    With ``--trainer.max_steps`` and no ``max_epochs``, Lightning sets ``max_epochs=-1`` (no epoch limit), and
    RichProgressBar writes ``Epoch {epoch}/{max_epochs - 1}``, i.e. ``Epoch 0/-2``. Here such a run shows
    ``Epoch 0``; a run with an epoch limit still shows ``Epoch 0/4``. All arguments are RichProgressBar's.
    """

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is None or self.trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        description = f"Epoch {current_epoch}"
        # padded to the validation bar's description, as RichProgressBar does (uneven lengths flicker)
        return f"{description:{max(len(description), len(self.validation_description))}}"
