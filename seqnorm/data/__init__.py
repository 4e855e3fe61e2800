"""Data for seqnorm: DataModules, vocabularies, padding collate, length bucketing, corpora, a synthetic task.

* :class:`TextCorpus` — language modelling (character or word level) from a file, a registered corpus
  (:data:`DATASETS`) or the embedded synthetic task; batches ``{"inputs", "targets", "lengths"}`` (plus ``window``
  and ``start`` with ``unit="stream"``: contiguous streams for stateful truncated BPTT, :mod:`seqnorm.data.streams`).
* :data:`TEXT_FORMATS`, :func:`ptb_char_to_text` — how files are read (``--data.text_format plain | ptb_char``:
  PTB-char's space-separated characters back to plain text), :mod:`seqnorm.data.formats`.
* :class:`LabeledText` — classification from ``label<TAB>text`` lines or the embedded task; batches
  ``{"inputs", "lengths", "labels"}``.
* :class:`Vocabulary`, :func:`tokenize`, :func:`detokenize` — token ids with ``<pad>=0``, ``<unk>=1``,
  ``<bos>=2``, ``<eos>=3``.
* :class:`BucketBatchSampler`, :class:`RandomBatchSampler` — batches of similar lengths / random batches, reshuffled
  each epoch from ``(seed, epoch)``; :class:`InOrderBatchSampler` — in order (stream windows); with
  :class:`ResumableDataLoader`, resumable mid-epoch from a checkpoint.
* :func:`synthetic_lines`, :func:`synthetic_labeled` — the offline bracket-nesting tasks.
* :class:`DataError` — every data problem, with a message naming the file or ``--data.*`` flag.
"""

from seqnorm.data.collate import (
    ClassificationDataset,
    LanguageModelingDataset,
    collate_classification,
    collate_lm,
)
from seqnorm.data.errors import DataError
from seqnorm.data.formats import TEXT_FORMATS, ptb_char_to_text
from seqnorm.data.labeled import LabeledText
from seqnorm.data.loader import ResumableDataLoader
from seqnorm.data.registry import DATASETS, DatasetSpec, Download, SplitFile, default_cache_dir, fetch_dataset
from seqnorm.data.sampler import BucketBatchSampler, EpochBatchSampler, InOrderBatchSampler, RandomBatchSampler
from seqnorm.data.synthetic import is_well_nested, synthetic_labeled, synthetic_lines
from seqnorm.data.text import TextCorpus
from seqnorm.data.vocab import Vocabulary, detokenize, tokenize

__all__ = [
    "DATASETS",
    "TEXT_FORMATS",
    "BucketBatchSampler",
    "ClassificationDataset",
    "DataError",
    "DatasetSpec",
    "Download",
    "EpochBatchSampler",
    "InOrderBatchSampler",
    "LabeledText",
    "LanguageModelingDataset",
    "RandomBatchSampler",
    "ResumableDataLoader",
    "SplitFile",
    "TextCorpus",
    "Vocabulary",
    "collate_classification",
    "collate_lm",
    "default_cache_dir",
    "detokenize",
    "fetch_dataset",
    "is_well_nested",
    "ptb_char_to_text",
    "synthetic_labeled",
    "synthetic_lines",
    "tokenize",
]
