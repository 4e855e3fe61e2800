"""The placement switches: each computes what its equation says, against small references written here."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import seqnorm
from seqnorm.norms import BatchNormSpec, TimestepBatchNorm, WeightNormSpec
from tests.conftest import CELLS, KINDS, LAYERS, perturb_norm_parameters, with_spec
from tests.layers.test_fast_path import _assert_same, _hx, _pair, _run
from tests.test_contract import _gradcheck_cell

F64 = {"dtype": torch.float64}
EXACT = {"rtol": 1e-12, "atol": 1e-12}


def _layer_norm(x: torch.Tensor, gain: torch.Tensor | None, shift: torch.Tensor | None, eps: float = 1e-5):
    y = (x - x.mean(1, keepdim=True)) / torch.sqrt(x.var(1, unbiased=False, keepdim=True) + eps)
    y = y if gain is None else y * gain
    return y if shift is None else y + shift


def _batch_norm(x: torch.Tensor, gain: torch.Tensor | None, shift: torch.Tensor | None, eps: float = 1e-5):
    """Training-mode BN over the rows of ``x`` ``(N, F)`` (all of them real)."""
    y = (x - x.mean(0)) / torch.sqrt(x.var(0, unbiased=False) + eps)
    y = y if gain is None else y * gain
    return y if shift is None else y + shift


def _lstm_tail(pre: torch.Tensor, c_prev: torch.Tensor) -> tuple[torch.Tensor, ...]:
    i, f, g, o = pre.chunk(4, 1)
    c = torch.sigmoid(f) * c_prev + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o), c


# --- each switch against its equation ------------------------------------------------------------------------------


@pytest.mark.parametrize("norm", ["layer", "batch"])
def test_joint_placement_normalizes_the_sum(norm: str) -> None:
    cell = seqnorm.LSTMCell(3, 4, **with_spec(norm, norm_placement="joint"), **F64)
    perturb_norm_parameters(cell)
    assert cell.norm_ih is None and cell.norm_hh is None and cell.norm_gates is not None
    x, h, c = torch.randn(5, 3, **F64), torch.randn(5, 4, **F64), torch.randn(5, 4, **F64)
    reference_norm = _layer_norm if norm == "layer" else _batch_norm
    total = x @ cell.weight_ih.T + h @ cell.weight_hh.T
    pre = reference_norm(total, cell.norm_gates.weight, None) + cell.bias_ih + cell.bias_hh
    o, c_new = _lstm_tail(pre, c)
    h_new = o * torch.tanh(reference_norm(c_new, cell.norm_c.weight, cell.norm_c.bias))
    assert_close(cell(x, (h, c), step=0), (h_new, c_new), **EXACT)


@pytest.mark.parametrize("norm", ["layer", "rms", "batch"])
def test_carried_state_norm_is_the_new_cell_state(norm: str) -> None:
    output_only = seqnorm.LSTMCell(3, 4, norm=norm, **F64)
    carried = seqnorm.LSTMCell(3, 4, **with_spec(norm, state_norm="carried"), **F64)
    perturb_norm_parameters(output_only)
    carried.load_state_dict(output_only.state_dict())
    x, state = torch.randn(5, 3, **F64), (torch.randn(5, 4, **F64), torch.randn(5, 4, **F64))
    h_out, c_raw = output_only(x, state, step=0)
    h_car, c_car = carried(x, state, step=0)
    assert_close(h_car, h_out, **EXACT)  # the same h: only what is carried differs
    if norm == "layer":
        expected_c = _layer_norm(c_raw, carried.norm_c.weight, carried.norm_c.bias)
    elif norm == "batch":
        expected_c = _batch_norm(c_raw, carried.norm_c.weight, carried.norm_c.bias)
    else:
        expected_c = carried.norm_c.bias + carried.norm_c.weight * c_raw * torch.rsqrt(
            c_raw.square().mean(1, keepdim=True) + 1e-5
        )
    assert_close(c_car, expected_c, **EXACT)
    # and the next step starts from it
    assert_close(carried(x, (h_car, c_car), step=1)[0], output_only(x, (h_car, c_car), step=1)[0], **EXACT)


@pytest.mark.parametrize("norm", ["layer", "rms", "batch", "batch_renorm"])
@pytest.mark.parametrize("kind", KINDS)
def test_affine_off_is_the_bare_normalization(kind: str, norm: str) -> None:
    bare = CELLS[kind](3, 4, **with_spec(norm, affine=False), **F64)
    assert not [name for name, _ in bare.named_parameters() if name.startswith("norm_")]
    unit = CELLS[kind](3, 4, **with_spec(norm, gamma_init=1.0), **F64)  # γ = 1, β = 0: the same function at init
    unit.load_state_dict(bare.state_dict(), strict=False)
    x, h = torch.randn(5, 3, **F64), torch.randn(5, 4, **F64)
    state = (h, torch.randn(5, 4, **F64)) if kind == "lstm" else h
    assert_close(bare(x, state, step=2), unit(x, state, step=2), **EXACT)


DEFAULT_GAINS = [("layer", 1.0), ("rms", 1.0), ("batch", 0.1), ("batch_renorm", 0.1)]


@pytest.mark.parametrize(("norm", "default_gain"), DEFAULT_GAINS)
def test_gamma_and_beta_initial_values(norm: str, default_gain: float) -> None:
    default = seqnorm.LSTMCell(3, 4, norm=norm)
    gains = [v for n, v in default.state_dict().items() if n.startswith("norm_") and n.endswith(".weight")]
    assert len(gains) == 3 and all(torch.equal(v, torch.full_like(v, default_gain)) for v in gains)
    cell = seqnorm.LSTMCell(3, 4, **with_spec(norm, gamma_init=0.5, beta_init=-0.25))
    for module in (cell.norm_ih, cell.norm_hh, cell.norm_c):
        assert torch.equal(module.weight, torch.full_like(module.weight, 0.5))
    assert torch.equal(cell.norm_c.bias, torch.full((4,), -0.25))
    assert cell.norm_ih.bias is None  # the gate terms' β stays fixed at 0: the cell bias follows
    with torch.no_grad():
        cell.norm_c.bias.zero_()
    cell.reset_parameters()  # the initial values are the module's, so a reset restores them
    assert torch.equal(cell.norm_c.bias, torch.full((4,), -0.25))


def _masked_bn(x: torch.Tensor, real: torch.Tensor, gain: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """BN of ``x`` ``(..., F)`` with moments over the positions where ``real`` ``(...)`` is true."""
    rows = x[real]
    return (x - rows.mean(0)) / torch.sqrt(rows.var(0, unbiased=False) + eps) * gain


@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_sequence_wise_input_batch_norm(impl: str) -> None:
    """BN-e*: the input term's moments over every real (t, b) position; the recurrent term stays per-timestep."""
    layer = seqnorm.LSTM(3, 4, norm=BatchNormSpec(input_stats="sequence"), impl=impl, **F64)
    perturb_norm_parameters(layer)
    cell = layer.cells[0]
    lengths = torch.tensor([6, 3, 6, 4])
    x = torch.randn(6, 4, 3, **F64)
    real = torch.arange(6).unsqueeze(1) < lengths  # (T, B)
    x_poisoned = torch.where(real.unsqueeze(2), x, 1e6)  # padding must not reach the statistics
    before = cell.norm_ih.running_mean.clone()
    output, (h_n, c_n) = layer(x_poisoned, lengths=lengths)

    inputs = _masked_bn(x @ cell.weight_ih.T, real, cell.norm_ih.weight)
    h, c = torch.zeros(4, 4, **F64), torch.zeros(4, 4, **F64)
    expected = []
    for t in range(6):
        keep = real[t]
        recurrent = torch.zeros(4, 16, **F64)
        recurrent[keep] = _batch_norm((h @ cell.weight_hh.T)[keep], cell.norm_hh.weight, None)
        o, c_new = _lstm_tail(inputs[t] + recurrent + cell.bias_ih + cell.bias_hh, c)
        c_bn = torch.zeros_like(c_new)
        c_bn[keep] = _batch_norm(c_new[keep], cell.norm_c.weight, cell.norm_c.bias)
        h_new = o * torch.tanh(c_bn)
        h, c = torch.where(keep.unsqueeze(1), h_new, h), torch.where(keep.unsqueeze(1), c_new, c)
        expected.append(torch.where(keep.unsqueeze(1), h, 0.0))
    assert_close(output, torch.stack(expected), **EXACT)
    assert_close((h_n[0], c_n[0]), (h, c), **EXACT)
    pooled_mean = (x @ cell.weight_ih.T)[real].mean(0)
    assert cell.norm_ih.running_mean.shape == (1, 16)
    assert_close(cell.norm_ih.running_mean[0], torch.lerp(before[0], pooled_mean, 0.1), **EXACT)


def test_sequence_wise_input_norm_needs_whole_sequences_in_training() -> None:
    cell = seqnorm.LSTMCell(3, 4, norm=BatchNormSpec(input_stats="sequence"))
    with pytest.raises(ValueError, match=r"LSTMCell: expected a whole sequence for input_stats='sequence'"):
        cell(torch.randn(5, 3), step=0)
    cell.eval()
    h, _ = cell(torch.randn(5, 3), step=0)  # running statistics: one step at a time is fine
    assert torch.isfinite(h).all()
    terms = cell.input_terms(torch.randn(6, 5, 3))  # the documented way to get its terms for a whole sequence
    assert terms.shape == (6, 5, 16)


def test_beyond_max_steps_pooled_statistics() -> None:
    norm = TimestepBatchNorm(3, max_steps=3, beyond_max_steps="pooled", gain=1.0, dtype=torch.float64)
    last = TimestepBatchNorm(3, max_steps=3, gain=1.0, dtype=torch.float64)
    for t, batches in enumerate([1, 2, 2]):  # steps seen 1, 2, 2 times
        for _ in range(batches):
            x = torch.randn(8, 3, **F64) * (t + 1) + t
            norm(x, t)
            last(x, t)
    weights = torch.tensor([1.0, 2.0, 2.0], **F64).unsqueeze(1) / 5
    mean = (weights * norm.running_mean).sum(0)
    var = (weights * (norm.running_var + norm.running_mean.square())).sum(0) - mean.square()
    buffers = {k: v.clone() for k, v in norm.state_dict().items()}
    x = torch.randn(8, 3, **F64)
    trained = norm(x, 7)  # training beyond max_steps: its own batch statistics, no row updated
    assert_close(trained, _batch_norm(x, None, None), **EXACT)
    assert all(torch.equal(v, buffers[k]) for k, v in norm.state_dict().items())
    norm.eval()
    last.eval()
    assert_close(norm(x, 7), (x - mean) / torch.sqrt(var + 1e-5), **EXACT)
    assert_close(norm(x, 1), last(x, 1), **EXACT)  # steps with a row of their own are unaffected
    assert_close(last(x, 7), last(x, 2), **EXACT)  # the default reuses the last row
    last.train()
    last(x, 7)
    assert last.num_batches_tracked.tolist() == [1, 2, 3]  # ... and trains it


# --- every switch: fast path == reference, gradcheck, streaming -----------------------------------------------------

SWITCHES: dict[str, dict[str, Any]] = {
    "joint": {"norm_placement": "joint"},
    "carried": {"state_norm": "carried"},
    "bare": {"affine": False},
    "init": {"gamma_init": 0.3, "beta_init": 0.2},
    "sequence": {"input_stats": "sequence"},
    "pooled": {"beyond_max_steps": "pooled"},
    "all": {"norm_placement": "joint", "state_norm": "carried", "beyond_max_steps": "pooled"},
}
CASES = [
    (kind, norm, name)
    for name, switches in SWITCHES.items()
    for norm in ("layer", "rms", "batch", "batch_renorm")
    for kind in KINDS
    if not (kind == "gru" and ({"norm_placement", "state_norm", "beta_init"} & set(switches)))
    if norm in ("batch", "batch_renorm") or not ({"input_stats", "beyond_max_steps"} & set(switches))
]


@pytest.mark.parametrize(("kind", "norm", "name"), CASES)
def test_switches_fast_path_equals_reference(kind: str, norm: str, name: str) -> None:
    reference, fast = _pair(kind, norm, num_layers=2, bidirectional=True, max_steps=4, **SWITCHES[name])
    lengths = torch.tensor([6, 3, 6, 4])
    x, hx = torch.randn(7, 4, 3, **F64), _hx(kind, 4, 4)
    for training in (True, False):
        reference.train(training)
        fast.train(training)
        _assert_same(_run(reference, x, hx, lengths), _run(fast, x, hx, lengths))


@pytest.mark.parametrize(("kind", "norm", "name"), [case for case in CASES if case[2] != "sequence"])
def test_switches_gradcheck(kind: str, norm: str, name: str) -> None:
    cell = CELLS[kind](3, 2, max_steps=1, **with_spec(norm, **SWITCHES[name]), **F64)
    perturb_norm_parameters(cell)
    _gradcheck_cell(cell, kind, torch.tensor([True, False, True, True]))  # step 1 >= max_steps: pooled or last


def _stream(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The outputs of feeding ``x`` ``(T, B, I)`` to ``layer.step`` one time step at a time."""
    state, outputs = None, []
    for x_t in x.unbind(0):
        output, state = layer.step(x_t, state)
        outputs.append(output)
    return torch.stack(outputs)


@pytest.mark.parametrize(("kind", "norm", "name"), CASES)
def test_switches_streaming_equals_whole_sequence(kind: str, norm: str, name: str) -> None:
    """Eval, one step at a time through step() (the state carries the time index), with T > max_steps."""
    layer = LAYERS[kind](3, 5, num_layers=2, max_steps=3, **with_spec(norm, **SWITCHES[name]), **F64)
    perturb_norm_parameters(layer)
    layer.train()
    layer(torch.randn(6, 4, 3, **F64))  # statistics with some history, so every row differs
    layer.eval()
    x = torch.randn(6, 2, 3, **F64)
    expected, _ = layer(x)
    assert_close(_stream(layer, x), expected, **EXACT)


@pytest.mark.parametrize("name", ["joint", "carried", "bare", "init"])
def test_layer_norm_switches_stream_at_batch_size_one_in_training(name: str) -> None:
    layer = seqnorm.LSTM(3, 5, num_layers=2, **with_spec("layer", **SWITCHES[name]), **F64)
    x = torch.randn(6, 1, 3, **F64)
    expected, _ = layer(x)
    assert_close(_stream(layer, x), expected, **EXACT)


@pytest.mark.parametrize(("kind", "norm", "name"), CASES)
def test_switches_under_autocast_are_close_to_float32(kind: str, norm: str, name: str) -> None:
    layer = LAYERS[kind](8, 16, num_layers=2, max_steps=4, **with_spec(norm, **SWITCHES[name]))
    x, lengths = torch.randn(6, 5, 8), torch.tensor([6, 3, 6, 5, 2])
    snapshot = {k: v.clone() for k, v in layer.state_dict().items()}
    expected, _ = layer(x, lengths=lengths)
    layer.load_state_dict(snapshot)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output, _ = layer(x, lengths=lengths)
    # The tolerance of tests/layers/test_mixed_precision.py; bare BN (γ = 1, not 0.1) over steps of 2-3 real rows passes
    # ten times larger gate pre-activations, and their bfloat16 rounding, into the saturating gates.
    atol = 0.1 if name == "bare" and norm.startswith("batch") else 0.06
    assert_close(output, expected, rtol=0.0, atol=atol)
    assert all(buffer.dtype == snapshot[key].dtype for key, buffer in layer.state_dict().items())


def test_eval_is_deterministic_with_switches_and_regularizers() -> None:
    layer = seqnorm.LSTM(
        3,
        5,
        norm=BatchNormSpec(norm_placement="joint", state_norm="carried"),
        zoneout_h=0.3,
        recurrent_dropout=0.3,
    )
    layer(torch.randn(6, 4, 3))
    layer.eval()
    x = torch.randn(6, 4, 3)
    assert torch.equal(layer(x)[0], layer(x)[0])


# --- bad combinations are errors naming the argument ----------------------------------------------------------------

NORMS_SPEC = {name: scheme.spec.__name__ for name, scheme in seqnorm.NORMS.items()}
BAD: list[tuple[str, str, dict[str, Any], str]] = [
    ("gru", "layer", {"norm_placement": "joint"}, r"expected norm_placement='separate' \(the GRU candidate"),
    ("gru", "layer", {"state_norm": "carried"}, r"expected state_norm='output' \(there is no cell state\)"),
    ("gru", "layer", {"beta_init": 0.5}, r"expected beta_init=0 \(only an LSTM's cell-state norm"),
    # an option the norm's spec lacks: the cell or layer names a spec that has it
    ("lstm", "none", {"norm_placement": "joint"}, r"keyword 'norm_placement'; pass norm=LayerNormSpec\(norm_place"),
    ("lstm", "weight", {"norm_placement": "joint"}, r"expected mean_only_bn=True for norm_placement='joint'"),
    ("lstm", "weight", {"state_norm": "carried"}, r"keyword 'state_norm'; pass norm=LayerNormSpec\(state_norm='c"),
    ("lstm", "layer", {"input_stats": "sequence"}, r"keyword 'input_stats'; pass norm=BatchNormSpec\(input_stat"),
    ("lstm", "rms", {"beyond_max_steps": "pooled"}, r"keyword 'beyond_max_steps'; pass norm=BatchNormSpec\("),
    ("lstm", "none", {"affine": False}, r"keyword 'affine'; pass norm=LayerNormSpec\(affine=False\)"),
    ("lstm", "layer", {"affine": False, "gamma_init": 2.0}, r"expected gamma_init=None and beta_init=0 with affine"),
    ("lstm", "batch", {"norm_placement": "joint", "input_stats": "sequence"}, r"expected input_stats='timestep' with"),
    ("lstm", "layer", {"norm_placement": "both"}, r"expected norm_placement to be one of 'separate', 'joint', got"),
    ("lstm", "layer", {"affine": "yes"}, r"expected affine to be one of True, False, got 'yes'"),
    ("lstm", "layer", {"gamma_init": "1"}, r"expected gamma_init to be a finite number, got '1'"),
    ("lstm", "batch", {"beta_init": float("nan")}, r"expected beta_init to be a finite number, got nan"),
    ("lstm", "batch", {"beyond_max_steps": "mean"}, r"expected beyond_max_steps to be one of 'last', 'pooled'"),
]


@pytest.mark.parametrize("level", ["cell", "layer"])
@pytest.mark.parametrize(("kind", "norm", "switches", "message"), BAD)
def test_bad_switches_are_errors_naming_the_argument(
    kind: str, norm: str, switches: dict[str, Any], message: str, level: str
) -> None:
    # the cell or layer names itself; a spec's own check names the spec (it is made before them)
    cls = CELLS[kind] if level == "cell" else LAYERS[kind]
    with pytest.raises((ValueError, TypeError), match=rf"^({cls.__name__}|{NORMS_SPEC[norm]}): (.* )?{message}"):
        cls(3, 4, **with_spec(norm, **switches))


def test_weight_norm_with_mean_only_bn_can_sit_jointly() -> None:
    cell = seqnorm.LSTMCell(3, 4, norm=WeightNormSpec(mean_only_bn=True, norm_placement="joint"))
    x, h, c = torch.randn(5, 3), torch.randn(5, 4), torch.randn(5, 4)
    total = F.linear(x, cell.weight_ih) + F.linear(h, cell.weight_hh)
    o, c_new = _lstm_tail(total - total.mean(0) + cell.bias_ih + cell.bias_hh, c)
    assert_close(cell(x, (h, c), step=0), (o * torch.tanh(c_new), c_new))


def test_repr_shows_switches() -> None:
    text = repr(seqnorm.LSTM(3, 4, norm=BatchNormSpec(norm_placement="joint", beyond_max_steps="pooled")))
    assert "norm_placement='joint'" in text and "beyond_max_steps='pooled'" in text
    assert "norm_placement" not in repr(seqnorm.LSTMCell(3, 4, norm="batch"))


@pytest.mark.parametrize(
    "switches",
    [
        {"norm": "batch", "input_stats": "sequence", "state_norm": "carried", "beyond_max_steps": "pooled"},
        {"norm": "layer", "norm_placement": "joint", "affine": False},
    ],
)
def test_torch_compile_with_switches(switches: dict[str, Any]) -> None:
    torch._dynamo.reset()
    layer = seqnorm.LSTM(3, 4, max_steps=2, **with_spec(**switches))
    compiled = torch.compile(layer, backend="eager")
    x, lengths = torch.randn(4, 3, 3), torch.tensor([4, 3, 4])
    output, _ = compiled(x, lengths=lengths)
    output.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)
    layer.eval()
    assert_close(compiled(x, lengths=lengths), layer(x, lengths=lengths))
