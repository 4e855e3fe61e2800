"""Lightning DDP on 2 CPU processes: sharded batches, synchronized BN from --trainer.sync_batchnorm, resume."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from seqnorm.data.sampler import BucketBatchSampler, RandomBatchSampler
from seqnorm.lightning import SyncBatchNorm
from seqnorm.norms.sync import SyncTimestepBatchNorm
from tests.conftest import QUIET, run_path


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
