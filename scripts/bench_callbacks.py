"""What HiddenStateStats adds to training time, at its default frequency.

Trains the embedded-LM setup (``configs/embedded_lm.yaml`` sizes) for ``--steps`` optimizer steps with and without
the callback, alternating the two in one process for ``--rounds`` rounds so that machine load hits both alike, and
prints the ratio of median training times. Validation is off in the timed runs (the fixed validation batch costs
once per validation run, reported separately).

    python scripts/bench_callbacks.py              # 3 rounds of 500 steps (about 5 minutes on 2 idle CPU cores)
    python scripts/bench_callbacks.py --quick      # 2 rounds of 100 steps
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from seqnorm.callbacks import HiddenStateStats
from seqnorm.data import TextCorpus
from seqnorm.lightning import LanguageModel


class _TrainingClock(pl.Callback):
    """CPU time of this process from the start to the end of training (setup and teardown are not counted).

    CPU time, not wall time: on a machine shared with other jobs, wall time measures their load as much as ours.
    """

    def __init__(self) -> None:
        self.start = self.seconds = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = time.process_time()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seconds = time.process_time() - self.start


def _train(data: TextCorpus, steps: int, callback: pl.Callback | None, root: str, validate: bool = False) -> float:
    torch.manual_seed(0)
    model = LanguageModel(data.vocab_size, data.pad_index, level="char", hidden_size=128, embedding_dim=32, lr=3e-3)
    clock = _TrainingClock()
    options: dict[str, Any] = {
        "max_steps": steps,
        "limit_val_batches": 1 if validate else 0,
        "num_sanity_val_steps": 0,
        "logger": TensorBoardLogger(root, name="bench"),
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "gradient_clip_val": 1.0,
        "accelerator": "cpu",
    }
    trainer = pl.Trainer(callbacks=[clock, *([callback] if callback else [])], **options)
    trainer.fit(model, datamodule=data)
    return clock.seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500, help="optimizer steps per timed run")
    parser.add_argument("--rounds", type=int, default=3, help="pairs of runs (without, with the callback)")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 100 steps")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads; 1 (default) keeps CPU time honest on a shared machine"
    )
    args = parser.parse_args(argv)
    # Idle intra-op threads spin when the machine is busy, and spinning counts as CPU time: one thread avoids it.
    torch.set_num_threads(args.threads)
    steps, rounds = (100, 2) if args.quick else (args.steps, args.rounds)
    defaults = HiddenStateStats()
    data = TextCorpus(batch_size=32)
    data.prepare_data()
    data.setup("fit")
    without, with_callback = [], []
    with tempfile.TemporaryDirectory() as root:
        _train(data, 5, None, root)  # warm-up: first-call costs belong to neither side
        for round_index in range(rounds):
            without.append(_train(data, steps, None, root))
            with_callback.append(_train(data, steps, HiddenStateStats(), root))
            print(f"round {round_index + 1}: without {without[-1]:.1f}, with {with_callback[-1]:.1f} CPU s", flush=True)
        # one validation run with and without the fixed-batch observation (images, histograms, BN train/eval gap)
        validation = _train(data, 1, HiddenStateStats(), root, validate=True) - _train(data, 1, None, root, True)
    base, observed = statistics.median(without), statistics.median(with_callback)
    # each round's pair ran back to back under similar load: the median of the paired ratios is the steadier figure
    ratios = [b / a for a, b in zip(without, with_callback, strict=True)]
    paired = statistics.median(ratios)
    print(f"paired ratios per round: {', '.join(f'{ratio:.3f}' for ratio in ratios)}; median {paired:.3f}")
    print(f"machine: {platform.platform()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}")
    observations = len(range(0, steps, defaults.every_n_steps))
    print(f"per observed step: about {(observed - base) / observations:.3f} CPU s ({observations} observations)")
    print(
        f"HiddenStateStats(every_n_steps={defaults.every_n_steps}, media_every_n_steps={defaults.media_every_n_steps})"
        f", {steps} steps, median of {rounds} rounds: without {base:.1f} s, with {observed:.1f} s, "
        f"ratio {observed / base:.3f} (+{100 * (observed / base - 1):.1f}%)"
    )
    print(f"one validation run with the fixed-batch observation: about {validation:+.2f} CPU s")


if __name__ == "__main__":
    main()
