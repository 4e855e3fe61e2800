"""Sampling text from a trained language model, one token at a time at batch size 1.

It lives beside the LightningModules because it joins the model with the vocabulary saved in a checkpoint.
"""

from __future__ import annotations

import torch

from seqnorm.data.vocab import Vocabulary, tokenize
from seqnorm.models import RNNLanguageModel

__all__ = ["generate_text"]


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
) -> str:
    """Continue ``prompt`` by ``length`` sampled tokens, using the model's stepping interface (batch size 1).

    Models trained on natural units (``unit`` other than ``"window"``) start from ``<bos>``; sampling ``<eos>``
    ends a unit: it is written as a newline and the next unit starts from ``<bos>``. ``temperature=0`` is greedy
    decoding; ``top_k`` keeps only the ``k`` most likely tokens. Returns the generated continuation only.
    """
    if length < 0:
        raise ValueError(f"generate_text: expected length >= 0, got {length}")
    if temperature < 0:
        raise ValueError(f"generate_text: expected temperature >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"generate_text: expected top_k >= 1, got {top_k}")
    model.eval()
    device = model.projection.weight.device
    natural_units = unit != "window"
    banned = [vocab.pad_index, vocab.unk_index] + ([vocab.bos_index] if vocab.bos_eos else [])
    if not natural_units and vocab.bos_eos:
        banned.append(vocab.eos_index)  # windows never end

    def feed(token: int, state: object) -> tuple[torch.Tensor, object]:
        return model.step(torch.tensor([token], device=device), state)  # type: ignore[arg-type]

    state = None
    logits = None
    if natural_units:
        logits, state = feed(vocab.bos_index, state)
    for token in vocab.encode(tokenize(prompt, level)):  # type: ignore[arg-type]
        logits, state = feed(token, state)
    if logits is None:
        raise ValueError("generate_text: expected a non-empty prompt for a model trained on windows, got ''")
    pieces: list[str] = []
    for _ in range(length):
        scores = logits[0].float()
        scores[banned] = float("-inf")
        if temperature == 0:
            token = int(scores.argmax())
        else:
            scores = scores / temperature
            if top_k is not None and top_k < scores.numel():
                threshold = scores.topk(top_k).values[-1]
                scores = scores.masked_fill(scores < threshold, float("-inf"))
            token = int(torch.multinomial(scores.softmax(0), 1, generator=generator))
        if natural_units and token == vocab.eos_index:
            pieces.append("\n")
            logits, state = feed(vocab.bos_index, state)
            continue
        pieces.append(vocab.decode([token])[0])
        logits, state = feed(token, state)
    if level == "char":
        return "".join(pieces)
    return " ".join(pieces).replace(" \n ", "\n").replace(" \n", "\n")
