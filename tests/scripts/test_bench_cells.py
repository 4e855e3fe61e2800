"""scripts/bench_cells.py: a cell in the user's own loop, seqnorm's against torch's and a hand-written LN cell."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.testing import assert_close

import seqnorm


def test_a_row_per_cell_with_the_ratios_of_its_times(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import bench_cells

    argv = ["bench_cells.py", "--quick", "--steps", "4", "--batch", "3", "--hidden", "8", "--input-size", "5"]
    monkeypatch.setattr(sys, "argv", argv)
    bench_cells.main()
    out = capsys.readouterr().out
    assert "4 masked steps, B=3, I=5, H=8" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "cell |" not in line]
    assert [row.split("|")[1].strip() for row in rows] == ["LSTM", "GRU"]
    for row in rows:
        torch_ms, hand, layer, batch, batch_ratio, layer_ratio = (float(cell) for cell in row.split("|")[2:8])
        assert min(torch_ms, hand, layer, batch) > 0
        assert batch_ratio == pytest.approx(batch / layer, rel=0.05)  # (times printed to 0.01 ms)
        assert layer_ratio == pytest.approx(layer / hand, rel=0.05)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_the_hand_written_cell_is_the_layer_norm_cell(kind: str) -> None:
    """The comparison is like with like: with seqnorm's LN cell's parameters, the hand-written cell computes its
    step."""
    import bench_cells

    lstm = kind == "lstm"
    ours = (seqnorm.LSTMCell if lstm else seqnorm.GRUCell)(5, 8, norm="layer", dtype=torch.float64)
    hand = (bench_cells.HandLNLSTMCell if lstm else bench_cells.HandLNGRUCell)(5, 8).double()
    with torch.no_grad():
        for parameter in ours.parameters():
            parameter.add_(torch.rand_like(parameter) * 0.5)  # γ and β away from 1 and 0
        hand.weight_ih.copy_(ours.weight_ih)
        hand.weight_hh.copy_(ours.weight_hh)
        hand.gamma_ih.copy_(ours.norm_ih.weight)
        hand.gamma_hh.copy_(ours.norm_hh.weight)
        if lstm:
            hand.bias.copy_(ours.bias_ih + ours.bias_hh)
            hand.gamma_c.copy_(ours.norm_c.weight)
            hand.beta_c.copy_(ours.norm_c.bias)
        else:
            hand.bias_ih.copy_(ours.bias_ih)
            hand.bias_hh.copy_(ours.bias_hh)
    x = torch.randn(3, 5, dtype=torch.float64)
    state = (
        tuple(torch.randn(2, 3, 8, dtype=torch.float64).unbind(0)) if lstm else torch.randn(3, 8, dtype=torch.float64)
    )
    assert_close(hand(x, state), ours(x, state), rtol=1e-12, atol=1e-12)


def test_a_batch_of_one_row_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import bench_cells

    monkeypatch.setattr(sys, "argv", ["bench_cells.py", "--quick", "--batch", "1"])
    with pytest.raises(SystemExit):
        bench_cells.main()
