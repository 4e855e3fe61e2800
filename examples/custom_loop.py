"""A normalized cell in your own training loop: per-timestep BatchNorm over variable-length sequences.

The task (synthesized here): read a sequence of +1/-1 values of length 5 to 20 and say whether its sum is positive.
The loop runs a :class:`seqnorm.LSTMCell` one step at a time, as you would for a custom recurrence:

- ``step=t`` tells the cell the time index. ``norm="batch"`` keeps statistics per time step, so the cell refuses a
  call without it (other norms ignore ``step``);
- ``mask`` marks the rows that are still running at step ``t``: padded rows enter no batch statistics and keep their
  state, so after the loop each row holds its state at its own last step.

Run: ``python examples/custom_loop.py`` (a few seconds on a CPU).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import seqnorm

HIDDEN = 32
STEPS = 200
BATCH = 64


def make_batch(batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Padded inputs ``(T, B, 1)``, their lengths ``(B,)`` and the labels ``(B,)`` (1: the sum is positive)."""
    lengths = torch.randint(5, 21, (batch_size,), generator=generator)
    lengths[lengths % 2 == 0] += 1  # odd lengths: a sum of ±1 values is never 0
    values = torch.randint(0, 2, (int(lengths.max()), batch_size), generator=generator).float() * 2 - 1
    real = torch.arange(values.shape[0]).unsqueeze(1) < lengths  # (T, B)
    values = values * real  # zeros at padded positions
    return values.unsqueeze(2), lengths, (values.sum(0) > 0).long()


class SumSign(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = seqnorm.LSTMCell(1, HIDDEN, norm="batch")
        self.head = nn.Linear(HIDDEN, 2)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        state = None
        for t, x_t in enumerate(x.unbind(0)):  # x: (T, B, 1)
            state = self.cell(x_t, state, step=t, mask=t < lengths)
        h_last, _ = state  # each sequence's state at its last real step
        return self.head(h_last)


def main() -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model = SumSign()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    test_x, test_lengths, test_y = make_batch(512, generator)

    try:
        model.cell(test_x[0])  # no step: a per-timestep norm cannot know which statistics to use
    except ValueError as error:
        print(f"without step=: {error}")

    for update in range(STEPS + 1):
        x, lengths, y = make_batch(BATCH, generator)
        loss = nn.functional.cross_entropy(model(x, lengths), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if update in (0, STEPS):
            print(f"update {update}: train loss {loss.item():.3f}")

    model.eval()  # evaluation uses each step's running statistics
    with torch.no_grad():
        accuracy = (model(test_x, test_lengths).argmax(1) == test_y).float().mean().item()
    print(f"test accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
