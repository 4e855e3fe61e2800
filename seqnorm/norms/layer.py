"""Per-sample normalizations: LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019).

Both normalize each row over its features, so they behave identically in training and evaluation and at any batch
size, including 1. They share the recurrent norm interface ``norm(x, step=0, mask=None)`` with the per-timestep batch
norms; ``step`` and ``mask`` are accepted and ignored because a row's output never depends on other rows or steps.
Under ``torch.autocast`` they compute in float32 (:func:`~seqnorm.norms.precision.float32_statistics`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seqnorm.norms.precision import float32_statistics

__all__ = ["LayerNorm", "RMSNorm"]


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
        self.eps = eps
        self.gain_init = gain
        self.shift_init = shift
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
        """``forward`` without the module-call overhead (the layers' fast path calls it at every step).

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
    # "bptt" and "generation": the hand-written BPTT (seqnorm.layers.bptt_norms) and the lean generation step
    # (seqnorm.layers.stepping) restate this math under the name in fast_kind.
    fast_forms: ClassVar[frozenset[str]] = frozenset({"loop", "bptt", "generation"})
    fast_kind: ClassVar[str | None] = "layer"

    @float32_statistics
    def forward(self, x: Tensor, step: int = 0, mask: Tensor | None = None) -> Tensor:
        return F.layer_norm(x, (self.num_features,), self.weight, self.bias, self.eps)


class RMSNorm(_RowNorm):
    r"""RMSNorm over the last dimension: :math:`y = \gamma \odot x / \sqrt{\overline{x^2} + \epsilon} + \beta`."""

    fast_forms: ClassVar[frozenset[str]] = frozenset({"loop", "bptt", "generation"})  # as LayerNorm's
    fast_kind: ClassVar[str | None] = "rms"

    @float32_statistics
    def forward(self, x: Tensor, step: int = 0, mask: Tensor | None = None) -> Tensor:
        y = F.rms_norm(x, (self.num_features,), self.weight, self.eps)
        return y if self.bias is None else y + self.bias
