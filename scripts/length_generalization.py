"""Train on windows of T steps, evaluate on windows of L > T steps: validation loss by position, per norm.

Per-timestep BN has running statistics only for the steps it was trained on. With ``max_steps=T`` (the library's
design, after Cooijmans et al.) every step ``t >= T`` reuses the statistics of step ``T - 1``; the extra row
``batch`` with ``max_steps=L`` shows the alternative, statistics rows for steps ``T..L-1`` that training never
reached (still at their initial mean 0, variance 1), and the row ``batch`` with ``beyond_max_steps="pooled"`` the
library's other policy: steps ``t >= T`` use the pooled statistics of all T steps. LayerNorm and the others need no
statistics of any step.
The corpus is read as one stream, so the text at position 150 is no harder than at position 15: a model that
generalizes in length keeps a flat loss past T. Every variant follows the fair protocol of ``_protocol`` (its own
learning rate from ``--lrs``, extended past an edge, chosen on the loss within T, for BN with the statistics of
``--bn-select``; mean ± std over ``--seeds``; BN also with exact statistics; the same ``--forget-bias`` for every
norm; ``diff_vs_none``: the paired per-seed difference of ``loss_beyond_T`` from the plain LSTM).

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
import _protocol
import torch

import seqnorm
from seqnorm.norms import NormSpec

NAME = "length_generalization"
QUICK = {
    **_protocol.QUICK,
    "norms": ["none", "layer", "batch"],
    "steps": 25,
    "eval_steps": 100,
    "batch_size": 16,
    "tokens": 30_000,
    "hidden": 64,
    "embedding": 32,
    "val_tokens": 10_000,
}
FULL = {
    **_protocol.FULL,
    "norms": ["none", "layer", "rms", "batch", "batch_renorm"],
    "steps": 50,
    "eval_steps": 200,
    "batch_size": 32,
    "tokens": 150_000,
    "hidden": 128,
    "embedding": 32,
    "val_tokens": None,
}
MEASURED = ["loss_within_T", "loss_beyond_T", "loss_last_quarter", "beyond_minus_within"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _common.make_parser(__doc__, NAME)
    parser.add_argument("--norms", nargs="+", choices=list(seqnorm.NORMS))
    parser.add_argument("--steps", type=_common.positive_int, help="T: time steps of the training windows")
    parser.add_argument(
        "--eval-steps", type=_common.positive_int, help="L: time steps of the validation windows (more than T)"
    )
    parser.add_argument("--batch-size", type=_common.positive_int)
    parser.add_argument("--tokens", type=_common.positive_int, help="training tokens per model")
    parser.add_argument("--hidden", type=_common.positive_int)
    parser.add_argument("--embedding", type=_common.positive_int)
    parser.add_argument("--val-tokens", type=_common.positive_int, help="validation tokens (default: the whole split)")
    parser.add_argument(
        "--no-untrained-stats", action="store_true", help="skip the BN row with statistics rows up to L"
    )
    parser.add_argument("--no-pooled", action="store_true", help="skip the BN row with beyond_max_steps='pooled'")
    _protocol.add_arguments(parser)
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
    train, val = train_windows["train"], long_windows["val"].head(args.val_tokens)
    print(f"{corpus.source}: train on {T} steps ({args.tokens} tokens), evaluate {len(val)} windows of {L} steps")
    rows, curves, trials = [], {}, []
    cache = _protocol.TrialCache.for_args(args, NAME)
    for norm, max_steps, beyond in variants(args):
        spec = seqnorm.NORMS[norm].spec(beyond_max_steps=beyond) if beyond != "last" else norm

        def train_one(
            lr: float, seed: int, norm: str = norm, spec: str | NormSpec = spec, max_steps: int = max_steps
        ) -> dict:
            model = _common.build_model(corpus.vocab_size, args, spec, max_steps=max_steps, seed=seed)
            positions: list[torch.Tensor] = []

            def measure(model: torch.nn.Module) -> dict[str, float]:
                positions.append(_common.evaluate(model, val)[1])  # (L,)
                within, past = float(positions[-1][:T].mean()), float(positions[-1][T:].mean())
                # The rate is chosen on positions the training length covers, not on the generalization measured.
                return {
                    "val_loss": within,
                    "loss_within_T": within,
                    "loss_beyond_T": past,
                    "loss_last_quarter": float(positions[-1][-L // 4 :].mean()),
                    "beyond_minus_within": past - within,
                }

            row, _ = _protocol.trial(
                model,
                train,
                norm=norm,
                measure=measure,
                stats_tokens=args.bn_stats_tokens,
                gap_key="loss_beyond_T",
                batch_size=args.batch_size,
                tokens=args.tokens,
                lr=lr,
                seed=seed,
            )
            row["by_position"] = positions[0].tolist() if positions else []  # running statistics (the first)
            return row

        name = f"{norm}|max_steps={max_steps}|{beyond}"
        key = _protocol.selection_key(norm, args)
        cell = _protocol.run_cell(
            train_one, args.lrs, args.seeds, args.select, key, cache, name, args.lr_extensions, args.select_seeds
        )
        label = f"{norm} (max_steps={max_steps}{', pooled' if beyond == 'pooled' else ''})"
        trials += [{"variant": label, **row} for row in cell.trials]
        row: dict[str, Any] = {
            "norm": norm,
            "max_steps": max_steps,
            "stats_beyond_T": beyond_note(norm, max_steps, T, beyond),
            **_protocol.summarize(cell, key, _protocol.other_key(norm, args)),
            "headline": "loss_beyond_T" + key.removeprefix("val_loss"),
            "chosen": cell.chosen,
            "forget_bias": args.forget_bias,
        }
        chosen = [torch.tensor(t["by_position"]) for t in cell.chosen if t["by_position"]]
        if chosen:
            curves[label] = torch.stack(chosen).mean(0)
        rows.append(row)
        print(f"  {label}: {row.get('beyond_minus_within', float('nan')):+.4f} (lr {row['lr']})", flush=True)

    _protocol.add_paired(rows, lambda row: None)  # every variant against the plain LSTM
    columns = ["norm", "max_steps", "stats_beyond_T", "status", "lr", "seeds"]
    measured = [*MEASURED, "loss_within_T_exact", "loss_beyond_T_exact", "beyond_minus_within_exact", "ema_gap"]
    columns += [name for key in measured for name in (key, f"{key}_std") if any(name in row for row in rows)]
    columns += ["seconds", "lr_chosen_on", "lrs_added", "lr_edge", "lr_other_metric", *_protocol.PAIRED_COLUMNS]
    columns.append("forget_bias")
    summary = [
        {
            "variant": label,
            "lr": r["lr"],
            "lr_edge": r["lr_edge"],
            **{
                key: _protocol.pm(r[key], r[f"{key}_std"]) if key in r else ""
                for key in [*MEASURED, "beyond_minus_within_exact"]
            },
            "diff_vs_none": r.get("paired", ""),
        }
        for label, r in zip(curves if len(curves) == len(rows) else [r["norm"] for r in rows], rows, strict=True)
    ]
    notes = [
        f"T = {T} training steps, L = {L} evaluation steps; LSTM hidden {args.hidden}, batch {args.batch_size}, "
        f"{args.tokens} training tokens. Losses in nats per token, eval mode, averaged over "
        f"{len(val)} validation windows; loss_within_T is positions 0..{T - 1}, loss_beyond_T positions {T}..{L - 1}.",
        *_protocol.notes(args, cache),
        "The learning rate is chosen on loss_within_T (the training length), so the choice does not look at the "
        "generalization being measured; for BN, ema_gap is on loss_beyond_T.",
        "Position 0 has no context, so loss_within_T includes the cold start; beyond_minus_within near or below 0 "
        "means no degradation past the training length.",
        f"batch_renorm uses the shortened schedule {_common.RENORM_SCHEDULE} (counted in batches per time step).",
    ]
    _common.write_results(
        args.out,
        rows,
        columns,
        title=f"Length generalization: train T={T}, evaluate L={L}; {_common.forget_bias_text(args)}",
        run=run,
        notes=notes,
        extra_tables=[
            (
                "Mean ± std over seeds (nats per token); diff_vs_none: paired per-seed difference of loss_beyond_T "
                "(BN: on its headline statistics) from the plain LSTM: mean [95% t-interval], seeds where the sign "
                "held",
                summary,
                ["variant", "lr", "lr_edge", *MEASURED, "beyond_minus_within_exact", "diff_vs_none"],
            )
        ],
    )
    _common.write_csv(
        args.out / "loss_by_position.csv",
        [{"position": t, **{name: float(c[t]) for name, c in curves.items()}} for t in range(L)],
        ["position", *curves],
    )
    _common.write_csv(
        args.out / "trials.csv",
        trials,
        [
            "variant",
            "lr",
            "seed",
            "status",
            *MEASURED,
            "loss_beyond_T_exact",
            "ema_gap",
            "updates",
            "tokens",
            "seconds",
        ],
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
