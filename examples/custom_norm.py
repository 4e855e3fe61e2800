"""A norm of your own in seqnorm's layers: ScaleNorm (Nguyen & Salazar 2019), ``γ x / (||x|| / sqrt(F) + eps)``.

A new norm is one module (with the pieces its fast forms call), one spec (its options) and one registry entry; then
``seqnorm.LSTM``/``GRU``, the cells and the Lightning modules take ``norm="scale"``. The module declares the forms
it implements (``fast_forms``): here the loop over the cell's step in training and the lean generation step. A norm
that declares none runs the reference loop, slower and the same.

This script registers it, checks the fast path against the reference loop in float64 over variable lengths, and
trains a two-layer LSTM with it on a toy regression. Run: ``python examples/custom_norm.py`` (seconds on a CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

import seqnorm
from seqnorm.norms import NORMS, NormContext, NormScheme, NormSpec

NAME = "scale"


@dataclass(frozen=True, kw_only=True)
class ScaleNormSpec(NormSpec):
    """The norm's options: its ``eps``. ``name`` is the registry key the layers' ``norm=`` takes."""

    name: ClassVar[str] = NAME
    eps: float = 1e-5


class ScaleNorm(nn.Module):
    """ScaleNorm per row, with the pieces of every form it declares (the StepPieces protocol)."""

    fast_forms: ClassVar[frozenset[str]] = frozenset({"loop", "generation"})

    def __init__(self, num_features: int, eps: float = 1e-5, *, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.num_features, self.eps, self.bias = num_features, eps, None
        self.weight = nn.Parameter(torch.empty(num_features, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:  # the cells reset their norms with their own parameters
        nn.init.uniform_(self.weight, 0.5, 1.5)

    def _scale(self, x: Tensor) -> Tensor:
        return 1.0 / (torch.linalg.vector_norm(x, dim=-1, keepdim=True) / self.num_features**0.5 + self.eps)

    # --- the reference loop and the loop over the cell's step ---

    def forward(self, x: Tensor, step: int = 0, mask: Tensor | None = None) -> Tensor:
        return self.weight * x * self._scale(x)

    def forward_step(self, x: Tensor, step: int = 0, mask: Tensor | None = None) -> Tensor:
        return self.forward(x)

    def forward_sequence(self, x: Tensor, mask: Tensor | None = None, counts: list[int] | None = None) -> Tensor:
        return self.forward(x)

    # --- the generation step ---

    def generation_step(self, shift: Tensor | None) -> Callable[[Tensor, int], Tensor]:
        def scale_norm(y: Tensor, step: int) -> Tensor:
            out = self.forward(y)
            return out if shift is None else out + shift

        return scale_norm


def build_scale_norm(features: int, role: str, ctx: NormContext) -> nn.Module:
    """What the cells call for each norm they hold (``role``: input, recurrent or cell state)."""
    spec: ScaleNormSpec = ctx.spec  # type: ignore[assignment]
    return ScaleNorm(features, spec.eps, device=ctx.device, dtype=ctx.dtype)


def register() -> None:
    """The one registry entry."""
    NORMS[NAME] = NormScheme(NAME, ScaleNormSpec, build_scale_norm)


def main() -> None:
    register()
    torch.manual_seed(0)
    layer = seqnorm.LSTM(3, 16, num_layers=2, norm=NAME, dtype=torch.float64)
    reference = seqnorm.LSTM(3, 16, num_layers=2, norm=NAME, impl="reference", dtype=torch.float64)
    reference.load_state_dict(layer.state_dict())
    x, lengths = torch.randn(12, 8, 3, dtype=torch.float64), torch.tensor([12, 5, 9, 12, 3, 7, 12, 10])
    print(f"norm={NAME!r}: path {layer.plan(x, lengths=lengths).path!r}")
    difference = (layer(x, lengths=lengths)[0] - reference(x, lengths=lengths)[0]).abs().max().item()
    print(f"max |fast - reference| = {difference:.1e} (float64)")

    # Regress each sequence's mean input from the last layer's final state.
    head = nn.Linear(16, 1, dtype=torch.float64)
    optimizer = torch.optim.Adam([*layer.parameters(), *head.parameters()], lr=1e-2)
    real = (torch.arange(12).unsqueeze(1) < lengths).unsqueeze(2)  # (T, B, 1)
    target = ((x * real).sum(0) / lengths.unsqueeze(1)).mean(1, keepdim=True)  # (B, 1)
    for update in range(101):
        optimizer.zero_grad()
        _, (h_n, _) = layer(x, lengths=lengths)
        loss = nn.functional.mse_loss(head(h_n[-1]), target)
        loss.backward()
        optimizer.step()
        if update % 50 == 0:
            print(f"update {update}: loss {loss.item():.5f}")


if __name__ == "__main__":
    main()
