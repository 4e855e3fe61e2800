"""norm="none" is torch.nn.LSTM / GRU / LSTMCell / GRUCell: outputs and gradients in float64, and state dicts."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.testing import assert_close

import seqnorm
from tests.conftest import CELLS, LAYERS, TORCH_KINDS

# Each registered cell that declares torch's step, with torch's module of that kernel.
_TORCH = {"lstm": (nn.LSTMCell, nn.LSTM), "gru": (nn.GRUCell, nn.GRU)}
TORCH_CELLS = {kind: (_TORCH[CELLS[kind].torch_kernel][0], CELLS[kind]) for kind in TORCH_KINDS}
TORCH_LAYERS = {kind: (_TORCH[CELLS[kind].torch_kernel][1], LAYERS[kind]) for kind in TORCH_KINDS}


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.grad for name, param in module.state_dict(keep_vars=True).items()}


def _flat(output: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return output if isinstance(output, tuple) else (output,)


@pytest.mark.parametrize("kind", TORCH_KINDS)
@pytest.mark.parametrize("bias", [True, False])
def test_cell_matches_torch(kind: str, bias: bool) -> None:
    torch_cls, ours_cls = TORCH_CELLS[kind]
    reference = torch_cls(5, 7, bias=bias, dtype=torch.float64)
    cell = ours_cls(5, 7, bias=bias, dtype=torch.float64)
    cell.load_state_dict(reference.state_dict())
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    h = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    state = (h, torch.randn(4, 7, dtype=torch.float64)) if kind == "lstm" else h
    results = []
    for module in (reference, cell):
        output = _flat(module(x, state))
        loss = sum((t * torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view_as(t)).sum() for t in output)
        results.append((output, torch.autograd.grad(loss, [x, h, *module.parameters()])))
    (expected, expected_grads), (got, grads) = results
    assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert_close(grads, expected_grads, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_unbatched_cell_input_matches_torch(kind: str) -> None:
    """torch's cells take ``(input_size,)`` with ``(H,)`` states and return ``(H,)``; so do ours, every norm."""
    torch_cls, ours_cls = TORCH_CELLS[kind]
    reference = torch_cls(3, 4, dtype=torch.float64)
    cell = ours_cls(3, 4, dtype=torch.float64)
    cell.load_state_dict(reference.state_dict())
    x = torch.randn(3, dtype=torch.float64)
    state = (torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64))
    hx = state if kind == "lstm" else state[0]
    for given in (None, hx):
        got, expected = cell(x, given), reference(x, given)
        assert_close(got, expected, rtol=1e-12, atol=1e-12)
    for norm in ("layer", "batch"):
        normed = ours_cls(3, 4, norm=norm, dtype=torch.float64).eval()
        batched = normed(x.unsqueeze(0), None, step=0)
        unbatched = normed(x, None, step=0)
        assert_close(unbatched, tuple(t[0] for t in batched) if kind == "lstm" else batched[0])
    with pytest.raises(ValueError, match=r"expected h of shape \(hidden,\) with an unbatched input, got \(1, 4\)"):
        cell(x, tuple(t.unsqueeze(0) for t in state) if kind == "lstm" else state[0].unsqueeze(0))


@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_cell_state_dict_is_torch_state_dict(kind: str) -> None:
    torch_cls, ours_cls = TORCH_CELLS[kind]
    ours = ours_cls(3, 4)
    assert list(ours.state_dict()) == list(torch_cls(3, 4).state_dict())
    reference = torch_cls(3, 4)
    reference.load_state_dict(ours.state_dict())  # and the other way round
    x = torch.randn(2, 3)
    assert_close(ours(x), reference(x))


@pytest.mark.parametrize("kind", TORCH_KINDS)
@pytest.mark.parametrize(
    ("num_layers", "bidirectional", "batch_first", "bias"),
    [(1, False, False, True), (2, True, False, True), (3, False, True, False), (2, True, True, True)],
)
def test_layer_matches_torch(kind: str, num_layers: int, bidirectional: bool, batch_first: bool, bias: bool) -> None:
    torch_cls, ours_cls = TORCH_LAYERS[kind]
    reference = torch_cls(
        4, 6, num_layers, bias=bias, batch_first=batch_first, bidirectional=bidirectional, dtype=torch.float64
    )
    layer = ours_cls.from_torch(reference)
    assert list(layer.state_dict()) == list(reference.state_dict())
    directions = 2 if bidirectional else 1
    x = torch.randn((3, 5, 4) if batch_first else (5, 3, 4), dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(num_layers * directions, 3, 6, dtype=torch.float64)
    hx = (h0, torch.randn_like(h0)) if kind == "lstm" else h0
    expected_out, expected_state = reference(x, hx)
    out, state = layer(x, hx)
    assert_close(out, expected_out, rtol=1e-12, atol=1e-12)
    assert_close(state, expected_state, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(out)
    expected_grads = torch.autograd.grad((expected_out * weights).sum(), [x, *reference.parameters()])
    grads = torch.autograd.grad((out * weights).sum(), [x, *layer.parameters()])
    assert len(grads) == len(expected_grads)
    # parameters() order differs (torch: per layer ih, hh, bias; ours: per cell) -> compare by state-dict name
    assert_close(grads[0], expected_grads[0], rtol=1e-12, atol=1e-12)
    ours_by_name = dict(zip(layer.state_dict(), grads[1:], strict=True))
    for name, grad in zip(reference.state_dict(), expected_grads[1:], strict=True):
        assert_close(ours_by_name[name], grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", TORCH_KINDS)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_packed_sequence_matches_torch(kind: str, bidirectional: bool) -> None:
    torch_cls, ours_cls = TORCH_LAYERS[kind]
    reference = torch_cls(4, 6, 2, bidirectional=bidirectional, dtype=torch.float64)
    layer = ours_cls.from_torch(reference)
    lengths = torch.tensor([3, 7, 1, 5, 7])
    x = torch.randn(7, 5, 4, dtype=torch.float64, requires_grad=True)
    packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
    expected_out, expected_state = reference(packed)
    out, state = layer(packed)
    assert isinstance(out, torch.nn.utils.rnn.PackedSequence)
    assert torch.equal(out.batch_sizes, expected_out.batch_sizes)
    assert torch.equal(out.sorted_indices, expected_out.sorted_indices)
    assert_close(out.data, expected_out.data, rtol=1e-12, atol=1e-12)
    assert_close(state, expected_state, rtol=1e-12, atol=1e-12)
    (grad_expected,) = torch.autograd.grad(expected_out.data.sum(), x, retain_graph=True)
    (grad,) = torch.autograd.grad(out.data.sum(), x)
    assert_close(grad, grad_expected, rtol=1e-12, atol=1e-12)
    # the lengths path gives the same as the packed path, with zeros at padding
    padded_out, state_from_lengths = layer(x, lengths=lengths)
    expected_padded, _ = pad_packed_sequence(expected_out, total_length=7)
    assert_close(padded_out, expected_padded, rtol=1e-12, atol=1e-12)
    assert_close(state_from_lengths, expected_state, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_unbatched_input_matches_torch(kind: str) -> None:
    torch_cls, ours_cls = TORCH_LAYERS[kind]
    reference = torch_cls(4, 6, 2, dtype=torch.float64)
    layer = ours_cls.from_torch(reference)
    x = torch.randn(5, 4, dtype=torch.float64)
    assert_close(layer(x), reference(x), rtol=1e-12, atol=1e-12)


def test_torch_attribute_names_resolve_to_cells() -> None:
    layer = seqnorm.LSTM(3, 4, num_layers=2, bidirectional=True)
    assert layer.weight_ih_l1_reverse is layer.cells[3].weight_ih
    assert layer.bias_hh_l0 is layer.cells[0].bias_hh
    with pytest.raises(AttributeError):
        _ = layer.weight_ih_l2
    with pytest.raises(AttributeError):
        _ = seqnorm.LSTM(3, 4).weight_ih_l0_reverse


@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_torch_attribute_names_are_what_torch_has_and_assign_the_cells_weights(kind: str) -> None:
    """An assignment under torch's name set a new attribute of the layer that read back while the cells went on
    with the old weight; a projection or bias that is not there read as None (``hasattr`` said it was)."""
    reference = TORCH_LAYERS[kind][0](3, 4, num_layers=2, bias=False, dtype=torch.float64)
    layer = LAYERS[kind](3, 4, num_layers=2, bias=False, dtype=torch.float64)
    for name in ("bias_ih_l0", "weight_hr_l0"):
        assert hasattr(layer, name) is hasattr(reference, name) is False
    for name, value in reference.named_parameters():
        setattr(layer, name, nn.Parameter(value.detach().clone()))
        assert getattr(layer, name) is dict(layer.named_parameters())[_ours(layer, name)]
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    assert_close(layer(x), reference(x), rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match=r"torch\.nn\.Parameter or None expected"):  # as torch says of a plain tensor
        layer.weight_hh_l1 = torch.zeros(layer.weight_hh_l1.shape, dtype=torch.float64)


def _ours(layer: nn.Module, torch_name: str) -> str:
    """The name in ``layer.named_parameters()`` of the weight torch calls ``torch_name``."""
    owner, attribute = layer._torch_named(torch_name)
    return next(f"{prefix}.{attribute}" for prefix, cell in layer.named_modules() if cell is owner)


@pytest.mark.parametrize("kind", TORCH_KINDS)
@pytest.mark.parametrize(("bias", "proj_size"), [(True, 0), (False, 0), (True, 2)])
def test_torch_layer_api_for_drop_in_code(kind: str, bias: bool, proj_size: int) -> None:
    """``all_weights`` lists torch's tensors in torch's order; ``flatten_parameters()`` runs; dropout with one layer
    warns as torch does."""
    if proj_size and not CELLS[kind].supports_projection:
        pytest.skip("torch's GRU has no proj_size")
    options = {"proj_size": proj_size} if proj_size else {}
    reference = TORCH_LAYERS[kind][0](3, 4, num_layers=2, bidirectional=True, bias=bias, **options)
    layer = LAYERS[kind](3, 4, num_layers=2, bidirectional=True, bias=bias, **options)
    layer.load_state_dict(reference.state_dict())
    ours, theirs = layer.all_weights, reference.all_weights
    assert [len(weights) for weights in ours] == [len(weights) for weights in theirs]
    for mine, torch_weights in zip(ours, theirs, strict=True):
        for got, expected in zip(mine, torch_weights, strict=True):
            assert torch.equal(got, expected)
    assert layer.flatten_parameters() is None
    with pytest.warns(UserWarning, match=r"dropout=0.5 has no effect with num_layers=1"):
        LAYERS[kind](3, 4, dropout=0.5)


def test_from_torch_rejects_wrong_module() -> None:
    with pytest.raises(ValueError, match=r"LSTM.from_torch: expected a torch.nn.LSTM, got"):
        seqnorm.LSTM.from_torch(nn.GRU(3, 4))


@pytest.mark.parametrize("norm", [name for name in seqnorm.NORMS if name != "weight"])
@pytest.mark.parametrize(("ours_cls", "torch_cls"), [(seqnorm.LSTM, nn.LSTM), (seqnorm.GRU, nn.GRU)])
def test_from_torch_with_a_norm_keeps_the_weights(ours_cls: type, torch_cls: type, norm: str) -> None:
    """``from_torch(module, norm=...)``: torch's weights copied, the norms at their initial values, keywords pass."""
    reference = torch_cls(3, 4, num_layers=2, bidirectional=True)
    layer = ours_cls.from_torch(reference, norm=norm, batch_first=True)
    assert layer.batch_first
    fresh = ours_cls(3, 4, num_layers=2, bidirectional=True, norm=norm)
    for (name, value), (fresh_name, fresh_value) in zip(
        layer.state_dict().items(), fresh.state_dict().items(), strict=True
    ):
        assert name == fresh_name
        if ".norm_" in name:
            assert torch.equal(value, fresh_value), name
    for index, cell in enumerate(layer.cells):
        suffix = f"_l{index // 2}" + ("_reverse" if index % 2 else "")
        assert torch.equal(cell.weight_ih, getattr(reference, "weight_ih" + suffix))
        assert torch.equal(cell.bias_hh, getattr(reference, "bias_hh" + suffix))


def test_from_torch_refuses_weight_norm_clearly() -> None:
    with pytest.raises(ValueError, match=r"LSTM.from_torch: expected a norm under which torch's weights stay"):
        seqnorm.LSTM.from_torch(nn.LSTM(3, 4), norm="weight")


@pytest.mark.parametrize("norm", ["none", "layer"])
@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            {"num_layers": 2},
            "(overridden: num_layers=2), got missing keys ['weight_ih_l1', 'weight_hh_l1', 'bias_ih_l1'",
        ),
        (
            {"bias": False},
            "(overridden: bias=False), got missing keys [] and unexpected keys ['bias_hh_l0', 'bias_ih_l0']",
        ),
        (
            {"hidden_size": 5},
            "to fit (overridden: hidden_size=5): Error(s) in loading state_dict for LSTM: size mismatch",
        ),
    ],
)
def test_from_torch_names_the_override_that_leaves_weights_out(norm: str, override: dict, expected: str) -> None:
    """With a norm, any leftover key was blamed on the norm ("expected a norm under which torch's weights stay
    parameters ... got norm='layer'"), a norm under which they do; without one, torch's multi-line RuntimeError."""
    with pytest.raises(ValueError) as caught:
        seqnorm.LSTM.from_torch(nn.LSTM(3, 4), norm=norm, **override)
    assert str(caught.value).startswith("LSTM.from_torch: expected the torch module's weights to ")
    assert expected in str(caught.value) and "\n" not in str(caught.value)
