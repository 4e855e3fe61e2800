"""HiddenStateStats in a Lightning run: values read back from the TensorBoard event files, and early failures."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn

from seqnorm.callbacks import HiddenStateStats
from tests.callbacks.conftest import BATCH_NORM_LENGTHS, TinySequenceModel, events, loader, make_trainer, scalar


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"every_n_steps": 2.5}, "every_n_steps"),
        ({"media_every_n_steps": -1}, "media_every_n_steps"),
        ({"zero_threshold": 0}, "zero_threshold"),
        ({"validation_batch": "yes"}, "validation_batch"),
    ],
)
def test_bad_arguments_are_rejected_up_front(arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"HiddenStateStats: expected {message}"):
        HiddenStateStats(**arguments)


@pytest.mark.parametrize("logger", [False, "csv"])
def test_fails_in_setup_without_a_tensorboard_logger(tmp_path: Path, logger: object) -> None:
    logger = CSVLogger(str(tmp_path)) if logger == "csv" else logger
    trainer = make_trainer(tmp_path, HiddenStateStats(), logger=logger)
    with pytest.raises(ValueError, match="HiddenStateStats: expected a TensorBoardLogger"):
        trainer.fit(TinySequenceModel(), loader(), loader())


def test_fails_in_setup_without_a_seqnorm_layer(tmp_path: Path) -> None:
    model = TinySequenceModel()
    model.body["encoder"] = nn.LSTM(3, 8, batch_first=True)
    with pytest.raises(ValueError, match="HiddenStateStats: expected the model to contain a seqnorm layer"):
        make_trainer(tmp_path, HiddenStateStats()).fit(model, loader(), loader())


def test_layer_norm_run_logs_unit_moments_at_init_and_gradients_through_time(tmp_path: Path) -> None:
    model = TinySequenceModel(cell="lstm", norm="layer", num_layers=2, bidirectional=True)
    callback = HiddenStateStats(every_n_steps=1, media_every_n_steps=None, validation_batch=False)
    make_trainer(tmp_path, callback).fit(model, loader(), loader())
    run = events(tmp_path / "version_0")
    for cell in ("l0", "l0_reverse", "l1", "l1_reverse"):
        # post-LN pre-activations (before the cell bias) at initialization: each row has mean 0 and std 1
        assert scalar(run, f"norm/{cell}/ih_post_mean", step=0) == pytest.approx(0.0, abs=1e-4)
        assert scalar(run, f"norm/{cell}/ih_post_std", step=0) == pytest.approx(1.0, abs=1e-3)
        for step in (0, 1):
            first = scalar(run, f"grad/{cell}/h_norm_first", step)
            last = scalar(run, f"grad/{cell}/h_norm_last", step)
            assert 0 < first < math.inf and 0 < last < math.inf
            assert scalar(run, f"grad/{cell}/last_over_first", step) == pytest.approx(last / first, rel=1e-4)
        assert 0 < scalar(run, f"hidden/{cell}/h_std", 0) < 1
        assert 0 <= scalar(run, f"gates/{cell}/f_sat", 0) <= 1
    assert "images" not in run.Tags() or not run.Tags()["images"]


def test_gradient_norms_do_not_depend_on_gradient_accumulation(tmp_path: Path) -> None:
    # Lightning divides the loss by accumulate_grad_batches before backward: the norms came out divided by it
    logged = []
    for accumulate in (1, 3):
        torch.manual_seed(0)
        callback = HiddenStateStats(every_n_steps=1, media_every_n_steps=None, validation_batch=False)
        trainer = make_trainer(tmp_path / str(accumulate), callback, max_steps=1, accumulate_grad_batches=accumulate)
        trainer.fit(TinySequenceModel(), loader(), loader())
        run = events(tmp_path / str(accumulate) / "version_0")
        logged.append([scalar(run, f"grad/l0/{name}", 0) for name in ("h_norm", "h_norm_first", "h_norm_last")])
    assert logged[1] == pytest.approx(logged[0], rel=1e-5)


def test_batch_norm_run_logs_active_rows_gradients_and_the_train_eval_gap(tmp_path: Path) -> None:
    model = TinySequenceModel(cell="gru", norm="batch", bidirectional=True, decoder=True)
    callback = HiddenStateStats(every_n_steps=1, media_every_n_steps=2)
    make_trainer(tmp_path, callback).fit(model, loader(lengths=BATCH_NORM_LENGTHS), loader(lengths=BATCH_NORM_LENGTHS))
    run = events(tmp_path / "version_0")
    lengths = torch.tensor(BATCH_NORM_LENGTHS[:4])  # the first training batch and the fixed validation batch
    expected = [int((lengths > t).sum()) for t in range(int(lengths.max()))]
    for cell in ("body.encoder/l0", "body.encoder/l0_reverse", "body.decoder/l0"):
        for tag in (f"norm/{cell}/active_rows", f"norm/{cell}/val_active_rows"):
            (histogram,) = [event for event in run.Histograms(tag) if event.step == 0 or "val_" in tag]
            assert list(histogram.histogram_value.bucket) == expected
        # post-BN pre-activations over the real rows: std is the initial gain 0.1 times sqrt(var / (var + eps)),
        # at every step (each has >= 2 real rows); a padded row in the statistic would push it far above 0.1
        assert 0.09 < scalar(run, f"norm/{cell}/ih_post_std", step=0) <= 0.1 + 1e-6
        assert scalar(run, f"norm/{cell}/ih_post_mean", step=0) == pytest.approx(0.0, abs=1e-5)
        (gradients,) = [event.histogram_value for event in run.Histograms(f"grad/{cell}/h_norm_per_step")]
        assert gradients.num == len(expected) and 0 < gradients.min <= gradients.max < math.inf
        assert 0 < scalar(run, f"norm/{cell}/val_train_eval_gap") < math.inf
        assert scalar(run, f"norm/{cell}/ih_running_var", step=1) > 0
    assert {"hidden/profile", "grad/profile", "norm/val_profile"} <= set(run.Tags()["images"])
    layout = run.Tensors("custom_scalars__config__")
    assert layout, "no custom-scalars layout"


def test_padding_does_not_change_the_validation_statistics(tmp_path: Path) -> None:
    values = []
    for index, pad_value in enumerate((0.0, 1e4)):
        torch.manual_seed(0)
        model = TinySequenceModel(cell="lstm", norm="batch", bidirectional=True)
        trainer = make_trainer(tmp_path / str(index), HiddenStateStats(media_every_n_steps=None))
        trainer.validate(model, loader(pad_value), verbose=False)
        run = events(tmp_path / str(index) / "version_0")
        values.append({tag: scalar(run, tag) for tag in run.Tags()["scalars"] if "/val_" in tag})
    assert values[0].keys() == values[1].keys() and len(values[0]) > 20
    for tag, value in values[0].items():
        assert value == pytest.approx(values[1][tag], rel=1e-5, abs=1e-7), tag


def test_scalars_also_reach_other_loggers(tmp_path: Path) -> None:
    csv = CSVLogger(str(tmp_path / "csv"), name="", version=0)
    loggers = [TensorBoardLogger(str(tmp_path), name="", version=0), csv]
    callback = HiddenStateStats(every_n_steps=1, media_every_n_steps=None, validation_batch=False)
    make_trainer(tmp_path, callback, logger=loggers, max_steps=1).fit(TinySequenceModel(), loader(), loader())
    header = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    assert "hidden/l0/h_std" in header.split(",")


def test_only_the_last_of_several_instances_is_active(tmp_path: Path) -> None:
    first, second = HiddenStateStats(every_n_steps=1), HiddenStateStats(every_n_steps=1, validation_batch=False)
    trainer = make_trainer(tmp_path, first, max_steps=1, limit_val_batches=0)
    trainer.callbacks.append(second)
    with pytest.warns(UserWarning, match="only the last one"):
        trainer.fit(TinySequenceModel(), loader(), loader())
    assert not first._enabled and second._enabled
    assert len(events(tmp_path / "version_0").Scalars("hidden/l0/h_std")) == 1


def test_validation_statistics_share_the_step_of_the_validation_loss(tmp_path: Path) -> None:
    model = TinySequenceModel(cell="lstm", norm="layer")
    callback = HiddenStateStats(every_n_steps=100, media_every_n_steps=None)
    make_trainer(tmp_path, callback, max_steps=4, val_check_interval=2).fit(model, loader(), loader())
    run = events(tmp_path / "version_0")
    validations = [event.step for event in run.Scalars("val/loss")]
    observed = sorted({event.step for tag in run.Tags()["scalars"] if "val_" in tag for event in run.Scalars(tag)})
    assert len(validations) == 2 and observed == validations


def test_a_diverged_run_is_observed_not_stopped(tmp_path: Path) -> None:
    """NaN weights: the histograms skip the non-finite values (TensorBoard raised on them), the scalars show NaN."""
    model = TinySequenceModel(norm="layer")
    with torch.no_grad():
        model.body["encoder"].cells[0].weight_hh.fill_(float("nan"))
    callback = HiddenStateStats(every_n_steps=1, media_every_n_steps=1)
    make_trainer(tmp_path, callback, max_steps=2).fit(model, loader(), loader())
    run = events(tmp_path / "version_0")
    assert math.isnan(scalar(run, "hidden/l0/h_std", 0))
