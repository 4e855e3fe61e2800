"""Every cell and layer with every norm pickles (``pickle``, ``torch.save(model)``, ``copy.deepcopy``) and comes back
the same module: same parameters and buffers, same outputs, and it still trains and loads state dicts."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import seqnorm
from seqnorm.lightning import LanguageModel
from tests.conftest import CELLS, KINDS, LAYERS, NORMS, perturb_norm_parameters

# Every test compares calls bit for bit: with one fixed matmul route, not during the route trial of a shape's first
# calls, whose candidates round differently (which test runs first at a shape depends on the order, and on xdist's).
pytestmark = pytest.mark.usefixtures("one_route")


def _torch_save(module: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


ROUND_TRIPS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "pickle": lambda module: pickle.loads(pickle.dumps(module)),
    "torch.save": _torch_save,
    "deepcopy": copy.deepcopy,
}


def _trained(module: nn.Module, run: Callable[[], object]) -> nn.Module:
    # A few training calls move the running statistics; the perturbation moves every gain and shift.
    for _ in range(3):
        run()
    perturb_norm_parameters(module)
    return module


def _assert_same_module(original: nn.Module, restored: nn.Module) -> None:
    assert type(restored).__name__ == type(original).__name__
    assert restored is not original
    state, restored_state = original.state_dict(), restored.state_dict()
    assert list(restored_state) == list(state)
    for name, tensor in state.items():
        assert torch.equal(restored_state[name], tensor), name
        assert restored_state[name].data_ptr() != tensor.data_ptr(), f"{name} is shared with the original"
    assert [name for name, _ in restored.named_parameters()] == [name for name, _ in original.named_parameters()]


@pytest.mark.parametrize("trip", list(ROUND_TRIPS))
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_cell_round_trip_gives_identical_outputs(kind: str, norm: str, trip: str) -> None:
    cell = CELLS[kind](4, 5, norm=norm, max_steps=3)
    cell = _trained(cell, lambda: cell(torch.randn(6, 4), step=1))
    restored = ROUND_TRIPS[trip](cell)
    _assert_same_module(cell, restored)
    x = torch.randn(6, 4)
    for training in (True, False):
        cell.train(training)
        restored.train(training)
        for step in range(4):
            assert_close(restored(x, step=step), cell(x, step=step), rtol=0, atol=0)
    # The copy trains on its own parameters: every one gets a gradient, and the original's get none.
    restored.train()
    output = restored(x, step=0)
    sum(t.sum() for t in (output if isinstance(output, tuple) else (output,))).backward()
    assert all(param.grad is not None for param in restored.parameters())
    assert all(param.grad is None for param in cell.parameters())


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", list(LAYERS))
def test_layer_round_trip_gives_identical_outputs_and_loads_state_dicts(kind: str, norm: str) -> None:
    layer = LAYERS[kind](3, 4, num_layers=2, bidirectional=True, norm=norm, max_steps=5)
    lengths = torch.tensor([5, 3, 2])
    layer = _trained(layer, lambda: layer(torch.randn(5, 3, 3), lengths=lengths))
    restored = ROUND_TRIPS["torch.save"](layer)
    _assert_same_module(layer, restored)
    x = torch.randn(5, 3, 3)
    for training in (True, False):
        layer.train(training)
        restored.train(training)
        assert_close(restored(x, lengths=lengths), layer(x, lengths=lengths), rtol=0, atol=0)
    # A restored layer still takes a state dict (weight norm's loading hook came back with it).
    fresh = LAYERS[kind](3, 4, num_layers=2, bidirectional=True, norm=norm, max_steps=5)
    restored.load_state_dict(fresh.state_dict())
    restored.eval()
    fresh.eval()
    assert_close(restored(x, lengths=lengths), fresh(x, lengths=lengths), rtol=0, atol=0)


def test_layer_with_a_norm_spec_pickles_with_its_options() -> None:
    spec = seqnorm.norms.BatchRenormSpec(r_max=2.0, max_steps=7)
    layer = seqnorm.LSTM(3, 4, norm=spec)
    restored = pickle.loads(pickle.dumps(layer))
    assert restored.norm_spec == spec
    assert restored.cells[0].scheme is seqnorm.NORMS["batch_renorm"]  # the registry's entry, not a copy
    x = torch.randn(4, 2, 3)
    assert_close(restored(x), layer(x), rtol=0, atol=0)


@pytest.mark.parametrize("norm", NORMS)
def test_lightning_module_pickles_as_ddp_spawn_needs(norm: str) -> None:
    # ddp_spawn pickles the LightningModule into each process.
    model = LanguageModel(vocab_size=7, norm=norm, hidden_size=6, embedding_dim=4).eval()
    restored = pickle.loads(pickle.dumps(model))
    tokens = torch.randint(0, 7, (2, 5))
    assert_close(restored.model(tokens), model.model(tokens), rtol=0, atol=0)
