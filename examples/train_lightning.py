"""Training from Python with Lightning: a LayerNorm-LSTM character language model on a text file, in seconds.

The ``seqnorm`` command line does the same from YAML (``seqnorm fit --config seqnorm:char_lm --data.path my.txt``);
from Python, the sizes that come from the data (vocabulary size, padding id, character level) are read from the
DataModule and given to the model, which is what the command line links for you.

Run: ``python examples/train_lightning.py`` (writes a small corpus and nothing else into a temporary directory).
"""

from __future__ import annotations

import math
import random
import tempfile
from pathlib import Path

import lightning.pytorch as pl

from seqnorm.data import TextCorpus
from seqnorm.lightning import LanguageModel

WORDS = ["the", "cat", "dog", "sat", "ran", "on", "under", "a", "mat", "log", "big", "small", "red", "blue"]


def write_corpus(path: Path, lines: int = 400) -> Path:
    rng = random.Random(0)
    text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))) for _ in range(lines))
    path.write_text(text + "\n", encoding="utf-8")
    return path


def main() -> None:
    pl.seed_everything(0, verbose=False)
    with tempfile.TemporaryDirectory() as folder:
        corpus = write_corpus(Path(folder) / "story.txt")
        data = TextCorpus(path=str(corpus), level="char", unit="line", batch_size=16)
        model = LanguageModel(
            data.vocab_size,
            pad_index=data.pad_index,
            level=data.level,
            cell="lstm",
            norm="layer",
            hidden_size=64,
            embedding_dim=16,
            lr=1e-2,
        )
        trainer = pl.Trainer(
            max_epochs=3,
            limit_val_batches=4,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=folder,
        )
        trainer.fit(model, data)
        after = trainer.validate(model, data, verbose=False)[0]
    # Guessing uniformly among the vocabulary's characters costs ln(V) nats per character: where training starts.
    uniform = math.log(data.vocab_size)
    print(f"val/loss {after['val/loss']:.3f} nats after {trainer.global_step} updates (uniform: {uniform:.3f})")
    print(f"val/bpc {after['val/bpc']:.3f}")


if __name__ == "__main__":
    main()
