"""The hand-written backward through time (seqnorm/layers/bptt.py): taken where it applies, and exact.

``tests/test_fast_path.py`` compares the fast paths (this one with the compiled kernels switched off) with the
reference loop for every cell and norm; here: that the custom Function is really what runs, where it must not run,
and ``gradcheck`` through it. The compiled kernels would take its place: they are off in this module
(``tests/test_kernels.py`` has theirs).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.autograd import gradcheck

import seqnorm
from seqnorm.layers import bptt
from tests.conftest import LAYERS, TORCH_KINDS, perturb_norm_parameters, with_spec

FUNCTION_NODE = {"lstm": "_LSTMRecurrenceBackward", "gru": "_GRURecurrenceBackward"}
# Batch renormalization with its r/d correction active from the first batch (as tests/test_fast_path.py).
RENORM_ACTIVE = {"warmup": 0, "r_max_steps": 1, "d_max_steps": 1, "r_max": 1.5, "d_max": 0.5}


@pytest.fixture(autouse=True)
def _plain_paths() -> Any:
    with seqnorm.kernels.disabled():
        yield


def _options(norm: str) -> dict[str, Any]:
    return with_spec(norm, norm_options=RENORM_ACTIVE if norm == "batch_renorm" else None)


def _graph_nodes(tensor: torch.Tensor) -> set[str]:
    """Names of every autograd node ``tensor`` depends on."""
    names, seen, todo = set(), set(), [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names


@pytest.mark.parametrize("norm", ["layer", "rms", "batch", "batch_renorm"])
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_training_runs_the_custom_function(kind: str, norm: str) -> None:
    layer = LAYERS[kind](3, 4, num_layers=2, bidirectional=True, **_options(norm))
    output, _ = layer(torch.randn(5, 3, 3), lengths=torch.tensor([5, 3, 5]))
    assert FUNCTION_NODE[kind] in _graph_nodes(output)


@pytest.mark.parametrize("norm", ["none", "weight"])
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_unnormalized_fast_path_runs_the_custom_function(kind: str, norm: str) -> None:
    """Inter-layer dropout keeps these off torch's kernel; the recurrence then runs through the Function."""
    layer = LAYERS[kind](3, 4, num_layers=2, dropout=0.5, norm=norm)
    output, _ = layer(torch.randn(5, 3, 3))
    assert FUNCTION_NODE[kind] in _graph_nodes(output)


@pytest.mark.parametrize(
    "options",
    [
        {"norm": seqnorm.norms.BatchRenormSpec(beyond_max_steps="pooled")},
        {"norm": seqnorm.norms.WeightNormSpec(mean_only_bn=True)},
        {"norm": "layer", "zoneout_h": 0.1},
        {"norm": "layer", "recurrent_dropout": 0.1},
        {"norm": "layer", "proj_size": 2},
    ],
)
def test_unsupported_configurations_keep_the_step_loop(options: dict[str, Any]) -> None:
    layer = seqnorm.LSTM(3, 4, **options)
    output, _ = layer(torch.randn(5, 3, 3))
    assert FUNCTION_NODE["lstm"] not in _graph_nodes(output)
    assert output.grad_fn is not None


@pytest.mark.parametrize("placement", [("norm_placement", "joint"), ("state_norm", "carried")])
def test_other_norm_placements_keep_the_step_loop(placement: tuple[str, str]) -> None:
    cell = seqnorm.LSTMCell(3, 4, norm="layer")
    x = torch.randn(5, 2, 3)
    state = cell.initial_state(2, x)
    assert bptt.supports(cell, x, state, None)
    setattr(cell, *placement)
    assert not bptt.supports(cell, x, state, None)


def test_no_gradient_needed_keeps_the_step_loop() -> None:
    cell = seqnorm.GRUCell(3, 4, norm="batch")
    x = torch.randn(5, 2, 3)
    with torch.no_grad():
        assert not bptt.supports(cell, x, cell.initial_state(2, x), None)
    cell.requires_grad_(False)
    assert not bptt.supports(cell, x, cell.initial_state(2, x), None)
    assert bptt.supports(cell, x.requires_grad_(), cell.initial_state(2, x), None)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("norm", ["layer", "rms", "batch", "batch_renorm"])
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_gradcheck_through_the_custom_function(kind: str, norm: str, training: bool) -> None:
    """Float64 gradcheck w.r.t. the input, the initial state and every parameter, with a padded row."""
    options = _options(norm)
    layer = LAYERS[kind](2, 3, max_steps=3, dtype=torch.float64, **options).train(training)
    perturb_norm_parameters(layer)
    if norm == "batch_renorm":
        # Running moments far from every batch's: r and d sit at their bounds (1/r_max, -d_max), constants near the
        # point, so the finite differences see the same function the detached r/d differentiate.
        with torch.no_grad():
            for name, buffer in layer.named_buffers():
                if name.endswith("running_var"):
                    buffer.fill_(100.0)
                elif name.endswith("running_mean"):
                    buffer.fill_(10.0)
    # Every call starts from the same buffers (training updates them; renorm's r and d read them).
    buffers = {name: buffer.clone() for name, buffer in layer.named_buffers()}
    names = [name for name, _ in layer.named_parameters()]
    params = [param.detach().clone().requires_grad_() for param in layer.parameters()]
    lengths = torch.tensor([4, 2, 4])  # steps 2 and 3 have 2 real rows: batch statistics over them only
    x = torch.randn(4, 3, 2, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(1, 3, 3, dtype=torch.float64, requires_grad=True)
    hx: Any = (h0, torch.randn_like(h0).requires_grad_()) if kind == "lstm" else h0
    leaves = (x, *(hx if kind == "lstm" else (hx,)))

    def run(x: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        state = tuple(rest[:2]) if kind == "lstm" else rest[0]
        parameters = dict(zip(names, rest[len(leaves) - 1 :], strict=True))
        parameters.update((name, buffer.clone()) for name, buffer in buffers.items())
        output, final = torch.func.functional_call(layer, parameters, (x, state), {"lengths": lengths})
        return output, *(final if kind == "lstm" else (final,))

    output, *_ = run(*leaves, *params)
    assert FUNCTION_NODE[kind] in _graph_nodes(output)
    assert gradcheck(run, (*leaves, *params), eps=1e-6, atol=1e-6)
