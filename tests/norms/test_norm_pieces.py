"""A norm written outside the library (``ScaleNorm`` of examples/custom_norm.py) that implements
:class:`~seqnorm.norms.protocol.StepPieces` and declares the plain-PyTorch fast forms, swapped into the cells here (no
registry): the plan runs it on the loop over hoisted input terms and the lean generation step, and both equal the
reference loop (float64, 1e-9). Nothing in ``seqnorm.layers`` knows this norm."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from examples.custom_norm import ScaleNorm
from seqnorm.norms.protocol import StepPieces
from tests.conftest import LAYERS, TORCH_KINDS

TOLERANCE = {"rtol": 1e-9, "atol": 1e-9}


def _layer(kind: str, **kwargs: Any) -> nn.Module:
    """A layer whose every norm is the toy (built with RMSNorm's slots, then swapped: no registry involved)."""
    torch.manual_seed(0)
    layer = LAYERS[kind](3, 4, norm="rms", dtype=torch.float64, **kwargs)
    for cell in layer.cells:
        for role in ("norm_ih", "norm_hh", "norm_c"):
            if getattr(cell, role, None) is not None:
                setattr(cell, role, ScaleNorm(getattr(cell, role).num_features, dtype=torch.float64))
    return layer


def _pair(kind: str) -> tuple[nn.Module, nn.Module]:
    fast = _layer(kind)
    reference = _layer(kind, impl="reference")
    reference.load_state_dict(fast.state_dict())
    return reference, fast


def test_the_toy_implements_the_protocol() -> None:
    assert isinstance(ScaleNorm(3), StepPieces)


@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_the_loop_equals_the_reference(kind: str) -> None:
    reference, fast = _pair(kind)
    x, lengths = torch.randn(5, 3, 3, dtype=torch.float64), torch.tensor([5, 2, 4])
    assert fast.plan(x.requires_grad_(), lengths=lengths).path == "loop"
    results = []
    for layer in (reference, fast):
        inputs = x.detach().clone().requires_grad_()
        output, state = layer(inputs, lengths=lengths)
        flat = [output, *(state if isinstance(state, tuple) else (state,))]
        loss = sum((t * torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view_as(t)).sum() for t in flat)
        results.append([output, *flat[1:], *torch.autograd.grad(loss, [inputs, *layer.parameters()])])
    assert_close(results[1], results[0], **TOLERANCE)


@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_generation_step_equals_the_reference_step(kind: str) -> None:
    reference, fast = _pair(kind)
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    with torch.no_grad():
        assert fast.plan(x[0]).path == "lean_step"
        states: list[Any] = [None, None]
        for x_t in x.unbind(0):
            out_ref, states[0] = reference.step(x_t, states[0])
            out_fast, states[1] = fast.step(x_t, states[1])
            assert_close(out_fast, out_ref, **TOLERANCE)
    assert_close(tuple(states[1]), tuple(states[0]), **TOLERANCE)
