"""The contract every cell x norm keeps: shapes, dtype, backward, gradcheck, state-dict round trip, train/eval."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradgradcheck
from torch.func import functional_call
from torch.testing import assert_close

import seqnorm
from seqnorm.norms import WeightNormSpec
from tests.conftest import BATCH_NORMS, CELLS, KINDS, LAYERS, NORMS, perturb_norm_parameters


def _state(kind: str, batch: int, hidden: int, dtype: torch.dtype) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    h = torch.randn(batch, hidden, dtype=dtype)
    return (h, torch.randn(batch, hidden, dtype=dtype)) if kind == "lstm" else h


def _h(output: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_cell_contract(kind: str, norm: str, dtype: torch.dtype) -> None:
    cell = CELLS[kind](5, 6, norm=norm, max_steps=4, dtype=dtype)
    x = torch.randn(3, 5, dtype=dtype)
    output = cell(x, _state(kind, 3, 6, dtype), step=2)
    outputs = output if kind == "lstm" else (output,)
    for tensor in outputs:
        assert tensor.shape == (3, 6)
        assert tensor.dtype == dtype
        assert torch.isfinite(tensor).all()
    sum(t.square().sum() for t in outputs).backward()
    for name, param in cell.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, f"{name} gets no gradient"
    # state=None is zeros
    zero_state = _state(kind, 3, 6, dtype)
    zero_state = tuple(torch.zeros_like(t) for t in zero_state) if kind == "lstm" else torch.zeros_like(zero_state)
    assert_close(cell(x, None, step=1), cell(x, zero_state, step=1))


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_cell_state_dict_round_trip_includes_running_statistics(kind: str, norm: str) -> None:
    cell = CELLS[kind](4, 5, norm=norm, max_steps=3)
    for step in range(5):  # training updates per-step running statistics
        cell(torch.randn(8, 4) * (step + 1), step=step)
    perturb_norm_parameters(cell)
    copy = CELLS[kind](4, 5, norm=norm, max_steps=3)
    copy.load_state_dict(cell.state_dict())
    for name, tensor in cell.state_dict().items():
        assert torch.equal(copy.state_dict()[name], tensor), name
    cell.eval()
    copy.eval()
    x = torch.randn(2, 4)
    for step in range(4):
        assert torch.equal(_h(copy(x, step=step)), _h(cell(x, step=step)))
    if norm in BATCH_NORMS:
        assert cell.norm_ih.num_batches_tracked.tolist() == [1, 1, 3]
        assert not torch.equal(cell.norm_ih.running_mean[0], cell.norm_ih.running_mean[2])


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_train_eval_switch_batch_vs_population_statistics(kind: str, norm: str) -> None:
    cell = CELLS[kind](4, 5, norm=norm)
    x = torch.randn(6, 4) * 3 + 1
    train_output = _h(cell(x, step=0))
    cell.eval()
    eval_output = _h(cell(x, step=0))
    if norm in BATCH_NORMS:
        assert not torch.allclose(train_output, eval_output)  # running statistics have seen one batch
    else:
        assert_close(train_output, eval_output)


def _gradcheck_cell(cell: torch.nn.Module, kind: str, mask: torch.Tensor | None) -> None:
    names = [name for name, _ in cell.named_parameters()]
    params = [param.detach().clone().requires_grad_() for _, param in cell.named_parameters()]
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    h = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    c = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)

    def run(x: torch.Tensor, h: torch.Tensor, c: torch.Tensor, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        state = (h, c) if kind == "lstm" else h
        output = functional_call(cell, dict(zip(names, values, strict=True)), (x, state), {"step": 1, "mask": mask})
        return output if isinstance(output, tuple) else (output,)

    assert torch.autograd.gradcheck(run, (x, h, c, *params), eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_cell_gradcheck_inputs_state_and_parameters(kind: str, norm: str, training: bool) -> None:
    cell = CELLS[kind](3, 2, norm=norm, dtype=torch.float64)
    perturb_norm_parameters(cell)  # away from γ = 0.1 / β = 0 so every parameter's path is exercised
    cell.train(training)
    mask = torch.tensor([True, True, False, True])  # a padded row: statistics over the other three
    _gradcheck_cell(cell, kind, mask)


def test_weight_norm_mean_only_bn_gradcheck() -> None:
    cell = CELLS["lstm"](3, 2, norm=WeightNormSpec(mean_only_bn=True), dtype=torch.float64)
    assert cell.norm_ih is not None and not cell.norm_ih.scale
    _gradcheck_cell(cell, "lstm", None)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_layer_contract(kind: str, norm: str) -> None:
    layer = LAYERS[kind](4, 5, num_layers=2, bidirectional=True, batch_first=True, norm=norm, max_steps=3)
    x = torch.randn(3, 6, 4)
    lengths = torch.tensor([6, 5, 6])  # >= 2 active rows at every step, as training batch norms need
    output, state = layer(x, lengths=lengths)
    assert output.shape == (3, 6, 10)
    h_n = state[0] if kind == "lstm" else state
    assert h_n.shape == (4, 3, 5)
    assert torch.equal(output[1, 5], torch.zeros(10))
    output.square().sum().backward()
    for name, param in layer.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    keys = list(layer.state_dict())
    assert all(key.split(".")[0].rsplit("_l", 1)[1] in {"0", "1", "0_reverse", "1_reverse"} for key in keys)
    perturb_norm_parameters(layer)
    copy = LAYERS[kind](4, 5, num_layers=2, bidirectional=True, batch_first=True, norm=norm, max_steps=3)
    copy.load_state_dict(layer.state_dict())
    layer.eval()
    copy.eval()
    assert torch.equal(copy(x, lengths=lengths)[0], layer(x, lengths=lengths)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_an_empty_batch_gives_empty_outputs_like_torch(kind: str, norm: str, dtype: torch.dtype) -> None:
    """Batch size 0 (``torch.nn.LSTM`` returns empty outputs): every path, the float32 kernels' matmul routes
    included (they crashed with ``std::bad_alloc``); in training only where the norm needs no batch statistics."""
    layer = LAYERS[kind](4, 5, num_layers=2, norm=norm, max_steps=3, dtype=dtype)
    x = torch.randn(6, 0, 4, dtype=dtype, requires_grad=True)
    for training in (False, True) if norm not in BATCH_NORMS else (False,):
        output, _ = layer.train(training)(x)
        assert output.shape == (6, 0, 5)
        output.sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
    with torch.no_grad():
        y, state = layer.eval().step(x[0])
    assert y.shape == (0, 5) and state.h.shape == (2, 0, 5)
    if norm in BATCH_NORMS:
        with pytest.raises(ValueError, match="got batch size 0"):
            layer.train()(x)


@pytest.mark.parametrize("norm", NORMS)
def test_forward_mode_derivatives_through_the_reference_loop(norm: str) -> None:
    """The user guide's promise that impl="reference" has every derivative, forward-mode AD included: the tangent of
    the output equals central differences, for every cell and norm, in training, with lengths (masked steps, and for
    per-timestep BN a tail step of one real row). The norms' step forms with nodes of their own (the kernels' BN
    step, the pieces' node) have no forward derivative and must leave a dual tensor to torch's ops."""
    import copy

    import torch.autograd.forward_ad as forward_ad

    torch.manual_seed(0)
    x, direction = torch.randn(5, 3, 3, dtype=torch.float64), torch.randn(5, 3, 3, dtype=torch.float64)
    lengths = torch.tensor([5, 3, 1])
    for kind in KINDS:
        layer = LAYERS[kind](3, 4, norm=norm, impl="reference", dtype=torch.float64)
        perturb_norm_parameters(layer)
        with forward_ad.dual_level():
            dual = forward_ad.make_dual(x, direction)
            tangent = forward_ad.unpack_dual(copy.deepcopy(layer)(dual, lengths=lengths)[0]).tangent
        with torch.no_grad():
            ahead, behind = (copy.deepcopy(layer)(x + h * direction, lengths=lengths)[0] for h in (1e-6, -1e-6))
        assert_close(tangent, (ahead - behind) / 2e-6, rtol=1e-6, atol=1e-7, msg=kind)


@pytest.mark.parametrize("norm", ["layer", "batch"])
@pytest.mark.parametrize("kind", KINDS)
def test_second_derivatives_through_the_reference_loop(kind: str, norm: str) -> None:
    """The README's promise: the compiled kernels' hand-written backwards are first-order (a second backward is torch's
    once_differentiable error), and impl="reference" has every derivative (gradgradcheck). (Where the kernels are not
    built, the fallback loop runs under autograd: every derivative too.)"""
    torch.manual_seed(0)
    x = torch.randn(3, 4, 2, dtype=torch.float64, requires_grad=True)
    fast = LAYERS[kind](2, 3, norm=norm, dtype=torch.float64)
    (grad,) = torch.autograd.grad(fast(x)[0].square().sum(), x, create_graph=True)
    if seqnorm.kernels.native("cpu") is not None:
        with pytest.raises(RuntimeError, match="differentiate twice"):
            grad.sum().backward()
    reference = LAYERS[kind](2, 3, norm=norm, dtype=torch.float64, impl="reference")
    assert gradgradcheck(lambda x: reference(x)[0], (x,), eps=1e-6, atol=1e-5)
