r"""The core's one seam: which implementation computes a sparse layer's pass, and who hears when a layer changes.

The core holds the reference of every pass: for a linear layer
:math:`Y = X\,(W + \sum_a \mathrm{scatter}(\eta_a, \phi_a))^\top + b` with the merged weight built transiently
(:func:`peft_sparse.core.passes.linear_pass`). Faster implementations live in :mod:`peft_sparse.accel` and
register here when ``peft_sparse`` is imported; this module never imports them. Three things are registered:

* **implementations of a pass**, per *base kind* — what the adapted tensor is: ``"linear"`` (``nn.Linear``,
  GPT-2 ``Conv1D``), ``"quantized"`` (bitsandbytes 4-bit, dequantized per pass), ``"embedding"``. Each kind has
  one reference (:func:`register_kind`); :func:`register` adds implementations tried before it, in order:
  *memos* first (they repeat the decisions of the layer's last pass after checking them), then, once the
  layer has checked its adapters' tensors, the others. An implementation is a callable
  ``(layer, x, active) -> Tensor | None`` that returns the pass's output — the reference's, bit for bit — or
  None for a pass it does not take. :func:`forward` makes the choice, in one place, from the layer's state and
  the input (as PyTorch's optimizers choose their single-tensor, ``foreach`` or ``fused`` implementation in
  one function). A new kind of base tensor registers its reference; a new implementation registers itself:
  neither touches ``SparseLayer.forward``;
* **steps** (:data:`STEPS`): single steps of the reference that a fast path does faster — the base layer's
  own output, the 4-bit weight plus the delta in one launch, what backward keeps of X, the delta's CSR
  matrices, the value gradient's sampled pattern, the autograd function's ``apply``;
* **listeners** (:func:`listen`): what the core calls when a layer changes, so that whatever a fast path
  keeps (a merged weight, memos of the last pass, kept kernel launches) or an optimizer keeps per slot
  follows the change: :func:`release`, :func:`forget`, :func:`reindex`, :func:`layouts_changed`,
  :func:`slots_changed`, :func:`slots_resized`.

:data:`ON` (``peft_sparse.fast_paths``, ``PEFT_SPARSE_FAST``) gates the first two: off, every pass takes the
reference and every step the reference's own way. Listeners are always called: they keep things consistent.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

# whether registered implementations and steps are used (peft_sparse.fast_paths sets it; off until the fast
# paths register, so the core alone computes every pass by its reference)
ON: bool = False


# ------------------------------------------------------------------------------------------ passes
class _Kind:
    __slots__ = ("reference", "memos", "implementations")

    def __init__(self, reference: Callable):
        self.reference = reference
        self.memos: list[Callable] = []
        self.implementations: list[Callable] = []


_KINDS: dict[str, _Kind] = {}


def register_kind(kind: str, reference: Callable) -> None:
    """``reference(layer, x, active, args, kwargs)``: the reference pass of layers whose base tensor is of
    ``kind`` (``layer.base_kind``), with the adapters ``active`` (their tensors checked); with none, the base
    layer's own pass."""
    _KINDS.setdefault(kind, _Kind(reference)).reference = reference


def register(kind: str, implementation: Callable, memo: bool = False) -> None:
    """Try ``implementation(layer, x, active)`` before the reference of ``kind`` (after those registered before
    it) in passes without extra arguments for the base layer, while :data:`ON`. A ``memo`` repeats the kept
    decisions of the layer's last pass after checking them itself: it is tried before the layer checks its
    adapters' tensors (``check_ready``); the others after."""
    entry = _KINDS.setdefault(kind, _Kind(None))  # (a kind whose layers are defined later: its reference comes then)
    implementations = entry.memos if memo else entry.implementations
    if implementation not in implementations:
        implementations.append(implementation)


def implementations(kind: str) -> list:
    """The memos and implementations registered for ``kind``, in the order :func:`forward` tries them."""
    return [*_KINDS[kind].memos, *_KINDS[kind].implementations]


def forward(layer, x: torch.Tensor, active: list, args: tuple, kwargs: dict) -> torch.Tensor:
    """The output of one pass of ``layer`` over ``x`` with the adapters ``active`` (the layer's active adapters
    it holds; empty while its adapters are disabled): the first registered implementation that takes the
    pass, else the reference of the layer's base kind — the choice, in one place. A layer's
    ``training_observer`` sees every training pass with an active adapter first (one whose ``idle``
    attribute is true is skipped)."""
    observer = layer.training_observer
    if active and observer is not None and layer.training and not getattr(observer, "idle", False) and torch.is_grad_enabled():
        observer(layer)
    kind = _KINDS[layer.base_kind]
    fast = ON and not args and not kwargs
    if fast:
        for memo in kind.memos:
            y = memo(layer, x, active)
            if y is not None:
                return y
    if active:
        layer.check_ready(active)  # the adapters' tensors as configured (placeholders refused, casts undone)
    if fast:
        for implementation in kind.implementations:
            y = implementation(layer, x, active)
            if y is not None:
                return y
    return kind.reference(layer, x, active, args, kwargs)


# ------------------------------------------------------------------------------------------ steps
class Steps:
    """Single steps of the reference pass with a faster implementation (None: the reference's own way).
    Read only while :data:`ON`; each must give the reference's result bit for bit (or None: not here)."""

    #: ``(base_layer, x) -> Y``: the base layer's own pass (an adapter merged into W, or none to add)
    base_output: Optional[Callable] = None
    #: ``(layer, indices, values, dtype) -> W + Σ scatter(η_a, φ_a) | None`` for a 4-bit weight, in one launch
    fused_weight: Optional[Callable] = None
    #: ``(x, mode) -> record | None``: how backward rebuilds X from what autograd keeps anyway (None: keep X)
    input_rebuild: Optional[Callable] = None
    #: ``(layer, active, indices, values) -> [CSR δ_a] | None``: the deltas as kept sparse matrices
    delta_matrices: Optional[Callable] = None
    #: ``(layer, indices, out_features, in_features, dtype) -> CSR pattern``: the indices' sampled pattern
    #: (``kernels.sampled_pattern``) for the CPU value gradient, kept while the indices stay as they are
    sampled_pattern: Optional[Callable] = None
    #: ``(x, bias, spec, *indices, *values) -> Y``: ``SparseDeltaLinear.apply`` with less host time
    apply: Optional[Callable] = None


STEPS = Steps()


def base_output(layer, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    """The base layer's own pass of ``layer`` (its adapters merged into W)."""
    if ON and not args and not kwargs and STEPS.base_output is not None:
        return STEPS.base_output(layer._modules["base_layer"], x)
    return layer.base_layer(x, *args, **kwargs)


# ------------------------------------------------------------------------------------------ layer state
# attributes fast paths keep on every sparse layer: name → (a function giving its initial value, whether a copy
# of the layer (deepcopy, pickling) keeps it; if not, the copy starts from the initial value)
LAYER_STATE: dict[str, tuple[Callable[[], Any], bool]] = {}


def register_layer_state(name: str, initial: Callable[[], Any], copied: bool = False) -> None:
    """Give every sparse layer created from now on the attribute ``name`` = ``initial()``."""
    LAYER_STATE[name] = (initial, copied)


# ------------------------------------------------------------------------------------------ listeners
class Listener:
    """What the core tells whoever keeps state derived from a layer's base weight or adapters. Every
    method is optional: the defaults do nothing (and :meth:`reindex` just runs the change)."""

    def release(self, layers: list, weight_only: bool) -> None:
        """θ₀ must be in the base weights of ``layers`` now (something will read or hand them out): undo
        anything written there for speed. Unless ``weight_only``, forget the layers' kept passes too."""

    def forget(self, layer, adapter: Optional[str]) -> None:
        """``adapter``'s tensors on ``layer`` (None: every adapter's) were replaced, resized or cast: drop
        what was built from them."""

    def reindex(self, layers: list, change: Callable[[], None]) -> Optional[Callable[[], None]]:
        """Run ``change()``, which rewrites the indices of ``layers`` in place (same sizes), keeping what
        depends on them consistent around it; return how to undo what only this listener holds, or None."""
        change()
        return None

    def layouts_changed(self, olds: list, news: list, plan_keys: list) -> None:
        """Block layouts were replaced: ``news[i]`` (a ``BlockLayout``) for ``olds[i]`` (or None), whose kernel
        plans were ``plan_keys[i]``."""

    def slots_changed(self, optimizer, values: list, source: torch.Tensor) -> bool:
        """The values tensors ``values`` (laid end to end, each its size) were rewritten in place: new slot j
        holds what old slot ``source[j]`` held, or is new where it is −1. True when this listener keeps
        ``optimizer``'s per-slot state (and followed the change)."""
        return False

    def slots_resized(self, optimizer, values: list, sources: list) -> bool:
        """Each ``values[i]`` was resized in place: its new slot j holds its old slot ``sources[i][j]`` (−1:
        new). True when this listener keeps ``optimizer``'s per-slot state (and followed the change)."""
        return False


LISTENERS: list[Listener] = []


def listen(listener: Listener) -> None:
    """Tell ``listener`` about every change from now on (once, however often it is registered)."""
    if listener not in LISTENERS:
        LISTENERS.append(listener)


def release(layers: list, weight_only: bool = False) -> None:
    """Every listener's :meth:`Listener.release` of ``layers``."""
    for listener in LISTENERS:
        listener.release(layers, weight_only)


def forget(layer, adapter: Optional[str] = None) -> None:
    """Every listener's :meth:`Listener.forget` of ``adapter`` (None: every adapter) on ``layer``."""
    for listener in LISTENERS:
        listener.forget(layer, adapter)


def reindex(layers: list, change: Callable[[], None]) -> list:
    """``change()`` (it rewrites the indices of ``layers`` in place), wrapped by every listener; returns their undos."""
    undos: list = []

    def wrapped(at: int) -> None:
        if at == len(LISTENERS):
            change()
            return
        undo = LISTENERS[at].reindex(layers, lambda: wrapped(at + 1))
        if undo is not None:
            undos.append(undo)

    wrapped(0)
    return undos


def layouts_changed(olds: list, news: list, plan_keys: list) -> None:
    """Every listener's :meth:`Listener.layouts_changed`."""
    for listener in LISTENERS:
        listener.layouts_changed(olds, news, plan_keys)


def slots_changed(optimizer, values: list, source: torch.Tensor) -> None:
    """Announce rewritten slots to the keepers of ``optimizer``'s per-slot state (see :meth:`Listener.slots_changed`)."""
    if not [listener for listener in LISTENERS if listener.slots_changed(optimizer, values, source)]:
        raise RuntimeError(f"nothing keeps the per-slot state of {type(optimizer).__name__}: its keeper registers when the package peft_sparse is imported")


def slots_resized(optimizer, values: list, sources: list) -> None:
    """Announce resized values to the keepers of ``optimizer``'s per-slot state (see :meth:`Listener.slots_resized`)."""
    if not [listener for listener in LISTENERS if listener.slots_resized(optimizer, values, sources)]:
        raise RuntimeError(f"nothing keeps the per-slot state of {type(optimizer).__name__}: its keeper registers when the package peft_sparse is imported")
