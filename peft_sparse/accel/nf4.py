"""The fused NF4 step of 4-bit layers on CUDA (the ``fused_weight`` step of :mod:`peft_sparse.core.dispatch`):
dequantization and the delta in one Triton launch, the launch kept per layer (``layer._nf4_rebuild``) and repeated
while its operands stay. The reference dequantizes through bitsandbytes and scatters the delta separately
(:mod:`peft_sparse.core.quant`)."""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn

from ..core import dispatch, kernels
from . import internals


def _no_rebuild() -> None:
    """What a copied or unpickled :class:`_NF4Rebuild` becomes."""
    return None


class _NF4Rebuild:
    """A 4-bit layer's fused NF4 launch (:func:`kernels.nf4_compose` with a single adapter) to repeat from
    its :class:`~peft_sparse.accel.triton_kernels.LaunchPlan` into a new output while its operands are
    the same: the base layer, its 4-bit weight (object, storage, quantization state, compute dtype), the
    indices (object, storage, size) and the values (storage, size, dtype); their contents may change.
    Indices rewritten in place (a reselection: their version moves) are followed: the per-program slices
    the launch reads (``starts``, the layer's kept :func:`nf4_starts`) are recomputed in
    place first, so the launch is repeated instead of planned anew. The plan holds those tensors, so the
    layer drops this when it forgets its last pass (a release of its base weight) or when the plan no
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
        # (address, version, size): the key of nf4_starts' cache, which the refresh below updates
        self.indices, self.indices_key, self.starts = indices, (indices.data_ptr(), internals.version(indices), indices.numel()), starts
        self.values_key = (values.data_ptr(), values.numel(), values.dtype)
        self.shape, self.dtype, self.device = merged.shape, merged.dtype, merged.device

    def __call__(self, layer, indices: torch.Tensor, values: torch.Tensor, dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
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


def nf4_operands(layer):
    """What :func:`kernels.nf4_compose` needs to rebuild this bitsandbytes NF4 weight, or None (not NF4
    on CUDA, or another layout). Cached per weight tensor, storage and quantization state: the offset
    of double quantization is read to the host once."""
    base = layer.get_base_layer()
    weight = getattr(base, "weight", None)
    state = getattr(weight, "quant_state", None)
    if state is None or not weight.is_cuda:
        return None
    cached = layer._nf4_cache
    if cached is not None and cached[0]() is weight and cached[1] == weight.data_ptr() and cached[2] is state:
        return cached[3]
    operands = None
    nested = getattr(state, "nested", False)
    if (
        state.quant_type == "nf4"
        and not getattr(state, "packing_format_for_cpu", False)
        and weight.dtype == torch.uint8 and weight.is_contiguous()
        and weight.numel() * 2 >= layer.numel
        and tuple(state.shape) == (layer.out_features, layer.in_features)
        and state.blocksize & (state.blocksize - 1) == 0
        and (not nested or state.state2.blocksize & (state.state2.blocksize - 1) == 0)
    ):  # fmt: skip
        inner = None
        if nested:
            inner = (state.absmax, state.state2.absmax, state.state2.code, state.state2.blocksize, float(state.offset))
        operands = (weight.data, state.code, state.absmax, inner, state.blocksize, tuple(state.shape), state.dtype)
    layer._nf4_cache = (weakref.ref(weight), weight.data_ptr(), state, operands)
    return operands


def nf4_starts(layer, indices: torch.Tensor) -> Optional[torch.Tensor]:
    """Where each program of the fused NF4 launch finds its slice of ``indices``
    (:func:`kernels.nf4_compose_starts`), kept while the indices tensor is the same and unchanged
    (its address and version: a reselection rewrites it in place). None for an inference tensor,
    which has no version to follow: the launch then finds the slices itself."""
    if indices.is_inference():
        return None
    key = (indices.data_ptr(), internals.version(indices), indices.numel())
    cached = layer._nf4_starts_cache
    if cached is not None and cached[0]() is indices and cached[1] == key:
        return cached[2]
    starts = kernels.nf4_compose_starts(indices, layer.numel)
    layer._nf4_starts_cache = (weakref.ref(indices), key, starts)
    return starts


def fused_merged_weight(layer, indices, values, dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    """For an NF4 weight on CUDA: the dequantized weight plus Σ scatter(η_a, φ_a) built in one fused
    launch (the first adapter inside it), in ``dtype`` (None: the layer's compute dtype); None when
    this layer has no fused path or the dtype differs from the one bitsandbytes dequantizes to.
    A single adapter's launch is repeated from its :class:`_NF4Rebuild` while its operands stay."""
    if not dispatch.ON or getattr(layer, "base_kind", None) != "quantized":  # (off: dequantized, the delta added separately)
        return None
    rebuild = layer._nf4_rebuild
    if rebuild is not None:
        merged = rebuild(layer, indices[0], values[0], dtype) if len(indices) == 1 else None
        if merged is not None:
            return merged
        layer._nf4_rebuild = None  # (it holds the tensors it planned with; the full path plans anew)
    operands = nf4_operands(layer) if layer.quantization_backend is not None else None
    if operands is None:
        return None
    base = layer.get_base_layer()
    compute = getattr(base, "compute_dtype", None) or operands[6]
    if compute != operands[6] or (dtype is not None and dtype != compute):
        return None
    packed, code, absmax, nested, blocksize, shape, qdtype = operands
    single = len(indices) == 1 and not indices[0].is_inference()  # (a launch to keep: see _NF4Rebuild)
    first = (indices[0], values[0].detach(), nf4_starts(layer, indices[0])) if indices else (None, None, None)
    result = kernels.nf4_compose(packed, code, absmax, nested, blocksize, shape, qdtype, *first, plan=single)
    merged, plan = result if single else (result, None)
    if plan is not None:
        layer._nf4_rebuild = _NF4Rebuild(plan, base, indices[0], values[0], merged, first[2])
    for idx, val in zip(indices[1:], values[1:]):
        kernels.scatter_add_into(merged, idx, val.detach())
    return merged
