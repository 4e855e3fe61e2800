"""``SeqnormProgressBar``: Lightning's RichProgressBar without the "Epoch 0/-2" of runs bounded by steps, with the run's
version as Lightning's logger names it, and one line at 80 columns."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import BatchesProcessedColumn, CustomBarColumn, CustomTimeColumn
from rich.progress import TextColumn
from rich.table import Column

__all__ = ["NARROW_WIDTH", "TIMED_WIDTH", "SeqnormProgressBar", "run_label"]

NARROW_WIDTH = 120
"""Below this many columns the bar keeps the fields that fit one line (see :class:`SeqnormProgressBar`)."""
TIMED_WIDTH = 100
"""From this many columns up to :data:`NARROW_WIDTH` a narrow bar still shows the elapsed and remaining time."""
_VERSION_PREFIX = "version_"  # Lightning's default run directories: version_0, version_1, ...


def run_label(version: int | str | None) -> str | None:
    """The run as the progress bar names it (``v_num``): ``13`` for version 13 or the directory ``version_13`` (a
    resumed run continues its directory), a run name as it is; ``None`` without a logger.

    Lightning's bar formats an int like its float metrics (``13.000``) and keeps the last four characters of a
    string (``version_13`` -> ``n_13``).
    """
    if version is None or version == "":
        return None
    if isinstance(version, str) and version.startswith(_VERSION_PREFIX) and version[len(_VERSION_PREFIX) :].isdigit():
        return version[len(_VERSION_PREFIX) :]
    return str(version)


class SeqnormProgressBar(RichProgressBar):
    """RichProgressBar whose training description names the last epoch only when there is one, whose ``v_num`` is the
    run's version or name (:func:`run_label`), and which fits narrow terminals on one line.

    With ``--trainer.max_steps`` and no ``max_epochs``, Lightning sets ``max_epochs=-1`` (no epoch limit), and
    RichProgressBar writes ``Epoch {epoch}/{max_epochs - 1}``, i.e. ``Epoch 0/-2``. Here such a run shows
    ``Epoch 0``; a run with an epoch limit still shows ``Epoch 0/4``.

    Lightning's row (description, a 40-column bar, batches, elapsed and remaining time, speed, then every metric)
    is about 140 columns wide for a language model, and at 80 its metrics wrapped onto a second line. Narrower than
    :data:`NARROW_WIDTH` the row drops the speed and ``v_num`` and writes ``train/loss`` as ``loss``; the bar is 20
    columns and the time stays down to :data:`TIMED_WIDTH`, below which the bar is 10 columns and the time goes::

        Epoch 3    ━━━━━━━━━━ 1204/2500 loss: 1.482 val/loss: 1.503 val/bpc: 2.168

    At any width the metrics end in "…" rather than wrap. The width is read when each stage's bars start. All
    arguments are RichProgressBar's.
    """

    _narrow = False

    def configure_columns(self, trainer: Trainer) -> list:
        console = getattr(self, "_console", None)  # RichProgressBar sets it just before it asks for the columns
        width = console.width if console is not None else NARROW_WIDTH
        self._narrow = width < NARROW_WIDTH
        if not self._narrow:
            return super().configure_columns(trainer)
        timed = width >= TIMED_WIDTH
        columns = [
            TextColumn("[progress.description]{task.description}", table_column=Column(no_wrap=True)),
            CustomBarColumn(
                bar_width=20 if timed else 10,
                complete_style=self.theme.progress_bar,
                finished_style=self.theme.progress_bar_finished,
                pulse_style=self.theme.progress_bar_pulse,
            ),
            BatchesProcessedColumn(style=self.theme.batch_progress),
        ]
        return [*columns, CustomTimeColumn(style=self.theme.time)] if timed else columns

    def _init_progress(self, trainer: Trainer) -> None:
        super()._init_progress(trainer)
        if self._metric_component is not None:  # cut at the edge ("…") instead of wrapping onto another line
            self._metric_component._table_column = Column(no_wrap=True, overflow="ellipsis")

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # Lightning's, from the loggers' versions: replaced (run_label)
        label = run_label(trainer.logger.version) if trainer.logger is not None else None
        if self._narrow:
            return {name.removeprefix("train/"): value for name, value in metrics.items()}
        return {"v_num": label, **metrics} if label is not None else metrics  # a string: rich prints it as it is

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is None or self.trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        description = f"Epoch {current_epoch}"
        # padded to the validation bar's description, as RichProgressBar does (uneven lengths flicker)
        return f"{description:{max(len(description), len(self.validation_description))}}"
