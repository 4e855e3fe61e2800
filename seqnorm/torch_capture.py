"""What layers and cells do under graph capture: ``torch.export`` / ONNX, ``torch.jit.trace``, ``torch.jit.script``.

- ``torch.export.export`` and ``torch.onnx.export(..., dynamo=True)`` (torch's default) capture the reference loop:
  plain tensor operations, the same function as the fast paths (which the tests check), with nothing hand-written
  for autograd to miss. The captured program is specialized to the example's sequence length (torch.export guards
  it; the ONNX model declares static input shapes). A model in training mode whose norms use batch statistics is
  refused: the running-statistics updates are state the exported graph does not carry, so its outputs would differ
  from eager ones.
- ``torch.jit.trace`` (also under ``torch.onnx.export(..., dynamo=False)``) records Python's control flow as
  constants: the time loop unrolled for the example's length, its padding (``lengths``) baked in, the hand-written
  backward of the fast path not at all. The graph would be silently wrong for other inputs, so it is refused with a
  ``RuntimeError`` naming the alternatives.
- ``torch.jit.script`` cannot compile the layers (keyword-only arguments, Python containers, registries); it is
  refused up front with the same alternatives, before TorchScript's own less helpful error.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ALTERNATIVES", "captured_by_export", "refuse_scripting"]

ALTERNATIVES = (
    "torch.export.export(model, args), torch.onnx.export(model, args, dynamo=True) (the default) or "
    "torch.compile(model)"
)


def captured_by_export(module: nn.Module) -> bool:
    """Whether ``torch.export`` (or the ONNX exporter on top of it) is capturing ``module`` now: then it must run the
    reference loop. A ``RuntimeError`` under ``torch.jit.trace``, a ``ValueError`` for a training-mode model with
    batch statistics under export (see the module docstring)."""
    owner = type(module).__name__
    if torch.jit.is_tracing():
        raise RuntimeError(
            f"{owner}: expected {ALTERNATIVES} to capture the model, got torch.jit.trace (or "
            "torch.onnx.export(..., dynamo=False), which traces): a trace records the time loop unrolled for this "
            "input's length and padding and would be silently wrong for other inputs"
        )
    if not torch.compiler.is_exporting():
        return False
    # Batch statistics, or per-step running ones a training forward updates (weight norm's mean-only BN).
    batch_statistics = any(
        getattr(getattr(cell, "scheme", None), "batch_statistics", False) or getattr(cell, "indexed_by_step", False)
        for cell in module.modules()
    )
    if module.training and batch_statistics:
        raise ValueError(
            f"{owner}: expected model.eval() before export (an exported graph does not carry the running-statistics "
            "updates of training-mode batch norm, so its outputs would differ), got a model in training mode"
        )
    return True


def refuse_scripting(module: nn.Module) -> None:
    """Called by ``torch.jit.script`` (``__prepare_scriptable__``) before it compiles ``module``."""
    raise RuntimeError(
        f"{type(module).__name__}: expected {ALTERNATIVES}, got torch.jit.script, which cannot compile seqnorm's "
        "layers and cells"
    )
