"""Online learning at batch size 1: learning curves of batch 1 against batch 32 at an equal number of tokens.

Ba et al. (2016) present layer normalization as usable in the online regime, one example per update, where batch
normalization is undefined. Here every model sees the same training windows (fewer than one epoch, so each window
once), either one per update or 32 per update, and is evaluated on the validation windows at regular token counts.
Per-timestep BN is included at both batch sizes: at batch size 1 its row records the error it raises. Every
(norm, batch size) follows the fair protocol of ``_protocol``: its own learning rate from ``--lrs`` (extended past
an edge), mean ± std over ``--seeds``, BN also evaluated with exact statistics (``seqnorm.update_bn``) and its rate
chosen on ``--bn-select``, the same ``--forget-bias`` for every norm, and the paired per-seed difference from the
plain LSTM of the same batch size (``diff_vs_none``); the curves are means over the seeds.

    python scripts/online_training.py --quick        # layer, none, batch; 2 lrs x 2 seeds; about a minute
    python scripts/online_training.py --norms layer rms weight none batch --tokens 100000
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _common
import _protocol
import torch

import seqnorm

NAME = "online_training"
QUICK = {
    **_protocol.QUICK,
    "norms": ["layer", "none", "batch"],
    "batch_sizes": [1, 32],
    "tokens": 8_000,
    "evaluations": 4,
    "steps": 32,
    "hidden": 64,
    "embedding": 32,
    "val_tokens": 3_000,
}
FULL = {
    **_protocol.FULL,
    "norms": ["layer", "rms", "weight", "none", "batch", "batch_renorm"],
    "batch_sizes": [1, 32],
    "tokens": 100_000,
    "evaluations": 10,
    "steps": 50,
    "hidden": 128,
    "embedding": 32,
    "val_tokens": 10_000,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _common.make_parser(__doc__, NAME)
    parser.add_argument("--norms", nargs="+", choices=list(seqnorm.NORMS))
    parser.add_argument("--batch-sizes", nargs="+", type=_common.positive_int, help="default: 1 (online) and 32")
    parser.add_argument("--tokens", type=_common.positive_int, help="training tokens per run (the equal budget)")
    parser.add_argument("--evaluations", type=_common.positive_int, help="validation points along the curve")
    parser.add_argument("--steps", type=_common.positive_int, help="time steps per window")
    parser.add_argument("--hidden", type=_common.positive_int)
    parser.add_argument("--embedding", type=_common.positive_int)
    parser.add_argument("--val-tokens", type=_common.positive_int)
    _protocol.add_arguments(parser)
    return _common.resolve(parser.parse_args(argv), QUICK, FULL)


def mean_curve(curves: Sequence[Sequence[tuple[int, float]]]) -> list[tuple[int, float, float]]:
    """``(tokens, mean, std)`` at each evaluation point, over seeds (their points fall at the same token counts)."""
    points = []
    for column in zip(*curves, strict=False):
        losses = [loss for _, loss in column]
        std = statistics.stdev(losses) if len(losses) > 1 else float("nan")
        points.append((column[0][0], statistics.fmean(losses), std))
    return points


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    run = _common.RunLog(argv, NAME)
    args = parse_args(argv)
    corpus, windows = _common.load_windows(args, args.steps)
    train, val = windows["train"], windows["val"].head(args.val_tokens)
    value = _common.value_name(corpus.level)
    epoch_tokens = train.tokens
    unigram = _common.unigram_loss(train, val, corpus.vocab_size)
    print(f"{corpus.source}: {args.tokens} training tokens per run ({args.tokens / epoch_tokens:.2f} epochs)")

    def measure(model: torch.nn.Module) -> dict[str, float]:
        loss = _common.evaluate(model, val)[0]
        return {"val_loss": loss, value: _common.loss_value(loss, corpus.level)}

    rows, curves, trials = [], [], []
    cache = _protocol.TrialCache.for_args(args, NAME)
    for norm in args.norms:
        for batch_size in args.batch_sizes:

            def train_one(lr: float, seed: int, norm: str = norm, batch_size: int = batch_size) -> dict[str, Any]:
                model = _common.build_model(corpus.vocab_size, args, norm, max_steps=args.steps, seed=seed)
                row, result = _protocol.trial(
                    model,
                    train,
                    norm=norm,
                    measure=measure,
                    stats_tokens=args.bn_stats_tokens,
                    gap_key=value,
                    batch_size=batch_size,
                    tokens=args.tokens,
                    lr=lr,
                    seed=seed,
                    evaluate_every=max(1, args.tokens // args.evaluations),
                    evaluate_fn=lambda m: measure(m)["val_loss"],
                )
                row["curve"] = [[tokens, loss] for tokens, loss in result.curve] if result.status == "ok" else []
                if row["curve"]:
                    row["best_val_loss"] = min(loss for _, loss in row["curve"][1:])
                return row

            name = f"{norm}|B={batch_size}"
            key = _protocol.selection_key(norm, args)
            cell = _protocol.run_cell(
                train_one, args.lrs, args.seeds, args.select, key, cache, name, args.lr_extensions, args.select_seeds
            )
            trials += [{"norm": norm, "batch_size": batch_size, **row} for row in cell.trials]
            row = {
                "norm": norm,
                "batch_size": batch_size,
                **_protocol.summarize(cell, key, _protocol.other_key(norm, args)),
            }
            row.update(headline=value + key.removeprefix("val_loss"), forget_bias=args.forget_bias)
            row["chosen"] = cell.chosen
            rows.append(row)
            chosen = [trial["curve"] for trial in cell.chosen if trial["curve"]]
            for tokens, loss, std in mean_curve(chosen) if chosen else []:
                curves.append(
                    {
                        "norm": norm,
                        "batch_size": batch_size,
                        "lr": cell.lr,
                        "tokens": tokens,
                        "val_loss": loss,
                        "val_loss_std": std,
                        value: _common.loss_value(loss, corpus.level),
                    }
                )
            print(
                f"  {norm:<13} batch {batch_size:>3}: {row.get(value, float('nan')):.4f} {value} (lr {row['lr']}, "
                f"{row['status']})",
                flush=True,
            )
    _protocol.add_paired(rows, lambda row: row["batch_size"])
    columns = ["norm", "batch_size", "status", "lr", "seeds", "updates", "tokens"]
    measured = ["val_loss", value, f"{value}_exact", "ema_gap", "best_val_loss"]
    columns += [name for key in measured for name in (key, f"{key}_std") if any(name in row for row in rows)]
    columns += ["seconds", "lr_chosen_on", "lrs_added", "lr_edge", "lr_other_metric"]
    columns += _protocol.PAIRED_COLUMNS
    columns.append("forget_bias")
    notes = [
        f"Equal budget: {args.tokens} training tokens ({args.tokens / epoch_tokens:.2f} epochs"
        f"{': each window seen at most once' if args.tokens <= epoch_tokens else ''}) in windows of {args.steps} "
        f"steps; LSTM hidden {args.hidden}; val_loss (nats per token, eval mode) on {len(val)} validation windows "
        "at the end of training.",
        *_protocol.notes(args, cache),
        f"No-context baseline: val_loss {unigram:.4f} ({value} {_common.loss_value(unigram, corpus.level):.4f}).",
        f"Learning curves (validation every ~1/{args.evaluations} of the budget, mean over seeds at the chosen "
        "rate, running statistics for BN): curves.csv, learning_curves.png.",
    ]
    summary = [
        {
            "norm": r["norm"],
            "batch_size": r["batch_size"],
            "lr": r["lr"],
            "updates": r["updates"],
            value: _protocol.pm(r[value], r[f"{value}_std"]) if r["status"] == "ok" else r["status"].split(":")[0],
            f"{value}_exact": _protocol.pm(r[f"{value}_exact"], r[f"{value}_exact_std"])
            if f"{value}_exact" in r
            else "",
            "diff_vs_none": r.get("paired", ""),
            "lr_edge": r["lr_edge"],
        }
        for r in rows
    ]
    _common.write_results(
        args.out,
        rows,
        columns,
        title=f"Online (batch size 1) vs batch 32; {_common.forget_bias_text(args)}",
        run=run,
        notes=notes,
        extra_tables=[
            (
                f"{value}, mean ± std over seeds; diff_vs_none: paired per-seed difference from the plain LSTM of the "
                f"same batch size ({value}, BN on its headline metric): mean [95% t-interval], seeds where the sign "
                "held",
                summary,
                ["norm", "batch_size", "lr", "lr_edge", "updates", value, f"{value}_exact", "diff_vs_none"],
            )
        ],
    )
    _common.write_csv(
        args.out / "curves.csv", curves, ["norm", "batch_size", "lr", "tokens", "val_loss", "val_loss_std", value]
    )
    _common.write_csv(
        args.out / "trials.csv",
        trials,
        [
            "norm",
            "batch_size",
            "lr",
            "seed",
            "status",
            "val_loss",
            value,
            f"{value}_exact",
            "ema_gap",
            "best_val_loss",
            "updates",
            "tokens",
            "seconds",
        ],
    )
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
