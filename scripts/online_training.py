"""Online learning at batch size 1: learning curves of batch 1 against batch 32 at an equal number of tokens.

Ba et al. (2016) present layer normalization as usable in the online regime, one example per update, where batch
normalization is undefined. Here every model sees the same training windows (fewer than one epoch, so each window
once), either one per update or 32 per update, and is evaluated on the validation windows at regular token counts.
Per-timestep BN is included at both batch sizes: at batch size 1 its row records the error it raises.

    python scripts/online_training.py --quick        # layer, none, batch; about a minute
    python scripts/online_training.py --norms layer rms weight none batch --tokens 100000
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

NAME = "online_training"
QUICK = {
    "norms": ["layer", "none", "batch"],
    "batch_sizes": [1, 32],
    "tokens": 12_000,
    "evaluations": 6,
    "steps": 32,
    "hidden": 64,
    "embedding": 32,
    "val_tokens": 4_000,
    "lr": 1e-2,
}
FULL = {
    "norms": ["layer", "rms", "weight", "none", "batch", "batch_renorm"],
    "batch_sizes": [1, 32],
    "tokens": 100_000,
    "evaluations": 10,
    "steps": 50,
    "hidden": 128,
    "embedding": 32,
    "val_tokens": 10_000,
    "lr": 3e-3,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _common.make_parser(__doc__, NAME)
    parser.add_argument("--norms", nargs="+", choices=list(seqnorm.NORMS))
    parser.add_argument("--batch-sizes", nargs="+", type=int, help="default: 1 (online) and 32")
    parser.add_argument("--tokens", type=int, help="training tokens per run (the equal budget)")
    parser.add_argument("--evaluations", type=int, help="validation points along the curve")
    parser.add_argument("--steps", type=int, help="time steps per window")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--embedding", type=int)
    parser.add_argument("--val-tokens", type=int)
    parser.add_argument("--lr", type=float, help="Adam learning rate for every run (default 1e-2 quick, 3e-3 full)")
    return _common.resolve(parser.parse_args(argv), QUICK, FULL)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    run = _common.RunLog(argv, NAME)
    args = parse_args(argv)
    corpus, windows = _common.load_windows(args, args.steps)
    val = windows["val"].head(args.val_tokens)
    value = _common.value_name(corpus.level)
    epoch_tokens = windows["train"].targets.numel()
    unigram = _common.unigram_loss(windows["train"], val, corpus.vocab_size)
    print(f"{corpus.source}: {args.tokens} training tokens per run ({args.tokens / epoch_tokens:.2f} epochs)")

    def validation_loss(model: torch.nn.Module) -> float:
        return _common.evaluate(model, val)[0]

    rows, curves = [], []
    for norm in args.norms:
        for batch_size in args.batch_sizes:
            model = _common.build_model(corpus.vocab_size, args, norm, max_steps=args.steps)
            result = _common.train_language_model(
                model,
                windows["train"],
                batch_size=batch_size,
                tokens=args.tokens,
                lr=args.lr,
                seed=args.seed,
                evaluate_every=max(1, args.tokens // args.evaluations),
                evaluate_fn=validation_loss,
            )
            ok = result.status == "ok"
            losses = [loss for _, loss in result.curve[1:]] if ok else []
            final = losses[-1] if losses else float("nan")
            rows.append(
                {
                    "norm": norm,
                    "batch_size": batch_size,
                    "status": result.status,
                    "updates": result.updates,
                    "tokens": result.tokens,
                    "val_loss": final,
                    value: _common.loss_value(final, corpus.level),
                    "best_val_loss": min(losses) if losses else float("nan"),
                    "seconds": round(result.seconds, 1),
                }
            )
            for tokens, loss in result.curve if ok else []:
                curves.append(
                    {
                        "norm": norm,
                        "batch_size": batch_size,
                        "tokens": tokens,
                        "val_loss": loss,
                        value: _common.loss_value(loss, corpus.level),
                    }
                )
            print(f"  {norm:<13} batch {batch_size:>3}: {rows[-1][value]:.4f} {value} ({result.status})", flush=True)
    columns = ["norm", "batch_size", "status", "updates", "tokens", "val_loss", value, "best_val_loss", "seconds"]
    notes = [
        f"Equal budget: {args.tokens} training tokens ({args.tokens / epoch_tokens:.2f} epochs"
        f"{': each window seen at most once' if args.tokens <= epoch_tokens else ''}) in windows of {args.steps} "
        f"steps; LSTM hidden {args.hidden}; Adam lr {args.lr} for every run; "
        f"val_loss (nats per token, eval mode) on {len(val)} validation windows at the end of training.",
        f"No-context baseline: val_loss {unigram:.4f} ({value} {_common.loss_value(unigram, corpus.level):.4f}).",
        f"Learning curves (validation every ~1/{args.evaluations} of the budget): curves.csv, learning_curves.png.",
    ]
    _common.write_results(args.out, rows, columns, title="Online (batch size 1) vs batch 32", run=run, notes=notes)
    _common.write_csv(args.out / "curves.csv", curves, ["norm", "batch_size", "tokens", "val_loss", value])
    plot(curves, value, _common.loss_value(unigram, corpus.level), args.out / "learning_curves.png")
    return rows


def plot(curves: list[dict[str, Any]], value: str, baseline: float, path: Path) -> None:
    plt = _common.pyplot()
    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    colors: dict[str, str] = {}
    for norm, batch_size in dict.fromkeys((c["norm"], c["batch_size"]) for c in curves):
        points = [(c["tokens"], c[value]) for c in curves if c["norm"] == norm and c["batch_size"] == batch_size]
        style = "-" if batch_size == 1 else "--"
        label = f"{norm} B={batch_size}"
        line = axes.plot(*zip(*points, strict=True), style, marker=".", color=colors.get(norm), label=label)
        colors.setdefault(norm, line[0].get_color())
    axes.axhline(baseline, color="gray", linewidth=0.8, linestyle=":", label="no-context baseline")
    axes.set_xlabel("training tokens seen")
    axes.set_ylabel(value.replace("_", " "))
    axes.set_title("Learning curves at equal tokens: batch 1 (solid) vs batch 32 (dashed)")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


if __name__ == "__main__":
    main()
