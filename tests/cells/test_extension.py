"""A cell and a norm defined here, outside the library: the plan runs what they declare, and they train on it.

The regression this guards: a 3-gate cell without cell state under ``norm="none"`` used to run torch's GRU kernel
(it only resembled a GRU by its state shape), off by up to 0.48 from its own reference loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

import seqnorm
from seqnorm.cells.gated import GatedCell
from seqnorm.layers import RecurrentLayer
from seqnorm.norms import NORMS, NormScheme, NormSpec
from tests.conftest import CELLS, LAYERS, TORCH_KINDS

TOLERANCE = {"rtol": 1e-9, "atol": 1e-9}


class GatedUnitCell(GatedCell):
    """A minimal-gated-unit style cell: ``f = σ(a_f + u_f)``, ``o = σ(a_o + u_o)``, ``n = tanh(a_n + f u_n)``,
    ``h' = f h + (1 - f) o n``. Three gate blocks and no cell state, like a GRU, but not a GRU."""

    num_gates = 3
    has_cell_state = False

    def initial_state(self, batch_size: int, like: Tensor) -> Tensor:
        return like.new_zeros(batch_size, self.hidden_size)

    def forward(self, x: Tensor, state: Tensor | None = None, *, step: int = 0, mask: Tensor | None = None) -> Tensor:
        return self.step_unchecked(x, self.initial_state(x.shape[0], x) if state is None else state, step, mask)

    def step_terms(self, x: Tensor | None, state: Tensor, step: int, mask: Tensor | None, **terms: Any) -> Tensor:
        input_term, recurrent_term = self.gate_terms(x, self.recurrent_input(state), step, mask, None, **terms)
        return self._mix(input_term, recurrent_term, state, mask)

    def _mix(self, a: Tensor, u: Tensor, h_prev: Tensor, mask: Tensor | None) -> Tensor:
        a_f, a_o, a_n = a.chunk(3, dim=1)
        u_f, u_o, u_n = u.chunk(3, dim=1)
        f, o = torch.sigmoid(a_f + u_f), torch.sigmoid(a_o + u_o)
        h = f * h_prev + (1 - f) * o * torch.tanh(a_n + f * u_n)
        return h if mask is None else torch.where(mask.unsqueeze(1), h, h_prev)


class HoistedGatedUnitCell(GatedUnitCell):
    """The same cell with the hoisted step written out, and declared: the plan may run the loop for it."""

    hoisted_step = True

    def folded_bias(self) -> Tensor | None:
        return self.bias_ih  # b_hh stays with the recurrent term: its candidate part is gated by f

    def recurrent_step(self, input_term: Tensor, state: Tensor, step: int, mask: Tensor | None, *args: Any) -> Tensor:
        weight_hh_t = args[1]
        recurrent = torch.mm(state, weight_hh_t)
        if self.norm_hh is not None:
            recurrent = self.norm_hh.forward_step(recurrent, step, mask)
        if self.bias_hh is not None:
            recurrent = recurrent + self.bias_hh
        return self._mix(input_term, recurrent, state, mask)


class GatedUnit(RecurrentLayer):
    cell_class = GatedUnitCell


class HoistedGatedUnit(RecurrentLayer):
    cell_class = HoistedGatedUnitCell


class ScaleNorm(nn.Module):
    """``γ x sqrt(F) / ||x||`` per row (Nguyen & Salazar 2019): a norm the library has never heard of."""

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.num_features, self.eps = num_features, eps
        self.weight = nn.Parameter(torch.ones(num_features))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor, step: int = 0, mask: Tensor | None = None) -> Tensor:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True) / self.num_features**0.5
        return self.weight * x / (norm + self.eps)


class LoopScaleNorm(ScaleNorm):
    """ScaleNorm with its per-step and whole-sequence forms, declared: good for the hoisted loop."""

    fast_forms: ClassVar[frozenset[str]] = frozenset({"loop"})

    def forward_step(self, x: Tensor, step: int = 0, mask: Tensor | None = None) -> Tensor:
        return self.forward(x)

    def forward_sequence(self, x: Tensor, mask: Tensor | None = None, counts: list[int] | None = None) -> Tensor:
        return self.forward(x)


@dataclass(frozen=True, kw_only=True)
class ScaleNormSpec(NormSpec):
    """The toy norm's spec: it has no options."""

    name: ClassVar[str] = "scale"


@dataclass(frozen=True, kw_only=True)
class LoopScaleNormSpec(NormSpec):
    name: ClassVar[str] = "scale_loop"


@pytest.fixture
def toy_norms() -> Iterator[None]:
    """A new norm is a module, a spec and one registry entry (``seqnorm.norms.NORMS``)."""
    added = {
        "scale": NormScheme("scale", ScaleNormSpec, lambda features, role, ctx: ScaleNorm(features)),
        "scale_loop": NormScheme("scale_loop", LoopScaleNormSpec, lambda features, role, ctx: LoopScaleNorm(features)),
    }
    NORMS.update(added)
    yield
    for name in added:
        del NORMS[name]


def _inputs(batch: int = 4) -> Tensor:
    return torch.randn(6, batch, 3, dtype=torch.float64)


def test_an_undeclared_three_gate_cell_runs_its_own_step_not_torchs_gru() -> None:
    layer = GatedUnit(3, 5, dtype=torch.float64)
    x = _inputs()
    plan = layer.plan(x)
    assert plan.path == "reference"
    assert "GatedUnitCell declares no" in plan.reason
    cell, h, expected = layer.cells[0], x.new_zeros(4, 5), []
    for x_t in x:
        h = cell(x_t, h)
        expected.append(h)
    output, h_n = layer(x)
    assert_close(output, torch.stack(expected), **TOLERANCE)
    assert_close(h_n[0], h, **TOLERANCE)
    for no_grad in (False, True):
        with torch.set_grad_enabled(not no_grad):
            assert layer.plan(x[0]).path == "reference"
            step_output, state = layer.step(x[0])
        assert_close(step_output, cell(x[0]), **TOLERANCE)
        assert state.c is None


def test_a_subclass_inherits_no_claim_unless_it_restates_it() -> None:
    class Peephole(seqnorm.LSTMCell):  # changes the step: must not run torch's LSTM kernel
        def step_unchecked(self, x: Tensor, state: Any, step: int, mask: Tensor | None) -> Any:
            h, c = super().step_unchecked(x, state, step, mask)
            return h + 0.1 * c, c

    class Renamed(seqnorm.LSTMCell):  # same math, says so
        torch_kernel = "lstm"
        hoisted_step = True

    x = _inputs()
    for cell_class, path in ((Peephole, "reference"), (Renamed, "torch_kernel")):
        layer = type("Layer", (RecurrentLayer,), {"cell_class": cell_class})(3, 5, dtype=torch.float64)
        assert layer.plan(x).path == path


@pytest.mark.usefixtures("toy_norms")
@pytest.mark.parametrize(
    ("layer_class", "norm", "path"),
    [
        (GatedUnit, "none", "reference"),
        (GatedUnit, "scale", "reference"),
        (HoistedGatedUnit, "none", "loop"),
        (HoistedGatedUnit, "scale", "reference"),  # the norm declares no loop form
        (HoistedGatedUnit, "scale_loop", "loop"),
        *((LAYERS[kind], "scale", "reference") for kind in TORCH_KINDS),
        *((LAYERS[kind], "scale_loop", "loop") for kind in TORCH_KINDS),  # no kernel form: not the kernels
    ],
)
def test_toys_follow_their_plan_equal_the_reference_and_train(layer_class: type, norm: str, path: str) -> None:
    torch.manual_seed(1)
    fast = layer_class(3, 5, num_layers=2, norm=norm, dtype=torch.float64)
    reference = layer_class(3, 5, num_layers=2, norm=norm, impl="reference", dtype=torch.float64)
    reference.load_state_dict(fast.state_dict())
    x, lengths = _inputs(), torch.tensor([6, 3, 5, 6])
    assert fast.plan(x, lengths=lengths).path == path
    assert_close(fast(x, lengths=lengths), reference(x, lengths=lengths), **TOLERANCE)
    for layer in (fast, reference):  # every path the plan claims, and the reference
        head = nn.Linear(5, 1, dtype=torch.float64)
        optimizer = torch.optim.Adam([*layer.parameters(), *head.parameters()], lr=3e-2)
        target = torch.randn(4, 1, dtype=torch.float64)
        losses = []
        for _ in range(20):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(head(layer(x, lengths=lengths)[1][-1]), target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_the_library_cells_keep_their_paths(kind: str) -> None:
    x = torch.randn(5, 3, 4)
    plain, normed = LAYERS[kind](4, 6), LAYERS[kind](4, 6, norm="layer")
    assert plain.plan(x).path == "torch_kernel"
    assert LAYERS[kind](4, 6, norm="layer", impl="reference").plan(x).path == "reference"
    assert plain.plan(x[0]).path == "torch_kernel"
    assert normed.plan(x[0]).path == "reference"
    with seqnorm.kernels.disabled():  # the plain-PyTorch paths (tests/kernels/test_kernels.py: the compiled ones)
        assert normed.plan(x).path == "loop"
        assert normed.plan(x).cells == ("loop",)
        with torch.no_grad():
            assert normed.plan(x).path == "loop"
            assert normed.plan(x[0]).path == "lean_step"
            assert normed.plan(x[0]).cells == ("lean_step",)
    assert CELLS[kind].torch_kernel == kind
    assert str(plain.plan(x)).startswith(f"torch_kernel: {CELLS[kind].__name__} declares torch_kernel={kind!r}")


def test_a_scheme_is_registered_under_its_specs_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # another name built the norm its spec's name registered, silently (or refused the spec as unregistered)
    with pytest.raises(ValueError, match=r"^NormScheme: expected name to be its spec's name, ScaleNormSpec.name = "):
        NormScheme("scale2", ScaleNormSpec, lambda features, role, ctx: ScaleNorm(features))
    monkeypatch.setitem(NORMS, "scale2", NormScheme("scale", ScaleNormSpec, lambda f, r, c: ScaleNorm(f)))
    with pytest.raises(ValueError, match=r"^LSTM: expected seqnorm.NORMS\['scale2'\] to be registered under its own"):
        seqnorm.LSTM(3, 4, norm="scale2")


@dataclass(frozen=True, kw_only=True)
class PlacedScaleNormSpec(NormSpec):
    """A spec of one's own with the placement switches as fields, without the built-in specs' check of them."""

    name: ClassVar[str] = "scale_placed"
    norm_placement: str = "separate"
    state_norm: str = "output"


@pytest.mark.parametrize(("switch", "value"), [("norm_placement", "bogus"), ("state_norm", "kept"), ("state_norm", 1)])
def test_a_placement_switch_of_a_custom_spec_is_checked(monkeypatch: pytest.MonkeyPatch, switch: str, value) -> None:
    # any value ran as the default ("separate", "output"), and the cell reported the value given
    build = lambda features, role, ctx: ScaleNorm(features)  # noqa: E731
    monkeypatch.setitem(NORMS, "scale_placed", NormScheme("scale_placed", PlacedScaleNormSpec, build))
    with pytest.raises(ValueError, match=rf"^LSTM: expected {switch} to be one of .*, got {value!r}$"):
        seqnorm.LSTM(3, 4, norm=PlacedScaleNormSpec(**{switch: value}))
    assert seqnorm.LSTM(3, 4, norm=PlacedScaleNormSpec(norm_placement="joint")).cells[0].norm_placement == "joint"
