"""Vocabulary: fixed specials, deterministic build, limits, encode/decode, saving; the tokenizers."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from seqnorm.data import DataError, Vocabulary, detokenize, tokenize


def test_specials_have_fixed_ids() -> None:
    vocab = Vocabulary(["x"])
    assert vocab.tokens[:4] == ["<pad>", "<unk>", "<bos>", "<eos>"]
    assert (vocab.pad_index, vocab.unk_index, vocab.bos_index, vocab.eos_index) == (0, 1, 2, 3)
    assert vocab.encode(["x"]) == [4]


def test_classification_vocabulary_has_no_bos_eos() -> None:
    vocab = Vocabulary(["x"], bos_eos=False)
    assert vocab.tokens == ["<pad>", "<unk>", "x"]
    with pytest.raises(DataError, match="<bos>"):
        _ = vocab.bos_index


def test_build_orders_by_frequency_then_token() -> None:
    vocab = Vocabulary.build([["b", "a", "c", "b"], ["c", "d", "a", "b"]])
    # b:3, then a:2 and c:2 tied (alphabetical), then d:1
    assert vocab.tokens[4:] == ["b", "a", "c", "d"]
    # The same counts in another order give the same ids.
    assert Vocabulary.build([["d", "a", "b", "c"], ["b", "c", "a", "b"]]) == vocab


def test_build_skips_specials_found_in_text() -> None:
    vocab = Vocabulary.build([["<unk>", "x", "<unk>"]])
    assert len(vocab) == 5
    assert vocab.encode(["<unk>", "x"]) == [1, 4]


def test_min_freq_and_max_size() -> None:
    tokens = [["a"] * 5 + ["b"] * 3 + ["c"] * 2 + ["d"]]
    assert Vocabulary.build(tokens, min_freq=2).tokens[4:] == ["a", "b", "c"]
    limited = Vocabulary.build(tokens, max_size=6)
    assert len(limited) == 6 and limited.tokens[4:] == ["a", "b"]
    assert limited.encode(["c", "d"]) == [1, 1]
    with pytest.raises(DataError, match=r"--data\.max_vocab_size"):
        Vocabulary.build(tokens, max_size=4)
    with pytest.raises(DataError, match=r"--data\.min_freq"):
        Vocabulary.build(tokens, min_freq=0)


def test_encode_decode() -> None:
    vocab = Vocabulary.build(["hello"])
    ids = vocab.encode("hellz")
    assert ids[-1] == vocab.unk_index
    assert vocab.decode(ids) == ["h", "e", "l", "l", "<unk>"]
    assert vocab.decode(torch.tensor(ids)) == vocab.decode(ids)
    with pytest.raises(DataError, match="outside"):
        vocab.decode([len(vocab)])


def test_encode_chars_matches_encode() -> None:
    vocab = Vocabulary.build(["abc\n é"])
    text = "cab\nzé a"
    assert vocab.encode_chars(text).tolist() == vocab.encode(text)
    assert vocab.encode_chars(text).dtype == torch.int64


def test_to_dict_from_dict_round_trip_through_json() -> None:
    vocab = Vocabulary.build([["the", "cat", "the"]], bos_eos=False)
    restored = Vocabulary.from_dict(json.loads(json.dumps(vocab.to_dict())))
    assert restored == vocab
    assert restored.encode(["cat", "dog"]) == vocab.encode(["cat", "dog"])
    assert restored.bos_eos is False


@pytest.mark.parametrize(
    "state",
    [
        {},
        {"tokens": ["a", "<pad>"], "bos_eos": True},
        "nonsense",
        {"tokens": ["<pad>", "<unk>", "<bos>", "<eos>"], "bos_eos": False},  # the specials as ordinary tokens
        {"tokens": ["<pad>", "<unk>", "<bos>", "<eos>"], "bos_eos": "false"},  # bool("false") is True
    ],
)
def test_from_dict_rejects_bad_state(state: object) -> None:
    with pytest.raises(DataError):
        Vocabulary.from_dict(state)  # type: ignore[arg-type]


def test_tokenize_levels() -> None:
    assert tokenize("a b\n", "char") == ["a", " ", "b", "\n"]
    assert tokenize("  the  cat\tsat\n", "word") == ["the", "cat", "sat"]
    assert detokenize(["the", "cat"], "word") == "the cat"
    with pytest.raises(DataError, match=r"--data\.level"):
        tokenize("x", "byte")  # type: ignore[arg-type]


@given(st.text(max_size=200))
def test_char_tokens_round_trip(text: str) -> None:
    assert detokenize(tokenize(text, "char"), "char") == text
    vocab = Vocabulary.build([text])
    assert "".join(vocab.decode(vocab.encode(text))) == text


@given(st.lists(st.text(alphabet=st.characters(blacklist_categories=["Z", "C"]), min_size=1), max_size=30))
@example(["the", "<pad>", "<unk>", "<eos>"])  # Hypothesis draws these too: it mines string constants from the source
def test_word_tokens_round_trip(words: list[str]) -> None:
    text = " ".join(words)
    assert tokenize(text, "word") == words
    vocab = Vocabulary.build([words])
    # every word comes back but "<pad>", which is <unk>: text spelled like padding is not padding (the test below)
    assert vocab.decode(vocab.encode(words)) == ["<unk>" if word == "<pad>" else word for word in words]


def test_text_spelled_like_padding_is_not_padding() -> None:
    # id 0 is what losses ignore: a word "<pad>" in the text must stay a target (PTB's literal <unk> still maps)
    vocab = Vocabulary.build([["the", "<pad>", "key", "<unk>"]])
    assert vocab.encode(["the", "<pad>", "<unk>"]) == [vocab.index("the"), vocab.unk_index, vocab.unk_index]
    assert vocab.tokens[vocab.pad_index] == "<pad>" and "<pad>" in vocab


@pytest.mark.parametrize("tokens", [[5], [None], [["x"]], "abc"])
def test_saved_tokens_must_be_strings(tokens: object) -> None:
    with pytest.raises(DataError, match="expected its tokens to be a list of strings"):
        Vocabulary.from_dict(
            {
                "tokens": ["<pad>", "<unk>", "<bos>", "<eos>", *tokens] if isinstance(tokens, list) else tokens,
                "bos_eos": True,
            }
        )
