"""A new norm is one module (with its spec) plus one registry entry: the proof.

Everything the library needs of :class:`ScaleNorm` is in ``examples/custom_norm.py`` (shipped for users to copy): the
module, implementing :class:`~seqnorm.norms.protocol.StepPieces` and declaring its fast forms, its spec (a
:class:`~seqnorm.norms.NormSpec` subclass with a ``name``) and one ``NORMS`` entry. ``seqnorm.LSTM``/``GRU`` then take
``norm="scale"``, the plan runs the loop over hoisted input terms in training and the lean step for generation, both
equal the reference loop (float64, 1e-9, variable lengths), and the layer trains.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

import seqnorm
from examples.custom_norm import NAME, ScaleNorm, register
from seqnorm.norms import NORMS
from seqnorm.norms.protocol import StepPieces

TOLERANCE = {"rtol": 1e-9, "atol": 1e-9}


@pytest.fixture
def toy_scale() -> Iterator[None]:
    register()  # the one registry entry
    yield
    del NORMS[NAME]


def _pair(layer_class: type, **kwargs: Any) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    fast = layer_class(3, 5, num_layers=2, norm=NAME, dtype=torch.float64, **kwargs)
    reference = layer_class(3, 5, num_layers=2, norm=NAME, impl="reference", dtype=torch.float64, **kwargs)
    reference.load_state_dict(fast.state_dict())
    return fast, reference


@pytest.mark.usefixtures("toy_scale")
def test_the_toy_is_a_step_pieces_norm_built_from_the_registry() -> None:
    layer = seqnorm.LSTM(3, 5, norm=seqnorm.NORMS[NAME].spec(eps=1e-3))
    norms = [module for module in layer.modules() if isinstance(module, ScaleNorm)]
    assert len(norms) == 3  # input, recurrent and cell-state norms of the one cell
    assert all(isinstance(norm, StepPieces) and norm.eps == 1e-3 for norm in norms)


@pytest.mark.usefixtures("toy_scale")
@pytest.mark.parametrize("layer_class", [seqnorm.LSTM, seqnorm.GRU])
def test_a_registered_norm_runs_the_loop_and_equals_the_reference(layer_class: type) -> None:
    fast, reference = _pair(layer_class)
    x, lengths = torch.randn(6, 4, 3, dtype=torch.float64), torch.tensor([6, 3, 5, 6])
    assert fast.plan(x, lengths=lengths).path == "loop"  # no "kernel" form: the compiled kernels know no toy
    assert reference.plan(x, lengths=lengths).path == "reference"
    results = []
    for layer in (fast, reference):
        x_in = x.clone().requires_grad_()
        output, state = layer(x_in, lengths=lengths)
        h_n = state if isinstance(state, Tensor) else state[0]
        (output.square().sum() + h_n.sum()).backward()
        results.append((output, h_n, x_in.grad, [p.grad for p in layer.parameters()]))
    (out_f, h_f, dx_f, grads_f), (out_r, h_r, dx_r, grads_r) = results
    assert_close(out_f, out_r, **TOLERANCE)
    assert_close(h_f, h_r, **TOLERANCE)
    assert_close(dx_f, dx_r, **TOLERANCE)
    for grad_f, grad_r in zip(grads_f, grads_r, strict=True):
        assert_close(grad_f, grad_r, **TOLERANCE)


@pytest.mark.usefixtures("toy_scale")
@pytest.mark.parametrize("layer_class", [seqnorm.LSTM, seqnorm.GRU])
def test_a_registered_norm_runs_the_lean_step_and_equals_the_reference(layer_class: type) -> None:
    fast, reference = _pair(layer_class)
    fast.eval(), reference.eval()
    x = torch.randn(5, 4, 3, dtype=torch.float64)
    with torch.no_grad():
        assert fast.plan(x[0]).path == "lean_step"
        assert reference.plan(x[0]).path == "reference"
        state_f = state_r = None
        for x_t in x:
            out_f, state_f = fast.step(x_t, state_f)
            out_r, state_r = reference.step(x_t, state_r)
            assert_close(out_f, out_r, **TOLERANCE)
        assert_close(fast(x)[0], reference(x)[0], **TOLERANCE)


@pytest.mark.usefixtures("toy_scale")
@pytest.mark.parametrize("layer_class", [seqnorm.LSTM, seqnorm.GRU])
def test_a_registered_norm_trains(layer_class: type) -> None:
    layer, _ = _pair(layer_class)
    head = nn.Linear(5, 1, dtype=torch.float64)
    optimizer = torch.optim.Adam([*layer.parameters(), *head.parameters()], lr=3e-2)
    x, lengths = torch.randn(6, 4, 3, dtype=torch.float64), torch.tensor([6, 3, 5, 6])
    target = torch.randn(4, 1, dtype=torch.float64)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        output, _ = layer(x, lengths=lengths)
        loss = nn.functional.mse_loss(head(output[lengths - 1, torch.arange(4)]), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.usefixtures("toy_scale")
def test_the_lightning_modules_take_any_registered_name() -> None:
    from seqnorm.lightning import LanguageModel

    model = LanguageModel(vocab_size=11, norm=NAME, hidden_size=8, embedding_dim=4)
    assert any(isinstance(module, ScaleNorm) for module in model.modules())
    with pytest.raises(ValueError, match=r"expected norm to be one of .*'scale'"):
        LanguageModel(vocab_size=11, norm="scales")
