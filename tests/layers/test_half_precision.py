"""Models converted to another dtype (``.to(torch.bfloat16)``, float16, float64) run every cell x norm, with the
norms' statistics in float32 or better; ``--trainer.precision bf16-true`` trains through the CLI.

Tolerances against the float32 model: here every operation rounds to the model's dtype (not only the matmuls, as
under autocast), the parameters and the input are rounded first, and the norms amplify that rounding by dividing by
a standard deviation. Measured worst cases over these tests (2 layers, bidirectional, lengths, train and eval):
bfloat16 (8 significant bits) 0.12 (LSTM, batch norm, training), float16 (11 bits) 0.009, float64 1e-6. We allow
0.2, 0.03 and 1e-5: far below the O(1) differences of a wrong computation, which the exact norm checks below catch.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.testing import assert_close

from seqnorm.cli import main
from seqnorm.norms import LayerNorm, RMSNorm, TimestepBatchNorm, TimestepBatchRenorm
from tests.conftest import CELLS, KINDS, LAYERS, NORMS, QUIET, run_path

TOLERANCE = {torch.bfloat16: 0.2, torch.float16: 0.03, torch.float64: 1e-5}
DTYPES = list(TOLERANCE)


def _flat(output: Any) -> tuple[torch.Tensor, ...]:
    return output if isinstance(output, tuple) else (output,)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", list(LAYERS))
def test_layer_in_another_dtype_is_close_to_float32(kind: str, norm: str, dtype: torch.dtype) -> None:
    layer_32 = LAYERS[kind](8, 16, num_layers=2, bidirectional=True, norm=norm)
    x = torch.randn(6, 5, 8)
    lengths = torch.tensor([6, 3, 6, 5, 2])
    for training in (True, False):
        layer_32.train(training)
        layer = copy.deepcopy(layer_32).to(dtype)
        expected, expected_state = layer_32(x, lengths=lengths)
        output, state = layer(x.to(dtype), lengths=lengths)
        assert output.dtype == dtype and all(t.dtype == dtype for t in _flat(state))
        assert_close(output.double(), expected.double(), rtol=0, atol=TOLERANCE[dtype])
        for got, want in zip(_flat(state), _flat(expected_state), strict=True):
            assert_close(got.double(), want.double(), rtol=0, atol=TOLERANCE[dtype])
        output.float().square().sum().backward()
        for name, param in layer.named_parameters():
            assert param.grad is not None and param.grad.dtype == dtype, name
            assert torch.isfinite(param.grad).all(), name
        for name, buffer in layer.named_buffers():  # running statistics stay in the module's dtype
            assert buffer.dtype == (dtype if buffer.is_floating_point() else torch.long), name
            assert torch.isfinite(buffer).all(), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_cell_and_step_in_half_precision(kind: str, norm: str, dtype: torch.dtype) -> None:
    cell_32 = CELLS[kind](4, 6, norm=norm, max_steps=3)
    cell = copy.deepcopy(cell_32).to(dtype)
    state_32: Any = None
    state: Any = None
    for t, x_t in enumerate(torch.randn(4, 3, 4).unbind(0)):
        state_32 = cell_32(x_t, state_32, step=t)
        state = cell(x_t.to(dtype), state, step=t)
        for got, want in zip(_flat(state), _flat(state_32), strict=True):
            assert got.dtype == dtype
            assert_close(got.double(), want.double(), rtol=0, atol=TOLERANCE[dtype])
    # The layer's one-step API (generation), without gradients, in evaluation.
    layer = LAYERS[kind](4, 6, num_layers=2, norm=norm).eval()
    expected, _ = layer(torch.ones(3, 2, 4))
    layer.to(dtype)
    step_state = None
    with torch.no_grad():
        for t in range(3):
            out, step_state = layer.step(torch.ones(2, 4, dtype=dtype), step_state)
            assert out.dtype == dtype
            assert_close(out.double(), expected[t].double(), rtol=0, atol=TOLERANCE[dtype])


def _rounded_float32(module: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(module).float()


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm, TimestepBatchNorm, TimestepBatchRenorm])
def test_norm_in_half_precision_computes_in_float32(cls: type, training: bool) -> None:
    # A large mean: statistics in bfloat16 arithmetic would lose the spread. The bfloat16 norm must equal the float32
    # computation on its own (rounded) parameters and input, rounded once at the end; its running statistics too.
    kwargs: dict[str, Any] = {"max_steps": 3} if cls in (TimestepBatchNorm, TimestepBatchRenorm) else {}
    norm = cls(32, **kwargs)
    with torch.no_grad():
        for tensor in [*norm.parameters(), *(b for b in norm.buffers() if b.is_floating_point())]:
            tensor.add_(torch.rand_like(tensor))
    norm = norm.to(torch.bfloat16).train(training)
    reference = _rounded_float32(norm)
    x = (torch.randn(3, 4, 32) * 3 + 100).bfloat16()
    mask = torch.tensor([True, True, False, True])
    for t, x_t in enumerate(x.unbind(0)):
        got = norm(x_t, t, mask)
        assert got.dtype == torch.bfloat16
        assert_close(got, reference(x_t.float(), t, mask).bfloat16(), rtol=0, atol=0)
    assert_close(norm.forward_sequence(x), reference.forward_sequence(x.float()).bfloat16(), rtol=0, atol=0)
    for name, buffer in norm.state_dict().items():
        want = reference.state_dict()[name]
        assert buffer.dtype == (torch.bfloat16 if want.is_floating_point() else want.dtype), name
        # Stored in bfloat16 after each of the two updates (relative rounding up to 2**-8 each), updated in float32.
        assert_close(buffer.double(), want.double(), rtol=2**-7, atol=0)
    # Gradients reach the bfloat16 parameters in their own dtype.
    x_grad = x[0].clone().requires_grad_()
    norm(x_grad, 0).float().square().sum().backward()
    assert x_grad.grad is not None and torch.isfinite(x_grad.grad).all()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in norm.parameters())


@pytest.mark.parametrize("norm", ["layer", "batch"])
def test_cli_trains_in_bf16_true(story: Path, norm: str) -> None:
    args = ["--model", "LanguageModel", "--data", "TextCorpus", "--data.path", str(story), "--data.batch_size", "8"]
    args += ["--model.hidden_size", "24", "--model.embedding_dim", "8", "--model.norm", norm, "--model.lr", "0.01"]
    args += ["--trainer.precision", "bf16-true", "--trainer.max_steps", "12", "--trainer.log_every_n_steps", "1"]
    main(["fit", *args, *QUIET, "--trainer.limit_val_batches", "2", "--trainer.val_check_interval", "6"])
    run = run_path(0)
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 12
    rnn = {key: value for key, value in checkpoint["state_dict"].items() if key.startswith("model.rnn.")}
    assert rnn and all(v.dtype == torch.bfloat16 for v in rnn.values() if v.is_floating_point())
    accumulator = EventAccumulator(str(run))
    accumulator.Reload()
    losses = [event.value for event in accumulator.Scalars("train/loss")]
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
