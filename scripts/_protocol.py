"""The fair protocol every training script follows: a learning-rate grid, several seeds, and BN evaluated twice.

A comparison of norms at one learning rate and one seed mostly measures which norm that rate suits and the luck of
one initialization. So every cell of a script's grid (a norm at a batch size, say):

1. is trained at each learning rate of ``--lrs`` and each seed of ``--seeds`` (seeds ``0..N-1``: they set the
   initialization and the order of the batches; the data split is fixed by ``--seed``);
2. takes the learning rate with the lowest mean validation loss over seeds (``--select mean``, every lr x seed
   run), or the cheaper rule ``--select first``: the best lr on the first seed, then the other seeds at that lr
   only; or, keeping selection apart from what is reported, ``--select apart``: the best mean over
   ``--select-seeds`` seeds numbered from :data:`SELECTION_SEEDS_FROM`, which no table reports, then the reported
   seeds ``0..N-1`` at that lr only (the selection's optimism stays out of the reported numbers). A rate at which
   any seed fails (an error, divergence) is not eligible. When the best rate is the largest or the smallest one
   tried, the comparison is not settled (a rate beyond the edge may be better still),
   so the grid extends itself: one more rate beyond that edge, by the ratio of the edge to its neighbour (rounded
   to 2 significant digits), until the best rate is interior or ``--lr-extensions`` rates were added to the cell
   (the cap; ``lrs_added`` and ``lr_edge`` say what happened: ``lr_edge`` is ``top``/``bottom`` when the cap
   stopped the search with the best rate still at an edge);
3. reports the mean and the sample standard deviation over the seeds at the chosen rate (``_std`` columns), with
   the grid and the chosen rate in the tables, and every single run in ``trials.csv``; and, against the plain
   LSTM (``norm="none"``) of the same setting, the paired per-seed differences (a seed fixes the initialization
   draw and the batch order for every norm): their mean, a 95% t-interval and in how many seeds the sign held
   (:func:`paired_difference`);
4. trains on an equal budget of real target tokens (padding excluded), so smaller batches take more updates; the
   ``updates`` column says how many, and ``--updates`` (where a script has it) gives the equal-updates view;
5. for norms with batch statistics (``batch``, ``batch_renorm``), is evaluated twice: with the running averages
   the model kept while training (``val_loss``), and after :func:`seqnorm.update_bn` recomputed them as exact
   averages over training data (``val_loss_exact``); ``ema_gap`` is the difference. With few updates, running
   averages lag behind the weights (momentum 0.1: after 12 updates 0.9^12 = 28% of the initial statistics remain),
   which is a fault of the estimate, not of BN; the exact column removes it. BN's rate is chosen on the metric
   the tables headline (``--bn-select exact``, the default: the exact statistics; ``running``: the running
   averages), and the rate the other metric would have chosen is reported beside it (``lr_other_metric``);
6. initializes every norm's forget-gate bias alike (``--forget-bias``, default 1 for all, the plain LSTM
   included: :data:`_common.FORGET_BIAS`), stated in the notes and in the ``forget_bias`` column.

Under ``mean`` and ``first`` the validation split both selects the rate and reports the loss, on shared seeds: the
optimism this adds is the same for every norm but can be as large as a small effect; ``apart`` (with a held-out test
number where a script reports one) removes it.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common
import torch
from _common import Sequences, TrainResult, model_outputs, train_language_model
from torch import Tensor, nn

import seqnorm
from seqnorm.norms import TimestepBatchNorm

__all__ = [
    "BN_METRICS",
    "FULL",
    "PAIRED_COLUMNS",
    "QUICK",
    "SELECTIONS",
    "SELECTION_SEEDS_FROM",
    "Cell",
    "Paired",
    "TrialCache",
    "add_arguments",
    "add_paired",
    "choose_lr",
    "exact_statistics",
    "fallback_per_update",
    "grid_row",
    "notes",
    "other_key",
    "paired_against",
    "paired_columns",
    "paired_difference",
    "paired_text",
    "pm",
    "run_cell",
    "selection_key",
    "summarize",
    "t_quantile_975",
    "trial",
    "uses_batch_statistics",
]

SELECTIONS = ("mean", "first", "apart")
SELECTION_SEEDS_FROM = 1000
"""Under ``--select apart`` the rate is chosen on seeds ``1000, 1001, ...``: seeds no table reports (0..N-1)."""
BN_METRICS = ("exact", "running")
# At most one rate added per cell in the quick settings (make demo stays a few minutes), three in the full ones.
QUICK = {"lrs": [3e-3, 1e-2], "seeds": 2, "select": "first", "bn_stats_tokens": 10_000, "lr_extensions": 1}
# On tinyshakespeare (README) batches of 1-8 chose 0.01 and batches of 32-64 chose 0.03 from this grid, the top:
# on PTB-char 0.1 was better still at B >= 32, which the self-extending grid finds (0.09, 0.27, ...).
FULL = {"lrs": [3e-3, 1e-2, 3e-2], "seeds": 3, "select": "mean", "bn_stats_tokens": 50_000, "lr_extensions": 3}

Trial = dict[str, Any]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--lrs``, ``--seeds``, ``--select``, ``--bn-stats-tokens`` (defaults from :data:`QUICK` / :data:`FULL`)."""
    group = parser.add_argument_group("fair protocol")
    group.add_argument(
        "--lrs", nargs="+", type=_common.positive_float, help="the Adam learning-rate grid each cell chooses from"
    )
    group.add_argument(
        "--seeds", type=_common.positive_int, help="seeds per cell (0..N-1): results are mean and std over them"
    )
    group.add_argument(
        "--select",
        choices=SELECTIONS,
        help="mean: the lr with the best mean validation loss over all seeds; first: best on seed 0, then the "
        "other seeds at that lr only (cheaper); apart: best mean over --select-seeds seeds that are not reported "
        f"(numbered from {SELECTION_SEEDS_FROM}), then the reported seeds at that lr",
    )
    group.add_argument(
        "--select-seeds",
        type=_common.positive_int,
        default=2,
        metavar="K",
        help="under --select apart: the seeds the rate is chosen on (default 2), apart from the reported ones",
    )
    group.add_argument(
        "--lr-extensions",
        type=_common.non_negative_int,
        metavar="N",
        help="the cap of the self-extending grid: at most N rates added to a cell whose best rate is at an edge of "
        "the rates tried (one step beyond it by the edge's ratio to its neighbour); 0 keeps --lrs as given",
    )
    group.add_argument(
        "--bn-select",
        choices=BN_METRICS,
        default="exact",
        help="the metric BN's rate is chosen on and headlined by: exact statistics (seqnorm.update_bn, default) or "
        "the running averages; the rate the other would choose is reported too",
    )
    group.add_argument(
        "--bn-stats-tokens",
        type=_common.positive_int,
        help="training tokens seqnorm.update_bn averages BN's exact statistics over",
    )
    group.add_argument(
        "--trials-cache",
        type=Path,
        metavar="FILE",
        help="JSON-lines file of finished runs: a run with the same settings, cell, rate and seed is read back "
        "instead of trained again (resume or extend a long grid); the notes count the runs read back",
    )


def uses_batch_statistics(norm: str) -> bool:
    """Whether ``norm`` normalizes with batch statistics in training (then it is evaluated twice)."""
    return seqnorm.NORMS[norm].batch_statistics


def selection_key(norm: str, args: argparse.Namespace, key: str = "val_loss") -> str:
    """The metric ``norm``'s rate is chosen on: ``key``, or for BN its exact twin under ``--bn-select exact``."""
    exact = uses_batch_statistics(norm) and getattr(args, "bn_select", "exact") == "exact"
    return f"{key}_exact" if exact else key


def other_key(norm: str, args: argparse.Namespace, key: str = "val_loss") -> str | None:
    """BN's metric that did not choose the rate (its choice is reported beside); ``None`` for other norms."""
    if not uses_batch_statistics(norm):
        return None
    return key if selection_key(norm, args, key) != key else f"{key}_exact"


def exact_statistics(model: nn.Module, train: Sequences, tokens: int, batch_size: int = 64) -> nn.Module:
    """A copy of ``model`` whose BN running statistics :func:`seqnorm.update_bn` recomputed over training data.

    The statistics are the exact moments over the first sequences of ``train`` holding ``tokens`` target tokens
    (padding excluded; ``update_bn`` weights every row alike, so ``batch_size`` only sets the speed).
    """
    subset = train.head(tokens)
    if subset.stateful:  # stream windows in stream order, the state carried as in training
        indices = subset.stream_batches(max(1, min(batch_size, len(subset) // 2)))
    else:
        indices = list(torch.arange(len(subset)).split(batch_size))
    loader = [subset.batch(index) for index in indices]
    carried: dict[str, Any] = {}

    def forward(module: nn.Module, batch: Sequences) -> Tensor:
        logits, carried["state"] = model_outputs(module, batch, carried.get("state"))
        return logits

    exact = copy.deepcopy(model)
    seqnorm.update_bn(loader, exact, forward=forward)
    return exact


def fallback_per_update(model: nn.Module, updates: int) -> float:
    """Training steps per update that per-timestep BN normalized with running statistics (< 2 active rows).

    Every norm of a cell sees the same rows, so the first norm's count stands for all of them.
    """
    norms = [module for module in model.modules() if isinstance(module, TimestepBatchNorm)]
    return norms[0].fallback_steps / max(updates, 1) if norms else math.nan


def trial(
    model: nn.Module,
    train: Sequences,
    *,
    norm: str,
    measure: Callable[[nn.Module], Mapping[str, float]],
    stats_tokens: int,
    gap_key: str,
    **training: Any,
) -> tuple[Trial, TrainResult]:
    """Train ``model`` (``training``: keywords of ``train_language_model``), then measure it.

    ``measure(model)`` returns the validation metrics (its ``val_loss`` selects the learning rate). A norm with
    batch statistics is measured again after :func:`exact_statistics`: each metric gets an ``_exact`` twin, and
    ``ema_gap`` is ``gap_key`` minus its exact twin (running averages' excess loss), and ``fallback_per_update``
    counts the padded-tail steps per update that had one active row (normalized with running statistics).
    """
    result = train_language_model(model, train, **training)
    row: Trial = {
        "status": result.status,
        "train_loss": result.train_loss,
        "updates": result.updates,
        "tokens": result.tokens,
        "seconds": result.seconds,
    }
    if result.status != "ok":
        return {**row, "val_loss": math.nan}, result
    row.update(measure(model))
    if uses_batch_statistics(norm):
        row["fallback_per_update"] = fallback_per_update(model, result.updates)
        exact = measure(exact_statistics(model, train, stats_tokens))
        row.update({f"{key}_exact": value for key, value in exact.items()})
        row["ema_gap"] = row[gap_key] - row[f"{gap_key}_exact"]
    return row, result


def choose_lr(trials: Sequence[Trial], key: str = "val_loss") -> float | None:
    """The learning rate whose runs have the lowest mean ``key``; rates with a failed run are not eligible.

    ``trials`` carry ``lr``, ``status`` and ``key``. ``None`` when no rate is eligible.
    """
    by_lr: dict[float, list[Trial]] = {}
    for row in trials:
        by_lr.setdefault(row["lr"], []).append(row)
    eligible = {
        lr: statistics.fmean(row[key] for row in rows)
        for lr, rows in by_lr.items()
        if all(row["status"] == "ok" and math.isfinite(row[key]) for row in rows)
    }
    return min(eligible, key=eligible.__getitem__) if eligible else None


@dataclass
class Cell:
    """One cell's runs under the protocol.

    Attributes:
        lr: the chosen learning rate, ``None`` if no rate trained.
        trials: every run, each with its ``lr`` and ``seed``.
        added: the rates the self-extending grid added beyond the given ones, in the order tried.
        edge: ``"top"``/``"bottom"`` when the chosen rate is still the largest/smallest tried (the cap stopped
            the extension, or it was 0), ``"only rate"`` for a grid of one rate, ``""`` when it is interior or
            no rate trained.
    """

    lr: float | None
    trials: list[Trial]
    added: list[float] = field(default_factory=list)
    edge: str = ""

    @property
    def chosen(self) -> list[Trial]:
        """The runs at the chosen rate (at a failed cell: those of the first rate where a run failed, which hold
        the reason; under the ``first`` rule that may be a later seed, seed 0 having trained). Under ``apart`` the
        selection's own seeds are left out where reported seeds ran."""
        if self.lr is not None:
            lr = self.lr
        else:
            lr = next((row["lr"] for row in self.trials if row["status"] != "ok"), self.trials[0]["lr"])
        runs = [row for row in self.trials if row["lr"] == lr]
        return [row for row in runs if row["seed"] < SELECTION_SEEDS_FROM] or runs


@dataclass
class TrialCache:
    """Finished runs kept in a JSON-lines file, keyed by the script's settings, the cell, the rate and the seed.

    A run is deterministic given its settings and seed (one CPU thread, deterministic algorithms: ``resolve``), so
    reading it back gives what training it again would. ``path=None`` keeps nothing. Rows must be JSON-serializable
    (lists, not tensors).

    Attributes:
        path: the file, appended to after every run.
        settings: everything that changes a run's outcome besides cell, rate and seed.
        hits: runs read back so far.
    """

    path: Path | None
    settings: dict[str, Any]
    hits: int = 0
    _rows: dict[str, Trial] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._settings = json.dumps(self.settings, sort_keys=True, default=str)
        if self.path is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                entry = json.loads(line)
                if entry["settings"] == self._settings:
                    self._rows[entry["key"]] = entry["row"]

    @classmethod
    def for_args(cls, args: argparse.Namespace, script: str, ignore: Sequence[str] = ()) -> TrialCache:
        """The cache of ``--trials-cache``; settings are ``args`` except what only picks cells or places output."""
        skipped = {"out", "threads", "quick", "trials_cache", "cache_dir", "lrs", "seeds", "select", *ignore}
        skipped |= {"lr_extensions", "bn_select", "select_seeds"}  # these pick rates, not a run's outcome
        skipped |= {"norms", "batch_sizes", "no_pooled", "no_untrained_stats"}  # these pick cells
        skipped |= {k for k in ("gamma_init", "report") if getattr(args, k, None) in (None, "val")}  # the defaults
        settings = {"script": script, **{k: v for k, v in vars(args).items() if k not in skipped}}
        text = settings.get("text")
        if text is not None and Path(text).is_file():  # the file's content, not only its path: an edited corpus
            settings["text_sha256"] = hashlib.sha256(Path(text).read_bytes()).hexdigest()  # is other data
            settings["text"] = Path(text).name  # and the same corpus elsewhere (another clone) is the same data
        return cls(getattr(args, "trials_cache", None), settings)

    def run(self, key: str, train: Callable[[], Trial]) -> Trial:
        """The cached row of ``key``, or ``train()``'s (then appended to the file)."""
        if key in self._rows:
            self.hits += 1
            return dict(self._rows[key])
        row = train()
        self._rows[key] = row
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as handle:
                handle.write(json.dumps({"settings": self._settings, "key": key, "row": row}) + "\n")
        return row


def _edge(lr: float | None, rates: Sequence[float]) -> str:
    """Where ``lr`` sits among the ``rates`` tried: ``top``, ``bottom``, ``only rate`` or ``""`` (interior)."""
    if lr is None:
        return ""
    if len(set(rates)) < 2:
        return "only rate"
    return "top" if lr == max(rates) else "bottom" if lr == min(rates) else ""


def _beyond(rates: Sequence[float], edge: str) -> float:
    """One step beyond the ``edge`` of ``rates``: the edge times its ratio to its neighbour, at 2 significant digits
    (so that a rate prints and caches as the number it is: 0.09, not 0.09000000000000001)."""
    ordered = sorted(set(rates))
    outer, inner = (ordered[-1], ordered[-2]) if edge == "top" else (ordered[0], ordered[1])
    return float(f"{outer * outer / inner:.2g}")


def run_cell(
    train_one: Callable[[float, int], Trial],
    lrs: Sequence[float],
    seeds: int,
    select: str = "mean",
    key: str = "val_loss",
    cache: TrialCache | None = None,
    name: str = "",
    extensions: int = 0,
    select_seeds: int = 2,
) -> Cell:
    """Run ``train_one(lr, seed)`` over the grid by the ``select`` rule and choose the learning rate by ``key``.

    While the chosen rate is the largest or smallest tried, and fewer than ``extensions`` rates were added, one rate
    beyond that edge is run (all seeds under ``mean``, seed 0 under ``first``, the ``select_seeds`` selection seeds
    under ``apart``) and the choice made again (the module docstring's step 2). With a ``cache``, runs are stored
    and read back under ``name`` (the cell), the rate and the seed.
    """
    if select not in SELECTIONS:
        raise ValueError(f"run_cell: expected select to be one of {', '.join(SELECTIONS)}, got {select!r}")

    def one(lr: float, seed: int) -> Trial:
        if cache is None:
            return {"lr": lr, "seed": seed, **train_one(lr, seed)}
        return {"lr": lr, "seed": seed, **cache.run(f"{name}|lr={lr!r}|seed={seed}", lambda: train_one(lr, seed))}

    if select == "apart":
        first_seeds = range(SELECTION_SEEDS_FROM, SELECTION_SEEDS_FROM + select_seeds)
    else:
        first_seeds = range(seeds) if select == "mean" else range(1)
    rates = list(dict.fromkeys(lrs))
    trials = [one(lr, seed) for lr in rates for seed in first_seeds]
    lr = choose_lr(trials, key)
    added: list[float] = []
    while len(added) < extensions and _edge(lr, rates) in ("top", "bottom"):
        beyond = _beyond(rates, _edge(lr, rates))
        if beyond in rates:  # the rounding landed on a rate tried (a grid of steps under 5%)
            break
        rates.append(beyond)
        added.append(beyond)
        trials += [one(beyond, seed) for seed in first_seeds]
        lr = choose_lr(trials, key)
    edge = _edge(lr, rates)
    if select in ("first", "apart") and lr is not None:
        trials += [one(lr, seed) for seed in range(1 if select == "first" else 0, seeds)]
        if choose_lr([row for row in trials if row["lr"] == lr], key) is None:
            lr, edge = None, ""  # a later seed failed at the rate seed 0 chose
    return Cell(lr, trials, added, edge)


def summarize(cell: Cell, key: str = "val_loss", other_key: str | None = None) -> dict[str, Any]:
    """Mean over the chosen runs of every numeric column, its sample std as ``<column>_std``, and the status.

    ``status`` is ``ok`` when every chosen run trained, else the first failure's reason; ``seeds`` counts the runs;
    ``lrs_added`` the rates the grid added (space-separated) and ``lr_edge`` :attr:`Cell.edge`; ``lr_chosen_on``
    is ``key``; with ``other_key`` (BN's other metric), ``lr_other_metric`` is the rate ``other_key`` would choose
    from the same runs (under ``--select first``: from seed 0's).
    """
    runs = cell.chosen
    failures = [row["status"] for row in runs if row["status"] != "ok"]
    summary: dict[str, Any] = {
        "lr": cell.lr,
        "seeds": len(runs),
        "status": failures[0] if failures else "ok",
        "lrs_added": " ".join(f"{lr:g}" for lr in cell.added),
        "lr_edge": cell.edge,
        "lr_chosen_on": key,
    }
    if other_key is not None:
        # under --select first only the chosen rate has every seed: the rates are compared on seed 0 alone then;
        # under --select apart on the selection's seeds
        apart = [row for row in cell.trials if row["seed"] >= SELECTION_SEEDS_FROM]
        every_seed = len({row["lr"] for row in cell.trials if row["seed"] != 0}) > 1
        pool = apart or (cell.trials if every_seed else [row for row in cell.trials if row["seed"] == 0])
        summary["lr_other_metric"] = choose_lr(pool, other_key)
    numeric = [
        column
        for column in dict.fromkeys(column for row in runs for column in row)
        if column not in ("lr", "seed") and any(isinstance(row.get(column), int | float) for row in runs)
    ]
    for column in numeric:
        values = [float(row.get(column, math.nan)) for row in runs]
        summary[column] = statistics.fmean(values)
        if all(isinstance(row.get(column), int) for row in runs) and len(set(values)) == 1:
            summary[column] = runs[0][column]  # a count every run shares (updates, tokens) stays an integer
        finite = len(values) > 1 and all(math.isfinite(value) for value in values)
        summary[f"{column}_std"] = statistics.stdev(values) if finite else math.nan
    return summary


# Two-sided 95% quantiles of Student's t by degrees of freedom (scipy.stats.t.ppf(0.975, df)); scipy is not a
# dependency, and the seeds of these runs are few.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}  # fmt: skip


def t_quantile_975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (a df between table entries takes the
    next smaller one: the wider, conservative interval; above 120, the normal 1.960)."""
    if df < 1:
        raise ValueError(f"t_quantile_975: expected df >= 1, got {df}")
    if df > 120:
        return 1.960
    return _T975[max(k for k in _T975 if k <= df)]


@dataclass(frozen=True)
class Paired:
    """Paired per-seed differences ``norm - baseline`` of one metric.

    Attributes:
        n: seeds where both trained.
        mean: the mean difference (negative: lower than the baseline, better for a loss).
        low, high: its 95% t-interval (``nan`` for one seed).
        held: seeds whose difference has the sign of the mean (0 when the mean is 0).
        differences: the per-seed differences, by seed.
    """

    n: int
    mean: float
    low: float
    high: float
    held: int
    differences: dict[int, float]


def paired_difference(values: Mapping[int, float], baseline: Mapping[int, float]) -> Paired | None:
    """The paired differences ``values[seed] - baseline[seed]`` over the seeds both have finite values for, or
    ``None`` when they share none. The interval is the mean ± t(0.975, n-1) · s / sqrt(n)."""
    seeds = sorted(seed for seed in values if seed in baseline)
    differences = {
        seed: values[seed] - baseline[seed]
        for seed in seeds
        if math.isfinite(values[seed]) and math.isfinite(baseline[seed])
    }
    if not differences:
        return None
    n, mean = len(differences), statistics.fmean(differences.values())
    half = t_quantile_975(n - 1) * statistics.stdev(differences.values()) / math.sqrt(n) if n > 1 else math.nan
    sign = (mean > 0) - (mean < 0)
    held = sum(1 for value in differences.values() if sign and (value > 0) - (value < 0) == sign)
    return Paired(n, mean, mean - half, mean + half, held, differences)


def paired_against(
    runs: Sequence[Trial], baseline: Sequence[Trial], key: str, baseline_key: str | None = None
) -> Paired | None:
    """:func:`paired_difference` of ``key`` over the ``runs`` (a cell's chosen runs) against ``baseline_key``
    (default ``key``) over the plain LSTM's, paired by seed; failed runs are left out."""

    def by_seed(rows: Sequence[Trial], name: str) -> dict[int, float]:
        return {row["seed"]: float(row[name]) for row in rows if row["status"] == "ok" and name in row}

    return paired_difference(by_seed(runs, key), by_seed(baseline, baseline_key or key))


PAIRED_COLUMNS = ["diff_vs_none", "diff_vs_none_low", "diff_vs_none_high", "diff_vs_none_held", "diff_vs_none_n"]


def paired_columns(paired: Paired | None, prefix: str = "diff_vs_none") -> dict[str, Any]:
    """CSV columns of a paired comparison: ``<prefix>``, ``_low``, ``_high``, ``_held`` and ``_n``."""
    if paired is None:
        return {}
    return {
        prefix: paired.mean,
        f"{prefix}_low": paired.low,
        f"{prefix}_high": paired.high,
        f"{prefix}_held": paired.held,
        f"{prefix}_n": paired.n,
    }


def add_paired(rows: Sequence[dict[str, Any]], setting: Callable[[dict[str, Any]], Any]) -> None:
    """Add to each summary row its paired difference from the plain LSTM's row of the same ``setting(row)`` (a
    batch size, say): the :func:`paired_columns` and ``paired`` (:func:`paired_text`).

    Rows carry ``norm``, ``chosen`` (the cell's chosen runs) and ``headline``, the metric compared (BN's exact
    twin under ``--bn-select exact``, its headline); rows without a plain LSTM of their setting get nothing.
    """
    baselines = {setting(row): row for row in rows if row["norm"] == "none"}
    for row in rows:
        baseline = baselines.get(setting(row))
        if baseline is not None and row is not baseline:
            paired = paired_against(row["chosen"], baseline["chosen"], row["headline"], baseline["headline"])
            row.update(paired_columns(paired), paired=paired_text(paired))


def paired_text(paired: Paired | None, digits: int = 3) -> str:
    """``"-0.052 [-0.071, -0.033], 3/3"`` for a table cell: mean, 95% interval, seeds where the sign held."""
    if paired is None:
        return ""
    interval = "" if math.isnan(paired.low) else f" [{paired.low:+.{digits}f}, {paired.high:+.{digits}f}]"
    return f"{paired.mean:+.{digits}f}{interval}, {paired.held}/{paired.n}"


def pm(mean: float, std: float, digits: int = 3) -> str:
    """``"mean ± std"`` for a table cell (``std`` left out when it is nan: a single run)."""
    if math.isnan(mean):
        return "nan"
    return f"{mean:.{digits}f}" if math.isnan(std) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def grid_row(cell: Cell, key: str) -> dict[str, str]:
    """``lr=<rate>`` -> mean ``key`` over the seeds run at that rate (``(n)`` seeds; ``*`` marks the chosen)."""
    row = {}
    for lr in dict.fromkeys(trial["lr"] for trial in cell.trials):
        runs = [trial for trial in cell.trials if trial["lr"] == lr]
        ok = [float(trial[key]) for trial in runs if trial["status"] == "ok" and key in trial]
        failure = next((trial["status"] for trial in runs if trial["status"] != "ok"), "missing")
        text = f"{statistics.fmean(ok):.3f} ({len(ok)})" if len(ok) == len(runs) else failure.split(":")[0]
        row[f"lr={lr:g}"] = text + (" *" if lr == cell.lr else "")
    return row


def notes(args: argparse.Namespace, cache: TrialCache | None = None) -> list[str]:
    """The protocol's lines for ``results.md`` (with how many runs ``cache`` read back)."""
    rule = {
        "mean": "the lowest mean validation loss over all seeds",
        "first": "the lowest validation loss of seed 0, then the other seeds at that rate only",
        "apart": f"the lowest mean validation loss over {getattr(args, 'select_seeds', 2)} selection seeds (from "
        f"{SELECTION_SEEDS_FROM}) that no table reports, then the reported seeds 0..{args.seeds - 1} at that rate only",
    }[args.select]
    extensions = getattr(args, "lr_extensions", 0)
    extension = (
        f"When a cell's best rate was the largest or smallest tried, one rate beyond that edge was added (the "
        f"edge times its ratio to its neighbour, 2 significant digits) until the best was interior, at most "
        f"{extensions} per cell (the cap): `lrs_added` lists them, and `lr_edge` says top/bottom where the cap "
        "stopped the search with the best still at an edge (that comparison is not settled)."
        if extensions
        else "The grid was not extended (--lr-extensions 0): a best rate at an edge of the grid (`lr_edge`) leaves "
        "that comparison unsettled."
    )
    bn_metric = getattr(args, "bn_select", "exact")
    return [
        f"Fair protocol: each cell chose its Adam learning rate from {{{', '.join(f'{lr:g}' for lr in args.lrs)}}} "
        f"by {rule}; values are mean ± sample std over {args.seeds} seeds (initialization and batch order) at "
        "the chosen rate; every run is in trials.csv. A rate where any seed failed was not eligible.",
        extension,
        f"Initialization: {_common.forget_bias_text(args)}.",
        "Per-timestep BN (batch, batch_renorm) is evaluated twice: `_exact` columns after seqnorm.update_bn "
        f"recomputed its statistics as exact averages over {args.bn_stats_tokens} training tokens; `ema_gap` is the "
        "running averages' value minus the exact one (their lag; positive = running averages worse). BN's rate was "
        f"chosen on the {'exact statistics' if bn_metric == 'exact' else 'running averages'} (--bn-select "
        f"{bn_metric}); `lr_other_metric` is the rate the other evaluation would have chosen.",
        *(
            [f"{cache.hits} runs were read back from {cache.path} (same settings, cell, rate and seed) instead of "
             "trained again."]
            if cache is not None and cache.hits
            else []
        ),
    ]  # fmt: skip
