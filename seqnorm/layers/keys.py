"""torch.nn.LSTM/GRU's layout for :class:`~seqnorm.layers.base.RecurrentLayer`: its state-dict keys (the layer's
hooks) and :func:`from_torch` (a layer from a torch module, behind ``LSTM.from_torch``/``GRU.from_torch``)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, TypeVar
from weakref import WeakKeyDictionary

from torch import nn

if TYPE_CHECKING:
    from seqnorm.layers.protocol import Layer

__all__ = ["TORCH_KEY", "cell_suffix", "from_torch", "from_torch_keys", "to_torch_keys", "torch_keys_in_errors"]

# torch.nn.LSTM's parameter names (`weight_ih_l0`, `bias_hh_l1_reverse`); norms follow suit: `norm_ih_l0.weight`.
TORCH_KEY = re.compile(r"(?P<name>[A-Za-z_]\w*?)_l(?P<layer>\d+)(?P<reverse>_reverse)?(?P<rest>\..*)?")

# Per layer during a load_state_dict: its prefix and error messages (from from_torch_keys to torch_keys_in_errors).
_LOADING: WeakKeyDictionary[Layer, tuple[str, list[str]]] = WeakKeyDictionary()


def cell_suffix(index: int, num_directions: int) -> str:
    """torch's name for the cell at ``cells[index]``: ``l0``, ``l0_reverse``, ``l1``, ... (layer-major)."""
    layer, direction = divmod(index, num_directions)
    return f"l{layer}{'_reverse' if direction else ''}"


def _torch_key(module: Layer, prefix: str, key: str) -> str:
    """``{prefix}cells.0.weight_ih`` -> ``{prefix}weight_ih_l0`` (``cells.1`` -> ``_l0_reverse``); others as given."""
    head = prefix + "cells."
    if not key.startswith(head):
        return key
    index, _, name = key[len(head) :].partition(".")
    first, dot, rest = name.partition(".")
    return f"{prefix}{first}_{cell_suffix(int(index), module.num_directions)}{dot}{rest}"


def to_torch_keys(module: Layer, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook: `cells.0.weight_ih` -> torch's `weight_ih_l0` (`cells.1...` -> `..._l0_reverse`)."""
    for key in [key for key in state_dict if key.startswith(prefix + "cells.")]:
        state_dict[_torch_key(module, prefix, key)] = state_dict.pop(key)


def from_torch_keys(module: Layer, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load-state-dict pre-hook: the inverse of :func:`to_torch_keys` (so torch state dicts load as they are).

    It also notes where this load reports its problems (``args[-1]``, the error messages), so that
    :func:`torch_keys_in_errors` can name the keys as the state dict does.
    """
    _LOADING[module] = (prefix, args[-1])
    for key in [key for key in state_dict if key.startswith(prefix)]:
        match = TORCH_KEY.fullmatch(key[len(prefix) :])
        if match is None or "." in match["name"]:
            continue
        index = int(match["layer"]) * module.num_directions + (1 if match["reverse"] else 0)
        state_dict[f"{prefix}cells.{index}.{match['name']}{match['rest'] or ''}"] = state_dict.pop(key)


def torch_keys_in_errors(module: Layer, incompatible_keys: Any) -> None:
    """Load-state-dict post-hook: the missing and unexpected keys and the size mismatches of this load, which the
    cells report under their own names (``cells.0.weight_hh``), under the state dict's (``weight_hh_l0``)."""
    prefix, error_msgs = _LOADING.pop(module, None) or ("", [])
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        keys[:] = [_torch_key(module, prefix, key) for key in keys]
    internal = re.compile(re.escape(prefix + "cells.") + r"\d+\.[\w.]+")
    error_msgs[:] = [internal.sub(lambda m: _torch_key(module, prefix, m[0]), message) for message in error_msgs]


# torch.nn.LSTM/GRU's structural arguments (from_torch copies them; a keyword may override one).
_TORCH_LAYOUT = ("input_size", "hidden_size", "num_layers", "bias", "batch_first", "dropout", "bidirectional")


LayerT = TypeVar("LayerT", bound=nn.Module)


def from_torch(cls: type[LayerT], module: nn.Module, expected: type[nn.Module], **kwargs: Any) -> LayerT:
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
    overridden = sorted(name for name in structure if name in kwargs and kwargs[name] != structure[name])
    because = f" (overridden: {', '.join(f'{n}={kwargs[n]!r}' for n in overridden)})" if overridden else ""
    try:
        missing, unexpected = layer.load_state_dict(module.state_dict(), strict=False)
    except RuntimeError as error:  # weights of other shapes (a hidden_size overridden)
        detail = " ".join(str(error).split())
        what = f"expected the torch module's weights to fit{because}"
        raise ValueError(f"{cls.__name__}.from_torch: {what}: {detail}") from None
    missing = [key for key in missing if not key.startswith("norm_")]  # torch's names: norm_ih_l0.weight
    if not unexpected and not missing:
        return layer
    if any(key.startswith("parametrizations") for key in missing):  # weight norm's g and v, for torch's W
        raise ValueError(
            f"{cls.__name__}.from_torch: expected a norm under which torch's weights stay parameters as they are "
            f"(any but 'weight', whose W = g v / |v| is a parametrization), got norm={options['norm']!r}; build "
            f"seqnorm.{cls.__name__}(..., norm={options['norm']!r}) and train it instead"
        )
    raise ValueError(
        f"{cls.__name__}.from_torch: expected the torch module's weights to be this layer's{because}, got missing "
        f"keys {missing} and unexpected keys {sorted(unexpected)}"
    )
