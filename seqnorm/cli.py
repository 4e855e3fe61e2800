"""The ``seqnorm`` command: LightningCLI's ``fit``, ``validate``, ``test``, ``predict``, plus ``generate``.

Examples::

    seqnorm fit --model LanguageModel --data TextCorpus --data.path my.txt --model.norm layer
    seqnorm fit --config configs/char_lm.yaml --config configs/norm/batch.yaml --data.path my.txt
    seqnorm fit ... --ckpt_path lightning_logs/version_0/checkpoints/last.ckpt    # resume
    seqnorm generate --ckpt_path lightning_logs/version_0/checkpoints/last.ckpt --prompt "The " --length 200

User errors (a missing file, bad text, an impossible setting) end with a one-paragraph message and exit code 2,
not a traceback; set ``SEQNORM_DEBUG=1`` to see the traceback.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from jsonargparse import auto_cli
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from seqnorm.data import LabeledText, TextCorpus, Vocabulary
from seqnorm.lightning import LanguageModel, SequenceClassifier
from seqnorm.lightning.base import DATA_STATE_KEY
from seqnorm.lightning.generate import generate_text

__all__ = ["SIGTERM_EXIT_CODE", "SeqnormCLI", "generate", "main"]

SIGTERM_EXIT_CODE = 128 + signal.SIGTERM
"""Exit code of a run stopped by SIGTERM (after saving last.ckpt): the shell's code for "terminated by SIGTERM"."""

# Registered for `--model NAME` / `--data NAME` (LightningCLI's subclass mode resolves short names of imported
# subclasses); listed here so that importing this module is what makes them available.
MODELS = (LanguageModel, SequenceClassifier)
DATAMODULES = (TextCorpus, LabeledText)

DEFAULT_CALLBACKS: list[dict[str, Any]] = [
    {  # best by validation loss, plus last.ckpt (also written on an exception or interrupt) for --ckpt_path resume
        "class_path": "seqnorm.lightning.checkpoint.ResumableCheckpoint",
        "init_args": {
            "monitor": "val/loss",
            "mode": "min",
            "filename": "best-{epoch}-{step}",
            "save_last": True,
            "save_on_exception": True,
        },
    },
]
# The progress bar is Lightning's default RichProgressBar (rich is a dependency), so
# `--trainer.enable_progress_bar false` still works.


class SeqnormCLI(LightningCLI):
    """LightningCLI with the sizes that come from the data linked into the model (never typed twice)."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # set_defaults, not trainer_defaults: it parses class_path dicts (and `--trainer.callbacks+=X` appends)
        parser.set_defaults({"trainer.callbacks": DEFAULT_CALLBACKS})
        # Each link applies where both ends exist: level -> LanguageModel, num_classes -> SequenceClassifier.
        for source, target in (
            ("data.vocab_size", "model.init_args.vocab_size"),
            ("data.pad_index", "model.init_args.pad_index"),
            ("data.level", "model.init_args.level"),
            ("data.num_classes", "model.init_args.num_classes"),
        ):
            parser.link_arguments(source, target, apply_on="instantiate")


def generate(
    *,
    ckpt_path: str,
    prompt: str = "",
    length: int = 200,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
) -> str:
    """Generate text from a LanguageModel checkpoint, one token at a time at batch size 1.

    Args:
        ckpt_path: a checkpoint written by ``seqnorm fit --model LanguageModel`` (e.g. ``.../last.ckpt``).
        prompt: text to continue (tokenized like the training data; unknown tokens become <unk>).
        length: number of tokens to generate.
        temperature: sampling temperature; 0 for greedy decoding.
        top_k: sample only among the k most likely tokens.
        seed: random seed for reproducible samples.
    """
    path = Path(ckpt_path)
    if not path.is_file():
        raise ValueError(f"--ckpt_path {ckpt_path}: no such checkpoint file")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    data_state = checkpoint.get(DATA_STATE_KEY)
    if data_state is None or "unit" not in data_state:
        raise ValueError(
            f"--ckpt_path {ckpt_path}: not a LanguageModel checkpoint written by `seqnorm fit` (it holds no "
            "vocabulary); pass a checkpoint of a language model run"
        )
    model = LanguageModel.load_from_checkpoint(path, map_location="cpu")
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return generate_text(
        model.model,
        Vocabulary.from_dict(data_state["vocab"]),
        level=data_state["level"],
        unit=data_state["unit"],
        prompt=prompt,
        length=length,
        temperature=temperature,
        top_k=top_k,
        generator=generator,
    )


def _generate_command(args: list[str]) -> None:
    text = auto_cli(generate, args=args)
    print(text)


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``seqnorm`` console script."""
    argv = sys.argv[1:] if args is None else args
    command = argv[0] if argv else ""
    try:
        if command == "generate":
            _generate_command(argv[1:])
        else:
            cli = SeqnormCLI(args=args, seed_everything_default=0)  # None: LightningCLI reads sys.argv itself
            if cli.trainer.received_sigterm:  # the run finished before the loops noticed the signal
                raise SIGTERMException
    except SIGTERMException:  # Lightning's SystemExit(None) would exit 0, as if the run had completed
        print(f"seqnorm {command}: stopped by SIGTERM", file=sys.stderr)
        raise SystemExit(SIGTERM_EXIT_CODE) from None
    except ValueError as error:  # our user-facing errors (DataError included) are ValueErrors with a full message
        if os.environ.get("SEQNORM_DEBUG"):
            raise
        print(f"seqnorm {command}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
