"""The public surface as torch users read it: the ``step`` rule of cells, precise types, real ``forward`` docstrings."""

from __future__ import annotations

import inspect
import typing

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrize import type_before_parametrizations
from torch.testing import assert_close

import seqnorm
from seqnorm.init import INITS, InitName
from seqnorm.norms import BatchNormSpec, NormName, NormPlacement, NormSpec, Placement, StateNorm, WeightNormSpec
from seqnorm.norms.specs import InputStats
from tests.conftest import CELLS, KINDS, LAYERS, NORMS


def _h(output: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _cells(kind: str) -> list[nn.Module]:
    """A cell of every registered norm, and weight norm with mean-only BN (a per-timestep companion norm)."""
    built = [CELLS[kind](3, 4, norm=norm, max_steps=3) for norm in NORMS]
    return [*built, CELLS[kind](3, 4, norm=WeightNormSpec(mean_only_bn=True), max_steps=3)]


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_step_is_required_exactly_where_statistics_are_per_timestep(kind: str, training: bool) -> None:
    for cell in _cells(kind):
        cell.train(training)
        name, x = type_before_parametrizations(cell).__name__, torch.randn(5, 3)  # weight norm's too: the cell
        buffers = {key: value.clone() for key, value in cell.state_dict().items()}
        mean_only = getattr(cell.norm_spec, "mean_only_bn", False)
        assert cell.indexed_by_step == (cell.scheme.batch_statistics or mean_only), cell.norm
        if cell.indexed_by_step:
            message = rf"^{name}: expected step=<time index> \(norm='{cell.norm}' keeps statistics per time step"
            with pytest.raises(ValueError, match=message + r".*got none$"):
                cell(x)
            for key, value in cell.state_dict().items():  # the refused call updated no running statistic
                assert torch.equal(value, buffers[key]), key
            cell(x, step=2)  # given, it runs
        else:  # the same function at every step: no step is step 0, and any other step too
            assert_close(_h(cell(x)), _h(cell(x, step=0)), rtol=0, atol=0)
            assert_close(_h(cell(x)), _h(cell(x, step=9)), rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_layers_and_their_stepping_give_the_step_themselves(kind: str) -> None:
    layer = LAYERS[kind](3, 4, norm="batch", max_steps=3)
    output, _ = layer(torch.randn(5, 2, 3))
    stepped, state = layer.step(torch.randn(2, 3))
    assert output.shape == (5, 2, 4) and stepped.shape == (2, 4) and state.step == 1


def test_choices_are_literals_equal_to_the_registries() -> None:
    assert typing.get_args(NormName) == tuple(seqnorm.NORMS)
    assert set(typing.get_args(InitName)) >= set(INITS)
    for name in typing.get_args(InitName):  # aliases included: every choice resolves
        seqnorm.LSTMCell(2, 3, init=name)
    defaults = Placement()
    assert typing.get_args(NormPlacement)[0] == defaults.norm_placement
    assert typing.get_args(StateNorm)[0] == defaults.state_norm


@pytest.mark.parametrize("cls", [*CELLS.values(), *LAYERS.values()], ids=lambda cls: cls.__name__)
def test_constructor_types_are_the_choices(cls: type) -> None:
    hints = typing.get_type_hints(cls.__init__)
    assert hints["norm"] == NormName | NormSpec and hints["init"] == InitName
    # the norm's choices are typed on its spec, where they are set
    expected = {"norm_placement": NormPlacement, "state_norm": StateNorm, "input_stats": InputStats}
    for name, hint in expected.items():
        assert typing.get_type_hints(BatchNormSpec)[name] == hint, name


@pytest.mark.parametrize("cls", [*CELLS.values(), *LAYERS.values()], ids=lambda cls: cls.__name__)
def test_forward_has_its_own_docstring_with_shapes(cls: type) -> None:
    doc = inspect.getdoc(cls.forward)
    assert doc is not None and doc != inspect.getdoc(nn.Module.forward)
    for section in ("Args:", "Returns:", "Raises:"):
        assert section in doc, section
    parameters = [name for name in inspect.signature(cls.forward).parameters if name != "self"]
    for name in parameters:  # every argument is documented
        assert f"\n    {name}: " in doc, name
    assert "(B, input_size)" in doc or "(L, N, H_in)" in doc
    hints = typing.get_type_hints(cls.forward)
    assert hints["return"] is not typing.Any
