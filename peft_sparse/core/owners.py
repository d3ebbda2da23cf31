"""Which sparse layer and adapter a values Parameter belongs to, from the parameter alone (optimizers such as SM3
ask it for every parameter at every step, to find the values' indices and dense shape)."""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from .base import index_dtype

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


_HOOK_ATTRIBUTES = ("_backward_hooks", "_post_accumulate_grad_hooks")  # (tied to the old tensor's C++ hooks)


def resize_parameter(layer, adapter_name: str, values: torch.nn.Parameter, data: torch.Tensor) -> None:
    """Give the Parameter ``values`` the contents ``data`` of another size, keeping the Python object (what an
    optimizer and user code hold). Its tensor is swapped for a fresh one (``torch.utils.swap_tensors``), so the
    next backward pass accumulates into a node of the new size even while a graph of an earlier step (a
    ``loss`` still referenced) keeps the old node alive; ``.data`` assignment (the fallback, where another weak
    reference to the tensor blocks the swap) would reuse that node and fail."""
    fresh = torch.nn.Parameter(data, requires_grad=values.requires_grad)
    fresh.__dict__.update({k: v for k, v in values.__dict__.items() if k not in _HOOK_ATTRIBUTES})
    forget_owner(values)  # (our weak reference: the swap refuses tensors that have one)
    try:
        torch.utils.swap_tensors(values, fresh)
    except RuntimeError:
        values.data = data
    else:
        for name in _HOOK_ATTRIBUTES:  # (Python-side hook tables stay with the object; their C++ hooks did not)
            if getattr(values, name, None) is not None:
                setattr(values, name, None)
    register_owner(values, layer, adapter_name)


def take_saved_sizes(module, state_dict: dict, prefix: str) -> None:
    """Before ``module`` (a sparse layer) loads ``state_dict``: each of its resizable adapters (``budget_split=
    'adaptive'``) takes the size of the saved indices, so the load fills it instead of failing on the shapes."""
    for name in module.resizable_adapters:
        saved = state_dict.get(f"{prefix}sparse_indices.{name}")
        if saved is None or name not in module.sparse_values or saved.numel() == module.sparse_values[name].numel():
            continue
        values = module.sparse_values[name]
        resize_parameter(module, name, values, torch.zeros(saved.numel(), dtype=values.dtype, device=values.device))
        module.sparse_indices[name] = torch.zeros(saved.numel(), dtype=index_dtype(module.numel), device=values.device)
        if name in module.sparse_ages:
            module.sparse_ages[name] = torch.zeros(saved.numel(), dtype=torch.int32, device=values.device)
        module._ready.pop(name, None)
