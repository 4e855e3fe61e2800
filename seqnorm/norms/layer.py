"""Per-sample normalizations: LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019).

Both normalize each row over its features, so they behave identically in training and evaluation and at any batch
size, including 1. They share the recurrent norm interface ``norm(x, step=0, mask=None)`` with the per-timestep batch
norms; ``step`` and ``mask`` are accepted and ignored because a row's output never depends on other rows or steps.
Under ``torch.autocast`` they compute in float32 (:func:`~seqnorm.norms.precision.float32_statistics`). Both provide
the generation step's piece (:class:`~seqnorm.norms.protocol.StepPieces`) and the compiled kernels' description.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seqnorm.kernels import KernelNorm
from seqnorm.norms.precision import float32_statistics
from seqnorm.validation import check_eps, check_finite

__all__ = ["LayerNorm", "RMSNorm", "rms_length"]


def rms_length(x: Tensor, floor: Tensor) -> Tensor:
    """``hypot(||x||, floor)`` over the last dimension, ``(..., 1)``: with ``floor = sqrt(F eps)`` it is
    ``sqrt(F (mean(x^2) + eps))``, so RMSNorm is ``x sqrt(F) / rms_length(x)``. Measured about twice as fast as
    torch's CPU ``rms_norm`` kernel at RNN sizes (several times at batch size 1), and ``||x||^2`` cannot overflow."""
    length = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    if torch.onnx.is_in_onnx_export():  # ONNX has no hypot (the exporter fails on it): the same length, unscaled
        return torch.sqrt(length.square() + floor.square())
    return torch.hypot(length, floor)


class _RowNorm(nn.Module):
    """Shared parameters and repr of the row-wise norms: a gain (``weight``) and an optional shift (``bias``).

    Args:
        num_features: size of the normalized (last) dimension.
        eps: added to the variance (mean square for RMSNorm). Default: 1e-5.
        gain: initial value of the gain γ. Default: 1.0.
        center: learn a shift β. Default: ``True``.
        affine: learn γ (and β if ``center``); ``False``: the bare normalization. Default: ``True``.
        shift: initial value of β. Default: 0.0.
    """

    def __init__(
        self,
        num_features: int,
        *,
        eps: float = 1e-5,
        gain: float = 1.0,
        center: bool = True,
        affine: bool = True,
        shift: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_features = num_features
        owner = type(self).__name__
        self.eps = check_eps(owner, eps)
        self.gain_init = check_finite(owner, "gain", gain)
        self.shift_init = check_finite(owner, "shift", shift)
        self.affine = affine
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(num_features, **factory)) if affine else None
        # The gate terms are followed by the cell's own bias, so their shift would be redundant: ``center=False``.
        self.bias = nn.Parameter(torch.empty(num_features, **factory)) if center and affine else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.constant_(self.weight, self.gain_init)
        if self.bias is not None:
            nn.init.constant_(self.bias, self.shift_init)

    def extra_repr(self) -> str:
        if not self.affine:
            return f"{self.num_features}, eps={self.eps}, affine=False"
        text = f"{self.num_features}, eps={self.eps}, gain={self.gain_init}, center={self.bias is not None}"
        return text + (f", shift={self.shift_init}" if self.bias is not None and self.shift_init else "")

    def forward_step(self, x: Tensor, step: int = 0, mask: Tensor | None = None) -> Tensor:
        """``forward`` without the module-call overhead (a cell's step calls it: the layers' loop, a cell in a loop of
        the user's own).

        Not decorated with :func:`float32_statistics`: ``forward`` is, and one check per call is enough.
        """
        return self.forward(x)

    def forward_sequence(self, x: Tensor, mask: Tensor | None = None, counts: list[int] | None = None) -> Tensor:
        """All steps of ``x`` ``(T, B, F)`` at once (the interface of the per-timestep norms); rows are independent."""
        return self(x)


class LayerNorm(_RowNorm):
    r"""LayerNorm over the last dimension: :math:`y = \gamma \odot (x - \mu) / \sqrt{\sigma^2 + \epsilon} + \beta`."""

    # Fast forms this exact class implements (read by seqnorm.layers.plan from the class's own namespace, so a
    # subclass restates them or gets none): "loop": forward_step/forward_sequence compute forward's function;
    # "generation": generation_step below (seqnorm.norms.protocol.StepPieces); "kernel": the compiled kernels'
    # LayerNorm (seqnorm/csrc/norms.h), given what kernel_norm returns.
    fast_forms: ClassVar[frozenset[str]] = frozenset({"loop", "generation", "kernel"})

    @float32_statistics
    def forward(self, x: Tensor, step: int = 0, mask: Tensor | None = None) -> Tensor:
        """Normalize each row of ``x`` ``(..., F)`` over its ``F`` features; ``step`` and ``mask`` are accepted for
        the recurrent norm interface and ignored (rows are independent, the same at every step)."""
        return F.layer_norm(x, (self.num_features,), self.weight, self.bias, self.eps)

    # --- StepPieces ---

    def generation_step(self, shift: Tensor | None) -> Callable[[Tensor, int], Tensor]:
        shape, weight, eps = (self.num_features,), self.weight, self.eps
        return lambda y, step: torch.layer_norm(y, shape, weight, shift, eps)

    def kernel_norm(self, shift: Tensor | None, *, frozen: bool = False) -> KernelNorm:
        """What the compiled kernels need (:mod:`seqnorm.kernels`): ``γ (x - mean) / sqrt(var + eps) + shift``
        (``frozen``: a cached generation step's; nothing to fold for a row norm)."""
        return KernelNorm("layer", self.eps, self.weight, shift, owner=self)


class RMSNorm(_RowNorm):
    r"""RMSNorm over the last dimension: :math:`y = \gamma \odot x / \sqrt{\overline{x^2} + \epsilon} + \beta`."""

    fast_forms: ClassVar[frozenset[str]] = frozenset({"loop", "generation", "kernel"})  # as LayerNorm's

    @float32_statistics
    def forward(self, x: Tensor, step: int = 0, mask: Tensor | None = None) -> Tensor:
        """Scale each row of ``x`` ``(..., F)`` by its root mean square; ``step`` and ``mask`` are ignored, as for
        :class:`LayerNorm`."""
        x_hat = x * self._rstd(x, self._constants(x))
        y = x_hat if self.weight is None else x_hat * self.weight
        return y if self.bias is None else y + self.bias

    def _constants(self, like: Tensor) -> tuple[Tensor, Tensor]:
        """``(sqrt(F), sqrt(F eps))`` as tensors (``torch.hypot`` takes no Python number)."""
        features = self.num_features
        return like.new_tensor(math.sqrt(features)), like.new_tensor(math.sqrt(features * self.eps))

    @staticmethod
    def _rstd(x: Tensor, constants: tuple[Tensor, Tensor]) -> Tensor:
        """``1 / sqrt(mean(x^2) + eps)`` per row, ``(..., 1)`` (:func:`rms_length`)."""
        root, floor = constants
        return torch.div(root, rms_length(x, floor))

    # --- StepPieces ---

    def generation_step(self, shift: Tensor | None) -> Callable[[Tensor, int], Tensor]:
        # y γ sqrt(F) / rms_length(y): sqrt(F) folded into γ once, four operations a step.
        weight = self.weight * math.sqrt(self.num_features)
        floor = weight.new_tensor(math.sqrt(self.num_features * self.eps))

        def rms(y: Tensor, step: int) -> Tensor:
            length = rms_length(y, floor)
            return torch.div(y, length).mul_(weight) if shift is None else torch.addcdiv(shift, y * weight, length)

        return rms

    def kernel_norm(self, shift: Tensor | None, *, frozen: bool = False) -> KernelNorm:
        """What the compiled kernels need (:mod:`seqnorm.kernels`): ``γ x / sqrt(mean(x²) + eps) + shift``."""
        return KernelNorm("rms", self.eps, self.weight, shift, owner=self)
