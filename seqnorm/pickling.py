"""Pickling of cells with weight norm (``torch.save(model)``, ``copy``, Lightning's ``ddp_spawn``).

torch refuses to pickle a module with a parametrization: its class is made at run time, and ``weight_norm`` leaves a
closure among the state-dict hooks. :class:`PicklableParametrizations` pickles such a module as the class it was
built as, with its ``parametrizations`` aside; unpickling applies weight norm again and puts the saved ones (the
same ``g`` and ``v`` parameters) back. Modules without a parametrization pickle as usual.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.utils import parametrizations, parametrize

from seqnorm.torch_ops import without_parametrization_hooks

__all__ = ["PicklableParametrizations"]

_PARAMETRIZED = "_pickled_parametrizations"


def _new_instance(cls: type) -> Any:
    """An uninitialized ``cls``, as pickle makes one before ``__setstate__``."""
    return cls.__new__(cls)


class PicklableParametrizations(nn.Module):
    """A module whose weight-norm parametrizations (``weight_norm(self, name, dim=0)``) survive pickling."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        if not parametrize.is_parametrized(self):
            return super().__reduce_ex__(protocol)
        state = self.__dict__.copy()
        state["_modules"] = {k: v for k, v in self._modules.items() if k != "parametrizations"}
        state["_load_state_dict_pre_hooks"] = without_parametrization_hooks(self._load_state_dict_pre_hooks)
        state[_PARAMETRIZED] = self.parametrizations
        return _new_instance, (type(self).__mro__[1],), state  # the class torch's parametrization subclassed

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        saved = state.pop(_PARAMETRIZED, None)
        super().__setstate__(state)
        if saved is not None:
            for name, pieces in saved.items():
                # A stand-in weight of the right shape for weight_norm to wrap; the saved g and v replace its own.
                self.register_parameter(name, nn.Parameter(pieces.original1.detach().clone()))
                parametrizations.weight_norm(self, name, dim=0)
            self._modules["parametrizations"] = saved
