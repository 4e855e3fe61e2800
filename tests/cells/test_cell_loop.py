"""A cell called step by step in the user's own loop (README: "A normalized cell in your own loop"; issue 31).

The cell's step calls each norm's declared step form (``forward_step``), which for per-timestep batch norms in training
is the compiled kernels' norm as one autograd node where they are loaded (else torch's fused kernel, or the norm's own
pieces as one node). Hooking an observer makes the step call every norm as a module (its ``forward``): the reference
the fast forms are compared with.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

import seqnorm
from tests.conftest import BATCH_NORMS, CELLS, KINDS, NORMS, perturb_norm_parameters, with_spec

# The lengths of a batch of 4: every row real at step 0, then 3, 2 and at the last step 1 (the "tail" fallback to
# the running statistics); with max_steps=4 the steps 4-6 share the last row of statistics.
LENGTHS = torch.tensor([7, 6, 3, 1])


def user_loop(cell: nn.Module, x: Tensor) -> Any:
    """The README's loop: ``cell(x[t], state, step=t, mask=t < lengths)``."""
    state = None
    for t in range(x.shape[0]):
        state = cell(x[t], state, step=t, mask=t < LENGTHS)
    return state


def train_twice(cell: nn.Module, inputs: list[Tensor]) -> list[Tensor]:
    """Two batches through the loop, then one backward of a weighted sum of the final states; returns the states."""
    states = []
    for x in inputs:
        state = user_loop(cell, x)
        states += list(state) if isinstance(state, tuple) else [state]
    generator = torch.Generator().manual_seed(1)
    sum(torch.randn(s.shape, generator=generator, dtype=s.dtype) * s for s in states).sum().backward()
    return states


def assert_same_training(kind: str, norm: str, **options: Any) -> None:
    cell = CELLS[kind](3, 5, max_steps=4, dtype=torch.float64, **with_spec(norm, **options))
    perturb_norm_parameters(cell)
    reference = copy.deepcopy(cell)
    reference.observer.register_forward_hook(lambda module, args, output: None)
    inputs = [torch.randn(7, 4, 3, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    reference_inputs = [x.detach().clone().requires_grad_() for x in inputs]

    states = train_twice(cell, inputs)
    expected_states = train_twice(reference, reference_inputs)

    for state, expected in zip(states, expected_states, strict=True):
        assert_close(state, expected, rtol=1e-9, atol=1e-9)
    for x, expected in zip(inputs, reference_inputs, strict=True):
        assert_close(x.grad, expected.grad, rtol=1e-9, atol=1e-9)
    expected_parameters = dict(reference.named_parameters())
    for name, parameter in cell.named_parameters():
        assert_close(parameter.grad, expected_parameters[name].grad, rtol=1e-9, atol=1e-9, msg=name)
    expected_buffers = dict(reference.named_buffers())
    for name, buffer in cell.named_buffers():
        assert_close(buffer, expected_buffers[name], rtol=1e-9, atol=1e-9, msg=name)
    for module, expected_module in zip(cell.modules(), reference.modules(), strict=True):
        assert getattr(module, "fallback_steps", None) == getattr(expected_module, "fallback_steps", None)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_user_loop_trains_as_the_reference(kind: str, norm: str) -> None:
    """Outputs, gradients (input and parameters), running statistics and fallback counts of two masked training
    batches equal those of the reference step, for every cell and norm."""
    assert_same_training(kind, norm)


@pytest.mark.parametrize(
    ("norm", "options"),
    [
        ("batch", {"momentum": None}),  # cumulative averages: the masked moments, not the fused kernel
        ("batch", {"small_batch": "running"}),
        # the r/d correction in force from the first batch, with limits that bind
        ("batch_renorm", {"norm_options": {"warmup": 0, "r_max": 1.2, "d_max": 0.1, "r_max_steps": 1}}),
    ],
)
@pytest.mark.parametrize("kind", KINDS)
def test_user_loop_trains_as_the_reference_with_options(kind: str, norm: str, options: dict[str, Any]) -> None:
    assert_same_training(kind, norm, **options)


@pytest.mark.parametrize("norm", BATCH_NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_user_loop_without_the_kernels_trains_as_the_reference(kind: str, norm: str) -> None:
    """The same where the compiled kernels are not loaded: per-timestep BN's steps are then torch's fused kernel and
    the norms' own pieces (the tests above run the kernels' norm step wherever the kernels are built)."""
    with seqnorm.kernels.disabled():
        assert_same_training(kind, norm)


def graph_size(output: Tensor) -> int:
    """The number of autograd nodes ``output`` depends on."""
    seen: set[Any] = set()
    pending = [output.grad_fn]
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        pending.extend(next_node for next_node, _ in node.next_functions)
    return len(seen)


@pytest.mark.parametrize("norm", BATCH_NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_norm_step_records_what_a_layer_norm_step_records(kind: str, norm: str) -> None:
    """Each per-timestep batch norm of an unmasked training step is one autograd node, as a LayerNorm is, and of a
    masked step at most three (plain BN: the real rows gathered, torch's batch norm, scattered back; batch renorm:
    one node of its pieces). (It was a dozen nodes a norm on a masked step, which made a BN cell in a user's loop
    ~4x slower than an LN cell, issue 31.)"""
    x = torch.randn(4, 3)
    sizes, norms = {}, 0
    for name in (norm, "layer"):
        cell = CELLS[kind](3, 5, norm=name)
        slots = (cell.norm_ih, cell.norm_hh, cell.norm_gates, getattr(cell, "norm_c", None))
        norms = max(norms, sum(module is not None for module in slots))
        state = None
        for t, mask in enumerate([torch.tensor([True, True, True, True]), torch.tensor([True, True, True, False])]):
            state = cell(x, state, step=t, mask=mask)
            h = state[0] if isinstance(state, tuple) else state
            sizes[name, t] = graph_size(h)
    assert norms >= 2
    assert sizes[norm, 0] == sizes["layer", 0]  # an unmasked step
    assert sizes[norm, 1] <= sizes["layer", 1] + 2 * norms  # a masked one
