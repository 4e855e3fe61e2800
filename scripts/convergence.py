"""Norms near convergence: the plain LSTM, LN, RMS and BN trained to a plateau at batch 1 and 32, windows of 100 and
400, with learning curves, paired differences and the gradient norm through time.

The equal-token sweeps measure the first minutes of training (at batch 32 a few dozen Adam updates); the papers'
comparisons are at convergence. Here every cell (norm, batch size B, window length T) trains for a fixed number of
updates (``--updates``: at least 3000; batch 1 gets more by default, its updates carry 32x fewer tokens), on fixed
windows of T characters drawn at random, and records:

- the validation learning curve (``--evaluations`` points), so a plateau can be shown (``gain_last_fifth``: how
  much the last fifth of the updates still gained);
- the gradient norm ``||dL/dh_t||`` of the first layer's hidden state at every step t (through the cell's
  ``observer`` hook, in training mode on a copy of the model, ``--grad-rows`` validation windows in batches of
  B): ``grad_total`` for L the window's mean loss (what training follows) and ``grad_last`` for L the loss at the
  window's last position alone (how far back the last prediction's gradient reaches), at ``--grad-points``
  points of training: the mechanism normalization is supposed to change;
- the final validation loss (BN also with exact statistics, ``seqnorm.update_bn``), mean ± std over ``--seeds``,
  and the paired per-seed difference from the plain LSTM of the same (B, T) (``_protocol.paired_difference``).

Learning rates (``_protocol``): each cell chooses its rate from ``--lrs`` with the self-extending grid
(``--lr-extensions``) on a shorter budget, ``--select-fraction`` of its updates (seed 0 under ``--select first``,
the default), then trains every seed at that rate for the full budget. A short budget favours larger rates than a
long one would; ``--lr RATE`` instead gives every cell that rate.

Resumable: every finished run (selection and final) is appended to ``--trials-cache`` (default
``<out>/runs.jsonl``) and read back when the same command runs again, so a killed run restarts at the run it was
in, and finished cells are skipped. Two processes can share the work (one per core) by splitting the cells, e.g.
``--seq-lens 100`` and ``--seq-lens 400`` with the same ``--out``; running the full command afterwards reads every
run back and writes the complete tables and plots.

    python scripts/convergence.py --quick                                     # tiny, the embedded corpus
    python scripts/convergence.py --text tinyshakespeare.txt --out docs/results/convergence  # the full grid (hours)
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
from torch import nn

import seqnorm

NAME = "convergence"
QUICK = {
    **_protocol.QUICK,
    "norms": ["none", "layer", "batch"],
    "batch_sizes": [1, 8],
    "seq_lens": [16],
    "updates": ["40"],
    "select": "first",
    "hidden": 32,
    "embedding": 16,
    "val_tokens": 4_000,
    "evaluations": 4,
    "grad_points": 2,
    "grad_rows": 8,
}
FULL = {
    **_protocol.FULL,
    "norms": ["none", "layer", "rms", "batch"],
    "batch_sizes": [1, 32],
    "seq_lens": [100, 400],
    # batch 1's updates carry 32x fewer tokens than batch 32's: 20000 of them (2 epochs of tinyshakespeare at
    # T = 100) cost less CPU time than 3000 at batch 32 and get nearer its plateau
    "updates": ["1:20000", "3000"],
    "select": "first",
    "hidden": 128,
    "embedding": 32,
    "val_tokens": None,
    "evaluations": 20,
    "grad_points": 4,
    "grad_rows": 32,
}


def updates_item(text: str) -> tuple[int | None, int]:
    """An argparse ``type`` for ``--updates``: ``N`` (every batch size) or ``B:N`` (batch size B)."""
    batch, colon, count = text.rpartition(":")
    try:
        pair = (int(batch) if colon else None, int(count))
    except ValueError:
        pair = (0, 0)
    if pair[1] < 1 or (pair[0] is not None and pair[0] < 1):
        raise argparse.ArgumentTypeError(f"expected N or B:N with integers >= 1, got {text!r}")
    return pair


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _common.make_parser(__doc__, NAME)  # --out results/convergence, as every script's (never docs/)
    parser.add_argument("--norms", nargs="+", choices=list(seqnorm.NORMS), help="norms to compare")
    parser.add_argument("--batch-sizes", nargs="+", type=_common.positive_int, help="batch sizes")
    parser.add_argument("--seq-lens", nargs="+", type=_common.positive_int, help="window lengths T (time steps)")
    parser.add_argument(
        "--updates",
        nargs="+",
        help="updates per run: N for every batch size, B:N for batch size B (default 1:20000 3000)",
    )
    parser.add_argument(
        "--select-fraction",
        type=_common.positive_float,
        default=0.25,
        help="the rate is chosen on runs of this fraction of the updates (default 0.25)",
    )
    parser.add_argument("--lr", type=_common.positive_float, help="one learning rate for every cell (no selection)")
    parser.add_argument("--hidden", type=_common.positive_int, help="LSTM hidden size")
    parser.add_argument("--embedding", type=_common.positive_int, help="embedding size")
    parser.add_argument(
        "--val-tokens", type=_common.positive_int, help="validation tokens (default: the whole validation split)"
    )
    parser.add_argument("--evaluations", type=_common.positive_int, help="validation points along each run")
    parser.add_argument(  # at least the start and the end
        "--grad-points", type=_common.at_least_two, help="gradient profiles along each run (>= 2)"
    )
    parser.add_argument("--grad-rows", type=_common.positive_int, help="validation windows per gradient profile")
    parser.add_argument(
        "--report",
        choices=("val", "test"),
        default="val",
        help="the headline: val (the validation loss at the end, which also chose the rate) or test (the held-out "
        "test split at the best-validation point of each run; the last point's test number beside it)",
    )
    parser.add_argument(
        "--gamma-init",
        type=_common.positive_float,
        help="initial gain of every norm (the spec's gamma_init; default each norm's own: 0.1 for BN, 1 for LN/RMS)",
    )
    _protocol.add_arguments(parser)
    args = parser.parse_args(argv)
    args = _common.resolve(args, QUICK, FULL)
    try:
        args.updates = budgets([updates_item(item) for item in args.updates], args.batch_sizes)
    except argparse.ArgumentTypeError as error:
        parser.error(f"argument --updates: {error}")
    if args.select_fraction > 1:
        parser.error(f"argument --select-fraction: expected a number in (0, 1], got {args.select_fraction}")
    if args.trials_cache is None:
        args.trials_cache = args.out / "runs.jsonl"
    return args


def budgets(items: Sequence[tuple[int | None, int]], batch_sizes: Sequence[int]) -> dict[int, int]:
    """Updates per batch size from ``--updates`` items (``B:N`` wins over a plain ``N``)."""
    default = next((count for batch, count in reversed(items) if batch is None), None)
    given = {batch: count for batch, count in items if batch is not None}
    missing = [size for size in batch_sizes if size not in given and default is None]
    if missing:
        raise argparse.ArgumentTypeError(f"no count for batch size {missing[0]}: add N or {missing[0]}:N")
    return {size: given.get(size, default) for size in batch_sizes}  # type: ignore[misc]


# --- measurements ----------------------------------------------------------------------------------------------------


def gradient_through_time(
    model: nn.Module, windows: _data.Sequences, batch_size: int, rows: int
) -> tuple[list[float], list[float]]:
    """Mean over ``rows`` windows (at least one batch) of ``||dL/dh_t||`` at every step t of the first layer: for L
    the window's mean loss (``total``) and for L the loss at its last position (``last``). Training mode (BN with the
    statistics of batches of ``batch_size``, as in training) on a copy, so the model's running statistics stay
    untouched."""
    probe = copy.deepcopy(model).train()
    steps = windows.steps
    total, last = torch.zeros(steps, dtype=torch.float64), torch.zeros(steps, dtype=torch.float64)
    states: dict[int, torch.Tensor] = {}

    def keep(module: nn.Module, inputs: tuple[dict[str, Any]], output: None) -> None:
        states[inputs[0]["step"]] = inputs[0]["h"]  # (B, H), in the graph of the loss

    handle = probe.rnn.cells[0].observer.register_forward_hook(keep)
    count = 0
    try:
        # at least one batch: fewer rows than B would leave BN without its training-time batch
        for start in range(0, min(max(rows, batch_size), len(windows)) - batch_size + 1, batch_size):
            batch = windows.batch(torch.arange(start, start + batch_size))
            states.clear()
            losses = F.cross_entropy(probe(batch.inputs).transpose(1, 2), batch.targets, reduction="none")  # (B, T)
            h = [states[t] for t in range(steps)]
            whole = torch.autograd.grad(losses.mean(1).sum(), h, retain_graph=True)
            final = torch.autograd.grad(losses[:, -1].sum(), h)
            total += torch.stack([g.norm(dim=1) for g in whole]).sum(1).double()  # (T,): summed over rows
            last += torch.stack([g.norm(dim=1) for g in final]).sum(1).double()
            count += batch_size
    finally:
        handle.remove()
    return (total / max(count, 1)).tolist(), (last / max(count, 1)).tolist()


def run_one(
    args: argparse.Namespace,
    corpus: Any,
    data: dict[str, _data.Sequences],
    norm: str,
    batch_size: int,
    updates: int,
    lr: float,
    seed: int,
    profile: bool,
) -> dict[str, Any]:
    """One training run of ``updates`` updates; with ``profile``, its learning curve, gradient profiles and, where
    ``data`` has a test split, the test loss at the last point (``test_loss``) and at the point of the curve with
    the best validation loss (``best_test_loss``, at update ``best_update``: the checkpoint early stopping keeps)."""
    train, val, test = data["train"], data["val"], data.get("test") if profile else None
    steps = train.steps
    value = _data.value_name(corpus.level)
    model = _common.build_model(corpus.vocab_size, args, norm, max_steps=steps, seed=seed)
    grads: list[dict[str, Any]] = []
    tokens_per_update = batch_size * steps  # fixed windows: every row is T tokens long
    # train_language_model evaluates before the first update, every `step` updates, and at the end
    step = max(1, updates // args.evaluations)
    calls = sorted({min(i * step, updates) for i in range(updates // step + 2)})
    targets = {
        min(calls, key=lambda at: abs(at - k * updates / (args.grad_points - 1))) for k in range(args.grad_points)
    }
    made = iter(calls)

    def measure(module: nn.Module) -> dict[str, float]:
        loss = _common.evaluate(module, val)[0]
        measured = {"val_loss": loss, value: _data.loss_value(loss, corpus.level)}
        if test is not None:
            test_loss = _common.evaluate(module, test)[0]
            measured.update(test_loss=test_loss, **{_test_name(value): _data.loss_value(test_loss, corpus.level)})
        return measured

    best: dict[str, Any] = {}  # the best validation point so far: its update and the model's state then

    def along(module: nn.Module) -> float:
        """A point of the learning curve, and a gradient profile where one is due (training pauses)."""
        update = next(made)
        if update in targets:
            total, last = gradient_through_time(module, val, batch_size, args.grad_rows)
            grads.append({"update": update, "total": total, "last": last})
        loss = _common.evaluate(module, val)[0]
        if test is not None and update > 0 and loss < best.get("val_loss", math.inf):
            best.update(val_loss=loss, update=update, state=copy.deepcopy(module.state_dict()))
        return loss

    row, result = _protocol.trial(
        model,
        train,
        norm=norm,
        measure=measure,
        stats_tokens=args.bn_stats_tokens,
        gap_key=value,
        batch_size=batch_size,
        tokens=0,
        max_updates=updates,
        lr=lr,
        seed=seed,
        evaluate_every=step * tokens_per_update if profile else None,
        evaluate_fn=along if profile else None,
    )
    row["ms_per_update"] = 1000 * result.seconds / max(result.updates, 1)
    if best and result.status == "ok":
        row.update(best_checkpoint(model, best, measure, norm, train, args.bn_stats_tokens))
    if profile and result.status == "ok":
        row["curve"] = [[tokens // tokens_per_update, loss] for tokens, loss in result.curve]
        row["grads"] = grads
        fifth = [loss for update, loss in row["curve"] if update <= 0.8 * result.updates][-1]
        row["gain_last_fifth"] = _data.loss_value(fifth, corpus.level) - _data.loss_value(
            row["curve"][-1][1], corpus.level
        )
    return row


def _test_name(value: str) -> str:
    """The test twin of a validation metric's name: ``val_bpc`` -> ``test_bpc``."""
    return "test_" + value.removeprefix("val_")


def best_checkpoint(
    model: nn.Module,
    best: dict[str, Any],
    measure: Any,
    norm: str,
    train: _data.Sequences,
    stats_tokens: int,
) -> dict[str, Any]:
    """The metrics of ``model`` with the state of its best validation point (``best``): each metric of
    ``measure`` as ``best_<metric>`` (BN also with exact statistics, ``best_<metric>_exact``), and
    ``best_update``."""
    kept = copy.deepcopy(model)
    kept.load_state_dict(best["state"])
    measured = {f"best_{key}": value for key, value in measure(kept).items()}
    if _protocol.uses_batch_statistics(norm):
        exact = measure(_protocol.exact_statistics(kept, train, stats_tokens))
        measured.update({f"best_{key}_exact": value for key, value in exact.items()})
    return {**measured, "best_update": best["update"]}


# --- the grid --------------------------------------------------------------------------------------------------------


def run_cell(
    args: argparse.Namespace,
    cache: _protocol.TrialCache,
    corpus: Any,
    data: dict[str, _data.Sequences],
    norm: str,
    batch_size: int,
) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """One (norm, B, T) cell: its rate (selection on the short budget, or ``--lr``), then every seed at the full
    budget. Returns the summary row, the selection runs and the final runs."""
    steps, updates = data["train"].steps, args.updates[batch_size]
    name = f"{norm}|B={batch_size}|T={steps}"
    key = _protocol.selection_key(norm, args)
    selection: list[dict[str, Any]] = []
    added, edge, lr = [], "", args.lr
    if lr is None:
        short = max(1, round(args.select_fraction * updates))

        def train_short(rate: float, seed: int) -> dict[str, Any]:
            return run_one(args, corpus, data, norm, batch_size, short, rate, seed, profile=False)

        # "first": the rate is chosen on seed 0; "apart": on the selection's own seeds (none reported at this budget)
        seeds = {"mean": args.seeds, "first": 1, "apart": 0}[args.select]
        chosen = _protocol.run_cell(
            train_short,
            args.lrs,
            seeds,
            "apart" if args.select == "apart" else "mean",
            key,
            cache,
            f"select|{name}|updates={short}",
            args.lr_extensions,
            args.select_seeds,
        )
        selection = [
            {"norm": norm, "batch_size": batch_size, "steps": steps, "updates": short, **t} for t in chosen.trials
        ]
        added, edge, lr = chosen.added, chosen.edge, chosen.lr
    final: list[dict[str, Any]] = []
    if lr is not None:
        for seed in range(args.seeds):
            row = cache.run(
                f"final|{name}|updates={updates}|lr={lr!r}|seed={seed}",
                lambda seed=seed: run_one(args, corpus, data, norm, batch_size, updates, lr, seed, profile=True),
            )
            final.append({"lr": lr, "seed": seed, **row})
    else:  # no rate trained at all (BN at batch 1): the selection's runs hold the reason
        final = [t for t in selection if t["lr"] == selection[0]["lr"]]
    cell = _protocol.Cell(lr, final, added, edge)
    value = _data.value_name(corpus.level)
    summary = {"norm": norm, "batch_size": batch_size, "steps": steps, **_protocol.summarize(cell, key)}
    if selection:
        other = _protocol.other_key(norm, args)
        if other is not None:
            summary["lr_other_metric"] = _protocol.choose_lr(selection, other)
    reported = f"best_{_test_name(value)}" if args.report == "test" else value
    summary.update(
        headline=reported + key.removeprefix("val_loss"),
        chosen=cell.chosen,
        forget_bias=args.forget_bias,
        lr_source="--lr" if args.lr is not None else f"selected on {args.select_fraction:g} of the updates",
    )
    trials = [{"norm": norm, "batch_size": batch_size, "steps": steps, **t} for t in final]
    return summary, selection, trials


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    run = _common.RunLog(argv, NAME)
    args = parse_args(argv)
    cache = _protocol.TrialCache.for_args(args, NAME, ignore=("seq_lens", "updates", "lr", "select_fraction"))
    rows, selection, trials = [], [], []
    corpus = None
    splits = ("train", "val", "test") if args.report == "test" else ("train", "val")
    for steps in args.seq_lens:
        corpus, data = _data.load_sequences(args, steps, "window", vocab_from=corpus, splits=splits)
        data["val"] = data["val"].head(args.val_tokens)
        print(
            f"{corpus.source}: T = {steps}, {len(data['train'])} training windows, {data['val'].tokens} validation "
            f"tokens; updates per run {args.updates}",
            flush=True,
        )
        for batch_size in args.batch_sizes:
            for norm in args.norms:
                row, chosen, final = run_cell(args, cache, corpus, data, norm, batch_size)
                rows.append(row)
                selection += chosen
                trials += final
                print(
                    f"  T={steps} B={batch_size} {norm:<6}: {row.get(row['headline'], math.nan):.4f} {row['headline']} "
                    f"(lr {row['lr']}, {row['status']}, {row.get('ms_per_update', math.nan):.1f} ms/update)",
                    flush=True,
                )
    assert corpus is not None
    value = _data.value_name(corpus.level)
    _protocol.add_paired(rows, lambda row: (row["batch_size"], row["steps"]))
    write_outputs(args, run, cache, rows, selection, trials, value)
    return rows


# --- output ----------------------------------------------------------------------------------------------------------


def curve_rows(trials: Sequence[dict[str, Any]], level: str, value: str) -> list[dict[str, Any]]:
    """One row per point of every final run's learning curve."""
    return [
        {**{k: t[k] for k in ("norm", "batch_size", "steps", "lr", "seed")}, "update": update, "val_loss": loss,
         value: _data.loss_value(loss, level)}
        for t in trials
        for update, loss in t.get("curve", [])
    ]  # fmt: skip


def grad_rows(trials: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (run, profile, step t): ``grad_total`` and ``grad_last`` (module docstring)."""
    return [
        {**{k: t[k] for k in ("norm", "batch_size", "steps", "lr", "seed")}, "update": profile["update"], "t": step,
         "grad_total": total, "grad_last": last}
        for t in trials
        for profile in t.get("grads", [])
        for step, (total, last) in enumerate(zip(profile["total"], profile["last"], strict=True))
    ]  # fmt: skip


def gradient_reach(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """How much of the last position's gradient reaches the window's first step, ``||dl_T/dh_0|| / ||dl_T/dh_T||``
    (the grad_last profile's ends, geometric mean over seeds), at initialization and at the end of training, per cell:
    the number behind grad_through_time.png's lower panels."""
    summary = []
    for row in rows:
        profiles = [t["grads"] for t in row.get("chosen", []) if t.get("grads")]
        if not profiles:
            continue
        reach = {}
        for name, which in (("at_init", 0), ("at_end", -1)):
            # a gradient that vanished below float32's range reads 0: counted, not averaged
            ratios = [p[which]["last"][0] / p[which]["last"][-1] for p in profiles]
            finite = [math.log10(ratio) for ratio in ratios if ratio > 0]
            text = f"{10 ** statistics.fmean(finite):.1e}" if finite else "0 (float32 underflow)"
            if finite and len(finite) < len(ratios):
                text += f"; 0 in {len(ratios) - len(finite)} of {len(ratios)} seeds"
            reach[name] = text
        updates = profiles[0][-1]["update"]
        summary.append({"T": row["steps"], "B": row["batch_size"], "norm": row["norm"], **reach, "updates": updates})
    return summary


def settled(rows: Sequence[dict[str, Any]], level: str) -> list[dict[str, Any]]:
    """Whether a comparison had settled: the paired difference from the plain LSTM of the same (T, B) on the
    learning curves (mean over seeds; BN with its running averages, as the curves hold) at half, four fifths and
    all of the updates."""
    plain = {(r["steps"], r["batch_size"]): r for r in rows if r["norm"] == "none"}
    summary = []
    for row in rows:
        base = plain.get((row["steps"], row["batch_size"]))
        if row["norm"] == "none" or base is None:
            continue
        mine = {t["seed"]: t["curve"] for t in row.get("chosen", []) if t.get("curve")}
        theirs = {t["seed"]: t["curve"] for t in base.get("chosen", []) if t.get("curve")}
        seeds = sorted(mine.keys() & theirs.keys())
        if not seeds:
            continue
        entry: dict[str, Any] = {"T": row["steps"], "B": row["batch_size"], "norm": row["norm"]}
        for name, fraction in (("at_half", 0.5), ("at_four_fifths", 0.8), ("at_end", 1.0)):

            def point(curves: dict[int, list[Any]], seed: int, fraction: float = fraction) -> float:
                curve = curves[seed]
                return _data.loss_value(curve[round(fraction * (len(curve) - 1))][1], level)

            paired = _protocol.paired_difference(
                {s: point(mine, s) for s in seeds}, {s: point(theirs, s) for s in seeds}
            )
            entry[name] = f"{paired.mean:+.3f}" if paired is not None else ""
        entry["seeds"] = len(seeds)
        summary.append(entry)
    return summary


def against_batch_norm(rows: Sequence[dict[str, Any]], value: str) -> list[dict[str, Any]]:
    """The batch-independent norms against per-timestep BN of the same (T, B), paired by seed: each row's headline
    metric (``value``, or its test twin under ``--report test``) against BN's (its exact statistics by default)."""
    batch = {(r["steps"], r["batch_size"]): r for r in rows if r["norm"] == "batch" and r["status"] == "ok"}
    summary = []
    for row in rows:
        bn = batch.get((row["steps"], row["batch_size"]))
        if bn is None or row["norm"] in ("batch", "batch_renorm") or row["status"] != "ok":
            continue
        paired = _protocol.paired_against(row["chosen"], bn["chosen"], row["headline"], bn["headline"])
        summary.append(
            {
                "T": row["steps"],
                "B": row["batch_size"],
                "norm": row["norm"],
                "minus_batch": _protocol.paired_text(paired),
            }
        )
    return summary


def settings_of(rows: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
    """The (T, B) settings in the order they ran."""
    return list(dict.fromkeys((row["steps"], row["batch_size"]) for row in rows))


def plot_curves(rows: Sequence[dict[str, Any]], value: str, level: str, path: Path) -> None:
    """Validation along training, mean over seeds at each cell's rate: one panel per (T, B), one line per norm."""
    plt = _common.pyplot()
    settings = settings_of(rows)
    figure, axes = plt.subplots(1, len(settings), figsize=(4 * len(settings), 3.6), dpi=90, squeeze=False)
    for axis, (steps, batch_size) in zip(axes[0], settings, strict=True):
        later: list[float] = []
        for row in rows:
            if (row["steps"], row["batch_size"]) != (steps, batch_size):
                continue
            runs = [t["curve"] for t in row["chosen"] if t.get("curve")]
            if not runs:
                continue
            updates = [update for update, _ in runs[0]]
            means = [_data.loss_value(statistics.fmean(c[i][1] for c in runs), level) for i in range(len(updates))]
            axis.plot(updates, means, marker=".", label=f"{row['norm']} (lr {row['lr']:g})")
            later += means[1:]
        if later:  # the untrained model's loss would squash the part that differs
            axis.set_ylim(min(later) - 0.05, min(max(later), min(later) + 1.5) + 0.05)
        axis.set_title(f"T={steps}, B={batch_size}", fontsize=10)
        axis.set_xlabel("updates")
        axis.legend(fontsize=7)
    axes[0][0].set_ylabel(f"validation {value.split('_')[-1]} (mean over seeds)")
    figure.suptitle("Learning curves (BN: running averages)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def plot_gradients(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """||dL/dh_t|| against t, mean over seeds, at the start (dotted) and the end of training (solid)."""
    plt = _common.pyplot()
    settings = settings_of(rows)
    figure, axes = plt.subplots(2, len(settings), figsize=(4 * len(settings), 6), dpi=90, squeeze=False)
    for column, (steps, batch_size) in enumerate(settings):
        for index, row in enumerate(r for r in rows if (r["steps"], r["batch_size"]) == (steps, batch_size)):
            profiles = [t["grads"] for t in row["chosen"] if t.get("grads")]
            if not profiles:
                continue
            for which, style in ((0, ":"), (-1, "-")):
                for line, key in enumerate(("total", "last")):
                    mean = torch.tensor([p[which][key] for p in profiles]).mean(0)
                    label = f"{row['norm']} (update {profiles[0][which]['update']})"
                    axes[line][column].semilogy(mean.numpy(), style, color=f"C{index}", linewidth=1.1, label=label)
        axes[0][column].set_title(f"T={steps}, B={batch_size}", fontsize=10)
        axes[1][column].set_xlabel("step t")
    axes[0][0].set_ylabel("||dL/dh_t||, L = window's mean loss", fontsize=8)
    axes[1][0].set_ylabel("||dl_T/dh_t||, l_T = last position's loss", fontsize=8)
    for axis in axes.flat:
        if axis.lines:
            axis.legend(fontsize=6)
    figure.suptitle("Gradient norm through time (dotted: at initialization; solid: end of training)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def write_outputs(
    args: argparse.Namespace,
    run: _common.RunLog,
    cache: _protocol.TrialCache,
    rows: list[dict[str, Any]],
    selection: list[dict[str, Any]],
    trials: list[dict[str, Any]],
    value: str,
) -> None:
    level = "char" if value == "val_bpc" else "word"
    test = _test_name(value)
    shown = f"best_{test}" if args.report == "test" else value  # the headline's name in the tables
    for row in rows:
        row["minutes_per_run"] = row.get("seconds", math.nan) / 60

    def last_point(row: dict[str, Any]) -> str:
        """Under --report test, the last point's test number beside the best point's (the headline)."""
        last = test + row["headline"].removeprefix(f"best_{test}")
        return _protocol.pm(row[last], row[f"{last}_std"]) if row["status"] == "ok" and last in row else ""

    summary = [
        {
            "T": row["steps"],
            "B": row["batch_size"],
            "norm": row["norm"] + (" (exact stats)" if row["headline"].endswith("_exact") else ""),
            "lr": ""
            if row["lr"] is None
            else f"{row['lr']:g}" + (f" ({row['lr_edge']} edge)" if row["lr_edge"] else ""),
            shown: _protocol.pm(row[row["headline"]], row[f"{row['headline']}_std"])
            if row["status"] == "ok"
            else row["status"].split(":")[0],
            "diff_vs_none": row.get("paired", ""),
            f"last_{test}": last_point(row) if args.report == "test" else "",
            "best_update": row.get("best_update"),
            "gain_last_fifth": row.get("gain_last_fifth"),
            "updates": row.get("updates"),
            "minutes_per_run": row.get("minutes_per_run"),
        }
        for row in rows
    ]
    columns = ["steps", "batch_size", "norm", "status", "lr", "lrs_added", "lr_edge", "lr_other_metric", "seeds"]
    measured = [value, f"{value}_exact", "ema_gap", "val_loss", "val_loss_exact", "gain_last_fifth", "train_loss"]
    measured += [f"best_{test}", f"best_{test}_exact", test, f"{test}_exact", f"best_{value}", "best_update"]
    columns += [name for key in measured for name in (key, f"{key}_std") if any(name in row for row in rows)]
    columns += [*_protocol.PAIRED_COLUMNS, "updates", "tokens", "ms_per_update", "seconds", "minutes_per_run"]
    columns += ["lr_chosen_on", "lr_source", "forget_bias"]
    total_hours = sum(float(t.get("seconds", 0.0)) for t in [*selection, *trials]) / 3600
    bn_metric = "exact statistics" if args.bn_select == "exact" else "running averages"
    notes = [
        f"Fixed windows of T steps drawn at random, {_common.forget_bias_text(args)}; LSTM hidden {args.hidden}, "
        f"embedding {args.embedding}, Adam, gradient norm clipped at 1; updates per run by batch size: "
        f"{args.updates}. Validation on {'the first ' + str(args.val_tokens) if args.val_tokens else 'all'} "
        f"validation tokens, eval mode; {shown} is the headline (BN: with {bn_metric}).",
        *(
            [f"{shown}: the held-out test split (never used to choose anything) at the point of each run's learning "
             f"curve with the best validation loss (every {1 / args.evaluations:.0%} of the updates: the checkpoint "
             f"early stopping keeps; `best_update`), {test} and `last_{test}` at the last point; rates chosen apart "
             "from the reported seeds (--select apart)." if args.select == "apart" else
             f"{shown}: the held-out test split at the point of each run's learning curve with the best validation "
             f"loss (`best_update`); `last_{test}` at the last point."]
            if args.report == "test"
            else []
        ),
        (f"Every cell trained at --lr {args.lr:g}." if args.lr is not None else
         f"Rates chosen on runs of {args.select_fraction:g} of each cell's updates ({args.select} rule), a shorter "
         "budget than the final runs: it can favour a larger rate than the full budget would. Every selection run "
         "is in selection.csv."),
        *_protocol.notes(args, cache),
        "gain_last_fifth: validation improvement over the last fifth of the updates (mean over seeds; near 0 at a "
        "plateau); curves.csv and learning_curves.png hold every curve (BN: running averages along the way).",
        f"Gradient norm through time (grad_norms.csv, grad_through_time.png): ||dL/dh_t|| of the first layer's h_t, "
        f"mean over {args.grad_rows} validation windows in batches of B, training mode on a copy (BN with batch "
        f"statistics), at {args.grad_points} points of each run; grad_total for L the window's mean loss, grad_last "
        "for L the loss at its last position alone.",
        f"Training time of all runs read or trained here: {total_hours:.2f} CPU hours (1 thread each; "
        "minutes_per_run and ms_per_update per cell, evaluation excluded).",
    ]  # fmt: skip
    _common.write_results(
        args.out,
        rows,
        columns,
        title=f"Near convergence: {value.replace('_', ' ')} by window length, batch size and norm",
        run=run,
        notes=notes,
        extra_tables=[
            (
                f"Mean ± std over seeds at each cell's rate; diff_vs_none: paired per-seed difference from the plain "
                f"LSTM of the same T and B, {shown}: mean [95% t-interval], seeds where the sign held",
                summary,
                ["T", "B", "norm", "lr", shown, "diff_vs_none"]
                + ([f"last_{test}", "best_update"] if args.report == "test" else [])
                + ["gain_last_fifth", "updates", "minutes_per_run"],
            ),
            (
                "How far back the last prediction's gradient reaches: ||dl_T/dh_0|| / ||dl_T/dh_T|| (grad_last at the "
                "window's first and last step; geometric mean over seeds), at initialization and after `updates`",
                gradient_reach(rows),
                ["T", "B", "norm", "at_init", "at_end", "updates"],
            ),
            (
                f"Settled? The paired difference from the plain LSTM ({value.split('_')[-1]}, mean over seeds) on "
                "the learning curves at half, four fifths and all of the updates (BN: running averages)",
                settled(rows, level),
                ["T", "B", "norm", "at_half", "at_four_fifths", "at_end", "seeds"],
            ),
            (
                f"Against per-timestep BN of the same T and B, paired by seed: {shown} minus BN's (its headline "
                "metric), mean [95% t-interval], seeds where the sign held",
                against_batch_norm(rows, value),
                ["T", "B", "norm", "minus_batch"],
            ),
        ],
    )
    keys = ["norm", "batch_size", "steps", "lr", "seed", "status", value, f"{value}_exact", "ema_gap", "val_loss"]
    keys += ["val_loss_exact", "train_loss", "updates", "tokens", "seconds", "ms_per_update"]
    _common.write_csv(args.out / "selection.csv", selection, keys)
    tested = [f"best_{test}", f"best_{test}_exact", test, f"{test}_exact", f"best_{value}", "best_update"]
    tested = [key for key in tested if any(key in row for row in trials)]  # under --report test
    _common.write_csv(args.out / "trials.csv", trials, [*keys, *tested, "gain_last_fifth"])
    _common.write_csv(
        args.out / "curves.csv",
        curve_rows(trials, level, value),
        ["norm", "batch_size", "steps", "lr", "seed", "update", "val_loss", value],
    )
    _common.write_csv(
        args.out / "grad_norms.csv",
        grad_rows(trials),
        ["norm", "batch_size", "steps", "lr", "seed", "update", "t", "grad_total", "grad_last"],
    )
    plot_curves(rows, value, level, args.out / "learning_curves.png")
    plot_gradients(rows, args.out / "grad_through_time.png")


if __name__ == "__main__":
    main()
