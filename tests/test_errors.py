"""Bad input is a ValueError worded "<Class>: expected <what>, got <value>", raised where it enters."""

from __future__ import annotations

import pytest
import torch

import seqnorm
from tests.conftest import CELLS, KINDS, LAYERS


@pytest.mark.parametrize("kind", KINDS)
def test_cell_bad_input(kind: str) -> None:
    cell = CELLS[kind](3, 4)
    name = type(cell).__name__
    with pytest.raises(ValueError, match=rf"^{name}: expected input of shape \(batch, 3\), got \(2, 3, 3\)$"):
        cell(torch.randn(2, 3, 3))
    with pytest.raises(ValueError, match=rf"^{name}: expected input of shape \(batch, 3\), got \(2, 5\)$"):
        cell(torch.randn(2, 5))
    with pytest.raises(ValueError, match=rf"^{name}: expected h of shape \(2, 4\), got \(3, 4\)$"):
        cell(torch.randn(2, 3), (torch.zeros(3, 4), torch.zeros(2, 4)) if kind == "lstm" else torch.zeros(3, 4))
    with pytest.raises(ValueError, match=rf"^{name}: expected mask of shape \(2,\) and dtype torch.bool, got \(3,\)"):
        cell(torch.randn(2, 3), mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=rf"^{name}: expected mask .* got \(2,\) torch.int64$"):
        cell(torch.randn(2, 3), mask=torch.ones(2, dtype=torch.long))


def test_lstm_cell_state_must_be_a_pair() -> None:
    cell = seqnorm.LSTMCell(3, 4)
    with pytest.raises(ValueError, match=r"^LSTMCell: expected c of shape \(2, 4\), got \(2, 5\)$"):
        cell(torch.randn(2, 3), (torch.zeros(2, 4), torch.zeros(2, 5)))
    with pytest.raises(ValueError, match=r"^LSTMCell: expected state to be a tuple \(h, c\), got Tensor$"):
        cell(torch.randn(2, 3), torch.zeros(2, 4))


@pytest.mark.parametrize("cls", [seqnorm.LSTMCell, seqnorm.GRUCell, seqnorm.LSTM, seqnorm.GRU])
def test_constructor_errors(cls: type) -> None:
    name = cls.__name__
    with pytest.raises(ValueError, match=rf"^{name}: expected norm to be one of 'none', 'layer', .*, got 'group'$"):
        cls(3, 4, norm="group")
    with pytest.raises(ValueError, match=rf"^{name}: expected init to be one of 'default', .*'he', got 'zeros'$"):
        cls(3, 4, init="zeros")
    with pytest.raises(ValueError, match=rf"^{name}: expected hidden_size to be a positive int, got 0$"):
        cls(3, 0)
    with pytest.raises(ValueError, match=rf"^{name}: expected input_size to be a positive int, got 2.5$"):
        cls(2.5, 4)
    with pytest.raises(
        ValueError, match=rf"^{name}: expected norm_options accepted by norm='layer' \(none\), got r_max$"
    ):
        cls(3, 4, norm="layer", norm_options={"r_max": 2.0})
    with pytest.raises(ValueError, match=r"small_batch to be 'tail', 'error' or 'running', got 'skip'"):
        cls(3, 4, norm="batch", small_batch="skip")


@pytest.mark.parametrize("kind", KINDS)
def test_layer_bad_input(kind: str) -> None:
    layer = LAYERS[kind](3, 4, num_layers=2)
    name = type(layer).__name__
    x = torch.randn(5, 2, 3)
    with pytest.raises(
        ValueError, match=rf"^{name}: expected a 3-D input \(seq, batch, features\) .*got shape \(5,\)$"
    ):
        layer(torch.randn(5))
    with pytest.raises(ValueError, match=rf"^{name}: expected input with 3 features, got 6$"):
        layer(torch.randn(5, 2, 6))
    with pytest.raises(ValueError, match=rf"^{name}: expected lengths of shape \(2,\), got \(3,\)$"):
        layer(x, lengths=torch.tensor([5, 4, 3]))
    with pytest.raises(ValueError, match=rf"^{name}: expected lengths in \[1, 5\] .*, got 0..5$"):
        layer(x, lengths=torch.tensor([5, 0]))
    with pytest.raises(ValueError, match=rf"^{name}: expected lengths in \[1, 5\] .*, got 2..6$"):
        layer(x, lengths=[6, 2])
    with pytest.raises(ValueError, match=rf"^{name}: expected integer lengths, got dtype torch.float32$"):
        layer(x, lengths=torch.tensor([5.0, 2.0]))
    bad_h = torch.zeros(1, 2, 4)
    hx = (bad_h, torch.zeros(2, 2, 4)) if kind == "lstm" else bad_h
    with pytest.raises(ValueError, match=rf"^{name}: expected h_0 of shape \(2, 2, 4\), got \(1, 2, 4\)$"):
        layer(x, hx)
    if kind == "lstm":
        with pytest.raises(ValueError, match=r"^LSTM: expected hx to be a tuple \(h_0, c_0\), got"):
            layer(x, torch.zeros(2, 2, 4))
    with pytest.raises(ValueError, match=rf"^{name}: expected dropout in \[0, 1\), got 1.0$"):
        LAYERS[kind](3, 4, dropout=1.0)
    with pytest.raises(ValueError, match=rf"^{name}: expected recurrent_dropout in \[0, 1\), got -0.1$"):
        LAYERS[kind](3, 4, recurrent_dropout=-0.1)


def test_packed_input_with_lengths_is_an_error() -> None:
    packed = torch.nn.utils.rnn.pack_padded_sequence(torch.randn(4, 2, 3), [4, 2])
    with pytest.raises(ValueError, match=r"^GRU: expected lengths=None with a PackedSequence input"):
        seqnorm.GRU(3, 4)(packed, lengths=[4, 2])


def test_step_errors() -> None:
    with pytest.raises(ValueError, match=r"^LSTM: expected a unidirectional layer for step\(\), got bidirectional"):
        seqnorm.LSTM(3, 4, bidirectional=True).step(torch.randn(1, 3))
    layer = seqnorm.LSTM(3, 4, num_layers=2)
    _, state = layer.step(torch.randn(2, 3))
    with pytest.raises(ValueError, match=r"^LSTM: expected state.h of shape \(2, 3, 4\), got \(2, 2, 4\)$"):
        layer.step(torch.randn(3, 3), state)
    with pytest.raises(ValueError, match=r"^LSTMCell: expected input of shape \(batch, 3\), got \(2, 5\)$"):
        layer.step(torch.randn(2, 5), state)
