"""The Triton backend's checks of its entry points' arguments, before any kernel reads them: a GPU kernel handed a
tensor of the wrong shape reads or writes past it (an illegal memory access, or silently wrong numbers), so each
call that cannot run raises ``ValueError`` (``TypeError`` for a dtype) naming the entry point and the argument, as
the C++ kernels' bindings do (``seqnorm/csrc/checks.h``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from seqnorm.kernels.backend import KernelNorm
from seqnorm.kernels.triton_backend.common import FLOATS
from seqnorm.kernels.triton_backend.norms import KINDS

__all__ = ["Checks"]


class Checks:
    """The checks of one call of ``entry``; ``like`` sets the dtype and device every tensor must share."""

    def __init__(self, entry: str, like: Tensor, name: str) -> None:
        self.entry = entry
        if not isinstance(like, Tensor):
            self.fail(f"expected {name} to be a tensor, got {type(like).__name__}")
        if like.dtype not in FLOATS:
            raise TypeError(f"seqnorm kernels: {entry}: expected {name} of float32 or float64, got {like.dtype}")
        self.dtype, self.device = like.dtype, like.device

    def fail(self, message: str) -> None:
        raise ValueError(f"seqnorm kernels: {self.entry}: {message}")

    def tensor(
        self, name: str, value: object, shape: Sequence[int], dims: str, *, dtype: torch.dtype | None = None
    ) -> Tensor:
        """``value`` a contiguous tensor of ``shape`` (written ``dims``), on the call's device, of ``dtype`` (the
        call's)."""
        if not isinstance(value, Tensor):
            self.fail(f"expected {name} of shape {dims} = {tuple(shape)}, got {type(value).__name__}")
        assert isinstance(value, Tensor)
        if tuple(value.shape) != tuple(shape):
            self.fail(f"expected {name} of shape {dims} = {tuple(shape)}, got {tuple(value.shape)}")
        want = self.dtype if dtype is None else dtype
        if value.dtype != want:
            raise TypeError(f"seqnorm kernels: {self.entry}: expected {name} of {want}, got {value.dtype}")
        if value.device != self.device:
            self.fail(f"expected {name} on {self.device}, got {value.device}")
        if not value.is_contiguous():
            self.fail(f"expected {name} to be contiguous, got strides {value.stride()}")
        return value

    def mask(self, mask: object, steps: int, rows: int) -> None:
        if mask is not None:
            self.tensor("mask", mask, (steps, rows), "(T, B)", dtype=torch.bool)

    def norm(self, name: str, norm: object, features: int, *, folded: bool = False) -> None:
        """A norm's arguments for ``features`` features: its kind, γ and shift, BatchNorm's running statistics (or,
        ``folded``, evaluation's folded rows)."""
        if not isinstance(norm, KernelNorm) or norm.kind not in KINDS:
            self.fail(f"expected {name} to be a norm's arguments (NormArgs) of kind {tuple(KINDS)}, got {norm!r}")
        assert isinstance(norm, KernelNorm)
        if norm.kind != "none":
            self.tensor(f"{name}.weight", norm.weight, (features,), "(F,)")
        elif norm.weight is not None:
            self.fail(f"expected no {name}.weight for kind 'none', got a tensor")
        if norm.shift is not None:
            self.tensor(f"{name}.shift", norm.shift, (features,), "(F,)")
        if norm.kind != "batch":
            return
        if folded and not norm.training:
            scale = norm.folded_scale
            rows = scale.shape[0] if isinstance(scale, Tensor) and scale.dim() == 2 else -1
            self.tensor(f"{name}.folded_scale", scale, (rows, features), "(R, F)")
            self.tensor(f"{name}.folded_offset", norm.folded_offset, (rows, features), "(R, F)")
            return
        mean = norm.running_mean
        rows = mean.shape[0] if isinstance(mean, Tensor) and mean.dim() == 2 and mean.shape[0] >= 1 else -1
        self.tensor(f"{name}.running_mean", mean, (rows, features), "(R, F)")
        self.tensor(f"{name}.running_var", norm.running_var, (rows, features), "(R, F)")
        self.tensor(f"{name}.num_batches_tracked", norm.num_batches_tracked, (rows,), "(R,)", dtype=torch.long)
        if not (norm.eps >= 0 and norm.momentum <= 1):
            self.fail(f"expected {name}.eps >= 0 and momentum <= 1, got {norm.eps} and {norm.momentum}")
        steps_ok = norm.r_max_steps >= 1 and norm.d_max_steps >= 1
        if norm.renorm and not (norm.r_max >= 1 and norm.d_max >= 0 and steps_ok):
            self.fail(f"expected {name}'s r_max >= 1, d_max >= 0 and step counts >= 1, got {norm!r}")


def check_forward(
    entry: str, gates: int, inputs: object, h0: object, c0: object, weight_hh: object, mask: object,
    norms: Sequence[object],
) -> None:  # fmt: skip
    """A recurrence's forward (``gates``: 4 for an LSTM, with ``c0`` and a cell-state norm; 3 for a GRU)."""
    checks = Checks(entry, inputs, "inputs")  # type: ignore[arg-type]
    assert isinstance(inputs, Tensor)
    if inputs.dim() != 3 or inputs.shape[0] < 1 or inputs.shape[2] % gates or inputs.shape[2] == 0:
        checks.fail(f"expected inputs of shape (T, B, {gates}H) with T >= 1, got {tuple(inputs.shape)}")
    steps, rows, width = inputs.shape
    checks.tensor("inputs", inputs, (steps, rows, width), f"(T, B, {gates}H)")
    _check_recurrence(checks, gates, steps, rows, width // gates, h0, c0, weight_hh, mask, norms)


def _check_recurrence(
    checks: Checks, gates: int, steps: int, rows: int, hidden: int, h0: object, c0: object, weight_hh: object,
    mask: object, norms: Sequence[object],
) -> None:  # fmt: skip
    width = gates * hidden
    checks.tensor("h0", h0, (rows, hidden), "(B, H)")
    if gates == 4:
        checks.tensor("c0", c0, (rows, hidden), "(B, H)")
    if not isinstance(weight_hh, Tensor) or tuple(weight_hh.shape) != (width, hidden):
        got = tuple(weight_hh.shape) if isinstance(weight_hh, Tensor) else type(weight_hh).__name__
        checks.fail(f"expected weight_hh of shape ({gates}H, H) = {(width, hidden)}, got {got}")
    assert isinstance(weight_hh, Tensor)
    if weight_hh.dtype != checks.dtype or weight_hh.device != checks.device:
        got = f"{weight_hh.dtype} on {weight_hh.device}"
        checks.fail(f"expected weight_hh of {checks.dtype} on {checks.device}, got {got}")
    checks.mask(mask, steps, rows)
    for name, norm, features in zip(("ih", "hh", "c"), norms, (width, width, hidden), strict=False):
        checks.norm(name, norm, features)


def check_step(
    cell: object, x: object, h: object, c: object, weight_ih_t: object, weight_hh_t: object, norms: Sequence[object]
) -> None:
    """The generation step's arguments."""
    entry = "generation_step"
    if cell not in ("lstm", "gru"):
        raise ValueError(f"seqnorm kernels: {entry}: expected cell 'lstm' or 'gru', got {cell!r}")
    checks = Checks(entry, h, "h")  # type: ignore[arg-type]
    assert isinstance(h, Tensor)
    gates = 4 if cell == "lstm" else 3
    if h.dim() != 3 or h.shape[0] != 1:
        checks.fail(f"expected h of shape (1, B, H), got {tuple(h.shape)}")
    _, rows, hidden = h.shape
    if not isinstance(x, Tensor) or x.dim() not in (2, 3) or (x.dim() == 3 and x.shape[0] != 1):
        checks.fail(f"expected x of shape (B, I) or (1, B, I), got {getattr(x, 'shape', type(x).__name__)}")
    assert isinstance(x, Tensor)
    x2 = x[0] if x.dim() == 3 else x
    checks.tensor("x", x2.contiguous(), (rows, x2.shape[-1]), "(B, I)")
    if gates == 4:
        checks.tensor("c", c, (1, rows, hidden), "(1, B, H)")
    elif c is not None:
        checks.fail("expected c None for a GRU, got a tensor")
    for name, weight, shape in (("weight_ih_t", weight_ih_t, (x2.shape[-1], gates * hidden)),
                                ("weight_hh_t", weight_hh_t, (hidden, gates * hidden))):  # fmt: skip
        if not isinstance(weight, Tensor) or tuple(weight.shape) != shape or weight.dtype != checks.dtype:
            got = (tuple(weight.shape), weight.dtype) if isinstance(weight, Tensor) else type(weight).__name__
            checks.fail(f"expected {name} of shape {shape} and {checks.dtype}, got {got}")
    for name, norm, features in zip(("ih", "hh", "c_norm"), norms, (gates * hidden,) * 2 + (hidden,), strict=False):
        checks.norm(name, norm, features, folded=True)


def check_backward(
    entry: str, gates: int, grads: Sequence[object], inputs: object, h0: object, c0: object, weight_hh: object,
    mask: object, hs: object, saved: Sequence[object], norms: Sequence[object], sequence: object, weight_ih: object,
) -> None:  # fmt: skip
    """A recurrence's backward: the forward's arguments (``inputs`` may be empty where no input norm reads them),
    the gradients of (hs, h_n[, c_n]), hs and what the forward saved (``saved``: tensors of (T or 1, B, ...))."""
    checks = Checks(entry, hs, "hs")  # type: ignore[arg-type]
    assert isinstance(hs, Tensor)
    if hs.dim() != 3:
        checks.fail(f"expected hs of shape (T, B, H), got {tuple(hs.shape)}")
    steps, rows, hidden = hs.shape
    names = ("grad_hs", "grad_h_n", "grad_c_n")[: len(grads)]
    shapes = ((steps, rows, hidden), (rows, hidden), (rows, hidden))
    for name, grad, shape in zip(names, grads, shapes, strict=False):
        checks.tensor(name, grad, shape, "(T, B, H)" if len(shape) == 3 else "(B, H)")
    if isinstance(inputs, Tensor) and inputs.numel():
        checks.tensor("inputs", inputs, (steps, rows, gates * hidden), f"(T, B, {gates}H)")
    _check_recurrence(checks, gates, steps, rows, hidden, h0, c0, weight_hh, mask, norms)
    if (sequence is None) != (weight_ih is None):
        checks.fail("expected sequence and weight_ih both or neither (the projection the recurrence made)")
    if isinstance(weight_ih, Tensor):
        inputs_size = weight_ih.shape[1] if weight_ih.dim() == 2 else -1
        checks.tensor("weight_ih", weight_ih, (gates * hidden, inputs_size), f"({gates}H, I)")
        checks.tensor("sequence", sequence, (steps, rows, inputs_size), "(T, B, I)")
    for index, tensor in enumerate(saved):  # what the forward saved: (T, B, ...) each, or None
        if tensor is None:
            continue
        if not isinstance(tensor, Tensor) or tensor.dim() < 3 or tuple(tensor.shape[:2]) != (steps, rows):
            checks.fail(f"expected saved[{index}] of shape (T, B, ...) = ({steps}, {rows}, ...), got {tensor!r:.80}")
        assert isinstance(tensor, Tensor)
        checks.tensor(f"saved[{index}]", tensor, tuple(tensor.shape), "(T, B, ...)")
