"""``ResumableDataLoader``: a DataLoader that Lightning saves in the checkpoint and restores mid-epoch.

Lightning's fit loop stores ``state_dict()`` of every train DataLoader that has ``state_dict``/``load_state_dict``
(``CombinedLoader._state_dicts``) and hands it back through ``load_state_dict`` before it makes the first iterator
of a resumed run. The state is the epoch and the number of batches *the training loop took* from the current
iterator: the batch sampler runs ahead of that when workers prefetch (``prefetch_factor`` batches each), and
Lightning's own one-batch prefetch is off for loaders with a length. Between two training steps the count is the
number of batches trained on in this epoch; a checkpoint written on an exception inside a step counts the batch of
that step too, and ``seqnorm.lightning.resume.rewind_unfinished_batch`` takes it back there.
"""

from __future__ import annotations

import random
from typing import Any

from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

from seqnorm.data.errors import DataError
from seqnorm.data.sampler import EpochBatchSampler, _EpochPass

__all__ = ["ResumableDataLoader"]


class ResumableDataLoader(DataLoader):
    """A DataLoader over an :class:`~seqnorm.data.sampler.EpochBatchSampler` whose position Lightning checkpoints.

    Takes DataLoader's arguments; ``batch_sampler`` must be an :class:`EpochBatchSampler` and ``generator`` a
    ``torch.Generator``. Each iterator reseeds the generator from the sampler's ``(seed, epoch)``, so the seeds of
    worker processes do not depend on how many iterators were made before (a resumed run makes a different number)
    and making an iterator never draws from the global random state.

    Example:
        >>> import torch
        >>> from seqnorm.data.sampler import RandomBatchSampler
        >>> sampler = RandomBatchSampler(10, batch_size=4)
        >>> loader = ResumableDataLoader(range(10), batch_sampler=sampler, generator=torch.Generator())
        >>> iterator = iter(loader)
        >>> first = next(iterator)
        >>> loader.state_dict()
        {'epoch': 0, 'position': 1}
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.batch_sampler, EpochBatchSampler):
            raise DataError(
                f"ResumableDataLoader: expected an EpochBatchSampler as batch_sampler, got {type(self.batch_sampler)}"
            )
        if self.generator is None:
            raise DataError("ResumableDataLoader: expected a torch.Generator as generator, got None")
        self._latest: _BaseDataLoaderIter | None = None

    @property
    def _sampler(self) -> EpochBatchSampler:
        assert isinstance(self.batch_sampler, EpochBatchSampler)
        return self.batch_sampler

    def __iter__(self) -> _BaseDataLoaderIter:
        sampler = self._sampler
        self.generator.manual_seed(random.Random(f"{sampler.seed}/{sampler.epoch}/loader").getrandbits(63))
        self._latest = super().__iter__()
        return self._latest

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": e, "position": p}``: ``p`` batches of epoch ``e`` were taken from this loader's iterator."""
        sampler, iterator = self._sampler, self._latest
        # torch's iterator keeps the sampler pass it draws indices from (`_sampler_iter`, replaced when persistent
        # workers start the next epoch) and counts the batches it returned (`_num_yielded`); the pass's own count
        # includes the batches that workers fetched ahead.
        batches = getattr(iterator, "_sampler_iter", None)
        if not isinstance(batches, _EpochPass) or batches.batches is None:
            return sampler._pending()  # no batch asked for since the iterator was made (or none made)
        if batches.epoch != sampler.epoch:
            return sampler.state_dict()
        return {"epoch": batches.epoch, "position": batches.start + iterator._num_yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next iterator yield the rest of the saved epoch (see ``EpochBatchSampler.load_state_dict``)."""
        self._sampler.load_state_dict(state)
        self._latest = None
