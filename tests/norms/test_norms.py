"""Each norm does what it claims (invariances), and the initialization schemes are what they say."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.testing import assert_close

import seqnorm
from seqnorm.init import INITS, resolve_init
from tests.conftest import CELLS, KINDS, perturb_norm_parameters


def _h(output: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


# Batch norms are invariant in training only: in evaluation the running moments are fixed numbers.
@pytest.mark.parametrize(
    ("norm", "training"),
    [("layer", True), ("layer", False), ("rms", True), ("rms", False), ("batch", True), ("batch_renorm", True)],
)
@pytest.mark.parametrize("kind", KINDS)
def test_output_invariant_to_rescaling_input_and_recurrent_terms(kind: str, norm: str, training: bool) -> None:
    cell = CELLS[kind](4, 5, norm=seqnorm.NORMS[norm].spec(eps=1e-12), dtype=torch.float64)
    perturb_norm_parameters(cell)
    x = torch.randn(6, 4, dtype=torch.float64)
    h = torch.randn(6, 5, dtype=torch.float64)
    state = (h, torch.randn(6, 5, dtype=torch.float64)) if kind == "lstm" else h
    cell.train(training)
    before = cell(x, state, step=3)
    with torch.no_grad():
        cell.weight_ih.mul_(7.5)
        cell.weight_hh.mul_(0.2)
    after = cell(x, state, step=3)
    assert_close(after, before, rtol=1e-8, atol=1e-8)


def test_norm_none_is_not_invariant() -> None:
    cell = seqnorm.LSTMCell(4, 5, dtype=torch.float64)
    x = torch.randn(6, 4, dtype=torch.float64)
    before = cell(x)
    with torch.no_grad():
        cell.weight_ih.mul_(7.5)
    assert not torch.allclose(cell(x)[0], before[0])


@pytest.mark.parametrize("kind", KINDS)
def test_weight_norm_invariant_to_rescaling_direction(kind: str) -> None:
    cell = CELLS[kind](4, 5, norm="weight", dtype=torch.float64)
    params = dict(cell.named_parameters())
    assert {"parametrizations.weight_ih.original0", "parametrizations.weight_ih.original1"} <= set(params)
    g = params["parametrizations.weight_ih.original0"]
    v = params["parametrizations.weight_ih.original1"]
    assert g.shape == (cell.num_gates * 5, 1) and v.shape == (cell.num_gates * 5, 4)
    x = torch.randn(3, 4, dtype=torch.float64)
    before = _h(cell(x))
    with torch.no_grad():
        v.mul_(torch.rand(v.shape[0], 1, dtype=torch.float64) * 10 + 0.1)  # any positive per-row rescaling
        params["parametrizations.weight_hh.original1"].mul_(3.0)
    assert_close(_h(cell(x)), before, rtol=1e-10, atol=1e-10)
    with torch.no_grad():
        g.mul_(2.0)  # but the gain matters
    assert not torch.allclose(_h(cell(x)), before)


def test_weight_norm_starts_equal_to_its_initialization() -> None:
    torch.manual_seed(3)
    plain = seqnorm.LSTMCell(4, 5, init="orthogonal", forget_bias=1.0)
    torch.manual_seed(3)
    weighted = seqnorm.LSTMCell(4, 5, norm="weight", init="orthogonal")
    assert_close(weighted.weight_ih, plain.weight_ih)
    assert_close(weighted.weight_hh, plain.weight_hh)
    x = torch.randn(2, 4)
    assert_close(weighted(x), plain(x))


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_row_norms_normalize_each_row(norm: str) -> None:
    cell = seqnorm.LSTMCell(6, 8, norm=norm)
    terms = torch.randn(3, 32) * 5 + 2
    y = cell.norm_ih(terms)
    if norm == "layer":
        assert_close(y.mean(1), torch.zeros(3), atol=1e-5, rtol=0)
        assert_close(y.var(1, unbiased=False), torch.ones(3), atol=1e-3, rtol=0)
    else:
        assert_close(y.square().mean(1), torch.ones(3), atol=1e-3, rtol=0)
    assert cell.norm_ih.bias is None and cell.norm_c.bias is not None


@pytest.mark.parametrize("kind", KINDS)
def test_init_schemes(kind: str) -> None:
    hidden = 6
    gates = 4 if kind == "lstm" else 3
    cells = {name: CELLS[kind](5, hidden, init=name) for name in INITS}
    bound = 1 / hidden**0.5
    assert cells["default"].weight_hh.abs().max() <= bound
    for block in cells["orthogonal"].weight_hh.chunk(gates):
        assert_close(block @ block.T, torch.eye(hidden), atol=1e-5, rtol=0)
    for block in cells["identity"].weight_hh.chunk(gates):
        assert torch.equal(block, torch.eye(hidden))
    xavier_bound = (6 / (5 + hidden)) ** 0.5
    assert cells["xavier"].weight_ih.abs().max() <= xavier_bound
    assert cells["kaiming"].weight_hh.std() > cells["xavier"].weight_hh.std()
    for name in ("xavier", "kaiming", "orthogonal", "identity"):
        assert torch.equal(cells[name].bias_ih, torch.zeros(gates * hidden)), name
    assert resolve_init("glorot", "X") == "xavier" and resolve_init("he", "X") == "kaiming"


def test_forget_bias() -> None:
    assert torch.equal(seqnorm.LSTMCell(3, 4, norm="layer").bias_ih[4:8], torch.ones(4))
    assert torch.equal(seqnorm.LSTMCell(3, 4, init="xavier", forget_bias=2.0).bias_ih[4:8], torch.full((4,), 2.0))
    torch.manual_seed(5)
    untouched = seqnorm.LSTMCell(3, 4)  # norm="none": torch's initialization, forget gate included
    torch.manual_seed(5)
    reference = torch.nn.LSTMCell(3, 4)
    assert torch.equal(untouched.bias_ih, reference.bias_ih)
    with pytest.warns(UserWarning, match="forget_bias"):
        seqnorm.GRUCell(3, 4, forget_bias=1.0)
    with pytest.warns(UserWarning, match="forget_bias=2.0 has no effect"):
        seqnorm.LSTMCell(3, 4, norm="layer", bias=False, forget_bias=2.0)


@pytest.mark.parametrize("norm", ["layer", "rms", "batch"])
def test_no_bias_gets_no_warning_about_a_forget_bias_not_passed(norm: str) -> None:
    """A normalized LSTM's default forget bias of 1 was set, then warned of, where there is no bias to hold it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer = seqnorm.LSTM(3, 4, norm=norm, bias=False)
    assert layer.cells[0].forget_bias is None and layer.cells[0].bias_ih is None


def test_reset_parameters_restores_running_statistics() -> None:
    cell = seqnorm.LSTMCell(3, 4, norm="batch")
    cell(torch.randn(5, 3) + 4, step=0)
    assert cell.norm_ih.running_mean.abs().sum() > 0
    cell.reset_parameters()
    assert torch.equal(cell.norm_ih.running_mean, torch.zeros_like(cell.norm_ih.running_mean))
