"""Shared fixtures and helpers for the seqnorm test suite."""

from __future__ import annotations

import pytest
import torch

import seqnorm

NORMS = list(seqnorm.NORMS)
BATCH_NORMS = [name for name, scheme in seqnorm.NORMS.items() if scheme.batch_statistics]
ROW_NORMS = [name for name in NORMS if name not in BATCH_NORMS]
CELLS = {"lstm": seqnorm.LSTMCell, "gru": seqnorm.GRUCell}

# The suite's models are tiny: a second intra-op thread only adds synchronization, and on a busy 2-core machine a
# descheduled OpenMP worker stalls every small op for milliseconds. One thread keeps `make test` fast and steady.
torch.set_num_threads(1)
LAYERS = {"lstm": seqnorm.LSTM, "gru": seqnorm.GRU}


def running_fallback(norm: str) -> dict[str, str]:
    """``small_batch="running"`` where ``norm`` has batch statistics; other norms refuse an option they lack."""
    return {"small_batch": "running"} if seqnorm.NORMS[norm].batch_statistics else {}


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def perturb_norm_parameters(module: torch.nn.Module) -> None:
    """Move every norm gain/shift and running statistic away from its initial value, so tests can see them."""
    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            if "norm_" in name and tensor.is_floating_point():
                tensor.add_(torch.rand_like(tensor) * 0.5)
