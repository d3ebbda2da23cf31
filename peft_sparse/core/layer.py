"""``SparseLayer``: one PEFT tuner layer for every sparse method and every supported base layer.

Per adapter it holds

* ``sparse_indices[name]`` — persistent buffer of flat, sorted, row-major indices into the
  **logical (out_features, in_features) matrix**, int32 when the matrix has fewer than 2³¹ elements;
* ``sparse_values[name]`` — the trainable values φ (a Parameter, float32 unless configured);
* ``sparse_ages[name]`` — only for dynamic methods (SpIEL): optimizer step at which each index was
  last grown, int32.

The storage layout of the base layer never leaks into the indices: GPT-2 ``Conv1D`` stores
(in, out) and bitsandbytes ``Linear4bit`` stores packed nf4 data, and both are translated here.

**A pass.** Training: W + scatter(η, φ) is built transiently in forward and again in backward
(:mod:`peft_sparse.core.functional`); nothing of W's size is kept for backward. Without gradients
(generation, evaluation) with few tokens: Y = X·Wᵀ + X·δᵀ from δ's d_φ entries instead. The layer's fast
paths live in :mod:`peft_sparse.accel` and are mixed in here: the opt-in training merge
(:mod:`peft_sparse.accel.training_merge`, W + δ kept in the base weight's storage while training) and the
fused NF4 launch of 4-bit layers (:mod:`peft_sparse.accel.nf4`).

**Steady passes** (a fast path, :mod:`peft_sparse.accel.steady`): a training forward like the last one
checks that pass's decisions directly and reuses them. The values' owner table is in :mod:`.owners`, mixed
batches (``adapter_names``) in :mod:`.mixed_batch`.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import resolve_quantization_backend
from torch import nn
from transformers.pytorch_utils import Conv1D

from .. import accel
from ..accel import internals
from ..accel.nf4 import FusedNF4Layer, _NF4Rebuild
from ..accel.inference import base_output, inference_forward, kept_delta_matrices
from ..accel.steady import steady_forward
from ..accel.training_merge import (
    TrainingMergeLayer,
    _TrainingMerge,
)
from ..registry import BufferDict
from . import kernels
from .functional import (
    sparse_delta_linear,
    sparse_delta_linear_reference,
    sparse_delta_product,
)
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


class SparseLayer(TrainingMergeLayer, FusedNF4Layer, MergeLayer, MixedBatchLayer, BlockLayoutLayer, BaseTunerLayer):
    adapter_layer_names = ("sparse_values",)
    other_param_names = ("sparse_indices", "sparse_ages", "sparse_masks")
    # keep the training adapter merged in the base weight's storage (module docstring): opt-in, through the
    # config's ``training_merge`` or per layer, because the base weight then shows θ₀ + δ during training
    merge_for_training: bool = False

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
        self._inference_memo = None  # the single active adapter's CSR delta and what it was built from (accel/inference.py)
        # adapter → the values tensor that last passed _check_ready, and the indices tensor it last checked
        self._ready: dict[str, torch.Tensor] = {}
        self._checked_indices: dict[str, torch.Tensor] = {}
        self.resizable_adapters: set[str] = set()  # adapters whose size a reselection or a load may change
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
        self._delta_csr.pop(adapter_name, None)
        self._inference_memo = None

    def train(self, mode: bool = True):
        if not mode:
            self.release_training_merge()
        return nn.Module.train(self, mode)

    def _apply(self, fn, recurse: bool = True):
        """``.to()``, ``.half()``, ``.bfloat16()``, ``.float()``, ``.cuda()`` …: a cast the user asks for through the
        module is followed — the values take the new floating dtype and it becomes their ``values_dtype`` on this
        layer (a cast of ``.data`` from outside is refused or undone instead: :meth:`_check_ready`)."""
        self.release_training_merge()
        self._inference_memo = None
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
        state.update(_model_ref=None, _shared_check=None, _nf4_cache=None, _nf4_starts_cache=None, _delta_csr={}, _inference_memo=None)
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

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if "adapter_names" in kwargs:
            return self._mixed_batch_forward(x, kwargs.pop("adapter_names"), *args, **kwargs)
        if self.merged_adapters and not self.disable_adapters:  # merged (merge, merged_for_inference): the base's pass
            if accel.ON and not args and not kwargs:
                return base_output(self._modules["base_layer"], x)  # (a fast path: F.linear itself where nothing hooks it)
            return self.base_layer(x, *args, **kwargs)
        observed = False
        if not args and not kwargs and accel.ON and not torch.is_grad_enabled():
            y = inference_forward(self, x)  # (a fast path: accel/inference.py)
            if y is not None:
                return y
        if self._steady is not None and not args and not kwargs and accel.ON:
            y, observed = steady_forward(self, x)  # (a fast path: accel/steady.py)
            if y is not None:
                return y
        if self.disable_adapters:
            self.release_training_merge()
            if self.merged:
                self.unmerge()
            return self._base_forward(x, *args, **kwargs)
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
        if not base.weight.numel() and hasattr(base.weight, "ds_id"):  # partitioned by DeepSpeed ZeRO-3, not gathered
            gather_partitioned_base(self, base)
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
                delta = sparse_delta_product(x, indices, values, self.out_features, kept_delta_matrices(self, active, indices, values))
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

    def _base_forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The base layer alone. In training with grad, through the sparse autograd function with no
        adapter: a plain ``nn.Linear`` would keep the live weight for backward, which a later training
        pass may rewrite in place; this one looks θ₀ up again in backward instead."""
        base = self.get_base_layer()
        if (self.merge_for_training and accel.ON and self.training and torch.is_grad_enabled() and type(base) is nn.Linear
                and not args and not kwargs):  # fmt: skip
            return sparse_delta_linear(x, self._stored_weight, base.bias, [], [], hooks=self)
        return self.base_layer(x, *args, **kwargs)

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
