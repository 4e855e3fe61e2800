"""Graph capture (seqnorm.torch_capture): torch.export and ONNX export give eager outputs, or fail with a clear error.

Checked against the ONNX reference evaluator (``onnx.reference``), with the graph's input really an input (the issue
was a constant graph that ignored it). ``torch.jit.trace`` and ``torch.jit.script`` are refused by name.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch.testing import assert_close

from seqnorm import RecurrentState
from seqnorm.norms import WeightNormSpec
from tests.conftest import BATCH_NORMS, CELLS, KINDS, LAYERS, NORMS

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")  # torch.onnx.export(dynamo=True) needs it
from onnx.reference import ReferenceEvaluator  # noqa: E402

ALTERNATIVES = r"expected torch.export.export\(model, args\), torch.onnx.export\(model, args, dynamo=True\)"


def _layer(kind: str, norm: str, **options: object) -> torch.nn.Module:
    layer = LAYERS[kind](4, 6, norm=norm, max_steps=3, **options)
    for _ in range(2):  # running statistics away from their initial values (eval uses them)
        layer(torch.randn(5, 3, 4) + 1)
    return layer.eval()


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", list(LAYERS))
def test_onnx_export_matches_eager(kind: str, norm: str) -> None:
    layer = _layer(kind, norm, bidirectional=True)  # short and one layer: the export's time grows with both
    x = torch.randn(3, 2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.onnx.export(layer, (x,), dynamo=True, verbose=False).model_proto
    assert [value.name for value in model.graph.input] == ["input"]
    evaluator = ReferenceEvaluator(model)
    for sample in (x, torch.randn(3, 2, 4) * 2):  # a second input: the graph reads its input
        output, state = layer(sample)
        expected = [output, *(state if isinstance(state, tuple) else (state,))]  # output, h_n (and c_n)
        got = [torch.as_tensor(array) for array in evaluator.run(None, {"input": sample.numpy()})]
        assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", list(LAYERS))
def test_torch_export_matches_eager_and_guards_the_length(kind: str, norm: str) -> None:
    layer = _layer(kind, norm)
    x = torch.randn(5, 3, 4)
    program = torch.export.export(layer, (x,))
    other = torch.randn(5, 3, 4)
    assert_close(program.module()(other), layer(other), rtol=0, atol=1e-5)  # reference loop vs fast path
    with pytest.raises(Exception, match=r"(?i)shape|guard|size|dimension"):  # specialized to T=5, and says so
        program.module()(torch.randn(7, 3, 4))


class _GenerationStep(torch.nn.Module):
    """One decoding step, the usual way to deploy a recurrent language model: ``layer.step()`` without gradients."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h, c = state if len(state) == 2 else (state[0], None)
        with torch.no_grad():
            y, after = self.layer.step(x, RecurrentState(h, c, 2))
        return (y, after.h) if after.c is None else (y, after.h, after.c)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", list(LAYERS))
def test_a_generation_step_exports(kind: str, norm: str) -> None:
    """The cached and compiled steps read storage addresses, which export's stand-in tensors lack ("Cannot access
    data pointer of Tensor"): under export the cells' own steps run."""
    step = _GenerationStep(_layer(kind, norm, num_layers=2))
    state = [torch.randn(2, 3, 6) for _ in range(2 if kind == "lstm" else 1)]
    program = torch.export.export(step, (torch.randn(3, 4), *state))
    x = torch.randn(3, 4)
    assert_close(program.module()(x, *state), step(x, *state), rtol=0, atol=1e-5)


@pytest.mark.parametrize("norm", BATCH_NORMS)
def test_export_of_a_training_batch_norm_model_is_refused(norm: str) -> None:
    layer = _layer("lstm", norm).train()
    with pytest.raises(ValueError, match=r"^LSTM: expected model.eval\(\) before export"):
        torch.export.export(layer, (torch.randn(5, 3, 4),))


def test_export_of_a_training_mean_only_bn_model_is_refused() -> None:
    """Weight norm's mean-only BN updates per-step running means in training, too (it exported without a word)."""
    layer = LAYERS["lstm"](4, 6, norm=WeightNormSpec(mean_only_bn=True)).train()
    with pytest.raises(ValueError, match=r"^LSTM: expected model.eval\(\) before export"):
        torch.export.export(layer, (torch.randn(5, 3, 4),))


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", list(LAYERS))
def test_jit_trace_is_refused_naming_the_alternatives(kind: str, norm: str) -> None:
    layer = _layer(kind, norm)
    name = type(layer).__name__
    with pytest.raises(RuntimeError, match=rf"^{name}: {ALTERNATIVES}.*got torch.jit.trace"):
        torch.jit.trace(layer, (torch.randn(5, 3, 4),))


def test_legacy_onnx_export_does_not_make_a_graph() -> None:
    class Wrapper(torch.nn.Module):  # a model that calls the layer with the input alone
        def __init__(self) -> None:
            super().__init__()
            self.rnn = _layer("lstm", "layer")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.rnn(x)[0]

    buffer = io.BytesIO()
    with pytest.raises(RuntimeError, match=rf"^LSTM: {ALTERNATIVES}.*dynamo=False"):
        torch.onnx.export(Wrapper(), (torch.randn(5, 3, 4),), buffer, dynamo=False)
    assert buffer.getvalue() == b""


@pytest.mark.parametrize("kind", KINDS)
def test_jit_script_is_refused_naming_the_alternatives(kind: str) -> None:
    for module in (CELLS[kind](4, 6, norm="layer"), LAYERS[kind](4, 6, norm="layer")):
        with pytest.raises(RuntimeError, match=rf"^{type(module).__name__}: {ALTERNATIVES}.*got torch.jit.script"):
            torch.jit.script(module)
