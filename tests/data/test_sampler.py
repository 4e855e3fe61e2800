"""BucketBatchSampler: a partition of the indices each epoch, seeded, with much less padding than random batches."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqnorm.data import BucketBatchSampler, DataError


def _padding(batches: list[list[int]], lengths: list[int]) -> int:
    return sum(max(lengths[i] for i in batch) * len(batch) - sum(lengths[i] for i in batch) for batch in batches)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 100), max_size=300),
    batch_size=st.integers(1, 40),
    shuffle=st.booleans(),
    epoch=st.integers(0, 5),
    pool_size=st.integers(1, 4),
)
def test_every_index_once_per_epoch(
    lengths: list[int], batch_size: int, shuffle: bool, epoch: int, pool_size: int
) -> None:
    sampler = BucketBatchSampler(lengths, batch_size, shuffle=shuffle, seed=3, pool_size=pool_size)
    sampler.set_epoch(epoch)
    batches = list(sampler)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    assert len(batches) == len(sampler)
    assert all(1 <= len(batch) <= batch_size for batch in batches)
    assert sum(len(batch) < batch_size for batch in batches) <= 1


def test_drop_last_keeps_only_full_batches() -> None:
    lengths = [random.Random(0).randint(1, 50) for _ in range(103)]
    sampler = BucketBatchSampler(lengths, 10, drop_last=True)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 10
    assert all(len(batch) == 10 for batch in batches)
    assert len({i for batch in batches for i in batch}) == 100


def test_seeded_and_reshuffled_each_epoch() -> None:
    lengths = [random.Random(1).randint(1, 80) for _ in range(500)]
    first = BucketBatchSampler(lengths, 16, seed=7)
    second = BucketBatchSampler(lengths, 16, seed=7)
    assert list(first) == list(second)
    assert list(first) != list(BucketBatchSampler(lengths, 16, seed=8))
    epoch0 = list(first)
    first.set_epoch(1)
    assert list(first) != epoch0
    first.sampler.set_epoch(0)  # where Lightning calls it: dataloader.batch_sampler.sampler
    assert list(first) == epoch0
    assert list(first.sampler) == [i for batch in epoch0 for i in batch]
    assert len(first.sampler) == len(lengths)


def test_unshuffled_batches_follow_length_order() -> None:
    sampler = BucketBatchSampler([5, 1, 4, 2, 3, 6], 2, shuffle=False)
    assert list(sampler) == [[1, 3], [4, 2], [0, 5]]


def test_bucketing_reduces_padding() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(1, 200) for _ in range(3000)]
    bucketed = list(BucketBatchSampler(lengths, 32, seed=0))
    order = list(range(len(lengths)))
    rng.shuffle(order)
    random_batches = [order[i : i + 32] for i in range(0, len(order), 32)]
    assert _padding(bucketed, lengths) < 0.1 * _padding(random_batches, lengths)


def test_rejects_batch_size_below_one() -> None:
    with pytest.raises(DataError, match=r"--data\.batch_size"):
        BucketBatchSampler([1, 2], 0)


@pytest.mark.parametrize("bucket", [True, False])
def test_lightning_rebuilding_the_sampler_is_refused_by_name(tmp_path, bucket: bool) -> None:
    """Under DDP, Lightning's default use_distributed_sampler=True rebuilds the batch sampler with its
    DistributedSampler as the first argument: bucketed batches then came from that sampler's index list (a third of
    the examples, silently), unbucketed ones failed with a TypeError that named nothing."""
    from lightning.fabric.utilities.data import _replace_dunder_methods
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _update_dataloader
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

    from seqnorm.data import TextCorpus

    (tmp_path / "text.txt").write_text("".join(f"line {i} {'x' * (i % 7)}\n" for i in range(60)), encoding="utf-8")
    with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):  # as Lightning does
        loader = TextCorpus(
            path=str(tmp_path / "text.txt"), unit="line", batch_size=3, bucket=bucket
        ).train_dataloader()
    sampler = DistributedSampler(loader.dataset, num_replicas=2, rank=0)
    with pytest.raises(DataError, match=r"pass Trainer\(use_distributed_sampler=False\)"):
        _update_dataloader(loader, sampler, RunningStage.TRAINING)


def test_in_order_batches_shard_for_evaluation_and_keep_every_batch() -> None:
    """Unbucketed evaluation is sharded like the rest (every process evaluated the whole split under DDP)."""
    from seqnorm.data import InOrderBatchSampler

    shards = [list(InOrderBatchSampler(10, 3, num_replicas=3, rank=rank)) for rank in range(3)]
    assert shards == [[[0, 1, 2], [9]], [[3, 4, 5]], [[6, 7, 8]]]


def test_unbucketed_evaluation_loaders_use_the_sharding_sampler(tmp_path) -> None:
    from seqnorm.data import InOrderBatchSampler, TextCorpus

    (tmp_path / "text.txt").write_text("".join(f"line {i} {'x' * (i % 7)}\n" for i in range(60)), encoding="utf-8")
    corpus = TextCorpus(path=str(tmp_path / "text.txt"), unit="line", batch_size=4, bucket=False)
    for loader in (corpus.val_dataloader(), corpus.test_dataloader()):
        assert isinstance(loader.batch_sampler, InOrderBatchSampler)
        assert [i for batch in loader.batch_sampler for i in batch] == list(range(len(loader.dataset)))
    assert not isinstance(corpus.predict_dataloader().batch_sampler, InOrderBatchSampler)  # Lightning rebuilds it
