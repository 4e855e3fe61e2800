"""The layers' fast paths equal the plain per-step reference loop: outputs, states, gradients and running statistics.

Every test runs twice: with the compiled kernels (:mod:`seqnorm.kernels`, where the plan routes normalized LSTM/GRU
layers) and with them switched off (the plain-PyTorch loop over the cell's step).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence
from torch.testing import assert_close

import seqnorm
from seqnorm.layers.sequence import choose_path
from seqnorm.norms import TimestepBatchNorm, TimestepBatchRenorm
from tests.conftest import (
    BATCH_NORMS,
    HOISTED,
    LAYERS,
    NORMS,
    ROW_NORMS,
    TORCH_KINDS,
    perturb_norm_parameters,
    require_kernels,
    with_spec,
)

TOLERANCE = {"rtol": 1e-9, "atol": 1e-9}
RENORM_ACTIVE = {"warmup": 0, "r_max_steps": 1, "d_max_steps": 1, "r_max": 1.5, "d_max": 0.5}


@pytest.fixture(autouse=True, params=["compiled", "plain"])
def _paths(request: pytest.FixtureRequest) -> Any:
    if request.param == "compiled":
        require_kernels()
        yield
    else:
        with seqnorm.kernels.disabled():
            yield


def _pair(kind: str, norm: str, **kwargs: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same layer twice: the reference loop and the default (fast) path, with perturbed norm parameters."""
    if norm == "batch_renorm":
        kwargs.setdefault("norm_options", RENORM_ACTIVE)  # the r/d correction acts from the first batch on
    kwargs = with_spec(norm, **kwargs)
    reference = LAYERS[kind](3, 4, impl="reference", dtype=torch.float64, **kwargs)
    perturb_norm_parameters(reference)  # running statistics away from 0/1, so renorm's r and d are not trivial
    fast = LAYERS[kind](3, 4, dtype=torch.float64, **kwargs)
    fast.load_state_dict(reference.state_dict())
    return reference, fast


def _run(layer: torch.nn.Module, x: torch.Tensor, hx: Any, lengths: torch.Tensor | None, seed: int = 1) -> list[Any]:
    """Output, final state, gradients w.r.t. input, initial state and every parameter, and the buffers after."""
    x = x.clone().requires_grad_()
    leaves = [t.clone().requires_grad_() for t in (hx if isinstance(hx, tuple) else (hx,))] if hx is not None else []
    state_in = None if hx is None else (tuple(leaves) if isinstance(hx, tuple) else leaves[0])
    torch.manual_seed(seed)  # dropout masks: both paths must draw the same ones
    output, state = layer(x, state_in, lengths=lengths)
    if isinstance(output, torch.nn.utils.rnn.PackedSequence):
        output = output.data
    flat = [output, *(state if isinstance(state, tuple) else (state,))]
    loss = sum((t * torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view_as(t)).sum() for t in flat)
    grads = torch.autograd.grad(loss, [x, *leaves, *layer.parameters()])
    return [output, state, grads, {k: v.clone() for k, v in layer.state_dict().items()}]


def _assert_same(reference: list[Any], fast: list[Any]) -> None:
    for name, expected, got in zip(("output", "state", "gradients", "buffers"), reference, fast, strict=True):
        assert_close(got, expected, **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")


def _hx(kind: str, layers: int, batch: int) -> Any:
    h0 = torch.randn(layers, batch, 4, dtype=torch.float64)
    return (h0, torch.randn_like(h0)) if kind == "lstm" else h0


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_fast_equals_reference(kind: str, norm: str, training: bool) -> None:
    """Lengths, both directions, two layers, an initial state; T > max_steps, so steps share the last BN row."""
    reference, fast = _pair(kind, norm, num_layers=2, bidirectional=True, max_steps=4)
    lengths = torch.tensor([6, 3, 6, 4])  # >= 2 real rows at every step, as training batch norms need
    x = torch.randn(7, 4, 3, dtype=torch.float64)  # and a last step of pure padding
    hx = _hx(kind, 4, 4)
    for layer in (reference, fast):
        layer.train(training)
    expected_paths = ("torch_kernel",) if norm in ("none", "weight") else HOISTED
    assert choose_path(fast, lengths, 4) in expected_paths
    for _ in range(2):  # the second call sees running statistics (and renorm limits) the first one wrote
        _assert_same(_run(reference, x, hx, lengths), _run(fast, x, hx, lengths))


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_torch_func_grad_and_vmap_equal_autograd(kind: str, norm: str) -> None:
    """torch.func's transforms took no normalized layer: the input projection's and the kernels' autograd Functions
    were of the old style, which they refuse ("must override the setup_context staticmethod"). In eval mode: batch
    norms in training update running statistics in place, which torch.func refuses of torch's own BatchNorm too."""
    _, layer = _pair(kind, norm, num_layers=2)
    layer.eval()
    x = torch.randn(5, 2, 3, dtype=torch.float64)

    def loss(parameters: dict[str, torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(layer, parameters, (inputs,))[0].square().sum()

    parameters = {name: p.detach() for name, p in layer.named_parameters()}
    by_func = torch.func.grad(loss, argnums=(0, 1))(parameters, x)
    inputs = x.clone().requires_grad_()
    expected = torch.autograd.grad(layer(inputs)[0].square().sum(), [*layer.parameters(), inputs])
    assert_close([*by_func[0].values(), by_func[1]], list(expected), **TOLERANCE)
    batched = torch.randn(3, 5, 2, 3, dtype=torch.float64)
    assert_close(torch.func.vmap(lambda one: layer(one)[0])(batched), torch.stack([layer(one)[0] for one in batched]))


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_fast_equals_reference_with_dropout(kind: str, norm: str) -> None:
    reference, fast = _pair(kind, norm, num_layers=2, dropout=0.3, recurrent_dropout=0.2, batch_first=True)
    assert choose_path(fast, None, 5) in HOISTED  # random masks keep even norm="none" off torch's kernel
    x = torch.randn(5, 6, 3, dtype=torch.float64)
    _assert_same(_run(reference, x, None, None, seed=7), _run(fast, x, None, None, seed=7))


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_fast_equals_reference_packed(kind: str, norm: str) -> None:
    reference, fast = _pair(kind, norm, bidirectional=True)
    x = torch.randn(6, 5, 3, dtype=torch.float64)
    packed = pack_padded_sequence(x, torch.tensor([6, 2, 5, 6, 4]), enforce_sorted=False)
    results = []
    for layer in (reference, fast):
        output, state = layer(packed)
        results.append((output.data, state, layer.state_dict()))
    assert_close(results[1], results[0], **TOLERANCE)


@pytest.mark.parametrize("norm", ROW_NORMS)
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_fast_equals_reference_at_batch_size_one(kind: str, norm: str) -> None:
    reference, fast = _pair(kind, norm, num_layers=2)
    x = torch.randn(5, 1, 3, dtype=torch.float64)
    _assert_same(_run(reference, x, None, None), _run(fast, x, None, None))


@pytest.mark.parametrize("norm", BATCH_NORMS)
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_small_batch_fallback_and_error_as_reference(kind: str, norm: str) -> None:
    lengths = torch.tensor([6, 2, 4])  # steps 4 and 5 have a single real row: running statistics
    x = torch.randn(6, 3, 3, dtype=torch.float64)
    for policy in ("tail", "running"):
        reference, fast = _pair(kind, norm, bidirectional=True, small_batch=policy)
        assert choose_path(fast, lengths, 3) in HOISTED
        _assert_same(_run(reference, x, None, lengths), _run(fast, x, None, lengths))
        counts = [[getattr(m, "fallback_steps", None) for m in layer.modules()] for layer in (reference, fast)]
        assert counts[0] == counts[1] and 2 in counts[0]  # every path counts the fallback steps alike
    strict = LAYERS[kind](3, 4, **with_spec(norm, small_batch="error"))
    assert choose_path(strict, lengths, 3) == "reference"  # the reference raises, after what it updated
    with pytest.raises(ValueError, match=r"at step 4 .* got 1 \(batch size 3\)"):
        strict(x.float(), lengths=lengths)


@pytest.mark.parametrize("norm", ["layer", "batch"])
def test_observer_forces_the_reference_path(norm: str) -> None:
    layer = seqnorm.LSTM(3, 4, num_layers=2, norm=norm)
    x = torch.randn(5, 3, 3)
    expected, _ = layer(x)
    steps: list[int] = []
    handle = layer.cells[1].observer.register_forward_hook(lambda module, args, output: steps.append(args[0]["step"]))
    assert choose_path(layer, None, 3) == "reference"
    layer.eval()  # identical computation without further running-statistics updates on either side
    observed, _ = layer(x)
    handle.remove()
    assert steps == [0, 1, 2, 3, 4]
    assert choose_path(layer, None, 3) in HOISTED
    assert_close(observed, layer(x)[0])
    assert expected.shape == observed.shape


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_step_equals_reference_step(kind: str, norm: str) -> None:
    reference, fast = _pair(kind, norm, num_layers=2)
    reference.eval()
    fast.eval()
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    states: list[Any] = [None, None]
    for x_t in x.unbind(0):
        out_ref, states[0] = reference.step(x_t, states[0])
        out_fast, states[1] = fast.step(x_t, states[1])
        assert_close(out_fast, out_ref, rtol=1e-12, atol=1e-12)
    assert_close(tuple(states[1]), tuple(states[0]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls", [TimestepBatchNorm, TimestepBatchRenorm])
@pytest.mark.parametrize("training", [True, False])
def test_forward_sequence_equals_stepwise_forward(cls: type[TimestepBatchNorm], training: bool) -> None:
    kwargs: dict[str, Any] = {"warmup": 0, "r_max_steps": 1, "d_max_steps": 1} if cls is TimestepBatchRenorm else {}
    stepwise = cls(5, max_steps=3, gain=0.7, small_batch="running", dtype=torch.float64, **kwargs)
    perturb_norm_parameters(torch.nn.ModuleDict({"norm_": stepwise}))
    stepwise.num_batches_tracked.fill_(2)
    vectorized = cls(5, max_steps=3, gain=0.7, small_batch="running", dtype=torch.float64, **kwargs)
    vectorized.load_state_dict(stepwise.state_dict())
    stepwise.train(training)
    vectorized.train(training)
    x = torch.randn(6, 4, 5, dtype=torch.float64) * 2 + 1
    mask = torch.tensor([[True] * 4] * 3 + [[True, True, False, True], [False, True, False, False]] + [[True] * 4])
    x_seq = x.clone().requires_grad_()
    x_step = x.clone().requires_grad_()
    expected = torch.stack([stepwise(x_t, t, m) for t, (x_t, m) in enumerate(zip(x_step.unbind(0), mask, strict=True))])
    got = vectorized.forward_sequence(x_seq, mask)
    assert_close(got, expected, **TOLERANCE)
    weights = torch.randn_like(got)
    assert_close(
        torch.autograd.grad((got * weights).sum(), x_seq), torch.autograd.grad((expected * weights).sum(), x_step)
    )
    assert_close(vectorized.state_dict(), stepwise.state_dict(), **TOLERANCE)


def test_impl_option() -> None:
    assert seqnorm.GRU(3, 4).impl == "auto"
    assert "impl='reference'" in repr(seqnorm.LSTM(3, 4, impl="reference"))
    expected = "'auto', 'reference', 'loop', 'kernel', 'triton', 'torch_kernel'"
    with pytest.raises(ValueError, match=rf"^LSTM: expected impl to be one of {expected}, got 'cuda'$"):
        seqnorm.LSTM(3, 4, impl="cuda")  # type: ignore[arg-type]


@pytest.mark.parametrize("pinned", ["loop", "kernel", "reference"])
def test_impl_pins_a_path_by_the_plans_own_name(pinned: str) -> None:
    """A path was named three ways (the plan's ``kernel``/``loop``, ``choose_path``'s ``fast``/``fused``, ``impl=``'s
    ``auto``/``reference``), and only the reference could be pinned. One vocabulary now: the plan's."""
    torch.manual_seed(0)
    auto = seqnorm.LSTM(3, 5, norm="layer", num_layers=2, bidirectional=True).double()
    layer = copy.deepcopy(auto)
    layer.impl = pinned  # type: ignore[assignment]
    x, lengths = torch.randn(6, 4, 3, dtype=torch.float64, requires_grad=True), torch.tensor([6, 3, 5, 2])
    if pinned == "kernel" and seqnorm.kernels.native("cpu") is None:  # the plain paths' run: the kernels are off
        with pytest.raises(ValueError, match=r"^LSTM: impl='kernel' cannot run this call: no compiled kernels"):
            layer(x, lengths=lengths)
        return
    plan = layer.plan(x, lengths=lengths)
    assert plan.path == pinned and set(plan.cells) <= {pinned}
    assert choose_path(layer, lengths, 4) == pinned
    got, expected = layer(x, lengths=lengths)[0], auto(x, lengths=lengths)[0]
    assert_close(got, expected, **TOLERANCE)
    assert_close(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(expected.sum(), x)[0], **TOLERANCE)


@pytest.mark.parametrize(
    ("pinned", "layer", "why"),
    [
        ("torch_kernel", dict(norm="layer"), "cannot run this call: torch's kernel normalizes nothing"),
        ("kernel", dict(norm="layer", zoneout_h=0.1), "cannot run this call: zoneout"),
        ("loop", dict(norm="layer", observed=True), "cannot run this call: an observer is hooked to cells[0]"),
        ("kernel", dict(norm="batch", first_step=2), "first_step=2 with per-timestep statistics"),
    ],
    ids=["torch_kernel-normalized", "kernel-zoneout", "loop-observed", "kernel-first_step"],
)
def test_a_pinned_path_that_cannot_run_the_call_says_why(pinned: str, layer: dict, why: str) -> None:
    options = dict(layer)
    observed, first_step = options.pop("observed", False), options.pop("first_step", 0)
    lstm = seqnorm.LSTM(3, 5, impl=pinned, **options)  # type: ignore[arg-type]
    if observed:
        lstm.cells[0].observer.register_forward_hook(lambda *args: None)
    with pytest.raises(ValueError, match=r"^LSTM: impl='\w+' cannot run this call: ") as error:
        lstm(torch.randn(4, 2, 3), first_step=first_step)
    assert why in str(error.value) and str(error.value).endswith("here")  # and what impl='auto' runs
