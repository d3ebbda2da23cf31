"""The training merge (opt-in: ``training_merge=True`` in the config, or ``layer.merge_for_training``).

While one adapter trains on a plain ``nn.Linear`` (float weight not shared with other parameters, no
quantization, no sharding wrapper, not an ``nn.DataParallel`` replica), the layer keeps the merged weight
in the base weight's own storage: it saves θ₀[η] (d_φ entries) once and writes θ₀[η] + φ at η (d_φ
entries, not W) whenever φ changed, so forward and backward read W in place and no W-sized copy is made.
The write happens right after each step of an optimizer that holds φ (one batched launch for all layers;
a hook every ``torch.optim.Optimizer`` runs, which repeats an optimizer's last rewrites while nothing they
depend on changed, :class:`_SteadyRefresh`). A training forward trusts that write only while φ's version
counter, data pointer and storage are unchanged since; otherwise it writes θ₀[η] + φ itself. θ₀ is written
back (``release_training_merge``) whenever anything else may look at the base weight: ``eval()``,
``state_dict()``, ``load_state_dict()``, ``.to()``, merging, unloading, disabling or deleting adapters,
``logical_weight()``, ``nn.DataParallel`` replication, and before an edit of the indices (which moves each
merge to its new indices in place: :func:`reseat_training_merges`). Between optimizer steps the base
weight read through ``named_parameters()`` holds θ₀ + δ: that is why this is opt-in. Results are bit for
bit those of the transient copy. ``peft_sparse.fast_paths(False)`` turns it off.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch
from torch import nn

from ..core import dispatch, kernels
from ..core.base import managed_by_sharding
from ..core.functional import compute_dtype, sparse_delta_linear
from . import internals
from .steady import remember


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
_MERGED_LAYERS: "weakref.WeakSet" = weakref.WeakSet()  # the layers merged now
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
    if not _MERGED_LAYERS or not dispatch.ON:
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
        layer._base_weight_held = False
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
    layer no longer merging in place (``merge_for_training``, :func:`can_merge_in_place`)
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
            and layer.merge_for_training and can_merge_in_place(layer, base, values)
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
        if layer._training_merge is not None or not layer.merge_for_training or not can_merge_in_place(layer, base, values):
            continue
        due.append((start_training_merge(layer, adapter, base.weight), values.detach()))
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


def _written_by_zero(values: torch.Tensor) -> bool:
    """Values whose updates DeepSpeed ZeRO writes (stage 1/2 link them to their partitions, stage 3 partitions
    them): it copies the stepped masters back by collectives that leave the values' version counter as it was,
    so a merge could not tell that they changed. The merge stays off; each pass composes W + δ itself."""
    return hasattr(values, "_hp_mapping") or hasattr(values, "ds_id")


def start_training_merge(layer, adapter: str, weight: torch.Tensor) -> _TrainingMerge:
    """Read θ₀ at the adapter's indices and register the layer for the optimizer step's rewrites (the
    caller writes θ₀[η] + φ)."""
    merge = layer._training_merge = _TrainingMerge(adapter, layer.sparse_indices[adapter], weight)
    layer._base_weight_held = True  # (the layer writes θ₀ back before anything reads the weight: release_training_merges)
    _MERGE_EPOCH[0] += 1
    _MERGED_LAYERS.add(layer)
    _register_step_hook()
    return merge


def can_merge_in_place(layer, base: nn.Module, values: torch.Tensor) -> bool:
    """Whether ``layer`` may keep W + δ in ``base``'s weight: a float ``nn.Linear`` weight, frozen, contiguous,
    beside the values, managed by no sharding wrapper and used by no other parameter of the model."""
    if layer.quantization_backend is not None or layer.fan_in_fan_out or type(base) is not nn.Linear:
        return False
    weight = base.weight
    return (
        weight.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and not weight.requires_grad
        and weight.is_contiguous()
        and weight.device == values.device
        and weight.device.type != "meta"
        and not managed_by_sharding(weight)
        and not _written_by_zero(values)
        and not layer._weight_is_shared(weight)
    )


def merged_for_training(layer, active: list[str], x: torch.Tensor, base: nn.Module) -> Optional[_TrainingMerge]:
    """Bring W + scatter(η, φ) of the single training adapter into the base weight's storage (None: not
    applicable; θ₀ is then written back where it was merged)."""
    if getattr(layer, "_is_replica", False):  # an nn.DataParallel replica: shares the weight, its state dies with the step
        return None
    name = active[0]
    indices = layer.sparse_indices[name]
    values = layer.sparse_values[name]
    weight = base.weight
    merge = layer._training_merge
    if merge is None or merge.adapter != name or merge.indices is not indices or merge.weight is not weight or not merge.stored_in_weight():
        release_weight(layer)
        if not can_merge_in_place(layer, base, values):
            return None
        merge = start_training_merge(layer, name, weight)
    if compute_dtype(x, weight.dtype) != weight.dtype:  # autocast to another dtype: the transient copy converts
        release_weight(layer)
        return None
    if not merge.current(values):  # not known to be what the optimizer step hook last wrote
        merge.write(values)
    return merge


def release_weight(layer) -> None:
    """θ₀ back in ``layer``'s base weight where an adapter is merged there for training."""
    if layer._training_merge is not None:
        release_training_merges([layer])


def training_merge_pass(layer, x: torch.Tensor, active: list) -> Optional[torch.Tensor]:
    """A training pass of a layer that keeps W + δ in its base weight (``layer.merge_for_training``; one adapter,
    a plain ``nn.Linear``): the reference's output and gradients, bit for bit, with neither pass building a
    weight-sized copy; remembered for the next pass (:func:`~.steady.remember`). With no adapter active, the
    base layer's pass through the sparse autograd function, which looks θ₀ up again in backward (a plain
    ``nn.Linear`` would keep the live weight, which a later pass rewrites in place). None for any other pass."""
    if not (layer.merge_for_training and layer.training and torch.is_grad_enabled()):
        return None
    base = layer.get_base_layer()
    if not active:
        if type(base) is not nn.Linear:
            return None
        layer.release_training_merge()
        return sparse_delta_linear(x, layer._stored_weight, base.bias, [], [], hooks=layer)
    if len(active) != 1:
        return None
    merge = merged_for_training(layer, active, x, base)
    if merge is None:
        return None
    name = active[0]
    indices, values = layer.sparse_indices[name], layer.sparse_values[name]
    blocks = [layer.block_metadata(name)]
    y = sparse_delta_linear(x, merge.stored_weight, base.bias, [indices], [values], hooks=layer, blocks=blocks, premerged=merge)
    remember(layer, active, values, indices, blocks, merge)
    return y
