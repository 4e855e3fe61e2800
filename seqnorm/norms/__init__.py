"""Normalization layers for recurrent cells and the registry that maps ``norm=`` names to them.

A cell asks the registry for a :class:`NormScheme` and builds from it up to three norms: ``norm_ih`` on the input
term ``W_ih x``, ``norm_hh`` on the recurrent term ``W_hh h`` and ``norm_c`` on the LSTM cell state before its output
``tanh`` (the carried cell state stays raw, as in Ba et al. and Cooijmans et al.) — or, with the placement switches
of :class:`Placement`, one ``norm_gates`` over the sum of the two terms and an ``N_c`` whose output is carried.
Every norm is called as ``norm(x, step, mask)``. A norm's options travel in its spec (:mod:`seqnorm.norms.specs`);
adding a norm means writing its module, its spec and one registry entry here; cells do not change.
Under ``torch.autocast`` every norm computes its statistics in float32 (:mod:`seqnorm.norms.precision`); a new norm
gets that by decorating its methods with :func:`float32_statistics`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import nn

from seqnorm.norms.batch import (
    DEFAULT_MAX_STEPS,
    DEFAULT_SMALL_BATCH,
    SMALL_BATCH_POLICIES,
    BeyondMaxSteps,
    SmallBatchPolicy,
    TimestepBatchNorm,
)
from seqnorm.norms.layer import LayerNorm, RMSNorm
from seqnorm.norms.precision import float32_statistics
from seqnorm.norms.renorm import TimestepBatchRenorm
from seqnorm.norms.sequence import SequenceBatchNorm, SequenceBatchRenorm
from seqnorm.norms.specs import (
    BatchNormSpec,
    BatchRenormSpec,
    InputStats,
    LayerNormSpec,
    NoNormSpec,
    NormSpec,
    RMSNormSpec,
    WeightNormSpec,
    checked,
    default_of,
    field_names,
)

__all__ = [
    "DEFAULT_MAX_STEPS",
    "DEFAULT_SMALL_BATCH",
    "NORMS",
    "NORM_KEYWORDS",
    "SMALL_BATCH_POLICIES",
    "BatchNormSpec",
    "BatchRenormSpec",
    "BeyondMaxSteps",
    "InputStats",
    "LayerNorm",
    "LayerNormSpec",
    "NoNormSpec",
    "NormContext",
    "NormName",
    "NormPlacement",
    "NormScheme",
    "NormSpec",
    "Placement",
    "RMSNorm",
    "RMSNormSpec",
    "SequenceBatchNorm",
    "SequenceBatchRenorm",
    "SmallBatchPolicy",
    "StateNorm",
    "TimestepBatchNorm",
    "TimestepBatchRenorm",
    "WeightNormSpec",
    "check_placement",
    "float32_statistics",
    "get_norm",
    "resolve_norm",
    "spec_from_dict",
]

NormName = Literal["none", "layer", "rms", "weight", "batch", "batch_renorm"]
"""The built-in registry names, the short form of ``norm=`` (a test keeps it equal to the keys of :data:`NORMS`; a
norm registered later is accepted at run time all the same)."""
NormPlacement = Literal["separate", "joint"]
StateNorm = Literal["output", "carried"]
Role = Literal["input", "recurrent", "gates", "state"]


@dataclass(frozen=True)
class Placement:
    r"""Where the norms sit in a cell: the switches that change the cell's equations, so stay on the cell.

    The norm's own options (``affine``, ``gamma_init``, ``input_stats``, ...) are fields of its spec
    (:mod:`seqnorm.norms.specs`).

    Attributes:
        norm_placement: ``"separate"`` (default): ``N_ih(W_ih x) + N_hh(W_hh h) + b`` (Ba et al., Cooijmans et al.);
            ``"joint"``: one norm over the sum, ``N(W_ih x + W_hh h) + b`` (LSTM only: the GRU candidate gates its
            recurrent term by ``r``, so the sum is not a single term there).
        state_norm: ``"output"`` (default): ``h' = o * tanh(N_c(c'))`` with the raw ``c'`` carried; ``"carried"``:
            ``c' <- N_c(c')`` is the new cell state too (LSTM only).
    """

    norm_placement: NormPlacement = "separate"
    state_norm: StateNorm = "output"


@dataclass(frozen=True)
class NormContext:
    """What a cell tells the registry when it builds its norms: who asks (for messages), the spec, the factory."""

    owner: str
    spec: NormSpec
    device: torch.device | str | None = None
    dtype: torch.dtype | None = None


NormFactory = Callable[[int, Role, NormContext], "nn.Module | None"]


NORM_KEYWORDS = frozenset(
    {
        "eps",
        "momentum",
        "max_steps",
        "small_batch",
        "affine",
        "gamma_init",
        "beta_init",
        "input_stats",
        "beyond_max_steps",
    }
)
"""Spec fields that cells and layers also take as keywords (today's API); the rest go through the spec or
``norm_options``."""


@dataclass(frozen=True)
class NormScheme:
    """How one ``norm=`` choice enters a cell.

    Attributes:
        name: the registry name.
        spec: the spec class of this norm (:mod:`seqnorm.norms.specs`); ``spec()`` is what the name means.
        build: factory of the norm for a role: ``"input"`` / ``"recurrent"`` (the ``W_ih x`` and ``W_hh h`` terms,
            ``4H``/``3H`` features), ``"gates"`` (their sum, with ``norm_placement="joint"``) or ``"state"`` (the
            LSTM cell state, ``H`` features); returns ``None`` where nothing is applied.
        weight_norm: reparametrize ``weight_ih`` and ``weight_hh`` as ``g * v / ||v||`` per output row.
        batch_statistics: whether training uses statistics over the batch (so needs >= 2 active rows).
        switches: the :class:`Placement` fields this scheme gives a meaning to (others must keep their defaults).
    """

    name: str
    spec: type[NormSpec]
    build: NormFactory
    weight_norm: bool = False
    batch_statistics: bool = False
    switches: frozenset[str] = frozenset()

    @property
    def options(self) -> frozenset[str]:
        """Names accepted in ``norm_options``: the spec's fields that cells and layers do not take as keywords."""
        return frozenset(field_names(self.spec)) - NORM_KEYWORDS

    def __reduce_ex__(self, protocol: Any) -> str | tuple[Any, ...]:
        # A registered scheme pickles by its name, as a class pickles by its qualified name: its factory may be a
        # closure (pickle cannot store those), and cells keep their scheme, so models with any norm pickle
        # (torch.save(model), copy.deepcopy, Lightning's ddp_spawn). Unpickling looks the name up in NORMS.
        if NORMS.get(self.name) is self:
            return _registered_scheme, (self.name,)
        return super().__reduce_ex__(protocol)


def _registered_scheme(name: str) -> NormScheme:
    if name not in NORMS:
        raise ValueError(f"NormScheme: expected norm {name!r} registered in seqnorm.NORMS to unpickle it, got none")
    return NORMS[name]


def _nothing(features: int, role: Role, ctx: NormContext) -> None:
    return None


def _row_norm(cls: type[LayerNorm] | type[RMSNorm]) -> NormFactory:
    def build(features: int, role: Role, ctx: NormContext) -> nn.Module:
        spec: LayerNormSpec = ctx.spec  # type: ignore[assignment]
        # The gate terms are followed by the cell bias, so only the state norm learns a shift.
        return cls(
            features,
            eps=spec.eps,
            gain=1.0 if spec.gamma_init is None else spec.gamma_init,
            center=role == "state",
            affine=spec.affine,
            shift=spec.beta_init,
            device=ctx.device,
            dtype=ctx.dtype,
        )

    return build


def _batch_norm(renorm: bool) -> NormFactory:
    def build(features: int, role: Role, ctx: NormContext) -> nn.Module:
        spec: BatchRenormSpec = ctx.spec  # type: ignore[assignment]
        kwargs: dict[str, Any] = {
            "eps": spec.eps,
            "momentum": spec.momentum,
            # Cooijmans et al.: γ = 0.1 keeps the gates out of saturation at the start
            "gain": 0.1 if spec.gamma_init is None else spec.gamma_init,
            "center": role == "state",  # β of the gate terms is fixed at 0
            "affine": spec.affine,
            "shift": spec.beta_init,
            "small_batch": spec.small_batch,
            "owner": ctx.owner,
            "device": ctx.device,
            "dtype": ctx.dtype,
        }
        if renorm:
            kwargs.update(
                {name: getattr(spec, name) for name in ("r_max", "d_max", "warmup", "r_max_steps", "d_max_steps")}
            )
        if role == "input" and spec.input_stats == "sequence":
            return (SequenceBatchRenorm if renorm else SequenceBatchNorm)(features, **kwargs)
        kwargs["beyond_max_steps"] = spec.beyond_max_steps
        return (TimestepBatchRenorm if renorm else TimestepBatchNorm)(features, spec.max_steps, **kwargs)

    return build


def _weight_norm_companion(features: int, role: Role, ctx: NormContext) -> nn.Module | None:
    # Salimans & Kingma's optional mean-only BN: per-timestep centering of the gate terms, no scaling.
    spec: WeightNormSpec = ctx.spec  # type: ignore[assignment]
    if role == "state" or not spec.mean_only_bn:
        return None
    return TimestepBatchNorm(
        features,
        spec.max_steps,
        eps=spec.eps,
        momentum=spec.momentum,
        scale=False,
        center=False,
        small_batch=spec.small_batch,
        beyond_max_steps=spec.beyond_max_steps,
        owner=ctx.owner,
        device=ctx.device,
        dtype=ctx.dtype,
    )


_SWITCHES = frozenset({"norm_placement", "state_norm"})

NORMS: dict[str, NormScheme] = {
    "none": NormScheme("none", NoNormSpec, _nothing),
    "layer": NormScheme("layer", LayerNormSpec, _row_norm(LayerNorm), switches=_SWITCHES),
    "rms": NormScheme("rms", RMSNormSpec, _row_norm(RMSNorm), switches=_SWITCHES),
    # With mean-only BN the gate terms have a (parameter-free, per-timestep) norm that can sit jointly.
    "weight": NormScheme(
        "weight", WeightNormSpec, _weight_norm_companion, weight_norm=True, switches=frozenset({"norm_placement"})
    ),
    "batch": NormScheme("batch", BatchNormSpec, _batch_norm(renorm=False), batch_statistics=True, switches=_SWITCHES),
    "batch_renorm": NormScheme(
        "batch_renorm", BatchRenormSpec, _batch_norm(renorm=True), batch_statistics=True, switches=_SWITCHES
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


def _supporting(name: str) -> str:
    """The registry names whose spec has the field ``name``, quoted, as error messages list them."""
    return ", ".join(repr(key) for key in sorted(NORMS) if name in field_names(NORMS[key].spec))


def _not_given(name: str, value: object) -> bool:
    # A keyword left at its default says nothing (as the placement switches always did): the LightningModules pass
    # the default small_batch whatever the norm. `bool` apart: 1 == True.
    default = _KEYWORD_DEFAULTS[name]
    return value == default and isinstance(value, bool) == isinstance(default, bool)


def resolve_norm(
    owner: str, norm: str | NormSpec, norm_options: Mapping[str, Any] | None = None, **keywords: Any
) -> NormSpec:
    """The spec that ``norm=`` together with the norm keywords of a cell or layer means; errors name ``owner``.

    ``norm`` is a registry name (its default spec) or a spec. ``keywords`` (a subset of :data:`NORM_KEYWORDS`)
    and ``norm_options`` are folded into the spec; a keyword at its default is not given. A given option that the
    norm does not have is a ``ValueError`` naming it — except ``max_steps``, which every cell and layer accepts
    (the public API contract) and norms without per-timestep statistics ignore. An option set both in a spec and as a
    keyword (to different values) is an error too. A spec passed alone is returned as it is: it was checked when
    it was made.
    """
    if isinstance(norm, NormSpec):
        scheme = NORMS.get(norm.name)  # type: ignore[arg-type]
        if scheme is None or type(norm) is not scheme.spec:
            choices = ", ".join(f"{s.spec.__name__}" for s in NORMS.values())
            raise ValueError(f"{owner}: expected a norm spec registered in seqnorm.NORMS ({choices}), got {norm!r}")
        get_norm(norm.name, owner, norm_options)  # norm_options' names
        spec, given = norm, True
    else:
        scheme = get_norm(norm, owner, norm_options)
        spec, given = scheme.spec(), False
    changes: dict[str, Any] = {}
    for name, value in keywords.items():
        if name not in NORM_KEYWORDS:
            raise TypeError(f"resolve_norm: unexpected keyword {name!r}")
        if _not_given(name, value):
            continue
        if name not in field_names(spec):
            if name == "max_steps":
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{owner}: expected max_steps to be a positive int, got {value!r}")
                continue
            raise ValueError(
                f"{owner}: expected norm to be one of {_supporting(name)} for {name}={value!r}, got norm={spec.name!r}"
            )
        changes[name] = value
    changes.update(norm_options or {})
    for name, value in changes.items():
        current = getattr(spec, name)
        if given and current != default_of(type(spec), name) and current != value:
            raise ValueError(
                f"{owner}: expected {name}={current!r} as norm={spec!r} sets it (or no {name} beside the spec), got "
                f"{name}={value!r}"
            )
    return checked(owner, spec, **changes) if changes else spec


def spec_from_dict(data: Mapping[str, Any], owner: str) -> NormSpec:
    """The spec that :meth:`NormSpec.to_dict` wrote, made by seqnorm's registry (never by a name from ``data``)."""
    if not isinstance(data, Mapping) or not isinstance(data.get("name"), str):
        raise ValueError(
            f"{owner}: expected norm as a registry name or {{'name': <registry name>, <option>: <value>, ...}}, "
            f"got {data!r}"
        )
    scheme = get_norm(data["name"], owner)
    options = {key: value for key, value in data.items() if key != "name"}
    unknown = sorted(set(options) - set(field_names(scheme.spec)))
    if unknown:
        accepted = ", ".join(field_names(scheme.spec)) or "none"
        raise ValueError(f"{owner}: expected options of norm={scheme.name!r} ({accepted}), got {', '.join(unknown)}")
    return checked(owner, scheme.spec(), **options)


def check_placement(
    owner: str,
    spec: NormSpec,
    *,
    has_cell_state: bool,
    norm_placement: str = "separate",
    state_norm: str = "output",
) -> Placement:
    """The :class:`Placement` of a cell, or a ``ValueError`` naming ``owner`` and the switch.

    A switch left at its default is always accepted; one set to something else must be a valid value that the
    norm supports and that makes sense for the cell (``has_cell_state``: an LSTM) and for the spec.
    """
    scheme = NORMS[spec.name]
    for name, value, choices in (
        ("norm_placement", norm_placement, get_args(NormPlacement)),
        ("state_norm", state_norm, get_args(StateNorm)),
    ):
        if value not in choices or not isinstance(value, str):
            raise ValueError(f"{owner}: expected {name} to be one of {', '.join(map(repr, choices))}, got {value!r}")
        if value != choices[0] and name not in scheme.switches:
            supported = sorted(n for n, s in NORMS.items() if name in s.switches)
            raise ValueError(
                f"{owner}: expected norm to be one of {', '.join(map(repr, supported))} for {name}={value!r}, "
                f"got norm={spec.name!r}"
            )
    placement = Placement(norm_placement, state_norm)  # type: ignore[arg-type]
    if scheme.weight_norm and norm_placement == "joint" and not getattr(spec, "mean_only_bn", False):
        raise ValueError(
            f"{owner}: expected norm_options={{'mean_only_bn': True}} for norm_placement='joint' with norm='weight' "
            "(weight norm alone has no norm to place), got no mean-only BN"
        )
    if norm_placement == "joint" and not has_cell_state:
        raise ValueError(
            f"{owner}: expected norm_placement='separate' (the GRU candidate gates its recurrent term by r, so the "
            "input and recurrent terms are not one sum), got 'joint'"
        )
    if state_norm == "carried" and not has_cell_state:
        raise ValueError(f"{owner}: expected state_norm='output' (there is no cell state), got 'carried'")
    if getattr(spec, "input_stats", "timestep") == "sequence" and norm_placement == "joint":
        raise ValueError(
            f"{owner}: expected input_stats='timestep' with norm_placement='joint' (the joint norm sees the "
            "recurrent term, which exists one step at a time), got 'sequence'"
        )
    beta_init = getattr(spec, "beta_init", 0.0)
    if beta_init != 0 and not has_cell_state:
        raise ValueError(f"{owner}: expected beta_init=0 (only an LSTM's cell-state norm has a β), got {beta_init!r}")
    return placement


def _keyword_defaults() -> dict[str, Any]:
    # One default per keyword, taken from the specs (the cell and layer signatures repeat them for `help()`; a
    # test checks that they agree).
    found: dict[str, Any] = {}
    for scheme in NORMS.values():
        for name in field_names(scheme.spec):
            if name in NORM_KEYWORDS:
                found.setdefault(name, default_of(scheme.spec, name))
    return found


_KEYWORD_DEFAULTS = _keyword_defaults()
