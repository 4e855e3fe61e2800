"""A cell is a step: the IndRNN cell of ``examples/custom_cell.py`` (shipped for users to copy), with a diagonal
recurrent weight and no dense ``W_hh``, runs through the library's layers (stacked, bidirectional, ``lengths``,
packed, ``step``) on the reference path.

It defines its own parameters (:meth:`RecurrentCell.build`), their initialization and its step, nothing else, and is
judged against a loop of the same math written out by hand and gradchecked; the example itself trains it on a task
it must learn (tests/test_examples.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.func import functional_call
from torch.nn.utils.rnn import pack_padded_sequence
from torch.testing import assert_close

import seqnorm
from examples.custom_cell import IndRNN, IndRNNCell

TOLERANCE = {"rtol": 1e-9, "atol": 1e-9}
EPS = 1e-5  # LayerNorm's default epsilon, as the hand-written loop uses it


def _by_hand(layer: IndRNN, x: Tensor, lengths: list[int]) -> tuple[Tensor, Tensor]:
    """The same network written out: each sequence alone, over its real steps only, every layer and direction (a
    reverse direction reads the real part backwards); padded outputs are zero. Returns ``output``, ``h_n``."""
    directions = 2 if layer.bidirectional else 1
    output = x.new_zeros(x.shape[0], x.shape[1], directions * layer.hidden_size)
    h_n = x.new_zeros(layer.num_layers * directions, x.shape[1], layer.hidden_size)
    for row, length in enumerate(lengths):
        inputs = x[:length, row]  # (T_b, I)
        for depth in range(layer.num_layers):
            outputs = []
            for direction in range(directions):
                suffix = f"_l{depth}" + ("_reverse" if direction else "")
                w_ih, w_hh = getattr(layer, "weight_ih" + suffix), getattr(layer, "weight_hh" + suffix)
                b = getattr(layer, "bias_ih" + suffix) + getattr(layer, "bias_hh" + suffix)
                gamma = None if layer.norm == "none" else getattr(layer, "norm_ih" + suffix).weight
                h = x.new_zeros(layer.hidden_size)
                states = []
                for x_t in inputs if direction == 0 else inputs.flip(0):
                    a = w_ih @ x_t
                    if gamma is not None:
                        a = gamma * (a - a.mean()) / torch.sqrt(a.var(unbiased=False) + EPS)
                    h = torch.relu(a + b + w_hh * h)
                    states.append(h)
                h_n[depth * directions + direction, row] = h
                stacked = torch.stack(states)
                outputs.append(stacked if direction == 0 else stacked.flip(0))
            inputs = torch.cat(outputs, dim=1)
        output[:length, row] = inputs
    return output, h_n


def test_the_cell_defines_its_parameters_and_no_dense_recurrent_weight() -> None:
    cell = IndRNNCell(3, 5, norm="layer")
    shapes = {name: tuple(parameter.shape) for name, parameter in cell.named_parameters()}
    assert shapes == {"weight_ih": (5, 3), "weight_hh": (5,), "bias_ih": (5,), "bias_hh": (5,), "norm_ih.weight": (5,)}
    assert not isinstance(cell, seqnorm.GatedCell)
    h = cell(torch.randn(2, 3))  # the base's forward: checks, the zero state, then this step
    assert h.shape == (2, 5)
    with pytest.raises(ValueError, match=r"^IndRNNCell: expected h of shape"):
        cell(torch.randn(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"^IndRNNCell: expected a norm this cell applies, got norm='weight'"):
        IndRNNCell(3, 5, norm="weight")  # weight norm would reparametrize weights this cell does not name


@pytest.mark.parametrize("norm", ["none", "layer"])
def test_layers_of_it_equal_the_loop_written_by_hand(norm: str) -> None:
    torch.manual_seed(0)
    layer = IndRNN(3, 4, num_layers=2, bidirectional=True, norm=norm, dtype=torch.float64)
    x, lengths = torch.randn(6, 4, 3, dtype=torch.float64), [6, 2, 5, 1]
    plan = layer.plan(x, lengths=lengths)
    assert plan.path == "reference" and "IndRNNCell declares no hoisted_step" in plan.reason, plan
    expected_output, expected_h_n = _by_hand(layer, x, lengths)
    output, h_n = layer(x, lengths=lengths)
    assert_close(output, expected_output, **TOLERANCE)
    assert_close(h_n, expected_h_n, **TOLERANCE)
    packed = pack_padded_sequence(x, torch.tensor(lengths), enforce_sorted=False)
    packed_output, packed_h_n = layer(packed)
    expected_packed = pack_padded_sequence(expected_output, torch.tensor(lengths), enforce_sorted=False)
    assert_close(packed_output.data, expected_packed.data, **TOLERANCE)
    assert_close(packed_h_n, expected_h_n, **TOLERANCE)
    # torch's state-dict keys, and the layer loads them back into a fresh copy that computes the same
    copy = IndRNN(3, 4, num_layers=2, bidirectional=True, norm=norm, dtype=torch.float64)
    copy.load_state_dict(layer.state_dict())
    assert layer.state_dict()["weight_hh_l1_reverse"].shape == (4,)
    assert_close(copy(x, lengths=lengths)[0], expected_output, **TOLERANCE)


def test_stepping_a_layer_of_it_continues_its_forward() -> None:
    torch.manual_seed(1)
    layer = IndRNN(3, 4, num_layers=2, norm="layer", dtype=torch.float64)
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    output, h_n = layer(x)
    state = None
    for grad in (True, False):  # the cells' own steps, with and without autograd
        with torch.set_grad_enabled(grad):
            assert layer.plan(x[0]).path == "reference"
            for t in range(5):
                stepped, state = layer.step(x[t], state)
                assert_close(stepped, output[t], **TOLERANCE)
        assert_close(state.h, h_n, **TOLERANCE)
        state = None


def test_gradients_through_the_layers_pass_gradcheck() -> None:
    torch.manual_seed(2)
    layer = IndRNN(2, 3, num_layers=2, bidirectional=True, norm="layer", dtype=torch.float64)
    names = [name for name, _ in layer.named_parameters()]
    x, lengths = torch.randn(4, 3, 2, dtype=torch.float64, requires_grad=True), torch.tensor([4, 2, 3])

    def run(x: Tensor, *parameters: Tensor) -> tuple[Tensor, Tensor]:
        return functional_call(layer, dict(zip(names, parameters, strict=True)), (x,), {"lengths": lengths})

    parameters = [parameter.detach().clone().requires_grad_() for parameter in layer.parameters()]
    assert torch.autograd.gradcheck(run, (x, *parameters))


def test_weight_dropout_drops_entries_of_the_diagonal() -> None:
    """The layers' DropConnect acts on whatever ``weight_hh`` a cell has: here the ``(H,)`` diagonal, one mask per
    sequence, which the cell's step takes in place of its own."""
    torch.manual_seed(3)
    layer = IndRNN(3, 4, weight_dropout=0.5, dtype=torch.float64)
    x, lengths = torch.randn(5, 2, 3, dtype=torch.float64), [5, 3]
    torch.manual_seed(4)
    output, _ = layer(x, lengths=lengths)
    torch.manual_seed(4)
    mask = torch.bernoulli(torch.full_like(layer.weight_hh_l0, 0.5)) / 0.5  # the draw draw_sequence_masks makes
    with torch.no_grad():
        layer.weight_hh_l0.mul_(mask)
    assert_close(output, _by_hand(layer, x, lengths)[0], **TOLERANCE)


def test_recurrent_dropout_reaches_the_cells_step() -> None:
    """A custom cell took the recurrent mask as its fifth argument and had to apply it itself; a cell that did not
    lost the layer's recurrent dropout silently. The step now asks ``self.recurrent_input(h)``: the mask is drawn
    once per sequence and multiplies the state where it enters the recurrence (the carried state is not dropped)."""
    torch.manual_seed(5)
    layer = IndRNN(3, 4, recurrent_dropout=0.5, norm="layer", dtype=torch.float64)
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    torch.manual_seed(6)
    output, _ = layer(x)
    torch.manual_seed(6)
    mask = torch.bernoulli(torch.full((2, 4), 0.5, dtype=torch.float64)) / 0.5  # draw_sequence_masks's first draw
    cell, h, expected = layer.cells[0], x.new_zeros(2, 4), []
    for x_t in x:
        h = torch.relu(cell.norm_ih(x_t @ cell.weight_ih.T) + cell.bias_ih + cell.bias_hh + cell.weight_hh * h * mask)
        expected.append(h)
    assert_close(output, torch.stack(expected), **TOLERANCE)
    assert not torch.equal(output, layer.eval()(x)[0])  # in evaluation nothing is dropped


class _OwnWeightsCell(IndRNNCell):
    """The IndRNN step reading its state and ``weight_hh`` directly, as a cell written before the contract did."""

    def step_unchecked(self, x: Tensor, state: Tensor, step: int, mask: Tensor | None) -> Tensor:
        term = self.norm_ih(x @ self.weight_ih.T, step, mask) + self.bias_ih + self.bias_hh
        return self.settle(torch.relu(term + self.weight_hh * state), state, mask)


@pytest.mark.parametrize(
    ("option", "said"),
    [("recurrent_dropout", "self.recurrent_input(h)"), ("weight_dropout", "self.recurrent_weight()")],
)
def test_a_cell_that_never_asks_for_a_drawn_regularizer_is_refused_not_run_without_it(option: str, said: str) -> None:
    layer_class = type("OwnWeights", (seqnorm.RecurrentLayer,), {"cell_class": _OwnWeightsCell})
    layer = layer_class(3, 4, norm="layer", **{option: 0.3})
    x = torch.randn(5, 2, 3)
    with pytest.raises(ValueError, match=r"^OwnWeights: _OwnWeightsCell's step_unchecked\(\) never used ") as error:
        layer(x)
    assert option in str(error.value) and said in str(error.value)
    assert layer.eval()(x)[0].shape == (5, 2, 4)  # nothing drawn in evaluation: it runs


def test_hidden_state_stats_refuses_it_by_name() -> None:
    # the callback's statistics read the gate blocks a GatedCell has: a clear error, not an AttributeError mid-run
    from seqnorm.callbacks.observe import find_cells

    with pytest.raises(
        ValueError, match=r"^HiddenStateStats: expected cells with gate blocks .* got IndRNNCell at 'l0'$"
    ):
        find_cells(IndRNN(3, 4, norm="layer"))


def test_an_observer_hooked_to_the_cell_sees_every_step() -> None:
    """The observer is the supported way to watch every step, and hooking it moved the layer to the reference
    loop; but a cell of one's own builds no record, and the hook was never called."""
    torch.manual_seed(0)
    layer = IndRNN(3, 4, norm="layer")
    records: list[dict] = []
    layer.cells[0].observer.register_forward_hook(lambda module, args, output: records.append(args[0]))
    x, lengths = torch.randn(5, 2, 3), torch.tensor([5, 3])
    output, _ = layer(x, lengths=lengths)
    assert [record["step"] for record in records] == [0, 1, 2, 3, 4]
    assert torch.equal(torch.stack([record["h"] for record in records])[:, 0], output[:, 0])
    assert records[4]["mask"].tolist() == [True, False]
    layer.cells[0](x[0], step=0)  # the cell called directly
    assert len(records) == 6
