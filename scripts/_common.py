"""What the experiment scripts share: arguments, a plain training loop, evaluation, and output.

Every script takes ``--quick`` (small settings for ``make demo``), ``--text FILE`` or ``--dataset NAME`` (default:
the embedded synthetic corpus, so nothing downloads), ``--out DIR`` and ``--seed``; writes ``results.csv``,
``results.md`` (the table, the command, the machine and the run time) and PNG plots into ``--out``; and prints the
table. Model, norms, data and vocabulary all come from :mod:`seqnorm`; only the experiment lives in the scripts.

Data (fixed windows or natural lines) is in :mod:`_data`; the fair protocol (learning-rate grid, seeds, BN evaluated
with running and with exact statistics) in :mod:`_protocol`.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
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
from _data import Sequences, load_sequences, load_windows, loss_value, unigram_loss, value_name
from torch import Tensor, nn

from seqnorm.data import DATASETS, TEXT_FORMATS, BucketBatchSampler
from seqnorm.models import RNNLanguageModel
from seqnorm.norms import NORMS, BatchRenormSpec, NormSpec
from seqnorm.norms.specs import default_of

__all__ = [
    "FORGET_BIAS",
    "LIBRARY_FORGET_BIAS",
    "RENORM_SCHEDULE",
    "RunLog",
    "Sequences",
    "TrainResult",
    "add_forget_bias",
    "build_model",
    "describe_error",
    "evaluate",
    "forget_bias_text",
    "forget_bias_value",
    "load_sequences",
    "load_windows",
    "loss_value",
    "make_parser",
    "markdown_table",
    "model_outputs",
    "pyplot",
    "resolve",
    "train_language_model",
    "unigram_loss",
    "value_name",
    "write_csv",
    "write_results",
]

Row = Mapping[str, Any]


# --- arguments -------------------------------------------------------------------------------------------------------


def _number(kind: type, low: float, strict: bool, what: str) -> Callable[[str], Any]:
    """An argparse ``type``: ``kind(text)`` above ``low`` (or at it, unless ``strict``); else argparse's own error,
    which names the flag (``--batch-sizes 0`` divided by zero, ``--lrs -0.01`` reached Adam's ValueError)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low or (strict and value == low) or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


positive_int = _number(int, 0, True, "an int >= 1")
non_negative_int = _number(int, 0, False, "an int >= 0")
positive_float = _number(float, 0.0, True, "a number > 0")
at_least_two = _number(int, 2, False, "an int >= 2")

# Every norm gets the same forget-gate bias, the plain LSTM included: a different one for normalized cells (the
# library's default: 1 for them, torch's U(-1/sqrt(H), 1/sqrt(H)) for norm="none") would mix initialization into
# "normalization helps". 1 is the usual LSTM practice (Gers et al. 2000; Jozefowicz et al. 2015) and the library's
# value for normalized cells, so their rows keep their meaning and only the plain LSTM's initialization changes.
FORGET_BIAS = 1.0
LIBRARY_FORGET_BIAS = "library"


def forget_bias_value(text: str) -> float | str:
    """An argparse ``type`` for ``--forget-bias``: a finite number, or ``library`` (each norm's library default)."""
    if text == LIBRARY_FORGET_BIAS:
        return text
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number or {LIBRARY_FORGET_BIAS!r}, got {text!r}")
    return value


def add_forget_bias(parser: argparse.ArgumentParser) -> None:
    """``--forget-bias``: the LSTM forget-gate bias after initialization, the same for every norm."""
    parser.add_argument(
        "--forget-bias",
        type=forget_bias_value,
        default=FORGET_BIAS,
        metavar="B",
        help=f"forget-gate bias after initialization, the same for every norm, plain LSTM included (default "
        f"{FORGET_BIAS:g}); '{LIBRARY_FORGET_BIAS}': the library's defaults (1 for normalized cells, torch's "
        "initialization for norm='none'), which confound initialization with normalization",
    )


def forget_bias_text(args: argparse.Namespace) -> str:
    """The forget-bias setting in words, for tables and notes."""
    value = getattr(args, "forget_bias", LIBRARY_FORGET_BIAS)
    if value == LIBRARY_FORGET_BIAS:
        return "forget bias: library defaults (1 for normalized cells, torch's init for the plain LSTM)"
    return f"forget bias {value:g} for every norm (plain LSTM included)"


def make_parser(description: str, name: str, text: bool = True) -> argparse.ArgumentParser:
    """A parser with the options every experiment script shares; ``name`` sets the default ``--out``. ``text``:
    with the options of the text a script reads (``--text``, ``--dataset``, ...); ``False`` for a script that
    reads none (the init study's inputs are noise), which then refuses them rather than ignore them."""
    # no abbreviations: `--lr` (a flag of before the protocol's grid) ran as whichever flag it was short for
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--quick", action="store_true", help="small settings that run in a minute or two on 2 CPUs")
    if text:
        source = parser.add_mutually_exclusive_group()
        source.add_argument("--text", metavar="FILE", help="your own text file (train/val/test carved 80/10/10)")
        source.add_argument(
            "--dataset", metavar="NAME", choices=sorted(DATASETS), help=f"a registered corpus: {', '.join(DATASETS)}"
        )
        parser.add_argument(
            "--text-format",
            choices=TEXT_FORMATS,
            help="how --text is read, as the seqnorm command's --data.text_format: plain, or ptb_char (characters "
            "separated by spaces, '_' between words; the separators dropped). Default: plain text, and a file "
            "that looks like PTB-char is refused (its separators would make bpc falsely good)",
        )
        parser.add_argument("--encoding", default="utf-8", help="the text encoding of --text (default utf-8)")
        parser.add_argument(
            "--cache-dir", help="where --dataset downloads go (default $SEQNORM_CACHE or ~/.cache/seqnorm)"
        )
    parser.add_argument("--out", type=Path, default=Path("results") / name, help="output directory")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    add_forget_bias(parser)
    parser.add_argument(
        "--threads",
        type=positive_int,
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
    text = getattr(args, "text", None)
    if text is not None and not Path(text).is_file():  # else the library's message names its own --data.path
        raise SystemExit(f"error: --text {text}: {'not a regular file' if Path(text).exists() else 'no such file'}")
    out = getattr(args, "out", None)
    if out is not None:
        writable_folder(out, "--out")  # now, not after hours of training
    torch.set_num_threads(args.threads)
    # The same seed gives the same numbers in every process: the compiled kernels then take one fixed matmul route,
    # not the one measured fastest under whatever load the machine had (each rounds differently).
    torch.use_deterministic_algorithms(True)
    return args


def writable_folder(folder: str | Path, flag: str) -> None:
    """Create ``folder`` (and its parents) if needed, or end the script with one line naming ``flag`` where it
    cannot be created or written: a script found it out when it wrote its tables, after all its training."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SystemExit(f"error: {flag} {folder}: cannot create the folder ({error.strerror or error})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SystemExit(f"error: {flag} {folder}: cannot write there")


# --- model and training ---------------------------------------------------------------------------------------------


# Batch renorm's published schedule (5000 warm-up batches, ramps of 25k-40k) is longer than these runs; a
# proportionally shorter one lets its r/d correction act at all (counted per time step, in training batches).
RENORM_SCHEDULE = {"warmup": 50, "r_max_steps": 200, "d_max_steps": 200}


def build_model(
    vocab_size: int,
    args: argparse.Namespace,
    norm: str | NormSpec,
    max_steps: int,
    seed: int | None = None,
    **rnn_kwargs: Any,
) -> RNNLanguageModel:
    """The LSTM language model of ``args.hidden``/``args.embedding`` with ``norm`` (a name or a spec), initialized
    from ``seed``.

    ``seed`` defaults to ``args.seed``. ``batch_renorm`` gets :data:`RENORM_SCHEDULE` unless its spec sets a
    schedule. An LSTM gets ``args.forget_bias`` (``--forget-bias``) whatever the norm; without it, or with
    ``library``, the library's default of each norm. ``args.gamma_init`` (``--gamma-init``, where a script has it)
    sets every norm's initial gain.
    """
    spec = NORMS[norm].spec() if isinstance(norm, str) else norm
    if isinstance(spec, BatchRenormSpec) and all(
        getattr(spec, key) == default_of(BatchRenormSpec, key) for key in RENORM_SCHEDULE
    ):
        norm = dataclasses.replace(spec, **RENORM_SCHEDULE)
    gamma_init = getattr(args, "gamma_init", None)  # --gamma-init: every norm's initial gain alike
    spec = NORMS[norm].spec() if isinstance(norm, str) else norm
    if gamma_init is not None and "gamma_init" in {field.name for field in dataclasses.fields(spec)}:
        norm = dataclasses.replace(spec, gamma_init=gamma_init)
    forget_bias = getattr(args, "forget_bias", LIBRARY_FORGET_BIAS)
    if forget_bias != LIBRARY_FORGET_BIAS and getattr(args, "cell", "lstm") == "lstm":
        rnn_kwargs.setdefault("forget_bias", forget_bias)
    torch.manual_seed(args.seed if seed is None else seed)
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


def model_outputs(model: nn.Module, batch: Sequences, state: Any = None) -> tuple[Tensor, Any]:
    """Logits ``(B, T, V)`` of one batch and its final recurrent state, detached (gradients stop at the window
    boundary). A stream window (``batch.stateful``) starts from ``state``; other batches from zeros (state ``None``)."""
    if not batch.stateful:
        return model(*batch.model_inputs()), None
    logits, final = model.forward_with_state(batch.inputs, None, state)  # streams are never padded
    return logits, final.detach() if isinstance(final, Tensor) else tuple(t.detach() for t in final)


def _losses(model: nn.Module, batch: Sequences, state: Any = None) -> tuple[Tensor, Any]:
    """Per-position losses ``(B, T)`` of one batch (zero at padding: its target is the padding id 0) and the final
    state (:func:`model_outputs`)."""
    logits, final = model_outputs(model, batch, state)
    return F.cross_entropy(logits.transpose(1, 2), batch.targets, reduction="none", ignore_index=0), final


@torch.no_grad()
def evaluate(model: nn.Module, sequences: Sequences, batch_size: int = 64) -> tuple[float, Tensor]:
    """Loss in eval mode (nats per real token) over ``sequences``, and its mean by position ``(T,)``."""
    was_training = model.training
    model.eval()
    total = torch.zeros(sequences.steps, dtype=torch.float64)
    count = torch.zeros(sequences.steps, dtype=torch.float64)
    # Stream windows: the split read as one stream, window after window, the state carried.
    batches = sequences.stream_batches(1) if sequences.stateful else torch.arange(len(sequences)).split(batch_size)
    state = None
    for index in batches:
        batch = sequences.batch(index)
        losses, state = _losses(model, batch, state)
        total[: batch.steps] += losses.sum(0).double()
        count[: batch.steps] += (torch.arange(batch.steps) < batch.lengths.unsqueeze(1)).sum(0)
    model.train(was_training)
    return float(total.sum() / count.sum()), (total / count.clamp(min=1)).float()


@dataclass
class TrainResult:
    """What one training run did.

    Attributes:
        status: ``"ok"`` or a short reason it could not train (the error, or divergence).
        tokens: real training target tokens consumed (padding excluded).
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
    train: Sequences,
    *,
    batch_size: int,
    tokens: int,
    lr: float,
    seed: int = 0,
    clip: float = 1.0,
    max_updates: int | None = None,
    evaluate_every: int | None = None,
    evaluate_fn: Callable[[nn.Module], float] | None = None,
    bucket: bool = False,
) -> TrainResult:
    """Adam on shuffled sequences in batches of ``batch_size`` until ``tokens`` target tokens have been seen
    (stream windows, ``train.stateful``: in stream order, the state carried).

    ``max_updates`` instead stops after that many updates (the equal-updates view; ``tokens`` is then ignored).
    Every sequence is used once per epoch (the last partial batch of an epoch is dropped), so a budget below one
    epoch is the online regime: each sequence seen once. Batches are drawn at random, so with lines a batch's rows
    end at different steps; ``bucket`` instead groups sequences of similar length, as the library's
    :class:`~seqnorm.data.BucketBatchSampler` does (shuffled pools sorted by length, the batches shuffled; seeded
    from ``seed`` and the epoch), so a batch's rows end at nearly the same step. A ``ValueError`` from the model
    (per-timestep BN at batch size 1) or a non-finite loss ends the run with that reason as its status instead of
    raising.
    """
    if len(train) < batch_size:
        return TrainResult(f"skipped: {len(train)} training sequences, fewer than the batch size {batch_size}")
    generator = torch.Generator().manual_seed(seed)
    sampler = BucketBatchSampler(train.lengths.tolist(), batch_size, drop_last=True, seed=seed) if bucket else None
    epoch = 0
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    result = TrainResult("ok")
    losses: list[float] = []
    next_evaluation = evaluate_every or 0
    if evaluate_fn is not None:
        result.curve.append((0, evaluate_fn(model)))
    model.train()
    batches: list[Tensor] = []
    state = None  # the carried state of stream windows
    start = time.perf_counter()

    def more() -> bool:
        return result.updates < max_updates if max_updates is not None else result.tokens < tokens

    try:
        while more():
            if not batches:
                if train.stateful:  # in order: window k of every stream, then k + 1; a new epoch starts from zeros
                    batches, state = train.stream_batches(batch_size)[::-1], None
                elif sampler is not None:
                    sampler.set_epoch(epoch)
                    batches = [torch.tensor(batch) for batch in sampler][::-1]
                    epoch += 1
                else:
                    order = torch.randperm(len(train), generator=generator)
                    batches = list(order[: len(order) - len(order) % batch_size].split(batch_size))[::-1]
            batch = train.batch(batches.pop())
            real = batch.tokens
            positions, state = _losses(model, batch, state)
            loss = positions.sum() / real
            if not torch.isfinite(loss):
                result.status = f"diverged: loss {float(loss.detach())} at update {result.updates}"
                break
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            losses.append(loss.item())
            result.updates += 1
            result.tokens += real
            if evaluate_fn is not None and evaluate_every and result.tokens >= next_evaluation:
                paused = time.perf_counter()
                result.curve.append((result.tokens, evaluate_fn(model)))
                start += time.perf_counter() - paused  # evaluation time is not training time
                while next_evaluation <= result.tokens:
                    next_evaluation += evaluate_every
    except ValueError as error:
        result.status = describe_error(error)
    result.seconds = time.perf_counter() - start
    if evaluate_fn is not None and evaluate_every and result.status == "ok" and result.curve[-1][0] != result.tokens:
        # a budget estimated from mean lengths (--updates with lines) can end short of the last planned point:
        # the curve still ends where training did, so its last stretch (last_gain) is the real one
        result.curve.append((result.tokens, evaluate_fn(model)))
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
        # large values (token counts averaged over seeds) keep every integer digit: .4g would print 1.000e+05
        return f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:.1f}"
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
