"""``SparseLayer``: one PEFT tuner layer for every sparse method and every supported base layer.

Per adapter it holds

* ``sparse_indices[name]`` — persistent buffer of flat, sorted, row-major indices into the
  **logical (out_features, in_features) matrix**, int32 when the matrix has fewer than 2³¹ elements;
* ``sparse_values[name]`` — the trainable values φ (a Parameter, float32 unless configured);
* ``sparse_ages[name]`` — only for dynamic methods (SpIEL): optimizer step at which each index was
  last grown, int32.

The storage layout of the base layer never leaks into the indices: GPT-2 ``Conv1D`` stores
(in, out) and bitsandbytes ``Linear4bit`` stores packed nf4 data, and both are translated here.

**Merged in place while training.** A forward pass needs W + scatter(η, φ). By default that is a
transient copy of W, built in forward and again in backward. While one adapter trains on a plain
``nn.Linear`` (float weight not shared with other parameters, no quantization, no sharding wrapper,
not an ``nn.DataParallel`` replica), the layer instead keeps the merged weight in the base weight's
own storage: it saves θ₀[η] (d_φ entries) once and writes θ₀[η] + φ at η (d_φ entries, not W)
whenever φ changed — so forward and backward read W in place and no W-sized copy is made. The write
happens right after each step of an optimizer that holds φ (one batched launch for all layers, while
the GPU still works through the step; a hook every ``torch.optim.Optimizer`` runs, which repeats an
optimizer's last rewrites while nothing they depend on changed, ``_SteadyRefresh``). A training forward
trusts that write only while φ's version counter, data pointer and storage are unchanged since;
otherwise — φ updated by anything else, e.g. a mixed-precision wrapper copying master weights into
``.data`` — it writes θ₀[η] + φ itself. Edits through ``.data`` that keep φ's storage, made between an
optimizer step and the next forward, are the one thing not seen: call ``release_training_merge()``
after them. A replaced base-weight storage starts a new merge; a backward whose stored weight was
rewritten since its forward builds its own merged weight. The entries are rounded exactly as the copy
would round them, so outputs are bit-identical. θ₀ is
written back (``release_training_merge``) whenever anything else may look at the
base weight: ``eval()``, ``state_dict()``, ``load_state_dict()``, ``.to()``/``.cuda()``, merging,
unloading, disabling or deleting adapters, ``logical_weight()``, ``nn.DataParallel`` replication
(replicas never merge), and before a reselection edits the indices (which then moves each merge to
its new indices in place: ``reseat_training_merges``). Each in-place write bumps the
weight's version counter, so a pass that saved the weight itself errors instead of reading changed
values; a backward whose forward ran merged but finds the merge released rebuilds W + scatter(η, φ)
from θ₀. Code that edits ``sparse_indices`` in place must call ``release_training_merge()`` first. Set
``merge_for_training = False`` on a layer to always use the transient copy.

**Steady passes.** Once such a merge was rewritten by an optimizer step, the layer remembers the
decisions of its last pass (adapter, values, indices and their version, base layer and weight, block
layout — nothing that refers back to the layer) and the next training forward checks each of them
directly, without the lookups of the full path, before reusing them; any difference, and any other
kind of pass, takes the full path. Quantized (4-bit) layers, which rebuild their weight in every
pass and never merge, remember their training passes the same way (a backward pass leaves the memo:
it only needs θ₀ back where a weight is merged), and repeat the fused NF4 launch of their single
adapter from a kept plan while its operands are the same (:class:`_NF4Rebuild`); a steady training
pass launches it itself and multiplies by the weight it gives (``functional.GivenWeightLinear``). When
kernels are short, the host time of a layer call bounds the training step.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Optional

import torch
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge
from peft.utils import resolve_quantization_backend
from torch import nn
from transformers.pytorch_utils import Conv1D

from .. import accel
from ..accel import internals
from ..registry import BufferDict
from . import kernels
from .functional import (
    _compute_dtype,
    compose_weight,
    given_weight_apply,
    merged_apply,
    sparse_delta_apply,
    sparse_delta_linear,
    delta_matrix,
    sparse_delta_linear_reference,
    sparse_delta_product,
)
from .selection import check_sparse_tensors


# id(values Parameter) → (weakref to it, weakref to its layer, adapter name): lets optimizers (SM3)
# find a values tensor's indices and dense shape from the parameter alone. Only weak references are
# held (tensors compare elementwise, so a WeakKeyDictionary cannot key them).
_VALUES_OWNER: dict[int, tuple[weakref.ref, weakref.ref, str]] = {}


def sparse_owner(values: torch.Tensor) -> Optional[tuple["SparseLayer", str]]:
    """(layer, adapter_name) of a sparse values Parameter, or None for any other tensor."""
    entry = _VALUES_OWNER.get(id(values))
    if entry is None or entry[0]() is not values:
        return None
    layer = entry[1]()  # (its container read directly: optimizers ask for every parameter at every step)
    if layer is None or layer._modules["sparse_values"]._parameters.get(entry[2]) is not values:
        return None
    return layer, entry[2]


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def is_bnb_4bit(module: nn.Module) -> bool:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return False
    return isinstance(module, bnb.nn.Linear4bit)


def supported_base_layer(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, Conv1D)) or is_bnb_4bit(module)


def logical_shape(module: nn.Module) -> tuple[int, int]:
    """(out_features, in_features) of a supported base layer."""
    if isinstance(module, Conv1D):
        return module.nf, module.nx
    return module.out_features, module.in_features


def standard_4bit_layout(base: nn.Module) -> None:
    """Undo bitsandbytes' CPU inference repacking (AVX512-BF16 layout) so dequantization reads the weight right.

    bitsandbytes repacks a Linear4bit weight in place the first time the *base* layer runs on CPU in
    eval mode without gradients; ``dequantize_4bit`` does not understand that layout.
    """
    weight = getattr(base, "weight", None)
    state = getattr(weight, "quant_state", None)
    if state is not None and getattr(state, "packing_format_for_cpu", False):
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

        weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)


def storage_positions(base: nn.Module, indices: torch.Tensor) -> torch.Tensor:
    """Flat positions in the stored float weight of logical (out, in) flat indices (Conv1D stores the transpose)."""
    idx = indices.long()
    if isinstance(base, Conv1D):
        out_features, in_features = logical_shape(base)
        return (idx % in_features) * out_features + idx // in_features
    return idx


def _release_before_state_dict(module, prefix, keep_vars) -> None:
    module.release_training_merge()


def _release_before_load(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
    module.release_training_merge()


class _BareLayer:
    """Adapter-less stand-in so quantization backends can requantize a plain base module."""

    def __init__(self, module: nn.Module):
        self._module = module

    def get_base_layer(self) -> nn.Module:
        return self._module


def add_delta_to_base(
    layer, indices: torch.Tensor, values: torch.Tensor, scale: float, *, safe: bool = False, what: str = "delta"
) -> Optional[torch.Tensor]:
    """θ ← θ + scale·scatter(η, φ) in the storage of ``layer`` (a SparseLayer or a bare supported module).

    Float weights are updated in place at the affected positions only; the previous values there are
    returned so the caller can restore them exactly. 4-bit weights are dequantized, updated and
    requantized through PEFT's quantization backend (returns None).
    """
    base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
    values = values.detach()
    backend = resolve_quantization_backend(base)
    if backend is not None:
        if not backend.supports_merge:
            raise TypeError(f"{backend.backend_name} layers cannot be merged")
        standard_4bit_layout(base)
        weight = backend.get_base_weight(base)  # (out, in), fresh
        weight.view(-1).index_add_(0, indices, (scale * values.float()).to(weight.dtype))
        if safe and not torch.isfinite(weight).all():
            raise ValueError(f"NaNs detected in the merged weights. The {what} seems to be broken")
        backend.set_base_weight(layer if hasattr(layer, "get_base_layer") else _BareLayer(base), weight)
        return None
    if base.weight.is_inference() and not torch.is_inference_mode_enabled():
        where = getattr(layer, "module_name", type(base).__name__)
        raise RuntimeError(
            f"{where}: the base weight was created under torch.inference_mode and can only change inside it: "
            "merge inside `with torch.inference_mode():`, or load the base model outside it"
        )
    idx = storage_positions(base, indices)
    flat = base.weight.data.view(-1)
    before = flat[idx]
    after = (before.float() + scale * values.float()).to(flat.dtype)
    if safe and not torch.isfinite(after).all():
        raise ValueError(f"NaNs detected in the merged weights. The {what} seems to be broken")
    flat[idx] = after
    return before


class _TrainingMerge:
    """The state of an adapter merged into its base weight's storage for training (see the module docstring).

    ``written``: what the values were at the last write — version counter, data pointer, the storage
    itself (held, so its address cannot be handed to another tensor while it is compared) and where its
    memory was (a resize frees or moves it) — and whether that write came from the step hook of an
    optimizer holding them (``by_step``). Only then may a forward pass trust the stored weight without
    rewriting it: values changed by anything else (a master-weight wrapper copying into ``.data`` after its
    inner optimizer stepped, say) may not move their version counter. ``weight_ptr``: the base weight's storage when θ₀ was read.
    ``generation`` counts the writes (a backward checks that its forward's weight is still the stored one)."""

    __slots__ = ("adapter", "indices", "weight", "weight_ptr", "flat", "base", "active", "written", "by_step", "generation", "__weakref__")

    def __init__(self, adapter: str, indices: torch.Tensor, weight: torch.Tensor):
        self.adapter, self.indices, self.weight, self.active = adapter, indices, weight, True
        self.weight_ptr = weight.data_ptr()
        self.flat = weight.data.view(-1)  # the storage written (valid while stored_in_weight())
        self.base = self.flat[indices]  # θ₀ at η
        self.written: Optional[tuple] = None
        self.by_step = False
        self.generation = 0

    # copies (deepcopy, pickling) rebuild the weight with its own storage, which holds what this one held; the
    # record of the last write (it holds the values' storage, which pickling cannot carry alone) starts empty,
    # so the copy's first pass writes the same values once more
    def __getstate__(self):
        state = {k: getattr(self, k) for k in self.__slots__ if k not in ("weight_ptr", "flat", "__weakref__")}
        state["written"] = None
        return state

    def __setstate__(self, state):
        for k, v in state.items():
            setattr(self, k, v)
        self.weight_ptr = self.weight.data_ptr()
        self.flat = self.weight.data.view(-1)

    def check_indices(self) -> None:
        if self.indices.shape != self.base.shape:
            raise RuntimeError(f"the indices of adapter {self.adapter!r} were resized while merged for training")

    def write(self, values: torch.Tensor) -> None:
        """Store θ₀[η] + φ at η (d_φ entries, rounded as the transient copy rounds them)."""
        self.check_indices()
        kernels.scatter_sum_into(self.flat, self.indices, self.base, values.detach())
        self.written_now(values, by_step=False)

    def written_now(self, values: torch.Tensor, by_step: bool) -> None:
        """Bookkeeping of a write of ``values`` (by :meth:`write` or a batched write of many layers)."""
        # anything autograd saved of this weight (e.g. a pass with the adapter disabled) now errors instead
        # of silently using the changed values
        torch.autograd.graph.increment_version(self.weight)
        self.generation += 1
        self.record_write(values, values.data_ptr())
        self.by_step = by_step

    def record_write(self, values: torch.Tensor, values_ptr: int) -> None:
        """``written`` for ``values`` (at ``values_ptr``) just written. The storage the last record holds is
        kept when it is at this address and still where it was: that very storage (no lookup)."""
        written = self.written
        if written is not None and written[1] == values_ptr and written[2].data_ptr() == written[3]:
            self.written = (internals.version(values), values_ptr, written[2], written[3])
        else:
            storage = values.untyped_storage()
            self.written = (internals.version(values), values_ptr, storage, storage.data_ptr())

    def current(self, values: torch.Tensor) -> bool:
        """Whether the stored weight is known to hold these values: written by the step hook of an
        optimizer that holds them, and their version, data pointer and storage unchanged since."""
        written = self.written
        # (the written storage is held and still where it was written — not freed or moved by a resize —, so
        # no other storage's memory holds its address: an equal data pointer points into that storage)
        return (
            self.by_step
            and written is not None
            and written[0] == internals.version(values)
            and written[1] == values.data_ptr()
            and written[2].data_ptr() == written[3]
        )

    def stored_in_weight(self) -> bool:
        """Whether the base weight still uses the storage θ₀ was read from (not replaced through ``.data``)."""
        return self.weight.data_ptr() == self.weight_ptr

    def still_merged(self, generation: int) -> bool:
        """False once θ₀ was written back or the values rewritten since the pass that saw ``generation``:
        a backward pass must then build its merged weight itself."""
        return self.active and self.generation == generation and self.stored_in_weight()

    def stored_weight(self) -> torch.Tensor:
        return self.weight


# layers holding a training merge, refreshed after every optimizer step that updates their values
_MERGED_LAYERS: "weakref.WeakSet[SparseLayer]" = weakref.WeakSet()
_STEP_HOOK = None
# moves on whenever a layer starts or ends a training merge (the set the step hook rewrites changes)
_MERGE_EPOCH = [0]
# optimizer → the rewrites its last step hook made (_SteadyRefresh), repeated while they hold
_STEADY_REFRESH: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _refresh_after_step(optimizer, args, kwargs) -> None:
    """After any optimizer step: rewrite the training merges of the layers whose values it holds.

    The rewrite then runs while the GPU still works through the step, not in the next forward pass
    (whose host time bounds the step when kernels are short). A forward pass rewrites again whenever
    the values changed after this, or were not written by such a step (see ``_TrainingMerge.current``).
    The layers' containers are read directly (``_modules``, ``_parameters``, ``_buffers``), and the
    rewrites of this optimizer's last step are repeated without the lookups while they hold
    (:class:`_SteadyRefresh`): this runs for every layer at every step."""
    if not _MERGED_LAYERS or not accel.ON:
        return
    groups = getattr(optimizer, "param_groups", None) or []
    steady = _STEADY_REFRESH.get(optimizer)
    if steady is not None:
        if steady.run(groups):
            return
        del _STEADY_REFRESH[optimizer]
    ids = {id(p) for g in groups for p in g["params"]}
    due = []  # (layer, merge, values) this step updated
    for layer in list(_MERGED_LAYERS):
        merge = layer._training_merge
        if merge is None:
            _MERGED_LAYERS.discard(layer)
            continue
        modules = layer._modules
        values = modules["sparse_values"]._parameters.get(merge.adapter)
        if values is None or id(values) not in ids:
            continue
        if merge.indices is not modules["sparse_indices"]._buffers.get(merge.adapter) or not merge.stored_in_weight():
            layer.release_training_merge()  # stale: the next training forward sets it up again
            continue
        merge.check_indices()
        due.append((layer, merge, values))
    if not due:
        return
    with torch.no_grad():
        launches = kernels.scatter_sum_many([m.flat for _, m, _ in due], [m.indices for _, m, _ in due], [m.base for _, m, _ in due], [v for _, _, v in due])
    for _, merge, values in due:
        merge.written_now(values, by_step=True)
    if launches is not None:
        try:
            _STEADY_REFRESH[optimizer] = _SteadyRefresh(groups, due, launches)
        except TypeError:  # (an optimizer that cannot be weakly referenced: no memo)
            pass


class _SteadyRefresh:
    """The rewrites of an optimizer's last step hook (all in multi-tensor launches), repeated while they
    hold: no layer started or ended a training merge since (``_MERGE_EPOCH``), the optimizer has the same
    parameter lists with the same members, and each layer still has the same merge, values and indices (tensor objects and
    addresses) and θ₀'s storage in its weight. The layers and merges are weakly referenced."""

    __slots__ = ("epoch", "groups", "entries", "launches")

    def __init__(self, groups: list, due: list, launches: list):
        self.epoch = _MERGE_EPOCH[0]
        self.groups = [(g["params"], list(g["params"])) for g in groups]
        self.entries = [(weakref.ref(layer), weakref.ref(merge), merge.adapter, values, values.data_ptr(), merge.indices.data_ptr())
                        for layer, merge, values in due]  # fmt: skip
        self.launches = launches

    def run(self, groups: list) -> bool:
        if _MERGE_EPOCH[0] != self.epoch or len(groups) != len(self.groups):
            return False
        for g, (params, members) in zip(groups, self.groups):
            if g["params"] is not params or len(params) != len(members) or any(a is not b for a, b in zip(params, members)):
                return False
        merges = []
        for layer_ref, merge_ref, adapter, values, values_ptr, indices_ptr in self.entries:
            layer, merge = layer_ref(), merge_ref()
            if layer is None or merge is None or layer._training_merge is not merge:
                return False
            modules = layer._modules
            indices = merge.indices
            if (
                modules["sparse_values"]._parameters.get(adapter) is not values or modules["sparse_indices"]._buffers.get(adapter) is not indices
                or not merge.stored_in_weight() or values.data_ptr() != values_ptr or indices.data_ptr() != indices_ptr
                or indices.shape != merge.base.shape
            ):  # fmt: skip
                return False
            merges.append(merge)
        for plan, out in self.launches:
            with kernels.on_device(out):
                plan()
        kernels.increment_versions([m.weight for m in merges])
        for merge, (_, _, _, values, values_ptr, _) in zip(merges, self.entries):
            merge.generation += 1
            merge.record_write(values, values_ptr)
            merge.by_step = True
        return True


def release_training_merges(layers: list) -> list:
    """:meth:`SparseLayer.release_training_merge` of many layers, θ₀ written back in one launch per
    group of like tensors (bit for bit). Returns the layers that were merged, with their adapters."""
    released, outs, indices, bases = [], [], [], []
    for layer in layers:
        merge = layer._training_merge
        if merge is None:
            continue
        if merge.indices.shape != merge.base.shape:
            raise RuntimeError(f"{layer.module_name}: the indices of adapter {merge.adapter!r} were resized while merged for training")
        if merge.stored_in_weight():  # (storage replaced through .data: the merged one is gone, the new one is θ₀)
            outs.append(merge.weight.data)
            indices.append(merge.indices)
            bases.append(merge.base)
        released.append((layer, merge.adapter))
    if outs:
        kernels.scatter_sum_many(outs, indices, bases, None)
    for layer, _ in released:
        merge = layer._training_merge
        if merge.stored_in_weight():
            torch.autograd.graph.increment_version(merge.weight)
        _MERGE_EPOCH[0] += 1
        layer._training_merge = None
        layer._steady = None
        merge.active = False
        _MERGED_LAYERS.discard(layer)
    return released


def reseat_training_merges(layers: list, change_indices: Callable[[], None]) -> list:
    """Move the training merges of ``layers`` to the new indices that ``change_indices()`` writes into
    their indices tensors in place (a reselection), bit for bit as releasing them before the change and
    merging them again after it would: θ₀ written back at the old indices, θ₀ read at the new ones into
    each merge's own θ₀ tensor, θ₀[η] + φ written there (one multi-tensor launch per write). The merges
    stay the same objects holding the same tensors, so the optimizer step hook's kept rewrites
    (:class:`_SteadyRefresh`) still apply to them. A merge that a forward pass would not keep — its
    base weight or that weight's storage replaced, its indices or values no longer the layer's, the
    layer no longer merging in place (``merge_for_training``, :meth:`SparseLayer._can_merge_in_place`)
    or no longer registered for the step hook (e.g. a copy) — is released and set up again as a
    forward pass would. Returns the layers set up again, with their adapters."""
    kept, others = [], []
    for layer in layers:
        merge = layer._training_merge
        if merge is None:
            continue
        modules = layer._modules
        values = modules["sparse_values"]._parameters.get(merge.adapter)
        base = layer.get_base_layer()
        if (
            merge.active and values is not None and merge.stored_in_weight() and merge.weight is base.weight
            and merge.indices is modules["sparse_indices"]._buffers.get(merge.adapter) and layer in _MERGED_LAYERS
            and layer.merge_for_training and layer._can_merge_in_place(base, values)
        ):  # fmt: skip
            merge.check_indices()
            kept.append((merge, values))
        else:
            others.append(layer)
    if kept:
        with torch.no_grad():
            kernels.scatter_sum_many([m.flat for m, _ in kept], [m.indices for m, _ in kept], [m.base for m, _ in kept], None)
    released = release_training_merges(others)
    change_indices()
    if kept:
        with torch.no_grad():
            for merge, _ in kept:
                merge.check_indices()
                torch.index_select(merge.flat, 0, merge.indices, out=merge.base)  # θ₀ at the new indices
            kernels.scatter_sum_many([m.flat for m, _ in kept], [m.indices for m, _ in kept], [m.base for m, _ in kept], [v.detach() for _, v in kept])
        for merge, values in kept:
            merge.written_now(values, by_step=True)
    merge_for_training_many(released)
    return [(layer, adapter) for layer, adapter in released if layer._training_merge is not None]


def merge_for_training_many(layers: list) -> None:
    """Set up the training merges of ``(layer, adapter)`` pairs as their next training forward passes
    would (θ₀ read at the current indices, θ₀[η] + φ written at η), all writes in one launch per group
    of like tensors — e.g. right after a reselection changed every layer's indices. Layers that cannot
    merge in place are left to their forward pass."""
    due = []
    for layer, adapter in layers:
        base = layer.get_base_layer()
        values = layer.sparse_values[adapter]
        if layer._training_merge is not None or not layer.merge_for_training or not layer._can_merge_in_place(base, values):
            continue
        due.append((layer._start_training_merge(adapter, base.weight), values.detach()))
    if not due:
        return
    with torch.no_grad():
        kernels.scatter_sum_many([m.flat for m, _ in due], [m.indices for m, _ in due], [m.base for m, _ in due], [v for _, v in due])
    for merge, values in due:
        merge.written_now(values, by_step=True)


def _register_step_hook() -> None:
    global _STEP_HOOK
    if _STEP_HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _STEP_HOOK = register_optimizer_step_post_hook(_refresh_after_step)


def _managed_by_sharding(weight: torch.Tensor) -> bool:
    """A weight managed by a sharding wrapper (FSDP, DeepSpeed ZeRO-3, DTensor): never written in place."""
    if getattr(weight, "_fsdp_flattened", False) or hasattr(weight, "ds_id"):
        return True
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(weight, DTensor)


def _no_rebuild() -> None:
    """What a copied or unpickled :class:`_NF4Rebuild` becomes."""
    return None


class _NF4Rebuild:
    """A 4-bit layer's fused NF4 launch (:func:`kernels.nf4_compose` with a single adapter) to repeat from
    its :class:`~peft_sparse.accel.triton_kernels.LaunchPlan` into a new output while its operands are
    the same: the base layer, its 4-bit weight (object, storage, quantization state, compute dtype), the
    indices (object, storage, size) and the values (storage, size, dtype); their contents may change.
    Indices rewritten in place (a reselection: their version moves) are followed: the per-program slices
    the launch reads (``starts``, the layer's kept :meth:`SparseLayer._nf4_starts`) are recomputed in
    place first, so the launch is repeated instead of planned anew. The plan holds those tensors, so the
    layer drops this when it forgets its last pass (``release_training_merge``) or when the plan no
    longer applies. A copy (``copy.deepcopy``, pickling) of the layer has none: the plan refers to
    compiled kernels and raw addresses, and the copy plans its own."""

    __slots__ = ("plan", "base", "weight", "weight_ptr", "state", "compute", "indices", "indices_key", "starts", "values_key", "shape", "dtype",
                 "device")  # fmt: skip

    def __reduce__(self):
        return _no_rebuild, ()

    def __init__(self, plan, base: nn.Module, indices: torch.Tensor, values: torch.Tensor, merged: torch.Tensor,
                 starts: Optional[torch.Tensor] = None):  # fmt: skip
        self.plan, self.base = plan, base
        self.weight = base.weight
        self.weight_ptr, self.state, self.compute = self.weight.data_ptr(), self.weight.quant_state, getattr(base, "compute_dtype", None)
        # (address, version, size): the key of SparseLayer._nf4_starts' cache, which the refresh below updates
        self.indices, self.indices_key, self.starts = indices, (indices.data_ptr(), internals.version(indices), indices.numel()), starts
        self.values_key = (values.data_ptr(), values.numel(), values.dtype)
        self.shape, self.dtype, self.device = merged.shape, merged.dtype, merged.device

    def __call__(self, layer: "SparseLayer", indices: torch.Tensor, values: torch.Tensor, dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
        """The merged weight, or None when anything differs from the planned launch (the caller then takes
        the full path, which plans again)."""
        base = self.base
        weight = self.weight
        key = self.indices_key
        if (
            (dtype is not None and dtype != self.dtype)
            or indices is not self.indices or indices.data_ptr() != key[0] or indices.numel() != key[2]
            or (values.data_ptr(), values.numel(), values.dtype) != self.values_key
            or (layer._modules["base_layer"] is not base and layer.get_base_layer() is not base)
            or base._parameters.get("weight") is not weight or weight.quant_state is not self.state
            or getattr(base, "compute_dtype", None) is not self.compute or weight.data_ptr() != self.weight_ptr
        ):  # fmt: skip
            return None
        starts = self.starts
        if internals.version(indices) != key[1]:  # rewritten in place: the slices follow (what the full path would compute)
            if starts is not None:
                if starts.is_inference() and not torch.is_inference_mode_enabled():
                    return None  # (planned under torch.inference_mode: its slices cannot be rewritten outside it)
                kernels.nf4_compose_starts(indices, layer.numel, out=starts)
            self.indices_key = key = (key[0], internals.version(indices), key[2])
            if starts is not None:
                layer._nf4_starts_cache = (weakref.ref(indices), key, starts)
        merged = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return merged if self.plan(merged) else None


class SparseLayer(BaseTunerLayer):
    adapter_layer_names = ("sparse_values",)
    other_param_names = ("sparse_indices", "sparse_ages")
    # keep the training adapter merged in the base weight's storage (module docstring): opt-in, through the
    # config's ``training_merge`` or per layer, because the base weight then shows θ₀ + δ during training
    merge_for_training: bool = False

    def __init__(self, base_layer: nn.Module, module_name: str) -> None:
        self.base_layer = base_layer
        self.module_name = module_name
        self.sparse_values = nn.ParameterDict({})
        self.sparse_indices = BufferDict(persistent=True)
        self.sparse_ages = BufferDict(persistent=True)
        self.values_dtype: dict[str, torch.dtype] = {}
        self.block_shape: dict[str, tuple[int, int]] = {}
        self._block_metadata: dict[str, tuple] = {}
        self._disable_adapters = False
        self.merged_adapters: list[str] = []
        # base values at an adapter's positions before it was merged: unmerge restores them exactly
        self._merge_backup: dict[str, torch.Tensor] = {}
        # adapters whose indices are placeholders until a saved adapter is loaded over them
        self._indices_pending: set[str] = set()
        # seams of the autograd function (see functional.GradientHooks)
        self.dense_grad_consumer = None
        self.dense_grad_count = 0
        self.value_grad_method = "auto"
        self._rebuild_inputs = "all"
        # called with the layer on every training forward pass (dynamic methods watch for a missing scheduler);
        # steady passes skip an observer whose ``idle`` attribute is true
        self.training_observer = None
        self._model_ref = None  # weakref to the model (set by the tuner): who else uses the base weight's storage
        self._shared_check = None  # (weakref to the weight, its storage pointer, shared?) of the last scan
        self._training_merge: Optional[_TrainingMerge] = None
        # the last pass's decisions while the single training adapter is merged in place (see forward)
        self._steady: Optional[tuple] = None
        self._nf4_cache = None  # (weakref to the 4-bit weight, its storage pointer, its quant state, operands)
        self._nf4_starts_cache = None  # (weakref to an indices tensor, (address, version, size), its starts)
        self._nf4_rebuild: Optional[_NF4Rebuild] = None  # the last single-adapter fused NF4 launch, to repeat
        self._delta_csr: dict = {}  # adapter → (key, indices, values, its CSR delta) for inference passes
        # adapter → the values tensor that last passed _check_ready, and the indices tensor it last checked
        self._ready: dict[str, torch.Tensor] = {}
        self._checked_indices: dict[str, torch.Tensor] = {}
        self.register_state_dict_pre_hook(_release_before_state_dict)
        self.register_load_state_dict_pre_hook(_release_before_load)

        base = self.get_base_layer()
        self.quantization_backend = resolve_quantization_backend(base)
        self.fan_in_fan_out = isinstance(base, Conv1D)
        self.out_features, self.in_features = logical_shape(base)

    @property
    def rebuild_inputs(self) -> str:
        """Which inputs backward rebuilds instead of keeping them for the value gradient
        (:func:`peft_sparse.accel.input_rebuild.input_rebuild`): ``"all"`` (default: gated-MLP activations and 16-bit RMSNorm
        outputs), ``"products"`` (only the activations: less recomputation, more memory), ``"none"``."""
        return self._rebuild_inputs

    @rebuild_inputs.setter
    def rebuild_inputs(self, mode: str) -> None:
        from ..accel.input_rebuild import REBUILD_MODES

        if mode not in REBUILD_MODES:
            raise ValueError(f"{self.module_name}: rebuild_inputs={mode!r} is not one of {REBUILD_MODES}")
        self._rebuild_inputs = mode

    # ----------------------------------------------------------------------------------- weights
    @property
    def numel(self) -> int:
        return self.out_features * self.in_features

    def logical_weight(self) -> torch.Tensor:
        """The frozen base weight θ₀ as an (out, in) tensor: a view for Linear/Conv1D, a dequantized copy for 4-bit."""
        self.release_training_merge()
        return self._stored_weight()

    def _stored_weight(self) -> torch.Tensor:
        """What the base weight's storage holds, as (out, in): θ₀, or θ₀ + scatter(η, φ) while merged for training."""
        base = self.get_base_layer()
        if self.quantization_backend is not None:
            standard_4bit_layout(base)
            weight = self.quantization_backend.get_base_weight(base)
            compute_dtype = getattr(base, "compute_dtype", None) or weight.dtype
            return weight.to(compute_dtype)
        weight = base.weight
        return weight.t() if self.fan_in_fan_out else weight

    def _nf4_operands(self):
        """What :func:`kernels.nf4_compose` needs to rebuild this bitsandbytes NF4 weight, or None (not NF4
        on CUDA, or another layout). Cached per weight tensor, storage and quantization state: the offset
        of double quantization is read to the host once."""
        base = self.get_base_layer()
        weight = getattr(base, "weight", None)
        state = getattr(weight, "quant_state", None)
        if state is None or not weight.is_cuda:
            return None
        cached = self._nf4_cache
        if cached is not None and cached[0]() is weight and cached[1] == weight.data_ptr() and cached[2] is state:
            return cached[3]
        operands = None
        nested = getattr(state, "nested", False)
        if (
            state.quant_type == "nf4"
            and not getattr(state, "packing_format_for_cpu", False)
            and weight.dtype == torch.uint8 and weight.is_contiguous()
            and weight.numel() * 2 >= self.numel
            and tuple(state.shape) == (self.out_features, self.in_features)
            and state.blocksize & (state.blocksize - 1) == 0
            and (not nested or state.state2.blocksize & (state.state2.blocksize - 1) == 0)
        ):  # fmt: skip
            inner = None
            if nested:
                inner = (state.absmax, state.state2.absmax, state.state2.code, state.state2.blocksize, float(state.offset))
            operands = (weight.data, state.code, state.absmax, inner, state.blocksize, tuple(state.shape), state.dtype)
        self._nf4_cache = (weakref.ref(weight), weight.data_ptr(), state, operands)
        return operands

    def _nf4_starts(self, indices: torch.Tensor) -> Optional[torch.Tensor]:
        """Where each program of the fused NF4 launch finds its slice of ``indices``
        (:func:`kernels.nf4_compose_starts`), kept while the indices tensor is the same and unchanged
        (its address and version: a reselection rewrites it in place). None for an inference tensor,
        which has no version to follow: the launch then finds the slices itself."""
        if indices.is_inference():
            return None
        key = (indices.data_ptr(), internals.version(indices), indices.numel())
        cached = self._nf4_starts_cache
        if cached is not None and cached[0]() is indices and cached[1] == key:
            return cached[2]
        starts = kernels.nf4_compose_starts(indices, self.numel)
        self._nf4_starts_cache = (weakref.ref(indices), key, starts)
        return starts

    def fused_merged_weight(self, indices, values, dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
        """For an NF4 weight on CUDA: the dequantized weight plus Σ scatter(η_a, φ_a) built in one fused
        launch (the first adapter inside it), in ``dtype`` (None: the layer's compute dtype); None when
        this layer has no fused path or the dtype differs from the one bitsandbytes dequantizes to.
        A single adapter's launch is repeated from its :class:`_NF4Rebuild` while its operands stay."""
        if not accel.ON:  # (a fast path: off, the weight is dequantized and the delta added separately)
            return None
        rebuild = self._nf4_rebuild
        if rebuild is not None:
            merged = rebuild(self, indices[0], values[0], dtype) if len(indices) == 1 else None
            if merged is not None:
                return merged
            self._nf4_rebuild = None  # (it holds the tensors it planned with; the full path plans anew)
        operands = self._nf4_operands() if self.quantization_backend is not None else None
        if operands is None:
            return None
        base = self.get_base_layer()
        compute = getattr(base, "compute_dtype", None) or operands[6]
        if compute != operands[6] or (dtype is not None and dtype != compute):
            return None
        packed, code, absmax, nested, blocksize, shape, qdtype = operands
        single = len(indices) == 1 and not indices[0].is_inference()  # (a launch to keep: see _NF4Rebuild)
        first = (indices[0], values[0].detach(), self._nf4_starts(indices[0])) if indices else (None, None, None)
        result = kernels.nf4_compose(packed, code, absmax, nested, blocksize, shape, qdtype, *first, plan=single)
        merged, plan = result if single else (result, None)
        if plan is not None:
            self._nf4_rebuild = _NF4Rebuild(plan, base, indices[0], values[0], merged, first[2])
        for idx, val in zip(indices[1:], values[1:]):
            kernels.scatter_add_into(merged, idx, val.detach())
        return merged

    def get_delta_weight(self, adapter_name: str) -> torch.Tensor:
        """The dense (out, in) delta scatter(η, φ) of one adapter, in the values' dtype."""
        values = self.sparse_values[adapter_name]
        delta = torch.zeros(self.numel, dtype=values.dtype, device=values.device)
        delta.index_add_(0, self.sparse_indices[adapter_name], values.detach())
        return delta.view(self.out_features, self.in_features)

    # ----------------------------------------------------------------------------------- adapters
    def update_layer(
        self,
        adapter_name: str,
        indices: torch.Tensor,
        values_dtype: torch.dtype,
        inference_mode: bool = False,
        with_ages: bool = False,
        indices_pending: bool = False,
        block_shape: tuple[int, int] = (1, 1),
    ) -> None:
        """Add an adapter with the given sorted flat indices and zero values."""
        device = self._base_device()
        indices = indices.to(device=device, dtype=index_dtype(self.numel))
        self.sparse_indices[adapter_name] = indices
        self.sparse_values[adapter_name] = nn.Parameter(
            torch.zeros(indices.numel(), dtype=values_dtype, device=device)
        )
        self.values_dtype[adapter_name] = values_dtype
        self._ready.pop(adapter_name, None)
        self.block_shape[adapter_name] = tuple(block_shape)
        self._register_values(adapter_name)
        if with_ages:
            self.sparse_ages[adapter_name] = torch.zeros(indices.numel(), dtype=torch.int32, device=device)
        if indices_pending:
            self._indices_pending.add(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def _register_values(self, adapter_name: str) -> None:
        values = self.sparse_values[adapter_name]
        for key in [k for k, v in _VALUES_OWNER.items() if v[0]() is None]:
            del _VALUES_OWNER[key]  # forget parameters that no longer exist
        _VALUES_OWNER[id(values)] = (weakref.ref(values), weakref.ref(self), adapter_name)

    def get_base_layer(self) -> nn.Module:
        """The innermost base layer (PEFT's definition: follow ``base_layer`` while there is one), without
        the attribute-lookup exceptions of PEFT's loop — it runs on every forward pass."""
        base = self._modules["base_layer"]
        while True:
            inner = base._modules.get("base_layer") if isinstance(base, nn.Module) else None
            if inner is None:
                if (
                    isinstance(base, nn.Module)
                    and type(base).__getattr__ is nn.Module.__getattr__  # no attribute forwarding (as wrappers do)
                    and "base_layer" not in base.__dict__
                    and not hasattr(type(base), "base_layer")
                ):
                    return base  # a plain module (checked without a failing attribute lookup)
                if not hasattr(base, "base_layer"):
                    return base
                inner = base.base_layer
            base = inner

    def _base_device(self) -> torch.device:
        base = self.get_base_layer()
        return base.weight.device

    def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device: Optional[torch.device] = None) -> None:
        # Unlike PEFT's default, never cast: values keep their configured dtype, indices their integer dtype.
        target = device if device is not None else self._base_device()
        if target.type == "meta":
            return
        for name in self.adapter_layer_names + self.other_param_names:
            container = getattr(self, name)
            if adapter_name in container and container[adapter_name].device != target:
                if container[adapter_name].device.type == "meta":
                    continue
                container[adapter_name] = container[adapter_name].to(target)
        if adapter_name in self.sparse_values:
            self._register_values(adapter_name)

    def delete_adapter(self, adapter_name: str) -> None:
        self.release_training_merge()
        super().delete_adapter(adapter_name)
        self.values_dtype.pop(adapter_name, None)
        self.block_shape.pop(adapter_name, None)
        self._block_metadata.pop(adapter_name, None)
        self._indices_pending.discard(adapter_name)
        self._ready.pop(adapter_name, None)
        self._delta_csr.pop(adapter_name, None)

    def block_metadata(self, adapter_name: str):
        """For a block adapter: its :class:`~peft_sparse.core.kernels.BlockLayout` (block rows and
        columns, ascending, and where each block's elements sit in the values); None when unstructured.

        Cached until the indices change (their version counter moves on every in-place edit)."""
        bh, bw = self.block_shape.get(adapter_name, (1, 1))
        if bh * bw == 1:
            return None
        indices = self._modules["sparse_indices"]._buffers[adapter_name]
        cached = self._block_metadata.get(adapter_name)
        if cached is not None and cached[0] == self._indices_key(indices):
            return cached[1]
        from .selection import BlockGrid

        blocks = BlockGrid(self.out_features, self.in_features, (bh, bw)).units(indices)
        if blocks.numel() * bh * bw != indices.numel():
            raise ValueError(f"{self.module_name}: indices of adapter {adapter_name!r} are not whole {(bh, bw)} blocks")
        return self.set_block_metadata(adapter_name, blocks)

    @staticmethod
    def _indices_key(indices: torch.Tensor) -> tuple:
        if indices.is_inference():  # (no version counter follows an edit: a key equal to no other, so never cached)
            return (indices.data_ptr(), object(), indices.numel())
        return (indices.data_ptr(), internals.version(indices), indices.numel())

    def cached_block_metadata(self, adapter_name: str):
        """The block layout cached for ``adapter_name`` (None: none), current or not — e.g. to learn which
        kernel plans it used before a reselection replaces it."""
        cached = self._block_metadata.get(adapter_name)
        return cached[1] if cached is not None else None

    def set_block_metadata(self, adapter_name: str, blocks: torch.Tensor, metadata=None):
        """Cache the block layout of the (ascending) active block numbers ``blocks`` (``metadata``: a
        :class:`~peft_sparse.core.kernels.BlockLayout` already computed for the current indices, e.g.
        by a batched reselection)."""
        indices = self.sparse_indices[adapter_name]
        if metadata is None:
            metadata = kernels.BlockLayout.of_blocks(blocks, self.out_features, self.in_features, self.block_shape[adapter_name])
        self._block_metadata[adapter_name] = (self._indices_key(indices), metadata)
        return metadata

    # ----------------------------------------------------------------------------------- merge
    def merge(self, safe_merge: bool = False, adapter_names: Optional[list[str]] = None) -> None:
        self.release_training_merge()
        adapter_names = check_adapters_to_merge(self, adapter_names)
        for name in adapter_names:
            if name in self.sparse_values:
                self._check_ready(name)
                self.add_scaled_delta(name, 1.0, safe=safe_merge, keep_backup=True)
                self.merged_adapters.append(name)

    def unmerge(self) -> None:
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            if name not in self.sparse_values:
                continue
            backup = self._merge_backup.pop(name, None)
            if backup is not None:  # float weights: restore the exact pre-merge values
                base = self.get_base_layer()
                base.weight.data.view(-1)[storage_positions(base, self.sparse_indices[name])] = backup
            else:
                self.add_scaled_delta(name, -1.0)

    def add_scaled_delta(self, adapter_name: str, scale: float, safe: bool = False, keep_backup: bool = False) -> None:
        """θ ← θ + scale·scatter(η, φ) in the base layer's own storage (requantized for 4-bit)."""
        backup = add_delta_to_base(
            self,
            self.sparse_indices[adapter_name],
            self.sparse_values[adapter_name].detach(),
            scale,
            safe=safe,
            what=f"adapter {adapter_name}",
        )
        if keep_backup and backup is not None:
            self._merge_backup[adapter_name] = backup

    # ----------------------------------------------------------------------------------- merged for training
    def release_training_merge(self) -> None:
        """Write θ₀ back at the positions of the adapter merged for training (no-op when none is); a
        quantized layer forgets its last training pass (see forward) and fused launch, which hold its tensors."""
        if self._training_merge is not None:
            release_training_merges([self])
        elif self._steady is not None:
            self._steady = None
        if self._nf4_rebuild is not None:
            self._nf4_rebuild = None

    def release_weight_merge(self) -> None:
        """Write θ₀ back at the positions of the adapter merged for training (no-op when none is): what a
        backward pass needs before it reads θ₀. Unlike :meth:`release_training_merge`, a quantized layer
        keeps the decisions of its last pass: a training step's backward leaves its next pass steady."""
        if self._training_merge is not None:
            release_training_merges([self])

    def _start_training_merge(self, adapter: str, weight: torch.Tensor) -> _TrainingMerge:
        """Read θ₀ at the adapter's indices and register the layer for the optimizer step's rewrites (the
        caller writes θ₀[η] + φ)."""
        merge = self._training_merge = _TrainingMerge(adapter, self.sparse_indices[adapter], weight)
        _MERGE_EPOCH[0] += 1
        _MERGED_LAYERS.add(self)
        _register_step_hook()
        return merge

    def _weight_is_shared(self, weight: torch.Tensor) -> bool:
        """Whether another parameter of the model uses the weight's storage (tied embeddings, views).
        Scanned once per weight tensor and storage (a tie replaces the tied layer's weight object)."""
        storage = weight.untyped_storage().data_ptr()
        cached = self._shared_check
        if cached is not None and cached[0]() is weight and cached[1] == storage:
            return cached[2]
        model = self._model_ref() if self._model_ref is not None else None
        if model is None:
            return True  # unknown: never write into it
        users = 0
        for _, p in model.named_parameters(remove_duplicate=False):
            if p.device == weight.device and p.untyped_storage().data_ptr() == storage:
                users += 1
        shared = users > 1
        self._shared_check = (weakref.ref(weight), storage, shared)
        return shared

    def _can_merge_in_place(self, base: nn.Module, values: torch.Tensor) -> bool:
        if self.quantization_backend is not None or self.fan_in_fan_out or type(base) is not nn.Linear:
            return False
        weight = base.weight
        return (
            weight.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and not weight.requires_grad
            and weight.is_contiguous()
            and weight.device == values.device
            and weight.device.type != "meta"
            and not _managed_by_sharding(weight)
            and not self._weight_is_shared(weight)
        )

    def _merged_for_training(self, active: list[str], x: torch.Tensor, base: nn.Module) -> Optional[_TrainingMerge]:
        """Bring W + scatter(η, φ) of the single training adapter into the base weight's storage (None: not
        applicable; θ₀ is then written back where it was merged — a quantized layer, never merged, keeps
        its kept NF4 launch, which full training passes and eval and no-grad passes then reuse)."""
        if getattr(self, "_is_replica", False):  # an nn.DataParallel replica: shares the weight, its state dies with the step
            return None
        if not (self.merge_for_training and accel.ON and self.training and len(active) == 1 and torch.is_grad_enabled()):
            self.release_weight_merge()
            return None
        name = active[0]
        indices = self.sparse_indices[name]
        values = self.sparse_values[name]
        weight = base.weight
        merge = self._training_merge
        if merge is None or merge.adapter != name or merge.indices is not indices or merge.weight is not weight or not merge.stored_in_weight():
            self.release_weight_merge()
            if not self._can_merge_in_place(base, values):
                return None
            merge = self._start_training_merge(name, weight)
        if _compute_dtype(x, weight.dtype) != weight.dtype:  # autocast to another dtype: the transient copy converts
            self.release_weight_merge()
            return None
        if not merge.current(values):  # not known to be what the optimizer step hook last wrote
            merge.write(values)
        return merge

    def train(self, mode: bool = True):
        if not mode:
            self.release_training_merge()
        return nn.Module.train(self, mode)

    def _apply(self, fn, recurse: bool = True):
        self.release_training_merge()
        return nn.Module._apply(self, fn, recurse)

    def __getstate__(self):
        # pickling (torch.save of a whole model): the caches that hold weak references start empty in the copy,
        # which fills them again; the model reference is set again by the tuner (SparseTuner.__setstate__)
        state = nn.Module.__getstate__(self).copy()
        state.update(_model_ref=None, _shared_check=None, _nf4_cache=None, _nf4_starts_cache=None, _delta_csr={})
        return state

    def _replicate_for_data_parallel(self):
        self.release_training_merge()  # replicas share the weight and never merge into it (see _merged_for_training)
        return nn.Module._replicate_for_data_parallel(self)

    # ----------------------------------------------------------------------------------- forward
    def _check_ready(self, adapter_name: str) -> None:
        """Refuse placeholder indices, re-register replaced values, restore a foreign cast; remember the
        values tensor that passed (``_ready``) so later passes skip the checks until it changes."""
        self._ready.pop(adapter_name, None)
        if adapter_name in self._indices_pending:
            raise RuntimeError(
                f"{self.module_name}: adapter {adapter_name!r} has placeholder indices (its config has "
                "init='external', i.e. indices that only a saved adapter file provides). Load the adapter "
                "weights with PeftModel.from_pretrained or peft_sparse.load_sparse_adapter."
            )
        values = self.sparse_values[adapter_name]
        if sparse_owner(values) is None:  # replaced since creation (e.g. an assign-load)
            self._register_values(adapter_name)
        indices = self.sparse_indices[adapter_name]
        if self._checked_indices.get(adapter_name) is not indices:
            # a new indices tensor, e.g. put in place by transformers' own adapter loading (``load_adapter``,
            # ``from_pretrained`` of an adapter directory), which bypasses PEFT's checks of the file: checked
            # once, as PEFT's loading checks it
            check_sparse_tensors(self.module_name, indices, values, self.numel, index_dtype=index_dtype(self.numel))
            self._checked_indices[adapter_name] = indices
        wanted = self.values_dtype[adapter_name]
        if values.dtype != wanted and values.device.type != "meta":
            # Something outside PEFT's adapter API re-cast the values (TRL casts the trainable parameters of
            # quantized models to bfloat16). Restore the configured dtype when that loses nothing, else refuse.
            if torch.count_nonzero(values) == 0:
                warnings.warn(
                    f"{self.module_name}: values of adapter {adapter_name!r} were cast to {values.dtype} outside "
                    f"peft_sparse; restored the configured values_dtype {wanted} (they were all zero, nothing lost)."
                )
                values.data = values.data.to(wanted)
            else:
                raise RuntimeError(
                    f"{self.module_name}: values of adapter {adapter_name!r} were cast to {values.dtype} outside "
                    f"peft_sparse but the adapter's values_dtype is {wanted}; precision may already be lost. "
                    f"Set values_dtype='{str(values.dtype).removeprefix('torch.')}' in the config, or stop the cast."
                )
        self._ready[adapter_name] = values

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        steady = self._steady
        observed = False
        if steady is not None and not args and not kwargs and accel.ON:
            # A training pass like the last one: the same single adapter (values, indices, blocks), still
            # merged in place and current (or, on a quantized layer, rebuilt as in every pass). Each
            # decision of the full path below is checked again here,
            # only without its lookups: the host time of a layer call bounds the step when kernels are short.
            # (The observer runs first, as in the full path: whatever it changes is seen by the checks.)
            current, name, values, dtype, indices, indices_key, base, weight, merge, blocks, device = steady
            observer = self.training_observer
            if (
                observer is not None and not getattr(observer, "idle", False)  # (idle: nothing to watch for now)
                and self.training and torch.is_grad_enabled() and not self._disable_adapters
                and not self.merged_adapters and self._active_adapter == current and name in self._modules["sparse_values"]._parameters
            ):  # (where the full path calls it: its adapter is active on this layer)  # fmt: skip
                self.training_observer(self)
                observed = True
            if (
                self.training
                and self._active_adapter == current
                and not self._disable_adapters
                and not self.merged_adapters
                and self._training_merge is merge
                and self._modules["base_layer"] is base
                and base._parameters.get("weight") is weight
                and self._modules["sparse_values"]._parameters.get(name) is values
                and self._ready.get(name) is values
                and values.dtype is dtype
                and self._modules["sparse_indices"]._buffers.get(name) is indices
                and internals.version(indices) == indices_key[0]
                and indices.data_ptr() == indices_key[1]
                and torch.is_grad_enabled()
            ):
                if merge is None:  # a quantized layer: its weight is rebuilt in each pass (nothing merged)
                    spec = (self._stored_weight, True, self, blocks, None, 1)  # (never kept: it holds the layer)
                    rebuild = self._nf4_rebuild
                    if rebuild is not None and not torch.is_autocast_enabled(x.device.type):
                        # the kept fused launch, called here (its own checks included) rather than from
                        # inside the autograd function's generic forward
                        merged = rebuild(self, indices, values, None)
                        if merged is not None:
                            y = given_weight_apply(x, merged, base._parameters.get("bias"), spec, indices, values)
                            del merged  # (transient: freed before the output's cast, as inside the autograd function)
                            return y.to(x.dtype)
                        self._nf4_rebuild = None  # (it did not apply: the generic path plans anew, without checking it again)
                    return sparse_delta_apply(x, base._parameters.get("bias"), spec, indices, values).to(x.dtype)
                autocast = torch.is_autocast_enabled(device)  # (the weight's device type: X on another fails in F.linear)
                if (
                    self.merge_for_training
                    and (not autocast or torch.get_autocast_dtype(device) == weight.dtype)
                    and weight.data_ptr() == merge.weight_ptr  # (merge.stored_in_weight(): the steady merge's weight is this one)
                    and not weight.requires_grad
                    and merge.current(values)
                ):
                    spec = (merge.stored_weight, False, self, blocks, merge, 1)
                    bias = base._parameters.get("bias")
                    if not autocast and x.dtype is weight.dtype and (bias is None or bias.dtype is weight.dtype):
                        return merged_apply(x, bias, spec, indices, values)  # (the generic pass would make no other decision)
                    return sparse_delta_apply(x, bias, spec, indices, values)
            self._steady = None  # (assigned only when set: nn.Module.__setattr__ costs host time on every pass)
        if self.disable_adapters:
            self.release_training_merge()
            if self.merged:
                self.unmerge()
            return self._base_forward(x, *args, **kwargs)
        if self.merged:
            return self.base_layer(x, *args, **kwargs)
        values_of = self.sparse_values
        active = [a for a in self.active_adapters if a in values_of]
        if not active:
            self.release_training_merge()
            return self._base_forward(x, *args, **kwargs)
        values = [values_of[a] for a in active]
        ready, wanted = self._ready, self.values_dtype
        for name, v in zip(active, values):
            if ready.get(name) is not v or v.dtype != wanted[name]:
                self._check_ready(name)
        if self.training_observer is not None and self.training and torch.is_grad_enabled() and not observed:
            self.training_observer(self)
        base = self.get_base_layer()
        indices_of = self.sparse_indices
        indices = [indices_of[a] for a in active]
        if self.quantization_backend is None and base.weight.requires_grad:
            # the base weight itself is being trained: let autograd keep what it needs
            return sparse_delta_linear_reference(x, self.logical_weight(), base.bias, indices, values)
        if not torch.is_grad_enabled() and not args and not kwargs:
            # no backward pass can follow (generation, evaluation): Y = X·Wᵀ + X·δᵀ, the delta applied from its
            # d_φ entries instead of a weight-sized W + δ, where the cost model says that is cheaper (few tokens)
            nnz = sum(v.numel() for v in values)
            if kernels.COST_MODEL.choose_inference(x, x.numel() // max(1, x.shape[-1]), self.out_features, self.in_features, nnz) == "sparse":
                self.release_weight_merge()
                y = self.base_layer(x)
                delta = sparse_delta_product(x, indices, values, self.out_features, self._delta_matrices(active, indices, values))
                return y + delta.to(y.dtype)
        blocks = [self.block_metadata(a) for a in active]
        premerged = self._merged_for_training(active, x, base)
        y = sparse_delta_linear(
            x, premerged.stored_weight if premerged is not None else self._stored_weight, base.bias, indices, values,
            hooks=self, owned=self.quantization_backend is not None, blocks=blocks, premerged=premerged,
        )  # fmt: skip
        single = not args and not kwargs and len(self.active_adapters) == 1 and len(active) == 1 and not indices[0].is_inference()
        if single and (premerged is not None or (self.quantization_backend is not None and self.training and torch.is_grad_enabled())):
            # merged in place (a single adapter, nn.Linear, no quantization, no autocast to another dtype), or
            # a quantized layer (never merged: the same call in every pass while nothing above changes)
            current, idx = self._active_adapter, indices[0]
            current = current if isinstance(current, str) else list(current)  # (a copy: compared by value)
            self._steady = (current, active[0], values[0], values[0].dtype, idx, (internals.version(idx), idx.data_ptr()), base, base.weight,
                            premerged, blocks, base.weight.device.type)  # fmt: skip
        return y.to(x.dtype) if self.quantization_backend is not None else y

    def _delta_matrices(self, active: list, indices: list, values: list) -> Optional[list]:
        """The adapters' deltas as CSR matrices for :func:`sparse_delta_product`, kept while their indices and
        values are unchanged (a fast path: None when the fast paths are off, the product then builds them)."""
        if not accel.ON:
            return None
        cache = self._delta_csr
        out = []
        for name, idx, val in zip(active, indices, values):
            if idx.is_inference() or val.is_inference():
                return None  # (no version counter follows their edits)
            key = (idx.data_ptr(), internals.version(idx), val.data_ptr(), internals.version(val), val.dtype, val.device)
            kept = cache.get(name)
            if kept is None or kept[0] != key or kept[1] is not idx or kept[2] is not val:
                kept = (key, idx, val, delta_matrix(idx, val.detach(), self.out_features, self.in_features))
                cache[name] = kept
            out.append(kept[3])
        return out

    def _base_forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The base layer alone. In training with grad, through the sparse autograd function with no
        adapter: a plain ``nn.Linear`` would keep the live weight for backward, which a later training
        pass may rewrite in place; this one looks θ₀ up again in backward instead."""
        base = self.get_base_layer()
        if (self.merge_for_training and accel.ON and self.training and torch.is_grad_enabled() and type(base) is nn.Linear
                and not args and not kwargs):  # fmt: skip
            return sparse_delta_linear(x, self._stored_weight, base.bias, [], [], hooks=self)
        return self.base_layer(x, *args, **kwargs)

    def merged_weight(self, adapter_names: Optional[list[str]] = None) -> torch.Tensor:
        """W + Σ scatter(η, φ) over the given (default: active) adapters, as a new (out, in) tensor."""
        names = adapter_names if adapter_names is not None else [a for a in self.active_adapters if a in self.sparse_values]
        weight = self.logical_weight()
        return compose_weight(
            weight,
            [self.sparse_indices[a] for a in names],
            [self.sparse_values[a].detach() for a in names],
            weight.dtype,
            owned=self.quantization_backend is not None,
        )

    def __repr__(self) -> str:
        return "sparse." + super().__repr__()


class SparseLinear(nn.Module, SparseLayer):
    """Sparse adapter around ``nn.Linear``, GPT-2 ``Conv1D`` or bitsandbytes ``Linear4bit``."""

    __getstate__ = SparseLayer.__getstate__  # (nn.Module's comes first in the method order)

    def __init__(self, base_layer: nn.Module, module_name: str) -> None:
        super().__init__()
        SparseLayer.__init__(self, base_layer, module_name)

    # nn.Module comes first in the MRO (as in PEFT's layers), so point at the shared implementations
    forward = SparseLayer.forward
    train = SparseLayer.train
    _apply = SparseLayer._apply
    _replicate_for_data_parallel = SparseLayer._replicate_for_data_parallel
    __repr__ = SparseLayer.__repr__
