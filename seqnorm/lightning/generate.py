"""Sampling text from a trained language model, one token at a time at batch size 1.

It lives beside the LightningModules because it joins the model with the vocabulary saved in a checkpoint.
"""

from __future__ import annotations

import math
import warnings

import torch

from seqnorm.data.units import STREAM_UNITS
from seqnorm.data.vocab import Vocabulary, tokenize
from seqnorm.layers import RecurrentState
from seqnorm.models import RNNLanguageModel

__all__ = ["SAMPLING_MINIMUMS", "generate_text", "sampling_out_of_range"]


SAMPLING_MINIMUMS = {"length": 0, "temperature": 0, "top_k": 1}
"""The smallest value of each sampling argument (``top_k`` may also be ``None``: no limit)."""


def sampling_out_of_range(length: int, temperature: float, top_k: int | None) -> tuple[str, object] | None:
    """The first sampling argument below its :data:`SAMPLING_MINIMUMS`, with its value, or ``None``; both
    :func:`generate_text` and ``seqnorm generate`` (which names flags, before reading the checkpoint) ask."""
    for name, value in (("length", length), ("temperature", temperature), ("top_k", top_k)):
        # `not <=`: NaN passes every comparison; inf is refused too (inf / inf is NaN where a token is banned)
        if value is not None and not SAMPLING_MINIMUMS[name] <= value < math.inf:
            return name, value
    return None


@torch.no_grad()
def generate_text(
    model: RNNLanguageModel,
    vocab: Vocabulary,
    *,
    level: str,
    unit: str = "line",
    prompt: str = "",
    length: int = 200,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    window_steps: int | None = None,
) -> str:
    """Continue ``prompt`` by ``length`` sampled tokens, using the model's stepping interface (batch size 1).

    Each token is fed as the model saw it in training:

    - natural units (``line``, ``paragraph``, ``sentence``): each unit was ``<bos>`` + tokens + ``<eos>`` from a
      zero state, so generation starts from ``<bos>``, and a sampled ``<eos>`` is written as a newline and followed
      by ``<bos>`` from a fresh state (time index 0 again);
    - token streams (``window``, ``stream``: :func:`~seqnorm.data.units.token_stream`): no ``<bos>`` ever. At
      character level a newline is a character like any other and ``<eos>`` never occurs; at word level each line
      ends with ``<eos>``, which is written as a newline and fed on. An empty prompt starts after a line break
      (``"\n"``, or ``<eos>`` for words), where the stream's lines begin.

    ``temperature=0`` is greedy decoding; ``top_k`` keeps only the ``k`` most likely tokens. ``window_steps``: for a
    stream model trained with the time index restarting in every window (``stream_steps="restart"``), the steps per
    window (``window_length - 1``): the state is carried on, but the index per-timestep statistics are read at
    restarts every ``window_steps`` tokens, as in training and evaluation; ``None``: it counts on. Returns the
    generated continuation only.
    """
    wrong = sampling_out_of_range(length, temperature, top_k)
    if wrong is not None:
        name, value = wrong
        what = "a finite number" if name == "temperature" else "an int"
        raise ValueError(f"generate_text: expected {name} to be {what} >= {SAMPLING_MINIMUMS[name]}, got {value}")
    if window_steps is not None and (
        isinstance(window_steps, bool) or not isinstance(window_steps, int) or window_steps < 1
    ):
        raise ValueError(f"generate_text: expected window_steps to be a positive int or None, got {window_steps!r}")
    model.eval()
    device = model.projection.weight.device
    natural_units = unit not in STREAM_UNITS
    banned = [vocab.pad_index, vocab.unk_index] + ([vocab.bos_index] if vocab.bos_eos else [])
    if not natural_units and level == "char" and vocab.bos_eos:
        banned.append(vocab.eos_index)  # a character stream has no <eos>: its line breaks are "\n"
    # What follows a sampled <eos>: the next unit's <bos>, or in a word stream the <eos> itself.
    after_eos = vocab.bos_index if natural_units else vocab.eos_index

    def feed(token: int, state: RecurrentState | None) -> tuple[torch.Tensor, RecurrentState]:
        if window_steps and state is not None and state.step >= window_steps:
            state = state._replace(step=0)  # the next window, as training and evaluation numbered its steps
        return model.step(torch.tensor([token], device=device), state)

    start = [vocab.bos_index] if natural_units else []
    prompt_tokens = tokenize(prompt, level)  # type: ignore[arg-type]
    prompt_ids = vocab.encode(prompt_tokens)
    unknown = sorted({token for token in prompt_tokens if token not in vocab})
    if unknown:  # they were turned into <unk> in silence
        what = "characters" if level == "char" else "words"
        shown = ", ".join(repr(token) for token in unknown[:10]) + (", ..." if len(unknown) > 10 else "")
        warnings.warn(
            f"generate_text: the prompt's {what} {shown} are not in the model's vocabulary and are fed as <unk>",
            stacklevel=3,  # the caller's line, past torch.no_grad's wrapper
        )
    if not natural_units and not prompt_ids:
        line_break = vocab.eos_index if level == "word" else vocab.encode(["\n"])[0]
        if line_break == vocab.unk_index:
            raise ValueError(
                f"generate_text: expected a non-empty prompt for a model trained on unit={unit!r} (its text has no "
                "line break to start after), got ''"
            )
        start = [line_break]
    state: RecurrentState | None = None
    for token in [*start, *prompt_ids]:
        logits, state = feed(token, state)
    pieces: list[str] = []
    for _ in range(length):
        scores = logits[0].float()
        scores[banned] = float("-inf")
        if temperature == 0:
            token = int(scores.argmax())
        else:
            # shifted by the best score first: a tiny temperature (1e-39) would make it inf, and inf - inf NaN
            scores = (scores - scores.max()) / temperature
            if top_k is not None and top_k < scores.numel():
                threshold = scores.topk(top_k).values[-1]
                scores = scores.masked_fill(scores < threshold, float("-inf"))
            token = int(torch.multinomial(scores.softmax(0), 1, generator=generator))
        if vocab.bos_eos and token == vocab.eos_index:
            pieces.append("\n")
            # a natural unit ends: the next one starts from a zero state; a word stream feeds <eos> on
            logits, state = feed(after_eos, None if natural_units else state)
            continue
        pieces.append(vocab.decode([token])[0])
        logits, state = feed(token, state)
    if level == "char":
        return "".join(pieces)
    # Words joined by spaces within a line, none around a line break (two breaks in a row: an empty line).
    text = ""
    for piece in pieces:
        text += piece if piece == "\n" or not text or text.endswith("\n") else " " + piece
    return text
