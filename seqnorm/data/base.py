"""What the two DataModules share: argument checks, the lazy build, and the four dataloaders."""

from __future__ import annotations

import inspect
import os
import re
import stat
import warnings
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset

from seqnorm.checkpoint_io import (
    DATA_HPARAMS_KEY,
    corrupt_checkpoint,
    data_class,
    read_checkpoint,
    refuse_unsafe_load,
    subclasses,
)
from seqnorm.data.errors import DataError
from seqnorm.data.files import check_encoding
from seqnorm.data.formats import checked_format
from seqnorm.data.loader import ResumableDataLoader
from seqnorm.data.sampler import BucketBatchSampler, EpochBatchSampler, InOrderBatchSampler, RandomBatchSampler
from seqnorm.data.vocab import Vocabulary

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["DATA_PATHS", "LOCAL_SETTINGS", "SequenceDataModule", "check_at_least", "check_fraction", "from_checkpoint"]

SPLITS = ("train", "val", "test")

LOCAL_SETTINGS = ("cache_dir", "dataset_hash", "num_workers")
"""DataModule arguments a checkpoint never supplies (``--ckpt_path``, ``load_from_checkpoint``): where files are
written, deleted or downloaded, which download to trust, and how many processes start belong to the machine and its
user, not to a file that may come from elsewhere. They come from the command line (or the caller) or the defaults."""

DATA_PATHS = {
    "path": "training",
    "train_path": "training",
    "val_path": "validation",
    "test_path": "test",
    "predict_path": "prediction",
}
"""The DataModules' file arguments, and the split each names (for the line that says a checkpoint chose one)."""


def short_name(name: str, limit: int = 32) -> str:
    """``name`` as a few filesystem-safe characters for a folder name: a text suffix (``.txt``, ``.tsv``, ``.text``)
    dropped, runs of other characters than letters, digits, ``.``, ``-``, ``_`` turned into one ``_``, at most
    ``limit`` characters; ``data`` when nothing is left."""
    stem = re.sub(r"\.(txt|tsv|text)$", "", name, flags=re.IGNORECASE)
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._-")[:limit].rstrip("._-")
    return safe or "data"


def check_at_least(flag: str, value: int | None, minimum: int) -> None:
    """Raise a :class:`DataError` naming ``--data.<flag>`` if ``value`` is below ``minimum``."""
    if value is not None and value < minimum:
        raise DataError(f"--data.{flag} must be at least {minimum}, got {value}")


def check_fraction(flag: str, value: float) -> None:
    """Raise a :class:`DataError` naming ``--data.<flag>`` unless ``0 <= value < 1``."""
    if not 0.0 <= value < 1.0:
        raise DataError(f"--data.{flag} must be in [0, 1), got {value}")


def from_checkpoint(saved: dict[str, Any], where: str) -> dict[str, Any]:
    """Of the data arguments ``saved`` in a checkpoint (those the caller would take: none the user set), the ones a
    run may take from it: none of :data:`LOCAL_SETTINGS`, and each file of :data:`DATA_PATHS` a regular file (not a
    device such as ``/dev/zero``, a FIFO or a folder), said once ("test data from the checkpoint: ..."), since it is
    read on the file's say-so; a saved ``text_format`` as :func:`~seqnorm.data.formats.checked_format` gives it.
    Raises :class:`DataError` naming ``where`` (the checkpoint) and the flag to pass."""
    taken = {}
    for name, value in saved.items():
        if name in LOCAL_SETTINGS:
            continue
        if name in DATA_PATHS and value is not None:
            _check_regular_file(name, value, where)
            rank_zero_info(f"{DATA_PATHS[name]} data from the checkpoint: {value} (--data.{name}; {where})")
        taken[name] = checked_format(value) if name == "text_format" else value
    return taken


def _check_regular_file(name: str, value: Any, where: str) -> None:
    instead = f"pass --data.{name} with a file of yours"
    if not isinstance(value, str):
        raise DataError(f"{where}: expected its --data.{name} to be a file path, got {value!r}: {instead}")
    try:
        mode = os.stat(value).st_mode
    except OSError as error:
        what = error.strerror or type(error).__name__
        raise DataError(f"{where}: its --data.{name} {value} cannot be read here ({what}): {instead}") from None
    if not stat.S_ISREG(mode):
        raise DataError(
            f"{where}: expected its --data.{name} to be a regular file, got {value} (a device, FIFO or folder): "
            f"refused; {instead}"
        )


class SequenceDataModule(pl.LightningDataModule):
    """Base of :class:`TextCorpus` and :class:`LabeledText`.

    Subclasses implement :meth:`_build`, which reads the data (once), builds ``self._vocab`` unless one was loaded
    from a checkpoint, and returns the encoded ``train``/``val``/``test`` datasets. Everything is built lazily on
    first use of :attr:`vocab`, :attr:`vocab_size` or a dataloader, because LightningCLI's
    ``link_arguments(..., apply_on="instantiate")`` reads sizes right after construction, before ``setup()``.
    """

    _collate: Callable[..., dict[str, torch.Tensor]]
    level: str  # "char" or "word": set by each subclass
    paths: dict[str, str | None]  # the files given, by split ("train", "val", "test"): set by each subclass

    def __init__(self, batch_size: int, bucket: bool, encoding: str, seed: int, num_workers: int) -> None:
        super().__init__()
        check_at_least("batch_size", batch_size, 1)
        check_at_least("num_workers", num_workers, 0)
        check_encoding(encoding)
        self.batch_size = batch_size
        self.bucket = bucket
        self.encoding = encoding
        self.seed = seed
        self.num_workers = num_workers
        self._vocab: Vocabulary | None = None
        self._datasets: dict[str, Dataset] | None = None

    def _build(self) -> dict[str, Dataset]:
        raise NotImplementedError

    @property
    def source_name(self) -> str:
        """The data in a few filesystem-safe characters, as a run's name says it: the first file given (training
        first) without its folder and its ``.txt``/``.tsv`` suffix (``ptb.char.valid`` for
        ``data/ptb.char.valid.txt``), ``embedded`` for the embedded task."""
        given = next((path for path in self._source_paths() if path is not None), None)
        return short_name(os.path.basename(os.path.normpath(given))) if given is not None else "embedded"

    def _source_paths(self) -> list[str | None]:
        """The files :attr:`source_name` may name, in its order of preference: the splits' (training first)."""
        return list(self.paths.values())

    @classmethod
    def load_from_checkpoint(  # type: ignore[override]
        cls, checkpoint_path: str | os.PathLike[str], **kwargs: Any
    ) -> Self:
        """The DataModule a checkpoint's run read its data with: its saved arguments (``kwargs`` replace single
        ones) and its vocabulary, as Lightning's ``load_from_checkpoint`` makes it, from a file that passes
        :func:`~seqnorm.checkpoint_io.read_checkpoint`.

        The file is read once, with ``weights_only=True``; the arguments must be plain values, and the class they
        name must be this class or a subclass of it, never imported on the file's say-so (a foreign one is a
        :class:`~seqnorm.checkpoint_io.CheckpointError`). The cache, a checksum to trust and the number of
        worker processes are never taken from it (:data:`LOCAL_SETTINGS`: pass them in ``kwargs``), and a file it
        names must be a regular file and is said once (:func:`from_checkpoint`).
        """
        flag = f"{cls.__name__}.load_from_checkpoint"
        refuse_unsafe_load(kwargs.pop("weights_only", None), flag)
        checkpoint = read_checkpoint(checkpoint_path, flag)
        target = data_class(checkpoint, subclasses(cls), checkpoint_path, flag) or cls
        taken = inspect.signature(target.__init__).parameters  # names no longer taken are ignored, as Lightning does
        saved = {name: value for name, value in (checkpoint.get(DATA_HPARAMS_KEY) or {}).items() if name in taken}
        saved = from_checkpoint({n: v for n, v in saved.items() if n not in kwargs}, f"{flag} {checkpoint_path}")
        try:
            datamodule = target(**{**saved, **kwargs})
            state = checkpoint.get(target.__qualname__)  # where Lightning saves the DataModule's state_dict()
            if state is not None:
                datamodule.load_state_dict(state)
        except DataError as error:  # a saved value the DataModule refuses
            raise corrupt_checkpoint(f"{flag} {checkpoint_path}", str(error)) from None
        return datamodule  # type: ignore[return-value]

    @property
    def datasets(self) -> dict[str, Dataset]:
        """The encoded ``train``/``val``/``test`` datasets, built on first access."""
        if self._datasets is None:
            from_data = self._vocab is None
            self._datasets = self._build()
            assert self._vocab is not None
            if from_data and len(self._vocab) == len(Vocabulary(bos_eos=self._vocab.bos_eos)):
                warnings.warn(
                    f"{type(self).__name__}: the vocabulary holds no token besides the special ones (every token of "
                    f"the training split is rarer than --data.min_freq {getattr(self, 'min_freq', 1)}): every input "
                    "reads as <unk>",
                    stacklevel=2,
                )
        return self._datasets

    @property
    def vocab(self) -> Vocabulary:
        """The vocabulary of the training split (or the one loaded from a checkpoint)."""
        self.datasets  # noqa: B018 - building sets self._vocab
        assert self._vocab is not None
        return self._vocab

    @property
    def vocab_size(self) -> int:
        """Number of token ids, specials included (the model's embedding and output size)."""
        return len(self.vocab)

    @property
    def pad_index(self) -> int:
        """The padding id (always 0; known without reading any data)."""
        return Vocabulary.pad_index

    def setup(self, stage: str | None = None) -> None:
        """Build the datasets now if nothing asked for them yet."""
        self.datasets  # noqa: B018

    def _check_level(self, state: dict[str, Any]) -> None:
        """A saved state of another tokenization level is a :class:`DataError` naming ``--data.level``: its
        vocabulary would turn every token of this level into ``<unk>``."""
        saved = state.get("level", self.level)
        if saved != self.level:
            raise DataError(
                f"the checkpoint was trained with --data.level {saved} but this run has --data.level "
                f"{self.level}: pass --data.level {saved}"
            )

    def _set_vocab(self, state: dict[str, Any]) -> None:
        try:
            vocab_state = state["vocab"]
        except (KeyError, TypeError):
            raise DataError(f"{type(self).__name__}: the checkpoint's datamodule state has no 'vocab'") from None
        self._vocab = Vocabulary.from_dict(vocab_state)
        self._datasets = None  # re-encode with the restored mapping on next use

    def _loader(self, split: str, *, shuffle: bool, bucket: bool | None) -> DataLoader:
        """``split``'s loader: seeded shuffled batches (training), every batch in length (``bucket``) or file order
        (evaluation), each sharded across processes by seqnorm's samplers; ``bucket=None``: a plain in-order
        DataLoader, which Lightning may rebuild (predict wraps it in its own index-tracking sampler)."""
        dataset = self.datasets[split]
        common: dict[str, Any] = {
            "collate_fn": partial(type(self)._collate, pad_index=self.pad_index),
            "num_workers": self.num_workers,
            "persistent_workers": self.num_workers > 0,
            # Every loader has its own generator: making an iterator draws a worker base seed from it, and without
            # one that draw comes from the global random state, which dropout uses too. Exact resume needs the
            # dropout masks not to depend on when validation (or a resumed run) made iterators.
            "generator": torch.Generator().manual_seed(self.seed),
        }
        if shuffle:
            # Orders that depend on (seed, epoch) only, and a loader that Lightning checkpoints mid-epoch.
            sampler: EpochBatchSampler
            if bucket:
                sampler = BucketBatchSampler(dataset.lengths, self.batch_size, seed=self.seed)
            else:
                sampler = RandomBatchSampler(len(dataset), self.batch_size, seed=self.seed)
            return ResumableDataLoader(dataset, batch_sampler=sampler, **common)
        if bucket is None:
            return DataLoader(dataset, batch_size=self.batch_size, shuffle=False, **common)
        # Evaluation: every batch, each process its share (unbucketed, every process evaluated the whole split).
        if bucket:
            sampler = BucketBatchSampler(dataset.lengths, self.batch_size, shuffle=False, seed=self.seed)
        else:
            sampler = InOrderBatchSampler(len(dataset), self.batch_size, seed=self.seed)
        return DataLoader(dataset, batch_sampler=sampler, **common)

    def train_dataloader(self) -> DataLoader:
        """Shuffled each epoch (length-bucketed when ``bucket``); resumable mid-epoch from a checkpoint."""
        return self._loader("train", shuffle=True, bucket=self.bucket)

    def val_dataloader(self) -> DataLoader:
        """In length order when ``bucket`` (least padding), else in file order."""
        return self._loader("val", shuffle=False, bucket=self.bucket)

    def test_dataloader(self) -> DataLoader:
        """Like :meth:`val_dataloader`, on the test split."""
        return self._loader("test", shuffle=False, bucket=self.bucket)

    def predict_dataloader(self) -> DataLoader:
        """The test split in file order, so predictions line up with the input."""
        if len(self.datasets.get("test", ())) == 0:  # else `predict` writes an empty file and says nothing
            raise DataError(
                "--data.test_path: predict reads the test split, and this data has none: pass --data.test_path "
                "with the texts to predict"
            )
        return self._loader("test", shuffle=False, bucket=None)
