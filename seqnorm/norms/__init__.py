"""Normalization layers for recurrent cells and the registry that maps ``norm=`` names to them.

A cell asks the registry for a :class:`NormScheme` and builds from it up to three norms: ``norm_ih`` on the input
term ``W_ih x``, ``norm_hh`` on the recurrent term ``W_hh h`` and ``norm_c`` on the LSTM cell state before its output
``tanh`` (the carried cell state stays raw, as in Ba et al. and Cooijmans et al.) — or, with the placement switches
of :class:`Placement` (fields of the spec), one ``norm_gates`` over the sum of the two terms and an ``N_c`` whose
output is carried. Every norm is called as ``norm(x, step, mask)``. A norm's options travel in its spec
(:mod:`seqnorm.norms.specs`), the one way to configure it: ``norm=`` takes a registry name or a spec. Adding a norm
means writing its module, its spec and one registry entry here; cells do not change.
Under ``torch.autocast`` every norm computes its statistics in float32 (:mod:`seqnorm.norms.precision`); a new norm
gets that by decorating its methods with :func:`float32_statistics`.
"""

from __future__ import annotations

import functools
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
    NormPlacement,
    NormSpec,
    RMSNormSpec,
    StateNorm,
    WeightNormSpec,
    checked,
    field_names,
)

__all__ = [
    "DEFAULT_MAX_STEPS",
    "DEFAULT_SMALL_BATCH",
    "NORMS",
    "REMOVED_KEYWORDS",
    "REMOVED_OPTIONS",
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
Role = Literal["input", "recurrent", "gates", "state"]


@dataclass(frozen=True)
class Placement:
    r"""Where the norms sit in a cell, as its spec says (:func:`check_placement` reads it; a spec without the field
    keeps the default).

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

    The :class:`Placement` switches a norm supports are the fields its spec has.
    """

    name: str
    spec: type[NormSpec]
    build: NormFactory
    weight_norm: bool = False
    batch_statistics: bool = False

    def __post_init__(self) -> None:
        # a spec names the scheme that builds it (resolve_norm, the cells): another name would build another norm
        if getattr(self.spec, "name", None) != self.name:
            raise ValueError(
                f"NormScheme: expected name to be its spec's name, {self.spec.__name__}.name = "
                f"{getattr(self.spec, 'name', None)!r}, got {self.name!r}"
            )

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


NORMS: dict[str, NormScheme] = {
    "none": NormScheme("none", NoNormSpec, _nothing),
    "layer": NormScheme("layer", LayerNormSpec, _row_norm(LayerNorm)),
    "rms": NormScheme("rms", RMSNormSpec, _row_norm(RMSNorm)),
    # With mean-only BN the gate terms have a (parameter-free, per-timestep) norm that can sit jointly.
    "weight": NormScheme("weight", WeightNormSpec, _weight_norm_companion, weight_norm=True),
    "batch": NormScheme("batch", BatchNormSpec, _batch_norm(renorm=False), batch_statistics=True),
    "batch_renorm": NormScheme("batch_renorm", BatchRenormSpec, _batch_norm(renorm=True), batch_statistics=True),
}


def get_norm(name: str, owner: str) -> NormScheme:
    """The scheme registered as ``name``; a ``ValueError`` naming ``owner`` for unknown names."""
    if not isinstance(name, str) or name not in NORMS:
        raise ValueError(f"{owner}: expected norm to be one of {', '.join(map(repr, NORMS))}, got {name!r}")
    scheme = NORMS[name]
    if scheme.name != name:
        raise ValueError(
            f"{owner}: expected seqnorm.NORMS[{name!r}] to be registered under its own name, got the scheme "
            f"{scheme.name!r}"
        )
    return scheme


def resolve_norm(owner: str, norm: str | NormSpec, max_steps: int = DEFAULT_MAX_STEPS) -> NormSpec:
    """The spec that ``norm=`` and ``max_steps=`` of a cell or layer mean; errors name ``owner``.

    ``norm`` is a registry name (its default spec) or a spec (checked when it was made). ``max_steps``, which every
    cell and layer takes (the public API contract), is folded into a spec that has it unless it is the default;
    norms without per-timestep statistics ignore it. A spec that sets another ``max_steps`` is a ``ValueError``.
    """
    if isinstance(norm, NormSpec):
        scheme = NORMS.get(norm.name)  # type: ignore[arg-type]
        if scheme is None or type(norm) is not scheme.spec:
            choices = ", ".join(f"{s.spec.__name__}" for s in NORMS.values())
            raise ValueError(f"{owner}: expected a norm spec registered in seqnorm.NORMS ({choices}), got {norm!r}")
        spec = norm
    else:
        spec = get_norm(norm, owner).spec()
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"{owner}: expected max_steps to be a positive int, got {max_steps!r}")
    if max_steps == DEFAULT_MAX_STEPS or "max_steps" not in field_names(spec):
        return spec
    current = spec.max_steps  # type: ignore[attr-defined]
    if current not in (DEFAULT_MAX_STEPS, max_steps):
        raise ValueError(
            f"{owner}: expected max_steps={current!r} as norm={spec!r} sets it (or no max_steps beside the spec), "
            f"got max_steps={max_steps!r}"
        )
    return checked(owner, spec, max_steps=max_steps)


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


def check_placement(owner: str, spec: NormSpec, *, has_cell_state: bool) -> Placement:
    """The :class:`Placement` that ``spec`` asks of a cell, or a ``ValueError`` naming ``owner`` where the cell cannot
    place it so (``has_cell_state``: an LSTM; the spec checked the rest when it was made)."""
    placement = Placement(
        getattr(spec, "norm_placement", "separate"),
        getattr(spec, "state_norm", "output"),
    )
    # a spec of one's own may declare the switches without the built-in specs' check of their values
    for name, choices in (("norm_placement", get_args(NormPlacement)), ("state_norm", get_args(StateNorm))):
        value = getattr(placement, name)
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{owner}: expected {name} to be one of {', '.join(map(repr, choices))}, got {value!r}")
    if placement.norm_placement == "joint" and not has_cell_state:
        raise ValueError(
            f"{owner}: expected norm_placement='separate' (the GRU candidate gates its recurrent term by r, so the "
            "input and recurrent terms are not one sum), got 'joint'"
        )
    if placement.state_norm == "carried" and not has_cell_state:
        raise ValueError(f"{owner}: expected state_norm='output' (there is no cell state), got 'carried'")
    beta_init = getattr(spec, "beta_init", 0.0)
    if beta_init != 0 and not has_cell_state:
        raise ValueError(f"{owner}: expected beta_init=0 (only an LSTM's cell-state norm has a β), got {beta_init!r}")
    return placement


REMOVED_OPTIONS: dict[str, Any] = {
    "eps": 1e-5,
    "momentum": 0.1,
    "affine": True,
    "gamma_init": None,
    "beta_init": 0.0,
    "input_stats": "timestep",
    "beyond_max_steps": "last",
    "norm_placement": "separate",
    "state_norm": "output",
}
"""Norm options that cells, layers and models took as keywords before specs (now fields of the spec passed as
``norm=``), each with its default of then: a default said nothing, so a norm without that option accepted it (what
an old checkpoint's ``rnn_options`` held, :mod:`seqnorm.lightning.old_hparams`)."""

REMOVED_KEYWORDS = frozenset({*REMOVED_OPTIONS, "small_batch", "norm_options"})
"""The keywords a cell or layer refuses, naming the spec to use: :data:`REMOVED_OPTIONS`, the small-batch policy and
the ``norm_options`` dict that carried the rest."""


def removed_keyword_error(owner: str, norm: object, name: str, value: object) -> TypeError:
    """The ``TypeError`` for a norm option passed to a cell or layer as ``name=value``: it names the spec to use."""
    if name == "norm_options":
        options = dict(value) if isinstance(value, Mapping) else {}
        wanted = set(options) or {"r_max"}
        shown = ", ".join(f"{key}={item!r}" for key, item in options.items()) or "..."
    else:
        wanted, shown = {name}, f"{name}={value!r}"
    if isinstance(norm, NormSpec):
        own: type[NormSpec] | None = type(norm)
    else:
        own = NORMS[norm].spec if isinstance(norm, str) and norm in NORMS else None
    # weight norm last: its statistics options configure only its optional mean-only BN
    having = [s.spec for s in sorted(NORMS.values(), key=lambda s: s.weight_norm) if wanted <= set(field_names(s.spec))]
    spec = own if own is not None and own in having else (having[0] if having else None)
    if spec is None:
        return TypeError(f"{owner}: got an unexpected keyword {name!r}; a norm's options are fields of its spec")
    others = [s.__name__ for s in having if s is not spec]
    also = (
        f" (or another spec with {', '.join(sorted(wanted))}: {', '.join(others)})"
        if others and spec is not own
        else ""
    )
    return TypeError(f"{owner}: got an unexpected keyword {name!r}; pass norm={spec.__name__}({shown}){also}")


def refuse_removed_keywords(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap a cell's or layer's ``__init__`` so that a norm option passed as a keyword (:data:`REMOVED_KEYWORDS`) is
    a ``TypeError`` naming the spec field to set instead of Python's bare "unexpected keyword argument"."""

    @functools.wraps(init)
    def checked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        for name in sorted(REMOVED_KEYWORDS & kwargs.keys()):
            raise removed_keyword_error(type(self).__name__, kwargs.get("norm", "none"), name, kwargs[name])
        init(self, *args, **kwargs)

    return checked_init
