"""A cell is a step: an IndRNN cell defined here, with a diagonal recurrent weight and no dense ``W_hh``, runs
through the library's layers (stacked, bidirectional, ``lengths``, packed, ``step``) on the reference path.

It defines its own parameters (:meth:`RecurrentCell.build`), their initialization and its step, nothing else, and is
judged against a loop of the same math written out by hand, trained on a task it must learn, and gradchecked.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.utils.rnn import pack_padded_sequence
from torch.testing import assert_close

import seqnorm

TOLERANCE = {"rtol": 1e-9, "atol": 1e-9}
EPS = 1e-5  # LayerNorm's default epsilon, as the hand-written loop uses it


class IndRNNCell(seqnorm.RecurrentCell):
    r"""IndRNN (Li et al. 2018): each unit recurs only on itself, through a weight vector rather than a matrix.

    .. math:: h' = \mathrm{relu}(N(W_{ih} x) + b_{ih} + w_{hh} \odot h + b_{hh})

    ``weight_ih`` ``(H, I)``, ``weight_hh`` ``(H,)``; ``N`` is the ``norm=`` of the registry on the ``H`` input
    features (the identity for ``"none"``).
    """

    def build(self, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        hidden = self.hidden_size
        self.weight_ih = nn.Parameter(torch.empty(hidden, self.input_size, device=device, dtype=dtype))
        self.weight_hh = nn.Parameter(torch.empty(hidden, device=device, dtype=dtype))
        self.bias_ih = nn.Parameter(torch.empty(hidden, device=device, dtype=dtype)) if self.bias else None
        self.bias_hh = nn.Parameter(torch.empty(hidden, device=device, dtype=dtype)) if self.bias else None
        self.norm_ih = self.build_norm(hidden, "input", device, dtype)

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.hidden_size)
        for parameter in (self.weight_ih, self.bias_ih, self.bias_hh):
            if parameter is not None:
                nn.init.uniform_(parameter, -bound, bound)
        nn.init.uniform_(self.weight_hh, 0.0, 1.0)  # |w| <= 1: no unit's state grows without bound
        super().reset_parameters()

    def step_unchecked(
        self,
        x: Tensor | None,
        state: Tensor,
        step: int,
        mask: Tensor | None,
        recurrent_mask: Tensor | None = None,
        weight_hh: Tensor | None = None,
        input_normed: Tensor | None = None,
        *,
        input_term: Tensor | None = None,
    ) -> Tensor:
        h_prev = state
        h_in = h_prev if recurrent_mask is None else h_prev * recurrent_mask
        term = F.linear(x, self.weight_ih)  # type: ignore[arg-type]
        if self.norm_ih is not None:
            term = self.norm_ih(term, step, mask)  # the mask keeps padded rows out of batch statistics
        if self.bias_ih is not None:
            term = term + self.bias_ih + self.bias_hh
        recurrent = self.weight_hh if weight_hh is None else weight_hh
        return self.settle(torch.relu(term + recurrent * h_in), h_prev, mask, self.zoneout_h)


class IndRNN(seqnorm.RecurrentLayer):
    cell_class = IndRNNCell


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


def test_it_trains_through_the_layers_to_count_its_inputs() -> None:
    """Regress the fraction of 1s among each sequence's real tokens (lengths 3..10, one-hot inputs) from the last
    layer's final states: 150 Adam steps bring the error under 5% of predicting the mean fraction (measured 2.0%,
    0.8% and 1.5% of it at seeds 0, 1 and 2)."""
    torch.manual_seed(0)
    layer = IndRNN(2, 16, num_layers=2, bidirectional=True, norm="layer")
    head = nn.Linear(2 * 16, 1)
    optimizer = torch.optim.Adam([*layer.parameters(), *head.parameters()], lr=1e-2)
    tokens, lengths = torch.randint(0, 2, (10, 64)), torch.randint(3, 11, (64,))
    real = torch.arange(10).unsqueeze(1) < lengths  # (T, B)
    target = ((tokens * real).sum(0) / lengths).unsqueeze(1)  # (B, 1)
    x = F.one_hot(tokens, 2).float()  # (T, B, 2); the padding is zeroed by the layer, as any padding
    baseline = F.mse_loss(target.mean().expand_as(target), target).item()
    for _ in range(150):
        optimizer.zero_grad()
        _, h_n = layer(x, lengths=lengths)
        loss = F.mse_loss(head(torch.cat([h_n[-2], h_n[-1]], dim=1)), target)
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05 * baseline, (loss.item(), baseline)


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


def test_hidden_state_stats_refuses_it_by_name() -> None:
    # the callback's statistics read the gate blocks a GatedCell has: a clear error, not an AttributeError mid-run
    from seqnorm.callbacks.observe import find_cells

    with pytest.raises(
        ValueError, match=r"^HiddenStateStats: expected cells with gate blocks .* got IndRNNCell at 'l0'$"
    ):
        find_cells(IndRNN(3, 4, norm="layer"))
