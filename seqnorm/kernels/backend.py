"""What a device's kernels provide, the :class:`Backend` contract, and what a norm hands them, :class:`KernelNorm`
(both device-neutral: the CPU's own tuning is :mod:`seqnorm.kernels.cpu`'s).

A backend runs a layer direction's whole normalized recurrence (forward and backward through time) and the no-grad
generation step for tensors of one device type. :func:`seqnorm.kernels.native` returns the device's backend, once
loaded; the plan (:mod:`seqnorm.layers.plan`) asks it whether it can run a cell's norms (:meth:`Backend.unsupported`)
and names its path after it (:attr:`Backend.name`); :mod:`seqnorm.layers.compiled`'s autograd Function and generation
step then call its entry points without deciding anything again.

- ``"kernel"``: the C++ kernels on the CPU (:class:`seqnorm.kernels.cpu.CpuBackend`, sources in ``seqnorm/csrc``).
- ``"triton"``: the Triton kernels on CUDA (:mod:`seqnorm.kernels.triton_backend`); with
  ``SEQNORM_BACKEND=triton`` and ``TRITON_INTERPRET=1``, on CPU tensors through Triton's interpreter (the tests).

The entry points' arguments are the C++ kernels': ``inputs`` ``(T, B, G·H)`` (W_ih x, which the input norm
normalizes, or the finished input terms), states ``(B, H)``, ``W_hh`` ``(G·H, H)``, ``mask`` ``(T, B)`` bool or
``None``, and one :attr:`Backend.NormArgs` per norm (input, recurrent, and an LSTM's cell state), built by
:meth:`KernelNorm.native`. What ``saved`` and ``stats`` hold is the backend's own: its backward
receives what its forward returned. A backend that runs autocast (its :meth:`Backend.unsupported` accepts
``autocast=True``) also takes a keyword ``half`` in its four sequence entry points: the dtype of the per-step
products' operands (autocast's, for float32 parameters), which it sums in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = ["NO_NORM", "Backend", "KernelNorm", "NormKind"]


@runtime_checkable
class Backend(Protocol):
    """The kernels of one device type (see the module's docstring for the arguments)."""

    name: str
    """The plan's path when this backend runs a layer (``layer.plan(x).path``): ``"kernel"`` or ``"triton"``."""

    NormArgs: Callable[..., Any]
    """Builds a norm's arguments: ``kind`` (``"none"``, ``"layer"``, ``"rms"``, ``"batch"``), ``eps``, ``weight``,
    ``shift``, BatchNorm's running statistics and options (:class:`seqnorm.kernels.KernelNorm`'s fields)."""

    def unsupported(
        self,
        kinds: tuple[str, ...],
        dtype: torch.dtype,
        *,
        step: bool = False,
        training: bool = False,
        autocast: bool = False,
    ) -> str | None:
        """Why a cell whose norms (input, recurrent, and an LSTM's cell state) are of ``kinds`` cannot run here in
        ``dtype`` (``step``: the no-grad generation step; ``training``: the cell's mode; ``autocast``: under
        autocast, ``dtype`` being the parameters'), or ``None``."""
        ...

    def lstm_forward(
        self, inputs: Tensor, h0: Tensor, c0: Tensor, weight_hh: Tensor, mask: Tensor | None,
        ih: Any, hh: Any, c: Any, save: bool,
    ) -> tuple[list[Tensor], list[Tensor | None], list[list[Tensor]], list[int]]:  # fmt: skip
        """``([hs, h_n, c_n], saved, stats, fallback steps per norm)``; ``saved``/``stats`` empty without ``save``."""
        ...

    def lstm_backward(self, *args: Any) -> list[Tensor | None]:
        """``(grad_hs, grad_h_n, grad_c_n, inputs, h0, c0, weight_hh, mask, hs, saved[:3], saved[3], stats, ih, hh,
        c, sequence, weight_ih, want_input, want_weight_ih)`` -> the gradients of the input (x when ``sequence`` and
        ``weight_ih`` are given: the backend makes the projection's gradients), h0, c0, W_hh, (γ, shift) of each
        norm, W_ih."""
        ...

    def gru_forward(
        self, inputs: Tensor, h0: Tensor, weight_hh: Tensor, mask: Tensor | None, ih: Any, hh: Any, save: bool
    ) -> tuple[list[Tensor], list[Tensor], list[list[Tensor]], list[int]]:
        """``([hs, h_n], saved, stats, fallback steps per norm)``."""
        ...

    def gru_backward(self, *args: Any) -> list[Tensor | None]:
        """``(grad_hs, grad_h_n, inputs, h0, weight_hh, mask, hs, saved, stats, ih, hh, sequence, weight_ih,
        want_input, want_weight_ih)`` -> as :meth:`lstm_backward`, without c0 and the cell-state norm."""
        ...

    def generation_step(
        self, cell: str, x: Tensor, h: Tensor, c: Tensor | None, weight_ih_t: Tensor, weight_hh_t: Tensor,
        ih: Any, hh: Any, c_norm: Any, step: int,
    ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        """One no-grad step: ``x`` ``(B, I)``, ``h``/``c`` ``(1, B, H)`` -> ``(h', c')`` (``c'`` ``None``: GRU)."""
        ...

    def prepare_step(self, weights: tuple[Tensor, Tensor], rows: int, fixed: Callable[[Tensor, Tensor], Any]) -> Any:
        """The generation step ``fixed(W_ih^T, W_hh^T)`` for ``rows`` rows, in whatever layout of the weights is
        fastest here (the CPU measures it; a GPU takes the transposed views)."""
        ...

    def project_kept(self, sequence: Tensor, weight: Tensor, out: Tensor) -> Tensor:
        """The input projection ``W x`` of the whole sequence into ``out`` (:func:`seqnorm.kernels.projection.project`),
        with the operands in whatever layout is fastest here."""
        ...

    def empty_like_saved(self, sizes: list[int], like: Tensor) -> Tensor:
        """An uninitialized tensor of ``like``'s dtype and device for a recurrence's large saved tensors."""
        ...

    def empty_cache(self) -> None:
        """Let go of memory the backend keeps between calls (none on CUDA: torch's allocator keeps it)."""
        ...

    def set_cache_limit(self, nbytes: int) -> None: ...

    def cache_info(self) -> tuple[int, int, int, int]:
        """``(bytes kept, limit, blocks reused, blocks made)``."""
        ...


NormKind = Literal["none", "layer", "rms", "batch"]


@dataclass(frozen=True)
class KernelNorm:
    """What a norm module hands the kernels (its ``kernel_norm(shift)``): its kind, options and tensors.

    ``shift`` is the norm's β plus whatever bias follows it. Per-timestep BatchNorm passes its running buffers, which
    the kernel updates in place in training exactly as the module's forward does; ``momentum < 0`` means a
    cumulative average (``momentum=None``). Renormalization adds its ``r_max``/``d_max`` schedule. For a generation
    step (nothing changes until the cached step is rebuilt) BatchNorm in evaluation also passes its statistics
    folded per row into ``folded_scale``/``folded_offset`` (``(R, F)``), filled as the steps reach them
    (``fold_through``).
    """

    kind: NormKind
    eps: float = 1e-5
    weight: Tensor | None = None
    shift: Tensor | None = None
    running_mean: Tensor | None = None
    running_var: Tensor | None = None
    num_batches_tracked: Tensor | None = None
    momentum: float = 0.1
    training: bool = False
    renorm: bool = False
    r_max: float = 1.0
    d_max: float = 0.0
    warmup: int = 0
    r_max_steps: int = 1
    d_max_steps: int = 1
    folded_scale: Tensor | None = None
    folded_offset: Tensor | None = None
    fold_through: Callable[[int], int] | None = field(default=None, compare=False)
    """Where the folded rows are filled as the steps reach them (BN's :class:`~seqnorm.norms.batch_pieces.FoldedRows`):
    call it with a step's time index before the step; it returns the first time index not folded yet."""
    owner: Any = field(default=None, compare=False)
    """The module (the layers add the kernel's fallback-step count to its ``fallback_steps``)."""

    def native(self, kernels: Backend) -> Any:
        """The C++ ``NormArgs`` of ``kernels``.

        The kernels index every tensor as dense rows: the read-only ones are made contiguous here (a parameter
        loaded with ``load_state_dict(assign=True)`` may be strided, or expanded); the running statistics, updated
        in place, must already be (:meth:`TimestepBatchNorm.fast_form_blocker` routes other buffers elsewhere).
        """
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            buffer = getattr(self, name)
            if buffer is not None and not buffer.is_contiguous():
                raise ValueError(
                    f"KernelNorm: expected {name} to be contiguous (updated in place), got strides {buffer.stride()}"
                )
        return kernels.NormArgs(
            kind=self.kind,
            eps=self.eps,
            weight=_dense(self.weight),
            shift=_dense(self.shift),
            running_mean=self.running_mean,
            running_var=self.running_var,
            num_batches_tracked=self.num_batches_tracked,
            momentum=self.momentum,
            training=self.training,
            renorm=self.renorm,
            r_max=self.r_max,
            d_max=self.d_max,
            warmup=self.warmup,
            r_max_steps=self.r_max_steps,
            d_max_steps=self.d_max_steps,
            folded_scale=_dense(self.folded_scale),
            folded_offset=_dense(self.folded_offset),
        )


def _dense(tensor: Tensor | None) -> Tensor | None:
    return None if tensor is None else tensor.contiguous()


NO_NORM = KernelNorm("none")
