"""The StepObserver tap: intermediates reach standard forward hooks, and nothing changes without them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.testing import assert_close

from tests.conftest import KINDS, LAYERS, NORMS, running_fallback


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_observer_sees_every_real_step(kind: str, norm: str) -> None:
    layer = LAYERS[kind](3, 4, num_layers=2, bidirectional=True, norm=running_fallback(norm))
    records: dict[int, list[dict[str, Any]]] = {index: [] for index in range(len(layer.cells))}
    handles = [
        cell.observer.register_forward_hook(lambda module, args, output, index=index: records[index].append(args[0]))
        for index, cell in enumerate(layer.cells)
    ]
    x = torch.randn(6, 3, 3)
    lengths = torch.tensor([4, 2, 3])  # step 4 and 5 are padding everywhere: not run, not observed
    output, _ = layer(x, lengths=lengths)
    gates = 4 if kind == "lstm" else 3
    for cell_records in records.values():
        assert [record["step"] for record in cell_records] == [0, 1, 2, 3]
        assert cell_records[0]["mask"] is None  # every row real
        assert cell_records[3]["mask"].tolist() == [True, False, False]
        for record in cell_records:
            assert record["gates"].shape == (3, gates * 4)
            assert record["input_raw"].shape == record["input_term"].shape == (3, gates * 4)
            assert ("c" in record) == (kind == "lstm")
            assert ((record["gates"] >= -1) & (record["gates"] <= 1)).all()
    # what the forward direction of the top layer shows as h is the layer output at the real positions
    for record in records[2]:
        real = torch.ones(3, dtype=torch.bool) if record["mask"] is None else record["mask"]
        assert_close(record["h"][real], output[record["step"], real, :4])
    for handle in handles:
        handle.remove()
    assert not layer.cells[0].observer.active


def test_observer_record_matches_layer_output() -> None:
    layer = LAYERS["lstm"](3, 4, norm="layer")
    records: list[dict[str, Any]] = []
    layer.cells[0].observer.register_forward_hook(lambda module, args, output: records.append(args[0]))
    x = torch.randn(5, 2, 3)
    output, (_, c_n) = layer(x)
    assert_close(torch.stack([record["h"] for record in records]), output)
    assert_close(records[-1]["c"], c_n[0])
    post = records[0]["input_term"] - layer.cells[0].bias_ih  # LayerNorm of W_ih x, before the bias
    assert_close(post.mean(1), torch.zeros(2), atol=1e-5, rtol=0)


def test_observer_adds_no_state() -> None:
    layer = LAYERS["gru"](3, 4, norm="batch")
    assert not any("observer" in key for key in layer.state_dict())
