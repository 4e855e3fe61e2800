"""``seqnorm.LSTM`` in place of ``torch.nn.LSTM``: same arguments, outputs, state-dict keys; then add a norm.

1. ``seqnorm.LSTM.from_torch(module)`` copies a trained ``nn.LSTM``: with the default ``norm="none"`` it computes the
   same function (and runs torch's own fused kernel).
2. State dicts go both ways, key for key (``weight_ih_l0``, ``bias_hh_l1_reverse``, ...).
3. ``from_torch(module, norm="layer")`` keeps torch's weights and adds LayerNorm (at its initial values, to train),
   and the layer takes ``lengths`` for padded batches.

Run: ``python examples/drop_in_replacement.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import seqnorm


class Tagger(nn.Module):
    """An existing model written for ``torch.nn.LSTM``: embedding -> LSTM -> linear, batch first."""

    def __init__(self, vocab_size: int = 50, hidden_size: int = 32) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, 16)
        self.rnn = nn.LSTM(16, hidden_size, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * hidden_size, 5)

    def forward(self, tokens: Tensor, lengths: Tensor | None = None) -> Tensor:
        x = self.embedding(tokens)
        # torch.nn.LSTM takes no lengths (pack the batch instead); seqnorm's layers take both
        output, _ = self.rnn(x) if lengths is None else self.rnn(x, lengths=lengths)
        return self.head(output)


def main() -> None:
    torch.manual_seed(0)
    model = Tagger().eval()
    tokens = torch.randint(0, 50, (4, 12))  # (B, T)
    expected = model(tokens)

    # 1. the same model with seqnorm's layer: identical outputs
    torch_rnn = model.rnn
    model.rnn = seqnorm.LSTM.from_torch(torch_rnn)
    difference = (model(tokens) - expected).abs().max().item()
    print(f"from_torch: max |seqnorm - torch| = {difference:.2e}")

    # 2. state dicts load both ways, with torch's keys
    keys = list(model.rnn.state_dict())
    back = nn.LSTM(16, 32, num_layers=2, bidirectional=True, batch_first=True)
    back.load_state_dict(model.rnn.state_dict())
    fresh = seqnorm.LSTM(16, 32, num_layers=2, bidirectional=True, batch_first=True)
    fresh.load_state_dict(back.state_dict())
    print(f"state-dict keys equal to torch's: {keys == list(torch_rnn.state_dict())} ({len(keys)} keys)")
    model.rnn = fresh
    difference = (model(tokens) - expected).abs().max().item()
    print(f"round trip seqnorm -> torch -> seqnorm: max difference = {difference:.2e}")

    # 3. a normalized layer with the same weights, over a padded batch
    model.rnn = seqnorm.LSTM.from_torch(torch_rnn, norm="layer")
    lengths = torch.tensor([12, 9, 5, 12])
    logits = model(tokens, lengths)
    padded_rnn_output, _ = model.rnn(model.embedding(tokens), lengths=lengths)
    print(f"norm='layer': logits {tuple(logits.shape)}, {sum(p.numel() for p in model.rnn.parameters())} parameters")
    print(f"padded positions output zero: {bool((padded_rnn_output[2, 5:] == 0).all())}")


if __name__ == "__main__":
    main()
