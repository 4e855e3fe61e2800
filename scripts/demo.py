"""A short tour of seqnorm's cells on an embedded task (no data files, no network).

Trains a small LSTM with each normalization to recall the first symbol of a sequence (a task that needs memory),
at batch size 32 and at batch size 1 with the same number of training sequences, and prints a table. Per-timestep
batch norm cannot train at batch size 1: its row shows the error it raises instead of a number.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import seqnorm

SYMBOLS = 4
STEPS = 10


def sample(batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    symbols = torch.randint(0, SYMBOLS, (batch, STEPS), generator=generator)
    return F.one_hot(symbols, SYMBOLS).float(), symbols[:, 0]


def train(norm: str, batch_size: int, sequences: int, seed: int = 0) -> tuple[str, float]:
    """Train on ``sequences`` sequences in batches of ``batch_size``; returns (status, held-out accuracy)."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    lstm = seqnorm.LSTM(SYMBOLS, 32, norm=norm, batch_first=True, init="orthogonal" if norm == "none" else "default")
    head = torch.nn.Linear(32, SYMBOLS)
    optimizer = torch.optim.Adam([*lstm.parameters(), *head.parameters()], lr=1e-2 if batch_size == 1 else 3e-2)
    try:
        for _ in range(sequences // batch_size):
            x, target = sample(batch_size, generator)
            loss = F.cross_entropy(head(lstm(x)[0][:, -1]), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    except ValueError as error:
        return f"ValueError: {error}", float("nan")
    lstm.eval()
    x, target = sample(2048, generator)
    with torch.no_grad():
        accuracy = (head(lstm(x)[0][:, -1]).argmax(1) == target).float().mean().item()
    return "ok", accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sequences", type=int, default=800, help="training sequences per run")
    args = parser.parse_args()
    print(f"Recall the first of {STEPS} symbols ({SYMBOLS} classes, chance 0.25); {args.sequences} training sequences")
    print(f"{'norm':<14}{'batch':>6}  {'accuracy':>8}  {'seconds':>7}  status")
    errors = set()
    for norm in seqnorm.NORMS:
        for batch_size in (32, 1):
            start = time.perf_counter()
            status, accuracy = train(norm, batch_size, args.sequences)
            if status != "ok":
                errors.add(status)
                status = "error (below)"
            print(f"{norm:<14}{batch_size:>6}  {accuracy:>8.3f}  {time.perf_counter() - start:>7.1f}  {status}")
    for message in sorted(errors):
        print(f"\n{message}")


if __name__ == "__main__":
    main()
