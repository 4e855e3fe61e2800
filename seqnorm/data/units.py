"""Cutting text into language-modelling units and turning units into id sequences.

Natural units are variable-length pieces of text:

* ``line``: each line that is not blank (trailing whitespace dropped);
* ``paragraph``: blocks separated by blank lines (line breaks inside a block are kept, as ``\\n`` characters);
* ``sentence``: paragraphs split after ``.``, ``!`` or ``?`` followed by whitespace (line breaks inside a sentence
  become spaces).

Each natural unit becomes ``[<bos>] + tokens + [<eos>]``, and the model predicts it shifted by one: input
``[<bos>] + tokens``, target ``tokens + [<eos>]``. The ``window`` unit instead reads the corpus as one token stream
(characters including newlines, or words with an ``<eos>`` after each line) cut into fixed windows; the ``stream``
unit reads the same token stream as ``B`` contiguous streams whose consecutive windows continue each other, for
stateful truncated BPTT (:mod:`seqnorm.data.streams`). Sequences longer
than ``window_length`` ids, of either kind, are cut into windows that overlap by one id, so every id after the
first is a target exactly once.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from typing import Literal, TypeVar

import torch

from seqnorm.data.collate import chunk_sequence
from seqnorm.data.errors import DataError
from seqnorm.data.vocab import EOS, Level, Vocabulary, tokenize

__all__ = [
    "STREAM_UNITS",
    "UNITS",
    "Unit",
    "carve",
    "encode_stream",
    "encode_units",
    "split_units",
    "stream_ids",
    "token_stream",
    "vocab_counts",
]

Unit = Literal["line", "paragraph", "sentence", "window", "stream"]
UNITS = ("line", "paragraph", "sentence", "window", "stream")
STREAM_UNITS = ("window", "stream")
"""Units that read the corpus as one token stream (:func:`token_stream`) instead of natural units."""

_BLANK_LINES = re.compile(r"\n\s*\n")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")

Items = TypeVar("Items", str, Sequence[str])


def split_units(text: str, unit: Unit) -> list[str]:
    """The natural units of ``text`` (``line``, ``paragraph`` or ``sentence``), in order, none blank."""
    if unit == "line":
        return [line.rstrip() for line in text.split("\n") if line.strip()]
    paragraphs = [block.strip() for block in _BLANK_LINES.split(text) if block.strip()]
    if unit == "paragraph":
        return paragraphs
    if unit == "sentence":
        sentences = (_SENTENCE_END.split(" ".join(paragraph.split("\n"))) for paragraph in paragraphs)
        return [sentence.strip() for group in sentences for sentence in group if sentence.strip()]
    raise DataError(f"--data.unit {unit!r} is not a natural unit: choose one of {', '.join(UNITS)}")


def token_stream(text: str, level: Level) -> str | list[str]:
    """The whole text as one token stream for ``window`` and ``stream`` units.

    Characters: the text itself (a ``str`` is a sequence of characters and far smaller than a list of them).
    Words: each line's words followed by ``<eos>``, the usual word-level LM convention (Zaremba et al. 2014).
    """
    if level == "char":
        return text
    stream: list[str] = []
    for line in text.split("\n"):
        words = line.split()
        if words:
            stream.extend(words)
            stream.append(EOS)
    return stream


def _count(total: int, fraction: float) -> int:
    # A positive fraction of a small corpus still gets one item, so no requested split is silently empty.
    return 0 if fraction <= 0 else max(1, round(total * fraction))


def carve(items: Items, val_fraction: float | None, test_fraction: float | None) -> tuple[Items, Items, Items]:
    """Split ``items`` contiguously into train, val and test, train first.

    Args:
        items: units, or a token stream.
        val_fraction: the share taken for validation; ``None`` takes nothing (the split has its own file).
        test_fraction: likewise for test.

    Returns:
        ``(train, val, test)``; a split with ``None`` fraction comes back empty.
    """
    total = len(items)
    n_val = _count(total, val_fraction or 0.0)
    n_test = _count(total, test_fraction or 0.0)
    end_train = total - n_val - n_test
    if end_train < 1:
        raise DataError(
            f"the corpus has only {total} unit{'' if total == 1 else 's'}: too few to carve --data.val_fraction "
            f"{val_fraction} and --data.test_fraction {test_fraction} from it and keep a training split; lower them "
            "or add text"
        )
    return items[:end_train], items[end_train : total - n_test], items[total - n_test :]


def vocab_counts(items: str | Sequence[str], level: Level, unit: Unit) -> Counter[str]:
    """Token counts of one split's units (or stream), for :meth:`Vocabulary.from_counts`."""
    counts: Counter[str] = Counter()
    if unit in STREAM_UNITS:
        counts.update(items)  # a str counts its characters (in C); a list counts its words
    else:
        for item in items:
            counts.update(item if level == "char" else item.split())
    return counts


def encode_units(
    units: Sequence[str], vocab: Vocabulary, level: Level, window_length: int
) -> tuple[list[torch.Tensor], list[int]]:
    """``[<bos>] + ids + [<eos>]`` of each unit, cut into windows of at most ``window_length`` ids; and for each
    window the index of the unit it was cut from (a unit longer than ``window_length`` gives several)."""
    sequences: list[torch.Tensor] = []
    sources: list[int] = []
    bos, eos = vocab.bos_index, vocab.eos_index
    for index, unit in enumerate(units):
        ids = torch.tensor([bos, *vocab.encode(tokenize(unit, level)), eos], dtype=torch.int64)
        windows = chunk_sequence(ids, window_length)
        sequences.extend(windows)
        sources.extend([index] * len(windows))
    return sequences, sources


def stream_ids(stream: str | Sequence[str], vocab: Vocabulary) -> torch.Tensor:
    """A token stream's ids, ``(L,)`` int64."""
    if isinstance(stream, str):
        return vocab.encode_chars(stream)
    return torch.tensor(vocab.encode(stream), dtype=torch.int64)


def encode_stream(stream: str | Sequence[str], vocab: Vocabulary, window_length: int) -> list[torch.Tensor]:
    """A token stream's ids cut into windows of ``window_length`` ids (the last may be shorter)."""
    return chunk_sequence(stream_ids(stream, vocab), window_length)
