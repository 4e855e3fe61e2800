"""Batch samplers whose order is a function of ``(seed, epoch)`` and which can start in the middle of an epoch.

Two orders are offered. :class:`RandomBatchSampler` shuffles all indices and cuts them into batches.
:class:`BucketBatchSampler` groups sequences of similar length, so that padded batches waste little compute: sorting
a whole epoch by length would give the same batches every epoch, in order of length, so the usual compromise
(fairseq, AllenNLP's bucket iterators) is kept: shuffle, cut into pools of about ``pool_size`` batches, sort each pool
by length, cut it into batches, then shuffle the order of the batches.

Under data parallelism (several processes of an initialized ``torch.distributed`` group, e.g. Lightning's DDP) every
process computes the same epoch order and takes its own share: batch ``k`` goes to process ``k % world_size``.
Training samplers (``shuffle``) drop the last ``< world_size`` batches of an epoch so that every process runs the same
number of steps (a process waiting for a gradient all-reduce the others never make would hang); evaluation orders
keep every batch (shares may differ by one batch: evaluation makes no per-step collective).

Both draw from a generator seeded from ``(seed, epoch)`` alone, never from the global random state. That makes an
epoch's order reproducible by itself, which is what exact resume needs: :meth:`EpochBatchSampler.load_state_dict`
with ``{"epoch": e, "position": p}`` makes the next iteration yield batches ``p, p+1, ...`` of epoch ``e``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from typing import Any

import torch.distributed as dist
from torch.utils.data import Sampler

from seqnorm.data.errors import DataError

__all__ = ["BucketBatchSampler", "EpochBatchSampler", "InOrderBatchSampler", "RandomBatchSampler", "process_share"]


def process_share(num_replicas: int | None = None, rank: int | None = None) -> tuple[int, int]:
    """``(num_replicas, rank)``: the processes sharing the data and this one's rank; each ``None`` is read from
    ``torch.distributed`` if a process group is initialized (Lightning's DDP), else 1 and 0."""
    distributed = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if distributed else 1
    if rank is None:
        rank = dist.get_rank() if distributed else 0
    return num_replicas, rank


class _EpochIndices(Sampler[int]):
    """The indices of an :class:`EpochBatchSampler`'s batches, flattened; forwards ``set_epoch`` to it."""

    def __init__(self, batches: EpochBatchSampler) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[int]:
        return (index for batch in self.batches._shard() for index in batch)

    def __len__(self) -> int:
        if self.batches.num_replicas > 1:
            return sum(len(batch) for batch in self.batches._shard())
        if self.batches.drop_last:
            return len(self.batches) * self.batches.batch_size
        return self.batches.num_examples

    def set_epoch(self, epoch: int) -> None:
        self.batches.set_epoch(epoch)


class _EpochPass(Iterator[list[int]]):
    """One pass over an epoch's batches, from the sampler's start position.

    Its epoch and start are fixed at the first batch, not when it is made: a DataLoader with workers makes a sampler
    iterator and at once a second one that it uses instead, and Lightning makes the train iterator before it calls
    ``set_epoch``.
    """

    def __init__(self, sampler: EpochBatchSampler) -> None:
        self.sampler = sampler
        self.batches: list[list[int]] | None = None  # None until the first batch is asked for
        self.epoch = self.start = self.yielded = 0

    def __next__(self) -> list[int]:
        if self.batches is None:
            sampler = self.sampler
            self.epoch, self.start, sampler._start = sampler.epoch, sampler._start, 0
            self.batches = sampler._shard()
            sampler._latest = self
        if self.start + self.yielded >= len(self.batches):
            raise StopIteration
        self.yielded += 1
        return self.batches[self.start + self.yielded - 1]


def _refuse_a_sampler(owner: str, value: object) -> None:
    """Lightning's ``use_distributed_sampler`` (its default, under DDP) rebuilds a loader's batch sampler with its
    own ``DistributedSampler`` as the first argument, where these take the data's size or lengths: the batches then
    came from the sampler's index list (a third of the examples, silently), or the build failed obscurely."""
    if isinstance(value, Sampler):
        raise DataError(
            f"{owner}: expected the data's size or lengths, got a {type(value).__name__}: Lightning rebuilt this "
            "loader around its own sampler (Trainer(use_distributed_sampler=True), its default); seqnorm's samplers "
            "shard themselves across processes: pass Trainer(use_distributed_sampler=False) (`seqnorm fit` does)"
        )


class EpochBatchSampler(Sampler[list[int]]):
    """Base of the seeded batch samplers: epoch selection, mid-epoch start, and the state that resumes them.

    Subclasses implement :meth:`_epoch_batches`, the complete list of batches of epoch :attr:`epoch`, computed from
    ``(seed, epoch)`` only.

    The state is ``{"epoch": e, "position": p}``: where the next iteration starts. :meth:`state_dict` counts the
    batches this sampler has yielded; a DataLoader whose workers fetch ahead must count the batches its consumer
    took instead (see :class:`seqnorm.data.loader.ResumableDataLoader`).
    """

    even_shares: bool = True
    """Whether every process gets the same number of batches (training); evaluation orders keep every batch."""

    def __init__(
        self,
        num_examples: int,
        batch_size: int,
        *,
        drop_last: bool = False,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        _refuse_a_sampler(type(self).__name__, num_examples)
        if batch_size < 1:
            raise DataError(f"--data.batch_size must be at least 1, got {batch_size}")
        self.num_replicas, self.rank = process_share(num_replicas, rank)
        if not 0 <= self.rank < self.num_replicas:
            raise DataError(f"{type(self).__name__}: expected rank in [0, {self.num_replicas}), got {self.rank}")
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0
        self._start = 0  # where the next pass starts (set by load_state_dict, cleared by set_epoch)
        self._latest: _EpochPass | None = None  # the latest pass that has begun
        # Lightning calls set_epoch on `dataloader.batch_sampler.sampler`, not on the batch sampler itself.
        self.sampler = _EpochIndices(self)

    def _epoch_batches(self) -> list[list[int]]:
        raise NotImplementedError

    def _shard(self) -> list[list[int]]:
        """This process's batches of the epoch: every ``num_replicas``-th from ``rank`` (module docstring)."""
        batches = self._epoch_batches()
        if self.num_replicas == 1:
            return batches
        usable = len(batches) - len(batches) % self.num_replicas if self.even_shares else len(batches)
        return batches[self.rank : usable : self.num_replicas]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order :meth:`__iter__` yields (Lightning calls this every epoch).

        Selecting another epoch than the current one starts it from its first batch; selecting the same one keeps
        a start position set by :meth:`load_state_dict` (Lightning calls ``set_epoch`` again after restoring).
        """
        if epoch != self.epoch:
            self._start = 0
        self.epoch = epoch

    def __len__(self) -> int:
        """This process's batches in a whole epoch, also while resuming mid-epoch (Lightning counts the consumed ones
        itself)."""
        total = (
            self.num_examples // self.batch_size if self.drop_last else math.ceil(self.num_examples / self.batch_size)
        )
        if self.even_shares:
            return total // self.num_replicas
        return len(range(self.rank, total, self.num_replicas))

    def _cut(self, indices: list[int]) -> list[list[int]]:
        batches = [indices[start : start + self.batch_size] for start in range(0, len(indices), self.batch_size)]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        return batches

    def _rng(self) -> random.Random:
        # A string seed is hashed deterministically (unlike hash() of a tuple of ints across Python builds).
        return random.Random(f"{self.seed}/{self.epoch}")

    def __iter__(self) -> Iterator[list[int]]:
        return _EpochPass(self)

    def _pending(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self._start}

    def state_dict(self) -> dict[str, int]:
        """Where a pass begun now would start, given the batches this sampler has yielded."""
        latest = self._latest
        if latest is None or latest.epoch != self.epoch:  # restored, or another epoch set since the latest pass
            return self._pending()
        return {"epoch": latest.epoch, "position": latest.start + latest.yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next iteration yield the batches of ``state["epoch"]`` from ``state["position"]`` on.

        A position at the end of the epoch is the start of the next epoch: Lightning may go on to the next epoch
        without making a new iterator (after an interrupt at the last batch), and workers fetch indices as soon as
        an iterator exists.
        """
        try:
            epoch, position = int(state["epoch"]), int(state["position"])
        except (KeyError, TypeError, ValueError):
            raise DataError(
                f"{type(self).__name__}: expected a state with 'epoch' and 'position', got {state!r}"
            ) from None
        if not 0 <= position <= len(self):
            raise DataError(f"{type(self).__name__}: expected a position in [0, {len(self)}], got {position}")
        if position == len(self):
            epoch, position = epoch + 1, 0
        self.epoch, self._start, self._latest = epoch, position, None


class RandomBatchSampler(EpochBatchSampler):
    """Yield batches of a random permutation of ``range(num_examples)``, a new one each epoch.

    Args:
        num_examples: the dataset size.
        batch_size: examples per batch (the last batch may be smaller unless ``drop_last``).
        drop_last: drop a last batch smaller than ``batch_size``.
        seed: the base seed; epoch ``e`` uses a generator seeded from ``(seed, e)``.
        num_replicas, rank: the processes sharing each epoch and this one's rank (module docstring); ``None``: from
            ``torch.distributed`` if initialized, else 1 and 0.

    Example:
        >>> batches = list(RandomBatchSampler(5, 2, seed=0))
        >>> sorted(i for batch in batches for i in batch), [len(batch) for batch in batches]
        ([0, 1, 2, 3, 4], [2, 2, 1])
    """

    def _epoch_batches(self) -> list[list[int]]:
        indices = list(range(self.num_examples))
        self._rng().shuffle(indices)
        return self._cut(indices)


class InOrderBatchSampler(EpochBatchSampler):
    """Yield ``range(num_examples)`` in order, cut into batches, the same every epoch: evaluation in file order, and
    stream windows, whose order carries the recurrent state from one batch to the next (:mod:`seqnorm.data.streams`:
    under DDP each process reads every window of its own streams, through an unsharded sampler,
    ``num_replicas=1``).

    Sharded like the others, every batch kept (evaluation); an :class:`EpochBatchSampler` so that
    :class:`~seqnorm.data.ResumableDataLoader` resumes it mid-epoch.

    Example:
        >>> list(InOrderBatchSampler(3, 1))
        [[0], [1], [2]]
    """

    even_shares = False

    def _epoch_batches(self) -> list[list[int]]:
        return self._cut(list(range(self.num_examples)))


class BucketBatchSampler(EpochBatchSampler):
    """Yield batches of dataset indices whose sequences have similar lengths.

    Args:
        lengths: the length of each example, indexed like the dataset.
        batch_size: examples per batch (the last batch may be smaller unless ``drop_last``).
        shuffle: pool-shuffle as described in the module docstring. Without it, batches follow the global length
            order, the same each epoch (for evaluation).
        drop_last: drop batches smaller than ``batch_size``.
        seed: the base seed; epoch ``e`` uses a generator seeded from ``(seed, e)``.
        pool_size: batches per sorting pool.
        num_replicas, rank: as :class:`RandomBatchSampler`; with ``shuffle`` (training) every process gets the same
            number of batches, without it (evaluation) every batch is kept.

    Example:
        >>> sampler = BucketBatchSampler([5, 1, 4, 2, 3, 6], batch_size=2, shuffle=False)
        >>> list(sampler)
        [[1, 3], [4, 2], [0, 5]]
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int = 0,
        pool_size: int = 50,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        _refuse_a_sampler("BucketBatchSampler", lengths)
        if pool_size < 1:
            raise DataError(f"BucketBatchSampler: pool_size must be at least 1, got {pool_size}")
        super().__init__(len(lengths), batch_size, drop_last=drop_last, seed=seed, num_replicas=num_replicas, rank=rank)
        self.lengths = list(lengths)
        self.shuffle = shuffle
        self.even_shares = shuffle
        self.pool_size = pool_size

    def _epoch_batches(self) -> list[list[int]]:
        length_of = self.lengths.__getitem__
        if not self.shuffle:
            return self._cut(sorted(range(len(self.lengths)), key=length_of))
        rng = self._rng()
        indices = list(range(len(self.lengths)))
        rng.shuffle(indices)
        pool = self.pool_size * self.batch_size
        # Pools are whole multiples of batch_size, so only the very last batch can be short.
        sorted_indices: list[int] = []
        for start in range(0, len(indices), pool):
            sorted_indices.extend(sorted(indices[start : start + pool], key=length_of))
        batches = self._cut(sorted_indices)
        rng.shuffle(batches)
        return batches
