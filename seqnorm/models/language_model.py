"""A recurrent language model: embedding -> seqnorm LSTM/GRU -> projection to the vocabulary."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from seqnorm.layers import RecurrentState
from seqnorm.models.rnn import embedded_rnn
from seqnorm.validation import check_rate

__all__ = ["RNNLanguageModel"]


class RNNLanguageModel(nn.Module):
    """Next-token prediction over padded batches of variable-length sequences.

    Args:
        vocab_size: number of token ids (embedding rows and output classes).
        embedding_dim: size of the token embedding.
        hidden_size: recurrent state size.
        cell: ``"lstm"`` or ``"gru"``.
        num_layers: stacked recurrent layers.
        dropout: dropout on the embedding, between layers and before the projection.
        pad_index: the padding id (its embedding starts at zero and gets no gradient from the input side; with
            ``tie_weights`` the projection's gradient moves it, which changes no output: padded steps are masked).
        tie_weights: share the embedding with the output projection (needs ``embedding_dim`` equal to the RNN's
            output size: ``hidden_size``, or ``proj_size`` when ``rnn_kwargs`` set it).
        **rnn_kwargs: ``norm``, ``init``, ``max_steps``, ``recurrent_dropout``, ... of :class:`~seqnorm.LSTM`.

    Inputs: ``inputs`` ``(B, T)`` token ids and ``lengths`` ``(B,)``. Output: logits ``(B, T, vocab_size)``.
    :meth:`forward_with_state` also takes and returns the recurrent state (stateful truncated BPTT).
    """

    def __init__(
        self,
        vocab_size: int,
        embedding_dim: int = 64,
        hidden_size: int = 256,
        cell: str = "lstm",
        num_layers: int = 1,
        dropout: float = 0.0,
        pad_index: int = 0,
        tie_weights: bool = False,
        **rnn_kwargs: Any,
    ) -> None:
        super().__init__()
        check_rate("RNNLanguageModel", "dropout", dropout)  # torch.nn.Dropout lets NaN through
        self.embedding, self.rnn = embedded_rnn(
            vocab_size,
            embedding_dim,
            pad_index,
            cell,
            hidden_size,
            num_layers=num_layers,
            dropout=dropout,
            **rnn_kwargs,
        )
        output_size = self.rnn.state_size  # proj_size (in rnn_kwargs) when set, else hidden_size
        if tie_weights and embedding_dim != output_size:
            what = "proj_size" if output_size != hidden_size else "hidden_size"
            raise ValueError(
                f"RNNLanguageModel: expected embedding_dim == {what} with tie_weights, got {embedding_dim} and "
                f"{output_size}: set embedding_dim={output_size} or tie_weights=False"
            )
        self.dropout = nn.Dropout(dropout)
        self.projection = nn.Linear(output_size, vocab_size)
        if tie_weights:
            self.projection.weight = self.embedding.weight

    def forward(self, inputs: Tensor, lengths: Tensor | None = None) -> Tensor:
        """Next-token logits ``(B, T, vocab_size)`` of token ids ``inputs`` ``(B, T)``; ``lengths`` ``(B,)`` marks
        padding (``None``: none), from a zero state (:meth:`forward_with_state` carries one)."""
        return self.forward_with_state(inputs, lengths)[0]

    def forward_with_state(
        self, inputs: Tensor, lengths: Tensor | None = None, state: Any = None, *, first_step: int = 0
    ) -> tuple[Tensor, Any]:
        """Logits ``(B, T, vocab_size)`` and the recurrent layer's final state, starting from ``state``.

        Args:
            inputs: ``(B, T)`` token ids.
            lengths: ``(B,)`` real lengths, or ``None`` (no padding).
            state: what a previous call returned (``(h, c)`` for LSTMs, ``h`` for GRUs, each
                ``(num_layers, B, H)``), or ``None`` for zeros. Detach it to truncate backpropagation there.
            first_step: the time index of ``inputs``' first step for per-timestep norms
                (:meth:`seqnorm.LSTM.forward`).
        """
        embedded = self.dropout(self.embedding(inputs))  # (B, T, E)
        offset = {"first_step": first_step} if first_step else {}  # only seqnorm's layers take it
        output, state = self.rnn(embedded, state, lengths=lengths, **offset)  # (B, T, H), zero at padding
        return self.projection(self.dropout(output)), state  # (B, T, V)

    @torch.no_grad()
    def step(self, tokens: Tensor, state: RecurrentState | None = None) -> tuple[Tensor, RecurrentState]:
        """Logits ``(B, vocab_size)`` for the next token after ``tokens`` ``(B,)``, and the new state."""
        output, state = self.rnn.step(self.embedding(tokens), state)
        return self.projection(output), state
