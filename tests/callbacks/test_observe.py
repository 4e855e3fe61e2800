"""The observation engine without Lightning: every cell × norm, bidirectional and stacked, padding excluded."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from seqnorm import GatedCell, RecurrentLayer
from seqnorm.callbacks.observe import Observation, find_cells, train_eval_gap
from seqnorm.norms import BatchNormSpec
from tests.conftest import BATCH_NORMS, KINDS, LAYERS, NORMS, running_fallback

LENGTHS = torch.tensor([5, 3, 2, 5])


def _padded_input(pad_value: float) -> torch.Tensor:
    x = torch.randn(5, 4, 3, generator=torch.Generator().manual_seed(1))  # (T, B, I)
    real = torch.arange(5).unsqueeze(1) < LENGTHS.unsqueeze(0)
    return torch.where(real.unsqueeze(2), x, pad_value)


def _observe(layer: torch.nn.Module, x: torch.Tensor, gradients: bool = False) -> dict:
    observation = Observation(find_cells(layer), keep_values=True, gradients=gradients)
    observation.start()
    output, _ = layer(x, lengths=LENGTHS)
    observation.stop()
    if gradients:
        output.square().sum().backward()
    return observation.summaries()


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_cell_and_norm_gives_finite_statistics_without_padding(kind: str, norm: str) -> None:
    torch.manual_seed(0)
    layer = LAYERS[kind](3, 6, num_layers=2, bidirectional=True, norm=running_fallback(norm))
    summaries = _observe(layer, _padded_input(0.0), gradients=True)
    assert list(summaries) == ["l0", "l0_reverse", "l1", "l1_reverse"]
    torch.manual_seed(0)
    layer = LAYERS[kind](3, 6, num_layers=2, bidirectional=True, norm=running_fallback(norm))
    # huge values in the padding: any statistic that let a padded row in would change
    leaked = _observe(layer, _padded_input(1e4), gradients=True)
    expected_rows = (torch.arange(5).unsqueeze(1) < LENGTHS.unsqueeze(0)).sum(1).double()
    for name, summary in summaries.items():
        assert ("hidden", "c_std") in summary.scalars or kind == "gru"
        assert {("gates", "g_sat" if kind == "lstm" else "n_sat"), ("grad", "last_over_first")} <= set(summary.scalars)
        for key, value in summary.scalars.items():
            assert math.isfinite(value), (name, key)
            assert value == pytest.approx(leaked[name].scalars[key], rel=1e-5, abs=1e-6), (name, key)
        assert_close(summary.active_rows, expected_rows)
        grads = summary.profiles[("grad", "h_norm")]
        assert (grads > 0).all() and torch.isfinite(grads).all()
        if norm in BATCH_NORMS:
            assert ("norm", "ih_running_var") in summary.scalars


def test_statistics_match_a_direct_computation_over_real_positions() -> None:
    layer = LAYERS["gru"](3, 6, norm="layer")
    x = _padded_input(3.0)
    summary = _observe(layer, x)["l0"]
    with torch.no_grad():
        output, _ = layer(x, lengths=LENGTHS)
    real = torch.arange(5).unsqueeze(1) < LENGTHS.unsqueeze(0)
    h = output[real]  # (real positions, H)
    assert summary.scalars[("hidden", "h_mean")] == pytest.approx(float(h.mean()), abs=1e-6)
    per_step = [output[t][real[t]].std(unbiased=False) for t in range(5)]
    assert_close(summary.profiles[("hidden", "h_std")].float(), torch.stack(per_step), atol=1e-5, rtol=1e-4)
    # LayerNorm of W_ih x: mean 0 and std 1 across each row's features
    assert summary.scalars[("norm", "ih_post_mean")] == pytest.approx(0.0, abs=1e-5)
    assert summary.scalars[("norm", "ih_post_std")] == pytest.approx(1.0, abs=1e-3)


def test_no_hooks_remain_after_an_observation() -> None:
    layer = LAYERS["lstm"](3, 4, num_layers=2, norm="batch")
    _observe(layer, _padded_input(0.0))
    assert not any(cell.observer.active for cell in layer.cells)
    assert not layer._forward_pre_hooks


@pytest.mark.parametrize("norm", BATCH_NORMS)
def test_train_eval_gap_leaves_running_statistics_and_rng_untouched(norm: str) -> None:
    layer = LAYERS["lstm"](3, 4, num_layers=2, bidirectional=True, norm=running_fallback(norm), dropout=0.5)
    layer.eval()
    before = {key: value.clone() for key, value in layer.state_dict().items()}
    rng = torch.get_rng_state()
    x = _padded_input(0.0)
    gaps = train_eval_gap(layer, find_cells(layer), (x,), {"lengths": LENGTHS})
    assert torch.equal(torch.get_rng_state(), rng)
    for key, value in layer.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert not layer.training and not any(module.training for module in layer.modules())
    for profile, overall in gaps.values():
        # fresh running statistics (mean 0, var 1) differ from the batch's: a visible gap at steps with >= 2 rows
        assert overall > 0 and math.isfinite(overall)
        assert profile.shape == (5,)


def test_train_eval_gap_leaves_the_fallback_counts_untouched() -> None:
    # steps 3 and 4 have one real row: in training they fall back to running statistics and count themselves
    layer = LAYERS["lstm"](3, 4, num_layers=2, norm="batch").eval()
    lengths = torch.tensor([5, 3, 2, 2])
    train_eval_gap(layer, find_cells(layer), (_padded_input(0.0),), {"lengths": lengths})
    assert [norm.fallback_steps for norm in layer.modules() if hasattr(norm, "fallback_steps")] == [0] * 6
    layer.train()(_padded_input(0.0), lengths=lengths)  # what the diagnostic must not pass for: a training step
    assert sum(norm.fallback_steps for norm in layer.modules() if hasattr(norm, "fallback_steps")) > 0


def test_projected_lstm_counts_units_of_the_projected_state() -> None:
    layer = LAYERS["lstm"](3, 6, num_layers=2, bidirectional=True, norm="layer", proj_size=2)
    summary = _observe(layer, _padded_input(0.0), gradients=True)["l1_reverse"]
    assert 0 <= summary.scalars[("hidden", "h_zero_frac")] <= 1
    assert all(math.isfinite(value) for value in summary.scalars.values())


@pytest.mark.parametrize(
    ("switches", "expected"),
    [
        ({"norm_placement": "joint"}, {("norm", "gates_running_mean"), ("norm", "gates_post_std")}),
        ({"input_stats": "sequence", "state_norm": "carried"}, {("norm", "ih_running_var"), ("norm", "c_post_std")}),
    ],
)
def test_placement_switches_are_observed(switches: dict, expected: set) -> None:
    layer = LAYERS["lstm"](3, 6, norm=BatchNormSpec(small_batch="running", **switches))
    summary = _observe(layer, _padded_input(0.0))["l0"]
    assert expected <= set(summary.scalars)
    assert all(math.isfinite(value) for value in summary.scalars.values())


class _MGUCell(GatedCell):
    """A minimal gated unit (Zhou et al. 2016): two gate blocks, a forget gate and a tanh candidate, declared as
    ``gate_layout`` ("f", "n"); its step hands the observer its record as the library's gated cells do."""

    num_gates = 2
    gate_layout = ("f", "n")

    def step_terms(self, x, state, step, mask, *, input_normed=None, input_term=None):  # type: ignore[no-untyped-def]
        record: dict | None = {} if self.observer.active else None
        a, u = self.gate_terms(x, self.recurrent_input(state), step, mask, record, input_normed, input_term)
        (fa, na), (fu, nu) = a.chunk(2, 1), u.chunk(2, 1)
        f = torch.sigmoid(fa + fu)
        n = torch.tanh(na + f * nu)
        h = self.settle((1 - f) * state + f * n, state, mask, self.zoneout_h)
        if record is not None:
            record.update(gates=torch.cat([f, n], 1), h=h)
            self.observer(record)
        return h


class _MGU(RecurrentLayer):
    cell_class = _MGUCell


def test_a_gated_cell_of_another_layout_is_observed_by_its_own_gate_names() -> None:
    """Two gate blocks ended in an IndexError (the LSTM's and GRU's tanh block, 2, was marked in every cell), and a
    third block of another layout would have been counted saturated as a tanh."""
    torch.manual_seed(0)
    layer = _MGU(3, 4, norm="layer")
    (summary,) = _observe(layer, _padded_input(0.0)).values()
    assert {("gates", "f_sat"), ("gates", "n_sat")} <= set(summary.scalars)
    assert not any(name.startswith(("g_", "gate")) for _, name in summary.scalars)
