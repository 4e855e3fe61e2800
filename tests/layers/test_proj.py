"""proj_size, as torch.nn.LSTM's: parity with torch for norm="none", every norm on every path, shapes and errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence
from torch.testing import assert_close

import seqnorm
from seqnorm.layers.sequence import choose_path
from tests.conftest import HOISTED, NORMS
from tests.layers.test_fast_path import _assert_same, _pair, _run

TIGHT = {"rtol": 1e-12, "atol": 1e-12}


@pytest.mark.parametrize("impl", ["auto", "reference"])
@pytest.mark.parametrize(
    ("num_layers", "bidirectional", "batch_first", "bias"),
    [(1, False, False, True), (2, True, False, True), (3, False, True, False)],
)
def test_matches_torch_lstm(num_layers: int, bidirectional: bool, batch_first: bool, bias: bool, impl: str) -> None:
    reference = nn.LSTM(
        4, 6, num_layers, bias=bias, batch_first=batch_first, bidirectional=bidirectional, proj_size=3,
        dtype=torch.float64,
    )  # fmt: skip
    layer = seqnorm.LSTM.from_torch(reference, impl=impl)
    assert layer.proj_size == 3
    assert list(layer.state_dict()) == list(reference.state_dict())  # weight_hr_l0 after the biases, as torch
    assert layer.weight_hr_l0 is layer.cells[0].weight_hr
    directions = 2 if bidirectional else 1
    x = torch.randn((2, 5, 4) if batch_first else (5, 2, 4), dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(num_layers * directions, 2, 3, dtype=torch.float64)
    c0 = torch.randn(num_layers * directions, 2, 6, dtype=torch.float64)
    expected_out, expected_state = reference(x, (h0, c0))
    out, state = layer(x, (h0, c0))
    assert out.shape[-1] == 3 * directions
    assert_close((out, state), (expected_out, expected_state), **TIGHT)
    weights = torch.randn_like(out)
    expected_grads = torch.autograd.grad((expected_out * weights).sum(), [x, *reference.parameters()])
    grads = torch.autograd.grad((out * weights).sum(), [x, *layer.parameters()])
    assert_close(grads[0], expected_grads[0], **TIGHT)
    ours_by_name = dict(zip(layer.state_dict(), grads[1:], strict=True))
    for name, grad in zip(reference.state_dict(), expected_grads[1:], strict=True):
        assert_close(ours_by_name[name], grad, **TIGHT, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_packed_matches_torch_lstm(impl: str) -> None:
    reference = nn.LSTM(4, 5, 2, bidirectional=True, proj_size=2, dtype=torch.float64)
    layer = seqnorm.LSTM.from_torch(reference, impl=impl)
    x = torch.randn(6, 4, 4, dtype=torch.float64)
    lengths = torch.tensor([3, 6, 1, 5])
    packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
    expected_out, expected_state = reference(packed)
    out, state = layer(packed)
    assert_close(out.data, expected_out.data, **TIGHT)
    assert_close(state, expected_state, **TIGHT)
    _, state_from_lengths = layer(x, lengths=lengths)
    assert_close(state_from_lengths, expected_state, **TIGHT)


def test_default_init_and_state_dict_load_into_torch() -> None:
    layer = seqnorm.LSTM(3, 8, proj_size=2, num_layers=2)
    bound = 1 / 8**0.5  # torch: U(-1/sqrt(hidden_size), ...) for every parameter, W_hr and W_hh included
    for param in layer.parameters():
        assert param.abs().max() <= bound
    reference = nn.LSTM(3, 8, 2, proj_size=2)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(4, 2, 3)
    assert_close(layer(x), reference(x))


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("norm", NORMS)
def test_fast_equals_reference(norm: str, training: bool) -> None:
    reference, fast = _pair("lstm", norm, num_layers=2, bidirectional=True, proj_size=3, max_steps=4)
    lengths = torch.tensor([6, 3, 6, 4])
    x = torch.randn(6, 4, 3, dtype=torch.float64)
    for layer in (reference, fast):
        layer.train(training)
    assert choose_path(fast, lengths, 4) in (("torch_kernel",) if norm in ("none", "weight") else HOISTED)
    _assert_same(_run(reference, x, None, lengths), _run(fast, x, None, lengths))


@pytest.mark.parametrize("norm", NORMS)
def test_fast_equals_reference_with_regularizers(norm: str) -> None:
    rates = {"recurrent_dropout": 0.2, "input_dropout": 0.2, "weight_dropout": 0.3, "zoneout_h": 0.3, "zoneout_c": 0.2}
    reference, fast = _pair("lstm", norm, num_layers=2, proj_size=2, **rates)
    x = torch.randn(5, 4, 3, dtype=torch.float64)
    _assert_same(_run(reference, x, None, None, seed=3), _run(fast, x, None, None, seed=3))


@pytest.mark.parametrize("norm", ["none", "layer", "batch"])
def test_step_equals_forward(norm: str) -> None:
    layer = seqnorm.LSTM(3, 5, num_layers=2, proj_size=2, norm=norm, dtype=torch.float64).eval()
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    expected, (h_n, c_n) = layer(x)
    state = None
    for t, x_t in enumerate(x.unbind(0)):
        out, state = layer.step(x_t, state)
        assert out.shape == (2, 2)
        assert_close(out, expected[t], **TIGHT)
    assert_close((state.h, state.c), (h_n, c_n), **TIGHT)
    assert state.c.shape == (2, 2, 5)


def test_cell_shapes_and_unbatched_layer() -> None:
    cell = seqnorm.LSTMCell(3, 5, proj_size=2, norm="layer")
    assert cell.weight_hh.shape == (20, 2) and cell.weight_hr.shape == (2, 5)
    h, c = cell(torch.randn(4, 3))
    assert h.shape == (4, 2) and c.shape == (4, 5)
    h, c = cell(torch.randn(4, 3), (h, c), step=1)
    assert "proj_size=2" in repr(cell)
    layer = seqnorm.LSTM(3, 5, proj_size=2, bidirectional=True)
    output, (h_n, c_n) = layer(torch.randn(7, 3))
    assert output.shape == (7, 4) and h_n.shape == (2, 2) and c_n.shape == (2, 5)
    assert "proj_size=2" in repr(layer)


@pytest.mark.parametrize("cls", [seqnorm.LSTM, seqnorm.LSTMCell])
@pytest.mark.parametrize("value", [4, 5, -1, 2.0, True])
def test_bad_proj_size(cls: type, value: object) -> None:
    with pytest.raises(
        ValueError, match=rf"^{cls.__name__}: expected proj_size to be an int in \[0, hidden_size=4\), got {value!r}$"
    ):
        cls(3, 4, proj_size=value)


@pytest.mark.parametrize("cls", [seqnorm.GRU, seqnorm.GRUCell])
def test_gru_has_no_projection(cls: type) -> None:
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: expected proj_size=0 \(projections are for LSTMs"):
        cls(3, 4, proj_size=2)


def test_state_shapes_are_checked() -> None:
    layer = seqnorm.LSTM(3, 5, proj_size=2)
    x = torch.randn(4, 2, 3)
    with pytest.raises(ValueError, match=r"^LSTM: expected h_0 of shape \(1, 2, 2\), got \(1, 2, 5\)$"):
        layer(x, (torch.zeros(1, 2, 5), torch.zeros(1, 2, 5)))
    with pytest.raises(ValueError, match=r"^LSTM: expected c_0 of shape \(1, 2, 5\), got \(1, 2, 2\)$"):
        layer(x, (torch.zeros(1, 2, 2), torch.zeros(1, 2, 2)))
    with pytest.raises(ValueError, match=r"^LSTMCell: expected h of shape \(2, 2\), got \(2, 5\)$"):
        layer.cells[0](x[0], (torch.zeros(2, 5), torch.zeros(2, 5)))
