"""The lean generation step (seqnorm/layers/stepping.py): the same steps as the reference, and a cache that follows."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from seqnorm import kernels
from seqnorm.layers import stepping
from seqnorm.layers.stepping import lean_layer_step
from seqnorm.norms import LayerNormSpec
from tests.conftest import LAYERS, NORMS, TORCH_KINDS, perturb_norm_parameters

TOLERANCE = {"rtol": 1e-12, "atol": 1e-12}


@pytest.fixture(autouse=True, params=["compiled", "plain"])
def lean_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test on both forms of the lean step: the compiled kernels' (where they are built) and the plain-PyTorch
    one that runs without a compiler."""
    if request.param == "compiled" and kernels.native("cpu") is None:
        pytest.skip(f"the compiled kernels are not loaded: {kernels.status()}")
    with contextlib.nullcontext() if request.param == "compiled" else kernels.disabled():
        yield request.param


def _pair(kind: str, norm: str, max_steps: int = 3, **kwargs: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    reference = LAYERS[kind](3, 4, norm=norm, impl="reference", dtype=torch.float64, max_steps=max_steps, **kwargs)
    perturb_norm_parameters(reference)
    lean = LAYERS[kind](3, 4, norm=norm, dtype=torch.float64, max_steps=max_steps, **kwargs)
    lean.load_state_dict(reference.state_dict())
    return reference.eval(), lean.eval()


def _steps(layer: torch.nn.Module, x: torch.Tensor, state: Any = None) -> tuple[torch.Tensor, Any]:
    outputs = []
    for x_t in x.unbind(0):
        output, state = layer.step(x_t, state)
        outputs.append(output)
    return torch.stack(outputs), state


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_lean_step_equals_reference_step(kind: str, norm: str) -> None:
    """Two layers, batch 1, more steps than max_steps (per-timestep BN then reuses its last row)."""
    reference, lean = _pair(kind, norm, num_layers=2)
    x = torch.randn(5, 1, 3, dtype=torch.float64)
    with torch.no_grad():
        assert lean_layer_step(lean, x[0]) is not None  # batch renorm included: in evaluation it is BN
        expected, expected_state = _steps(reference, x)
        got, state = _steps(lean, x)
    assert_close(got, expected, **TOLERANCE)
    assert_close(tuple(state), tuple(expected_state), **TOLERANCE)


@pytest.mark.parametrize("norm", ["batch", "batch_renorm"])
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_batch_norm_rows_are_folded_as_the_steps_reach_them(kind: str, norm: str, lean_path: str) -> None:
    """A cached step folds BN's running statistics a block of rows at a time (FoldedRows): every step reads its own
    row's, across the blocks (8, 16), beyond max_steps (the last row) and from a state that starts at a later step;
    a rebuilt step folds afresh from the statistics as they are then."""
    reference, lean = _pair(kind, norm, max_steps=20)
    x = torch.randn(26, 2, 3, dtype=torch.float64)
    with torch.no_grad():
        for name, buffer in reference.named_buffers():  # statistics of this test's own: no stale fold matches them
            if "running_" in name:
                buffer.uniform_(0.5, 1.5)
        lean.load_state_dict(reference.state_dict())
        assert lean.plan(x[0]).cells == ("kernel" if lean_path == "compiled" else "lean_step",)
        expected, expected_state = _steps(reference, x[:12])
        got, state = _steps(lean, x[:12])
        assert_close(got, expected, **TOLERANCE)
        for layer in (reference, lean):  # new statistics: the rebuilt step must not keep the old folds
            for name, buffer in layer.named_buffers():
                if "running_mean" in name:
                    buffer.add_(0.25)
        assert_close(_steps(lean, x[12:], state)[0], _steps(reference, x[12:], expected_state)[0], **TOLERANCE)
        stepping.forget(lean)
        later = state._replace(step=17)
        assert_close(lean.step(x[0], later)[0], reference.step(x[0], later)[0], **TOLERANCE)


@pytest.mark.parametrize("norm", ["layer", "rms", "weight", "batch", "batch_renorm"])
def test_cache_follows_parameter_updates(norm: str) -> None:
    reference, lean = _pair("lstm", norm)
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    with torch.no_grad():
        _steps(lean, x)  # builds the cache
        for layer in (reference, lean):  # an optimizer-like in-place update of every parameter and buffer
            for tensor in layer.state_dict().values():
                if tensor.is_floating_point():
                    tensor.mul_(0.9)
        assert_close(_steps(lean, x)[0], _steps(reference, x)[0], **TOLERANCE)
        for layer in (reference, lean):  # replaced, not updated in place (weight norm: through its parametrization)
            weight = layer.cells[0].weight_hh.detach() * 1.5
            layer.cells[0].weight_hh = weight if norm == "weight" else torch.nn.Parameter(weight)
        assert_close(_steps(lean, x)[0], _steps(reference, x)[0], **TOLERANCE)


def _update_through_data(layer: torch.nn.Module, factor: float) -> None:
    """A hand-written SGD-like update: through ``.data``, which bumps no version counter."""
    for parameter in layer.parameters():
        parameter.data.mul_(factor)


@pytest.mark.parametrize("norm", ["none", "layer", "rms", "weight", "batch", "batch_renorm"])
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_cache_sees_updates_through_data_after_a_training_step_or_a_mode_switch(kind: str, norm: str) -> None:
    reference, lean = _pair(kind, norm)
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    with torch.no_grad():
        _steps(lean, x)  # builds the cache
    lean(x)[0].sum().backward()  # a training step's forward and backward (in eval: the running statistics stay)
    for layer in (reference, lean):
        _update_through_data(layer, 0.9)
    with torch.no_grad():
        assert_close(_steps(lean, x)[0], _steps(reference, x)[0], **TOLERANCE)
        for layer in (reference, lean):  # edited between generation steps, then eval() as the docs say
            _update_through_data(layer, 1.2)
            layer.eval()
        assert_close(_steps(lean, x)[0], _steps(reference, x)[0], **TOLERANCE)


@pytest.mark.parametrize("norm", ["batch", "batch_renorm"])
def test_lean_step_only_without_gradients_and_batch_norm_only_in_eval(norm: str) -> None:
    layer = LAYERS["gru"](3, 4, norm=norm)
    x = torch.randn(2, 3)
    assert lean_layer_step(layer, x) is None  # gradients enabled
    with torch.no_grad():
        assert lean_layer_step(layer, x) is None  # training: batch statistics, the cell's own step
        layer.eval()
        assert lean_layer_step(layer, x) is not None
        layer.train()
        assert lean_layer_step(layer, x) is None
        handle = layer.cells[0].observer.register_forward_hook(lambda *args: None)
        layer.eval()
        assert lean_layer_step(layer, x) is None  # an observer sees every step of the cell itself
        handle.remove()
        assert lean_layer_step(layer, x) is not None


def test_a_step_plan_without_gradients_says_why_it_is_not_the_lean_step() -> None:
    """It said only "the cells' own steps", where the reason (a norm's missing γ, say) was known and kept back."""
    layer = LAYERS["lstm"](3, 4, norm=LayerNormSpec(affine=False))
    x = torch.randn(2, 3)
    with torch.no_grad():
        assert str(layer.plan(x)) == (
            "reference: the cells' own steps; not the lean step: LayerNorm without γ (affine=False)"
        )
    assert str(layer.plan(x)) == "reference: the cells' own steps"  # with gradients the lean step is not asked


def test_layers_made_in_inference_mode_step_without_the_cache() -> None:
    with torch.inference_mode():
        layer = LAYERS["lstm"](3, 4, norm="layer").eval()
        state = None
        for _ in range(3):
            _, state = layer.step(torch.randn(2, 3), state)
        assert lean_layer_step(layer, torch.randn(2, 3)) is None  # inference tensors have no version counter
    assert state.step == 3
