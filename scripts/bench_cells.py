"""A normalized cell in the user's own loop (issue 31 item 5): seqnorm's cells against torch's and a hand-written one.

The third way seqnorm is used: ``seqnorm.LSTMCell(..., norm=...)`` called step by step in a Python loop the user
writes, with ``step=t`` and ``mask=t < lengths`` (README, "A normalized cell in your own loop";
``examples/custom_loop.py``). What is timed, per variant, is a training step as such a loop runs it: ``--steps``
masked steps over a batch of ``--batch`` variable-length rows (lengths drawn once between ``steps // 2`` and
``steps``, one row the full length), then ``h.sum()`` backward. A row past its length keeps its state, as seqnorm's
``mask`` does; torch's cells and the hand-written ones do the same with ``torch.where``, the usual idiom.

Variants, for the LSTM and the GRU:

- ``torch``: ``torch.nn.LSTMCell`` / ``GRUCell`` (no norm; the floor);
- ``hand LN``: the same math as seqnorm's LayerNorm cell written plainly in PyTorch ops, as a user would write it:
  ``F.layer_norm`` on the input and recurrent terms (and, for the LSTM, the cell state on its way to ``tanh``),
  ``torch.sigmoid``/``tanh``;
- ``seqnorm LN``: ``norm="layer"``;
- ``seqnorm BN``: ``norm="batch"`` (per-timestep statistics, Cooijmans et al.), in training mode.

Every variant runs the same inputs, interleaved round by round (``--repeats`` rounds after ``--warmup``), one thread
unless ``--threads`` says otherwise; the table gives the median ms per training step (forward + backward), the
median of the forward alone (without gradients, still in training mode) in µs per time step, and the ratios the
issue's targets read: BN / LN (target ≤ 2) and LN / hand-written LN (target ≤ 1.3). ``--clock cpu`` times this
thread's CPU time instead of the wall clock: on a machine shared with other jobs the wall clock counts the time the
process waits descheduled, which varied the ratios by a third between runs (BENCHMARKS.md, issue 31).

Usage: ``python scripts/bench_cells.py`` (``--cells lstm``, ``--repeats 200``, ``--clock cpu``; ``--quick``: a few
rounds). Run from the repository root with ``scripts`` importable (it reads ``bench.cpu_name``), as the other scripts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from datetime import date

import torch
import torch.nn.functional as F
from bench import cpu_name
from torch import Tensor, nn

import seqnorm

Loop = Callable[[Tensor, Tensor], Tensor]  # (x (T, B, I), lengths (B,)) -> the last h (B, H)


class HandLNLSTMCell(nn.Module):
    """seqnorm's ``LSTMCell(norm="layer")`` written plainly: LN on ``W_ih x``, ``W_hh h`` and ``c'`` toward ``tanh``."""

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        gates = 4 * hidden_size
        self.weight_ih = nn.Parameter(torch.randn(gates, input_size) / hidden_size**0.5)
        self.weight_hh = nn.Parameter(torch.randn(gates, hidden_size) / hidden_size**0.5)
        self.bias = nn.Parameter(torch.zeros(gates))
        self.gamma_ih = nn.Parameter(torch.ones(gates))
        self.gamma_hh = nn.Parameter(torch.ones(gates))
        self.gamma_c = nn.Parameter(torch.ones(hidden_size))
        self.beta_c = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: Tensor, state: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        h, c = state
        gates = (
            F.layer_norm(x @ self.weight_ih.t(), self.gamma_ih.shape, self.gamma_ih)
            + F.layer_norm(h @ self.weight_hh.t(), self.gamma_hh.shape, self.gamma_hh)
            + self.bias
        )
        i, f, g, o = gates.chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(F.layer_norm(c, self.gamma_c.shape, self.gamma_c, self.beta_c))
        return h, c


class HandLNGRUCell(nn.Module):
    """seqnorm's ``GRUCell(norm="layer")`` written plainly: LN on ``W_ih x`` and ``W_hh h``, ``r`` gating ``u_n``."""

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        gates = 3 * hidden_size
        self.weight_ih = nn.Parameter(torch.randn(gates, input_size) / hidden_size**0.5)
        self.weight_hh = nn.Parameter(torch.randn(gates, hidden_size) / hidden_size**0.5)
        self.bias_ih = nn.Parameter(torch.zeros(gates))
        self.bias_hh = nn.Parameter(torch.zeros(gates))
        self.gamma_ih = nn.Parameter(torch.ones(gates))
        self.gamma_hh = nn.Parameter(torch.ones(gates))

    def forward(self, x: Tensor, h: Tensor) -> Tensor:
        a = F.layer_norm(x @ self.weight_ih.t(), self.gamma_ih.shape, self.gamma_ih, self.bias_ih)
        u = F.layer_norm(h @ self.weight_hh.t(), self.gamma_hh.shape, self.gamma_hh, self.bias_hh)
        a_r, a_z, a_n = a.chunk(3, dim=1)
        u_r, u_z, u_n = u.chunk(3, dim=1)
        r, z = torch.sigmoid(a_r + u_r), torch.sigmoid(a_z + u_z)
        n = torch.tanh(a_n + r * u_n)
        return (1 - z) * n + z * h


def masked_loop(cell: nn.Module, lstm: bool) -> Loop:
    """A torch-style cell (no ``step``/``mask``) run as a user masks it: finished rows keep their state."""

    def run(x: Tensor, lengths: Tensor) -> Tensor:
        batch, hidden = x.shape[1], cell.weight_hh.shape[1]
        h = x.new_zeros(batch, hidden)
        c = x.new_zeros(batch, hidden)
        for t in range(x.shape[0]):
            keep = (t < lengths).unsqueeze(1)
            if lstm:
                h_new, c_new = cell(x[t], (h, c))
                h, c = torch.where(keep, h_new, h), torch.where(keep, c_new, c)
            else:
                h = torch.where(keep, cell(x[t], h), h)
        return h

    return run


def seqnorm_loop(cell: seqnorm.LSTMCell | seqnorm.GRUCell, lstm: bool) -> Loop:
    """seqnorm's cell as the README's loop calls it: ``cell(x[t], state, step=t, mask=t < lengths)``."""

    def run(x: Tensor, lengths: Tensor) -> Tensor:
        state = None
        for t in range(x.shape[0]):
            state = cell(x[t], state, step=t, mask=t < lengths)
        return state[0] if lstm else state

    return run


def variants(kind: str, input_size: int, hidden: int) -> dict[str, tuple[nn.Module, Loop]]:
    lstm = kind == "lstm"
    torch_cell = (nn.LSTMCell if lstm else nn.GRUCell)(input_size, hidden)
    hand = (HandLNLSTMCell if lstm else HandLNGRUCell)(input_size, hidden)
    ours = seqnorm.LSTMCell if lstm else seqnorm.GRUCell
    layer, batch = ours(input_size, hidden, norm="layer"), ours(input_size, hidden, norm="batch")
    return {
        "torch": (torch_cell, masked_loop(torch_cell, lstm)),
        "hand LN": (hand, masked_loop(hand, lstm)),
        "seqnorm LN": (layer, seqnorm_loop(layer, lstm)),
        "seqnorm BN": (batch, seqnorm_loop(batch, lstm)),
    }


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def timed(run: Callable[[], object], clock: Callable[[], float]) -> float:
    start = clock()
    run()
    return clock() - start


def measure(args: argparse.Namespace, kind: str) -> dict[str, tuple[float, float]]:
    """Median (training step ms, forward µs per time step) of each variant, interleaved round by round."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.steps, args.batch, args.input_size, generator=generator)
    lengths = torch.randint(args.steps // 2, args.steps + 1, (args.batch,), generator=generator)
    lengths[0] = args.steps
    entries = variants(kind, args.input_size, args.hidden)

    def train(module: nn.Module, loop: Loop) -> Callable[[], None]:
        def step() -> None:
            module.zero_grad(set_to_none=True)
            loop(x, lengths).sum().backward()

        return step

    def forward(loop: Loop) -> Callable[[], None]:
        def step() -> None:
            with torch.no_grad():
                loop(x, lengths)

        return step

    training = {name: train(module, loop) for name, (module, loop) in entries.items()}
    forwards = {name: forward(loop) for name, (_, loop) in entries.items()}
    for _ in range(args.warmup):
        for name in entries:
            training[name]()
            forwards[name]()
    train_times: dict[str, list[float]] = {name: [] for name in entries}
    forward_times: dict[str, list[float]] = {name: [] for name in entries}
    clock = CLOCKS[args.clock]
    for _ in range(args.repeats):
        for name in entries:
            train_times[name].append(timed(training[name], clock))
            forward_times[name].append(timed(forwards[name], clock))
    return {
        name: (1e3 * statistics.median(train_times[name]), 1e6 * statistics.median(forward_times[name]) / args.steps)
        for name in entries
    }


def table(args: argparse.Namespace, results: dict[str, dict[str, tuple[float, float]]]) -> str:
    lines = [
        f"{cpu_name()}; {date.today().isoformat()}; torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
        f"{args.steps} masked steps, B={args.batch}, I={args.input_size}, H={args.hidden}; median of {args.repeats} "
        f"({args.clock} clock)",
        "",
        "| cell | torch ms | hand LN ms | seqnorm LN ms | seqnorm BN ms | BN / LN (≤ 2) | LN / hand LN (≤ 1.3) "
        "| forward µs/step: torch / hand LN / LN / BN |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for kind, times in results.items():
        train = {name: value[0] for name, value in times.items()}
        forward = " / ".join(f"{value[1]:.0f}" for value in times.values())
        lines.append(
            f"| {kind} | {train['torch']:.2f} | {train['hand LN']:.2f} | {train['seqnorm LN']:.2f} | "
            f"{train['seqnorm BN']:.2f} | {train['seqnorm BN'] / train['seqnorm LN']:.2f} | "
            f"{train['seqnorm LN'] / train['hand LN']:.2f} | {forward} |"
        )
    return "\n".join(lines)


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", default="lstm,gru", help="comma-separated: lstm, gru")
    parser.add_argument("--steps", type=positive, default=30)
    parser.add_argument("--batch", type=positive, default=8, help="at least 2: BN trains on batch statistics")
    parser.add_argument("--input-size", type=positive, default=32)
    parser.add_argument("--hidden", type=positive, default=64)
    parser.add_argument("--repeats", type=positive, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=positive, default=1)
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: elapsed time; cpu: this thread's CPU time (steadier on a shared machine: time spent descheduled "
        "is not counted)",
    )
    parser.add_argument("--quick", action="store_true", help="a few rounds (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.warmup = 3, 1
    cells = [cell.strip() for cell in args.cells.split(",") if cell.strip()]
    unknown = sorted(set(cells) - {"lstm", "gru"})
    if unknown or not cells:
        parser.error(f"--cells: expected lstm and/or gru, got {', '.join(unknown) or 'none'}")
    if args.batch < 2:
        parser.error(
            f"--batch: expected at least 2 rows (per-timestep BN trains on batch statistics), got {args.batch}"
        )
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(table(args, {cell.upper(): measure(args, cell) for cell in cells}))


if __name__ == "__main__":
    main()
