"""A recurrent sequence classifier: embedding -> seqnorm LSTM/GRU -> pooling over real positions -> linear."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn

from seqnorm.models.rnn import embedded_rnn
from seqnorm.validation import check_rate

__all__ = ["Pooling", "RNNClassifier"]

Pooling = Literal["last", "mean", "max"]


class RNNClassifier(nn.Module):
    """Variable-length token sequences -> class logits.

    Args:
        vocab_size: number of token ids.
        num_classes: number of labels.
        embedding_dim, hidden_size, cell, num_layers, dropout, pad_index: as :class:`RNNLanguageModel`.
        bidirectional: run the top layer's features in both directions (pooled features double).
        pooling: ``"last"`` — the final state of each sequence at its real end (both directions' finals when
            bidirectional); ``"mean"`` / ``"max"`` — over the real positions only, padding excluded.
        **rnn_kwargs: ``norm``, ``init``, ... of :class:`~seqnorm.LSTM`.

    Inputs: ``inputs`` ``(B, T)``, ``lengths`` ``(B,)``. Output: logits ``(B, num_classes)``.
    """

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        embedding_dim: int = 64,
        hidden_size: int = 128,
        cell: str = "lstm",
        num_layers: int = 1,
        bidirectional: bool = False,
        pooling: Pooling = "last",
        dropout: float = 0.0,
        pad_index: int = 0,
        **rnn_kwargs: Any,
    ) -> None:
        super().__init__()
        if pooling not in ("last", "mean", "max"):
            raise ValueError(f"RNNClassifier: expected pooling to be 'last', 'mean' or 'max', got {pooling!r}")
        check_rate("RNNClassifier", "dropout", dropout)  # torch.nn.Dropout lets NaN through
        self.pooling = pooling
        self.embedding, self.rnn = embedded_rnn(
            vocab_size,
            embedding_dim,
            pad_index,
            cell,
            hidden_size,
            num_layers=num_layers,
            dropout=dropout,
            bidirectional=bidirectional,
            **rnn_kwargs,
        )
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(self.rnn.state_size * (2 if bidirectional else 1), num_classes)  # proj_size if set

    def forward(self, inputs: Tensor, lengths: Tensor) -> Tensor:
        """Class logits ``(B, num_classes)`` of token ids ``inputs`` ``(B, T)`` with real lengths ``lengths`` ``(B,)``:
        from each sequence's state at its last real step (``pooling="last"``) or the mean or max of its outputs
        over its real positions."""
        output, state = self.rnn(self.dropout(self.embedding(inputs)), lengths=lengths)  # output (B, T, D*H)
        if self.pooling == "last":
            h_n = state[0] if isinstance(state, tuple) else state  # (layers * D, B, H)
            directions = 2 if self.rnn.bidirectional else 1
            features = torch.cat(list(h_n[-directions:]), dim=1)  # (B, D*H): top layer, every direction
        else:
            real = torch.arange(output.shape[1], device=output.device) < lengths.to(output.device).unsqueeze(1)
            real = real.unsqueeze(2)  # (B, T, 1)
            if self.pooling == "mean":
                features = output.sum(1) / real.sum(1).to(output.dtype)  # padded outputs are zero
            else:
                features = output.masked_fill(~real, float("-inf")).amax(1)
        return self.head(self.dropout(features))
