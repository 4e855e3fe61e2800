"""Per-timestep batch normalization and batch renormalization: statistics per step, batch size 1, r/d correction."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from torch.testing import assert_close

import seqnorm
from seqnorm.norms import NORMS, TimestepBatchNorm, TimestepBatchRenorm
from tests.conftest import BATCH_NORMS, CELLS, KINDS, LAYERS, require_kernels


def test_running_statistics_update_only_their_step() -> None:
    bn = TimestepBatchNorm(3, max_steps=4, momentum=0.25)
    x = torch.randn(10, 3) * 2 + 5
    bn(x, step=1)
    assert_close(bn.running_mean[1], 0.25 * x.mean(0))
    assert_close(bn.running_var[1], 0.75 + 0.25 * x.var(0, unbiased=True))
    assert torch.equal(bn.running_mean[[0, 2, 3]], torch.zeros(3, 3))
    assert torch.equal(bn.running_var[[0, 2, 3]], torch.ones(3, 3))
    assert bn.num_batches_tracked.tolist() == [0, 1, 0, 0]
    bn(x, step=9)  # beyond max_steps: trains the last step's statistics
    assert bn.num_batches_tracked.tolist() == [0, 1, 0, 1]


@pytest.mark.parametrize("norm", BATCH_NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_per_timestep_statistics_after_training(kind: str, norm: str) -> None:
    layer = LAYERS[kind](3, 8, norm=NORMS[norm].spec(momentum=0.5), max_steps=4)
    with torch.no_grad():
        for _ in range(10):  # step-dependent inputs: step t has mean t and scale t + 1
            x = torch.randn(12, 16, 3) * torch.arange(1.0, 13.0).view(12, 1, 1) + torch.arange(12.0).view(12, 1, 1)
            layer(x)
    cell = layer.cells[0].eval()
    x = torch.randn(5, 3)
    state = cell.initial_state(5, x)
    outputs = {step: cell(x, state, step=step) for step in (0, 1, 3, 4, 7, 100)}
    h = {step: out[0] if kind == "lstm" else out for step, out in outputs.items()}
    assert not torch.allclose(h[0], h[3], atol=1e-3)
    assert not torch.allclose(h[0], h[1], atol=1e-3)
    for late in (4, 7, 100):
        assert torch.equal(h[late], h[3])


@pytest.mark.parametrize("norm", BATCH_NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_batch_size_one_in_training_is_a_clear_error(kind: str, norm: str) -> None:
    layer = LAYERS[kind](3, 4, norm=norm)  # the default policy, "tail"
    batch_one = (
        r"expected a batch of at least 2 rows .* got batch size 1\. .*cannot train at batch size 1.*norm=\"layer\""
    )
    with pytest.raises(ValueError, match=batch_one) as refused:
        layer(torch.randn(5, 1, 3))
    # the advice works as written (it said small_batch="running", a keyword the layers refuse)
    advice = re.search(r"pass norm=(\w+)\(small_batch=\"running\"\)", str(refused.value))
    assert advice is not None, refused.value
    advised = LAYERS[kind](3, 4, norm=getattr(seqnorm.norms, advice.group(1))(small_batch="running"))
    assert torch.isfinite(advised(torch.randn(5, 1, 3))[0]).all()
    cell = CELLS[kind](3, 4, norm=norm)
    with pytest.raises(ValueError, match=rf"^{type(cell).__name__}: expected a batch of at least 2 rows"):
        cell(torch.randn(1, 3), step=0)
    layer.eval()  # population statistics need no batch
    output, _ = layer(torch.randn(5, 1, 3))
    assert torch.isfinite(output).all()


@pytest.mark.parametrize("norm", BATCH_NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_strict_policy_raises_at_a_single_row_step(kind: str, norm: str) -> None:
    layer = LAYERS[kind](3, 4, norm=NORMS[norm].spec(small_batch="error"))
    with pytest.raises(ValueError, match=r"expected at least 2 active .* step 3 .* got 1 \(batch size 3\)"):
        layer(torch.randn(6, 3, 3), lengths=torch.tensor([6, 2, 3]))
    cell = CELLS[kind](3, 4, norm=NORMS[norm].spec(small_batch="error"))
    with pytest.raises(ValueError, match=r"got 1 \(batch size 4\)"):
        cell(torch.randn(4, 3), step=0, mask=torch.tensor([False, True, False, False]))
    with pytest.raises(ValueError, match=r"got batch size 1\."):
        cell(torch.randn(1, 3), step=0)


def test_tail_step_is_normalized_with_its_running_statistics() -> None:
    bn = TimestepBatchNorm(3, max_steps=4, dtype=torch.float64)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(4, 3, dtype=torch.float64))
        bn.running_var.copy_(torch.rand(4, 3, dtype=torch.float64) + 0.5)
        bn.weight.copy_(torch.rand(3, dtype=torch.float64) + 0.5)
        bn.bias.copy_(torch.randn(3, dtype=torch.float64))
    before = {name: tensor.clone() for name, tensor in bn.state_dict().items()}
    x = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([False, True, False])
    y = bn(x, step=2, mask=mask)
    expected = (x[1] - before["running_mean"][2]) / torch.sqrt(before["running_var"][2] + bn.eps)
    assert_close(y[1], expected * bn.weight + bn.bias)
    for name, tensor in bn.state_dict().items():
        assert torch.equal(tensor, before[name]), f"{name} changed on a fallback step"
    assert bn.fallback_steps == 1
    # the running moments are constants in the backward pass, as in evaluation
    (grad,) = torch.autograd.grad(y[1].sum(), x)
    assert_close(grad[1], bn.weight.detach() / torch.sqrt(before["running_var"][2] + bn.eps))
    assert torch.equal(grad[[0, 2]], torch.zeros(2, 3, dtype=torch.float64))
    # a step with two rows uses the batch: no fallback, and it updates its row
    bn(x.detach(), step=2, mask=torch.tensor([True, True, False]))
    assert bn.fallback_steps == 1 and bn.num_batches_tracked[2] == 1


@pytest.mark.parametrize("norm", BATCH_NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_variable_length_batch_trains_by_default_and_counts_tail_steps(kind: str, norm: str) -> None:
    layer = LAYERS[kind](3, 4, norm=norm, max_steps=8)
    lengths = torch.tensor([6, 2, 3])  # steps 3, 4, 5 have one real row
    output, _ = layer(torch.randn(6, 3, 3), lengths=lengths)
    output.sum().backward()
    assert torch.isfinite(output).all()
    norms = [m for m in layer.modules() if isinstance(m, TimestepBatchNorm)]
    per_step = [n for n in norms if not getattr(n, "whole_sequence", False)]
    assert per_step and all(n.fallback_steps == 3 for n in per_step)
    tracked = per_step[0].num_batches_tracked[:6].tolist()
    assert tracked == [1, 1, 1, 0, 0, 0]
    layer.eval()
    layer(torch.randn(6, 3, 3), lengths=lengths)
    assert all(n.fallback_steps == 3 for n in per_step)  # evaluation counts nothing


@pytest.mark.parametrize("norm", BATCH_NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_small_batch_running_fallback(kind: str, norm: str) -> None:
    layer = LAYERS[kind](3, 4, norm=NORMS[norm].spec(small_batch="running"))
    layer(torch.randn(6, 8, 3) * 3 + 1)  # gives the running statistics something to hold
    buffers = {name: tensor.clone() for name, tensor in layer.state_dict().items()}
    x = torch.randn(6, 1, 3)
    output, _ = layer(x)
    assert torch.isfinite(output).all() and output.abs().sum() > 0
    for name, tensor in layer.state_dict().items():
        assert torch.equal(tensor, buffers[name]), f"{name} changed on a fallback step"
    layer.eval()
    assert_close(output, layer(x)[0])  # the fallback is exactly the population statistics
    # mixed: steps with >= 2 active rows use the batch, the tail with one active row falls back
    layer.train()
    mixed, _ = layer(torch.randn(6, 3, 3), lengths=torch.tensor([6, 2, 3]))
    assert torch.isfinite(mixed).all()
    tracked = layer.cells[0].norm_ih.num_batches_tracked[:6].tolist()
    assert tracked == [2, 2, 2, 1, 1, 1]


def test_renorm_is_batch_norm_during_warmup() -> None:
    renorm = TimestepBatchRenorm(4, max_steps=3, warmup=10, gain=1.0)
    bn = TimestepBatchNorm(4, max_steps=3, gain=1.0)
    for _ in range(3):
        x = torch.randn(8, 4) * 3 + 2
        assert_close(renorm(x, step=0), bn(x, step=0))
    assert_close(renorm.running_mean, bn.running_mean)


def test_renorm_schedule() -> None:
    renorm = TimestepBatchRenorm(2, max_steps=2, r_max=3.0, d_max=5.0, warmup=10, r_max_steps=20, d_max_steps=40)
    schedule = []
    for tracked in (0, 10, 20, 30, 50, 1000):
        renorm.num_batches_tracked[1] = tracked
        r_max, d_max = renorm.limits(1)
        schedule.append((round(float(r_max), 6), round(float(d_max), 6)))
    assert schedule == [(1.0, 0.0), (1.0, 0.0), (2.0, 1.25), (3.0, 2.5), (3.0, 5.0), (3.0, 5.0)]


def test_default_renorm_schedule_is_the_papers() -> None:
    """Ioffe 2017: plain BN for 5000 steps, then relaxed to reach r_max = 3 at 40k steps and d_max = 5 at 25k."""
    renorm = TimestepBatchRenorm(2, max_steps=1, dtype=torch.float64)
    schedule = {}
    for tracked in (5000, 25000, 40000):
        renorm.num_batches_tracked[0] = tracked
        schedule[tracked] = tuple(round(float(limit), 9) for limit in renorm.limits(0))
    assert schedule == {5000: (1.0, 0.0), 25000: (round(1 + 2 * 20 / 35, 9), 5.0), 40000: (3.0, 5.0)}


def test_renorm_limits_in_the_statistics_precision_and_counted_in_row_updates() -> None:
    """float64 models get float64 limits (they were float32: 2e-8 off the exact schedule); the shared last row
    counts one update per step that reaches it (README: beyond_max_steps)."""
    renorm = TimestepBatchRenorm(2, max_steps=2, r_max=1.2, d_max=0.1, warmup=0, r_max_steps=3, d_max_steps=7)
    renorm.double()
    renorm.num_batches_tracked[1] = 1
    r_max, d_max = renorm.limits(1)
    assert r_max.dtype == torch.float64 and float(r_max) == 1.0 + 0.2 * (1 / 3) and float(d_max) == 0.1 * (1 / 7)
    layer = seqnorm.LSTM(2, 3, norm="batch_renorm", max_steps=2)
    layer(torch.randn(6, 4, 2))  # one batch of 6 steps: row 0 once, the last row for steps 1..5
    assert layer.cells[0].norm_hh.num_batches_tracked.tolist() == [1, 5]


def test_renorm_correction_matches_the_paper() -> None:
    renorm = TimestepBatchRenorm(4, max_steps=2, r_max=1.5, d_max=0.5, warmup=0, r_max_steps=1, d_max_steps=1)
    renorm.momentum = 0.0  # keep the running moments fixed to check the formula
    with torch.no_grad():
        renorm.running_mean[0] = torch.tensor([0.0, 1.0, -3.0, 0.2])
        renorm.running_var[0] = torch.tensor([1.0, 0.1, 9.0, 1.0])
        renorm.weight.copy_(torch.tensor([1.0, 2.0, 0.5, 1.0]))
    renorm.num_batches_tracked[0] = 5
    x = torch.randn(16, 4) * torch.tensor([1.0, 2.0, 1.0, 0.5]) + torch.tensor([0.0, 1.5, -3.0, 0.0])
    x.requires_grad_()
    y = renorm(x, step=0)
    mean, var = x.mean(0), x.var(0, unbiased=False)
    std, running_std = torch.sqrt(var + renorm.eps), torch.sqrt(renorm.running_var[0] + renorm.eps)
    r = (std / running_std).clamp(1 / 1.5, 1.5).detach()
    d = ((mean - renorm.running_mean[0]) / running_std).clamp(-0.5, 0.5).detach()
    expected = ((x - mean) / std * r + d) * renorm.weight
    assert_close(y, expected)
    assert not torch.allclose(r, torch.ones(4)) and not torch.allclose(d, torch.zeros(4))  # the correction acted
    weights = torch.randn(16, 4)
    assert_close(torch.autograd.grad((y * weights).sum(), x)[0], torch.autograd.grad((expected * weights).sum(), x)[0])
    renorm.eval()  # evaluation is plain BN with the running moments
    assert_close(renorm(x, step=0), (x - renorm.running_mean[0]) / running_std * renorm.weight)


def test_cooijmans_initialization() -> None:
    cell = seqnorm.LSTMCell(3, 4, norm="batch")
    assert torch.equal(cell.norm_ih.weight, torch.full((16,), 0.1))
    assert cell.norm_ih.bias is None and cell.norm_hh.bias is None  # β of the gate terms is fixed at 0
    assert torch.equal(cell.norm_c.weight, torch.full((4,), 0.1))
    assert torch.equal(cell.norm_c.bias, torch.zeros(4))
    assert cell.norm_ih.running_mean.shape == (100, 16)
    assert torch.equal(cell.bias_ih[4:8] + cell.bias_hh[4:8], torch.ones(4))  # forget bias 1.0


def test_pooled_moments_keep_their_variance_in_float32_when_the_means_are_large() -> None:
    """``beyond_max_steps="pooled"`` in float32: running means near 300 with a spread of 0.1 (E[var + mean²] -
    E[mean]² cancelled the variance to 0 or 0.016 where it is 0.02)."""
    generator = torch.Generator().manual_seed(0)
    means = 300 + 0.1 * torch.randn(4, 3, generator=generator, dtype=torch.float64)
    variances = 0.01 + 0.01 * torch.rand(4, 3, generator=generator, dtype=torch.float64)
    pooled = {}
    for dtype in (torch.float32, torch.float64):
        norm = TimestepBatchNorm(3, max_steps=4, beyond_max_steps="pooled", dtype=dtype)
        norm.running_mean.copy_(means)
        norm.running_var.copy_(variances)
        norm.num_batches_tracked.copy_(torch.tensor([4, 3, 2, 1]))
        pooled[dtype] = norm.pooled_moments()
    exact_mean, exact_var = pooled[torch.float64]
    mean, var = pooled[torch.float32]
    assert_close(mean.double(), exact_mean, rtol=1e-6, atol=0)
    assert_close(var.double(), exact_var, rtol=1e-4, atol=0)
    # the mixture's variance: within-step variance plus the spread of the step means
    weights = torch.tensor([4.0, 3.0, 2.0, 1.0], dtype=torch.float64).unsqueeze(1) / 10
    expected = (weights * (variances + (means - exact_mean).square())).sum(0)
    assert_close(exact_var, expected)


@pytest.mark.parametrize("kernels_on", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_a_fused_steps_backward_survives_a_later_update_of_the_running_statistics(
    masked: bool, kernels_on: bool
) -> None:
    """A training step's fused kernel (``forward_step``: torch's ``native_batch_norm`` without the compiled kernels,
    their norm with them) updates its running row in place, and autograd saves the running tensors handed to torch's:
    a later in-place write to the buffers (here ``forward()``'s update of the next step) must leave the step's
    backward valid. Outputs, gradients and buffers are ``forward()``'s, padded rows included (their gradient is zero,
    as a cell passes them)."""
    torch.manual_seed(0)
    fused, reference = (TimestepBatchNorm(3, max_steps=4, dtype=torch.float64).train() for _ in range(2))
    x, later = torch.randn(5, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    mask = torch.tensor([True, True, False, True, False]) if masked else None
    weights = torch.randn(5, 3, dtype=torch.float64) * (1.0 if mask is None else mask.unsqueeze(1))
    outputs, grads = [], []
    for norm, step in ((fused, fused.forward_step), (reference, reference.forward)):
        leaf = x.clone().requires_grad_()
        with contextlib.nullcontext() if kernels_on else seqnorm.kernels.disabled():
            y = step(leaf, 1, mask)
        norm(later, 2)  # forward(): the next step's row updated in place
        grads.append(torch.autograd.grad((y * weights).sum(), [leaf, norm.weight]))
        outputs.append(y.detach())
    assert_close(outputs[0], outputs[1])
    assert_close(grads[0], grads[1])
    assert_close(fused.state_dict(), reference.state_dict())


@pytest.mark.parametrize("masked", [False, True])
def test_a_strided_gain_gets_the_gradient_of_a_dense_one_in_a_cells_step(masked: bool) -> None:
    """``load_state_dict(assign=True)`` can leave γ strided; a training step's fused BatchNorm (``forward_step``) then
    handed it to aten's CPU backward, which reads it as dense rows: gradients 1e7 off. Without the compiled kernels
    this is also the layers' loop."""
    torch.manual_seed(0)
    dense = TimestepBatchNorm(3, max_steps=4, dtype=torch.float64).train()
    with torch.no_grad():
        dense.weight.uniform_(0.5, 1.5)
    wide = torch.full((3, 2), 1e6, dtype=torch.float64)
    wide[:, 0] = dense.weight.detach()
    strided = TimestepBatchNorm(3, max_steps=4, dtype=torch.float64).train()
    strided.load_state_dict({**dense.state_dict(), "weight": wide[:, 0]}, assign=True)
    assert not strided.weight.is_contiguous()
    x = torch.randn(5, 3, dtype=torch.float64)
    mask = torch.tensor([True, True, False, True, True]) if masked else None
    grads = []
    for norm in (dense, strided):
        leaf = x.clone().requires_grad_()
        y = norm.forward_step(leaf, 1, mask)
        grads.append(torch.autograd.grad((y * torch.arange(15.0, dtype=y.dtype).view(5, 3)).sum(), [leaf, norm.weight]))
    assert_close(grads[1], grads[0])


def test_a_steps_mask_is_read_from_the_device_once_and_again_after_it_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cell's step hands one mask to its three norms: each counted its real rows with a host sync of its own.
    The count is kept for that mask; the same tensor written in place, or another one, is counted again."""
    from seqnorm.norms import batch

    reads = []
    nonzero = torch.Tensor.nonzero
    monkeypatch.setattr(torch.Tensor, "nonzero", lambda self, *a, **k: reads.append(self) or nonzero(self, *a, **k))
    cell = seqnorm.LSTMCell(3, 4, norm="batch")
    x, mask = torch.randn(5, 3), torch.tensor([True, True, True, False, False])
    reference = [TimestepBatchNorm(16), TimestepBatchNorm(16)]  # alike: γ 0.1, β 0, zero running statistics
    cell(x, step=0, mask=mask)
    assert sum(read is mask for read in reads) == 1  # three norms, one read
    assert batch.real_rows(mask) == 3
    mask[3] = True  # in place: counted again
    assert batch.real_rows(mask) == 4
    assert batch.real_rows(mask.clone()) == 4 and batch.real_rows(torch.ones(5, dtype=torch.bool)) == 5
    # the statistics are those of the real rows, as forward() computes them (its own count)
    y = reference[0].forward_step(x[:, :1].repeat(1, 16), 0, mask)
    assert_close(y, reference[1](x[:, :1].repeat(1, 16), 0, mask))


def test_which_form_runs_a_training_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Who calls what in a cell's training step, so that no branch is kept that nothing reaches. Where the compiled
    kernels are loaded, every training step of plain BN and batch renorm (batch and tail steps) is the kernels' norm
    (_kernel_step), unless the instance is outside the form (here a strided γ). Without them: plain BN's batch steps
    are torch's fused kernels (forward_step's own), its tail steps the pieces' running-statistics step; batch
    renorm's batch steps are its own pieces' step, whose moments come from the fused kernel (_fused_step)."""
    from seqnorm.norms import batch_pieces

    require_kernels()
    calls: list[str] = []

    def spy(owner: object, name: str) -> None:
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *args, **kw: calls.append(name) or real(*args, **kw))

    spy(TimestepBatchNorm, "_fused_forward_step")
    spy(batch_pieces.BatchNormPieces, "_kernel_step")
    spy(batch_pieces.BatchNormPieces, "step_forward")
    spy(batch_pieces.BatchNormPieces, "_fused_step")
    spy(TimestepBatchRenorm, "step_forward")
    x = torch.randn(4, 6)
    tail = torch.tensor([True, False, False, False])
    norm = TimestepBatchNorm(6)
    norm.forward_step(x, 0)
    norm.forward_step(x, 1, tail)
    TimestepBatchRenorm(6, warmup=0).forward_step(x, 0)
    assert calls == ["_kernel_step"] * 3 and norm.fallback_steps == 1
    calls.clear()
    strided = TimestepBatchNorm(6)
    strided.load_state_dict({**strided.state_dict(), "weight": torch.ones(6, 2)[:, 0]}, assign=True)
    strided.forward_step(x, 0)
    assert calls == ["_fused_forward_step"]
    calls.clear()
    with seqnorm.kernels.disabled():
        norm.forward_step(x, 0)
        assert calls == ["_fused_forward_step"]
        calls.clear()
        norm.forward_step(x, 1, tail)
        assert calls == ["step_forward"] and norm.fallback_steps == 2  # the pieces, on running statistics
        calls.clear()
        TimestepBatchRenorm(6, warmup=0).forward_step(x, 0)
        assert calls == ["step_forward", "_fused_step"]


@pytest.mark.parametrize("cls", [TimestepBatchNorm, TimestepBatchRenorm])
def test_the_kernels_step_equals_torchs_and_follows_changes_to_the_module(cls: type) -> None:
    """A cell's training step by the compiled kernels' norm (_kernel_step) against the same step in torch's ops (the
    kernels switched off): outputs, gradients, running statistics and fallback counts, over steps that own a row,
    share the last one, are masked, and fall back to running statistics (one real row). The kernels' arguments are
    kept between steps: a changed momentum, buffers loaded with assign=True and a dtype conversion must each reach
    the next step (a stale copy would update the statistics by the old rule, or write into released buffers)."""
    require_kernels()
    torch.manual_seed(0)
    options = {"warmup": 0, "r_max": 1.5, "d_max": 0.5} if cls is TimestepBatchRenorm else {}
    kernel, plain = (cls(6, max_steps=3, dtype=torch.float64, **options).train() for _ in range(2))
    with torch.no_grad():
        for norm in (kernel, plain):
            norm.weight.copy_(torch.linspace(0.5, 1.5, 6))
    masks = [None, torch.tensor([True, False, True, True, False]), torch.tensor([False, False, True, False, False])]

    def steps(dtype: torch.dtype, tolerance: float, by_kernel: bool = True) -> None:
        for step in range(5):
            for mask in masks:
                x = torch.randn(5, 6, dtype=dtype)
                weights = torch.randn(5, 6, dtype=dtype) * (1.0 if mask is None else mask.unsqueeze(1))
                results = []
                for norm, off in ((kernel, False), (plain, True)):
                    leaf = x.clone().requires_grad_()
                    with seqnorm.kernels.disabled() if off else contextlib.nullcontext():
                        y = norm.forward_step(leaf, step, mask)
                    results.append([y, *torch.autograd.grad((y * weights).sum(), [leaf, norm.weight])])
                assert (results[0][0].grad_fn.name() == "NormStepBackward") == by_kernel
                assert_close(results[0], results[1], rtol=tolerance, atol=tolerance)
        assert_close(kernel.state_dict(), plain.state_dict(), rtol=tolerance, atol=tolerance)
        assert kernel.fallback_steps == plain.fallback_steps > 0

    steps(torch.float64, 1e-12)
    for norm in (kernel, plain):
        norm.momentum = 0.5
    steps(torch.float64, 1e-12)
    fresh = {**dict(plain.named_buffers()), "running_mean": torch.randn(3, 6, dtype=torch.float64)}
    for norm in (kernel, plain):  # new buffers, the same parameters
        norm.load_state_dict({name: tensor.clone() for name, tensor in fresh.items()}, strict=False, assign=True)
    steps(torch.float64, 1e-12)
    for norm in (kernel, plain):
        norm.float()
    steps(torch.float32, 1e-5)
    for norm in (kernel, plain):  # γ's memory swapped for a strided view: the kernels would read a stale dense copy
        norm.weight.data = torch.stack([norm.weight.detach(), torch.zeros(6)], 1)[:, 0]
    steps(torch.float32, 1e-5, by_kernel=False)


def test_the_kernels_step_node_holds_its_module_weakly() -> None:
    """The kernels' step is a node made in C++ (NormStepBackward), which Python's collector cannot see through: a
    module keeping an output of its own step (a hook's record) would be a cycle never collected if the node held the
    module, so it holds it weakly; the module is needed only for a second derivative, which then says it is gone."""
    import gc
    import weakref

    require_kernels()
    x, mask = torch.randn(4, 6, requires_grad=True), torch.tensor([True, True, True, False])
    norm = TimestepBatchNorm(6, max_steps=3)
    y = norm.forward_step(x, 1, mask)
    assert y.grad_fn.name() == "NormStepBackward"
    norm.kept = y  # module -> output -> node (-> module, were it held)
    held = weakref.ref(norm)
    del norm, y
    gc.collect()
    assert held() is None
    norm = TimestepBatchNorm(6, max_steps=3)
    y = norm.forward_step(x, 1, mask)
    (grad,) = torch.autograd.grad(y.square().sum(), x, create_graph=True, retain_graph=True)
    assert grad.requires_grad  # the second derivative's graph, through the module's own backward
    del norm
    gc.collect()
    with pytest.raises(RuntimeError, match="expected the norm module of this step for its second derivative"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)


@pytest.mark.parametrize("dual_of", ["x", "weight", "bias"])
@pytest.mark.parametrize("kernels_on", [True, False])
@pytest.mark.parametrize("cls", [TimestepBatchNorm, TimestepBatchRenorm])
def test_a_steps_forward_mode_derivative_equals_finite_differences(cls: type, kernels_on: bool, dual_of: str) -> None:
    """Forward-mode AD through a cell's training step (a dual input, γ or β): the kernels' node and the pieces' node
    have no forward derivative and leave a dual tensor to torch's ops (the fused kernel, or forward()), whose tangent
    of the real rows equals central differences, over batch steps, masked steps and a one-row tail step (float64)."""
    import copy

    import torch.autograd.forward_ad as forward_ad

    if kernels_on:
        require_kernels()
    torch.manual_seed(0)
    options = {"warmup": 0, "r_max": 1.5, "d_max": 0.5} if cls is TimestepBatchRenorm else {}
    norm = cls(6, max_steps=3, dtype=torch.float64, **options)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 6))
        norm.bias.copy_(torch.linspace(-0.5, 0.5, 6))
    values = {"x": torch.randn(5, 6, dtype=torch.float64), "weight": norm.weight.detach(), "bias": norm.bias.detach()}
    direction = torch.randn_like(values[dual_of])

    def step(changed: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The step on a fresh copy of ``norm`` (the same running statistics each time), ``dual_of`` ``changed``."""
        module, given = copy.deepcopy(norm), {**values, dual_of: changed}
        module._parameters.update(weight=given["weight"], bias=given["bias"])  # plain or dual tensors in their place
        return module.forward_step(given["x"], 1, mask)

    masks = [None, torch.tensor([True, False, True, True, False]), torch.tensor([False, True, False, False, False])]
    with contextlib.nullcontext() if kernels_on else seqnorm.kernels.disabled():
        for mask in masks:
            with forward_ad.dual_level():
                tangent = forward_ad.unpack_dual(step(forward_ad.make_dual(values[dual_of], direction), mask)).tangent
            ahead, behind = (step(values[dual_of] + h * direction, mask) for h in (1e-6, -1e-6))
            real = slice(None) if mask is None else mask
            assert_close(tangent[real], ((ahead - behind) / 2e-6)[real], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kernels_on", [True, False])
@pytest.mark.parametrize("cls", [TimestepBatchNorm, TimestepBatchRenorm])
def test_a_steps_mask_written_in_place_before_its_backward_is_refused_or_harmless(cls: type, kernels_on: bool) -> None:
    """A loop may reuse one mask tensor and write the next step's rows into it before the backward. A norm's step
    whose backward reads the mask again (the kernels' node, the pieces' node) must refuse that; one that kept what it
    needs (the fused path's row indices) must give the gradient of the mask it ran with. Never another's gradient."""
    if kernels_on:
        require_kernels()
    torch.manual_seed(0)
    norm = cls(6, max_steps=3, dtype=torch.float64, **({"warmup": 0} if cls is TimestepBatchRenorm else {}))
    x, weights = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    grads = []
    for mutate in (False, True):
        mask = torch.tensor([True, True, False, True, False])
        leaf = x.clone().requires_grad_()
        with contextlib.nullcontext() if kernels_on else seqnorm.kernels.disabled():
            y = norm.forward_step(leaf, 0, mask)
        loss = (y * weights * torch.tensor([True, True, False, True, False]).unsqueeze(1)).sum()
        if mutate:
            mask[2] = True
            try:
                grads.append(torch.autograd.grad(loss, leaf)[0])
            except RuntimeError as error:
                assert "modified by an inplace operation" in str(error)
                return
        else:
            grads.append(torch.autograd.grad(loss, leaf)[0])
    assert_close(grads[1], grads[0])
