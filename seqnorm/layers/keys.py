"""torch.nn.LSTM/GRU's layout for :class:`~seqnorm.layers.base.RecurrentLayer`: its state-dict keys (the layer's
hooks) and :func:`from_torch` (a layer from a torch module, behind ``LSTM.from_torch``/``GRU.from_torch``)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from seqnorm.layers.base import RecurrentLayer

__all__ = ["TORCH_KEY", "from_torch", "from_torch_keys", "to_torch_keys"]

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


# torch.nn.LSTM/GRU's structural arguments (from_torch copies them; a keyword may override one).
_TORCH_LAYOUT = ("input_size", "hidden_size", "num_layers", "bias", "batch_first", "dropout", "bidirectional")


def from_torch(
    cls: type[RecurrentLayer], module: nn.Module, expected: type[nn.Module], **kwargs: Any
) -> RecurrentLayer:
    """A ``cls`` layer with the structure and weights of ``module`` (an ``expected`` instance); ``kwargs`` add
    constructor keywords (a norm's own parameters then keep their initial values)."""
    if not isinstance(module, expected):
        raise ValueError(f"{cls.__name__}.from_torch: expected a torch.nn.{expected.__name__}, got {type(module)}")
    if getattr(module, "proj_size", 0):
        kwargs = {"proj_size": module.proj_size, **kwargs}
    weight = module.weight_ih_l0
    structure = {name: getattr(module, name) for name in _TORCH_LAYOUT}
    options: dict[str, Any] = {
        **structure,
        "norm": "none",
        "device": weight.device,
        "dtype": weight.dtype,
        **kwargs,
    }
    layer = cls(**options)
    # With a norm, its own parameters keep their initial values; every weight of `module` must still land.
    missing, unexpected = layer.load_state_dict(module.state_dict(), strict=options["norm"] == "none")
    if unexpected or any(".norm_" not in key for key in missing):
        raise ValueError(
            f"{cls.__name__}.from_torch: expected a norm under which torch's weights stay parameters as they are "
            f"(any but 'weight', whose W = g v / |v| is a parametrization), got norm={options['norm']!r}; build "
            f"seqnorm.{cls.__name__}(..., norm={options['norm']!r}) and train it instead"
        )
    return layer
