"""Train on windows of T steps, evaluate on windows of L > T steps: validation loss by position, per norm.

Per-timestep BN has running statistics only for the steps it was trained on. With ``max_steps=T`` (the library's
design, after Cooijmans et al.) every step ``t >= T`` reuses the statistics of step ``T - 1``; the extra row
``batch`` with ``max_steps=L`` shows the alternative, statistics rows for steps ``T..L-1`` that training never
reached (still at their initial mean 0, variance 1), and the row ``batch`` with ``beyond_max_steps="pooled"`` the
library's other policy: steps ``t >= T`` use the pooled statistics of all T steps. LayerNorm and the others need no
statistics of any step.
The corpus is read as one stream, so the text at position 150 is no harder than at position 15: a model that
generalizes in length keeps a flat loss past T.

    python scripts/length_generalization.py --quick   # T = 25, L = 100, about a minute
    python scripts/length_generalization.py --text my.txt --steps 100 --eval-steps 400
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _common
import torch

import seqnorm

NAME = "length_generalization"
QUICK = {
    "norms": ["none", "layer", "batch"],
    "steps": 25,
    "eval_steps": 100,
    "batch_size": 16,
    "tokens": 40_000,
    "hidden": 64,
    "embedding": 32,
    "val_tokens": 15_000,
    "lr": 1e-2,
}
FULL = {
    "norms": ["none", "layer", "rms", "batch", "batch_renorm"],
    "steps": 50,
    "eval_steps": 200,
    "batch_size": 32,
    "tokens": 150_000,
    "hidden": 128,
    "embedding": 32,
    "val_tokens": None,
    "lr": 3e-3,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _common.make_parser(__doc__, NAME)
    parser.add_argument("--norms", nargs="+", choices=list(seqnorm.NORMS))
    parser.add_argument("--steps", type=int, help="T: time steps of the training windows")
    parser.add_argument("--eval-steps", type=int, help="L: time steps of the validation windows (more than T)")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--tokens", type=int, help="training tokens per model")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--embedding", type=int)
    parser.add_argument("--val-tokens", type=int, help="validation tokens (default: the whole split)")
    parser.add_argument("--lr", type=float, help="Adam learning rate (default 1e-2 quick, 3e-3 full)")
    parser.add_argument(
        "--no-untrained-stats", action="store_true", help="skip the BN row with statistics rows up to L"
    )
    parser.add_argument("--no-pooled", action="store_true", help="skip the BN row with beyond_max_steps='pooled'")
    args = _common.resolve(parser.parse_args(argv), QUICK, FULL)
    if args.eval_steps <= args.steps:
        parser.error(f"--eval-steps ({args.eval_steps}) must exceed --steps ({args.steps})")
    return args


def variants(args: argparse.Namespace) -> list[tuple[str, int, str]]:
    """``(norm, max_steps, beyond_max_steps)``: every norm at ``max_steps=T``, plus BN pooled and BN with rows to L."""
    runs = [(norm, args.steps, "last") for norm in args.norms]
    if "batch" in args.norms and not args.no_pooled:
        runs.append(("batch", args.steps, "pooled"))
    if "batch" in args.norms and not args.no_untrained_stats:
        runs.append(("batch", args.eval_steps, "last"))
    return runs


def beyond_note(norm: str, max_steps: int, steps: int, beyond: str) -> str:
    if not seqnorm.NORMS[norm].batch_statistics:
        return "none needed"
    if max_steps > steps:
        return "untrained rows (0/1)"
    return f"pooled steps 0..{steps - 1}" if beyond == "pooled" else f"reuse step {steps - 1}"


def smooth(values: torch.Tensor, width: int = 5) -> torch.Tensor:
    """Moving average over positions (same length; shorter windows at the ends)."""
    kernel = torch.ones(1, 1, width)
    padded = torch.nn.functional.pad(values.view(1, 1, -1), (width // 2, width // 2), mode="replicate")
    return torch.nn.functional.conv1d(padded, kernel).view(-1) / width


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    run = _common.RunLog(argv, NAME)
    args = parse_args(argv)
    T, L = args.steps, args.eval_steps
    corpus, train_windows = _common.load_windows(args, T)
    _, long_windows = _common.load_windows(args, L, vocab_from=corpus)
    val = long_windows["val"].head(args.val_tokens)
    print(f"{corpus.source}: train on {T} steps ({args.tokens} tokens), evaluate {len(val)} windows of {L} steps")
    rows, curves = [], {}
    for norm, max_steps, beyond in variants(args):
        extra = {"beyond_max_steps": beyond} if beyond != "last" else {}
        model = _common.build_model(corpus.vocab_size, args, norm, max_steps=max_steps, **extra)
        result = _common.train_language_model(
            model, train_windows["train"], batch_size=args.batch_size, tokens=args.tokens, lr=args.lr, seed=args.seed
        )
        row: dict[str, Any] = {
            "norm": norm,
            "max_steps": max_steps,
            "stats_beyond_T": beyond_note(norm, max_steps, T, beyond),
            "status": result.status,
        }
        if result.status == "ok":
            _, by_position = _common.evaluate(model, val)
            curves[f"{norm} (max_steps={max_steps}{', pooled' if beyond == 'pooled' else ''})"] = by_position
            within, beyond = float(by_position[:T].mean()), float(by_position[T:].mean())
            row.update(
                loss_within_T=within,
                loss_beyond_T=beyond,
                loss_last_quarter=float(by_position[-L // 4 :].mean()),
                beyond_minus_within=beyond - within,
            )
        row["train_seconds"] = round(result.seconds, 1)
        rows.append(row)
        label = f"{norm} max_steps={max_steps}" + (" pooled" if beyond == "pooled" else "")
        print(f"  {label}: {row.get('beyond_minus_within', float('nan')):+.4f}", flush=True)

    columns = [
        "norm",
        "max_steps",
        "stats_beyond_T",
        "status",
        "loss_within_T",
        "loss_beyond_T",
        "loss_last_quarter",
        "beyond_minus_within",
        "train_seconds",
    ]
    notes = [
        f"T = {T} training steps, L = {L} evaluation steps; LSTM hidden {args.hidden}, batch {args.batch_size}, "
        f"{args.tokens} training tokens, Adam lr {args.lr}. Losses in nats per token, eval mode, averaged over "
        f"{len(val)} validation windows; loss_within_T is positions 0..{T - 1}, loss_beyond_T positions {T}..{L - 1}.",
        "Position 0 has no context, so loss_within_T includes the cold start; beyond_minus_within near or below 0 "
        "means no degradation past the training length.",
        f"batch_renorm uses the shortened schedule {_common.RENORM_SCHEDULE} (counted in batches per time step).",
    ]
    _common.write_results(
        args.out, rows, columns, title=f"Length generalization: train T={T}, evaluate L={L}", run=run, notes=notes
    )
    _common.write_csv(
        args.out / "loss_by_position.csv",
        [{"position": t, **{name: float(c[t]) for name, c in curves.items()}} for t in range(L)],
        ["position", *curves],
    )
    plot(curves, T, args.out / "loss_by_position.png")
    return rows


def plot(curves: dict[str, torch.Tensor], steps: int, path: Path) -> None:
    plt = _common.pyplot()
    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    for name, curve in curves.items():
        axes.plot(smooth(curve).numpy(), label=name, linewidth=1.2)
    axes.axvline(steps, color="gray", linestyle="--", linewidth=1)
    axes.annotate("training length T", (steps, 0.97), xycoords=("data", "axes fraction"), fontsize=8, ha="left")
    axes.set_xlabel("position in the validation window")
    axes.set_ylabel("loss (nats/token, 5-step moving average)")
    axes.set_title("Loss by position beyond the training length")
    axes.legend(fontsize=8, loc="center right")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


if __name__ == "__main__":
    main()
