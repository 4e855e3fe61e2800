"""A cell of your own in seqnorm's layers: IndRNN (Li et al. 2018), a diagonal recurrent weight and no dense ``W_hh``.

A new cell subclasses :class:`seqnorm.RecurrentCell` and defines its parameters (``build``), their initialization
(``reset_parameters``) and one time step (``step_unchecked(x, state, step, mask)``), taking its state where it enters
the recurrence through ``self.recurrent_input(h)`` and its recurrent weight as ``self.recurrent_weight()``, so that
the layers' recurrent dropout and DropConnect reach it; what every cell shares (argument checks, the zero state,
padding, zoneout, observers) comes from the base. A :class:`seqnorm.RecurrentLayer` with ``cell_class`` set
then runs it stacked, bidirectional, over ``lengths`` or a ``PackedSequence``, and one ``step()`` at a time, with
torch's state-dict keys. A cell that declares no fast form runs the layers' reference loop.

This script trains a two-layer bidirectional IndRNN with LayerNorm to say what fraction of each sequence's tokens
are 1s (lengths 3 to 10). Run: ``python examples/custom_cell.py`` (seconds on a CPU).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import seqnorm


class IndRNNCell(seqnorm.RecurrentCell):
    r"""Each unit recurs only on itself, through a weight vector rather than a matrix.

    .. math:: h' = \mathrm{relu}(N(W_{ih} x) + b_{ih} + w_{hh} \odot h + b_{hh})

    ``weight_ih`` ``(H, I)``, ``weight_hh`` ``(H,)``; ``N`` is the ``norm=`` of the registry on the ``H`` input
    features (the identity for ``"none"``).
    """

    def build(self, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        hidden = self.hidden_size
        self.weight_ih = nn.Parameter(torch.empty(hidden, self.input_size, device=device, dtype=dtype))
        self.weight_hh = nn.Parameter(torch.empty(hidden, device=device, dtype=dtype))
        self.bias_ih = nn.Parameter(torch.empty(hidden, device=device, dtype=dtype)) if self.bias else None
        self.bias_hh = nn.Parameter(torch.empty(hidden, device=device, dtype=dtype)) if self.bias else None
        self.norm_ih = self.build_norm(hidden, "input", device, dtype)

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.hidden_size)
        for parameter in (self.weight_ih, self.bias_ih, self.bias_hh):
            if parameter is not None:
                nn.init.uniform_(parameter, -bound, bound)
        nn.init.uniform_(self.weight_hh, 0.0, 1.0)  # |w| <= 1: no unit's state grows without bound
        super().reset_parameters()

    def step_unchecked(self, x: Tensor, state: Tensor, step: int, mask: Tensor | None) -> Tensor:
        h_prev = state
        term = F.linear(x, self.weight_ih)
        if self.norm_ih is not None:
            term = self.norm_ih(term, step, mask)  # the mask keeps padded rows out of batch statistics
        if self.bias_ih is not None:
            term = term + self.bias_ih + self.bias_hh
        # The layers' recurrent dropout and DropConnect reach the step here (the identity without them).
        recurrent = self.recurrent_weight() * self.recurrent_input(h_prev)
        return self.settle(torch.relu(term + recurrent), h_prev, mask, self.zoneout_h)


class IndRNN(seqnorm.RecurrentLayer):
    """Layers of :class:`IndRNNCell`, as ``seqnorm.LSTM`` is of ``LSTMCell``."""

    cell_class = IndRNNCell


def main() -> None:
    torch.manual_seed(0)
    layer = IndRNN(2, 16, num_layers=2, bidirectional=True, norm="layer")
    head = nn.Linear(2 * 16, 1)
    optimizer = torch.optim.Adam([*layer.parameters(), *head.parameters()], lr=1e-2)
    tokens, lengths = torch.randint(0, 2, (10, 64)), torch.randint(3, 11, (64,))
    real = torch.arange(10).unsqueeze(1) < lengths  # (T, B)
    target = ((tokens * real).sum(0) / lengths).unsqueeze(1)  # (B, 1)
    x = F.one_hot(tokens, 2).float()  # (T, B, 2); the padding is zeroed by the layer, as any padding
    print(f"parameters of one cell: {[(n, tuple(p.shape)) for n, p in layer.cells[0].named_parameters()]}")
    print(f"path: {layer.plan(x, lengths=lengths).path!r}")
    baseline = F.mse_loss(target.mean().expand_as(target), target).item()
    for update in range(151):
        optimizer.zero_grad()
        _, h_n = layer(x, lengths=lengths)
        loss = F.mse_loss(head(torch.cat([h_n[-2], h_n[-1]], dim=1)), target)
        loss.backward()
        optimizer.step()
        if update % 50 == 0:
            print(f"update {update}: loss {loss.item():.5f}")
    print(f"final loss / predicting the mean fraction ({baseline:.5f}): {loss.item() / baseline:.3f}")


if __name__ == "__main__":
    main()
