"""The experiment scripts' data: a split as padded token sequences, either fixed windows or natural lines.

Three ways to cut the same text (``--unit``):

- ``window``: the corpus read as one token stream and cut into windows of equal length (``unit="window"``). Every
  time step of every batch then has all its rows, so per-timestep BN sees full batches everywhere; the short last
  window of each split is dropped.
- ``line``: one line per sequence (``unit="line"``, input ``<bos> + line``, target ``line + <eos>``), padded to
  the longest line of each batch. Rows end at different steps, so the tail steps of a batch have fewer active rows
  than the batch size, down to one: the variable-length mechanism of per-timestep BN (its ``small_batch`` policy)
  is exercised only here. Lines longer than the window are cut into pieces by the library.
- ``stream``: the windows of ``window``, read as stateful truncated BPTT (char-rnn / AWD-LSTM): the split's windows,
  in text order, are cut into ``B`` contiguous streams (:func:`seqnorm.data.streams.contiguous_streams` on their
  indices), batch ``k`` holds window ``k`` of every stream, and the model starts each window from the previous
  window's final state, detached (:meth:`Sequences.stream_batches`). Evaluation reads the split as one stream, one
  window after another, carrying the state. Per-timestep BN numbers every window's steps from 0 (the library's
  ``stream_steps="restart"``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from seqnorm.data import DataError, TextCorpus
from seqnorm.data.streams import contiguous_streams

__all__ = [
    "UNITS",
    "Sequences",
    "load_sequences",
    "load_windows",
    "loss_value",
    "open_corpus",
    "script_message",
    "unigram_loss",
    "value_name",
]

UNITS = ("window", "line", "stream")
# The library's data errors name the `seqnorm` command's flags; the scripts' own flags for the same settings.
SCRIPT_FLAGS = {
    "--data.train_path": "--text",
    "--data.path": "--text",
    "--data.text_format": "--text-format",
    "--data.dataset": "--dataset",
    "--data.cache_dir": "--cache-dir",
    "--data.encoding": "--encoding",
}

SCRIPT_ADVICE = [
    # the scripts carve validation and test from --text at the library's fractions, and take no split files
    (
        r"raise --data\.\w+_fraction, pass --data\.\w+_path or add text",
        "add text (validation and test take 10% of it each)",
    ),
    (r"--data\.val_fraction (\S+) and --data\.test_fraction (\S+)", r"a validation fraction \1 and a test fraction \2"),
    (r"; lower them or add text", "; add text"),
    (r"\(--data\.(val|test)_fraction (\S+)\)", r"(a fraction \2)"),
]
"""The library's advice about flags the scripts do not have, in the scripts' words (after :data:`SCRIPT_FLAGS`)."""


def script_words(text: str) -> str:
    """``text`` (a data error or notice of the library's) naming the scripts' flags (:data:`SCRIPT_FLAGS`) and
    giving their advice (:data:`SCRIPT_ADVICE`) where the library names the ``seqnorm`` command's flags."""
    for library_flag, script_flag in SCRIPT_FLAGS.items():
        text = text.replace(library_flag, script_flag)
    for pattern, replacement in SCRIPT_ADVICE:
        text = re.sub(pattern, replacement, text)
    return text


class _ScriptWords(logging.Filter):
    """The library's notices (``TextCorpus: carved from the end of --data.path ...``) in the scripts' words."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = script_words(record.getMessage()), None
        return True


@contextlib.contextmanager
def _notices_in_script_words() -> Iterator[None]:
    """The library's notices in the scripts' words (:class:`_ScriptWords`) while the block runs, and only then: the
    process may run the ``seqnorm`` command too (the tests do)."""
    logger, words = logging.getLogger("lightning.pytorch.utilities.rank_zero"), _ScriptWords()
    logger.addFilter(words)
    try:
        yield
    finally:
        logger.removeFilter(words)


@dataclass
class Sequences:
    """Next-token sequences of one split, padded on the right with id 0 (the library's padding id).

    Attributes:
        inputs: ``(N, T)`` token ids, ``T`` the longest sequence.
        targets: ``(N, T)`` the next token at each position (padding where the input is padding).
        lengths: ``(N,)`` real positions of each sequence (all ``T`` for windows).
        stateful: the rows are consecutive windows of one text, read as streams with the state carried
            (``unit="stream"``).
    """

    inputs: Tensor
    targets: Tensor
    lengths: Tensor
    stateful: bool = False

    def __len__(self) -> int:
        return self.inputs.shape[0]

    @property
    def steps(self) -> int:
        """``T``: the longest sequence's length."""
        return self.inputs.shape[1]

    @property
    def ragged(self) -> bool:
        """Whether any sequence is shorter than ``T`` (then the model needs ``lengths``)."""
        return bool((self.lengths < self.steps).any())

    @property
    def tokens(self) -> int:
        """Real target tokens (padding excluded)."""
        return int(self.lengths.sum())

    def batch(self, index: Tensor) -> Sequences:
        """The sequences at ``index``, trimmed to the longest of them (less padding to run through)."""
        lengths = self.lengths[index]
        longest = int(lengths.max())
        return Sequences(self.inputs[index, :longest], self.targets[index, :longest], lengths, self.stateful)

    def stream_batches(self, batch_size: int) -> list[Tensor]:
        """The row indices of each batch when the rows are read as ``batch_size`` contiguous streams: batch ``k`` is
        window ``k`` of every stream (the rows that do not fill all streams are left out)."""
        streams = contiguous_streams(torch.arange(len(self)), batch_size, flag="--batch-sizes")  # (B, windows)
        return list(streams.unbind(1))

    def model_inputs(self) -> tuple[Tensor, ...]:
        """What ``RNNLanguageModel`` is called with: ``(inputs,)``, or ``(inputs, lengths)`` when ragged."""
        return (self.inputs, self.lengths) if self.ragged else (self.inputs,)

    def head(self, max_tokens: int | None) -> Sequences:
        """The first sequences holding at most ``max_tokens`` target tokens (at least one sequence)."""
        if max_tokens is None:
            return self
        count = max(1, int((self.lengths.cumsum(0) <= max_tokens).sum()))
        return self.batch(torch.arange(count))


def _stack(sequences: list[Tensor]) -> Sequences:
    padded = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True)  # (N, T + 1), padding id 0
    lengths = torch.tensor([len(s) - 1 for s in sequences])
    targets = padded[:, 1:].clone()
    return Sequences(padded[:, :-1], targets, lengths)


def script_message(error: DataError) -> str:
    """``error``'s message as one line naming the scripts' flags (``--text``, ``--text-format``) where the library
    names the ``seqnorm`` command's (``--data.path``, ``--data.text_format``)."""
    return f"error: {script_words(' '.join(str(error).split()))}"


def open_corpus(
    args: argparse.Namespace, unit: str, window_length: int, vocab_from: TextCorpus | None = None
) -> TextCorpus:
    """The :class:`TextCorpus` of ``--text``/``--dataset`` (else the embedded corpus), read as ``--text-format``
    says, its datasets built; a data error (a PTB-char file read as plain text, say) ends the script with one line
    naming the file and the scripts' flag (:func:`script_message`), not a traceback whose advice names the CLI's."""
    try:
        with _notices_in_script_words():
            corpus = TextCorpus(
                path=args.text,
                dataset=args.dataset,
                unit=unit,  # type: ignore[arg-type]
                window_length=window_length,
                batch_size=1,  # batching happens in the scripts' own loop
                text_format=getattr(args, "text_format", None),
                seed=args.seed,
                cache_dir=args.cache_dir,
                encoding=getattr(args, "encoding", "utf-8"),
            )
            if vocab_from is not None:
                corpus.load_state_dict(vocab_from.state_dict())
            corpus.datasets  # noqa: B018 -- reads, checks and encodes the text now, inside this handler
    except DataError as error:
        raise SystemExit(script_message(error)) from None
    return corpus


def load_sequences(
    args: argparse.Namespace,
    steps: int,
    unit: str = "window",
    vocab_from: TextCorpus | None = None,
    splits: Sequence[str] = ("train", "val"),
) -> tuple[TextCorpus, dict[str, Sequences]]:
    """The ``splits`` (``train`` and ``val``; ``test`` too where a script reports it) of ``--text``/``--dataset``
    (else the embedded corpus) cut by ``unit``. The carved splits do not depend on which are loaded.

    ``steps`` is the window's number of predictions, or for lines the most any piece of a line has. ``vocab_from``
    shares another corpus's vocabulary (the same text cut another way; the vocabularies of one text agree). Data
    errors end the script with one line (:func:`open_corpus`).
    """
    if unit not in UNITS:
        raise ValueError(f"load_sequences: expected unit to be one of {', '.join(UNITS)}, got {unit!r}")
    corpus = open_corpus(args, "window" if unit == "stream" else unit, steps + 1, vocab_from)
    loaded = {}
    for split in splits:
        sequences = corpus.datasets[split].sequences  # type: ignore[attr-defined]
        if unit != "line":
            sequences = [s for s in sequences if len(s) == steps + 1]
        if not sequences:
            error = DataError(
                f"{corpus.source}: the {split} split has no window of {steps + 1} tokens; add text or use fewer steps"
            )
            raise SystemExit(script_message(error))
        loaded[split] = _stack(sequences)
        loaded[split].stateful = unit == "stream"
    return corpus, loaded


def load_windows(
    args: argparse.Namespace, steps: int, vocab_from: TextCorpus | None = None
) -> tuple[TextCorpus, dict[str, Sequences]]:
    """:func:`load_sequences` with ``unit="window"``: every sequence exactly ``steps`` long."""
    return load_sequences(args, steps, "window", vocab_from)


def unigram_loss(train: Sequences, val: Sequences, vocab_size: int) -> float:
    """Validation loss (nats per token) of the training split's token frequencies: the no-context baseline."""
    real_train = train.targets[_real(train)]
    counts = torch.bincount(real_train, minlength=vocab_size).double() + 1.0  # add-one: no log(0)
    log_probs = (counts / counts.sum()).log()
    return float(-log_probs[val.targets[_real(val)]].mean())


def _real(sequences: Sequences) -> Tensor:
    return torch.arange(sequences.steps) < sequences.lengths.unsqueeze(1)  # (N, T)


def value_name(level: str) -> str:
    """``val_bpc`` for character models, ``val_ppl`` for word models."""
    return "val_bpc" if level == "char" else "val_ppl"


def loss_value(loss: float, level: str) -> float:
    """Bits per character (char level) or perplexity (word level) of a loss in nats per token."""
    return loss / math.log(2) if level == "char" else math.exp(min(loss, 50.0))
