"""``TextCorpus``: a LightningDataModule for character- and word-level language modelling."""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader, Dataset

from seqnorm.data.base import SPLITS, SequenceDataModule, check_at_least, check_fraction, short_name
from seqnorm.data.collate import LanguageModelingDataset, collate_lm
from seqnorm.data.errors import DataError
from seqnorm.data.files import read_text
from seqnorm.data.formats import TEXT_FORMATS, TextFormat, apply_text_format
from seqnorm.data.loader import ResumableDataLoader
from seqnorm.data.registry import DatasetSpec, fetch_dataset, get_spec
from seqnorm.data.sampler import InOrderBatchSampler, process_share
from seqnorm.data.streams import StreamWindows, collate_stream, contiguous_streams
from seqnorm.data.synthetic import synthetic_lines
from seqnorm.data.units import (
    STREAM_UNITS,
    UNITS,
    carve,
    encode_stream,
    encode_units,
    split_units,
    stream_ids,
    token_stream,
    vocab_counts,
)
from seqnorm.data.vocab import Vocabulary

__all__ = ["DEFAULT_TEST_FRACTION", "SYNTHETIC_LM_LINES", "TextCorpus"]

SYNTHETIC_LM_LINES = 5000
"""Lines of the embedded bracket task used when no file and no dataset is given (about 210k characters)."""

DEFAULT_TEST_FRACTION = 0.1
OOV_WARNING = 0.05
"""A validation or test file read with a checkpoint's vocabulary warns when more than this share of its tokens is not
in it (read as ``<unk>``): the file is likely not the kind of text the model learned (another tokenization, level or
language). PTB's own word-level text spells ``<unk>`` literally; those tokens are in the vocabulary and do not count."""
"""The share carved for test when ``test_fraction`` is not given and the training text is the only text."""


class TextCorpus(SequenceDataModule):
    """Language-modelling batches from a text file, a registered corpus, or the embedded synthetic task.

    The text is cut into units (see :mod:`seqnorm.data.units`): natural units (lines, paragraphs, sentences)
    become input ``[<bos>] + tokens`` and target ``tokens + [<eos>]``; ``window`` units are fixed windows of the
    token stream, input ``window[:-1]`` and target ``window[1:]``, each window an independent sequence (shuffled,
    the state starts from zero: Cooijmans et al.'s protocol). ``stream`` units cut each split's token stream into
    ``batch_size`` contiguous streams read in consecutive windows, in order, for stateful truncated BPTT: row ``b``
    of batch ``k + 1`` continues row ``b`` of batch ``k`` (:mod:`seqnorm.data.streams`), and
    :class:`~seqnorm.lightning.LanguageModel` carries its state across them. Under DDP each of the ``W`` processes
    reads ``batch_size / W`` of the streams (every window of them), so ``W`` processes train on the batches of one.
    The vocabulary comes from the training split only. Nothing is read until first needed, and then only once:
    :attr:`vocab_size` works right after construction (LightningCLI links it to the model on instantiation).

    Args:
        path: one text file, split contiguously into train, val and test (train first) by ``val_fraction`` and
            ``test_fraction``. Same as ``train_path`` alone.
        train_path: the training text. Validation is carved from its end when there is no ``val_path``, and test
            as ``test_fraction`` says; what is carved is printed once, with the sizes.
        val_path: the validation text.
        test_path: the test text (also used by ``predict``). ``val_path``/``test_path`` without a training text
            are read only with a vocabulary loaded from a checkpoint (``seqnorm test --ckpt_path X --data.test_path
            new.txt``: the checkpoint supplies the rest).
        dataset: a registered corpus, see :data:`seqnorm.data.DATASETS` (downloaded once into ``cache_dir``).
        level: ``"char"`` or ``"word"`` tokens. ``None``: the dataset's default, else ``"char"``.
        unit: ``"line"``, ``"paragraph"``, ``"sentence"``, ``"window"`` or ``"stream"``. ``None``: the dataset's
            default; for a character LM on a text file (``path``/``train_path``) ``"stream"`` (stateful truncated
            BPTT, the char-rnn setup); else ``"line"`` (word level, the embedded task).
        window_length: ids per window for ``unit="window"`` and ``"stream"`` (the truncated-BPTT length plus one),
            and the most any natural unit is cut into (inputs are at most ``window_length - 1`` long).
        batch_size: sequences per batch (1 or more), per process under DDP; with ``unit="stream"`` the number of
            streams, in every split (each split must hold at least ``2 * batch_size`` tokens), for all processes
            together: under DDP a multiple of the world size, each process reading ``batch_size / world_size`` of
            them (the text is cut the same whatever the number of processes, and so is what a checkpoint carries).
        bucket: batch sequences of similar length together (:class:`BucketBatchSampler`) to reduce padding
            (ignored by ``unit="stream"``, whose batches are in stream order).
        min_freq: tokens seen fewer times in training map to ``<unk>``.
        max_vocab_size: the largest vocabulary, specials included; ``None`` for no limit.
        encoding: the text encoding of the files.
        text_format: how the files are read (:mod:`seqnorm.data.formats`): ``"plain"``, or ``"ptb_char"`` for
            characters separated by spaces with ``_`` between words (PTB-char; separators dropped, ``_`` read as a
            space, so there is one token per real character). ``None``: the dataset's format, else plain text, and
            a file that looks like PTB-char is refused (its separators would make bpc falsely good); pass
            ``"plain"`` to read such a file as it is.
        val_fraction: share of the units carved for validation when there is no ``val_path``.
        test_fraction: share of the units carved for test when there is no ``test_path``. ``None``:
            :data:`DEFAULT_TEST_FRACTION` when the training text is the only text (one file, the embedded task, a
            corpus without splits), nothing when a validation text is given (``val_path``): naming a validation file
            keeps the whole training file for training unless a test share is asked for.
        seed: seeds the embedded task and the batch order.
        num_workers: DataLoader worker processes.
        cache_dir: where datasets are downloaded; ``None``: ``$SEQNORM_CACHE`` or ``~/.cache/seqnorm``.
        dataset_hash: a checksum (``sha256:<hex>`` or ``md5:<hex>``) for a dataset with none registered (text8).

    Batches are dicts: ``inputs`` and ``targets`` ``(B, T)`` int64 padded with :attr:`pad_index`, ``lengths``
    ``(B,)`` int64; with ``unit="stream"`` also ``window`` (the window's index in the epoch, 0-d int64), ``start``
    (the stream position of its first input), ``first_stream`` and ``num_streams`` (which of the split's streams
    the rows are): see :func:`~seqnorm.data.streams.collate_stream`.

    Example:
        >>> corpus = TextCorpus(batch_size=4)  # the embedded bracket task, offline
        >>> corpus.vocab_size
        20
        >>> sorted(next(iter(corpus.train_dataloader())))
        ['inputs', 'lengths', 'targets']
    """

    _collate = staticmethod(collate_lm)

    def __init__(
        self,
        path: str | None = None,
        train_path: str | None = None,
        val_path: str | None = None,
        test_path: str | None = None,
        dataset: str | None = None,
        level: Literal["char", "word"] | None = None,
        unit: Literal["line", "paragraph", "sentence", "window", "stream"] | None = None,
        window_length: int = 128,
        batch_size: int = 32,
        bucket: bool = True,
        min_freq: int = 1,
        max_vocab_size: int | None = None,
        encoding: str = "utf-8",
        text_format: Literal["plain", "ptb_char"] | None = None,
        val_fraction: float = 0.1,
        test_fraction: float | None = None,
        seed: int = 0,
        num_workers: int = 0,
        cache_dir: str | None = None,
        dataset_hash: str | None = None,
    ) -> None:
        super().__init__(batch_size, bucket, encoding, seed, num_workers)
        # The arguments as given go into checkpoints (datamodule_hyper_parameters), so that evaluating one needs no
        # data flags but the new file. logger=False: Lightning would log them beside the model's hyperparameters,
        # and refuses a key of both with two values (the given `level=None` and the model's linked `level`).
        self.save_hyperparameters(logger=False)
        check_at_least("window_length", window_length, 2)
        check_at_least("min_freq", min_freq, 1)
        check_at_least("max_vocab_size", max_vocab_size, 5)  # the 4 specials and at least one token
        check_fraction("val_fraction", val_fraction)
        if test_fraction is not None:
            check_fraction("test_fraction", test_fraction)
        if val_fraction + (test_fraction or 0.0) >= 1.0:
            raise DataError(
                f"--data.val_fraction {val_fraction} plus --data.test_fraction {test_fraction} leave no training "
                "text: their sum must be below 1"
            )
        if path is not None and train_path is not None:
            raise DataError("--data.path and --data.train_path both given: pass one (they mean the same)")
        self.spec: DatasetSpec | None = None
        if dataset is not None:
            if any(p is not None for p in (path, train_path, val_path, test_path)):
                raise DataError("--data.dataset and --data.path/--data.train_path both given: choose one source")
            self.spec = get_spec(dataset)
        if level is not None and level not in ("char", "word"):
            raise DataError(f"--data.level {level!r}: choose char or word")
        if unit is not None and unit not in UNITS:
            raise DataError(f"--data.unit {unit!r}: choose one of {', '.join(UNITS)}")
        if text_format is not None and text_format not in TEXT_FORMATS:
            raise DataError(f"--data.text_format {text_format!r}: choose one of {', '.join(TEXT_FORMATS)}")
        own_text = path is not None or train_path is not None
        # a validation or test file alone is text of the user's too (evaluating a checkpoint, whose vocabulary it is)
        any_file = own_text or val_path is not None or test_path is not None
        if text_format == "ptb_char" and not any_file and self.spec is None:
            raise DataError(
                "--data.text_format ptb_char needs a file (--data.path, --data.train_path, or with a checkpoint's "
                "vocabulary --data.val_path or --data.test_path): the embedded task is plain text"
            )
        self.level: Literal["char", "word"] = level or (self.spec.level if self.spec else "char")  # type: ignore[assignment]
        # None is kept apart from "plain": only a format nobody named is checked for PTB-char's look.
        self._given_text_format: TextFormat | None = text_format
        self.text_format: TextFormat = text_format or (self.spec.text_format if self.spec else "plain")
        # A character LM on a text file reads it as streams (stateful truncated BPTT, the char-rnn setup); the
        # embedded task's lines and word-level text keep one sequence per line.
        default_unit = "stream" if self.level == "char" and own_text else "line"
        self.unit: Literal["line", "paragraph", "sentence", "window", "stream"] = unit or (  # type: ignore[assignment]
            self.spec.unit if self.spec else default_unit
        )
        self.paths = {"train": train_path or path, "val": val_path, "test": test_path}
        self._train_flag = "--data.train_path" if train_path is not None else "--data.path"
        self.window_length = window_length
        self.min_freq = min_freq
        self.max_vocab_size = max_vocab_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.cache_dir = cache_dir
        self.dataset_hash = dataset_hash
        self._items: dict[str, Any] | None = None

    @property
    def source(self) -> str:
        """Where the text comes from, as named in messages."""
        if self.spec is not None:
            return f"--data.dataset {self.spec.name}"
        given = [path for path in self.paths.values() if path is not None]  # a training text first, if any
        return given[0] if given else "the embedded synthetic task"

    @property
    def source_name(self) -> str:
        """The registered corpus's name, else the first file's (:attr:`SequenceDataModule.source_name`)."""
        return short_name(self.spec.name) if self.spec is not None else super().source_name

    def prepare_data(self) -> None:
        """Download the registered dataset, if any (Lightning calls this on one process only)."""
        if self.spec is not None:
            fetch_dataset(self.spec.name, self.cache_dir, self.dataset_hash)

    @property
    def _evaluation_only(self) -> bool:
        """Validation or test files without a training text: read with a checkpoint's vocabulary."""
        return self.spec is None and self.paths["train"] is None and any(self.paths.values())

    def _read(self) -> dict[str, str | None]:
        """Each split's text, ``None`` for splits to be carved from the training text (or, with evaluation files
        only, for splits there are none of)."""
        if self.spec is not None:
            files = fetch_dataset(self.spec.name, self.cache_dir, self.dataset_hash)
            texts: dict[str, str | None] = {}
            for split in SPLITS:
                text = read_text(files[split], "utf-8", "--data.dataset") if split in files else None
                source = f"--data.dataset {self.spec.name} ({files.get(split)})"
                texts[split] = apply_text_format(text, self.text_format, source) if text is not None else None
            return texts
        if self.paths["train"] is None and not self._evaluation_only:
            return {"train": "\n".join(synthetic_lines(SYNTHETIC_LM_LINES, self.seed)), "val": None, "test": None}
        flags = {"train": self._train_flag}
        flags.update(val="--data.val_path", test="--data.test_path")
        return {
            split: apply_text_format(
                read_text(path, self.encoding, flags[split]), self._given_text_format, f"{flags[split]} {path}"
            )
            if path is not None
            else None
            for split, path in self.paths.items()
        }

    def _units(self, text: str) -> Any:
        return token_stream(text, self.level) if self.unit in STREAM_UNITS else split_units(text, self.unit)

    def _load_items(self) -> dict[str, Any]:
        texts = self._read()
        items = {split: self._units(text) if text is not None else None for split, text in texts.items()}
        if items["train"] is None:  # evaluation files only: nothing to train on, nothing to carve
            empty = self._units("")
            return {split: value if value is not None else empty for split, value in items.items()}
        test_fraction = self.test_fraction
        if test_fraction is None:  # a named validation text keeps the training text whole
            test_fraction = DEFAULT_TEST_FRACTION if items["val"] is None else 0.0
        fractions = {
            "val": self.val_fraction if items["val"] is None else None,
            "test": test_fraction if items["test"] is None else None,
        }
        train, val, test = carve(items["train"], fractions["val"], fractions["test"])
        carved = {"val": (len(val), fractions["val"]), "test": (len(test), fractions["test"])}
        self._report_carved(len(items["train"]), len(train), carved)
        return {
            "train": train,
            "val": items["val"] if items["val"] is not None else val,
            "test": items["test"] if items["test"] is not None else test,
        }

    def _report_carved(self, total: int, kept: int, carved: dict[str, tuple[int, float | None]]) -> None:
        """Say once (on rank 0) what was carved from the training text, with the sizes."""
        parts = [
            f"{size} for {split} (--data.{split}_fraction {fraction})"
            for split, (size, fraction) in carved.items()
            if size
        ]
        if not parts:
            return
        what = "tokens" if self.unit in STREAM_UNITS else f"{self.unit}s"
        if self.unit in STREAM_UNITS and self.level == "char":
            what = "characters"
        source = f"{self._train_flag} {self.paths['train']}" if self.paths["train"] else self.source
        rank_zero_info(
            f"TextCorpus: carved from the end of {source} ({total} {what}): {' and '.join(parts)}; {kept} {what} "
            "left for training"
        )

    def _build(self) -> dict[str, Dataset]:
        if self._items is None:
            if self._evaluation_only and self._vocab is None:
                raise DataError(
                    "--data.val_path / --data.test_path need --data.train_path (the training text, from which the "
                    "vocabulary is built), unless a checkpoint supplies the vocabulary (seqnorm validate|test|"
                    "predict --ckpt_path)"
                )
            self._items = self._load_items()
        if self._vocab is None:
            counts = vocab_counts(self._items["train"], self.level, self.unit)
            self._vocab = Vocabulary.from_counts(counts, self.min_freq, self.max_vocab_size)
        else:  # a checkpoint's vocabulary: say so when a file of the user's is mostly outside it
            self._warn_out_of_vocabulary()
        if self.unit == "stream":
            return self._stream_datasets()
        datasets = {}
        for split, items in self._items.items():
            units: list[int] | None = None
            if self.unit == "window":
                sequences = encode_stream(items, self._vocab, self.window_length)
            else:
                sequences, units = encode_units(items, self._vocab, self.level, self.window_length)
            datasets[split] = LanguageModelingDataset(sequences, units)
            if split != "train" and items and not sequences:  # carved and announced, then no window: it ran empty
                raise DataError(
                    f"{self.source}: the {split} split has fewer than 2 tokens, nothing to predict: raise "
                    f"--data.{split}_fraction, pass --data.{split}_path or add text"
                )
        if len(datasets["train"]) < self.batch_size and not self._evaluation_only:
            raise DataError(
                f"{self.source}: the training split has {len(datasets['train'])} sequences ({self.unit} units of "
                f"at most --data.window_length {self.window_length} tokens) but --data.batch_size is "
                f"{self.batch_size}: lower --data.batch_size or --data.window_length, or add text"
            )
        return datasets

    def _warn_out_of_vocabulary(self) -> None:
        assert self._items is not None and self._vocab is not None
        for split in ("val", "test"):
            path, items = self.paths[split], self._items.get(split)
            if path is None or not items:
                continue
            counts = vocab_counts(items, self.level, self.unit)
            total = sum(counts.values())
            unknown = sum(count for token, count in counts.items() if token not in self._vocab)
            if total and unknown / total > OOV_WARNING:
                warnings.warn(
                    f"TextCorpus: {unknown / total:.1%} of the tokens of --data.{split}_path {path} ({unknown} of "
                    f"{total}) are not in the checkpoint's vocabulary and are read as <unk>: the file may not be the "
                    f"kind of text the model was trained on (another --data.level, tokenization, format or "
                    "language), and its loss would say little",
                    stacklevel=2,
                )

    def _stream_datasets(self) -> dict[str, Dataset]:
        assert self._items is not None and self._vocab is not None
        datasets: dict[str, Dataset] = {}
        for split, items in self._items.items():
            ids = stream_ids(items, self._vocab)
            if len(ids) == 0:
                continue  # a split carved with fraction 0 has no text: no loader for it
            try:
                streams = contiguous_streams(ids, self.batch_size)
            except DataError as error:
                raise DataError(f"{self.source}: the {split} split: {error}") from None
            datasets[split] = StreamWindows(streams, self.window_length)
        return datasets

    def _loader(self, split: str, *, shuffle: bool, bucket: bool | None) -> DataLoader:
        if self.unit != "stream":
            return super()._loader(split, shuffle=shuffle, bucket=bucket)
        if split not in self.datasets:
            if split == "val":  # --data.val_fraction 0 asked for no validation, as line units read it
                return DataLoader([], batch_size=1, collate_fn=collate_stream)
            raise DataError(
                f"{self.source}: no {split} text: raise --data.{split}_fraction or pass --data.{split}_path"
            )
        dataset = self._stream_share(split)
        # One item is a whole batch, in order: the state carried from batch k into batch k+1 continues each stream.
        # Every process reads every window of its own streams (unsharded sampler). Resumable in every split (only
        # training is ever resumed; the others merely share the loader).
        sampler = InOrderBatchSampler(len(dataset), 1, seed=self.seed, num_replicas=1, rank=0)
        return ResumableDataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=collate_stream,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def _stream_share(self, split: str) -> StreamWindows:
        """This process's streams of ``split`` (all of them without DDP): see :meth:`StreamWindows.share`."""
        dataset = self.datasets[split]
        assert isinstance(dataset, StreamWindows)
        return dataset.share(*process_share())

    def predict_dataloader(self) -> DataLoader:
        """The test split in file order; with ``unit="stream"`` its windows in order, each one batch (under DDP each
        process predicts its own streams)."""
        loader = super().predict_dataloader()
        if self.unit != "stream":
            return loader
        # A plain DataLoader: Lightning rebuilds the predict loader around its own index-tracking batch sampler,
        # which ResumableDataLoader refuses (its sampler is the position a resumed fit restores); nothing resumes
        # a prediction.
        return DataLoader(
            self._stream_share("test"),
            batch_size=1,
            shuffle=False,
            collate_fn=collate_stream,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def state_dict(self) -> dict[str, Any]:
        """The vocabulary and tokenization, saved in checkpoints so a resumed run keeps the same ids and reads
        its text the same way."""
        return {
            "vocab": self.vocab.to_dict(),
            "level": self.level,
            "unit": self.unit,
            "text_format": self.text_format,
            "batch_size": self.batch_size,  # a resumed fit continues the data order in batches of this size
            "window_length": self.window_length,  # generation restarts a stream window's time index as training did
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the vocabulary of :meth:`state_dict`; the data is re-encoded with it on next use."""
        self._check_level(state_dict)
        # Checkpoints from before text formats carry none: their data was read as plain text, or as PTB-char
        # through the ptb_char dataset, which still reads it that way, so there is nothing to compare.
        saved_format = state_dict.get("text_format", self.text_format)
        if saved_format != self.text_format:
            raise DataError(
                f"the checkpoint was trained on text read with --data.text_format {saved_format} but this run reads "
                f"{self.source} with --data.text_format {self.text_format}: pass --data.text_format {saved_format}"
            )
        self._set_vocab(state_dict)
