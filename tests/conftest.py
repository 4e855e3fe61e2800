"""Shared fixtures and helpers for the seqnorm test suite."""

from __future__ import annotations

import pytest
import torch

import seqnorm
from seqnorm.layers.plan import declared

NORMS = list(seqnorm.NORMS)
BATCH_NORMS = [name for name, scheme in seqnorm.NORMS.items() if scheme.batch_statistics]
ROW_NORMS = [name for name in NORMS if name not in BATCH_NORMS]
# Cells and layers come from the registries: a new entry gets the contract, path and parity tests unedited.
CELLS = seqnorm.CELLS
LAYERS = seqnorm.LAYERS
KINDS = list(CELLS)
# The cells that declare torch's step: parity with torch.nn, torch's kernel, the hand-written BPTT, the lean step.
TORCH_KINDS = [kind for kind, cell in CELLS.items() if declared(cell, "torch_kernel", None)]

# The suite's models are tiny: a second intra-op thread only adds synchronization, and on a busy 2-core machine a
# descheduled OpenMP worker stalls every small op for milliseconds. One thread keeps `make test` fast and steady.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def perturb_norm_parameters(module: torch.nn.Module) -> None:
    """Move every norm gain/shift and running statistic away from its initial value, so tests can see them."""
    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            if "norm_" in name and tensor.is_floating_point():
                tensor.add_(torch.rand_like(tensor) * 0.5)
