"""Resumable sampling: a saved position yields exactly the rest of its epoch, later epochs are unchanged, workers'
prefetching is not counted, and making evaluation iterators leaves the global random state alone."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from seqnorm.data import BucketBatchSampler, DataError, EpochBatchSampler, RandomBatchSampler, TextCorpus
from seqnorm.data.loader import ResumableDataLoader
from seqnorm.lightning.resume import random_states, set_random_states

LENGTHS = [random.Random(2).randint(1, 30) for _ in range(45)]
SAMPLERS: dict[str, Callable[[], EpochBatchSampler]] = {
    "bucket": lambda: BucketBatchSampler(LENGTHS, 4, seed=5, pool_size=2),
    "random": lambda: RandomBatchSampler(len(LENGTHS), 4, seed=5),
    "random_drop_last": lambda: RandomBatchSampler(len(LENGTHS), 4, drop_last=True, seed=5),
}


def _epoch(make: Callable[[], EpochBatchSampler], epoch: int) -> list[list[int]]:
    sampler = make()
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize("name", SAMPLERS)
def test_resume_at_every_position_yields_the_rest_of_the_epoch(name: str) -> None:
    make = SAMPLERS[name]
    epoch_2, epoch_3 = _epoch(make, 2), _epoch(make, 3)
    assert epoch_2 != epoch_3 and len(epoch_2) == len(make())
    for position in range(len(epoch_2) + 1):
        running = make()
        running.set_epoch(2)
        iterator = iter(running)
        taken = [next(iterator) for _ in range(position)]
        state = running.state_dict()
        assert state == {"epoch": 2, "position": position} and taken == epoch_2[:position]

        resumed = make()
        resumed.load_state_dict(state)
        if position < len(epoch_2):
            resumed.set_epoch(2)  # Lightning sets the epoch again after restoring
            assert list(resumed) == epoch_2[position:]
            resumed.set_epoch(3)
        # a position at the end of the epoch is the start of the next: the next iterator is epoch 3, set or not
        assert list(resumed) == epoch_3
        assert len(resumed) == len(epoch_2)  # Lightning's epoch length, also while resuming


def test_orders_depend_on_seed_and_epoch_only() -> None:
    assert _epoch(SAMPLERS["random"], 1) == _epoch(SAMPLERS["random"], 1)
    assert _epoch(SAMPLERS["random"], 1) != _epoch(lambda: RandomBatchSampler(len(LENGTHS), 4, seed=6), 1)
    torch.manual_seed(1)
    random.seed(1)
    first = _epoch(SAMPLERS["bucket"], 0)
    torch.manual_seed(2)
    random.seed(2)
    assert _epoch(SAMPLERS["bucket"], 0) == first


def test_bad_states_are_named() -> None:
    sampler = SAMPLERS["random"]()
    with pytest.raises(DataError, match=r"^RandomBatchSampler: expected a position in \[0, 12\], got 13$"):
        sampler.load_state_dict({"epoch": 0, "position": 13})
    with pytest.raises(DataError, match=r"^RandomBatchSampler: expected a state with 'epoch' and 'position'"):
        sampler.load_state_dict({"step": 3})


@pytest.mark.parametrize("persistent", [False, True])
def test_loader_counts_the_batches_taken_not_those_workers_fetched(persistent: bool) -> None:
    def make() -> ResumableDataLoader:
        sampler = RandomBatchSampler(len(LENGTHS), 4, seed=5)
        kwargs = {"num_workers": 2, "persistent_workers": persistent, "prefetch_factor": 2}
        return ResumableDataLoader(
            list(range(len(LENGTHS))), batch_sampler=sampler, generator=torch.Generator(), **kwargs
        )

    expected = [torch.tensor(batch) for epoch in (0, 1) for batch in _epoch(SAMPLERS["random"], epoch)]
    loader = make()
    assert loader.state_dict() == {"epoch": 0, "position": 0}
    seen = list(loader)  # all of epoch 0 (and, with persistent workers, the same iterator is reused next epoch)
    loader.batch_sampler.sampler.set_epoch(1)  # where Lightning calls it
    iterator = iter(loader)
    seen += [next(iterator) for _ in range(3)]
    assert loader.state_dict() == {"epoch": 1, "position": 3}  # the workers have fetched up to 4 more

    resumed = make()
    resumed.load_state_dict(loader.state_dict())
    seen += list(resumed)
    assert len(seen) == len(expected) and all(torch.equal(a, b) for a, b in zip(seen, expected, strict=True))


def test_datamodule_loaders_leave_the_global_random_state_alone(write: Callable[..., str]) -> None:
    lines = "\n".join(" ".join("ab"[i % 2] * (1 + i % 7) for i in range(j, j + 5)) for j in range(60))
    for bucket in (True, False):
        corpus = TextCorpus(path=write("c.txt", lines), batch_size=4, bucket=bucket)
        state = torch.get_rng_state()
        for loader in (corpus.train_dataloader(), corpus.val_dataloader(), corpus.test_dataloader()):
            next(iter(loader))
        assert torch.equal(torch.get_rng_state(), state)
        assert isinstance(corpus.train_dataloader(), ResumableDataLoader)


def test_random_states_survive_a_weights_only_checkpoint(tmp_path: Path) -> None:
    import numpy as np

    np.random.seed(3)
    np.random.standard_normal()  # a cached gaussian is part of numpy's state
    torch.save({"states": random_states()}, tmp_path / "states.pt")
    draws = (torch.rand(3), random.random(), np.random.standard_normal(2).tolist())
    set_random_states(torch.load(tmp_path / "states.pt", weights_only=True)["states"])
    again = (torch.rand(3), random.random(), np.random.standard_normal(2).tolist())
    assert torch.equal(draws[0], again[0]) and draws[1:] == again[1:]
