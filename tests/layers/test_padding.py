"""Variable lengths: a padded batch gives each sequence exactly what it gives alone; padding never leaks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import seqnorm
from seqnorm.layers import reverse_padded
from seqnorm.norms import TimestepBatchNorm
from tests.conftest import BATCH_NORMS, KINDS, LAYERS, NORMS, ROW_NORMS, perturb_norm_parameters


def _alone_vs_padded(kind: str, norm: str, lengths: list[int], training: bool, bidirectional: bool) -> None:
    layer = LAYERS[kind](3, 4, num_layers=2, bidirectional=bidirectional, norm=norm, dtype=torch.float64)
    perturb_norm_parameters(layer)  # running statistics and gains that are not the identity
    layer.train(training)
    steps = max(lengths) + 1  # one step of pure padding at the end too
    x = torch.randn(steps, len(lengths), 3, dtype=torch.float64)
    output, state = layer(x, lengths=torch.tensor(lengths))
    h_n = state[0] if kind == "lstm" else state
    for b, length in enumerate(lengths):
        alone_output, alone_state = layer(x[:length, b : b + 1])
        alone_h = alone_state[0] if kind == "lstm" else alone_state
        assert_close(output[:length, b : b + 1], alone_output, rtol=1e-10, atol=1e-10)
        assert torch.equal(output[length:, b], torch.zeros_like(output[length:, b]))
        assert_close(h_n[:, b : b + 1], alone_h, rtol=1e-10, atol=1e-10)
        if kind == "lstm":
            assert_close(state[1][:, b : b + 1], alone_state[1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("norm", ROW_NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_padded_equals_alone_row_norms(kind: str, norm: str, training: bool, bidirectional: bool) -> None:
    _alone_vs_padded(kind, norm, [5, 2, 1, 4], training, bidirectional)


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("norm", BATCH_NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_padded_equals_alone_batch_norms_in_eval(kind: str, norm: str, bidirectional: bool) -> None:
    _alone_vs_padded(kind, norm, [5, 2, 1, 4], False, bidirectional)


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    kind=st.sampled_from(KINDS),
    norm=st.sampled_from(["none", "layer", "rms", "weight"]),
    bidirectional=st.booleans(),
)
def test_padded_equals_alone_property(lengths: list[int], kind: str, norm: str, bidirectional: bool) -> None:
    _alone_vs_padded(kind, norm, lengths, True, bidirectional)


@given(lengths=st.lists(st.integers(1, 7), min_size=1, max_size=5))
def test_reverse_padded_reverses_only_the_real_part(lengths: list[int]) -> None:
    x = torch.arange(7 * len(lengths)).view(7, len(lengths))
    reversed_x = reverse_padded(x.unsqueeze(-1), torch.tensor(lengths)).squeeze(-1)
    for b, length in enumerate(lengths):
        assert reversed_x[:length, b].tolist() == x[:length, b].flip(0).tolist()
        assert reversed_x[length:, b].tolist() == x[length:, b].tolist()
    assert torch.equal(reverse_padded(reversed_x.unsqueeze(-1), torch.tensor(lengths)).squeeze(-1), x)


@pytest.mark.parametrize("norm", BATCH_NORMS)
def test_masked_rows_do_not_change_batch_statistics(norm: str) -> None:
    bn = seqnorm.LSTMCell(3, 4, norm=norm).norm_ih
    reference = seqnorm.LSTMCell(3, 4, norm=norm).norm_ih
    x = torch.randn(6, 16)
    mask = torch.tensor([True, False, True, True, False, True])
    garbage = x.clone()
    garbage[~mask] = float("inf")
    output = bn(garbage, step=2, mask=mask)
    expected = reference(x[mask], step=2)
    assert_close(output[mask], expected)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert_close(getattr(bn, name), getattr(reference, name)), name
    assert bn.num_batches_tracked[2] == 1
    assert torch.isfinite(output[mask]).all()  # the padded rows hold inf: none of it leaked


@pytest.mark.parametrize("value", [1e4, float("nan"), float("inf")])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_padding_values_never_matter(kind: str, norm: str, value: float) -> None:
    """Garbage at padded positions (NaN and inf included) changes neither outputs, final states, running statistics
    nor gradients, the parameters' included (NaN padding reached W_ih's gradient as 0 * NaN)."""
    lengths = torch.tensor([6, 3, 6, 4])  # >= 2 active rows at every step
    x = torch.randn(6, 4, 3, requires_grad=True)
    garbage = x.detach().clone()
    for b, length in enumerate(lengths.tolist()):
        garbage[length:, b] = value
    garbage.requires_grad_()
    weights = LAYERS[kind](3, 4, num_layers=2, bidirectional=True, norm=norm).state_dict()
    results = []
    for inputs in (x, garbage):
        layer = LAYERS[kind](3, 4, num_layers=2, bidirectional=True, norm=norm)
        layer.load_state_dict(weights)
        torch.manual_seed(1)
        output, state = layer(inputs, lengths=lengths)
        grad, *parameter_grads = torch.autograd.grad(output.square().sum(), [inputs, *layer.parameters()])
        results.append((output, state, layer.state_dict(), grad, parameter_grads))
    (output, state, buffers, grad, parameter_grads), (output_g, state_g, buffers_g, grad_g, parameter_grads_g) = results
    assert_close(output_g, output)
    assert_close(state_g, state)
    assert_close(buffers_g, buffers)
    assert_close(parameter_grads_g, parameter_grads)
    for b, length in enumerate(lengths.tolist()):
        assert_close(grad_g[:length, b], grad[:length, b])
        assert torch.equal(grad_g[length:, b], torch.zeros_like(grad_g[length:, b]))


def test_layer_skips_steps_that_are_padding_for_every_row() -> None:
    layer = seqnorm.LSTM(3, 4, norm="batch")
    x = torch.randn(9, 2, 3)
    output, _ = layer(x, lengths=torch.tensor([5, 5]))  # steps 5..8 have no active row: not run, zeros
    assert torch.equal(output[5:], torch.zeros(4, 2, 4))
    assert layer.cells[0].norm_ih.num_batches_tracked[:6].tolist() == [1, 1, 1, 1, 1, 0]


def test_timestep_batch_norm_direct_mask_equals_subset() -> None:
    bn = TimestepBatchNorm(5, max_steps=3, gain=1.0)
    x = torch.randn(7, 5)
    mask = torch.rand(7) > 0.4
    mask[:2] = True
    y = bn(x, step=0, mask=mask)
    active = x[mask]
    expected = (active - active.mean(0)) / torch.sqrt(active.var(0, unbiased=False) + bn.eps)
    assert_close(y[mask], expected)
