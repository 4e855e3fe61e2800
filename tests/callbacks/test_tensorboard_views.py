"""What TensorBoard shows of a HiddenStateStats run, read back from its event files: custom-scalars charts of a few
lines each, line plots for a one-layer model, and a fixed validation batch that reaches the late time steps."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from torch.utils.data import DataLoader, Dataset

from seqnorm.callbacks import HiddenStateStats
from seqnorm.callbacks.hidden_state_stats import fixed_batch_index
from seqnorm.callbacks.render import MAX_CHART_CELLS, render_profiles
from seqnorm.data import BucketBatchSampler
from tests.callbacks.conftest import TinySequenceModel, events, loader, make_trainer, sequences

# Bucketed evaluation batches of 4 come shortest first: [2, 2, 3, 3], [4, 5, 6, 6], [7, 9, 12, 12], [14, 15]. The
# longest full batch is the third; the last, longer one has two rows only.
BUCKETED_LENGTHS = [12, 3, 2, 6, 15, 9, 4, 2, 12, 6, 3, 7, 14, 5]
LONGEST_FULL_BATCH = 2


class _Sequences(Dataset):
    """:func:`sequences` with the per-example ``lengths`` that seqnorm's datasets declare."""

    def __init__(self, lengths: list[int]) -> None:
        self.data = sequences(lengths=lengths)
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return self.data[index]


def _trimmed(batch: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
    x, lengths, targets = (torch.stack(parts) for parts in zip(*batch, strict=True))
    steps = int(lengths.max())  # padded to the batch's longest sequence, as seqnorm's collate pads
    return [x[:, :steps], lengths, targets[:, :steps]]


def _bucketed(lengths: list[int]) -> DataLoader:
    sampler = BucketBatchSampler(lengths, batch_size=4, shuffle=False)
    return DataLoader(_Sequences(lengths), batch_sampler=sampler, collate_fn=_trimmed)


def _layout(run: EventAccumulator) -> layout_pb2.Layout:
    layout = layout_pb2.Layout()
    layout.ParseFromString(run.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    return layout


def _coloured_share(png: bytes) -> float:
    """The share of strongly coloured pixels: a heatmap is mostly colour, a line plot mostly white with thin lines."""
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    return float(((pixels.max(axis=2) - pixels.min(axis=2)) > 60).mean())


def test_no_custom_scalar_chart_overlays_more_than_four_cells(tmp_path: Path) -> None:
    # 6 cells; before, one chart overlaid ih/hh/c post-norm std of all of them (12 lines for this GRU, 21 seen)
    model = TinySequenceModel(cell="gru", norm="batch", num_layers=3, bidirectional=True)
    callback = HiddenStateStats(every_n_steps=1, media_every_n_steps=None)
    make_trainer(tmp_path, callback).fit(model, loader(), loader())  # two steps (an epoch), then a validation
    run = events(tmp_path / "version_0")
    tags = run.Tags()["scalars"]
    charts = [chart for category in _layout(run).category for chart in category.chart]
    for chart in charts:
        lines = [tag for tag in tags if any(re.search(regex, tag) for regex in chart.multiline.tag)]
        assert 1 <= len(lines) <= MAX_CHART_CELLS, (chart.title, lines)  # none empty, none crowded
        if lines[0].startswith(("hidden/", "norm/")):  # one statistic a chart, a layer's directions together
            assert len({tag.rpartition("/")[2] for tag in lines}) == 1, lines
            assert len({tag.split("/")[1].removesuffix("_reverse") for tag in lines}) in (1, 2), lines
    assert len(charts) > 20
    titles = {chart.title for chart in charts}
    assert {"h std (train): l0-l1", "h std (train): l2", "train/eval gap on the fixed val batch: l2"} <= titles


@pytest.mark.parametrize(("num_layers", "lines"), [(1, True), (2, False)])
def test_a_one_layer_model_gets_line_plots_and_several_layers_heatmaps(
    tmp_path: Path, num_layers: int, lines: bool
) -> None:
    model = TinySequenceModel(norm="batch", num_layers=num_layers, bidirectional=True)
    make_trainer(tmp_path, HiddenStateStats(media_every_n_steps=1)).fit(model, loader(), loader())
    run = events(tmp_path / "version_0")
    for tag in ("hidden/profile", "norm/val_profile"):
        share = _coloured_share(run.Images(tag)[-1].encoded_image_string)
        # measured: 1-3% for the line plots of one layer, 25-45% for heatmaps (one row or more)
        assert (share < 0.08) if lines else (share > 0.15), (tag, share)


def test_colour_bar_labels_do_not_overlap_for_one_row() -> None:
    """A one-row heatmap (a lone cell among several layers' statistics) had its two colour-bar labels drawn over
    each other: the bar is now tall enough for both, with blank rows between them."""
    image = render_profiles("hidden", {"h_std": {"l0": torch.linspace(0.123, 0.987, 12)}})
    bar_labels = image[22 + 14 :, -57:]  # the panel below the title and its label line, right of the colour bar
    inked = np.flatnonzero((bar_labels.min(axis=2) < 128).any(axis=1))
    gaps = np.diff(inked)
    assert gaps.max() >= 4, inked  # two label blocks, apart


def test_the_fixed_validation_batch_is_the_longest_full_one(tmp_path: Path) -> None:
    validation = _bucketed(BUCKETED_LENGTHS)
    assert fixed_batch_index(validation) == LONGEST_FULL_BATCH
    assert fixed_batch_index(validation, limit=2) == 1  # within --trainer.limit_val_batches
    assert fixed_batch_index(loader()) == 0  # a dataset that declares no lengths: the first batch

    model = TinySequenceModel(norm="batch")
    callback = HiddenStateStats(media_every_n_steps=None)
    trainer = make_trainer(tmp_path, callback, limit_train_batches=2, limit_val_batches=None)
    trainer.fit(model, _bucketed(BUCKETED_LENGTHS), validation)  # validation after step 2, every batch
    run = events(tmp_path / "version_0")
    lengths = torch.tensor([BUCKETED_LENGTHS[i] for i in list(validation.batch_sampler)[LONGEST_FULL_BATCH]])
    expected = [int((lengths > t).sum()) for t in range(int(lengths.max()))]  # 12 steps, 4 rows down to 2
    (histogram,) = run.Histograms("norm/l0/val_active_rows")
    assert list(histogram.histogram_value.bucket) == expected
    assert len(expected) == 12 and expected[-1] == 2
