"""The fair protocol every training script follows: a learning-rate grid, several seeds, and BN evaluated twice.

A comparison of norms at one learning rate and one seed mostly measures which norm that rate suits and the luck of
one initialization. So every cell of a script's grid (a norm at a batch size, say):

1. is trained at each learning rate of ``--lrs`` and each seed of ``--seeds`` (seeds ``0..N-1``: they set the
   initialization and the order of the batches; the data split is fixed by ``--seed``);
2. takes the learning rate with the lowest mean validation loss over seeds (``--select mean``, every lr x seed
   run), or the cheaper rule ``--select first``: the best lr on the first seed, then the other seeds at that lr
   only. A rate at which any seed fails (an error, divergence) is not eligible;
3. reports the mean and the sample standard deviation over the seeds at the chosen rate (``_std`` columns), with
   the grid and the chosen rate in the tables, and every single run in ``trials.csv``;
4. trains on an equal budget of real target tokens (padding excluded), so smaller batches take more updates; the
   ``updates`` column says how many, and ``--updates`` (where a script has it) gives the equal-updates view;
5. for norms with batch statistics (``batch``, ``batch_renorm``), is evaluated twice: with the running averages
   the model kept while training (``val_loss``), and after :func:`seqnorm.update_bn` recomputed them as exact
   averages over training data (``val_loss_exact``); ``ema_gap`` is the difference. With few updates, running
   averages lag behind the weights (momentum 0.1: after 12 updates 0.9^12 = 28% of the initial statistics remain),
   which is a fault of the estimate, not of BN; the exact column removes it.

The validation split both selects the rate and reports the loss; with a grid of 2-3 rates the optimism this adds
is small next to the seed spread, and it is the same for every norm.
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
    "FULL",
    "QUICK",
    "SELECTIONS",
    "Cell",
    "TrialCache",
    "add_arguments",
    "choose_lr",
    "exact_statistics",
    "fallback_per_update",
    "grid_row",
    "notes",
    "pm",
    "run_cell",
    "summarize",
    "trial",
    "uses_batch_statistics",
]

SELECTIONS = ("mean", "first")
QUICK = {"lrs": [3e-3, 1e-2], "seeds": 2, "select": "first", "bn_stats_tokens": 10_000}
# On tinyshakespeare (README) batches of 1-8 chose 0.01 and batches of 32-64 chose 0.03 from this grid; a run of
# 2M characters at batch 64 found every norm's best rate inside {0.003, ..., 0.1}.
FULL = {"lrs": [3e-3, 1e-2, 3e-2], "seeds": 3, "select": "mean", "bn_stats_tokens": 50_000}

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
        "other seeds at that lr only (cheaper)",
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
    """

    lr: float | None
    trials: list[Trial]

    @property
    def chosen(self) -> list[Trial]:
        """The runs at the chosen rate (at a failed cell: those of the first rate where a run failed, which hold
        the reason; under the ``first`` rule that may be a later seed, seed 0 having trained)."""
        if self.lr is not None:
            lr = self.lr
        else:
            lr = next((row["lr"] for row in self.trials if row["status"] != "ok"), self.trials[0]["lr"])
        return [row for row in self.trials if row["lr"] == lr]


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
        skipped |= {"norms", "batch_sizes", "no_pooled", "no_untrained_stats"}  # these pick cells
        settings = {"script": script, **{k: v for k, v in vars(args).items() if k not in skipped}}
        text = settings.get("text")
        if text is not None and Path(text).is_file():  # the file's content, not only its path: an edited corpus
            settings["text_sha256"] = hashlib.sha256(Path(text).read_bytes()).hexdigest()  # is other data
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


def run_cell(
    train_one: Callable[[float, int], Trial],
    lrs: Sequence[float],
    seeds: int,
    select: str = "mean",
    key: str = "val_loss",
    cache: TrialCache | None = None,
    name: str = "",
) -> Cell:
    """Run ``train_one(lr, seed)`` over the grid by the ``select`` rule and choose the learning rate by ``key``.

    With a ``cache``, runs are stored and read back under ``name`` (the cell), the rate and the seed.
    """
    if select not in SELECTIONS:
        raise ValueError(f"run_cell: expected select to be one of {', '.join(SELECTIONS)}, got {select!r}")

    def one(lr: float, seed: int) -> Trial:
        if cache is None:
            return {"lr": lr, "seed": seed, **train_one(lr, seed)}
        return {"lr": lr, "seed": seed, **cache.run(f"{name}|lr={lr!r}|seed={seed}", lambda: train_one(lr, seed))}

    first_seeds = range(seeds) if select == "mean" else range(1)
    trials = [one(lr, seed) for lr in lrs for seed in first_seeds]
    lr = choose_lr(trials, key)
    if select == "first" and lr is not None:
        trials += [one(lr, seed) for seed in range(1, seeds)]
        if choose_lr([row for row in trials if row["lr"] == lr], key) is None:
            lr = None  # a later seed failed at the rate seed 0 chose
    return Cell(lr, trials)


def summarize(cell: Cell) -> dict[str, Any]:
    """Mean over the chosen runs of every numeric column, its sample std as ``<column>_std``, and the status.

    ``status`` is ``ok`` when every chosen run trained, else the first failure's reason; ``seeds`` counts the runs.
    """
    runs = cell.chosen
    failures = [row["status"] for row in runs if row["status"] != "ok"]
    summary: dict[str, Any] = {"lr": cell.lr, "seeds": len(runs), "status": failures[0] if failures else "ok"}
    numeric = [
        key
        for key in dict.fromkeys(key for row in runs for key in row)
        if key not in ("lr", "seed") and any(isinstance(row.get(key), int | float) for row in runs)
    ]
    for key in numeric:
        values = [float(row.get(key, math.nan)) for row in runs]
        summary[key] = statistics.fmean(values)
        if all(isinstance(row.get(key), int) for row in runs) and len(set(values)) == 1:
            summary[key] = runs[0][key]  # a count every run shares (updates, tokens) stays an integer
        finite = len(values) > 1 and all(math.isfinite(value) for value in values)
        summary[f"{key}_std"] = statistics.stdev(values) if finite else math.nan
    return summary


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
    rule = (
        "the lowest mean validation loss over all seeds"
        if args.select == "mean"
        else "the lowest validation loss of seed 0, then the other seeds at that rate only"
    )
    return [
        f"Fair protocol: each cell chose its Adam learning rate from {{{', '.join(f'{lr:g}' for lr in args.lrs)}}} "
        f"by {rule}; values are mean ± sample std over {args.seeds} seeds (initialization and batch order) at "
        "the chosen rate; every run is in trials.csv. A rate where any seed failed was not eligible.",
        "Per-timestep BN (batch, batch_renorm) is evaluated twice: `_exact` columns after seqnorm.update_bn "
        f"recomputed its statistics as exact averages over {args.bn_stats_tokens} training tokens; `ema_gap` is the "
        "running averages' value minus the exact one (their lag; positive = running averages worse).",
        *(
            [f"{cache.hits} runs were read back from {cache.path} (same settings, cell, rate and seed) instead of "
             "trained again."]
            if cache is not None and cache.hits
            else []
        ),
    ]  # fmt: skip
