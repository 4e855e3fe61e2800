"""Every cell x norm under torch.autocast (bfloat16 on CPU): float32 statistics, close to float32, and torch.compile.

Tolerance: outputs are ``h`` in ``[-1, 1]``; bfloat16 keeps 8 significant bits (relative rounding 2**-9), and the
rounding of ``x``, ``h`` and the weights before each matmul is amplified through the gates and, for LayerNorm/RMSNorm,
by the division by a standard deviation. The worst case measured over these tests is about 0.03 (LSTM with RMSNorm);
we allow an absolute 0.06 and no relative slack, far below the O(1) differences of a wrong computation. The norms
themselves are checked exactly: under autocast they equal their float32 computation on the upcast input.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.testing import assert_close

import seqnorm
from seqnorm.layers.sequence import choose_path
from seqnorm.norms import LayerNorm, RMSNorm, TimestepBatchNorm, TimestepBatchRenorm
from tests.conftest import CELLS, HOISTED, LAYERS, NORMS, TORCH_KINDS

BF16_TOLERANCE = {"rtol": 0.0, "atol": 0.06}


def _bf16() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _flat(output: Any) -> tuple[torch.Tensor, ...]:
    return output if isinstance(output, tuple) else (output,)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_cell_under_autocast_is_close_to_float32(kind: str, norm: str, training: bool) -> None:
    cell_32 = CELLS[kind](8, 16, norm=norm)
    for t in range(4):  # running statistics away from 0/1, for evaluation
        cell_32(torch.randn(6, 8) + 1, step=t)
    cell_16 = copy.deepcopy(cell_32)
    cell_32.train(training)
    cell_16.train(training)
    state_32: Any = None
    state_16: Any = None
    for t, x_t in enumerate(torch.randn(4, 6, 8).unbind(0)):
        state_32 = cell_32(x_t, state_32, step=t)
        with _bf16():
            state_16 = cell_16(x_t, state_16, step=t)
        for got, want in zip(_flat(state_16), _flat(state_32), strict=True):
            assert got.dtype == torch.float32  # the norms hand float32 on; the state stays float32
            assert_close(got, want, **BF16_TOLERANCE)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_layer_under_autocast_is_close_to_float32(kind: str, norm: str, training: bool) -> None:
    layer = LAYERS[kind](8, 16, num_layers=2, bidirectional=True, norm=norm).train(training)
    x = torch.randn(6, 5, 8)
    lengths = torch.tensor([6, 3, 6, 5, 2])
    for impl in ("auto", "reference"):
        layer.impl = impl
        snapshot = {k: v.clone() for k, v in layer.state_dict().items()}
        expected_output, expected_state = layer(x, lengths=lengths)
        layer.load_state_dict(snapshot)  # the same running statistics for the bfloat16 run
        with _bf16():
            assert choose_path(layer, lengths, 5) in (("reference",) if impl == "reference" else HOISTED)
            output, state = layer(x, lengths=lengths)
        assert_close(output, expected_output, **BF16_TOLERANCE)
        assert_close(state, expected_state, **BF16_TOLERANCE)
        for name, buffer in layer.state_dict().items():
            assert buffer.dtype == snapshot[name].dtype, name
        # backward through the mixed-precision graph
        grads = torch.autograd.grad(output.square().sum(), list(layer.parameters()), allow_unused=True)
        assert all(grad is None or torch.isfinite(grad).all() for grad in grads)


@pytest.mark.parametrize("norm", ["none", "layer", "batch"])
def test_a_projected_state_stays_float32_under_autocast(norm: str) -> None:
    # as without a projection: h_n (bfloat16 from W_hr's product, before) carries on outside autocast
    layer = seqnorm.LSTM(8, 16, proj_size=4, num_layers=2, norm=norm)
    x = torch.randn(6, 5, 8)
    expected_output, expected_state = copy.deepcopy(layer)(x)
    with _bf16():
        output, state = layer(x)
        step_output, _ = copy.deepcopy(layer).eval().step(x[0])
    assert [t.dtype for t in (output, *state, step_output)] == [torch.float32] * 4
    assert_close(output, expected_output, **BF16_TOLERANCE)
    assert_close(state[0], expected_state[0], **BF16_TOLERANCE)
    assert_close(state[1], expected_state[1], rtol=0.06, atol=0.06)  # c is not bounded by 1
    carried, _ = layer(x, state)  # outside autocast
    assert carried.dtype == torch.float32


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_float64_layer_is_untouched_by_autocast(kind: str, norm: str) -> None:
    # autocast leaves float64 alone, as for torch.nn.LSTM: same numbers, float64 out (layer and batch norms raised
    # a mixed-dtype error, rms and renorm computed in float32)
    layer = LAYERS[kind](3, 8, norm=norm, dtype=torch.float64)
    x = torch.randn(5, 4, 3, dtype=torch.float64)
    expected, _ = copy.deepcopy(layer)(x)
    with _bf16():
        output, _ = layer(x)
    assert output.dtype == torch.float64
    assert_close(output, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_row_norm_statistics_are_float32(cls: type) -> None:
    norm = cls(32)
    x = (torch.randn(4, 32) * 3 + 100).bfloat16()  # a large mean: bfloat16 arithmetic would lose the spread
    with _bf16():
        got = norm(x)
    assert got.dtype == torch.float32
    assert_close(got, norm(x.float()), rtol=0, atol=0)


@pytest.mark.parametrize("cls", [TimestepBatchNorm, TimestepBatchRenorm])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_statistics_are_float32(cls: type, training: bool) -> None:
    norm_16 = cls(32, max_steps=3).train(training)
    norm_32 = cls(32, max_steps=3).train(training)
    x = (torch.randn(3, 4, 32) * 3 + 100).bfloat16()
    mask = torch.tensor([[True] * 4, [True, True, False, True], [True] * 4])
    with _bf16():
        per_step = [norm_16(x_t, t, m) for t, (x_t, m) in enumerate(zip(x.unbind(0), mask, strict=True))]
        sequence = norm_16.forward_sequence(x, mask)
    expected = [norm_32(x_t.float(), t, m) for t, (x_t, m) in enumerate(zip(x.unbind(0), mask, strict=True))]
    expected_sequence = norm_32.forward_sequence(x.float(), mask)
    assert all(y.dtype == torch.float32 for y in [*per_step, sequence])
    assert_close(per_step, expected, rtol=0, atol=0)
    assert_close(sequence, expected_sequence, rtol=0, atol=0)
    assert_close(norm_16.state_dict(), norm_32.state_dict(), rtol=0, atol=0)  # running statistics in float32


@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_step_under_autocast(kind: str) -> None:
    layer = LAYERS[kind](4, 8, num_layers=2).eval()  # norm="none": torch's fused cell is bypassed under autocast
    x = torch.randn(3, 2, 4)
    expected, _ = layer(x)
    state = None
    for t, x_t in enumerate(x.unbind(0)):
        with _bf16():
            out, state = layer.step(x_t, state)
        assert_close(out, expected[t], **BF16_TOLERANCE)


def test_torch_compile_eager_backend() -> None:
    """A tiny normalized model with lengths and zoneout compiles (graph breaks allowed, no crash)."""
    torch._dynamo.reset()
    layer = seqnorm.LSTM(3, 4, norm="layer", zoneout_h=0.1).eval()
    compiled = torch.compile(layer, backend="eager")
    x = torch.randn(3, 3, 3)
    lengths = torch.tensor([3, 2, 3])
    assert_close(compiled(x, lengths=lengths), layer(x, lengths=lengths))
    layer.train()
    output, _ = compiled(x, lengths=lengths)
    output.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("norm", ["none", "weight"])
def test_torch_compile_of_torchs_fused_kernel_with_gradients(kind: str, norm: str) -> None:
    """Without a norm the layer runs torch's fused kernel: traced with gradients, the CPU's LSTM failed (``expected
    Tensor() for op: aten.mkldnn_rnn_layer``); like torch.nn.LSTM, it runs untraced inside the compiled graph."""
    torch._dynamo.reset()
    layer = LAYERS[kind](3, 4, norm=norm)
    x = torch.randn(5, 2, 3)
    output, _ = torch.compile(layer, backend="aot_eager")(x)  # the eager backend traces no autograd graph
    gradients = torch.autograd.grad(output.square().sum(), list(layer.parameters()))
    expected, _ = layer(x)
    assert_close(output, expected)
    assert_close(gradients, torch.autograd.grad(expected.square().sum(), list(layer.parameters())))
