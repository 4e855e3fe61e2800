"""What the Triton backend's two layouts share: the row norms of every step at once (the input norm before the loop,
the parameter gradients after it), the per-step product, the projection's gradients, the launch arguments."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from seqnorm.kernels.backend import KernelNorm
from seqnorm.kernels.triton_backend.launch import launch
from seqnorm.kernels.triton_backend.norms import KINDS, rows_backward, rows_forward

FLOATS = (torch.float32, torch.float64)
"""The dtypes the kernels compute in."""

_ROWS_EACH = 64  # rows a program of the whole-block backward sums its parameter gradients over


def code(norm: KernelNorm) -> int:
    """The norm's kind as the kernels' compile-time constant (:data:`~seqnorm.kernels.triton_backend.norms.KINDS`)."""
    return KINDS[norm.kind]


def identity(norm: KernelNorm) -> bool:
    """No norm and no shift: the output is the input."""
    return norm.kind == "none" and norm.shift is None


def block(hidden: int) -> int:
    return triton.next_power_of_2(hidden)


def param(tensor: Tensor | None, like: Tensor) -> Tensor:
    """A norm's γ or shift, or ``like`` where it has none (the kernels do not read it then)."""
    return like if tensor is None else tensor


def normalize_rows(x: Tensor, norm: KernelNorm) -> tuple[Tensor, list[Tensor]]:
    """``γ N(x) + shift`` of every row of ``x`` (..., F) at once, and the statistics its backward needs."""
    if identity(norm):
        return x, []
    features = x.shape[-1]
    flat = x.reshape(-1, features)
    out = torch.empty_like(flat)
    mean = flat.new_empty(flat.shape[0])
    rstd = flat.new_empty(flat.shape[0])
    launch(
        rows_forward, (flat.shape[0],),
        flat, out, param(norm.weight, flat), param(norm.shift, flat), mean, rstd, features, norm.eps,
        KIND=code(norm), SHIFT=norm.shift is not None, BLOCK=block(features),
    )  # fmt: skip
    stats = [mean.view(x.shape[:-1]), rstd.view(x.shape[:-1])] if code(norm) else []
    return out.view(x.shape), stats


def rows_backward_all(
    dy: Tensor, x: Tensor, stats: list[Tensor], norm: KernelNorm, want_dx: bool
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """dx (``want_dx``), dL/dγ and dL/dshift of a norm applied to every row of ``x`` (..., F), given dL/dy."""
    if identity(norm):
        return dy if want_dx else None, None, None
    features = x.shape[-1]
    flat_dy, flat_x = dy.reshape(-1, features), x.reshape(-1, features)
    rows = flat_dy.shape[0]
    programs = triton.cdiv(rows, _ROWS_EACH)
    dweight = flat_dy.new_empty(programs, features)
    dshift = flat_dy.new_empty(programs, features)
    write_dx = want_dx and code(norm) != 0
    dx = torch.empty_like(flat_dy) if write_dx else flat_dy
    mean, rstd = (stats[0].reshape(-1), stats[1].reshape(-1)) if code(norm) else (flat_dy, flat_dy)
    launch(
        rows_backward, (programs,),
        flat_dy, flat_x, mean, rstd, param(norm.weight, flat_dy), dx, dweight, dshift, rows, features,
        KIND=code(norm), WRITE_DX=write_dx, ROWS_EACH=_ROWS_EACH, BLOCK=block(features),
    )  # fmt: skip
    grad_weight = dweight.sum(0) if norm.weight is not None and code(norm) else None
    grad_shift = dshift.sum(0) if norm.shift is not None else None
    return (dx.view(dy.shape) if want_dx else None), grad_weight, grad_shift


HALVES = (torch.bfloat16, torch.float16)
"""The dtypes the per-step product may take its operands in (under autocast)."""

HALF_INTO_FLOAT32 = torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm.dtype_out", "CUDA")
"""Whether this torch has cuBLAS's half-precision product with a float32 output on CUDA (``torch.mm(...,
out_dtype=torch.float32)``): the float32 sum kept as is, not rounded to half precision."""


class StepProduct:
    """The per-step product ``a @ weight`` into ``out`` (``W_hh h`` forward, ``dL/d(W_hh h) W_hh`` backward).

    Without ``half``, in the parameters' dtype. With ``half`` (autocast's dtype, :data:`HALVES`) the operands are in
    half precision and the sum is not: ``weight`` is cast once per call, the step kernels write ``a`` in ``half``
    beside the full-precision tensor (:meth:`operand`), and the product accumulates in ``out``'s dtype, as cuBLAS's
    half-precision GEMM with a float32 output does. Where that GEMM is not available (the interpreter's CPU tensors,
    an older torch) it is computed exactly so: a product of two half-precision numbers is exact in float32, so
    ``a`` widened into a buffer times the widened half-precision weight sums the same products.

    Args:
        weight: the step's right operand, ``(K, N)`` (a view such as ``W_hh.t()`` is kept as it is).
        rows: the left operand's rows.
        like: a tensor of the loop's dtype and device.
        half: the operands' dtype, or ``None``.
    """

    def __init__(self, weight: Tensor, rows: int, like: Tensor, half: torch.dtype | None) -> None:
        if half is not None and half not in HALVES:
            raise ValueError(f"StepProduct: expected half in {HALVES} or None, got {half}")
        self.half = half
        self.weight = weight if half is None else weight.to(half)
        emulated = half is not None and not (HALF_INTO_FLOAT32 and like.is_cuda and like.dtype == torch.float32)
        # the emulation's buffers: ``a`` widened, and the half-precision weight widened (once)
        self._widened = like.new_empty(rows, weight.shape[0]) if emulated else None
        self._wide_weight = self.weight.to(like.dtype) if emulated else None
        self._operands = None if half is None else like.new_empty(2, rows, weight.shape[0], dtype=half)
        self._like = like

    @classmethod
    def forward(cls, weight_hh: Tensor, h0: Tensor, half: torch.dtype | None) -> StepProduct:
        """``h W_hh^T`` of each forward step; with ``half``, ``h0`` is written into the operand step 0 reads."""
        product = cls(weight_hh.t(), h0.shape[0], h0, half)
        if half is not None:
            product.operand(-1).copy_(h0)
        return product

    def operand(self, t: int) -> Tensor:
        """The half-precision buffer the step kernel of step ``t`` writes the next product's left operand into (two
        in turn: a step writes one while its product reads the other); without ``half``, a placeholder the kernels
        do not write."""
        return self._like if self._operands is None else self._operands[t % 2]

    def __call__(self, a: Tensor, t: int, out: Tensor) -> None:
        """``out = a @ weight``. With ``half`` the left operand is ``a``'s half-precision copy, which step ``t``'s
        kernel wrote into :meth:`operand` ``(t)``."""
        if self.half is None:
            torch.mm(a, self.weight, out=out)
            return
        left = self.operand(t)
        if self._widened is None:
            torch.mm(left, self.weight, out_dtype=out.dtype, out=out)
        else:
            assert self._wide_weight is not None
            self._widened.copy_(left)
            torch.mm(self._widened, self._wide_weight, out=out)


def lstm_outputs(terms: Tensor, save: bool) -> tuple[int, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A forward LSTM loop's outputs, allocated like ``terms`` ``(T, B, 4H)``: ``kept`` (the steps whose activations
    are kept: all with ``save``, else one slot reused), ``hs`` ``(T, B, H)``, ``cs`` (``T``, else 2 in turn),
    ``acts`` ``(kept, B, 4H)``, ``tanh_cs`` ``(kept, B, H)``, ``raw`` ``(kept, B, 4H)``."""
    steps, rows, width = terms.shape
    hidden = width // 4
    kept = steps if save else 1
    hs = terms.new_empty(steps, rows, hidden)
    cs = terms.new_empty(steps if save else 2, rows, hidden)
    acts = terms.new_empty(kept, rows, width)
    tanh_cs = terms.new_empty(kept, rows, hidden)
    raw = terms.new_empty(kept, rows, width)
    return kept, hs, cs, acts, tanh_cs, raw


def gru_outputs(terms: Tensor, save: bool) -> tuple[int, Tensor, Tensor, Tensor, Tensor]:
    """A forward GRU loop's outputs, allocated like ``terms`` ``(T, B, 3H)``: ``kept`` (as for
    :func:`lstm_outputs`), ``hs`` ``(T, B, H)``, ``acts``, ``us`` and ``raw``, each ``(kept, B, 3H)``."""
    steps, rows, width = terms.shape
    kept = steps if save else 1
    hs = terms.new_empty(steps, rows, width // 3)
    return (
        kept,
        hs,
        terms.new_empty(kept, rows, width),
        terms.new_empty(kept, rows, width),
        terms.new_empty(kept, rows, width),
    )


def mask_arg(mask: Tensor | None, like: Tensor) -> Tensor:
    return like if mask is None else mask


def projection_grads(
    grad_inputs: Tensor, sequence: Tensor | None, weight_ih: Tensor | None, want_input: bool, want_weight: bool
) -> tuple[Tensor | None, Tensor | None]:
    """The input's gradient (of x with a projection W_ih x, else of the input terms) and W_ih's, as large matmuls."""
    if sequence is None or weight_ih is None:
        return (grad_inputs if want_input else None), None
    flat = grad_inputs.reshape(-1, grad_inputs.shape[-1])
    grad_x = (flat @ weight_ih).view(*sequence.shape[:-1], weight_ih.shape[1]) if want_input else None
    grad_w = flat.t() @ sequence.reshape(-1, sequence.shape[-1]) if want_weight else None
    return grad_x, grad_w


def previous_states(h0: Tensor, hs: Tensor) -> Tensor:
    """Each step's h_{t-1}, (T, B, H): h0, then hs but the last."""
    return torch.cat([h0.unsqueeze(0), hs[:-1]])
