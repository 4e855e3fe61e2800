"""Exporting a normalized LSTM: ``torch.export`` and ONNX work; TorchScript and tracing are refused by name.

- ``torch.export.export(model, (x,))`` captures the reference time loop as plain tensor ops (specialized to the
  example's sequence length);
- ``torch.onnx.export(model, (x,), dynamo=True)`` writes the same program as ONNX (needs ``onnx`` and
  ``onnxscript``: ``pip install "seqnorm[test]"``); checked here with ONNX's reference evaluator;
- ``torch.jit.script`` / ``torch.jit.trace`` raise a ``RuntimeError`` naming these two instead (a trace would record
  the loop unrolled for one length and be silently wrong for others).

Export in ``eval()`` mode: a model whose norms use batch statistics is refused in training mode, since a graph does
not carry the running-statistics updates. The guide's "Export" section (docs/guide/cells-and-layers.md) has the
whole table.

Run: ``python examples/export.py`` (writes ``model.onnx`` into a temporary directory).
"""

from __future__ import annotations

import importlib.util
import tempfile
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

import seqnorm


class Encoder(nn.Module):
    """A BN-LSTM encoder with a linear head: ``(T, B, 4) -> (B, 3)`` from the final hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = seqnorm.LSTM(4, 16, norm="batch", max_steps=8)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        _, (h_n, _) = self.rnn(x)
        return self.head(h_n[-1])


def main() -> None:
    torch.manual_seed(0)
    model = Encoder()
    with torch.no_grad():  # a few training batches: running statistics away from their initial values
        for _ in range(3):
            model(torch.randn(8, 16, 4))
    model.eval()
    x = torch.randn(8, 2, 4)  # (T, B, I)
    expected = model(x)

    program = torch.export.export(model, (x,))
    other = torch.randn(8, 2, 4)
    difference = (program.module()(other) - model(other)).abs().max().item()
    print(f"torch.export: max |exported - eager| = {difference:.1e}")

    if importlib.util.find_spec("onnx") and importlib.util.find_spec("onnxscript"):
        from onnx.reference import ReferenceEvaluator

        with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter's progress notes
            path = Path(folder) / "model.onnx"
            torch.onnx.export(model, (x,), str(path), dynamo=True, verbose=False)
            (onnx_output,) = ReferenceEvaluator(str(path)).run(None, {"x": x.numpy()})
        difference = (torch.as_tensor(onnx_output) - expected).abs().max().item()
        print(f"ONNX: max |onnx - eager| = {difference:.1e}")
    else:
        print("ONNX: skipped (pip install onnx onnxscript)")

    try:
        torch.jit.script(model)
    except RuntimeError as error:
        print(f"torch.jit.script: refused: {error}")


if __name__ == "__main__":
    main()
