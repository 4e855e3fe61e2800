"""State-dict keys in torch.nn.LSTM's layout, for :class:`~seqnorm.layers.base.RecurrentLayer`'s hooks."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from seqnorm.layers.base import RecurrentLayer

__all__ = ["TORCH_KEY", "from_torch_keys", "to_torch_keys"]

# torch.nn.LSTM's parameter names (`weight_ih_l0`, `bias_hh_l1_reverse`); norms follow suit: `norm_ih_l0.weight`.
TORCH_KEY = re.compile(r"(?P<name>[A-Za-z_]\w*?)_l(?P<layer>\d+)(?P<reverse>_reverse)?(?P<rest>\..*)?")


def to_torch_keys(module: RecurrentLayer, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook: `cells.0.weight_ih` -> torch's `weight_ih_l0` (`cells.1...` -> `..._l0_reverse`)."""
    head = prefix + "cells."
    for key in [key for key in state_dict if key.startswith(head)]:
        index, _, name = key[len(head) :].partition(".")
        first, dot, rest = name.partition(".")
        state_dict[f"{prefix}{first}{module._cell_suffix(int(index))}{dot}{rest}"] = state_dict.pop(key)


def from_torch_keys(module: RecurrentLayer, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load-state-dict pre-hook: the inverse of :func:`to_torch_keys` (so torch state dicts load as they are)."""
    for key in [key for key in state_dict if key.startswith(prefix)]:
        match = TORCH_KEY.fullmatch(key[len(prefix) :])
        if match is None or "." in match["name"]:
            continue
        index = int(match["layer"]) * module.num_directions + (1 if match["reverse"] else 0)
        state_dict[f"{prefix}cells.{index}.{match['name']}{match['rest'] or ''}"] = state_dict.pop(key)
