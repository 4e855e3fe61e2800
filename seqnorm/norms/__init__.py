"""Normalization layers for recurrent cells and the registry that maps ``norm=`` names to them.

A cell asks the registry for a :class:`NormScheme` and builds from it up to three norms: ``norm_ih`` on the input
term ``W_ih x``, ``norm_hh`` on the recurrent term ``W_hh h`` and ``norm_c`` on the LSTM cell state before its output
``tanh`` (the carried cell state stays raw, as in Ba et al. and Cooijmans et al.) — or, with the placement switches
of :class:`Placement`, one ``norm_gates`` over the sum of the two terms and an ``N_c`` whose output is carried.
Every norm is called as ``norm(x, step, mask)``. Adding a norm means writing its module and one registry entry here
(with what it supports of the switches); cells do not change.
Under ``torch.autocast`` every norm computes its statistics in float32 (:mod:`seqnorm.norms.precision`); a new norm
gets that by decorating its methods with :func:`float32_statistics`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from seqnorm.norms.batch import BeyondMaxSteps, SmallBatchPolicy, TimestepBatchNorm
from seqnorm.norms.layer import LayerNorm, RMSNorm
from seqnorm.norms.precision import float32_statistics
from seqnorm.norms.renorm import TimestepBatchRenorm
from seqnorm.norms.sequence import SequenceBatchNorm, SequenceBatchRenorm

__all__ = [
    "NORMS",
    "BeyondMaxSteps",
    "LayerNorm",
    "NormContext",
    "NormName",
    "NormScheme",
    "Placement",
    "RMSNorm",
    "SequenceBatchNorm",
    "SequenceBatchRenorm",
    "SmallBatchPolicy",
    "TimestepBatchNorm",
    "TimestepBatchRenorm",
    "check_placement",
    "float32_statistics",
    "get_norm",
]

NormName = Literal["none", "layer", "rms", "weight", "batch", "batch_renorm"]
Role = Literal["input", "recurrent", "gates", "state"]


@dataclass(frozen=True)
class Placement:
    r"""Where and how the norms sit in a cell: the placement switches every cell and layer accepts.

    Attributes:
        norm_placement: ``"separate"`` (default): ``N_ih(W_ih x) + N_hh(W_hh h) + b`` (Ba et al., Cooijmans et al.);
            ``"joint"``: one norm over the sum, ``N(W_ih x + W_hh h) + b`` (LSTM only: the GRU candidate gates its
            recurrent term by ``r``, so the sum is not a single term there).
        state_norm: ``"output"`` (default): ``h' = o * tanh(N_c(c'))`` with the raw ``c'`` carried; ``"carried"``:
            ``c' <- N_c(c')`` is the new cell state too (LSTM only).
        affine: learn the norms' gains γ (and the cell-state shift β); ``False``: bare normalizations.
        gamma_init: initial γ; ``None``: the norm's own default (0.1 for batch norms, Cooijmans et al.; 1.0 for
            layer/RMS norms).
        beta_init: initial β of the cell-state norm (gate terms have no β: the cell bias follows them).
        input_stats: ``"timestep"`` (default): per-timestep statistics for the input term's batch norm;
            ``"sequence"``: statistics over batch × time, excluding padding (BN-e*, Deep Speech 2).
        beyond_max_steps: ``"last"`` (default) or ``"pooled"``: statistics of per-timestep batch norms at steps
            ``t >= max_steps`` (:mod:`seqnorm.norms.batch`).
    """

    norm_placement: Literal["separate", "joint"] = "separate"
    state_norm: Literal["output", "carried"] = "output"
    affine: bool = True
    gamma_init: float | None = None
    beta_init: float = 0.0
    input_stats: Literal["timestep", "sequence"] = "timestep"
    beyond_max_steps: BeyondMaxSteps = "last"


@dataclass(frozen=True)
class NormContext:
    """What a cell tells the registry when it builds its norms."""

    owner: str
    max_steps: int = 100
    eps: float = 1e-5
    momentum: float = 0.1
    small_batch: SmallBatchPolicy = "error"
    options: Mapping[str, Any] = field(default_factory=dict)
    placement: Placement = Placement()
    device: torch.device | str | None = None
    dtype: torch.dtype | None = None


NormFactory = Callable[[int, Role, NormContext], "nn.Module | None"]


@dataclass(frozen=True)
class NormScheme:
    """How one ``norm=`` choice enters a cell.

    Attributes:
        name: the registry name.
        build: factory of the norm for a role: ``"input"`` / ``"recurrent"`` (the ``W_ih x`` and ``W_hh h`` terms,
            ``4H``/``3H`` features), ``"gates"`` (their sum, with ``norm_placement="joint"``) or ``"state"`` (the
            LSTM cell state, ``H`` features); returns ``None`` where nothing is applied.
        weight_norm: reparametrize ``weight_ih`` and ``weight_hh`` as ``g * v / ||v||`` per output row.
        batch_statistics: whether training uses statistics over the batch (so needs >= 2 active rows).
        options: names accepted in ``norm_options`` for this scheme.
        switches: the :class:`Placement` fields this scheme gives a meaning to (others must keep their defaults).
    """

    name: str
    build: NormFactory
    weight_norm: bool = False
    batch_statistics: bool = False
    options: frozenset[str] = frozenset()
    switches: frozenset[str] = frozenset()


def _nothing(features: int, role: Role, ctx: NormContext) -> None:
    return None


def _row_norm(cls: type[LayerNorm] | type[RMSNorm]) -> NormFactory:
    def build(features: int, role: Role, ctx: NormContext) -> nn.Module:
        placement = ctx.placement
        # The gate terms are followed by the cell bias, so only the state norm learns a shift.
        return cls(
            features,
            eps=ctx.eps,
            gain=1.0 if placement.gamma_init is None else placement.gamma_init,
            center=role == "state",
            affine=placement.affine,
            shift=placement.beta_init,
            device=ctx.device,
            dtype=ctx.dtype,
        )

    return build


def _batch_norm(renorm: bool) -> NormFactory:
    def build(features: int, role: Role, ctx: NormContext) -> nn.Module:
        placement = ctx.placement
        kwargs: dict[str, Any] = {
            "eps": ctx.eps,
            "momentum": ctx.momentum,
            # Cooijmans et al.: γ = 0.1 keeps the gates out of saturation at the start
            "gain": 0.1 if placement.gamma_init is None else placement.gamma_init,
            "center": role == "state",  # β of the gate terms is fixed at 0
            "affine": placement.affine,
            "shift": placement.beta_init,
            "small_batch": ctx.small_batch,
            "owner": ctx.owner,
            "device": ctx.device,
            "dtype": ctx.dtype,
        }
        options = dict(ctx.options) if renorm else {}
        if role == "input" and placement.input_stats == "sequence":
            return (SequenceBatchRenorm if renorm else SequenceBatchNorm)(features, **kwargs, **options)
        kwargs["beyond_max_steps"] = placement.beyond_max_steps
        return (TimestepBatchRenorm if renorm else TimestepBatchNorm)(features, ctx.max_steps, **kwargs, **options)

    return build


def _weight_norm_companion(features: int, role: Role, ctx: NormContext) -> nn.Module | None:
    # Salimans & Kingma's optional mean-only BN: per-timestep centering of the gate terms, no scaling.
    if role == "state" or not ctx.options.get("mean_only_bn", False):
        return None
    return TimestepBatchNorm(
        features,
        ctx.max_steps,
        eps=ctx.eps,
        momentum=ctx.momentum,
        scale=False,
        center=False,
        small_batch=ctx.small_batch,
        beyond_max_steps=ctx.placement.beyond_max_steps,
        owner=ctx.owner,
        device=ctx.device,
        dtype=ctx.dtype,
    )


_ALL_SWITCHES = frozenset(
    {"norm_placement", "state_norm", "affine", "gamma_init", "beta_init", "input_stats", "beyond_max_steps"}
)
_ROW_SWITCHES = frozenset({"norm_placement", "state_norm", "affine", "gamma_init", "beta_init"})

NORMS: dict[str, NormScheme] = {
    "none": NormScheme("none", _nothing),
    "layer": NormScheme("layer", _row_norm(LayerNorm), switches=_ROW_SWITCHES),
    "rms": NormScheme("rms", _row_norm(RMSNorm), switches=_ROW_SWITCHES),
    # With mean-only BN the gate terms have a (parameter-free, per-timestep) norm that can sit jointly.
    "weight": NormScheme(
        "weight",
        _weight_norm_companion,
        weight_norm=True,
        options=frozenset({"mean_only_bn"}),
        switches=frozenset({"norm_placement", "beyond_max_steps"}),
    ),
    "batch": NormScheme("batch", _batch_norm(renorm=False), batch_statistics=True, switches=_ALL_SWITCHES),
    "batch_renorm": NormScheme(
        "batch_renorm",
        _batch_norm(renorm=True),
        batch_statistics=True,
        options=frozenset({"r_max", "d_max", "warmup", "r_max_steps", "d_max_steps"}),
        switches=_ALL_SWITCHES,
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


_CHOICES: dict[str, tuple[Any, ...]] = {
    "norm_placement": ("separate", "joint"),
    "state_norm": ("output", "carried"),
    "input_stats": ("timestep", "sequence"),
    "beyond_max_steps": ("last", "pooled"),
    "affine": (True, False),
}


def check_placement(
    owner: str,
    scheme: NormScheme,
    options: Mapping[str, Any] | None,
    *,
    has_cell_state: bool,
    **switches: Any,
) -> Placement:
    """The :class:`Placement` of ``switches`` (keyword per field), or a ``ValueError`` naming ``owner`` and the switch.

    A switch left at its default is always accepted; one set to something else must be a valid value that the
    scheme supports and that makes sense for the cell (``has_cell_state``: an LSTM) and the other switches.
    """
    defaults = Placement()
    placement = Placement(**switches)
    changed = {name for name in switches if getattr(placement, name) != getattr(defaults, name)}
    for name, choices in _CHOICES.items():
        value = getattr(placement, name)
        if value not in choices or type(value) is not type(choices[0]):
            raise ValueError(f"{owner}: expected {name} to be one of {', '.join(map(repr, choices))}, got {value!r}")
    for name in ("gamma_init", "beta_init"):
        value = getattr(placement, name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
        ):
            raise ValueError(f"{owner}: expected {name} to be a finite number, got {value!r}")
    for name in sorted(changed - scheme.switches):
        supported = sorted(n for n, s in NORMS.items() if name in s.switches)
        raise ValueError(
            f"{owner}: expected norm to be one of {', '.join(map(repr, supported))} for {name}="
            f"{getattr(placement, name)!r}, got norm={scheme.name!r}"
        )
    mean_only = bool((options or {}).get("mean_only_bn", False))
    if scheme.weight_norm and changed and not mean_only:
        raise ValueError(
            f"{owner}: expected norm_options={{'mean_only_bn': True}} for "
            f"{', '.join(f'{n}={getattr(placement, n)!r}' for n in sorted(changed))} with norm='weight' "
            "(weight norm alone has no norm to place), got no mean-only BN"
        )
    if placement.norm_placement == "joint" and not has_cell_state:
        raise ValueError(
            f"{owner}: expected norm_placement='separate' (the GRU candidate gates its recurrent term by r, so the "
            "input and recurrent terms are not one sum), got 'joint'"
        )
    if placement.state_norm == "carried" and not has_cell_state:
        raise ValueError(f"{owner}: expected state_norm='output' (there is no cell state), got 'carried'")
    if placement.input_stats == "sequence" and placement.norm_placement == "joint":
        raise ValueError(
            f"{owner}: expected input_stats='timestep' with norm_placement='joint' (the joint norm sees the "
            "recurrent term, which exists one step at a time), got 'sequence'"
        )
    if not placement.affine and ("gamma_init" in changed or "beta_init" in changed):
        raise ValueError(
            f"{owner}: expected gamma_init=None and beta_init=0 with affine=False (nothing to initialize), "
            f"got gamma_init={placement.gamma_init!r}, beta_init={placement.beta_init!r}"
        )
    if "beta_init" in changed and not has_cell_state:
        raise ValueError(
            f"{owner}: expected beta_init=0 (only an LSTM's cell-state norm has a β), got {placement.beta_init!r}"
        )
    return placement
