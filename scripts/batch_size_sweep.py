"""Validation loss of a character LSTM language model for every norm x batch size, at an equal budget of tokens.

Each cell of the grid trains a fresh model (same seed, same learning rate) on the same number of training tokens,
so smaller batches take more, noisier updates. Validation runs in eval mode (BN uses its running statistics).
Per-timestep BN runs with its default ``small_batch="error"`` on fixed-length windows: at batch size 2 and up every
step has all rows, and at batch size 1 it raises. That run is a row of the table with the error as its status, not
a gap: it is the result.

    python scripts/batch_size_sweep.py --quick            # none/layer/batch x 1/4/32, about a minute
    python scripts/batch_size_sweep.py                    # the full grid on the embedded corpus
    python scripts/batch_size_sweep.py --dataset ptb_char # Cooijmans et al.'s corpus (downloads once)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _common

import seqnorm

NAME = "batch_size_sweep"
QUICK = {
    "norms": ["none", "layer", "batch"],
    "batch_sizes": [1, 4, 32],
    "tokens": 12_000,
    "steps": 32,
    "hidden": 64,
    "embedding": 32,
    "val_tokens": 6_000,
    "lr": 1e-2,
}
FULL = {
    "norms": list(seqnorm.NORMS),
    "batch_sizes": [1, 2, 4, 8, 32, 64],
    "tokens": 60_000,
    "steps": 50,
    "hidden": 128,
    "embedding": 32,
    "val_tokens": None,
    "lr": 3e-3,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _common.make_parser(__doc__, NAME)
    parser.add_argument("--norms", nargs="+", choices=list(seqnorm.NORMS), help="norms to compare")
    parser.add_argument("--batch-sizes", nargs="+", type=int, help="batch sizes to compare")
    parser.add_argument("--tokens", type=int, help="training tokens per run (the equal budget)")
    parser.add_argument("--steps", type=int, help="time steps per training window")
    parser.add_argument("--hidden", type=int, help="LSTM hidden size")
    parser.add_argument("--embedding", type=int, help="embedding size")
    parser.add_argument("--val-tokens", type=int, help="validation tokens (default: the whole validation split)")
    parser.add_argument(
        "--lr", type=float, help="Adam learning rate, the same for every run (default 1e-2 quick, 3e-3 full)"
    )
    return _common.resolve(parser.parse_args(argv), QUICK, FULL)


def run_grid(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str, float]:
    """Train every (norm, batch size); returns the rows, the corpus level and the unigram baseline loss."""
    corpus, windows = _common.load_windows(args, args.steps)
    val = windows["val"].head(args.val_tokens)
    value = _common.value_name(corpus.level)
    print(
        f"{corpus.source}: {len(windows['train'])} training windows of {args.steps} steps, vocabulary "
        f"{corpus.vocab_size}; {args.tokens} training tokens per run; {val.inputs.numel()} validation tokens",
        flush=True,
    )
    rows = []
    for batch_size in args.batch_sizes:
        for norm in args.norms:
            model = _common.build_model(corpus.vocab_size, args, norm, max_steps=args.steps)
            result = _common.train_language_model(
                model, windows["train"], batch_size=batch_size, tokens=args.tokens, lr=args.lr, seed=args.seed
            )
            val_loss = _common.evaluate(model, val)[0] if result.status == "ok" else float("nan")
            row = {
                "norm": norm,
                "batch_size": batch_size,
                "status": result.status,
                "val_loss": val_loss,
                value: _common.loss_value(val_loss, corpus.level),
                "train_loss": result.train_loss,
                "updates": result.updates,
                "tokens": result.tokens,
                "seconds": round(result.seconds, 1),
            }
            rows.append(row)
            print(f"  {norm:<13} batch {batch_size:>3}: {row[value]:.4f} {value}  ({result.status})", flush=True)
    return rows, corpus.level, _common.unigram_loss(windows["train"], val, corpus.vocab_size)


def summary(rows: Sequence[dict[str, Any]], value: str) -> list[dict[str, Any]]:
    """One row per norm, one column per batch size: the validation value, or the first word of the status."""
    table: dict[str, dict[str, Any]] = {}
    for row in rows:
        cell = row[value] if row["status"] == "ok" else row["status"].split(":")[0]
        table.setdefault(row["norm"], {"norm": row["norm"]})[f"B={row['batch_size']}"] = cell
    return list(table.values())


def plot(rows: Sequence[dict[str, Any]], value: str, path: Path) -> None:
    plt = _common.pyplot()
    figure, axes = plt.subplots(figsize=(6, 4), dpi=100)
    for norm in dict.fromkeys(row["norm"] for row in rows):
        points = [(r["batch_size"], r[value]) for r in rows if r["norm"] == norm and r["status"] == "ok"]
        failed = [r["batch_size"] for r in rows if r["norm"] == norm and r["status"] != "ok"]
        line = axes.plot(*zip(*points, strict=True), marker="o", label=norm)[0] if points else None
        for batch_size in failed:  # where a norm could not train: an x on the axis, in the norm's colour
            color = line.get_color() if line else "black"
            axes.annotate(
                "x", (batch_size, 0.02), xycoords=("data", "axes fraction"), color=color, ha="center", fontsize=14
            )
    sizes = sorted({row["batch_size"] for row in rows})
    axes.set_xscale("log", base=2)
    axes.set_xticks(sizes, [str(size) for size in sizes])
    axes.set_xlabel("batch size (equal training tokens)")
    axes.set_ylabel(value.replace("_", " "))
    axes.set_title("Validation after an equal token budget (x: could not train)")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    run = _common.RunLog(argv, NAME)
    args = parse_args(argv)
    rows, level, unigram = run_grid(args)
    value = _common.value_name(level)
    columns = ["norm", "batch_size", "status", "val_loss", value, "train_loss", "updates", "tokens", "seconds"]
    errors = sorted({row["status"] for row in rows if row["status"] != "ok"})
    notes = [
        f"Equal budget: {args.tokens} training tokens per run in windows of {args.steps} steps; LSTM hidden "
        f"{args.hidden}, embedding {args.embedding}, Adam lr {args.lr} for every batch size, gradient norm clipped "
        "at 1. val_loss is nats per token in eval mode.",
        f"No-context baseline (training-split token frequencies): val_loss {unigram:.4f}, {value} "
        f"{_common.loss_value(unigram, level):.4f}; a model below it has learned to use context.",
        'Per-timestep BN (batch, batch_renorm) runs with small_batch="error" (the default): fixed-length windows '
        "give every step all B rows, so B >= 2 trains normally and B = 1 raises the ValueError recorded as status.",
        f"batch_renorm uses a shortened schedule {_common.RENORM_SCHEDULE} (counted in batches per time step).",
        *(f"Status `{error}`" for error in errors),
    ]
    _common.write_results(
        args.out,
        rows,
        columns,
        title=f"Batch-size sweep: {value.replace('_', ' ')} by norm and batch size",
        run=run,
        notes=notes,
        extra_tables=[(f"{value} (norm x batch size)", summary(rows, value), ["norm", *summary_columns(rows)])],
    )
    plot(rows, value, args.out / "val_by_batch_size.png")
    return rows


def summary_columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    return [f"B={size}" for size in dict.fromkeys(row["batch_size"] for row in rows)]


if __name__ == "__main__":
    main()
