"""Checkpoints survive SIGKILL, SIGTERM, crashes and full disks: every ``.ckpt`` is whole, ``last.ckpt`` the newest."""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
from tensorboard.summary.writer.record_writer import RecordWriter

from seqnorm.cli import SIGTERM_EXIT_CODE, main
from seqnorm.cli.runs import disk_full_held_in_threads
from seqnorm.lightning import atomic_io
from seqnorm.lightning.atomic_io import AtomicCheckpointIO
from tests.conftest import QUIET, run_path

TINY = ["--model.hidden_size", "16", "--model.embedding_dim", "8"]
VAL_EVERY = 5
# A save of this model takes a few milliseconds, long enough for a poll to see its temporary file and kill then.
SAVES_TAKE_A_WHILE = ["--model.hidden_size", "64", "--model.embedding_dim", "32"]
# The run folders, named after what they train (cli.runs.run_name): a char LM on story.txt, an LN-LSTM of 16 or 64
TINY_RUN = "lightning_logs/charlm-story-lstm-layer-h16/version_0"
SLOW_SAVES_RUN = "lightning_logs/charlm-story-lstm-layer-h64/version_0"
UNREACHED = 10**6  # max_steps of a run that is to be killed: however fast the machine, it is still training
LAUNCH_DEADLINE = 180.0  # seconds; only a guard against a hung child on an overloaded machine, never an assertion


def _fit_args(story: Path, max_steps: int, *extra: str) -> list[str]:
    data = ["--model", "LanguageModel", "--data", "TextCorpus", "--data.path", str(story), "--data.batch_size", "16"]
    validation = ["--trainer.val_check_interval", str(VAL_EVERY), "--trainer.limit_val_batches", "2"]
    return ["fit", *data, *TINY, *QUIET, *validation, "--trainer.max_steps", str(max_steps), *extra]


def _steps(directory: Path) -> dict[str, int]:
    """global_step of every ``*.ckpt`` in ``directory``, each loaded the safe way (so each is complete)."""
    return {path.name: torch.load(path, weights_only=True)["global_step"] for path in directory.glob("*.ckpt")}


def _check_directory(directory: Path, validated: bool = True) -> dict[str, int]:
    """The crash-safety invariants of a checkpoint directory at any moment; returns the steps by file name.

    ``validated``: the run started at step 0, so its validations (the only source of best files) were at multiples of
    VAL_EVERY. (A run resumed mid-epoch restarts its data from the epoch's start, which moves them.)
    """
    steps = _steps(directory)
    strays = [path.name for path in directory.iterdir() if path.suffix != ".ckpt"]
    # a SIGKILL mid-write may leave a temporary file, but one that no *.ckpt glob or `last*.ckpt` search can pick up
    assert all(name.startswith(".") and name.endswith(atomic_io.TEMP_SUFFIX) for name in strays), strays
    best = {name: step for name, step in steps.items() if name.startswith("best-")}
    if best:
        assert steps["last.ckpt"] >= max(best.values()), steps
    if validated:
        assert all(step % VAL_EVERY == 0 for step in best.values()), steps  # a best file only from a validation
    return steps


class RaiseAt(Callback):
    """Crashes training (RuntimeError) after training step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, *args: object) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"crash at step {self.step}")


def _watch_publications(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, int]]:
    """Check the directory invariants after every rename that publishes a checkpoint; returns what was seen."""
    seen: list[dict[str, int]] = []
    publish = atomic_io._publish

    def checked_publish(temp: str, target: str) -> None:
        publish(temp, target)
        seen.append(_check_directory(Path(target).parent))

    monkeypatch.setattr(atomic_io, "_publish", checked_publish)
    return seen


def test_a_crash_in_training_writes_last_but_no_best(story: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _watch_publications(monkeypatch)
    with pytest.raises(RuntimeError, match="crash at step 7"):
        main(
            _fit_args(
                story, 20, "--trainer.callbacks+=tests.cli.test_crash_safety.RaiseAt", "--trainer.callbacks.step=7"
            )
        )
    steps = _check_directory(run_path(0) / "checkpoints")
    assert steps == {"last.ckpt": 7, "best-epoch=0-step=5.ckpt": 5}
    # the validation at step 5 wrote last.ckpt first, then the best file from it
    assert seen[:2] == [{"last.ckpt": 5}, {"last.ckpt": 5, "best-epoch=0-step=5.ckpt": 5}]


def test_every_validation_refreshes_last_even_without_improvement(story: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # lr 0: every validation loss equals the first, so only the first validation is a new best. Lightning alone
    # would leave last.ckpt at step 5 for the rest of the run; a kill would then lose all steps after it.
    seen = _watch_publications(monkeypatch)
    main(_fit_args(story, 17, "--model.lr", "0"))
    steps = _check_directory(run_path(0) / "checkpoints")
    assert steps == {"last.ckpt": 17, "best-epoch=0-step=5.ckpt": 5}
    assert [state["last.ckpt"] for state in seen] == [5, 5, 10, 15, 17]


class FailingFile:
    """A file whose writes fail with ENOSPC once ``room`` bytes have been written (a disk filling up)."""

    def __init__(self, file: Any, room: int) -> None:
        self.file, self.room = file, room

    def write(self, data: Any) -> int:
        written = self.file.write(memoryview(data)[: self.room])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), written)

    def __enter__(self) -> FailingFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.file.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)


def _fill_disk_after(monkeypatch: pytest.MonkeyPatch, good_writes: int) -> None:
    calls = []

    def filling_open(path: str, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        file = open(path, mode, *args, **kwargs)  # noqa: SIM115 - handed to the caller's `with`
        calls.append(path)
        return file if len(calls) <= good_writes else FailingFile(file, room=1000)

    monkeypatch.setattr(atomic_io, "open", filling_open, raising=False)


@pytest.mark.parametrize("interruption", ["ENOSPC", "KeyboardInterrupt"])
def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interruption: str
) -> None:
    target = tmp_path / "last.ckpt"
    writer = AtomicCheckpointIO()
    writer.save_checkpoint({"global_step": 1, "weight": torch.ones(1000)}, target)
    previous = target.read_bytes()
    if interruption == "ENOSPC":
        _fill_disk_after(monkeypatch, good_writes=0)
        expected: type[BaseException] = OSError
    else:  # Ctrl-C in the middle of the write

        def interrupted(temp: str, target: str) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(atomic_io, "_publish", interrupted)
        expected = KeyboardInterrupt
    with pytest.raises(expected):
        writer.save_checkpoint({"global_step": 2, "weight": torch.zeros(1000)}, target)
    assert target.read_bytes() == previous
    assert [path.name for path in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_full_disk_during_fit_is_one_line_and_keeps_the_last_good_checkpoint(
    story: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], recwarn: pytest.WarningsRecorder
) -> None:
    seen = _watch_publications(monkeypatch)
    _fill_disk_after(monkeypatch, good_writes=1)  # last.ckpt at step 5 (its best-* is a hard link, not a write)
    with pytest.raises(SystemExit) as exit_info:  # it was a raw `OSError: [Errno 28]` traceback
        main(_fit_args(story, 20))
    assert exit_info.value.code == 1
    # The save of last.ckpt on the way out met the full disk too: it is the error's to say, not a warning line more
    assert not [str(warning.message) for warning in recwarn if "could not save" in str(warning.message)]
    directory = run_path(0) / "checkpoints"
    assert _check_directory(directory) == seen[-1] == {"last.ckpt": 5, "best-epoch=0-step=5.ckpt": 5}
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    full = os.strerror(errno.ENOSPC)
    assert line == (
        f"seqnorm fit: error: no space left on the device of {directory.parent.resolve()} ({full}): free space there "
        "(older runs under lightning_logs/, their checkpoints/ folders) or pass --trainer.default_root_dir on a disk "
        f"with room; the last complete checkpoint is kept: resume with --ckpt_path {directory.resolve() / 'last.ckpt'}"
    )


def test_a_full_disk_met_by_the_tensorboard_writer_thread_is_the_same_one_line(
    story: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """TensorBoard writes its event file in a thread, which raised ENOSPC twice: handed to the command's next write
    (the one line), and out of the thread, whose traceback came after that line on a real 16 MB tmpfs."""
    out_of_threads: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: out_of_threads.append(args.exc_value))

    write, writes = RecordWriter.write, []

    def filling(self: RecordWriter, data: bytes) -> None:  # the event file's header fits, then the disk is full
        writes.append(data)
        if len(writes) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write(self, data)

    monkeypatch.setattr(RecordWriter, "write", filling)
    with pytest.raises(SystemExit) as exit_info:
        main(_fit_args(story, 20))
    assert exit_info.value.code == 1
    for writer in threading.enumerate():  # the failed writer thread has raised: let its excepthook run
        if isinstance(writer, _AsyncWriterThread) and writer.exception is not None:
            writer.join()
    assert out_of_threads == []
    run = Path(TINY_RUN).resolve()
    assert not run.exists()  # it failed before its first step: nothing of it is left to take up room
    assert [line for line in capsys.readouterr().err.splitlines() if not line.startswith("INFO: ")] == [
        f"seqnorm fit: error: no space left on the device of {run} ({os.strerror(errno.ENOSPC)}): free space there "
        "(older runs under lightning_logs/, their checkpoints/ folders) or pass --trainer.default_root_dir on a disk "
        "with room; no checkpoint was lost (a write that fails leaves the previous file)"
    ]


def test_a_full_disk_in_a_thread_is_the_commands_to_report_once(monkeypatch: pytest.MonkeyPatch) -> None:
    out_of_threads: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: out_of_threads.append(args.exc_value))

    def in_a_thread(error: BaseException) -> None:
        def fail() -> None:
            raise error

        thread = threading.Thread(target=fail)
        thread.start()
        thread.join()

    full, other = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), OSError(errno.EACCES, "Permission denied")
    with pytest.raises(OSError) as raised, disk_full_held_in_threads():
        in_a_thread(full)  # nothing handed it back (TensorBoard does): the command ends with it
        in_a_thread(other)
    assert raised.value is full
    in_a_thread(full)  # after the command reported it (a thread's late excepthook): still quiet
    in_a_thread(OSError(errno.ENOSPC, "another disk, after the command"))
    assert [str(error) for error in out_of_threads] == [
        "[Errno 13] Permission denied",
        "[Errno 28] another disk, after the command",
    ]


def _child_env(tmp_path: Path, tmpdir: Path | None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return env


def _launch(story: Path, env: dict[str, str], log: Path, max_steps: int, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "seqnorm.cli", *_fit_args(story, max_steps, *extra)]
    with log.open("wb") as output:  # a file, not a pipe nobody reads while waiting: a full pipe would block the child
        return subprocess.Popen(command, cwd=story.parent, env=env, stdout=output, stderr=subprocess.STDOUT)


def _identity(path: Path) -> tuple[int, int] | None:
    """``(inode, mtime)`` of ``path``, ``None`` if it does not exist: changes whenever a save replaces the file."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _replaced(path: Path, previous: tuple[int, int] | None) -> Callable[[], bool]:
    return lambda: _identity(path) not in (None, previous)


def _wait_for(condition: Any, process: subprocess.Popen) -> bool:
    """Poll ``condition`` until it holds (True) or the process ends (False)."""
    deadline = time.monotonic() + LAUNCH_DEADLINE
    while not condition():
        if process.poll() is not None:
            return False
        assert time.monotonic() < deadline, "the child never got there"
        time.sleep(0.0005)
    return True


def _other_filesystem_tmpdir(tmp_path: Path) -> Path | None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        return None
    return shm


@pytest.mark.parametrize("tmpdir", ["same filesystem", "other filesystem"])
def test_sigkill_at_random_moments_then_resume(
    story: Path, tmp_path: Path, tmpdir: str, request: pytest.FixtureRequest
) -> None:
    """SIGKILL a real `seqnorm fit` (resumed from the previous one each time, in its run directory), some kills
    during a save."""
    child_tmp = None
    if tmpdir == "other filesystem":
        shm = _other_filesystem_tmpdir(tmp_path)
        if shm is None:
            pytest.skip("/dev/shm is missing or on the same filesystem as the run directory")
        child_tmp = shm / f"seqnorm-{os.getpid()}-{tmp_path.name}"
        child_tmp.mkdir()
        request.addfinalizer(lambda: shutil.rmtree(child_tmp, ignore_errors=True))
    env = _child_env(tmp_path, child_tmp)
    rng = random.Random(f"sigkill {tmpdir}")
    resume: list[str] = []
    directory = tmp_path / SLOW_SAVES_RUN / "checkpoints"  # a resumed fit continues the run it resumes
    for run, during_save in enumerate([False, True, False] if child_tmp else [True, False]):
        log, previous = tmp_path / f"run{run}.log", _identity(directory / "last.ckpt")
        process = _launch(story, env, log, UNREACHED, *SAVES_TAKE_A_WHILE, *resume)
        try:
            # this run's own first save: last.ckpt made, or replaced by a rename (another inode)
            assert _wait_for(_replaced(directory / "last.ckpt", previous), process), log.read_text()[-2000:]
            if during_save:  # the moment a temporary checkpoint file appears: mid-write
                _wait_for(lambda directory=directory: any(directory.glob(f".*{atomic_io.TEMP_SUFFIX}")), process)
            else:
                time.sleep(rng.uniform(0.0, 1.0))
        finally:
            process.kill()
        assert process.wait() == -signal.SIGKILL, log.read_text()[-2000:]  # killed while training, not after
        steps = _check_directory(directory, validated=not resume)
        resume = ["--ckpt_path", str(directory / "last.ckpt")]
    log = tmp_path / "finished.log"
    max_steps = steps["last.ckpt"] + 2 * VAL_EVERY
    finished = _launch(story, env, log, max_steps, *SAVES_TAKE_A_WHILE, *resume)
    assert finished.wait() == 0, log.read_text()[-2000:]
    assert _check_directory(directory, validated=False)["last.ckpt"] == max_steps


def test_sigterm_saves_last_writes_no_best_and_exits_nonzero(story: Path, tmp_path: Path) -> None:
    directory, log = tmp_path / TINY_RUN / "checkpoints", tmp_path / "run.log"
    process = _launch(story, _child_env(tmp_path, None), log, UNREACHED)
    try:
        assert _wait_for((directory / "last.ckpt").exists, process), log.read_text()[-2000:]
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=LAUNCH_DEADLINE)
    finally:
        process.kill()
    output = log.read_text()
    assert process.returncode == SIGTERM_EXIT_CODE == 143, output[-2000:]
    assert "seqnorm fit: stopped by SIGTERM" in output
    steps = _check_directory(directory)  # best files only from validations: none from the signal
    saved = re.search(r"SIGTERMException at step (\d+); saved .*last\.ckpt", output)
    if saved is not None:  # absent when the signal came during a validation's own save of that step
        assert steps["last.ckpt"] == int(saved.group(1))
