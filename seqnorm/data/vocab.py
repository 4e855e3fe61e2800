"""Token vocabularies and the two tokenizers (characters, whitespace-separated words).

A :class:`Vocabulary` maps token strings to contiguous integer ids. The special tokens come first and have fixed
ids, so that a model built for one vocabulary can rely on them without being told:

======= == ==============================================================
token   id meaning
======= == ==============================================================
<pad>   0  padding; batches are padded with it and losses ignore it
<unk>   1  any token that is not in the vocabulary
<bos>   2  start of a unit (language modelling only)
<eos>   3  end of a unit, e.g. the newline after a line (language modelling only)
======= == ==============================================================

Classification vocabularies leave out ``<bos>``/``<eos>`` (``bos_eos=False``) but keep ``<pad>=0`` and ``<unk>=1``.
A text token spelled exactly like a special (PTB's literal ``<unk>``) maps to that special, except ``<pad>``, which
maps to ``<unk>``: only padding has id 0, which losses ignore.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import torch

from seqnorm.data.errors import DataError

__all__ = ["BOS", "EOS", "PAD", "UNK", "Level", "Vocabulary", "detokenize", "tokenize"]

PAD = "<pad>"
UNK = "<unk>"
BOS = "<bos>"
EOS = "<eos>"

Level = Literal["char", "word"]
_LEVELS = ("char", "word")


def _check_level(level: str) -> None:
    if level not in _LEVELS:
        raise DataError(f"unknown tokenization level {level!r}: pass --data.level char or --data.level word")


def tokenize(text: str, level: Level) -> list[str]:
    """Split ``text`` into tokens.

    Args:
        text: the text.
        level: ``"char"`` gives one token per character (spaces and newlines included); ``"word"`` splits on runs of
            whitespace (no empty tokens).

    Returns:
        The tokens, in order.
    """
    _check_level(level)
    return list(text) if level == "char" else text.split()


def detokenize(tokens: Iterable[str], level: Level) -> str:
    """Join tokens back into text: characters are concatenated, words are joined with single spaces."""
    _check_level(level)
    return ("" if level == "char" else " ").join(tokens)


class Vocabulary:
    """A mapping between token strings and integer ids with fixed special ids.

    Args:
        tokens: the ordinary tokens, in id order; they get ids after the specials. Duplicates and specials are
            skipped.
        bos_eos: include ``<bos>``/``<eos>`` (language modelling). Classification vocabularies pass ``False``.

    Example:
        >>> vocab = Vocabulary.build([["a", "b", "a"], ["c"]])
        >>> vocab.encode(["a", "z"])
        [4, 1]
        >>> vocab.decode([4, 6])
        ['a', 'c']
    """

    pad_index = 0
    unk_index = 1

    def __init__(self, tokens: Iterable[str] = (), *, bos_eos: bool = True) -> None:
        self.bos_eos = bos_eos
        self._itos: list[str] = [PAD, UNK, BOS, EOS] if bos_eos else [PAD, UNK]
        self._stoi: dict[str, int] = {token: index for index, token in enumerate(self._itos)}
        for token in tokens:
            if token not in self._stoi:
                self._stoi[token] = len(self._itos)
                self._itos.append(token)
        # Text spelled "<pad>" is a token, not padding: only padding has id 0, which losses ignore.
        self._stoi[PAD] = self.unk_index

    @classmethod
    def build(
        cls,
        token_lists: Iterable[Iterable[str]],
        min_freq: int = 1,
        max_size: int | None = None,
        *,
        bos_eos: bool = True,
    ) -> Vocabulary:
        """Count tokens (of the training split only) and keep the frequent ones.

        Tokens are ordered by frequency, most frequent first, ties broken by the token string, so the same data
        always gives the same ids.

        Args:
            token_lists: an iterable of token sequences; a ``str`` counts as its characters.
            min_freq: tokens seen fewer times than this map to ``<unk>``.
            max_size: the largest vocabulary size, specials included; ``None`` for no limit.
            bos_eos: include ``<bos>``/``<eos>``.
        """
        counts: Counter[str] = Counter()
        for tokens in token_lists:
            counts.update(tokens)
        return cls.from_counts(counts, min_freq=min_freq, max_size=max_size, bos_eos=bos_eos)

    @classmethod
    def from_counts(
        cls,
        counts: Mapping[str, int],
        min_freq: int = 1,
        max_size: int | None = None,
        *,
        bos_eos: bool = True,
    ) -> Vocabulary:
        """Like :meth:`build`, from precomputed token counts."""
        if min_freq < 1:
            raise DataError(f"--data.min_freq must be at least 1, got {min_freq}")
        num_specials = 4 if bos_eos else 2
        if max_size is not None and max_size <= num_specials:
            raise DataError(
                f"--data.max_vocab_size must exceed the {num_specials} special tokens, got {max_size}: "
                "raise it or pass null for no limit"
            )
        specials = {PAD, UNK, BOS, EOS}
        kept = sorted(
            ((token, count) for token, count in counts.items() if count >= min_freq and token not in specials),
            key=lambda item: (-item[1], item[0]),
        )
        if max_size is not None:
            kept = kept[: max_size - num_specials]
        return cls((token for token, _ in kept), bos_eos=bos_eos)

    @property
    def bos_index(self) -> int:
        """Id of ``<bos>``; a :class:`DataError` for vocabularies built with ``bos_eos=False``."""
        return self._special_index(BOS)

    @property
    def eos_index(self) -> int:
        """Id of ``<eos>``; a :class:`DataError` for vocabularies built with ``bos_eos=False``."""
        return self._special_index(EOS)

    def _special_index(self, token: str) -> int:
        if not self.bos_eos:
            raise DataError(f"this vocabulary was built without {token} (a classification vocabulary)")
        return self._stoi[token]

    @property
    def tokens(self) -> list[str]:
        """All tokens in id order, specials first (a copy)."""
        return list(self._itos)

    def __len__(self) -> int:
        return len(self._itos)

    def __contains__(self, token: object) -> bool:
        return token in self._stoi

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Vocabulary):
            return NotImplemented
        return self._itos == other._itos and self.bos_eos == other.bos_eos

    def __hash__(self) -> int:
        return hash((tuple(self._itos), self.bos_eos))

    def __repr__(self) -> str:
        return f"Vocabulary(size={len(self)}, bos_eos={self.bos_eos})"

    def index(self, token: str) -> int:
        """Id of one token (``unk_index`` if unknown)."""
        return self._stoi.get(token, self.unk_index)

    def encode(self, tokens: Iterable[str]) -> list[int]:
        """Ids of ``tokens``; unknown tokens become ``unk_index``. A ``str`` is encoded character by character."""
        get, unk = self._stoi.get, self.unk_index
        return [get(token, unk) for token in tokens]

    def encode_chars(self, text: str) -> torch.Tensor:
        """Ids of every character of ``text`` as an int64 tensor; fast for long texts (text8 has 10^8 characters).

        Works on the distinct code points only, so the Python-level work is per distinct character, not per
        character.
        """
        import numpy as np

        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        distinct, inverse = np.unique(codes, return_inverse=True)
        table = np.array([self.index(chr(code)) for code in distinct.tolist()], dtype=np.int64)
        return torch.from_numpy(table[inverse.reshape(-1)])

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Tokens of ``ids`` (a list or a 1-D tensor); ids outside the vocabulary are a :class:`DataError`."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        tokens = []
        for index in ids:
            if not 0 <= index < len(self._itos):
                raise DataError(f"token id {index} is outside this vocabulary of size {len(self._itos)}")
            tokens.append(self._itos[index])
        return tokens

    def to_dict(self) -> dict[str, Any]:
        """A plain JSON-able description (stored in Lightning checkpoints by the DataModules)."""
        return {"tokens": list(self._itos), "bos_eos": self.bos_eos}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> Vocabulary:
        """Rebuild a vocabulary saved by :meth:`to_dict`; the ids come out identical."""
        try:
            tokens: Sequence[str] = state["tokens"]
            bos_eos = state["bos_eos"]
        except (KeyError, TypeError) as error:
            raise DataError(f"not a saved Vocabulary (expected keys 'tokens' and 'bos_eos'): {error!r}") from error
        if not isinstance(bos_eos, bool):  # bool("false") is True
            raise DataError(f"saved Vocabulary is corrupt: expected bos_eos to be true or false, got {bos_eos!r}")
        if not isinstance(tokens, list | tuple) or not all(isinstance(token, str) for token in tokens):
            odd = (
                type(tokens).__name__
                if not isinstance(tokens, list | tuple)
                else next(repr(token) for token in tokens if not isinstance(token, str))
            )
            raise DataError(f"saved Vocabulary is corrupt: expected its tokens to be a list of strings, got {odd}")
        vocab = cls(tokens, bos_eos=bos_eos)
        specials = {BOS, EOS} if not bos_eos else set()  # a vocabulary without them never holds them as tokens
        if vocab._itos != list(tokens) or specials & set(tokens):
            raise DataError("saved Vocabulary is corrupt: its specials are not first or its tokens repeat")
        return vocab
