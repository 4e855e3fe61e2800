"""What the experiment scripts share: arguments, data as fixed-length windows, a plain training loop, and output.

Every script takes ``--quick`` (small settings for ``make demo``), ``--text FILE`` or ``--dataset NAME`` (default:
the embedded synthetic corpus, so nothing downloads), ``--out DIR`` and ``--seed``; writes ``results.csv``,
``results.md`` (the table, the command, the machine and the run time) and PNG plots into ``--out``; and prints the
table. Model, norms, data and vocabulary all come from :mod:`seqnorm`; only the experiment lives in the scripts.

Training data is the corpus read as one token stream cut into windows of equal length (``unit="window"``), because
then every time step of every batch has all its rows: per-timestep batch norm trains at any batch size of 2 or more
with its default ``small_batch="error"``, and the only run that cannot train is the one that genuinely cannot
(batch size 1). What variable-length batches do to BN is measured separately by ``small_batch_statistics.py``.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seqnorm.data import DATASETS, DataError, TextCorpus
from seqnorm.models import RNNLanguageModel

__all__ = [
    "RENORM_SCHEDULE",
    "RunLog",
    "TrainResult",
    "Windows",
    "build_model",
    "describe_error",
    "evaluate",
    "load_windows",
    "make_parser",
    "markdown_table",
    "pyplot",
    "resolve",
    "train_language_model",
    "unigram_loss",
    "value_name",
    "write_results",
]

Row = Mapping[str, Any]


# --- arguments -------------------------------------------------------------------------------------------------------


def make_parser(description: str, name: str) -> argparse.ArgumentParser:
    """A parser with the options every experiment script shares; ``name`` sets the default ``--out``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small settings that run in a minute or two on 2 CPUs")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--text", metavar="FILE", help="your own text file (train/val/test carved 80/10/10)")
    source.add_argument(
        "--dataset", metavar="NAME", choices=sorted(DATASETS), help=f"a registered corpus: {', '.join(DATASETS)}"
    )
    parser.add_argument("--cache-dir", help="where --dataset downloads go (default $SEQNORM_CACHE or ~/.cache)")
    parser.add_argument("--out", type=Path, default=Path("results") / name, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: these models are small, per-step overhead dominates, and on a shared "
        "2-core machine one thread measured 2-5x faster than two)",
    )
    return parser


def resolve(args: argparse.Namespace, quick: Mapping[str, Any], full: Mapping[str, Any]) -> argparse.Namespace:
    """Fill every option left at ``None`` from ``quick`` or ``full`` (by ``args.quick``); explicit flags win."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    torch.set_num_threads(args.threads)
    return args


# --- data ------------------------------------------------------------------------------------------------------------


@dataclass
class Windows:
    """Equal-length next-token windows of one split.

    Attributes:
        inputs: ``(N, T)`` token ids.
        targets: ``(N, T)`` the inputs shifted by one.
    """

    inputs: Tensor
    targets: Tensor

    def __len__(self) -> int:
        return self.inputs.shape[0]

    @property
    def steps(self) -> int:
        return self.inputs.shape[1]

    def head(self, max_tokens: int | None) -> Windows:
        """The first windows holding at most ``max_tokens`` target tokens (at least one window)."""
        if max_tokens is None:
            return self
        count = max(1, max_tokens // self.steps)
        return Windows(self.inputs[:count], self.targets[:count])


def load_windows(
    args: argparse.Namespace, steps: int, vocab_from: TextCorpus | None = None
) -> tuple[TextCorpus, dict[str, Windows]]:
    """The corpus of ``--text``/``--dataset`` (else the embedded one) as windows of ``steps`` predictions.

    Windows shorter than the rest (the end of each split) are dropped, so that every batch is full at every step.
    ``vocab_from`` shares another corpus's vocabulary (the same text cut into windows of another length).
    """
    corpus = TextCorpus(
        path=args.text,
        dataset=args.dataset,
        unit="window",
        window_length=steps + 1,
        batch_size=1,  # batching happens in the scripts' own loop
        seed=args.seed,
        cache_dir=args.cache_dir,
    )
    if vocab_from is not None:
        corpus.load_state_dict(vocab_from.state_dict())
    splits = {}
    for split in ("train", "val"):
        sequences = [s for s in corpus.datasets[split].sequences if len(s) == steps + 1]  # type: ignore[attr-defined]
        if not sequences:
            raise DataError(
                f"{corpus.source}: the {split} split has no window of {steps + 1} tokens; add text or use fewer steps"
            )
        stacked = torch.stack(sequences)  # (N, steps + 1)
        splits[split] = Windows(stacked[:, :-1], stacked[:, 1:])
    return corpus, splits


def unigram_loss(train: Windows, val: Windows, vocab_size: int) -> float:
    """Validation loss (nats per token) of the training split's token frequencies: the no-context baseline."""
    counts = torch.bincount(train.targets.flatten(), minlength=vocab_size).double() + 1.0  # add-one: no log(0)
    log_probs = (counts / counts.sum()).log()
    return float(-log_probs[val.targets.flatten()].mean())


def value_name(level: str) -> str:
    """``val_bpc`` for character models, ``val_ppl`` for word models."""
    return "val_bpc" if level == "char" else "val_ppl"


def loss_value(loss: float, level: str) -> float:
    """Bits per character (char level) or perplexity (word level) of a loss in nats per token."""
    return loss / math.log(2) if level == "char" else math.exp(min(loss, 50.0))


# --- model and training ----------------------------------------------------------------------------------------------


# Batch renorm's published schedule (5000 warm-up batches, ramps of 25k-40k) is longer than these runs; a
# proportionally shorter one lets its r/d correction act at all (counted per time step, in training batches).
RENORM_SCHEDULE = {"warmup": 50, "r_max_steps": 200, "d_max_steps": 200}


def build_model(
    vocab_size: int, args: argparse.Namespace, norm: str, max_steps: int, **rnn_kwargs: Any
) -> RNNLanguageModel:
    """The LSTM language model of ``args.hidden``/``args.embedding`` with ``norm`` (seeded by ``args.seed``).

    ``batch_renorm`` gets :data:`RENORM_SCHEDULE` unless ``norm_options`` says otherwise.
    """
    if norm == "batch_renorm":
        rnn_kwargs.setdefault("norm_options", RENORM_SCHEDULE)
    torch.manual_seed(args.seed)
    return RNNLanguageModel(
        vocab_size,
        embedding_dim=args.embedding,
        hidden_size=args.hidden,
        cell=getattr(args, "cell", "lstm"),
        norm=norm,
        max_steps=max_steps,
        **rnn_kwargs,
    )


def describe_error(error: Exception) -> str:
    """A one-line status for a run that could not train: the exception type and its message's first sentence."""
    sentence = str(error).split(". ")[0].strip()
    owner, colon, rest = sentence.partition(": ")
    if colon and " " not in owner:  # "LSTMCell: expected ..." -> "expected ..."
        sentence = rest
    return f"{type(error).__name__}: {sentence}"


@torch.no_grad()
def evaluate(model: nn.Module, windows: Windows, batch_size: int = 64) -> tuple[float, Tensor]:
    """Loss in eval mode (nats per token) over ``windows``, and its mean by position ``(T,)``."""
    was_training = model.training
    model.eval()
    total = torch.zeros(windows.steps, dtype=torch.float64)
    for start in range(0, len(windows), batch_size):
        logits = model(windows.inputs[start : start + batch_size])  # (B, T, V)
        losses = F.cross_entropy(logits.transpose(1, 2), windows.targets[start : start + batch_size], reduction="none")
        total += losses.sum(0).double()
    model.train(was_training)
    by_position = total / len(windows)
    return float(by_position.mean()), by_position.float()


@dataclass
class TrainResult:
    """What one training run did.

    Attributes:
        status: ``"ok"`` or a short reason it could not train (the error, or divergence).
        tokens: training target tokens consumed.
        updates: optimizer steps taken.
        seconds: wall time of the training loop (evaluations excluded).
        train_loss: mean training loss (nats) over the last tenth of the updates.
        curve: ``(tokens seen, validation loss)`` at each evaluation, starting at 0 tokens.
    """

    status: str
    tokens: int = 0
    updates: int = 0
    seconds: float = 0.0
    train_loss: float = math.nan
    curve: list[tuple[int, float]] = field(default_factory=list)


def train_language_model(
    model: nn.Module,
    train: Windows,
    *,
    batch_size: int,
    tokens: int,
    lr: float,
    seed: int = 0,
    clip: float = 1.0,
    evaluate_every: int | None = None,
    evaluate_fn: Callable[[nn.Module], float] | None = None,
) -> TrainResult:
    """Adam on shuffled windows in batches of ``batch_size`` until ``tokens`` target tokens have been seen.

    Every window is used once per epoch (the last partial batch of an epoch is dropped), so a budget below one epoch
    is the online regime: each window seen once. A ``ValueError`` from the model (per-timestep BN at batch size 1)
    or a non-finite loss ends the run with that reason as its status instead of raising.
    """
    if len(train) < batch_size:
        return TrainResult(f"skipped: {len(train)} training windows, fewer than the batch size {batch_size}")
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    result = TrainResult("ok")
    losses: list[float] = []
    next_evaluation = evaluate_every or 0
    if evaluate_fn is not None:
        result.curve.append((0, evaluate_fn(model)))
    model.train()
    batches: list[Tensor] = []
    start = time.perf_counter()
    try:
        while result.tokens < tokens:
            if not batches:
                order = torch.randperm(len(train), generator=generator)
                batches = list(order[: len(order) - len(order) % batch_size].split(batch_size))[::-1]
            index = batches.pop()
            logits = model(train.inputs[index])  # (B, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1), train.targets[index].flatten())
            if not torch.isfinite(loss):
                result.status = f"diverged: loss {float(loss)} at update {result.updates}"
                break
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            losses.append(loss.item())
            result.updates += 1
            result.tokens += index.numel() * train.steps
            if evaluate_fn is not None and evaluate_every and result.tokens >= next_evaluation:
                paused = time.perf_counter()
                result.curve.append((result.tokens, evaluate_fn(model)))
                start += time.perf_counter() - paused  # evaluation time is not training time
                next_evaluation += evaluate_every
    except ValueError as error:
        result.status = describe_error(error)
    result.seconds = time.perf_counter() - start
    if losses:
        tail = losses[-max(1, len(losses) // 10) :]
        result.train_loss = sum(tail) / len(tail)
    return result


# --- output ----------------------------------------------------------------------------------------------------------


def _format(value: Any, digits: int) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.{digits}g}" if abs(value) < 1e5 else f"{value:.3e}"
    return str(value)


def markdown_table(rows: Sequence[Row], columns: Sequence[str], digits: int = 4) -> str:
    """A GitHub Markdown table of ``rows`` (dicts) in ``columns`` order; floats to ``digits`` significant digits."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_format(row.get(column), digits) for column in columns) + " |")
    return "\n".join(lines)


def write_csv(path: Path, rows: Sequence[Row], columns: Sequence[str]) -> None:
    """``rows`` as CSV with a header; floats at full precision, missing values empty."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: _format(row.get(key), 8) for key in columns})


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass
class RunLog:
    """The command, machine and start time of a run, for the provenance lines of ``results.md``."""

    argv: Sequence[str]
    script: str
    started: float = field(default_factory=time.perf_counter)

    def lines(self) -> list[str]:
        command = " ".join(["python", f"scripts/{self.script}.py", *map(shlex.quote, self.argv)])
        machine = f"{_cpu_name()} ({os.cpu_count()} CPUs)"
        return [
            f"Command: `{command}`",
            f"Machine: {machine}, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}, "
            f"Python {platform.python_version()}",
            f"Run time: {time.perf_counter() - self.started:.0f} s",
        ]


def write_results(
    out: Path,
    rows: Sequence[Row],
    columns: Sequence[str],
    *,
    title: str,
    run: RunLog,
    notes: Sequence[str] = (),
    extra_tables: Sequence[tuple[str, Sequence[Row], Sequence[str]]] = (),
) -> str:
    """Write ``results.csv`` and ``results.md`` into ``out``, print the table, and return the Markdown.

    ``extra_tables`` are ``(title, rows, columns)`` shown after the main table in ``results.md`` (and printed).
    """
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "results.csv", rows, columns)
    parts = [f"## {title}", "", markdown_table(rows, columns)]
    for extra_title, extra_rows, extra_columns in extra_tables:
        parts += ["", f"### {extra_title}", "", markdown_table(extra_rows, extra_columns)]
    if notes:
        parts += ["", *(f"- {note}" for note in notes)]
    parts += ["", *(f"{line}  " for line in run.lines())]
    text = "\n".join(parts) + "\n"
    (out / "results.md").write_text(text)
    print(text)
    sys.stdout.flush()
    return text


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
