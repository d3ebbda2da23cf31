"""Which sparse layer and adapter a values Parameter belongs to, from the parameter alone (optimizers such as SM3
ask it for every parameter at every step, to find the values' indices and dense shape)."""

from __future__ import annotations

import weakref
from typing import Optional

import torch

# id(values Parameter) → (weakref to it, weakref to its layer, adapter name): lets optimizers (SM3)
# find a values tensor's indices and dense shape from the parameter alone. Only weak references are
# held (tensors compare elementwise, so a WeakKeyDictionary cannot key them).
_VALUES_OWNER: dict[int, tuple[weakref.ref, weakref.ref, str]] = {}


def sparse_owner(values: torch.Tensor) -> Optional[tuple]:
    """(layer, adapter_name) of a sparse values Parameter, or None for any other tensor."""
    entry = _VALUES_OWNER.get(id(values))
    if entry is None or entry[0]() is not values:
        return None
    layer = entry[1]()  # (its container read directly: optimizers ask for every parameter at every step)
    if layer is None or layer._modules["sparse_values"]._parameters.get(entry[2]) is not values:
        return None
    return layer, entry[2]


def register_owner(values: torch.Tensor, layer, adapter_name: str) -> None:
    """Record ``values`` as adapter ``adapter_name``'s values on ``layer`` (weakly), forgetting dead entries."""
    for key in [k for k, v in _VALUES_OWNER.items() if v[0]() is None]:
        del _VALUES_OWNER[key]  # forget parameters that no longer exist
    _VALUES_OWNER[id(values)] = (weakref.ref(values), weakref.ref(layer), adapter_name)


def forget_owner(values: torch.Tensor) -> None:
    """Drop ``values``' entry (and with it the weak reference to it)."""
    entry = _VALUES_OWNER.get(id(values))
    if entry is not None and entry[0]() is values:
        del _VALUES_OWNER[id(values)]
