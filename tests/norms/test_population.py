"""Exact population statistics (seqnorm.update_bn) and cumulative running averages (momentum=None)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence
from torch.testing import assert_close

import seqnorm
from seqnorm.norms import BatchNormSpec, TimestepBatchNorm
from tests.conftest import BATCH_NORMS, KINDS, LAYERS

# Batches of different sizes and lengths: (T, B) with each row's length.
BATCHES = [(7, [7, 3, 5]), (4, [4, 4, 1, 2, 3]), (9, [2, 9]), (3, [3, 1, 2, 3])]


def _padded_batches(features: int, dtype: torch.dtype = torch.float64) -> list[tuple[Tensor, Tensor]]:
    torch.manual_seed(3)
    batches = []
    for steps, lengths in BATCHES:
        x = torch.randn(steps, len(lengths), features, dtype=dtype) * 2 + torch.arange(steps).view(steps, 1, 1)
        batches.append((x, torch.tensor(lengths)))
    return batches


def _expected(batches: list[tuple[Tensor, Tensor]], max_steps: int) -> tuple[Tensor, Tensor, Tensor]:
    """Mean, unbiased variance and row count per row of statistics, from the real rows alone (steps >= max_steps
    pool into the last row)."""
    rows: dict[int, list[Tensor]] = {}
    for x, lengths in batches:
        for t in range(x.shape[0]):
            rows.setdefault(min(t, max_steps - 1), []).append(x[t, lengths > t])
    features = batches[0][0].shape[-1]
    mean = torch.zeros(max_steps, features, dtype=torch.float64)
    var = torch.ones(max_steps, features, dtype=torch.float64)
    count = torch.zeros(max_steps)
    for row, parts in rows.items():
        values = torch.cat(parts)
        mean[row], count[row] = values.mean(0), len(values)
        if len(values) >= 2:
            var[row] = values.var(0, unbiased=True)
    return mean, var, count


class _Packed(nn.Module):
    """A model that takes a PackedSequence and normalizes it per step with a TimestepBatchNorm."""

    def __init__(self, norm: TimestepBatchNorm) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, packed: PackedSequence) -> Tensor:
        x, lengths = pad_packed_sequence(packed)
        mask = torch.arange(x.shape[0]).unsqueeze(1) < lengths.unsqueeze(0)  # (T, B)
        return self.norm.forward_sequence(x, mask)


def test_update_bn_is_the_exact_moments_of_the_real_rows() -> None:
    max_steps = 5  # lengths reach 9: steps 4..8 pool into the last row
    norm = TimestepBatchNorm(3, max_steps, dtype=torch.float64)
    batches = _padded_batches(3)
    loader = [pack_padded_sequence(x, lengths, enforce_sorted=False) for x, lengths in batches]
    model = _Packed(norm).eval()
    weight_before = norm.weight.detach().clone()
    seqnorm.update_bn(loader, model)
    mean, var, count = _expected(batches, max_steps)
    assert (count >= 2).all()
    assert_close(norm.running_mean, mean, rtol=1e-12, atol=1e-12)
    assert_close(norm.running_var, var, rtol=1e-12, atol=1e-12)
    # padding values do not matter: make them huge and the result is the same
    for x, lengths in batches:
        x[torch.arange(x.shape[0]).unsqueeze(1) >= lengths] = 1e6
    seqnorm.update_bn(loader, model)
    assert_close(norm.running_mean, mean, rtol=1e-12, atol=1e-12)
    assert not model.training and not norm.training
    assert torch.equal(norm.weight, weight_before)
    assert norm.num_batches_tracked.sum() == 0  # counts training batches only


def test_not_an_average_of_batch_moments() -> None:
    # A batch of 2 rows and one of 20: the exact mean weights rows, not batches.
    norm = TimestepBatchNorm(1, 1, dtype=torch.float64)
    small, large = torch.zeros(1, 2, 1, dtype=torch.float64), torch.ones(1, 20, 1, dtype=torch.float64)
    seqnorm.update_bn([small, large], _Sequence(norm))
    assert_close(norm.running_mean[0], torch.tensor([20 / 22], dtype=torch.float64))


class _Sequence(nn.Module):
    def __init__(self, norm: TimestepBatchNorm) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: Tensor) -> Tensor:
        return self.norm.forward_sequence(x)


@pytest.mark.parametrize("kind", KINDS)
def test_update_bn_on_a_layer_gives_the_input_terms_moments(kind: str) -> None:
    # The input term W_ih x_t depends on the data only, so its moments can be computed here; the layer takes
    # PackedSequences (lengths) and padded tensors (all rows real) alike.
    layer = LAYERS[kind](3, 4, norm="batch", max_steps=6, dtype=torch.float64)
    batches = _padded_batches(3)
    loader = [(pack_padded_sequence(x, lengths, enforce_sorted=False), "label") for x, lengths in batches]
    full = torch.randn(5, 3, 3, dtype=torch.float64)
    loader.append((full, "a padded tensor: every row real"))
    seqnorm.update_bn(loader, layer)
    weight = layer.cells[0].weight_ih.detach()
    terms = [(x @ weight.T, lengths) for x, lengths in batches] + [(full @ weight.T, torch.full((3,), 5))]
    mean, var, _ = _expected(terms, 6)
    norm = layer.cells[0].norm_ih
    assert_close(norm.running_mean, mean, rtol=1e-10, atol=1e-10)
    assert_close(norm.running_var, var, rtol=1e-10, atol=1e-10)
    assert layer.training  # it was in training mode before


@pytest.mark.parametrize("norm", BATCH_NORMS)
def test_modes_parameters_and_counts_are_left_alone(norm: str) -> None:
    model = nn.Sequential(nn.Dropout(0.5), LAYERS["lstm"](3, 4, norm=norm))
    model.train()
    model[0].eval()  # a module in another mode than its parent keeps it
    model(torch.randn(4, 3, 3))  # a training step: counts batches
    modes = {name: module.training for name, module in model.named_modules()}
    parameters = {name: p.detach().clone() for name, p in model.named_parameters()}
    tracked = {name: b.clone() for name, b in model.named_buffers() if name.endswith("num_batches_tracked")}
    seqnorm.update_bn([torch.randn(4, 3, 3) for _ in range(3)], model)
    assert {name: module.training for name, module in model.named_modules()} == modes
    for name, p in model.named_parameters():
        assert torch.equal(p, parameters[name]), name
    for name, buffer in model.named_buffers():
        if name in tracked:
            assert torch.equal(buffer, tracked[name]), name


def test_steps_the_loader_never_reaches_keep_their_statistics() -> None:
    norm = TimestepBatchNorm(2, 4)
    norm.running_mean[2:] = 7.0
    norm.running_var[2:] = 3.0
    seqnorm.update_bn([torch.randn(2, 5, 2) for _ in range(2)], _Sequence(norm))
    assert torch.equal(norm.running_mean[2:], torch.full((2, 2), 7.0))
    assert torch.equal(norm.running_var[2:], torch.full((2, 2), 3.0))
    assert not torch.equal(norm.running_mean[:2], torch.full((2, 2), 7.0))


def test_batch_size_one_loader_and_single_row_steps_count() -> None:
    # No small-batch error while collecting: one-row steps are normalized with the running statistics, and their
    # rows still enter the population.
    layer = LAYERS["lstm"](2, 3, norm="batch", max_steps=4, dtype=torch.float64)
    batches = [torch.randn(4, 1, 2, dtype=torch.float64) for _ in range(5)]
    seqnorm.update_bn(batches, layer)
    weight = layer.cells[0].weight_ih.detach()
    terms = [(x @ weight.T, torch.tensor([4])) for x in batches]
    mean, var, _ = _expected(terms, 4)
    assert_close(layer.cells[0].norm_ih.running_mean, mean)
    assert_close(layer.cells[0].norm_ih.running_var, var)


def test_device_argument_and_dict_batches_with_forward() -> None:
    norm = TimestepBatchNorm(2, 3, dtype=torch.float64)
    batches = _padded_batches(2)
    loader = [{"inputs": x, "lengths": lengths} for x, lengths in batches]

    def forward(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        packed = pack_padded_sequence(batch["inputs"], batch["lengths"], enforce_sorted=False)
        return model(packed)

    seqnorm.update_bn(loader, _Packed(norm), device="cpu", forward=forward)
    mean, var, _ = _expected(batches, 3)
    assert_close(norm.running_mean, mean)
    assert_close(norm.running_var, var)


def test_empty_loader_and_interrupted_pass_change_nothing() -> None:
    norm = TimestepBatchNorm(2, 3)
    model = _Sequence(norm)
    with pytest.raises(ValueError, match=r"^update_bn: expected a loader with at least one batch, got an empty one"):
        seqnorm.update_bn([], model)

    def broken():
        yield torch.randn(3, 4, 2)
        raise RuntimeError("disk gone")

    with pytest.raises(RuntimeError, match="disk gone"):
        seqnorm.update_bn(broken(), model)
    assert torch.equal(norm.running_mean, torch.zeros(3, 2)) and torch.equal(norm.running_var, torch.ones(3, 2))
    assert norm.fused_update  # not left collecting: training updates the running statistics again
    norm.train()
    norm(torch.randn(4, 2) + 5, step=0)
    assert norm.running_mean[0].mean() > 0.3


def test_model_without_batch_norm_is_left_alone() -> None:
    layer = LAYERS["lstm"](2, 3, norm="layer")
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    seqnorm.update_bn([torch.randn(3, 2, 2)], layer)
    assert all(torch.equal(v, state[k]) for k, v in layer.state_dict().items())


# --- momentum=None: cumulative averages, as torch.nn.BatchNorm1d ---


def test_momentum_none_is_torch_batchnorm1d_cumulative_average() -> None:
    norm = TimestepBatchNorm(3, 2, momentum=None, gain=1.0, dtype=torch.float64)
    reference = nn.BatchNorm1d(3, momentum=None, dtype=torch.float64)
    for batch in (4, 7, 2, 9):
        x = torch.randn(batch, 3, dtype=torch.float64) * 3 + 1
        assert_close(norm(x, step=1), reference(x))
    assert_close(norm.running_mean[1], reference.running_mean)
    assert_close(norm.running_var[1], reference.running_var)
    assert norm.num_batches_tracked.tolist() == [0, 4]
    assert torch.equal(norm.running_mean[0], torch.zeros(3))


@pytest.mark.parametrize("kind", KINDS)
def test_momentum_none_layer_paths_agree(kind: str) -> None:
    # The fused kernel takes a float momentum: with None every path must use the cumulative rule alike.
    torch.manual_seed(0)
    layers = {}
    for impl in ("reference", "auto"):
        torch.manual_seed(0)
        layers[impl] = LAYERS[kind](
            3, 4, norm=BatchNormSpec(momentum=None), max_steps=5, impl=impl, dtype=torch.float64
        )
    for _ in range(3):
        x = torch.randn(6, 4, 3, dtype=torch.float64)
        for layer in layers.values():
            layer(x, lengths=torch.tensor([6, 5, 2, 6]))[0].sum().backward()
    reference, fast = layers["reference"].state_dict(), layers["auto"].state_dict()
    for name, value in reference.items():
        assert_close(fast[name], value, rtol=1e-9, atol=1e-9, msg=name)


def test_momentum_none_in_specs_and_errors() -> None:
    assert seqnorm.norms.BatchNormSpec(momentum=None).momentum is None
    with pytest.raises(ValueError, match=r"momentum to be a finite number in \[0, 1\] or None, got 2.0"):
        LAYERS["lstm"](3, 4, norm=BatchNormSpec(momentum=2.0))


def test_update_bn_passes_do_not_count_as_fallback_steps() -> None:
    layer = LAYERS["lstm"](2, 3, norm="batch")
    x = torch.randn(5, 3, 2)
    layer(x, lengths=torch.tensor([5, 2, 3]))
    counts = [m.fallback_steps for m in layer.modules() if isinstance(m, TimestepBatchNorm)]
    assert counts == [2, 2, 2]
    seqnorm.update_bn([(x, torch.tensor([5, 2, 3]))], layer, forward=lambda m, b: m(b[0], lengths=b[1]))
    assert [m.fallback_steps for m in layer.modules() if isinstance(m, TimestepBatchNorm)] == counts
