"""Exact resume: a run stopped and resumed from ``last.ckpt`` trains on the same batches, with the same dropout masks,
to the same parameters (bitwise, on CPU) as the uninterrupted run with the same seed.

Each case compares against one uninterrupted run of ``TOTAL`` steps (cached per data mode). The training split of
the ``story`` text holds 8 batches of 64, so step 8 is an epoch boundary; validation runs every 3 steps. A run
interrupted inside a step records that step's batch, which the resumed run records again when it redoes the step.
"""

from __future__ import annotations

import hashlib
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from seqnorm.cli import main
from tests.conftest import QUIET, write_story

TOTAL = 19
EPOCH = 8  # batches per epoch
REGULARIZED = ["--model.dropout", "0.3", "--model.recurrent_dropout", "0.3"]
REGULARIZED += ["--model.rnn_options", '{"zoneout_h": 0.1}']
TINY = ["--model.hidden_size", "16", "--model.embedding_dim", "8", "--model.lr", "0.01", *REGULARIZED]
SCHEDULE = ["--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "2", "--trainer.logger", "false"]


class Record(Callback):
    """Notes, for every training batch and validation, where the loop is; kept in :data:`RECORDS`."""

    def on_train_batch_start(self, trainer, pl_module, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        digest = hashlib.sha1(batch["inputs"].numpy().tobytes()).hexdigest()[:12]
        loop = trainer.fit_loop.epoch_loop
        RECORDS.append(("batch", trainer.current_epoch, batch_idx, trainer.global_step, loop._batches_that_stepped))
        RECORDS.append(("data", digest))

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            RECORDS.append(("validation", trainer.current_epoch, trainer.global_step))


class InterruptInside(Callback):
    """Raises KeyboardInterrupt inside training step ``step`` (after its backward, before its optimizer step) or,
    with ``validation=True``, at the end of the first batch of the validation after step ``step`` (the validation
    set has one batch: Lightning's restart would count that validation as done)."""

    def __init__(self, step: int, validation: bool = False) -> None:
        self.step, self.validation = step, validation

    def on_after_backward(self, trainer, pl_module) -> None:
        if not self.validation and trainer.global_step == self.step - 1:
            raise KeyboardInterrupt

    def on_validation_batch_end(self, trainer, *args: object) -> None:
        if self.validation and trainer.global_step == self.step and not trainer.sanity_checking:
            raise KeyboardInterrupt


class LossRecord(Callback):
    """Notes ``train/loss`` (the mean over the last ``log_every_n_steps`` steps) after every training step."""

    def on_train_batch_end(self, trainer, *args: object) -> None:
        LOSSES.append(float(trainer.callback_metrics["train/loss"]))


class EpochLossRecord(Callback):
    """Notes ``train/loss_epoch`` of each epoch that ended (read once the next one starts, or the run ends: the
    module logs it in its own ``on_train_epoch_end``, after the callbacks')."""

    def on_train_epoch_start(self, trainer, *args: object) -> None:
        if "train/loss_epoch" in trainer.callback_metrics:
            EPOCH_LOSSES.append(float(trainer.callback_metrics["train/loss_epoch"]))

    def on_train_end(self, trainer, *args: object) -> None:
        self.on_train_epoch_start(trainer)


RECORDS: list[tuple[Any, ...]] = []
LOSSES: list[float] = []
EPOCH_LOSSES: list[float] = []
_REFERENCE_EPOCH_LOSSES: list[float] = []
_REFERENCE_LOSSES: list[float] = []
HERE = __name__
"""This module's name for the CLI's class paths: pytest imports it as ``test_resume``, and a class path naming
``tests.tasks.test_resume`` would import a second copy, whose callbacks fill another ``RECORDS``."""


def _fit(run: Path, bucket: bool, *extra: str) -> tuple[list[tuple[Any, ...]], dict[str, torch.Tensor]]:
    """``seqnorm fit`` on ``run``'s parent's story into ``run``; the run's records and final parameters."""
    RECORDS.clear()
    args = ["fit", "--model", "LanguageModel", "--data", "TextCorpus", "--data.path", str(run.parent / "story.txt")]
    args += ["--data.unit", "line"]  # bucketed and unbucketed line batches: the premise of these tests
    args += ["--data.batch_size", "64", "--data.bucket", str(bucket).lower(), "--trainer.default_root_dir", str(run)]
    args += [*TINY, *QUIET, *SCHEDULE, f"--trainer.callbacks+={HERE}.Record", *extra]
    sigint = signal.getsignal(signal.SIGINT)
    try:
        main(args)
    except SystemExit:  # Lightning's graceful shutdown after Ctrl-C
        pass
    finally:
        signal.signal(signal.SIGINT, sigint)  # Lightning ignores further Ctrl-C while shutting down
    assert RECORDS, "Record saw no batch: its class path names another copy of this module"
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    return list(RECORDS), checkpoint["state_dict"]


_UNINTERRUPTED: dict[tuple[Any, ...], tuple[list[tuple[Any, ...]], dict[str, torch.Tensor]]] = {}


def _uninterrupted(
    bucket: bool, tmp_path_factory: pytest.TempPathFactory, *extra: str
) -> tuple[list, dict[str, torch.Tensor]]:
    key = (bucket, *extra)
    if key not in _UNINTERRUPTED:
        workdir = tmp_path_factory.mktemp(
            f"uninterrupted_{bucket}_{len(_UNINTERRUPTED)}" if extra else f"uninterrupted_{bucket}"
        )
        write_story(workdir / "story.txt")
        _UNINTERRUPTED[key] = _fit(workdir / "run", bucket, "--trainer.max_steps", str(TOTAL), *extra)
    return _UNINTERRUPTED[key]


@pytest.mark.parametrize("bucket", [True, False], ids=["bucketed", "unbucketed"])
@pytest.mark.parametrize(
    ("stop", "how"),
    [
        (5, "max_steps"),  # mid-epoch, between validations: last.ckpt is the train-end save
        (6, "max_steps"),  # mid-epoch, at a validation: last.ckpt is the save after validation
        (EPOCH, "max_steps"),  # the last batch of the first epoch
        (4, "interrupt"),  # Ctrl-C mid-epoch: last.ckpt is the save on exception
        (2 * EPOCH, "interrupt"),  # Ctrl-C after the last batch of the second epoch
    ],
)
def test_resumed_run_equals_uninterrupted_run(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, bucket: bool, stop: int, how: str
) -> None:
    reference, reference_parameters = _uninterrupted(bucket, tmp_path_factory)
    write_story(tmp_path / "story.txt")
    if how == "max_steps":
        first, _ = _fit(tmp_path / "first", bucket, "--trainer.max_steps", str(stop))
    else:
        interrupt = ["--trainer.callbacks+=tests.interrupt.InterruptAfter", "--trainer.callbacks.step", str(stop)]
        first, _ = _fit(tmp_path / "first", bucket, "--trainer.max_steps", str(TOTAL), *interrupt)
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == stop
    resumed, parameters = _fit(
        tmp_path / "resumed", bucket, "--trainer.max_steps", str(TOTAL), "--ckpt_path", str(last)
    )

    # the same batches in the same order, at the same epoch, batch index, step and logging step; validations on the
    # same steps (Lightning does not validate again at the step the resumed checkpoint was saved after)
    assert first + resumed == reference
    assert parameters.keys() == reference_parameters.keys()
    different = [name for name, value in parameters.items() if not torch.equal(value, reference_parameters[name])]
    assert not different


@pytest.mark.parametrize(("stop", "how"), [(5, "max_steps"), (EPOCH, "interrupt")])
def test_resume_with_worker_processes(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, stop: int, how: str
) -> None:
    """Workers fetch batches ahead and ask for indices before Lightning sets the epoch: still the same run."""
    reference, reference_parameters = _uninterrupted(True, tmp_path_factory)
    write_story(tmp_path / "story.txt")
    workers = ["--data.num_workers", "2"]
    if how == "max_steps":
        first, _ = _fit(tmp_path / "first", True, *workers, "--trainer.max_steps", str(stop))
    else:
        interrupt = ["--trainer.callbacks+=tests.interrupt.InterruptAfter", "--trainer.callbacks.step", str(stop)]
        first, _ = _fit(tmp_path / "first", True, *workers, "--trainer.max_steps", str(TOTAL), *interrupt)
    last = str(tmp_path / "first" / "checkpoints" / "last.ckpt")
    resumed, parameters = _fit(
        tmp_path / "resumed", True, *workers, "--trainer.max_steps", str(TOTAL), "--ckpt_path", last
    )
    assert first + resumed == reference
    assert all(torch.equal(value, reference_parameters[name]) for name, value in parameters.items())


def _interrupt_inside(step: int, where: str) -> list[str]:
    inside = [f"--trainer.callbacks+={HERE}.InterruptInside", "--trainer.callbacks.step", str(step)]
    return [*inside, "--trainer.callbacks.validation", str(where == "validation").lower()]


def _steps_redone(first: list[tuple[Any, ...]], resumed: list[tuple[Any, ...]], where: str) -> list[tuple[Any, ...]]:
    """``first + resumed`` without the first run's record of the step it was interrupted in, which is redone."""
    if where == "validation":  # the interrupted validation recorded nothing (its record is made at its end)
        return first + resumed
    assert first[-2:] == resumed[:2]  # the same batch at the same epoch, index and step
    return first[:-2] + resumed


@pytest.mark.parametrize("bucket", [True, False], ids=["bucketed", "unbucketed"])
@pytest.mark.parametrize(
    ("stop", "where"),
    [
        (5, "step"),  # mid-epoch
        (6, "step"),  # the step before a validation
        (EPOCH, "step"),  # the last batch of an epoch
        (EPOCH + 1, "step"),  # the first batch of an epoch
        (6, "validation"),  # in the middle of a validation: it runs again
    ],
)
def test_resume_after_interrupt_inside_a_step(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, bucket: bool, stop: int, where: str
) -> None:
    """Ctrl-C inside a step (or a validation) is saved as if before it, and the resumed run redoes it once."""
    reference, reference_parameters = _uninterrupted(bucket, tmp_path_factory)
    write_story(tmp_path / "story.txt")
    first, _ = _fit(tmp_path / "first", bucket, "--trainer.max_steps", str(TOTAL), *_interrupt_inside(stop, where))
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == (stop - 1 if where == "step" else stop)
    resumed, parameters = _fit(
        tmp_path / "resumed", bucket, "--trainer.max_steps", str(TOTAL), "--ckpt_path", str(last)
    )

    # the same batches, dropout masks, step counters and validations as the uninterrupted run
    assert _steps_redone(first, resumed, where) == reference
    different = [name for name, value in parameters.items() if not torch.equal(value, reference_parameters[name])]
    assert not different


@pytest.mark.parametrize("stop", [5, EPOCH + 1])
def test_resume_after_interrupt_inside_a_step_with_batch_norm(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, stop: int
) -> None:
    """The interrupted step's forward had updated BN's running statistics; the checkpoint holds them as they were
    before it (the redone step counted them twice: every parameter drifted, as small_batch="tail" normalizes the
    batches' short tails with the running statistics)."""
    batch_norm = ["--model.norm", "batch"]
    reference, reference_parameters = _uninterrupted(True, tmp_path_factory, *batch_norm)
    write_story(tmp_path / "story.txt")
    first, _ = _fit(
        tmp_path / "first", True, "--trainer.max_steps", str(TOTAL), *batch_norm, *_interrupt_inside(stop, "step")
    )
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    saved = torch.load(last, weights_only=True)["state_dict"]
    counters = [value for name, value in saved.items() if name.endswith("num_batches_tracked")]
    assert counters and max(int(value.max()) for value in counters) == stop - 1
    resumed, parameters = _fit(
        tmp_path / "resumed", True, "--trainer.max_steps", str(TOTAL), *batch_norm, "--ckpt_path", str(last)
    )
    assert _steps_redone(first, resumed, "step") == reference
    different = [name for name, value in parameters.items() if not torch.equal(value, reference_parameters[name])]
    assert not different


@pytest.mark.parametrize("where", ["step", "between"])
def test_the_train_loss_window_resumes_too(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, where: str
) -> None:
    """``train/loss`` averages the last ``log_every_n_steps`` (50) steps: after a resume, the window holds the steps
    before it (it started empty, and the first 50 points differed from the uninterrupted run's)."""
    record = [f"--trainer.callbacks+={HERE}.LossRecord"]
    if not _REFERENCE_LOSSES:  # the uninterrupted run is made once (and cached by _uninterrupted)
        LOSSES.clear()
        _uninterrupted(True, tmp_path_factory, *record)
        _REFERENCE_LOSSES.extend(LOSSES)
    reference = _REFERENCE_LOSSES
    write_story(tmp_path / "story.txt")
    LOSSES.clear()
    if where == "step":
        stop = _interrupt_inside(6, "step")
    else:
        stop = ["--trainer.callbacks+=tests.interrupt.InterruptAfter", "--trainer.callbacks.step", "6"]
    _fit(tmp_path / "first", True, "--trainer.max_steps", str(TOTAL), *record, *stop)
    last = str(tmp_path / "first" / "checkpoints" / "last.ckpt")
    _fit(tmp_path / "resumed", True, "--trainer.max_steps", str(TOTAL), *record, "--ckpt_path", last)
    assert len(reference) == TOTAL
    assert reference == LOSSES


@pytest.mark.parametrize("stop", ["max_steps", "step"])
def test_the_epoch_train_loss_covers_the_whole_resumed_epoch(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, stop: str
) -> None:
    """``train/loss_epoch`` of the epoch a run was resumed in averaged the steps after the resume only (Lightning's
    epoch sum is in no checkpoint): 3.1028 where the uninterrupted run logged 3.1138."""
    record = [f"--trainer.callbacks+={HERE}.EpochLossRecord"]
    if not _REFERENCE_EPOCH_LOSSES:  # the uninterrupted run is made once (and cached by _uninterrupted)
        EPOCH_LOSSES.clear()
        _uninterrupted(False, tmp_path_factory, *record)
        _REFERENCE_EPOCH_LOSSES.extend(EPOCH_LOSSES)
    reference = _REFERENCE_EPOCH_LOSSES
    write_story(tmp_path / "story.txt")
    stopping = ["--trainer.max_steps", "5"] if stop == "max_steps" else ["--trainer.max_steps", str(TOTAL)]
    _fit(tmp_path / "first", False, *stopping, *([] if stop == "max_steps" else _interrupt_inside(5, "step")))
    EPOCH_LOSSES.clear()
    last = str(tmp_path / "first" / "checkpoints" / "last.ckpt")
    _fit(tmp_path / "resumed", False, "--trainer.max_steps", str(TOTAL), *record, "--ckpt_path", last)
    assert len(reference) == 3  # epochs of 8, 8 and the last 3 steps
    assert reference == EPOCH_LOSSES


def test_a_stop_at_an_epochs_end_that_validated_resumes_exactly(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Validation at each epoch's end (Lightning's default), a stop after the epoch's last step: the checkpoint,
    written in that validation, resumed into the next epoch in another order (its sampler counted the epoch twice)
    with the logging steps one ahead; with ``max_epochs`` it trained nothing. An epoch-end scheduler step keeps its
    place (the resumed run runs the epoch end the stopped run ran after the save)."""
    extra = ["--trainer.val_check_interval", "1.0", "--optimizer", "Adam", "--optimizer.lr", "0.01"]
    extra += ["--lr_scheduler", "StepLR", "--lr_scheduler.step_size", "1", "--lr_scheduler.gamma", "0.5"]
    reference, reference_parameters = _uninterrupted(False, tmp_path_factory, *extra)
    write_story(tmp_path / "story.txt")
    first, _ = _fit(tmp_path / "first", False, "--trainer.max_steps", str(EPOCH), *extra)
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    resumed, parameters = _fit(
        tmp_path / "resumed", False, "--trainer.max_steps", str(TOTAL), *extra, "--ckpt_path", str(last)
    )
    assert first + resumed == reference
    assert [name for name, value in parameters.items() if not torch.equal(value, reference_parameters[name])] == []
    _fit(tmp_path / "by_epochs", False, "--trainer.max_epochs", "2", *extra, "--ckpt_path", str(last))
    assert (
        torch.load(tmp_path / "by_epochs" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2 * EPOCH
    )


@pytest.mark.parametrize("bucket", [True, False], ids=["bucketed", "unbucketed"])
def test_precise_bn_at_the_end_of_a_stopped_fit_leaves_the_resume_exact(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, bucket: bool
) -> None:
    """PreciseBN replaces BN's running averages when fit ends, before last.ckpt is written; the run that never
    stopped trains on with the averages, which the padded tails' steps read: weights 3e-3 apart after the resume.
    The checkpoint keeps the population statistics (for evaluating it) and the averages (for resuming it)."""
    precise = ["--model.norm", "batch", "--trainer.callbacks+=seqnorm.lightning.PreciseBN"]
    precise += ["--trainer.callbacks.num_batches", "2"]
    reference, reference_parameters = _uninterrupted(bucket, tmp_path_factory, *precise)
    write_story(tmp_path / "story.txt")
    first, _ = _fit(tmp_path / "first", bucket, "--trainer.max_steps", "5", *precise)
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    stopped = torch.load(last, weights_only=True)
    state = next(value for key, value in stopped["callbacks"].items() if key.startswith("PreciseBN"))
    saved = list(stopped["state_dict"].values())
    averages = state["running_before_final_update"]
    assert any(not any(torch.equal(value, weight) for weight in saved) for value in averages.values())  # replaced
    resumed, parameters = _fit(
        tmp_path / "resumed", bucket, "--trainer.max_steps", str(TOTAL), *precise, "--ckpt_path", str(last)
    )
    assert first + resumed == reference
    assert [name for name, value in parameters.items() if not torch.equal(value, reference_parameters[name])] == []


def test_resume_twice_after_interrupts_inside_steps(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A resumed run's own checkpoints resume exactly too, the loop counters included."""
    reference, reference_parameters = _uninterrupted(True, tmp_path_factory)
    write_story(tmp_path / "story.txt")
    max_steps = ["--trainer.max_steps", str(TOTAL)]
    first, _ = _fit(tmp_path / "first", True, *max_steps, *_interrupt_inside(5, "step"))
    resume = ["--ckpt_path", str(tmp_path / "first" / "checkpoints" / "last.ckpt")]
    second, _ = _fit(tmp_path / "second", True, *max_steps, *resume, *_interrupt_inside(11, "validation"))
    resume = ["--ckpt_path", str(tmp_path / "second" / "checkpoints" / "last.ckpt")]
    third, parameters = _fit(tmp_path / "third", True, *max_steps, *resume)

    assert _steps_redone(first, second, "step") + third == reference
    assert all(torch.equal(value, reference_parameters[name]) for name, value in parameters.items())
    uninterrupted = next(tmp_path_factory.getbasetemp().glob("uninterrupted_True*")) / "run" / "checkpoints"
    loops = torch.load(tmp_path / "third" / "checkpoints" / "last.ckpt", weights_only=True)["loops"]
    assert loops == torch.load(uninterrupted / "last.ckpt", weights_only=True)["loops"]


STREAM = ["--data.unit", "stream", "--data.batch_size", "8", "--data.window_length", "181"]
"""Stateful truncated BPTT on the story: 8 streams of 1264 characters, read in 8 windows per epoch (the last one
3 steps long), each starting from the previous window's final state."""


@pytest.mark.parametrize(
    ("stop", "how"),
    [
        (5, "max_steps"),  # mid-epoch: the carried state is in last.ckpt
        (5, "step"),  # Ctrl-C inside a step: the state before that step is saved, the step redone
        (EPOCH, "interrupt"),  # the epoch's last window: the next run starts at window 0, from zeros
        (EPOCH + 2, "interrupt"),
    ],
)
def test_stateful_stream_resumes_exactly(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, stop: int, how: str
) -> None:
    reference, reference_parameters = _uninterrupted(False, tmp_path_factory, *STREAM)
    write_story(tmp_path / "story.txt")
    if how == "max_steps":
        first, _ = _fit(tmp_path / "first", False, *STREAM, "--trainer.max_steps", str(stop))
    elif how == "step":
        first, _ = _fit(
            tmp_path / "first", False, *STREAM, "--trainer.max_steps", str(TOTAL), *_interrupt_inside(stop, how)
        )
    else:
        interrupt = ["--trainer.callbacks+=tests.interrupt.InterruptAfter", "--trainer.callbacks.step", str(stop)]
        first, _ = _fit(tmp_path / "first", False, *STREAM, "--trainer.max_steps", str(TOTAL), *interrupt)
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    assert "seqnorm_stream_state" in torch.load(last, weights_only=True)
    resumed, parameters = _fit(
        tmp_path / "resumed", False, *STREAM, "--trainer.max_steps", str(TOTAL), "--ckpt_path", str(last)
    )

    assert (_steps_redone(first, resumed, how) if how == "step" else first + resumed) == reference
    different = [name for name, value in parameters.items() if not torch.equal(value, reference_parameters[name])]
    assert not different
