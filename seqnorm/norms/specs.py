"""Norm specs: one frozen dataclass per registered norm, carrying exactly the options of that norm.

``norm=`` takes a registry name (``"batch"``, the short form: that norm's default spec) or a spec
(``BatchNormSpec(max_steps=256, momentum=0.05)``). A spec validates its fields once, when it is made; cells and layers
build their norms from it without checking again. Each spec names its registry entry (``spec.name``).

The specs are named ``<Norm>Spec`` because :mod:`seqnorm.norms` already exports the norm *modules*
(:class:`~seqnorm.norms.LayerNorm`, :class:`~seqnorm.norms.RMSNorm`, ...); one suffix for all keeps the six parallel,
and ``BatchNormSpec`` does not read like a module as torch's ``BatchNorm1d`` does.

Where the norm sits is part of its spec too: ``norm_placement`` and ``state_norm`` (the cell reads them as its
:class:`~seqnorm.norms.Placement`), since which placements exist depends on the norm (none for ``"none"``, no state
norm for ``"weight"``); only what depends on the cell (a GRU has no joint sum and no cell state) is checked there.

In configs a spec is written as jsonargparse writes any class (``--model.norm.class_path
seqnorm.norms.BatchNormSpec --model.norm.init_args.momentum 0.05``); in checkpoints as plain data
(:meth:`NormSpec.to_dict`), which only seqnorm's registry turns back into a spec (:func:`seqnorm.norms.spec_from_dict`).
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Literal

from seqnorm.norms.batch import (
    DEFAULT_MAX_STEPS,
    DEFAULT_SMALL_BATCH,
    SMALL_BATCH_POLICIES,
    BeyondMaxSteps,
    SmallBatchPolicy,
)
from seqnorm.validation import check_eps, check_finite, check_momentum

__all__ = [
    "BatchNormSpec",
    "BatchRenormSpec",
    "InputStats",
    "LayerNormSpec",
    "NoNormSpec",
    "NormPlacement",
    "NormSpec",
    "RMSNormSpec",
    "StateNorm",
    "WeightNormSpec",
    "checked",
    "default_of",
    "field_names",
]

InputStats = Literal["timestep", "sequence"]
NormPlacement = Literal["separate", "joint"]
StateNorm = Literal["output", "carried"]


# Whom a failed check names: the spec itself, or the cell, layer or model that was given the options (`checked`).
_owner: ContextVar[str | None] = ContextVar("seqnorm_norm_spec_owner", default=None)


def _fail(owner: str, expected: str, got: object) -> ValueError:
    return ValueError(f"{owner}: expected {expected}, got {got}")


def _check_choice(owner: str, name: str, value: object, choices: tuple[Any, ...]) -> None:
    # `type(...) is` so that 1 and 0 do not pass for True and False
    if value not in choices or type(value) is not type(choices[0]):
        raise _fail(owner, f"{name} to be one of {', '.join(map(repr, choices))}", repr(value))


def _check_int(owner: str, name: str, value: object, low: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _fail(owner, f"{name} to be {what}", repr(value))


class NormSpec:
    """Base of the norm specs (not itself a dataclass, so configs can name any subclass by ``class_path``).

    Subclasses are frozen dataclasses: hashable, comparable, and never changed after their check. ``name`` is the
    registry entry the spec belongs to.
    """

    name: ClassVar[str]

    def __post_init__(self) -> None:
        self.check(_owner.get() or type(self).__name__)

    def check(self, owner: str) -> None:
        """Raise a ``ValueError`` naming ``owner`` for a field out of range or options that contradict each other."""

    def options(self) -> dict[str, Any]:
        """The fields that differ from their defaults (what ``repr`` shows)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        """Plain data for hyperparameters and checkpoints: ``{"name": <registry name>, <every field>: value}``."""
        return {"name": self.name, **{f.name: getattr(self, f.name) for f in fields(self)}}  # type: ignore[arg-type]

    def __repr__(self) -> str:
        # Only what was set: a default spec reads `BatchNormSpec()`, as it is written.
        return f"{type(self).__name__}({', '.join(f'{key}={value!r}' for key, value in self.options().items())})"


def checked(owner: str, spec: NormSpec, **changes: Any) -> NormSpec:
    """``dataclasses.replace(spec, **changes)``, its check failing with a ``ValueError`` that names ``owner``.

    ``LSTM(3, 4, norm="batch", momentum=2.0)`` should read ``LSTM: expected momentum to be ..., got 2.0``: the user
    typed ``LSTM``, not ``BatchNormSpec``.
    """
    token = _owner.set(owner)
    try:
        return replace(spec, **changes)  # type: ignore[type-var]
    finally:
        _owner.reset(token)


def default_of(spec: type[NormSpec], name: str) -> Any:
    """The default of field ``name`` of ``spec``."""
    return next(f.default for f in fields(spec) if f.name == name)  # type: ignore[arg-type]


def field_names(spec: type[NormSpec] | NormSpec) -> tuple[str, ...]:
    return tuple(f.name for f in fields(spec))  # type: ignore[arg-type]


@dataclass(frozen=True, repr=False, kw_only=True)
class NoNormSpec(NormSpec):
    """``norm="none"``: no normalization, exactly ``torch.nn.LSTMCell``/``GRUCell``. No options."""

    name: ClassVar[str] = "none"


@dataclass(frozen=True, repr=False, kw_only=True)
class _Placed(NormSpec):
    """Where the gate-term norms sit: ``"separate"`` (default): ``N_ih(W_ih x) + N_hh(W_hh h) + b`` (Ba et al.,
    Cooijmans et al.); ``"joint"``: one norm over the sum, ``N(W_ih x + W_hh h) + b`` (LSTM only: the GRU candidate
    gates its recurrent term by ``r``, so the sum is not a single term there)."""

    norm_placement: NormPlacement = "separate"

    def check(self, owner: str) -> None:
        _check_choice(owner, "norm_placement", self.norm_placement, ("separate", "joint"))


@dataclass(frozen=True, repr=False, kw_only=True)
class _StatePlaced(_Placed):
    """``state_norm``: ``"output"`` (default): ``h' = o * tanh(N_c(c'))`` with the raw ``c'`` carried;
    ``"carried"``: ``c' <- N_c(c')`` is the new cell state too (LSTM only)."""

    state_norm: StateNorm = "output"

    def check(self, owner: str) -> None:
        _Placed.check(self, owner)
        _check_choice(owner, "state_norm", self.state_norm, ("output", "carried"))


@dataclass(frozen=True, repr=False, kw_only=True)
class _Affine(NormSpec):
    """The learned gain γ (and cell-state shift β) that layer, RMS and batch norms share."""

    affine: bool = True
    gamma_init: float | None = None
    beta_init: float = 0.0

    def check(self, owner: str) -> None:
        _check_choice(owner, "affine", self.affine, (True, False))
        for name in ("gamma_init", "beta_init"):
            value = getattr(self, name)
            if value is not None:
                check_finite(owner, name, value)
        if not self.affine and (self.gamma_init is not None or self.beta_init != 0):
            raise _fail(
                owner,
                "gamma_init=None and beta_init=0 with affine=False (nothing to initialize)",
                f"gamma_init={self.gamma_init!r}, beta_init={self.beta_init!r}",
            )


@dataclass(frozen=True, repr=False, kw_only=True)
class _Row(_Affine, _StatePlaced):
    eps: float = 1e-5

    def check(self, owner: str) -> None:
        check_eps(owner, self.eps)
        _Affine.check(self, owner)
        _StatePlaced.check(self, owner)


@dataclass(frozen=True, repr=False, kw_only=True)
class LayerNormSpec(_Row):
    r"""``norm="layer"`` (Ba et al. 2016): each row normalized over its features, in training and evaluation alike.

    Args:
        eps: added to the variance (> 0). Default: 1e-5.
        affine: learn the gains γ (and the cell-state norm's shift β); ``False``: bare normalizations.
        gamma_init: initial γ; ``None``: 1.0.
        beta_init: initial β of the LSTM cell-state norm (gate terms have no β: the cell bias follows them).
        norm_placement: ``"separate"`` (default) or ``"joint"`` (one norm over ``W_ih x + W_hh h``; LSTM only).
        state_norm: ``"output"`` (default: the raw ``c'`` is carried) or ``"carried"`` (``c' <- N_c(c')``; LSTM
            only).
    """

    name: ClassVar[str] = "layer"


@dataclass(frozen=True, repr=False, kw_only=True)
class RMSNormSpec(_Row):
    """``norm="rms"`` (Zhang & Sennrich 2019): rows scaled by their RMS; options as :class:`LayerNormSpec`."""

    name: ClassVar[str] = "rms"


@dataclass(frozen=True, repr=False, kw_only=True)
class _Statistics(NormSpec):
    """Options of per-timestep batch statistics (:class:`~seqnorm.norms.TimestepBatchNorm`)."""

    eps: float = 1e-5
    momentum: float | None = 0.1
    max_steps: int = DEFAULT_MAX_STEPS
    small_batch: SmallBatchPolicy = DEFAULT_SMALL_BATCH
    beyond_max_steps: BeyondMaxSteps = "last"

    def check(self, owner: str) -> None:
        check_eps(owner, self.eps)
        check_momentum(owner, self.momentum)
        _check_int(owner, "max_steps", self.max_steps, 1, "a positive int")
        if self.small_batch not in SMALL_BATCH_POLICIES:
            raise _fail(owner, "small_batch to be 'tail', 'error' or 'running'", repr(self.small_batch))
        _check_choice(owner, "beyond_max_steps", self.beyond_max_steps, ("last", "pooled"))


@dataclass(frozen=True, repr=False, kw_only=True)
class WeightNormSpec(_Statistics, _Placed):
    """``norm="weight"`` (Salimans & Kingma 2016): ``W = g · v/‖v‖`` per output row of ``W_ih`` and ``W_hh``.

    Args:
        mean_only_bn: add their mean-only batch norm: per-timestep centering of the gate terms, no scaling.
        norm_placement: of that mean-only BN, as :class:`LayerNormSpec` (``"joint"`` needs ``mean_only_bn=True``).
        eps, momentum, max_steps, small_batch, beyond_max_steps: of that mean-only BN, as
            :class:`BatchNormSpec`; with ``mean_only_bn=False`` they must keep their defaults (there are no
            statistics to configure), except ``max_steps``, which every norm accepts and this one then ignores.
    """

    name: ClassVar[str] = "weight"
    mean_only_bn: bool = False

    def check(self, owner: str) -> None:
        _Statistics.check(self, owner)
        _Placed.check(self, owner)
        _check_choice(owner, "mean_only_bn", self.mean_only_bn, (True, False))
        if self.norm_placement == "joint" and not self.mean_only_bn:
            raise _fail(
                owner,
                "mean_only_bn=True for norm_placement='joint' with norm='weight' (weight norm alone has no norm to "
                "place)",
                "no mean-only BN",
            )
        if not self.mean_only_bn:
            # max_steps is accepted whatever the norm (the public API contract): ignored here rather than refused
            unused = {key: value for key, value in self.options().items() if key not in ("mean_only_bn", "max_steps")}
            if unused:
                raise _fail(
                    owner,
                    f"mean_only_bn=True for {', '.join(f'{k}={v!r}' for k, v in unused.items())} with norm='weight' "
                    "(they configure its mean-only batch norm)",
                    "mean_only_bn=False",
                )


@dataclass(frozen=True, repr=False, kw_only=True)
class _Batch(_Affine, _Statistics, _StatePlaced):
    input_stats: InputStats = "timestep"

    def check(self, owner: str) -> None:
        _Statistics.check(self, owner)
        _check_choice(owner, "input_stats", self.input_stats, ("timestep", "sequence"))
        _Affine.check(self, owner)
        _StatePlaced.check(self, owner)
        if self.input_stats == "sequence" and self.norm_placement == "joint":
            raise _fail(
                owner,
                "input_stats='timestep' with norm_placement='joint' (the joint norm sees the recurrent term, which "
                "exists one step at a time)",
                "'sequence'",
            )


@dataclass(frozen=True, repr=False, kw_only=True)
class BatchNormSpec(_Batch):
    """``norm="batch"`` (Cooijmans et al. 2016): per-timestep batch statistics, γ initialized to 0.1, β of the gate
    terms fixed at 0.

    Args:
        eps: added to the variance (> 0). Default: 1e-5.
        momentum: weight of the new batch in the running moments; ``None``: their cumulative average (as
            ``torch.nn.BatchNorm1d``). Default: 0.1.
        max_steps: time steps with their own statistics; later steps follow ``beyond_max_steps``. Default: 100.
        small_batch: what a training step with fewer than 2 active rows does: ``"tail"`` (default: in a batch of
            2 or more rows, normalize it with the running statistics of the step, not updating them, and count it;
            a batch of 1 row raises), ``"error"`` (always raise) or ``"running"`` (always fall back, batch size 1
            too). See :mod:`seqnorm.norms.batch`.
        beyond_max_steps: ``"last"`` (default) or ``"pooled"``: the statistics of steps ``t >= max_steps``
            (:mod:`seqnorm.norms.batch`).
        input_stats: ``"timestep"`` (default) or ``"sequence"``: the input term's statistics per step, or over
            batch × time excluding padding (BN-e*, Deep Speech 2).
        affine, gamma_init, beta_init: as :class:`LayerNormSpec`; ``gamma_init=None`` means 0.1.
        norm_placement, state_norm: as :class:`LayerNormSpec`.
    """

    name: ClassVar[str] = "batch"


@dataclass(frozen=True, repr=False, kw_only=True)
class BatchRenormSpec(_Batch):
    """``norm="batch_renorm"`` (Ioffe 2017): :class:`BatchNormSpec` with the r/d correction and its schedule.

    Args:
        r_max: final bound of ``r``. Default: 3.0.
        d_max: final bound of ``d``. Default: 5.0.
        warmup: training batches (per step) of plain BN before the correction starts. Default: 5000.
        r_max_steps: batches after ``warmup`` over which ``r_max`` ramps from 1. Default: 35000 (so it reaches
            its final value at batch 40000, as in the paper).
        d_max_steps: batches after ``warmup`` over which ``d_max`` ramps from 0. Default: 20000 (final at batch
            25000, as in the paper).
        the rest: as :class:`BatchNormSpec`.
    """

    name: ClassVar[str] = "batch_renorm"
    r_max: float = 3.0
    d_max: float = 5.0
    warmup: int = 5000
    r_max_steps: int = 35000
    d_max_steps: int = 20000

    def check(self, owner: str) -> None:
        super().check(owner)
        check_finite(owner, "r_max", self.r_max, "a finite number >= 1", lambda r_max: r_max >= 1)
        check_finite(owner, "d_max", self.d_max, "a finite number >= 0", lambda d_max: d_max >= 0)
        _check_int(owner, "warmup", self.warmup, 0, "an int >= 0")
        _check_int(owner, "r_max_steps", self.r_max_steps, 1, "a positive int")
        _check_int(owner, "d_max_steps", self.d_max_steps, 1, "a positive int")
