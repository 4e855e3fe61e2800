"""A tiny LightningModule that holds seqnorm layers somewhere inside it, its data, and an event-file reader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import seqnorm
from seqnorm.callbacks import HiddenStateStats
from tests.conftest import running_fallback

LENGTHS = [6, 4, 3, 1, 6, 5, 2, 2]  # two batches of 4; steps 4 and 5 of the first batch have one real row
BATCH_NORM_LENGTHS = [6, 6, 3, 2, 6, 5, 2, 2]  # at least 2 real rows at every step of the first batch
INPUT_SIZE = 3


class TinySequenceModel(pl.LightningModule):
    """Per-step regression with seqnorm layers nested in a ModuleDict, as a user's own module might hold them."""

    def __init__(
        self,
        cell: str = "lstm",
        norm: str = "layer",
        num_layers: int = 1,
        bidirectional: bool = False,
        decoder: bool = False,
        hidden_size: int = 8,
    ) -> None:
        super().__init__()
        layer = {"lstm": seqnorm.LSTM, "gru": seqnorm.GRU}[cell]
        options: dict[str, Any] = {"norm": running_fallback(norm), "batch_first": True}
        self.body = nn.ModuleDict(
            {"encoder": layer(INPUT_SIZE, hidden_size, num_layers, bidirectional=bidirectional, **options)}
        )
        width = hidden_size * (2 if bidirectional else 1)
        if decoder:
            self.body["decoder"] = seqnorm.GRU(width, hidden_size, **options)
            width = hidden_size
        self.head = nn.Linear(width, 1)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        output, _ = self.body["encoder"](x, lengths=lengths)
        if "decoder" in self.body:
            output, _ = self.body["decoder"](output, lengths=lengths)
        return self.head(output).squeeze(-1)

    def _loss(self, batch: list[Tensor]) -> Tensor:
        x, lengths, targets = batch
        real = torch.arange(x.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
        return (self(x, lengths) - targets)[real].square().mean()

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self._loss(batch)

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def sequences(pad_value: float = 0.0, lengths: list[int] = LENGTHS, seed: int = 0) -> TensorDataset:
    """Random sequences of ``lengths`` padded to their longest with ``pad_value``."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    steps = int(lengths.max())
    x = torch.randn(len(lengths), steps, INPUT_SIZE, generator=generator)
    real = torch.arange(steps).unsqueeze(0) < lengths.unsqueeze(1)
    x = torch.where(real.unsqueeze(2), x, pad_value)
    targets = torch.randn(len(lengths), steps, generator=generator)
    return TensorDataset(x, lengths, targets)


def loader(pad_value: float = 0.0, lengths: list[int] = LENGTHS) -> DataLoader:
    return DataLoader(sequences(pad_value, lengths), batch_size=4, shuffle=False)


def make_trainer(root: Path, callback: HiddenStateStats, **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = {
        "max_steps": 2,
        "limit_val_batches": 1,
        "num_sanity_val_steps": 0,
        "logger": TensorBoardLogger(str(root), name="", version=0),
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "accelerator": "cpu",
    }
    options.update(kwargs)
    return pl.Trainer(callbacks=[callback], **options)


def events(root: Path) -> EventAccumulator:
    """Everything the run under ``root`` wrote, nothing subsampled."""
    accumulator = EventAccumulator(str(root), size_guidance={"scalars": 0, "histograms": 0, "images": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def scalar(accumulator: EventAccumulator, tag: str, step: int | None = None) -> float:
    entries = accumulator.Scalars(tag)
    if step is not None:
        entries = [entry for entry in entries if entry.step == step]
    assert entries, f"no value of {tag} at step {step}"
    return entries[-1].value
