"""Steady training passes (a fast path of :class:`peft_sparse.core.layer.SparseLayer`): once a merge was rewritten
by an optimizer step, a layer remembers the decisions of its last pass and the next training forward checks
each of them directly, without the lookups of the full path, before reusing them.

The decisions kept are the adapter, values, indices and their version, base layer and weight, and block layout:
nothing that refers back to the layer. Any difference, and any other kind of pass, takes the full path.
Quantized (4-bit) layers, which rebuild their weight in every pass and never merge, remember their training
passes the same way and repeat the fused NF4 launch of their single adapter while its operands are the same; a
steady training pass launches it itself and multiplies by the weight it gives (``functional.GivenWeightLinear``).
When kernels are short, the host time of a layer call bounds the training step."""

from __future__ import annotations

from typing import Optional

import torch

from . import internals
from ..core.functional import given_weight_apply, merged_apply, sparse_delta_apply


def steady_forward(layer, x: torch.Tensor) -> tuple[Optional[torch.Tensor], bool]:
    """A training pass like the layer's last one: the same single adapter (values, indices, blocks), still merged
    in place and current (or, on a quantized layer, rebuilt as in every pass). Each decision of the full path
    (:meth:`SparseLayer.forward`) is checked again here, only without its lookups: the host time of a layer call
    bounds the step when kernels are short. The observer runs first, as in the full path: whatever it changes is
    seen by the checks. Returns (the output, or None when the full path must run; whether the observer ran)."""
    current, name, values, dtype, indices, indices_key, base, weight, merge, blocks, device = layer._steady
    observed = False
    observer = layer.training_observer
    if (
        observer is not None and not getattr(observer, "idle", False)  # (idle: nothing to watch for now)
        and layer.training and torch.is_grad_enabled() and not layer._disable_adapters
        and not layer.merged_adapters and layer._active_adapter == current and name in layer._modules["sparse_values"]._parameters
    ):  # (where the full path calls it: its adapter is active on this layer)  # fmt: skip
        layer.training_observer(layer)
        observed = True
    if (
        layer.training
        and layer._active_adapter == current
        and not layer._disable_adapters
        and not layer.merged_adapters
        and layer._training_merge is merge
        and layer._modules["base_layer"] is base
        and base._parameters.get("weight") is weight
        and layer._modules["sparse_values"]._parameters.get(name) is values
        and layer._ready.get(name) is values
        and values.dtype is dtype
        and layer._modules["sparse_indices"]._buffers.get(name) is indices
        and internals.version(indices) == indices_key[0]
        and indices.data_ptr() == indices_key[1]
        and torch.is_grad_enabled()
    ):
        if merge is None:  # a quantized layer: its weight is rebuilt in each pass (nothing merged)
            spec = (layer._stored_weight, True, layer, blocks, None, 1)  # (never kept: it holds the layer)
            rebuild = layer._nf4_rebuild
            if rebuild is not None and not torch.is_autocast_enabled(x.device.type):
                # the kept fused launch, called here (its own checks included) rather than from
                # inside the autograd function's generic forward
                merged = rebuild(layer, indices, values, None)
                if merged is not None:
                    y = given_weight_apply(x, merged, base._parameters.get("bias"), spec, indices, values)
                    del merged  # (transient: freed before the output's cast, as inside the autograd function)
                    return y.to(x.dtype), observed
                layer._nf4_rebuild = None  # (it did not apply: the generic path plans anew, without checking it again)
            return sparse_delta_apply(x, base._parameters.get("bias"), spec, indices, values).to(x.dtype), observed
        autocast = torch.is_autocast_enabled(device)  # (the weight's device type: X on another fails in F.linear)
        if (
            layer.merge_for_training
            and (not autocast or torch.get_autocast_dtype(device) == weight.dtype)
            and weight.data_ptr() == merge.weight_ptr  # (merge.stored_in_weight(): the steady merge's weight is this one)
            and not weight.requires_grad
            and merge.current(values)
        ):
            spec = (merge.stored_weight, False, layer, blocks, merge, 1)
            bias = base._parameters.get("bias")
            if not autocast and x.dtype is weight.dtype and (bias is None or bias.dtype is weight.dtype):
                return merged_apply(x, bias, spec, indices, values), observed  # (the generic pass would make no other decision)
            return sparse_delta_apply(x, bias, spec, indices, values), observed
    layer._steady = None  # (assigned only when set: nn.Module.__setattr__ costs host time on every pass)
    return None, observed
