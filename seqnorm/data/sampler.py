"""Length-bucketed batching, so that padded batches waste little compute.

Sorting a whole epoch by length would give the same batches every epoch, in order of length. The usual
compromise (fairseq, AllenNLP's bucket iterators) is kept here: shuffle, cut into pools of about ``pool_size``
batches, sort each pool by length, cut it into batches, then shuffle the order of the batches. Each batch holds
sequences of similar length, while batch composition and order still change from epoch to epoch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence

from torch.utils.data import Sampler

from seqnorm.data.errors import DataError

__all__ = ["BucketBatchSampler"]


class _BucketIndices(Sampler[int]):
    """The indices of a :class:`BucketBatchSampler`'s batches, flattened; forwards ``set_epoch`` to it."""

    def __init__(self, batches: BucketBatchSampler) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[int]:
        return (index for batch in self.batches for index in batch)

    def __len__(self) -> int:
        if self.batches.drop_last:
            return len(self.batches) * self.batches.batch_size
        return len(self.batches.lengths)

    def set_epoch(self, epoch: int) -> None:
        self.batches.set_epoch(epoch)


class BucketBatchSampler(Sampler[list[int]]):
    """Yield batches of dataset indices whose sequences have similar lengths.

    Args:
        lengths: the length of each example, indexed like the dataset.
        batch_size: examples per batch (the last batch may be smaller unless ``drop_last``).
        shuffle: pool-shuffle as described in the module docstring. Without it, batches follow the global length
            order, the same each epoch (for evaluation).
        drop_last: drop batches smaller than ``batch_size``.
        seed: the base seed; epoch ``e`` uses a generator seeded from ``(seed, e)``.
        pool_size: batches per sorting pool.

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
    ) -> None:
        if batch_size < 1:
            raise DataError(f"--data.batch_size must be at least 1, got {batch_size}")
        if pool_size < 1:
            raise DataError(f"BucketBatchSampler: pool_size must be at least 1, got {pool_size}")
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.pool_size = pool_size
        self.epoch = 0
        # Lightning calls set_epoch on `dataloader.batch_sampler.sampler`, not on the batch sampler itself.
        self.sampler = _BucketIndices(self)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order :meth:`__iter__` yields (Lightning calls this every epoch)."""
        self.epoch = epoch

    def __len__(self) -> int:
        if self.drop_last:
            return len(self.lengths) // self.batch_size
        return math.ceil(len(self.lengths) / self.batch_size)

    def _cut(self, indices: list[int]) -> list[list[int]]:
        batches = [indices[start : start + self.batch_size] for start in range(0, len(indices), self.batch_size)]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        length_of = self.lengths.__getitem__
        if not self.shuffle:
            yield from self._cut(sorted(range(len(self.lengths)), key=length_of))
            return
        # A string seed is hashed deterministically (unlike hash() of a tuple of ints across Python builds).
        rng = random.Random(f"{self.seed}/{self.epoch}")
        indices = list(range(len(self.lengths)))
        rng.shuffle(indices)
        pool = self.pool_size * self.batch_size
        # Pools are whole multiples of batch_size, so only the very last batch can be short.
        sorted_indices: list[int] = []
        for start in range(0, len(indices), pool):
            sorted_indices.extend(sorted(indices[start : start + pool], key=length_of))
        batches = self._cut(sorted_indices)
        rng.shuffle(batches)
        yield from batches
