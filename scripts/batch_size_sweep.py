"""Validation loss of a character LSTM language model for every norm x batch size, under the fair protocol.

Each cell (norm, batch size) trains fresh models on an equal budget of training tokens, so smaller batches take
more, noisier updates; it picks its own learning rate from a small grid and reports mean ± std over seeds
(``_protocol``: ``--lrs``, ``--seeds``, ``--select``). Validation runs in eval mode; per-timestep BN is evaluated
with its running averages and again after ``seqnorm.update_bn`` (exact statistics), and the gap is a column.

``--unit window`` (default) trains on fixed windows of ``--steps`` characters: every step has all rows, so BN
trains at any batch size of 2 or more and raises at 1 (that row's status is the result). ``--unit line`` trains on
the corpus's lines, padded per batch: rows end at different steps, so a batch's tail steps have fewer active rows
(down to one, which BN's default ``small_batch`` policy normalizes with that step's running statistics).
``--unit stream`` trains on the windows as stateful truncated BPTT: the windows read as ``B`` contiguous streams,
each window starting from the previous one's final state (detached); validation reads its split as one stream.
``--unit line --bucket`` batches lines of similar length together (the library's ``BucketBatchSampler``), so few
tail steps are left with one active row: how many there are depends on the corpus's length distribution and on
bucketing. ``--updates N`` replaces the equal token budget by equal updates; ``--evaluations K`` records validation
curves (``curves.csv``) and how much the last stretch of training still gained (``last_gain``: how far from
convergence). Every norm is compared with the plain LSTM of its batch size by paired per-seed differences
(``diff_vs_none``: mean, 95% interval, seeds where the sign held).

    python scripts/batch_size_sweep.py --quick            # none/layer/batch x 1/4/32, 2 lrs x 2 seeds, ~1-2 min
    python scripts/batch_size_sweep.py --text FILE        # all six norms x 1..64, 3 lrs x 3 seeds
    python scripts/batch_size_sweep.py --text FILE --unit line
    python scripts/batch_size_sweep.py --text FILE --steps 100 --batch-sizes 64 --norms none layer batch \\
        --tokens 2000000 --evaluations 10   # Cooijmans et al.'s setting: windows of 100, batch 64
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _common
import _data
import _protocol

import seqnorm

NAME = "batch_size_sweep"
QUICK = {
    **_protocol.QUICK,
    "norms": ["none", "layer", "batch"],
    "batch_sizes": [1, 4, 32],
    "tokens": 8_000,
    "steps": 32,
    "hidden": 64,
    "embedding": 32,
    "val_tokens": 4_000,
}
FULL = {
    **_protocol.FULL,
    "norms": list(seqnorm.NORMS),
    "batch_sizes": [1, 2, 4, 8, 32, 64],
    "tokens": 60_000,
    "steps": 50,
    "hidden": 128,
    "embedding": 32,
    "val_tokens": None,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _common.make_parser(__doc__, NAME)
    parser.add_argument("--norms", nargs="+", choices=list(seqnorm.NORMS), help="norms to compare")
    parser.add_argument("--batch-sizes", nargs="+", type=_common.positive_int, help="batch sizes to compare")
    parser.add_argument(
        "--unit",
        choices=_data.UNITS,
        default="window",
        help="fixed windows, variable lines, or the windows as stateful streams (state carried across windows)",
    )
    parser.add_argument(
        "--bucket",
        action="store_true",
        help="with --unit line: batch lines of similar length together (seqnorm.data.BucketBatchSampler) instead of "
        "at random",
    )
    parser.add_argument("--tokens", type=_common.positive_int, help="training tokens per run (the equal budget)")
    parser.add_argument(
        "--updates", type=_common.positive_int, help="train every run for this many updates instead (equal updates)"
    )
    parser.add_argument(
        "--steps", type=_common.positive_int, help="time steps per window (with --unit line: the longest piece)"
    )
    parser.add_argument("--hidden", type=_common.positive_int, help="LSTM hidden size")
    parser.add_argument("--embedding", type=_common.positive_int, help="embedding size")
    parser.add_argument(
        "--val-tokens", type=_common.positive_int, help="validation tokens (default: the whole validation split)"
    )
    parser.add_argument(
        "--evaluations", type=_common.non_negative_int, default=0, help="validation points along each run (curves.csv)"
    )
    _protocol.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.bucket and args.unit != "line":
        parser.error(f"--bucket groups lines of similar length: it needs --unit line, got --unit {args.unit}")
    return _common.resolve(args, QUICK, FULL)


def run_grid(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """Every (batch size, norm) under the protocol; returns summary rows, every trial, and facts about the data."""
    corpus, data = _data.load_sequences(args, args.steps, args.unit)
    train, val = data["train"], data["val"].head(args.val_tokens)
    value = _data.value_name(corpus.level)
    budget_text = f"{args.updates} updates" if args.updates else f"{args.tokens} tokens"
    print(
        f"{corpus.source}: {len(train)} training {'window' if args.unit == 'stream' else args.unit}s "
        f"({train.tokens} tokens, up to {train.steps} steps{', read as streams' if train.stateful else ''}), "
        f"vocabulary {corpus.vocab_size}; budget {budget_text} per run; {val.tokens} validation tokens",
        flush=True,
    )

    def measure(model: Any) -> dict[str, float]:
        loss = _common.evaluate(model, val)[0]
        return {"val_loss": loss, value: _data.loss_value(loss, corpus.level)}

    rows, trials, curves = [], [], []
    cache = _protocol.TrialCache.for_args(args, NAME)
    for batch_size in args.batch_sizes:
        for norm in args.norms:

            def train_one(lr: float, seed: int, norm: str = norm, batch_size: int = batch_size) -> dict[str, Any]:
                model = _common.build_model(corpus.vocab_size, args, norm, max_steps=train.steps, seed=seed)
                row, result = _protocol.trial(
                    model,
                    train,
                    norm=norm,
                    measure=measure,
                    stats_tokens=args.bn_stats_tokens,
                    gap_key=value,
                    batch_size=batch_size,
                    tokens=args.tokens,
                    max_updates=args.updates,
                    lr=lr,
                    seed=seed,
                    evaluate_every=max(1, budget(args, train, batch_size) // args.evaluations)
                    if args.evaluations
                    else None,
                    evaluate_fn=(lambda m: measure(m)[value]) if args.evaluations else None,
                    bucket=args.bucket,
                )
                row["curve"] = [[tokens, loss] for tokens, loss in result.curve] if result.status == "ok" else []
                if len(row["curve"]) >= 2:
                    row["last_gain"] = row["curve"][-2][1] - row["curve"][-1][1]
                return row

            name = f"{norm}|B={batch_size}"
            key = _protocol.selection_key(norm, args)
            cell = _protocol.run_cell(
                train_one, args.lrs, args.seeds, args.select, key, cache, name, args.lr_extensions, args.select_seeds
            )
            trials += [{"norm": norm, "batch_size": batch_size, **row} for row in cell.trials]
            curves += [
                {
                    "norm": norm,
                    "batch_size": batch_size,
                    "lr": t["lr"],
                    "seed": t["seed"],
                    "tokens": tokens,
                    value: point,
                }
                for t in cell.trials
                for tokens, point in t["curve"]
            ]
            row = {
                "norm": norm,
                "batch_size": batch_size,
                **_protocol.summarize(cell, key, _protocol.other_key(norm, args)),
            }
            row["headline"] = f"{value}_exact" if key.endswith("_exact") else value
            row["forget_bias"] = args.forget_bias
            row["chosen"] = cell.chosen
            rows.append(row)
            exact = f", exact {row[value + '_exact']:.4f}" if value + "_exact" in row else ""
            print(
                f"  {norm:<13} batch {batch_size:>3}: {row.get(value, float('nan')):.4f} {value}{exact} "
                f"(lr {row['lr']}, {row['status']})",
                flush=True,
            )
            row["grid"] = _protocol.grid_row(cell, value)
    _protocol.add_paired(rows, lambda row: row["batch_size"])
    facts = {
        "level": corpus.level,
        "unigram": _data.unigram_loss(train, val, corpus.vocab_size),
        "train_tokens": train.tokens,
        "val_tokens": val.tokens,
        "curves": curves,
        "cache": cache,
    }
    return rows, trials, facts


def budget(args: argparse.Namespace, train: _data.Sequences, batch_size: int) -> int:
    """Training tokens a run will see: ``--tokens``, or ``--updates`` batches of the mean sequence length."""
    if args.updates is None:
        return args.tokens
    return args.updates * batch_size * train.tokens // len(train)


def by_batch_size(rows: Sequence[dict[str, Any]], cell: Any) -> list[dict[str, Any]]:
    """One row per norm, one column per batch size, each holding ``cell(row)``."""
    table: dict[str, dict[str, Any]] = {}
    for row in rows:
        table.setdefault(row["norm"], {"norm": row["norm"]})[f"B={row['batch_size']}"] = cell(row)
    return list(table.values())


def outcome(row: dict[str, Any], key: str) -> str:
    """``mean ± std`` of ``key``, or the first word of the reason the cell could not train."""
    if row["status"] != "ok":
        return row["status"].split(":")[0]
    return _protocol.pm(row[key], row[f"{key}_std"])


def summary(rows: Sequence[dict[str, Any]], value: str) -> list[dict[str, Any]]:
    """One row per norm, one column per batch size: ``mean ± std`` of ``value`` (BN: of its headline metric, the
    exact statistics under --bn-select exact, and the norm named so), or why the cell could not train."""
    table = by_batch_size(rows, lambda row: outcome(row, row.get("headline", value)))
    exact = {row["norm"] for row in rows if row.get("headline", value) != value}
    return [{**row, "norm": f"{row['norm']} (exact stats)"} if row["norm"] in exact else row for row in table]


def summary_columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The batch-size columns of :func:`summary`, in the order the sweep ran them."""
    return [f"B={size}" for size in dict.fromkeys(row["batch_size"] for row in rows)]


def plot(rows: Sequence[dict[str, Any]], value: str, path: Path) -> None:
    plt = _common.pyplot()
    figure, axes = plt.subplots(figsize=(6.5, 4), dpi=100)
    for norm in dict.fromkeys(row["norm"] for row in rows):
        ok = [r for r in rows if r["norm"] == norm and r["status"] == "ok"]
        failed = [r["batch_size"] for r in rows if r["norm"] == norm and r["status"] != "ok"]
        line = None
        if ok:
            sizes = [r["batch_size"] for r in ok]
            line = axes.errorbar(
                sizes, [r[value] for r in ok], yerr=[r[f"{value}_std"] for r in ok], marker="o", capsize=3, label=norm
            )[0]
            exact = [r for r in ok if f"{value}_exact" in r]
            if exact:
                axes.plot(
                    [r["batch_size"] for r in exact],
                    [r[f"{value}_exact"] for r in exact],
                    linestyle=":",
                    marker="^",
                    color=line.get_color(),
                    label=f"{norm} (exact stats)",
                )
        for batch_size in failed:  # where a norm could not train: an x on the axis, in the norm's colour
            color = line.get_color() if line else "black"
            axes.annotate(
                "x", (batch_size, 0.02), xycoords=("data", "axes fraction"), color=color, ha="center", fontsize=14
            )
    sizes = sorted({row["batch_size"] for row in rows})
    axes.set_xscale("log", base=2)
    axes.set_xticks(sizes, [str(size) for size in sizes])
    axes.set_xlabel("batch size")
    axes.set_ylabel(value.replace("_", " ") + " (mean ± std over seeds)")
    axes.set_title("Each cell at its best learning rate (x: could not train)", fontsize=10)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def plot_curves(rows: Sequence[dict[str, Any]], curves: Sequence[dict[str, Any]], value: str, path: Path) -> None:
    """Validation along training at each cell's chosen rate, mean over its seeds (how far from convergence)."""
    plt = _common.pyplot()
    figure, axes = plt.subplots(figsize=(6.5, 4), dpi=100)
    for row in rows:
        points: dict[int, list[float]] = {}
        for point in curves:
            if (point["norm"], point["batch_size"], point["lr"]) == (row["norm"], row["batch_size"], row["lr"]):
                points.setdefault(point["tokens"], []).append(point[value])
        if points:
            tokens = sorted(points)
            means = [sum(points[t]) / len(points[t]) for t in tokens]
            axes.plot(tokens, means, marker=".", label=f"{row['norm']} B={row['batch_size']} lr={row['lr']:g}")
    later = [point[value] for point in curves if point["tokens"] > 0]
    if later:  # the untrained model's loss (at 0 tokens) would squash the part of the curves that differs
        axes.set_ylim(min(later) - 0.05, max(later) + 0.05)
    axes.set_xlabel("training tokens seen")
    axes.set_ylabel(value.replace("_", " ") + " (running statistics for BN)")
    axes.set_title("Validation along training (mean over seeds, chosen rate)", fontsize=10)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def notes(args: argparse.Namespace, rows: Sequence[dict[str, Any]], facts: dict[str, Any]) -> list[str]:
    """The lines under the tables: budget, protocol, baseline, BN's small-batch policy, failures."""
    value, level = _data.value_name(facts["level"]), facts["level"]
    budget_text = f"{args.updates} updates" if args.updates else f"{args.tokens} training tokens"
    shape = {
        "window": f"windows of {args.steps} steps, batches drawn at random",
        "line": f"lines (pieces of at most {args.steps}), batches drawn at random",
        "stream": f"windows of {args.steps} steps read as B contiguous streams in order, each window starting from "
        "the previous one's final state (detached); validation reads its split as one stream",
    }[args.unit]
    if args.bucket:
        shape = shape.replace("batches drawn at random", "batches of similar lengths (BucketBatchSampler)")
    lines = [
        f"Equal budget: {budget_text} per run, in {shape}; {facts['train_tokens']} "
        f"training tokens in the split, {facts['val_tokens']} validation tokens. LSTM hidden {args.hidden}, "
        f"embedding {args.embedding}, Adam, gradient norm clipped at 1. val_loss is nats per real token, eval mode.",
        *_protocol.notes(args, facts["cache"]),
        f"No-context baseline (training-split token frequencies): val_loss {facts['unigram']:.4f}, {value} "
        f"{_data.loss_value(facts['unigram'], level):.4f}; a model below it has learned to use context.",
        "Per-timestep BN trains with the library's default small_batch='tail': a batch of one sequence raises the "
        "ValueError recorded as status; in a batch of B >= 2, a padded-tail step with one active row is normalized "
        "with that step's running statistics (fallback_per_update: such steps per update; 0 with fixed windows, "
        "where every step has all B rows). At B = 2 each feature of the two rows is normalized to -1 and +1 (a "
        "degenerate case).",
        f"batch_renorm uses a shortened schedule {_common.RENORM_SCHEDULE} (counted in batches per time step).",
    ]
    if args.evaluations:
        lines.append(
            f"last_gain: validation improvement over the last 1/{args.evaluations} of training (mean over seeds); "
            "curves.csv has every run's curve."
        )
    return lines + [f"Status `{error}`" for error in sorted({r["status"] for r in rows if r["status"] != "ok"})]


def extra_tables(
    args: argparse.Namespace, rows: Sequence[dict[str, Any]], value: str
) -> list[tuple[str, list[dict[str, Any]], list[str]]]:
    """The norm x batch size views: values, BN with exact statistics, updates, chosen rates, and the rate grid."""
    columns = ["norm", *summary_columns(rows)]
    bn_metric = "exact statistics" if args.bn_select == "exact" else "running averages"
    tables = [
        (
            f"{value}, mean ± std over seeds (norm x batch size; BN with {bn_metric}, its rate chosen on them)",
            summary(rows, value),
            columns,
        )
    ]
    paired = [row for row in rows if "paired" in row]
    if paired:
        tables.append(
            (
                f"Paired per-seed difference from the plain LSTM (none) of the same batch size, {value} (BN: "
                f"{bn_metric}): mean [95% t-interval], seeds where the sign held",
                by_batch_size(paired, lambda r: r["paired"]),
                columns,
            )
        )
    bn_rows = [row for row in rows if _protocol.uses_batch_statistics(row["norm"])]
    if bn_rows:
        running = by_batch_size(bn_rows, lambda r: outcome(r, value))
        exact = by_batch_size(bn_rows, lambda r: outcome(r, f"{value}_exact"))
        gap = by_batch_size(bn_rows, lambda r: outcome(r, "ema_gap"))
        other = by_batch_size(bn_rows, lambda r: r.get("lr_other_metric"))
        tables.append(
            (
                f"BN both ways (rate chosen on the {bn_metric}): {value} with running averages, with exact statistics "
                "(seqnorm.update_bn), ema_gap = running - exact, and the rate the other evaluation would choose",
                [{**r, "norm": f"{r['norm']} running"} for r in running]
                + [{**r, "norm": f"{r['norm']} exact"} for r in exact]
                + [{**r, "norm": f"{r['norm']} ema_gap"} for r in gap]
                + [{**r, "norm": f"{r['norm']} lr_other_metric"} for r in other],
                columns,
            )
        )
    tables.append(("Updates per run (norm x batch size)", by_batch_size(rows, lambda r: r["updates"]), columns))
    tables.append(("Chosen learning rate (norm x batch size)", by_batch_size(rows, lambda r: r["lr"]), columns))
    rates = sorted({float(key[3:]) for row in rows for key in row["grid"]})
    tables.append(
        (
            f"Learning-rate grid: mean {value} over the seeds run at each rate (n; * = chosen; rates beyond --lrs "
            "were added where the best was at an edge; lr_edge: still at an edge when the cap stopped it)",
            [
                {"norm": row["norm"], "batch_size": row["batch_size"], **row["grid"], "lr_edge": row["lr_edge"]}
                for row in rows
            ],
            ["norm", "batch_size", *[f"lr={lr:g}" for lr in rates], "lr_edge"],
        )
    )
    return tables


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    run = _common.RunLog(argv, NAME)
    args = parse_args(argv)
    rows, trials, facts = run_grid(args)
    value = _data.value_name(facts["level"])
    measured = [value, f"{value}_exact", "ema_gap", "val_loss", "val_loss_exact", "train_loss", "fallback_per_update"]
    measured += ["last_gain"] if args.evaluations else []
    columns = ["norm", "batch_size", "status", "lr", "seeds"]
    columns += [name for key in measured for name in (key, f"{key}_std")]
    columns += ["updates", "tokens", "seconds", "lr_chosen_on", "lrs_added", "lr_edge", "lr_other_metric"]
    columns += _protocol.PAIRED_COLUMNS
    columns += ["forget_bias"]
    _common.write_results(
        args.out,
        rows,
        columns,
        title=f"Batch-size sweep ({args.unit}s{', bucketed' if args.bucket else ''}): {value.replace('_', ' ')} by "
        f"norm and batch size; {_common.forget_bias_text(args)}",
        run=run,
        notes=notes(args, rows, facts),
        extra_tables=extra_tables(args, rows, value),
    )
    trial_columns = [
        "norm",
        "batch_size",
        "lr",
        "seed",
        "status",
        value,
        f"{value}_exact",
        "ema_gap",
        "val_loss",
        "val_loss_exact",
        "train_loss",
        "fallback_per_update",
        "last_gain",
        "updates",
        "tokens",
        "seconds",
    ]
    _common.write_csv(args.out / "trials.csv", trials, trial_columns)
    if facts["curves"]:
        _common.write_csv(
            args.out / "curves.csv", facts["curves"], ["norm", "batch_size", "lr", "seed", "tokens", value]
        )
        plot_curves(rows, facts["curves"], value, args.out / "learning_curves.png")
    plot(rows, value, args.out / "val_by_batch_size.png")
    return rows


if __name__ == "__main__":
    main()
