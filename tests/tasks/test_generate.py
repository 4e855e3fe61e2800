"""``generate_text`` feeds each token as the model saw it in training: ``<bos>``/``<eos>`` for natural units, the
stream's own line breaks for ``window``/``stream`` units (which never contained ``<bos>``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from seqnorm.data.vocab import BOS, EOS, Vocabulary
from seqnorm.layers import RecurrentState
from seqnorm.lightning.generate import generate_text


class Scripted(nn.Module):
    """A language model stand-in that records the tokens it is fed and always prefers ``favourite``."""

    def __init__(self, vocab_size: int, favourite: int) -> None:
        super().__init__()
        self.projection = nn.Linear(1, vocab_size)
        self.favourite = favourite
        self.fed: list[int] = []

    def step(self, token: torch.Tensor, state: object) -> tuple[torch.Tensor, object]:
        self.fed.append(int(token))
        logits = torch.zeros(1, self.projection.out_features)
        logits[0, self.favourite] = 10.0
        return logits, state


def _run(vocab: Vocabulary, favourite: str, **kwargs: object) -> tuple[str, list[str]]:
    model = Scripted(len(vocab), vocab.encode([favourite])[0])
    text = generate_text(model, vocab, length=3, temperature=0, **kwargs)  # type: ignore[arg-type]
    return text, vocab.decode(model.fed)


def test_natural_units_start_from_bos_and_restart_after_eos() -> None:
    vocab = Vocabulary(["a", "b", "\n"])
    assert _run(vocab, EOS, level="char", unit="line") == ("\n\n\n", [BOS, BOS, BOS, BOS])
    assert _run(vocab, "a", level="char", unit="line", prompt="b") == ("aaa", [BOS, "b", "a", "a", "a"])


@pytest.mark.parametrize("unit", ["stream", "window"])
def test_character_streams_never_see_bos_or_eos(unit: str) -> None:
    vocab = Vocabulary(["a", "b", "\n"])
    # an empty prompt starts after a line break; <eos> (never a target in a character stream) is not sampled
    text, fed = _run(vocab, EOS, level="char", unit=unit)
    assert BOS not in fed and EOS not in fed and fed[0] == "\n"
    assert EOS not in text
    assert _run(vocab, "a", level="char", unit=unit, prompt="ab") == ("aaa", ["a", "b", "a", "a", "a"])
    with pytest.raises(ValueError, match=r"expected a non-empty prompt for a model trained on unit="):
        _run(Vocabulary(["a", "b"]), "a", level="char", unit=unit)  # no line break to start after


@pytest.mark.parametrize("unit", ["stream", "window"])
def test_word_streams_feed_eos_as_their_line_break(unit: str) -> None:
    vocab = Vocabulary(["the", "cat"])
    assert _run(vocab, EOS, level="word", unit=unit) == ("\n\n\n", [EOS, EOS, EOS, EOS])
    assert _run(vocab, "cat", level="word", unit=unit, prompt="the") == ("cat cat cat", ["the", "cat", "cat", "cat"])


def test_words_are_joined_by_spaces_within_lines_only() -> None:
    vocab = Vocabulary(["the", "cat"])
    model = Scripted(len(vocab), 0)
    script = iter(["the", EOS, EOS, "cat", "the"])

    def step(token: torch.Tensor, state: object) -> tuple[torch.Tensor, object]:
        logits = torch.full((1, len(vocab)), -10.0)
        logits[0, vocab.encode([next(script, "the")])[0]] = 10.0
        return logits, state

    model.step = step  # type: ignore[method-assign]
    text = generate_text(model, vocab, level="word", unit="stream", prompt="cat", length=5, temperature=0)  # type: ignore[arg-type]
    assert text == "the\n\ncat the"  # was "the\n\n cat the"


@pytest.mark.parametrize("temperature", [1e-39, 1e-45])
def test_a_tiny_temperature_samples_like_greedy_decoding(temperature: float) -> None:
    # scores / 1e-39 overflowed to inf, and softmax of inf - inf is NaN: multinomial raised
    vocab = Vocabulary(["a", "b", "\n"])
    model = Scripted(len(vocab), vocab.encode(["b"])[0])
    text = generate_text(model, vocab, level="char", unit="line", length=4, temperature=temperature, top_k=2)  # type: ignore[arg-type]
    assert text == "bbbb"


class Counting(Scripted):
    """A stand-in that also records the time index of the state each token is fed with (``None``: a fresh state)."""

    def __init__(self, vocab_size: int, favourite: int) -> None:
        super().__init__(vocab_size, favourite)
        self.steps: list[int | None] = []

    def step(self, token: torch.Tensor, state: RecurrentState | None) -> tuple[torch.Tensor, RecurrentState]:
        self.steps.append(None if state is None else state.step)
        logits, _ = super().step(token, state)
        return logits, RecurrentState(torch.zeros(1), None, 1 if state is None else state.step + 1)


def test_each_natural_unit_starts_from_a_fresh_state() -> None:
    # training ran every line from a zero state at step 0; <bos> after a sampled <eos> was fed on the carried state
    vocab = Vocabulary(["a", "\n"])
    model = Counting(len(vocab), vocab.encode([EOS])[0])
    generate_text(model, vocab, level="char", unit="line", length=3, temperature=0)  # type: ignore[arg-type]
    assert vocab.decode(model.fed) == [BOS, BOS, BOS, BOS] and model.steps == [None, None, None, None]


def test_a_stream_window_restarts_its_time_index_as_training_did() -> None:
    vocab = Vocabulary(["a", "\n"])
    model = Counting(len(vocab), vocab.encode(["a"])[0])
    generate_text(model, vocab, level="char", unit="stream", prompt="a", length=6, temperature=0, window_steps=3)  # type: ignore[arg-type]
    assert model.steps == [None, 1, 2, 0, 1, 2, 0]  # the state carried on, the index restarted every 3 tokens
    model = Counting(len(vocab), vocab.encode(["a"])[0])
    generate_text(model, vocab, level="char", unit="stream", prompt="a", length=6, temperature=0)  # type: ignore[arg-type]
    assert model.steps == [None, 1, 2, 3, 4, 5, 6]  # without window_steps: it counts on


def test_an_unknown_prompt_token_is_said_at_the_callers_line() -> None:
    # it was said at torch.no_grad's wrapper (torch/utils/_contextlib.py), a line of torch's own
    with pytest.warns(UserWarning, match=r"the prompt's characters 'z' are not in the model's vocabulary") as said:
        _run(Vocabulary(["a", "\n"]), "a", level="char", unit="line", prompt="az")
    assert said[0].filename == __file__
