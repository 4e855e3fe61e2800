"""Why per-timestep BN struggles with small and ragged batches: three measurements, one row per batch size.

1. Effective batch size along variable-length batches. With one sentence (line) per sequence, the rows of a
   padded batch end at different steps, so per-timestep BN at step t sees only the rows still active. We batch the
   training lines as the library's ``BucketBatchSampler`` does (similar lengths together) and at random, and count:
   the mean share of active rows over the steps run, and the share of batches with a step where exactly one row is
   left, which ``small_batch="error"`` refuses and the default ``"tail"`` normalizes with that step's running
   statistics (the longest line is alone at its tail unless tied).
2. Train/eval discrepancy. A BN-LSTM trained on full windows (under the fair protocol of ``_protocol``: its
   learning rate from ``--lrs``, every measurement a mean over ``--seeds`` trained models) is evaluated on
   validation windows twice: in eval mode (running statistics) and in training mode (statistics of each validation
   batch of size B). The difference is what a BN model's predictions depend on its batch-mates.
3. Noise of batch statistics. From the trained model's pre-norm recurrent term ``W_hh h`` (read through the cell's
   ``observer`` hook) at every step, we draw many batches of B rows and measure the spread of their mean and
   variance estimates relative to the population's: sampling theory says about ``1/sqrt(B)`` for the mean and
   ``sqrt(2(B-1))/B`` for the (biased) variance of Gaussian data: at B = 4 the variance BN divides by is off by
   about 60% from batch to batch.

    python scripts/small_batch_statistics.py --quick
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _common
import _data
import _protocol
import torch
import torch.nn.functional as F

from seqnorm.data import BucketBatchSampler

NAME = "small_batch_statistics"
QUICK = {
    **_protocol.QUICK,
    "batch_sizes": [1, 2, 4, 8, 16, 32, 64],
    "steps": 25,
    "train_batch_size": 32,
    "tokens": 30_000,
    "hidden": 64,
    "embedding": 32,
    "val_tokens": 12_000,
}
FULL = {
    **_protocol.FULL,
    "batch_sizes": [1, 2, 4, 8, 16, 32, 64],
    "steps": 50,
    "train_batch_size": 32,
    "tokens": 100_000,
    "hidden": 128,
    "embedding": 32,
    "val_tokens": None,
}
DRAWS = 200  # random batches per (batch size, step) for the noise estimates


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _common.make_parser(__doc__, NAME)
    parser.add_argument("--batch-sizes", nargs="+", type=_common.positive_int)
    parser.add_argument("--steps", type=_common.positive_int, help="time steps of the BN model's training windows")
    parser.add_argument("--train-batch-size", type=_common.positive_int)
    parser.add_argument("--tokens", type=_common.positive_int, help="training tokens of the BN model")
    parser.add_argument("--hidden", type=_common.positive_int)
    parser.add_argument("--embedding", type=_common.positive_int)
    parser.add_argument("--val-tokens", type=_common.positive_int)
    parser.add_argument(
        "--max-length", type=_common.positive_int, default=128, help="lines are cut into pieces of this many ids"
    )
    _protocol.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.trials_cache is not None:
        parser.error("--trials-cache: this script measures the trained models themselves, which a cache cannot keep")
    return _common.resolve(args, QUICK, FULL)


# --- 1. effective batch size -----------------------------------------------------------------------------------------


def line_lengths(args: argparse.Namespace) -> list[int]:
    """Input lengths of the training lines (natural units) of the corpus."""
    corpus = _data.open_corpus(args, "line", args.max_length)
    return list(corpus.datasets["train"].lengths)  # type: ignore[attr-defined]


def batches_of(lengths: list[int], batch_size: int, bucketed: bool, seed: int) -> list[torch.Tensor]:
    """Length tensors of one epoch's full batches, bucketed by the library's sampler or drawn at random."""
    if bucketed:
        indices = list(BucketBatchSampler(lengths, batch_size, shuffle=True, drop_last=True, seed=seed))
    else:
        order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
        indices = [order[i : i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]
    return [torch.tensor([lengths[i] for i in batch]) for batch in indices]


def effective_batch(
    lengths: list[int], batch_size: int, bucketed: bool, seed: int
) -> tuple[dict[str, float], torch.Tensor]:
    """Share of active rows, share of batches that raise, and the share of active rows by step ``(max_len,)``.

    The by-step share is over the batches still running at that step (the steps BN actually normalizes).
    """
    batches = batches_of(lengths, batch_size, bucketed, seed)
    longest = max(lengths)
    active_sum, running = torch.zeros(longest), torch.zeros(longest)
    active_share, raising = 0.0, 0
    for batch in batches:
        active = (batch.unsqueeze(0) > torch.arange(longest).unsqueeze(1)).sum(1)  # (max_len,) active rows per step
        run = int(batch.max())
        active_sum += active
        running[:run] += 1
        active_share += float(active[:run].sum()) / (batch_size * run)
        raising += int(bool((active[:run] < 2).any()))
    count = max(len(batches), 1)
    by_step = active_sum / (batch_size * running)  # nan where no batch runs
    return {"active_share": active_share / count, "raising_batches": raising / count}, by_step


# --- 2. train/eval discrepancy, 3. noise -----------------------------------------------------------------------------


@torch.no_grad()
def train_eval_gap(model: torch.nn.Module, windows: _common.Sequences, batch_size: int) -> float:
    """Validation loss with batch statistics of each batch of ``batch_size`` minus the loss with running ones, on
    the same windows: the first ``N - N % batch_size`` (on a copy: running statistics untouched)."""
    model = copy.deepcopy(model)
    usable = len(windows) - len(windows) % batch_size
    totals = {False: 0.0, True: 0.0}  # evaluation first: training mode moves the copy's running statistics
    for training in totals:
        model.train(training)
        for start in range(0, usable, batch_size):
            logits = model(windows.inputs[start : start + batch_size])
            targets = windows.targets[start : start + batch_size].flatten()
            totals[training] += float(F.cross_entropy(logits.flatten(0, 1), targets))
    return (totals[True] - totals[False]) / (usable // batch_size)


@torch.no_grad()
def recurrent_terms(model: torch.nn.Module, windows: _common.Sequences) -> torch.Tensor:
    """The pre-norm recurrent term ``W_hh h`` of the first layer at every step, eval mode: ``(T, N, 4H)``."""
    steps: dict[int, list[torch.Tensor]] = {}

    def keep(module: torch.nn.Module, inputs: tuple[dict[str, Any]], output: None) -> None:
        steps.setdefault(inputs[0]["step"], []).append(inputs[0]["recurrent_raw"])

    handle = model.rnn.cells[0].observer.register_forward_hook(keep)
    try:
        _common.evaluate(model, windows)
    finally:
        handle.remove()
    return torch.stack([torch.cat(steps[t]) for t in sorted(steps)])


def statistic_noise(population: torch.Tensor, batch_size: int, seed: int) -> tuple[float, float]:
    """Median over steps and features of std(batch mean)/sigma and std(batch variance)/sigma^2.

    ``population`` is ``(T, N, F)``; step 0 is skipped (``h_0 = 0`` makes its recurrent term constant).
    """
    generator = torch.Generator().manual_seed(seed)
    mean_noise, var_noise = [], []
    for values in population[1:]:  # (N, F)
        sigma2 = values.var(0, correction=0)
        varying = sigma2 > 1e-8 * sigma2.max().clamp(min=1e-30)
        if not varying.any():
            continue
        rows = torch.rand(DRAWS, values.shape[0], generator=generator).argsort(1)[:, :batch_size]  # without repl.
        sample = values[rows][:, :, varying]  # (DRAWS, B, F')
        mean_noise.append(sample.mean(1).std(0) / sigma2[varying].sqrt())
        if batch_size > 1:
            var_noise.append(sample.var(1, correction=0).std(0) / sigma2[varying])
    mean = float(torch.cat(mean_noise).median()) if mean_noise else math.nan
    var = float(torch.cat(var_noise).median()) if var_noise else math.nan
    return mean, var


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    run = _common.RunLog(argv, NAME)
    args = parse_args(argv)
    lengths = line_lengths(args)
    corpus, windows = _common.load_windows(args, args.steps)
    train, val = windows["train"], windows["val"].head(args.val_tokens)
    models: dict[tuple[float, int], torch.nn.Module] = {}

    def train_one(lr: float, seed: int) -> dict[str, Any]:
        model = _common.build_model(corpus.vocab_size, args, "batch", max_steps=args.steps, seed=seed)
        row, _ = _protocol.trial(
            model,
            train,
            norm="batch",
            measure=lambda m: {"val_loss": _common.evaluate(m, val)[0]},
            stats_tokens=args.bn_stats_tokens,
            gap_key="val_loss",
            batch_size=args.train_batch_size,
            tokens=args.tokens,
            lr=lr,
            seed=seed,
        )
        models[(lr, seed)] = model
        return row

    # The BN model is trained under the fair protocol; the measurements below are means over its seeds.
    key = _protocol.selection_key("batch", args)
    cell = _protocol.run_cell(
        train_one, args.lrs, args.seeds, args.select, key, extensions=args.lr_extensions, select_seeds=args.select_seeds
    )
    if cell.lr is None:
        raise SystemExit(f"{NAME}: the BN model did not train: {cell.trials[0]['status']}")
    trained = _protocol.summarize(cell, key, _protocol.other_key("batch", args))
    chosen = [models[(cell.lr, row["seed"])] for row in cell.chosen]
    populations = [recurrent_terms(model, val) for model in chosen]  # each (T, N, 4H)
    population = populations[0]
    rows, by_step = [], {}
    for batch_size in args.batch_sizes:
        row: dict[str, Any] = {"batch_size": batch_size}
        for bucketed, label in ((True, "bucketed"), (False, "random")):
            measured, by_step[(batch_size, label)] = effective_batch(lengths, batch_size, bucketed, args.seed)
            row[f"active_share_{label}"] = measured["active_share"]
            row[f"raising_batches_{label}"] = measured["raising_batches"]
        if batch_size <= population.shape[1]:
            noise = [statistic_noise(p, batch_size, seed) for seed, p in enumerate(populations)]
            row["mean_noise"] = statistics.fmean(mean for mean, _ in noise)
            row["var_noise"] = statistics.fmean(var for _, var in noise)
            finite = math.sqrt((population.shape[1] - batch_size) / (population.shape[1] - 1))
            row["mean_noise_theory"] = finite / math.sqrt(batch_size)
            # BN divides by the biased variance; for Gaussian data its relative std is sqrt(2 (B-1)) / B, times
            # (approximately) the same finite-population factor, the batches being drawn without replacement.
            theory = finite * math.sqrt(2 * (batch_size - 1)) / batch_size
            row["var_noise_theory"] = theory if batch_size > 1 else math.nan
        row["eval_mode_loss"] = trained["val_loss"]
        row["eval_mode_loss_exact"] = trained["val_loss_exact"]
        try:
            gaps = [train_eval_gap(model, val, batch_size) if batch_size <= len(val) else math.nan for model in chosen]
            row["train_eval_gap"] = statistics.fmean(gaps)
            spread = len(gaps) > 1 and all(math.isfinite(gap) for gap in gaps)  # nan: fewer windows than B
            row["train_eval_gap_std"] = statistics.stdev(gaps) if spread else math.nan
            row["train_mode_loss"] = trained["val_loss"] + row["train_eval_gap"]
            row["train_mode_status"] = "ok"
        except ValueError as error:
            row["train_mode_status"] = _common.describe_error(error)
        rows.append(row)
        print(f"  batch {batch_size}: done", flush=True)
    columns = [
        "batch_size",
        "active_share_bucketed",
        "raising_batches_bucketed",
        "active_share_random",
        "raising_batches_random",
        "mean_noise",
        "mean_noise_theory",
        "var_noise",
        "var_noise_theory",
        "eval_mode_loss",
        "eval_mode_loss_exact",
        "train_mode_loss",
        "train_eval_gap",
        "train_eval_gap_std",
        "train_mode_status",
    ]
    notes = [
        f"1. {len(lengths)} training lines of {corpus.source} (input lengths {min(lengths)}..{max(lengths)}). "
        "active_share: mean share of a batch's rows still active, over the steps the batch runs; raising_batches: "
        "share of batches with a step where < 2 rows are active (small_batch='error' raises there; the default "
        "'tail' normalizes that step with its running statistics).",
        f"2. BN-LSTM (hidden {args.hidden}) trained on {trained['tokens']:.0f} tokens of {args.steps}-step windows at "
        f"batch {args.train_batch_size}, lr {cell.lr} chosen from {args.lrs} ({args.select} rule; added past an "
        f"edge: {trained['lrs_added'] or 'none'}, of at most {args.lr_extensions}"
        f"{'; still at the ' + cell.edge + ' edge' if cell.edge else ''}) on the "
        f"{'exact statistics' if key.endswith('_exact') else 'running averages'} (--bn-select {args.bn_select}; "
        f"the other would choose {trained['lr_other_metric']}), {_common.forget_bias_text(args)}, {len(chosen)} "
        f"seeds ({trained['seconds']:.1f} s each); losses in nats per token on {len(val)} validation windows, "
        "means over the seeds (train_eval_gap_std: their spread); train_eval_gap compares both modes on the same "
        "windows, the first N - N mod B (train_mode_loss = eval_mode_loss + that gap); eval_mode_loss_exact after "
        f"seqnorm.update_bn over {args.bn_stats_tokens} training tokens.",
        f"3. Noise: median over steps 1..{args.steps - 1} and the {population.shape[2]} features of the pre-norm "
        f"recurrent term, {DRAWS} random batches drawn without replacement from {population.shape[1]} validation "
        "windows; theory: sqrt((N-B)/(N-1))/sqrt(B) for the mean, sqrt((N-B)/(N-1)) sqrt(2(B-1))/B (approximately) "
        "for the biased variance of Gaussian data (what BN divides by).",
    ]
    _common.write_results(
        args.out, rows, columns, title="Small-batch statistics of per-timestep BN", run=run, notes=notes
    )
    by_step_rows = [
        {"batch_size": b, "batching": label, "step": t, "active_share_when_running": float(curve[t])}
        for (b, label), curve in by_step.items()
        for t in range(len(curve))
    ]
    _common.write_csv(
        args.out / "effective_batch_by_step.csv",
        by_step_rows,
        ["batch_size", "batching", "step", "active_share_when_running"],
    )
    plot(rows, by_step, args.out / "small_batch_statistics.png")
    return rows


def plot(rows: list[dict[str, Any]], by_step: dict[tuple[int, str], torch.Tensor], path: Path) -> None:
    """Three panels: the share of rows still active along the steps (bucketed and random batches, one colour
    each, one line style per batch size), the noise of the batch statistics against theory, and BN's train/eval gap
    against the batch size it normalizes with."""
    plt = _common.pyplot()
    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.2), dpi=90)
    shown = [size for size in sorted({size for size, _ in by_step}) if size >= 4][-2:]  # two sizes stay legible
    for batching, color in (("bucketed", "C0"), ("random", "C3")):
        for batch_size, style in zip(shown, ("-", "--"), strict=False):
            curve = by_step[(batch_size, batching)].numpy()
            left.plot(curve, style, color=color, linewidth=1.6, label=f"{batching} batches, B={batch_size}")
    left.set_xlabel("time step t")
    left.set_ylabel("active rows / B (batches still running at t)")
    left.set_title("Effective batch along variable-length lines", fontsize=10)
    left.set_ylim(0, 1.05)
    left.legend(fontsize=8, loc="lower left")
    noisy = [r for r in rows if r["batch_size"] > 1 and not math.isnan(r.get("var_noise", math.nan))]
    sizes = [r["batch_size"] for r in noisy]
    names = {"mean_noise": "batch mean: std / population std", "var_noise": "batch variance: std / population var"}
    for (key, marker), color in zip((("mean_noise", "o"), ("var_noise", "s")), ("C0", "C1"), strict=True):
        middle.loglog(sizes, [r[key] for r in noisy], marker=marker, color=color, label=f"{names[key]} (measured)")
        middle.loglog(sizes, [r[f"{key}_theory"] for r in noisy], ":", color=color, linewidth=1.2,
                      label=f"{names[key].split(':')[0]}: sampling theory")  # fmt: skip
    middle.minorticks_off()
    middle.set_xticks(sizes, [str(size) for size in sizes])
    middle.set_yticks([0.1, 0.2, 0.5, 1.0], ["0.1", "0.2", "0.5", "1"])
    middle.set_xlabel("batch size B")
    middle.set_ylabel("relative spread of the batch estimate")
    middle.set_title("Noise of per-timestep batch statistics", fontsize=10)
    middle.legend(fontsize=7)
    gaps = [r for r in rows if not math.isnan(float(r.get("train_eval_gap", math.nan) or math.nan))]
    if gaps:
        right.errorbar(
            [r["batch_size"] for r in gaps],
            [r["train_eval_gap"] for r in gaps],
            yerr=[r.get("train_eval_gap_std", 0.0) or 0.0 for r in gaps],
            marker="o",
            capsize=3,
        )
        right.set_xscale("log")  # the gap itself on a linear scale: near 0 at large B, and it may be negative
        right.axhline(0.0, color="gray", linewidth=0.8)
        right.minorticks_off()
        right.set_xticks([r["batch_size"] for r in gaps], [str(r["batch_size"]) for r in gaps])
    right.set_xlabel("batch size B of the validation batches")
    right.set_ylabel("loss in training mode − eval mode (nats/char)")
    right.set_title("BN's train/eval gap (mean ± std over seeds)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


if __name__ == "__main__":
    main()
