"""A norm written here, outside the library, that implements :class:`~seqnorm.norms.protocol.StepPieces` and declares
every fast form: the plan runs it on the hand-written BPTT and the lean generation step, and both equal the reference
loop (float64, 1e-9) and pass gradcheck. Nothing in ``seqnorm.layers`` knows this norm."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor, nn
from torch.autograd import gradcheck
from torch.testing import assert_close

from seqnorm.norms.protocol import NormCall, StepPieces
from tests.conftest import LAYERS, TORCH_KINDS

TOLERANCE = {"rtol": 1e-9, "atol": 1e-9}


class PiecesScaleNorm(nn.Module):
    """ScaleNorm (Nguyen & Salazar 2019), ``γ x / (||x|| / sqrt(F) + eps)`` per row, with every form's pieces."""

    fast_forms: ClassVar[frozenset[str]] = frozenset({"loop", "bptt", "generation"})

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.num_features, self.eps, self.bias = num_features, eps, None
        self.weight = nn.Parameter(torch.empty(num_features, dtype=torch.float64).uniform_(0.5, 1.5))

    def _scale(self, x: Tensor) -> Tensor:
        return 1.0 / (torch.linalg.vector_norm(x, dim=-1, keepdim=True) / self.num_features**0.5 + self.eps)

    def forward(self, x: Tensor, step: int = 0, mask: Tensor | None = None) -> Tensor:
        return self.weight * x * self._scale(x)

    def forward_step(self, x: Tensor, step: int = 0, mask: Tensor | None = None) -> Tensor:
        return self.forward(x)

    def forward_sequence(self, x: Tensor, mask: Tensor | None = None, counts: list[int] | None = None) -> Tensor:
        return self.forward(x)

    def bptt_step(
        self, x: Tensor, step: int, mask: Any, count: int, weight: Tensor, shift: Any, call: NormCall
    ) -> Tensor:
        scale = self._scale(x)
        call.keep(scales=scale)
        y = x * scale * weight
        return y if shift is None else y + shift

    def bptt_finish(self, call: NormCall) -> None:
        pass

    def bptt_backward(
        self, dy: Tensor, x: Tensor, step: int, mask: Any, count: int, weight: Tensor, shift: Any, call: NormCall
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        scale = call.steps["scales"][step]
        scaled = dy * weight
        # d(scale)/dx = -scale^2 x / (||x|| sqrt(F)), with ||x|| = (1/scale - eps) sqrt(F); at x = 0 (h_0 = 0) the
        # term is 0, as autograd's subgradient of the norm.
        length = ((1.0 / scale - self.eps) * self.num_features).clamp_min(torch.finfo(x.dtype).tiny)
        dx = scaled * scale - x * (scale.square() * (scaled * x).sum(1, keepdim=True) / length)
        return dx, (dy * x * scale).sum(0), None if shift is None else dy.sum(0)

    def bptt_normalized(self, x: Tensor, features: slice, call: NormCall) -> Tensor:
        return x * call.stacked["scales"]

    def generation_step(self, shift: Tensor | None) -> Callable[[Tensor, int], Tensor]:
        def scale_norm(y: Tensor, step: int) -> Tensor:
            out = self.forward(y)
            return out if shift is None else out + shift

        return scale_norm


def _layer(kind: str, **kwargs: Any) -> nn.Module:
    """A layer whose every norm is the toy (built with RMSNorm's slots, then swapped: no registry involved)."""
    torch.manual_seed(0)
    layer = LAYERS[kind](3, 4, norm="rms", dtype=torch.float64, **kwargs)
    for cell in layer.cells:
        for role in ("norm_ih", "norm_hh", "norm_c"):
            if getattr(cell, role, None) is not None:
                setattr(cell, role, PiecesScaleNorm(getattr(cell, role).num_features))
    return layer


def _pair(kind: str) -> tuple[nn.Module, nn.Module]:
    fast = _layer(kind)
    reference = _layer(kind, impl="reference")
    reference.load_state_dict(fast.state_dict())
    return reference, fast


def test_the_toy_implements_the_protocol() -> None:
    assert isinstance(PiecesScaleNorm(3), StepPieces)


@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_bptt_equals_the_reference(kind: str) -> None:
    reference, fast = _pair(kind)
    x, lengths = torch.randn(5, 3, 3, dtype=torch.float64), torch.tensor([5, 2, 4])
    assert fast.plan(x.requires_grad_(), lengths=lengths).path == "bptt"
    results = []
    for layer in (reference, fast):
        inputs = x.detach().clone().requires_grad_()
        output, state = layer(inputs, lengths=lengths)
        flat = [output, *(state if isinstance(state, tuple) else (state,))]
        loss = sum((t * torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view_as(t)).sum() for t in flat)
        results.append([output, *flat[1:], *torch.autograd.grad(loss, [inputs, *layer.parameters()])])
    assert_close(results[1], results[0], **TOLERANCE)


@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_gradcheck_through_the_bptt_function(kind: str) -> None:
    layer = _layer(kind)
    names = [name for name, _ in layer.named_parameters()]
    params = [param.detach().clone().requires_grad_() for param in layer.parameters()]
    x = torch.randn(4, 3, 3, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([4, 2, 4])
    assert layer.plan(x, lengths=lengths).path == "bptt"

    def run(x: Tensor, *parameters: Tensor) -> tuple[Tensor, ...]:
        output, _ = torch.func.functional_call(
            layer, dict(zip(names, parameters, strict=True)), (x,), {"lengths": lengths}
        )
        return (output,)

    assert gradcheck(run, (x, *params), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_generation_step_equals_the_reference_step(kind: str) -> None:
    reference, fast = _pair(kind)
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    with torch.no_grad():
        assert fast.plan(x[0]).path == "lean_step"
        states: list[Any] = [None, None]
        for x_t in x.unbind(0):
            out_ref, states[0] = reference.step(x_t, states[0])
            out_fast, states[1] = fast.step(x_t, states[1])
            assert_close(out_fast, out_ref, **TOLERANCE)
    assert_close(tuple(states[1]), tuple(states[0]), **TOLERANCE)
