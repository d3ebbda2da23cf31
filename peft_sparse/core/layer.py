r"""``SparseLayer``: one PEFT tuner layer for every sparse method and every supported base layer.

Per adapter it holds

* ``sparse_indices[name]`` — persistent buffer of flat, sorted, row-major indices into the
  **logical (out_features, in_features) matrix**, int32 when the matrix has fewer than 2³¹ elements;
* ``sparse_values[name]`` — the trainable values φ (a Parameter, float32 unless configured);
* ``sparse_ages[name]`` — only for dynamic methods (SpIEL): optimizer step at which each index was
  last grown, int32.

The storage layout of the base layer never leaks into the indices: GPT-2 ``Conv1D`` stores
(in, out) and bitsandbytes ``Linear4bit`` stores packed nf4 data, and both are translated here.

**A pass** computes

.. math::
    Y = X\,\big(W + \textstyle\sum_a \mathrm{scatter}(\eta_a, \phi_a)\big)^\top + b

over the active adapters a (thesis Eq. 7.2, 7.8). :meth:`SparseLayer.forward` says which adapters are active
and hands the pass to :func:`peft_sparse.core.dispatch.forward`, which picks its implementation from the
layer's base kind (:attr:`SparseLayer.base_kind`) and state: the reference of :mod:`.passes` (W + δ built
transiently in forward and again in backward, nothing of W's size kept; without gradients and with few
tokens, Y = X·Wᵀ + X·δᵀ from δ's d_φ entries), or a faster implementation registered by
:mod:`peft_sparse.accel`. Whatever a fast path keeps on a layer (its attributes are registered in
:data:`~peft_sparse.core.dispatch.LAYER_STATE`) follows the layer through the listeners of :mod:`.dispatch`:
:meth:`SparseLayer.release_training_merge` and the edits of :mod:`.edit` call them. The values' owner table
is in :mod:`.owners`, mixed batches (``adapter_names``) in :mod:`.mixed_batch`, merging in :mod:`.merging`.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Optional

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import resolve_quantization_backend
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..registry import BufferDict
from . import dispatch, passes
from .base import (  # noqa: F401 (the base-layer helpers, also importable from here)
    engine_keeps_master,
    gather_partitioned_base,
    add_delta_to_base,
    index_dtype,
    innermost_base_layer,
    logical_shape,
    storage_positions,
    supported_base_layer,
    supported_embedding,
    unsupported_embedding_reason,
)
from .block_layout import BlockLayoutLayer
from .functional import REBUILD_MODES
from .merging import MergeLayer
from .mixed_batch import MixedBatchLayer
from .owners import register_owner, sparse_owner, take_saved_sizes  # noqa: F401 (sparse_owner: also importable from here)
from .quant import standard_4bit_layout
from .selection import check_sparse_tensors


def _release_before_state_dict(module, prefix, keep_vars) -> None:
    module.release_training_merge()


def _release_before_load(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
    module.release_training_merge()
    take_saved_sizes(module, state_dict, prefix)  # (budget_split='adaptive': a saved adapter holds its own sizes)


class SparseLayer(MergeLayer, MixedBatchLayer, BlockLayoutLayer, BaseTunerLayer):
    adapter_layer_names = ("sparse_values",)
    other_param_names = ("sparse_indices", "sparse_ages", "sparse_masks")
    # keep the training adapter merged in the base weight's storage (the training merge of peft_sparse.accel):
    # opt-in, through the config's ``training_merge`` or per layer, because the base weight then shows θ₀ + δ
    # during training
    merge_for_training: bool = False
    #: what the adapted tensor is, for the choice of a pass's implementation (:mod:`.dispatch`): "linear",
    #: "quantized" (set per layer), "embedding"
    base_kind: str = "linear"
    # True while a fast path keeps something of its own in the base weight's storage (the training merge sets it):
    # the layer then has the listeners of .dispatch write θ₀ back before anything reads the weight
    _base_weight_held: bool = False

    def __init__(self, base_layer: nn.Module, module_name: str) -> None:
        self.base_layer = base_layer
        self.module_name = module_name
        self.sparse_values = nn.ParameterDict({})
        self.sparse_indices = BufferDict(persistent=True)
        self.sparse_ages = BufferDict(persistent=True)
        # per-group masks over an adapter's slots, packed 8 per byte (S⁴: one row per language)
        self.sparse_masks = BufferDict(persistent=True)
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
        # called with the layer on every training forward pass with an active adapter (dynamic methods watch for a
        # missing scheduler), unless its ``idle`` attribute is true
        self.training_observer = None
        self._model_ref = None  # weakref to the model (set by the tuner): who else uses the base weight's storage
        self._shared_check = None  # (weakref to the weight, its storage pointer, shared?) of the last scan
        for name, (initial, _) in dispatch.LAYER_STATE.items():  # what the fast paths keep on a layer
            setattr(self, name, initial())
        # adapter → the values tensor that last passed _check_ready, and the indices tensor it last checked
        self._ready: dict[str, torch.Tensor] = {}
        self._checked_indices: dict[str, torch.Tensor] = {}
        self.resizable_adapters: set[str] = set()  # adapters whose size a reselection or a load may change
        self.register_state_dict_pre_hook(_release_before_state_dict)
        self.register_load_state_dict_pre_hook(_release_before_load)

        base = self.get_base_layer()
        self.quantization_backend = resolve_quantization_backend(base)
        if self.quantization_backend is not None:
            self.base_kind = "quantized"
        self.fan_in_fan_out = isinstance(base, Conv1D)
        self.out_features, self.in_features = logical_shape(base)

    @property
    def rebuild_inputs(self) -> str:
        """Which inputs backward rebuilds instead of keeping them for the value gradient (the ``input_rebuild``
        step of :mod:`.dispatch`, a fast path): ``"all"`` (default: gated-MLP activations and 16-bit RMSNorm
        outputs), ``"products"`` (only the activations: less recomputation, more memory), ``"none"``."""
        return self._rebuild_inputs

    @rebuild_inputs.setter
    def rebuild_inputs(self, mode: str) -> None:
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

    def release_training_merge(self) -> None:
        """θ₀ back in the base weight wherever a fast path wrote W + δ there (the training merge), and the passes
        the fast paths kept of this layer forgotten: before anything else reads or hands out the base weight."""
        dispatch.release([self])

    def release_weight_merge(self) -> None:
        """θ₀ back in the base weight wherever a fast path wrote W + δ there: what a pass needs before it reads θ₀.
        Unlike :meth:`release_training_merge`, the kept passes stay (a training step's backward leaves the next
        pass steady)."""
        if self._base_weight_held:  # (nothing to write back otherwise: a reference pass asks every time)
            dispatch.release([self], True)

    def _weight_is_shared(self, weight: torch.Tensor) -> bool:
        """Whether another parameter of the model uses the weight's storage (tied embeddings, views): such a
        weight is never written in place. Scanned once per weight tensor and storage (a tie replaces the tied
        layer's weight object)."""
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
        register_owner(self.sparse_values[adapter_name], self, adapter_name)

    def get_base_layer(self) -> nn.Module:
        return innermost_base_layer(self._modules["base_layer"])

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
        dispatch.forget(self, adapter_name)

    def train(self, mode: bool = True):
        if not mode:
            self.release_training_merge()
        return nn.Module.train(self, mode)

    def _apply(self, fn, recurse: bool = True):
        """``.to()``, ``.half()``, ``.bfloat16()``, ``.float()``, ``.cuda()`` …: a cast the user asks for through the
        module is followed — the values take the new floating dtype and it becomes their ``values_dtype`` on this
        layer (a cast of ``.data`` from outside is refused or undone instead: :meth:`_check_ready`)."""
        self.release_training_merge()
        dispatch.forget(self)
        before = {name: v.dtype for name, v in self.sparse_values.items()}
        out = nn.Module._apply(self, fn, recurse)
        for name, v in self.sparse_values.items():
            if name in before and v.dtype != before[name] and v.dtype.is_floating_point:
                self.values_dtype[name] = v.dtype
                self._ready.pop(name, None)
        return out

    def __getstate__(self):
        # pickling (torch.save of a whole model): the caches that hold weak references start empty in the copy,
        # which fills them again; the model reference is set again by the tuner (SparseTuner.__setstate__)
        state = nn.Module.__getstate__(self).copy()
        state.update(_model_ref=None, _shared_check=None)
        state.update({name: initial() for name, (initial, copied) in dispatch.LAYER_STATE.items() if not copied})
        return state

    def _replicate_for_data_parallel(self):
        self.release_training_merge()  # replicas share the weight: nothing a fast path wrote goes with them
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
            # Something outside PEFT's adapter API re-cast the values. DeepSpeed's bf16/fp16 engines cast every
            # trainable parameter and keep its float32 master: nothing was lost, and the layer follows the cast (as
            # ``_apply`` follows one asked for through the module; the adapter file keeps the config's dtype). Else
            # (TRL casts the trainable parameters of quantized models to bfloat16) restore the configured dtype
            # when that loses nothing, and refuse otherwise.
            if engine_keeps_master(values):
                self.values_dtype[adapter_name] = values.dtype
            elif torch.count_nonzero(values) == 0:
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

    def check_ready(self, active: list) -> None:
        """:meth:`_check_ready` of each adapter in ``active`` whose values changed since they last passed."""
        values_of, ready, wanted = self._modules["sparse_values"]._parameters, self._ready, self.values_dtype
        for name in active:
            v = values_of[name]
            if ready.get(name) is not v or v.dtype != wanted[name]:
                self._check_ready(name)

    def active_sparse_adapters(self) -> list:
        """The active adapters this layer holds, in order; none while adapters are disabled."""
        if self._disable_adapters:
            return []
        active, values_of = self._active_adapter, self._modules["sparse_values"]._parameters
        if isinstance(active, str):
            return [active] if active in values_of else []
        return [a for a in active if a in values_of]

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        r"""Y = X·(W + Σ_a scatter(η_a, φ_a))ᵀ + b over the active adapters a: x (..., in) → (..., out).

        The implementation of the pass — the reference of :mod:`.passes`, or one the fast paths registered —
        is chosen in one place, :func:`peft_sparse.core.dispatch.forward`."""
        if "adapter_names" in kwargs:  # a mixed batch: row i takes adapter adapter_names[i] (PEFT's keyword)
            return self._mixed_batch_forward(x, kwargs.pop("adapter_names"), *args, **kwargs)
        if self.merged_adapters:  # merged into W (merge, merged_for_inference)
            if not self.disable_adapters:
                return dispatch.base_output(self, x, args, kwargs)  # the base layer's own pass
            self.unmerge()  # disabled: θ₀ back, the base layer alone
        active = self.active_sparse_adapters()
        return dispatch.forward(self, x, active, args, kwargs)

    def __repr__(self) -> str:
        return "sparse." + nn.Module.__repr__(self)


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


# the reference pass of each base kind this module wraps (embeddings: .embedding)
dispatch.register_kind("linear", passes.linear_pass)
dispatch.register_kind("quantized", passes.linear_pass)
