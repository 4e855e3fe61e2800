"""Lightning DDP on 2 CPU processes: sharded batches, synchronized BN from --trainer.sync_batchnorm, resume, and
stateful stream windows (each process carries its own streams) equal to one process on all of them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from seqnorm.data.sampler import BucketBatchSampler, RandomBatchSampler
from seqnorm.lightning import SyncBatchNorm
from seqnorm.lightning.language_model import STREAM_STATE_KEY
from seqnorm.norms.sync import SyncTimestepBatchNorm
from tests.conftest import QUIET, logged_scalars, run_path


def test_training_shards_are_disjoint_and_equal_evaluation_keeps_every_batch() -> None:
    lengths = [(i * 7) % 23 + 1 for i in range(101)]
    for make in (
        lambda **shard: BucketBatchSampler(lengths, 4, seed=3, **shard),
        lambda **shard: RandomBatchSampler(101, 4, seed=3, **shard),
    ):
        whole = [batch for batch in make()]
        shards = [list(make(num_replicas=3, rank=rank)) for rank in range(3)]
        assert len({len(shard) for shard in shards}) == 1  # the same number of steps on every process
        assert all(len(make(num_replicas=3, rank=rank)) == len(shards[rank]) for rank in range(3))
        taken = [batch for shard in shards for batch in shard]
        assert sorted(map(tuple, taken)) == sorted(map(tuple, whole[: len(whole) // 3 * 3]))
    evaluation = [list(BucketBatchSampler(lengths, 4, shuffle=False, num_replicas=3, rank=r)) for r in range(3)]
    assert sorted(tuple(b) for shard in evaluation for b in shard) == sorted(
        tuple(b) for b in BucketBatchSampler(lengths, 4, shuffle=False)
    )


def test_sync_batchnorm_plugin_converts_and_reverts() -> None:
    from seqnorm.lightning import LanguageModel

    model = LanguageModel(12, norm="batch")
    SyncBatchNorm().apply(model)
    converted = [type(m) for m in model.modules() if "BatchNorm" in type(m).__name__]
    assert converted and all(kind is SyncTimestepBatchNorm for kind in converted)
    SyncBatchNorm().revert(model)
    assert not any(isinstance(m, SyncTimestepBatchNorm) for m in model.modules())


def _fit(story: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "seqnorm.cli",
        "fit",
        "--model",
        "LanguageModel",
        "--data",
        "TextCorpus",
        "--data.path",
        str(story),
        "--data.unit",
        "line",
        "--data.batch_size",
        "8",
        "--model.norm",
        "batch",
        "--model.hidden_size",
        "16",
        "--model.embedding_dim",
        "8",
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "ddp",
        "--trainer.sync_batchnorm",
        "true",
        "--trainer.val_check_interval",
        "4",
        "--trainer.limit_val_batches",
        "3",
        *QUIET,
        *extra,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=story.parent)


def test_two_process_fit_with_synchronized_bn_and_resume(story: Path) -> None:
    first = _fit(story, "--trainer.max_steps", "8")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "sync_dist" not in first.stderr  # every epoch-level value is logged synchronized
    last = run_path(0, story.parent) / "checkpoints/last.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    assert checkpoint["global_step"] == 8
    assert any(key.endswith("running_mean") for key in checkpoint["state_dict"])
    resumed = _fit(story, "--trainer.max_steps", "12", "--ckpt_path", str(last))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = torch.load(last, weights_only=True)  # the resumed run continues its run directory
    assert final["global_step"] == 12


# ---- stream windows: the default for a character file ---------------------------------------------------------------

DDP = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]


def _seqnorm(folder: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    folder.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "seqnorm.cli", "fit", "--model", "LanguageModel", "--data", "TextCorpus"]
    result = subprocess.run([*command, *arguments, *QUIET], capture_output=True, text=True, timeout=600, cwd=folder)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _stream_fit(story: Path, folder: Path, *extra: str) -> dict:
    """A character LM on ``story`` read as 4 streams (the default unit), in float64; its last.ckpt."""
    _seqnorm(
        folder,
        *("--data.path", str(story), "--data.batch_size", "4", "--data.window_length", "17"),
        *("--model.hidden_size", "16", "--model.embedding_dim", "8", "--trainer.precision", "64-true"),
        *("--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "4"),
        *extra,
    )
    return torch.load(run_path(0, folder) / "checkpoints/last.ckpt", weights_only=True)


@pytest.mark.parametrize(
    ("norm", "resume"),
    [(["--model.norm", "layer"], True), (["--model.norm", "batch", "--trainer.sync_batchnorm", "true"], False)],
    ids=["layer-resumed", "batch-synchronized"],
)
def test_stream_windows_on_two_processes_equal_one_process_on_every_stream(
    story: Path, norm: list[str], resume: bool
) -> None:
    """It stopped with "--data.unit stream: expected one process, got 2". Each process now reads 2 of the 4 streams
    and carries their states (training and validation); the gradients' all-reduce averages the two halves' mean
    losses, which is the mean of the whole batch (equal token counts), and synchronized BN sees the whole batch.

    Both runs are float64, so they differ only in the order of sums (gloo's all-reduce of two halves, one process
    summing all rows): at most 2e-15 measured after 9 Adam steps; 1e-12 leaves a wide margin, while a process
    reading the wrong streams or starting a window from a wrong state moves the parameters by about the learning
    rate (2e-3) per step. ``resume``: both continue from one process's mid-epoch checkpoint (the two processes each
    take their rows of its carry); ``batch-synchronized``: 9 steps straight, the checkpoint's carry gathered from
    both processes."""
    one, two = story.parent / "one", story.parent / "two"
    if resume:
        _stream_fit(story, one, *norm, "--trainer.max_steps", "6")
        shutil.copytree(one, two)  # each resumed run continues its own copy of the run directory
        runs = [
            _stream_fit(story, folder, *norm, *devices, "--trainer.max_steps", "9", "--ckpt_path", str(last))
            for folder, devices in ((one, []), (two, DDP))
            for last in [run_path(0, folder) / "checkpoints/last.ckpt"]
        ]
    else:
        runs = [
            _stream_fit(story, folder, *norm, *devices, "--trainer.max_steps", "9")
            for folder, devices in ((one, []), (two, DDP))
        ]
    single, double = runs
    assert single["global_step"] == double["global_step"] == 9
    tight = {"rtol": 1e-10, "atol": 1e-12}
    assert single["state_dict"].keys() == double["state_dict"].keys()
    for name, value in single["state_dict"].items():  # parameters and BN's running statistics
        assert_close(double["state_dict"][name], value, **tight, msg=name)
    for name, state in single[STREAM_STATE_KEY]["train"].items():  # (1, 4, 16): every stream's carry, in order
        assert state.shape == (1, 4, 16)
        assert_close(double[STREAM_STATE_KEY]["train"][name], state, **tight, msg=name)
    # token-weighted over both processes' windows, each carrying its own val streams; TensorBoard keeps float32
    logged = [logged_scalars(run_path(0, folder)) for folder in (one, two)]
    for tag in ("val/loss", "val/bpc"):
        assert len(logged[0][tag]) == 3  # after steps 3, 6 and 9
        assert [step for step, _ in logged[1][tag]] == [step for step, _ in logged[0][tag]]
        assert [value for _, value in logged[1][tag]] == pytest.approx([value for _, value in logged[0][tag]], rel=1e-6)


def test_the_readme_character_lm_command_runs_under_ddp(story: Path) -> None:
    """The README's LM command with --trainer.strategy ddp --trainer.devices 2: streams are its default unit."""
    _seqnorm(
        story.parent,
        *("--data.path", str(story), "--model.norm", "layer", "--model.hidden_size", "256"),
        *DDP,
        "--trainer.max_steps",
        "4",
    )
    checkpoint = torch.load(run_path(0, story.parent) / "checkpoints/last.ckpt", weights_only=True)
    assert checkpoint["seqnorm_data"]["unit"] == "stream" and checkpoint["global_step"] == 4
    assert checkpoint[STREAM_STATE_KEY]["train"]["h"].shape == (1, 32, 256)  # the carry of all 32 streams
    assert "val/bpc" in logged_scalars(run_path(0, story.parent))
