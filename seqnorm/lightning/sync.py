"""``SyncBatchNorm``: Lightning's ``sync_batchnorm`` for seqnorm's per-timestep batch norms too."""

from __future__ import annotations

from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from torch.nn import Module

from seqnorm.norms.sync import convert_sync_batchnorm, revert_sync_batchnorm

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(TorchSyncBatchNorm):
    """A ``LayerSync`` plugin that synchronizes ``torch.nn`` BatchNorm (as Lightning's own) and every seqnorm batch
    norm (:func:`seqnorm.convert_sync_batchnorm`) across the processes of a distributed run.

    ``seqnorm fit --trainer.sync_batchnorm true`` installs it; with a plain ``Trainer`` pass it yourself:
    ``Trainer(strategy="ddp", sync_batchnorm=True, plugins=[SyncBatchNorm()])`` (Lightning accepts it beside
    ``sync_batchnorm=True`` because it extends Lightning's ``TorchSyncBatchNorm``). No effect on a single device.
    """

    def apply(self, model: Module) -> Module:
        return convert_sync_batchnorm(super().apply(model))

    def revert(self, model: Module) -> Module:
        return revert_sync_batchnorm(super().revert(model))
