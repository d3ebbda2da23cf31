"""What the sparse core knows about the base layers it wraps, independent of any adapter: which layers are
supported, their logical (out, in) shape, where a logical index sits in the stored weight, the index dtype,
and how a delta is added to a base weight in its own storage (float in place, 4-bit requantized)."""

from __future__ import annotations

from typing import Optional

import torch
from peft.utils import resolve_quantization_backend
from torch import nn
from transformers.pytorch_utils import Conv1D

from .quant import is_bnb_4bit, standard_4bit_layout


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def supported_embedding(module: nn.Module) -> bool:
    """A plain lookup table: ``nn.Embedding`` or a subclass that keeps its forward (no scaling, no max_norm)."""
    return isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward and module.max_norm is None


def unsupported_embedding_reason(module: nn.Module) -> Optional[str]:
    if not isinstance(module, nn.Embedding):
        return None
    if type(module).forward is not nn.Embedding.forward:
        return f"{type(module).__name__} changes nn.Embedding's forward (e.g. scales it), so a delta added to its rows would not be what it computes"
    if module.max_norm is not None:
        return f"its max_norm={module.max_norm} renormalises the rows in place at every lookup"
    return None


def supported_base_layer(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, Conv1D)) or is_bnb_4bit(module) or supported_embedding(module)


def logical_shape(module: nn.Module) -> tuple[int, int]:
    """(out_features, in_features) of a supported base layer; an embedding table is (num_embeddings, embedding_dim)."""
    if isinstance(module, Conv1D):
        return module.nf, module.nx
    if isinstance(module, nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    return module.out_features, module.in_features


def storage_positions(base: nn.Module, indices: torch.Tensor) -> torch.Tensor:
    """Flat positions in the stored float weight of logical (out, in) flat indices (Conv1D stores the transpose)."""
    idx = indices.long()
    if isinstance(base, Conv1D):
        out_features, in_features = logical_shape(base)
        return (idx % in_features) * out_features + idx // in_features
    return idx


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


def innermost_base_layer(base: nn.Module) -> nn.Module:
    """The innermost base layer under ``base`` (PEFT's definition: follow ``base_layer`` while there is one), without
    the attribute-lookup exceptions of PEFT's loop: it runs on every forward pass of a sparse layer."""
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


def gather_partitioned_base(layer: nn.Module, base: nn.Module) -> None:
    """DeepSpeed ZeRO-3 partitions every parameter and gathers a module's own parameters around its forward and
    backward passes. A sparse layer reads its base layer's weight (and bias) in its own forward pass without calling
    the base layer, so they are registered as the sparse layer's external parameters — ZeRO-3 gathers them with the
    sparse layer's from then on, in the backward pass too — and gathered now for the pass that found them
    partitioned (as ZeRO-3 itself treats a parameter it finds used outside its module)."""
    for param in register_partitioned_base(layer, base):
        param.all_gather()


def register_partitioned_base(layer: nn.Module, base: nn.Module) -> list:
    """Register ``base``'s ZeRO-3-partitioned weight and bias as ``layer``'s external parameters (see
    :func:`gather_partitioned_base`); returns those newly registered. Done before the first training step (SpIEL's
    scheduler does it for its layers), ZeRO-3 records the same order of fetches in every step."""
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    registered = getattr(layer, "_external_params", {})
    new = []
    for param in (base.weight, getattr(base, "bias", None)):
        if isinstance(param, nn.Parameter) and hasattr(param, "ds_id") and id(param) not in registered:
            register_external_parameter(layer, param)
            new.append(param)
    return new


def engine_keeps_master(param: torch.Tensor) -> bool:
    """Whether a DeepSpeed mixed-precision optimizer (bf16 at any ZeRO stage, fp16 under ZeRO 1–3) holds ``param``'s float32
    master copy, so that ``param`` itself is the engine's low-precision working copy and casting it lost nothing:
    DeepSpeed marks such a parameter with ``ds_id`` (stage 3) or ``_hp_mapping`` (the others) — the attributes its
    public ``deepspeed.utils.safe_get_full_fp32_param`` reads. False without DeepSpeed."""
    return hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")


def managed_by_sharding(weight: torch.Tensor) -> bool:
    """A weight managed by a sharding wrapper (FSDP, DeepSpeed ZeRO-3, DTensor): never written in place."""
    if getattr(weight, "_fsdp_flattened", False) or hasattr(weight, "ds_id"):
        return True
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(weight, DTensor)
