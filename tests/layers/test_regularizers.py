"""Zoneout, variational input dropout and DropConnect: the equations they state, train-only, seeded, on every path."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import seqnorm
from seqnorm.layers.sequence import choose_path
from tests.conftest import CELLS, HOISTED, KINDS, LAYERS, NORMS
from tests.layers.test_fast_path import _assert_same, _pair, _run

TIGHT = {"rtol": 1e-12, "atol": 1e-12}
REGULARIZERS = {"input_dropout": 0.3, "weight_dropout": 0.4, "zoneout_h": 0.3, "zoneout_c": 0.2}


def _twin(layer: nn.Module, **kwargs: Any) -> nn.Module:
    """The same layer (weights, running statistics, mode) without regularizers."""
    twin = type(layer)(layer.input_size, layer.hidden_size, norm=layer.norm, dtype=torch.float64, **kwargs)
    twin.load_state_dict(layer.state_dict())
    return twin.train(layer.training)


def _regularized(kind: str, norm: str, impl: str = "auto", **rates: float) -> nn.Module:
    return LAYERS[kind](3, 5, norm=norm, impl=impl, dtype=torch.float64, **rates).train()


def _h(state: Any) -> torch.Tensor:
    return state if isinstance(state, torch.Tensor) else state[0]


# --- each switch does what its equation says ---


@pytest.mark.parametrize("impl", ["auto", "reference"])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_zoneout_equation(kind: str, norm: str, impl: str) -> None:
    """h_t = d_h * h_{t-1} + (1 - d_h) * h~_t (and c alike), fresh Bernoulli masks at every step."""
    rates = {"zoneout_h": 0.4, "zoneout_c": 0.3} if kind == "lstm" else {"zoneout_h": 0.4}
    layer = _regularized(kind, norm, impl, **rates)
    cell = _twin(layer).cells[0]
    x = torch.randn(6, 4, 3, dtype=torch.float64)
    torch.manual_seed(3)
    output, state = layer(x)
    torch.manual_seed(3)
    expected_state: Any = cell.initial_state(4, x)
    outputs = []
    for t, x_t in enumerate(x.unbind(0)):
        new = cell(x_t, expected_state, step=t)  # the plain step (its twin draws nothing)
        if kind == "lstm":
            zone_h = torch.rand(4, 5, dtype=torch.float64) < rates["zoneout_h"]  # h first, then c
            zone_c = torch.rand(4, 5, dtype=torch.float64) < rates["zoneout_c"]
            expected_state = (
                torch.where(zone_h, expected_state[0], new[0]),
                torch.where(zone_c, expected_state[1], new[1]),
            )
        else:
            zone_h = torch.rand(4, 5, dtype=torch.float64) < rates["zoneout_h"]
            expected_state = torch.where(zone_h, expected_state, new)
        outputs.append(_h(expected_state))
    assert_close(output, torch.stack(outputs), **TIGHT)
    assert_close(_h(state)[0], _h(expected_state), **TIGHT)
    assert not torch.equal(output, _twin(layer)(x)[0])  # zoneout did act


@pytest.mark.parametrize("impl", ["auto", "reference"])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_input_dropout_equation(kind: str, norm: str, impl: str) -> None:
    """x_t <- x_t * m / (1 - p) with one Bernoulli(1 - p) mask m of shape (B, I) for every step."""
    layer = _regularized(kind, norm, impl, input_dropout=0.5)
    twin = _twin(layer)
    x = torch.randn(5, 4, 3, dtype=torch.float64)
    torch.manual_seed(5)
    output, state = layer(x)
    torch.manual_seed(5)
    mask = torch.bernoulli(torch.full((4, 3), 0.5, dtype=torch.float64)) / 0.5
    expected_output, expected_state = twin(x * mask)
    assert_close((output, state), (expected_output, expected_state), **TIGHT)
    assert not torch.equal(output, _twin(layer)(x)[0])


@pytest.mark.parametrize("impl", ["auto", "reference"])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_weight_dropout_equation(kind: str, norm: str, impl: str) -> None:
    """W_hh <- W_hh * M / (1 - p): one Bernoulli(1 - p) mask M on the weights per call, not per step."""
    layer = _regularized(kind, norm, impl, weight_dropout=0.5)
    x = torch.randn(5, 4, 3, dtype=torch.float64)
    twin = _twin(layer)  # before seeding: its initialization draws too
    torch.manual_seed(9)
    output, state = layer(x)
    torch.manual_seed(9)
    weight_hh = layer.cells[0].weight_hh  # after weight norm, if any
    dropped = weight_hh * torch.bernoulli(torch.full_like(weight_hh, 0.5)) / 0.5
    with torch.no_grad():
        if norm == "weight":
            twin.cells[0].weight_hh = dropped  # through the parametrization: g = ||w||, v = w
        else:
            twin.cells[0].weight_hh.copy_(dropped)
    assert_close((output, state), twin(x), **TIGHT)
    assert not torch.equal(output, _twin(layer)(x)[0])


def test_weight_dropout_matches_torch_lstm_with_dropped_weights() -> None:
    """norm="none" against torch.nn.LSTM whose weight_hh_l0 carries the same mask (Merity et al.'s WeightDrop)."""
    layer = _regularized("lstm", "none", weight_dropout=0.3)
    reference = nn.LSTM(3, 5, dtype=torch.float64)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(6, 2, 3, dtype=torch.float64)
    torch.manual_seed(2)
    output, _ = layer(x)
    torch.manual_seed(2)
    with torch.no_grad():
        reference.weight_hh_l0.mul_(torch.bernoulli(torch.full_like(reference.weight_hh_l0, 0.7)) / 0.7)
    assert_close(output, reference(x)[0], **TIGHT)


@pytest.mark.parametrize("kind", KINDS)
def test_cell_zoneout_is_per_step_and_train_only(kind: str) -> None:
    cell = CELLS[kind](3, 4, zoneout_h=0.5, dtype=torch.float64)
    plain = CELLS[kind](3, 4, dtype=torch.float64)
    plain.load_state_dict(cell.state_dict())
    x = torch.randn(6, 3, dtype=torch.float64)
    h = torch.randn(6, 4, dtype=torch.float64)
    state: Any = (h, torch.randn_like(h)) if kind == "lstm" else h
    torch.manual_seed(0)
    zoned = _h(cell(x, state))
    torch.manual_seed(0)
    zone = torch.rand(6, 4, dtype=torch.float64) < 0.5
    assert_close(zoned, torch.where(zone, h, _h(plain(x, state))), **TIGHT)
    assert not torch.equal(_h(cell(x, state)), zoned)  # a fresh draw per call
    cell.eval()
    assert_close(_h(cell(x, state)), _h(plain(x, state)), rtol=0, atol=0)


# --- evaluation: deterministic and exactly the un-regularized model ---


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.usefixtures("one_route")  # compared bit for bit
def test_eval_is_identity(kind: str, norm: str) -> None:
    rates = dict(REGULARIZERS, recurrent_dropout=0.3)
    if kind == "gru":
        rates.pop("zoneout_c")
    layer = LAYERS[kind](3, 5, num_layers=2, bidirectional=True, norm=norm, dropout=0.2, **rates).eval()
    plain = LAYERS[kind](3, 5, num_layers=2, bidirectional=True, norm=norm).eval()
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(5, 3, 3)
    lengths = torch.tensor([5, 2, 4])
    assert choose_path(layer, lengths, 3) == choose_path(plain, lengths, 3)
    first, second, expected = layer(x, lengths=lengths), layer(x, lengths=lengths), plain(x, lengths=lengths)
    assert_close(first, expected, rtol=0, atol=0)
    assert_close(second, expected, rtol=0, atol=0)
    # and stepping (unidirectional only)
    uni = LAYERS[kind](3, 5, norm=norm, **rates).eval()
    uni_plain = LAYERS[kind](3, 5, norm=norm).eval()
    uni_plain.load_state_dict(uni.state_dict())
    states: list[Any] = [None, None]
    for x_t in x.unbind(0):
        out, states[0] = uni.step(x_t, states[0])
        expected_out, states[1] = uni_plain.step(x_t, states[1])
        assert_close(out, expected_out, rtol=0, atol=0)


# --- the fast path runs them exactly as the reference ---


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_fast_equals_reference_with_regularizers(kind: str, norm: str) -> None:
    rates = dict(REGULARIZERS, recurrent_dropout=0.2)
    if kind == "gru":
        rates.pop("zoneout_c")
    reference, fast = _pair(kind, norm, num_layers=2, bidirectional=True, dropout=0.3, **rates)
    lengths = torch.tensor([5, 3, 5, 4])
    assert choose_path(fast, lengths, 4) in HOISTED  # random draws keep even norm="none" off torch's kernel
    x = torch.randn(5, 4, 3, dtype=torch.float64)
    _assert_same(_run(reference, x, None, lengths, seed=7), _run(fast, x, None, lengths, seed=7))


@pytest.mark.parametrize("name", list(REGULARIZERS))
def test_each_regularizer_keeps_the_fused_kernel_out_in_training_only(name: str) -> None:
    layer = seqnorm.LSTM(3, 4, **{name: 0.1})
    assert choose_path(layer, None, 2) in HOISTED
    assert choose_path(layer.eval(), None, 2) == "torch_kernel"


@pytest.mark.parametrize("kind", KINDS)
def test_step_applies_zoneout_in_training(kind: str) -> None:
    """step() in training = forward over one step (same draws); zoneout is not lost to torch's fused cell."""
    layer = LAYERS[kind](3, 4, num_layers=2, zoneout_h=0.5, dtype=torch.float64)
    x = torch.randn(1, 2, 3, dtype=torch.float64)
    h0 = torch.randn(2, 2, 4, dtype=torch.float64)
    c0 = torch.randn_like(h0)
    torch.manual_seed(4)
    expected, _ = layer(x, (h0, c0) if kind == "lstm" else h0)
    torch.manual_seed(4)
    got, _ = layer.step(x[0], seqnorm.RecurrentState(h0, c0 if kind == "lstm" else None, 0))
    assert_close(got, expected[0], **TIGHT)
    assert not torch.allclose(got, layer.eval()(x, (h0, c0) if kind == "lstm" else h0)[0][0])


def test_gradcheck_with_regularizers() -> None:
    layer = seqnorm.LSTM(2, 2, norm="layer", dtype=torch.float64, **REGULARIZERS, recurrent_dropout=0.2)
    x = torch.randn(3, 2, 2, dtype=torch.float64, requires_grad=True)

    def run(inputs: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(0)  # the same masks at every evaluation gradcheck makes
        return layer(inputs)[0]

    assert torch.autograd.gradcheck(run, (x,))


# --- bad rates ---


RATE_ARGUMENTS = [
    *((cls, name) for cls in (seqnorm.LSTM, seqnorm.GRU) for name in ("dropout", "recurrent_dropout", *REGULARIZERS)),
    (seqnorm.LSTMCell, "zoneout_h"),
    (seqnorm.LSTMCell, "zoneout_c"),
    (seqnorm.GRUCell, "zoneout_h"),
]


@pytest.mark.parametrize("value", [-0.1, 1.0, "0.5", True])
@pytest.mark.parametrize(("cls", "name"), RATE_ARGUMENTS)
def test_bad_rates_name_the_argument(cls: type, name: str, value: object) -> None:
    message = rf"^{cls.__name__}: expected {name} to be a finite number in \[0, 1\), got {value!r}$"
    with pytest.raises(ValueError, match=message):
        cls(3, 4, **{name: value})


@pytest.mark.parametrize("cls", [seqnorm.GRU, seqnorm.GRUCell])
def test_gru_has_no_cell_state_to_zone_out(cls: type) -> None:
    with pytest.raises(
        ValueError, match=rf"^{cls.__name__}: expected zoneout_c=0 \(there is no cell state\), got 0.1$"
    ):
        cls(3, 4, zoneout_c=0.1)


def test_repr_shows_rates() -> None:
    text = repr(seqnorm.LSTM(3, 4, input_dropout=0.1, weight_dropout=0.2, zoneout_h=0.3, zoneout_c=0.4))
    for part in ("input_dropout=0.1", "weight_dropout=0.2", "zoneout_h=0.3", "zoneout_c=0.4"):
        assert part in text
