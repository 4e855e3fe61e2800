"""seqnorm's Triton backend: the normalized LSTM/GRU recurrence for CUDA tensors (and, with ``TRITON_INTERPRET=1``,
CPU tensors through Triton's interpreter, which is how the tests run it).

The split is haste's: the input projection and, for a norm per row, the input norm of all steps at once; per step one
``torch.mm`` (cuBLAS on a GPU) into a preallocated buffer and one fused Triton kernel; the backward the same way in
reverse, with the weight and input gradients as large matmuls after the loop. Two layouts of the step kernels:
a program per row of the batch where every norm keeps its statistics per row (:mod:`.rows`), a program per block of
features over every row where per-timestep BatchNorm takes statistics across the rows (:mod:`.column_layout`). The
entry points have the C++ kernels' signatures (:class:`seqnorm.kernels.backend.Backend`), so the autograd Function of
:mod:`seqnorm.layers.compiled` and the plan run unchanged. Nothing here reads a value back to the host inside the loops.

Kernels: :mod:`.norms` (each norm's statistics and backward), :mod:`.cells` (the gates), :mod:`.recurrence` and
:mod:`.columns` (the fused steps of the two layouts); every launch goes through :func:`.launch.launch`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from seqnorm.kernels.backend import KernelNorm
from seqnorm.kernels.projection import project
from seqnorm.kernels.triton_backend import column_layout, rows
from seqnorm.kernels.triton_backend.checks import check_backward, check_forward, check_step
from seqnorm.kernels.triton_backend.common import FLOATS

__all__ = [
    "NormArgs",
    "cache_info",
    "empty_cache",
    "empty_like_saved",
    "generation_step",
    "gru_backward",
    "gru_forward",
    "lstm_backward",
    "lstm_forward",
    "name",
    "prepare_step",
    "project_kept",
    "set_cache_limit",
    "unsupported",
]

name = "triton"
"""The plan's path for this backend (``layer.plan(x).path``)."""

_ROW_KINDS = ("none", "layer", "rms")


def NormArgs(**fields: Any) -> KernelNorm:
    """A norm's arguments (:meth:`seqnorm.kernels.KernelNorm.native`): for this backend, the ``KernelNorm`` itself."""
    return KernelNorm(**fields)


def unsupported(
    kinds: tuple[str, ...], dtype: torch.dtype, *, step: bool = False, training: bool = False, autocast: bool = False
) -> str | None:
    """Why this backend cannot run a cell whose norms (input, recurrent, cell state) are of ``kinds`` in ``dtype``
    (``step``: the no-grad generation step; ``training``: the cell's mode), or ``None``. Under ``autocast`` the
    recurrence runs in the parameters' ``dtype`` (statistics, gates and states in float32: the plain path's
    precision), the input projection in autocast's, and so do the operands of each step's product ``W_hh h`` and
    its backward's (the entry points' ``half``; summed in float32: :class:`.common.StepProduct`)."""
    if dtype not in FLOATS:
        return f"dtype {dtype}"
    if autocast and step:
        return "a generation step under autocast"
    if step:  # evaluation's BatchNorm comes folded into a scale and offset per feature: any mix runs by rows
        return "a generation step in training with batch statistics" if training and "batch" in kinds else None
    input_kind, *recurrent = kinds
    if all(kind in _ROW_KINDS for kind in kinds):
        return None
    if all(kind in ("none", "batch") for kind in recurrent) and input_kind in (*_ROW_KINDS, "batch"):
        return None
    return f"norms {kinds}: statistics per row and across the rows mixed in the recurrence"


def _columns(*norms: KernelNorm) -> bool:
    return any(norm.kind == "batch" for norm in norms)


def lstm_forward(
    inputs: Tensor, h0: Tensor, c0: Tensor, weight_hh: Tensor, mask: Tensor | None,
    ih: KernelNorm, hh: KernelNorm, c_norm: KernelNorm, save: bool, *, half: torch.dtype | None = None,
) -> tuple[list[Tensor], list[Tensor | None], list[list[Tensor]], list[int]]:  # fmt: skip
    """The C++ ``lstm_forward``'s contract: ``([hs, h_n, c_n], saved, stats, fallbacks)``; ``half``: under
    autocast, the dtype of the per-step products' operands (:func:`unsupported`)."""
    check_forward("lstm_forward", 4, inputs, h0, c0, weight_hh, mask, (ih, hh, c_norm))
    layout = column_layout if _columns(ih, hh, c_norm) else rows
    return layout.lstm_forward(inputs, h0, c0, weight_hh, mask, ih, hh, c_norm, save, half=half)


def lstm_backward(*args: Any, half: torch.dtype | None = None) -> list[Tensor | None]:
    """The C++ ``lstm_backward``'s contract (:class:`~seqnorm.kernels.backend.Backend`); ``half`` as for the
    forward."""
    ih, hh, c_norm = args[12:15]
    check_backward("lstm_backward", 4, args[:3], *args[3:9], [*args[9], args[10]], (ih, hh, c_norm), *args[15:17])
    return (column_layout if _columns(ih, hh, c_norm) else rows).lstm_backward(*args, half=half)


def gru_forward(
    inputs: Tensor, h0: Tensor, weight_hh: Tensor, mask: Tensor | None, ih: KernelNorm, hh: KernelNorm, save: bool,
    *, half: torch.dtype | None = None,
) -> tuple[list[Tensor], list[Tensor], list[list[Tensor]], list[int]]:  # fmt: skip
    """The C++ ``gru_forward``'s contract: ``([hs, h_n], saved, stats, fallbacks)``; ``half`` as for an LSTM."""
    check_forward("gru_forward", 3, inputs, h0, None, weight_hh, mask, (ih, hh))
    layout = column_layout if _columns(ih, hh) else rows
    return layout.gru_forward(inputs, h0, weight_hh, mask, ih, hh, save, half=half)


def gru_backward(*args: Any, half: torch.dtype | None = None) -> list[Tensor | None]:
    """The C++ ``gru_backward``'s contract (:class:`~seqnorm.kernels.backend.Backend`); ``half`` as for the
    forward."""
    ih, hh = args[9:11]
    check_backward("gru_backward", 3, args[:2], args[2], args[3], None, *args[4:7], args[7], (ih, hh), *args[11:13])
    return (column_layout if _columns(ih, hh) else rows).gru_backward(*args, half=half)


def generation_step(
    cell: str, x: Tensor, h: Tensor, c: Tensor | None, weight_ih_t: Tensor, weight_hh_t: Tensor,
    ih: KernelNorm, hh: KernelNorm, c_norm: KernelNorm, step: int,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The C++ ``generation_step``'s contract (:mod:`.rows`)."""
    check_step(cell, x, h, c, weight_ih_t, weight_hh_t, (ih, hh, c_norm))
    if step < 0:
        raise ValueError(f"seqnorm kernels: generation_step: expected step >= 0, got {step}")
    return rows.generation_step(cell, x, h, c, weight_ih_t, weight_hh_t, ih, hh, c_norm, step)


def prepare_step(weights: tuple[Tensor, Tensor], batch: int, fixed: Callable[[Tensor, Tensor], Any]) -> Any:
    """The generation step on the transposed views of the weights (cuBLAS takes either layout alike)."""
    del batch
    return fixed(*(weight.t() for weight in weights))


def project_kept(sequence: Tensor, weight: Tensor, out: Tensor) -> Tensor:
    """The input projection of the whole sequence into ``out`` (one cuBLAS product; either layout of ``W`` alike)."""
    return project(sequence, weight, out=out)


# --- memory: torch's caching allocator keeps CUDA memory; nothing is kept here ---


def empty_like_saved(sizes: list[int], like: Tensor) -> Tensor:
    return like.new_empty(sizes)


def empty_cache() -> None:
    """Nothing to let go: this backend keeps no memory of its own (torch's allocator does)."""


def set_cache_limit(nbytes: int) -> None:
    del nbytes


def cache_info() -> tuple[int, int, int, int]:
    return (0, 0, 0, 0)
