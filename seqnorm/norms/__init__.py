"""Normalization layers for recurrent cells and the registry that maps ``norm=`` names to them.

A cell asks the registry for a :class:`NormScheme` and builds from it up to three norms: ``norm_ih`` on the input
term ``W_ih x``, ``norm_hh`` on the recurrent term ``W_hh h`` and ``norm_c`` on the LSTM cell state before its output
``tanh`` (the carried cell state stays raw, as in Ba et al. and Cooijmans et al.). Every norm is called as
``norm(x, step, mask)``. Adding a norm means writing its module and one registry entry here; cells do not change.
Under ``torch.autocast`` every norm computes its statistics in float32 (:mod:`seqnorm.norms.precision`); a new norm
gets that by decorating its methods with :func:`float32_statistics`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from seqnorm.norms.batch import SmallBatchPolicy, TimestepBatchNorm, TimestepBatchRenorm
from seqnorm.norms.layer import LayerNorm, RMSNorm
from seqnorm.norms.precision import float32_statistics

__all__ = [
    "NORMS",
    "LayerNorm",
    "NormContext",
    "NormName",
    "NormScheme",
    "RMSNorm",
    "SmallBatchPolicy",
    "TimestepBatchNorm",
    "TimestepBatchRenorm",
    "float32_statistics",
    "get_norm",
]

NormName = Literal["none", "layer", "rms", "weight", "batch", "batch_renorm"]
Role = Literal["gate", "state"]


@dataclass(frozen=True)
class NormContext:
    """What a cell tells the registry when it builds its norms."""

    owner: str
    max_steps: int = 100
    eps: float = 1e-5
    momentum: float = 0.1
    small_batch: SmallBatchPolicy = "error"
    options: Mapping[str, Any] = field(default_factory=dict)
    device: torch.device | str | None = None
    dtype: torch.dtype | None = None


NormFactory = Callable[[int, Role, NormContext], "nn.Module | None"]


@dataclass(frozen=True)
class NormScheme:
    """How one ``norm=`` choice enters a cell.

    Attributes:
        name: the registry name.
        build: factory of the norm for a role: ``"gate"`` (the ``W_ih x`` and ``W_hh h`` terms, ``4H``/``3H``
            features) or ``"state"`` (the LSTM cell state, ``H`` features); returns ``None`` where nothing is applied.
        weight_norm: reparametrize ``weight_ih`` and ``weight_hh`` as ``g * v / ||v||`` per output row.
        batch_statistics: whether training uses statistics over the batch (so needs >= 2 active rows).
        options: names accepted in ``norm_options`` for this scheme.
    """

    name: str
    build: NormFactory
    weight_norm: bool = False
    batch_statistics: bool = False
    options: frozenset[str] = frozenset()


def _nothing(features: int, role: Role, ctx: NormContext) -> None:
    return None


def _row_norm(cls: type[LayerNorm] | type[RMSNorm]) -> NormFactory:
    def build(features: int, role: Role, ctx: NormContext) -> nn.Module:
        # The gate terms are followed by the cell bias, so only the state norm learns a shift.
        return cls(features, eps=ctx.eps, center=role == "state", device=ctx.device, dtype=ctx.dtype)

    return build


def _batch_norm(renorm: bool) -> NormFactory:
    def build(features: int, role: Role, ctx: NormContext) -> nn.Module:
        kwargs: dict[str, Any] = {
            "eps": ctx.eps,
            "momentum": ctx.momentum,
            "gain": 0.1,  # Cooijmans et al.: γ = 0.1 keeps the gates out of saturation at the start
            "center": role == "state",  # β of the gate terms is fixed at 0
            "small_batch": ctx.small_batch,
            "owner": ctx.owner,
            "device": ctx.device,
            "dtype": ctx.dtype,
        }
        if renorm:
            return TimestepBatchRenorm(features, ctx.max_steps, **kwargs, **ctx.options)
        return TimestepBatchNorm(features, ctx.max_steps, **kwargs)

    return build


def _weight_norm_companion(features: int, role: Role, ctx: NormContext) -> nn.Module | None:
    # Salimans & Kingma's optional mean-only BN: per-timestep centering of the gate terms, no scaling.
    if role != "gate" or not ctx.options.get("mean_only_bn", False):
        return None
    return TimestepBatchNorm(
        features,
        ctx.max_steps,
        eps=ctx.eps,
        momentum=ctx.momentum,
        scale=False,
        center=False,
        small_batch=ctx.small_batch,
        owner=ctx.owner,
        device=ctx.device,
        dtype=ctx.dtype,
    )


NORMS: dict[str, NormScheme] = {
    "none": NormScheme("none", _nothing),
    "layer": NormScheme("layer", _row_norm(LayerNorm)),
    "rms": NormScheme("rms", _row_norm(RMSNorm)),
    "weight": NormScheme("weight", _weight_norm_companion, weight_norm=True, options=frozenset({"mean_only_bn"})),
    "batch": NormScheme("batch", _batch_norm(renorm=False), batch_statistics=True),
    "batch_renorm": NormScheme(
        "batch_renorm",
        _batch_norm(renorm=True),
        batch_statistics=True,
        options=frozenset({"r_max", "d_max", "warmup", "r_max_steps", "d_max_steps"}),
    ),
}


def get_norm(name: str, owner: str, options: Mapping[str, Any] | None = None) -> NormScheme:
    """The scheme registered as ``name``; a ``ValueError`` naming ``owner`` for unknown names or options."""
    if not isinstance(name, str) or name not in NORMS:
        raise ValueError(f"{owner}: expected norm to be one of {', '.join(map(repr, NORMS))}, got {name!r}")
    scheme = NORMS[name]
    unknown = sorted(set(options or {}) - scheme.options)
    if unknown:
        accepted = ", ".join(sorted(scheme.options)) or "none"
        raise ValueError(
            f"{owner}: expected norm_options accepted by norm={name!r} ({accepted}), got {', '.join(unknown)}"
        )
    return scheme
