"""The private or undocumented torch calls seqnorm makes, in one place, each with why a public one does not do.

If a torch release renames or changes one of them, this is the file to adapt (and ``tests/layers/test_fast_path.py``,
``tests/cells/test_cell_loop.py`` and ``tests/layers/test_stepping.py`` are the tests that say so). Names are bound
once at import: the fast paths call them at every step, where one attribute lookup fewer is measurable at batch size
1.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils import parametrizations

__all__ = [
    "CELL_KERNELS",
    "SEQUENCE_KERNELS",
    "batch_norm_backward",
    "batch_norm_with_stats",
    "functorch_transforming",
    "without_parametrization_hooks",
]

# torch.nn.LSTM/GRU's own kernels over a whole sequence (padded or packed): the public modules would need their
# weights copied into an nn.LSTM per call; torch.nn.LSTM.forward itself calls these with its flat weight list.
SEQUENCE_KERNELS: dict[str, Callable[..., Any]] = {"lstm": torch._VF.lstm, "gru": torch._VF.gru}

# torch.nn.LSTMCell/GRUCell's kernels for one step: the same reason, and no module-call overhead at batch size 1.
CELL_KERNELS: dict[str, Callable[..., Any]] = {"lstm": torch._VF.lstm_cell, "gru": torch._VF.gru_cell}

# Training-mode BatchNorm that also returns the mean and 1/std it used (F.batch_norm returns only the output): the
# one-node step of per-timestep BN (seqnorm.norms.protocol.step_node) keeps them for its backward instead of
# recomputing them, and plain BN's fused training step (TimestepBatchNorm._fused_forward_step, under autograd) reads
# them for its padded rows. native_batch_norm updates the running row in place with BN's rule, exactly as
# F.batch_norm does.
batch_norm_with_stats: Callable[..., Any] = torch.native_batch_norm


def batch_norm_backward(dy: Tensor, x: Tensor, weight: Tensor | None, *args: Any) -> Any:
    """aten's ``native_batch_norm_backward`` (the kernel autograd itself runs for BatchNorm, so the one-node step's
    gradients are the ones autograd's graph would give), with ``weight`` made dense: on CPU it reads a strided weight (a
    parameter loaded with ``load_state_dict(assign=True)``) as dense rows, and its gradients came out 1e17 off."""
    return torch.ops.aten.native_batch_norm_backward(dy, x, None if weight is None else weight.contiguous(), *args)


def without_parametrization_hooks(hooks: Mapping[int, Any]) -> OrderedDict[int, Any]:
    """A module's ``_load_state_dict_pre_hooks`` without those torch's weight norm registered (closures, which
    pickle cannot store; calling ``weight_norm`` again registers them again)."""
    return OrderedDict(
        (key, hook)
        for key, hook in hooks.items()
        if getattr(getattr(hook, "hook", hook), "__module__", None) != parametrizations.__name__
    )


# Whether a torch.func transform (grad, vmap, jvp, functional_call under grad) is running: the compiled kernels'
# autograd Function predates setup_context, which those transforms require, so the plan takes a torch-op path then.
# The tensors' own dispatch keys would say it of each input; this asks once, for the whole call.
functorch_transforming: Callable[[], bool] = torch._C._are_functorch_transforms_active
