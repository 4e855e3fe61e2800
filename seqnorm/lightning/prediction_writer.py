"""``PredictionWriter``: what ``seqnorm predict`` writes, one JSON line per input sequence, in input order."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from seqnorm.lightning.atomic_io import AtomicTextFile

__all__ = ["PREDICTIONS_FILE", "PredictionWriter"]

PREDICTIONS_FILE = "predictions.jsonl"
"""The file name in the predict run's directory (``lightning_logs/<run name>/version_N/predict_K/``)."""


class PredictionWriter(BasePredictionWriter):
    """Write every prediction of ``Trainer.predict`` as one JSON object per line into ``<run dir>/predictions.jsonl``.

    The rows come from the task module's ``prediction_records(prediction, batch)`` (each task decides what a row
    holds: :meth:`SequenceClassifier.prediction_records <seqnorm.lightning.SequenceClassifier.prediction_records>`,
    :meth:`LanguageModel.prediction_records <seqnorm.lightning.LanguageModel.prediction_records>`); this callback
    adds ``index``, the sequence's position in the predict dataset (seqnorm's DataModules predict on the test split
    in file order, so for a labelled file the index is the line's number among its non-blank lines, from 0) and,
    where the dataset says which text unit each sequence was cut from, ``unit`` (a language model's line longer than
    its window is several sequences: :class:`~seqnorm.data.LanguageModelingDataset`'s ``units``). It writes the rows
    as the batches arrive, so memory does not grow with the data, into a temporary file beside the
    target that becomes it when the predict ends (a link at the path is replaced, never written through; a predict
    that fails leaves the previous file). ``seqnorm predict`` installs it.

    Args:
        output_dir: where to write; ``None``: the trainer's ``log_dir`` (the run's
            folder, ``lightning_logs/<run name>/version_N/predict_K`` for a run's checkpoint).
        filename: the file's name. With several processes, each writes its own ``<stem>.rank<R><suffix>``.
    """

    def __init__(self, output_dir: str | None = None, filename: str = PREDICTIONS_FILE) -> None:
        super().__init__(write_interval="batch")
        if not filename or os.sep in filename or (os.altsep and os.altsep in filename):
            raise ValueError(
                f"PredictionWriter: expected filename to be a file name without a folder, got {filename!r}"
            )
        self.output_dir = output_dir
        self.filename = filename
        self.path: Path | None = None
        """The file written by the latest ``predict``."""
        self._file: AtomicTextFile | None = None
        self._rows = 0

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not callable(getattr(pl_module, "prediction_records", None)):
            raise ValueError(
                f"PredictionWriter: expected a module with prediction_records(prediction, batch) (seqnorm's task "
                f"modules), got {type(pl_module).__name__}"
            )
        run_dir = trainer.log_dir or trainer.default_root_dir  # log_dir is None without a logger
        directory = Path(self.output_dir if self.output_dir is not None else run_dir)
        name = Path(self.filename)
        if trainer.world_size > 1:  # every process predicts its own share of the batches
            name = name.with_name(f"{name.stem}.rank{trainer.global_rank}{name.suffix}")
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / name
        # through a temporary file renamed into place at the end: a link planted at the path is replaced, not
        # written through (open(path, "w") followed it), and a predict that fails keeps the previous file
        self._file = AtomicTextFile(self.path)
        self._rows = 0

    def write_on_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        assert self._file is not None
        records = pl_module.prediction_records(prediction, batch)
        # Lightning gives the dataset indices of the batch's rows (it wraps the predict batch sampler); a loader it
        # cannot wrap gets running numbers, which are the same indices for a loader in dataset order.
        indices = list(batch_indices) if batch_indices and len(batch_indices) == len(records) else None
        # a dataset whose sequences were cut from longer units says which (LanguageModelingDataset.units)
        units = getattr(getattr(_loader(trainer, dataloader_idx), "dataset", None), "units", None)
        for offset, record in enumerate(records):
            index = indices[offset] if indices is not None else self._rows + offset
            unit = {"unit": int(units[index])} if units is not None else {}
            self._file.write(json.dumps({"index": int(index), **unit, **record}) + "\n")
        self._rows += len(records)

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        file, self._file = self._file, None
        if file is not None:
            file.commit()
        rank_zero_info(f"PredictionWriter: {self._rows} predictions written to {self.path}")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        file, self._file = self._file, None
        if file is not None:
            file.discard()


def _loader(trainer: pl.Trainer, dataloader_idx: int) -> Any:
    loaders = trainer.predict_dataloaders
    return loaders[dataloader_idx] if isinstance(loaders, list | tuple) else loaders
