"""Layer inputs rebuilt in backward from what autograd keeps anyway, instead of kept (the ``input_rebuild`` step
of :mod:`peft_sparse.core.dispatch`).

A gated MLP's activation silu(gate) ⊙ up (``down_proj``'s input) and a 16-bit RMSNorm output (q/k/v's,
gate/up's) are products whose factors their own autograd nodes save for backward: the sparse layers'
value gradient needs X too, and keeping X again would double that memory. The nodes' saved tensors are
read through :mod:`.internals` (torch internals, each with a fallback: where one is missing, X is kept).
``peft_sparse.fast_paths(False)`` keeps X always.
"""

from __future__ import annotations

import weakref
from _weakref import _remove_dead_weakref
from typing import Optional

import torch

from ..core import kernels
from ..core.functional import REBUILD_MODES  # noqa: F401 (the modes: "all", "products", "none")
from . import internals


class InputRebuild:
    """How backward rebuilds a layer input X from tensors autograd keeps anyway, instead of keeping X.

    Two patterns, both recognised from X's autograd node (nothing model-specific is imported):

    * X = A ⊙ B with both factors saved by the product's node — a gated MLP's activation
      silu(gate) ⊙ up feeding ``down_proj``;
    * X = S ⊙ (P ⊙ Q).to(X.dtype) with S saved by the outer product and P, Q by the inner one, X in a
      16-bit type — an RMSNorm's output ``weight * (h·rsqrt(var + ε)).to(dtype)`` feeding q/k/v or
      gate/up (the norm's own backward keeps h and the rsqrt).

    The rebuild repeats the same elementwise operations on the same tensors, so it gives the same
    bits. Tensors saved through saved-tensor hooks (X computed inside a checkpoint region, offloading)
    are never used: X is then kept. Not detectable, hence not supported: X changed through ``.data``
    after it was computed (an in-place edit through autograd is detected and X kept). Layers reading
    the same X share one record: the first backward that needs X rebuilds it, the last one drops it
    (``pending`` counts the readers registered in forward).
    """

    __slots__ = ("node", "inner", "saved", "dtype", "pending", "value", "__weakref__")

    def __init__(self, node, inner, saved: Optional[str], dtype: torch.dtype):
        self.node, self.inner, self.saved, self.dtype = node, inner, saved, dtype
        self.pending, self.value = 0, None

    def _compute(self) -> torch.Tensor:
        node = self.node
        if self.inner is None:
            return internals.saved_tensor(node, "_saved_self") * internals.saved_tensor(node, "_saved_other")
        inner = self.inner
        return kernels.scaled_product(internals.saved_tensor(node, self.saved), internals.saved_tensor(inner, "_saved_self"),
                                      internals.saved_tensor(inner, "_saved_other"), self.dtype)  # fmt: skip

    def get(self) -> torch.Tensor:
        value = self.value if self.value is not None else self._compute()
        self.pending -= 1
        self.value = value if self.pending > 0 else None
        return value

    def factors(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(A, B) with X = A ⊙ B, both of X's shape and dtype, for the last reader when X = A ⊙ B is not
        formed yet (counted as its read): a consumer that multiplies tile by tile never writes X out.
        None otherwise — then :meth:`get`."""
        if self.inner is not None or self.value is not None or self.pending != 1:
            return None
        a, b = internals.saved_tensor(self.node, "_saved_self"), internals.saved_tensor(self.node, "_saved_other")
        if a.shape != b.shape or a.dtype != self.dtype or b.dtype != self.dtype:
            return None
        self.pending = 0
        return a, b


# id(autograd node) → a weak reference to its rebuild record, alive while some layer's backward may still
# need it (the record holds the node, so while it lives the id is that node's). A plain dict of weak
# references: ``weakref.WeakValueDictionary``'s Python-level get and set cost microseconds per layer call.
# Dead entries are dropped as the table grows (:func:`_register`).
_REBUILDS: "dict[int, weakref.ref[InputRebuild]]" = {}
_PRUNE_AT = [1024]


def _registered(node) -> Optional[InputRebuild]:
    """The live rebuild record of ``node``, or None."""
    ref = _REBUILDS.get(id(node))
    record = ref() if ref is not None else None
    return record if record is not None and record.node is node else None


def _register(node, record: InputRebuild) -> None:
    if len(_REBUILDS) >= _PRUNE_AT[0]:  # (amortised: the table at most doubles its live entries between prunes)
        # Safe with forward passes in several threads (nn.DataParallel): the items are copied in one step,
        # and an entry is removed only if its reference is still dead (as WeakValueDictionary removes them)
        for key, ref in list(_REBUILDS.items()):
            if ref() is None:
                _remove_dead_weakref(_REBUILDS, key)
        _PRUNE_AT[0] = max(1024, 2 * len(_REBUILDS))
    _REBUILDS[id(node)] = weakref.ref(record)


class _Hooked(Exception):
    """A saved tensor went through saved-tensor hooks (checkpointing, offloading): never unpack it in forward."""


def _saved(node, name: str):
    """The tensor ``node`` saved as ``name`` (``"_saved_self"``…), None when it saved none there.
    Raises _Hooked, without unpacking, when the tensor was packed by saved-tensor hooks: unpacking it
    now would spend a checkpoint's single unpack, or copy an offloaded tensor back."""
    found = internals.saved_tensor(node, name)
    if found is internals.HOOKED:
        raise _Hooked(name)
    return found


def input_rebuild(x: torch.Tensor, mode: str = "all") -> Optional[InputRebuild]:
    """The shared :class:`InputRebuild` of X (registering one more reader), or None when X must be kept.

    ``mode``: ``"all"`` — both patterns; ``"products"`` — only X = A ⊙ B with both factors kept (the
    cheaper rebuild: one multiplication); ``"none"`` — always keep X. Skipped while saved-tensor hooks
    are active (activation checkpointing, offloading): they manage what is kept, and X then goes
    through them like any saved tensor."""
    if mode == "none" or x.is_inference() or internals.version(x) != 0:  # (inference tensors: no version to follow)
        return None  # (edited in place since it was computed, or no version to tell: not known to be A ⊙ B)
    node = x.grad_fn
    if node is None or internals.node_kind(node) != "MulBackward0":
        return None
    if internals.saved_tensor_hooks_active():  # (True also where that cannot be known)
        return None
    record = _registered(node)
    if record is None:
        try:
            record = _new_rebuild(node, x)
        except _Hooked:
            return None
        if record is None:
            return None
        _register(node, record)
    if mode == "products" and record.inner is not None:
        return None
    record.pending += 1
    return record


def _broadcast(*shapes: torch.Size) -> Optional[tuple]:
    """The broadcast of ``shapes``, None when they do not broadcast (``torch.broadcast_shapes`` without
    its symbolic-shape machinery, which costs tens of microseconds per call)."""
    ndim = max(len(s) for s in shapes)
    out = []
    for i in range(-ndim, 0):
        size = 1
        for s in shapes:
            if len(s) >= -i and s[i] != 1:
                if size != 1 and size != s[i]:
                    return None
                size = s[i]
        out.append(size)
    return tuple(out)


def _broadcasts_to(shape: torch.Size, a: torch.Size, b: torch.Size) -> bool:
    """Whether shapes ``a`` and ``b`` broadcast to exactly ``shape``: at once when one of them is ``shape``
    and the other ``shape`` too, one entry per row (``(..., 1)``) or one per column (``shape[-1:]``), else
    through :func:`_broadcast`."""
    for full, other in ((a, b), (b, a)):
        if full == shape and (other == shape or other == shape[-1:] or (len(other) == len(shape) and other[-1] == 1 and other[:-1] == shape[:-1])):
            return True
    return _broadcast(a, b) == tuple(shape)


def _new_rebuild(node, x: torch.Tensor) -> Optional[InputRebuild]:
    a, b = _saved(node, "_saved_self"), _saved(node, "_saved_other")
    shape = x.shape
    if a is not None and b is not None:
        if _broadcasts_to(shape, a.shape, b.shape) and (a.dtype == b.dtype == x.dtype or torch.result_type(a, b) == x.dtype):
            return InputRebuild(node, None, None, x.dtype)
        return None
    if (a is None) == (b is None) or x.dtype not in (torch.float16, torch.bfloat16):
        return None
    saved_name, s, unsaved = ("_saved_self", a, 1) if a is not None else ("_saved_other", b, 0)
    cast = node.next_functions[unsaved][0]
    if cast is None or internals.node_kind(cast) != "ToCopyBackward0":
        return None
    inner = cast.next_functions[0][0]
    if inner is None or internals.node_kind(inner) != "MulBackward0":
        return None
    p, q = _saved(inner, "_saved_self"), _saved(inner, "_saved_other")
    if p is None or q is None or s.dtype != x.dtype or not (s.get_device() == p.get_device() == q.get_device() == x.get_device()):
        return None
    if not _broadcasts_to(shape, p.shape, q.shape) or not _broadcasts_to(shape, s.shape, shape):
        return None
    return InputRebuild(node, inner, saved_name, x.dtype)
