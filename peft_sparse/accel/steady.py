"""Steady training passes (an implementation of the ``"linear"`` and ``"quantized"`` passes): once a merge was
rewritten by an optimizer step, a layer remembers the decisions of its last pass (``layer._steady``) and the next
training forward checks each of them directly, without the lookups of the full path, before reusing them.

The decisions kept are the adapter, values, indices and their version, base layer and weight, and block layout:
nothing that refers back to the layer. Any difference, and any other kind of pass, takes the full path.
Quantized (4-bit) layers, which rebuild their weight in every pass and never merge, remember their training
passes the same way and repeat the fused NF4 launch of their single adapter while its operands are the same; a
steady training pass launches it itself and multiplies by the weight it gives (:class:`GivenWeightLinear`).
When kernels are short, the host time of a layer call bounds the training step.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..core import passes
from ..core.functional import SparseDeltaLinear, chosen_block, keep_for_backward, values_gradient, values_need_grad
from . import internals


class GivenWeightLinear(SparseDeltaLinear):
    """:class:`SparseDeltaLinear` whose forward pass multiplies by a merged weight the caller built
    (``merged``: a transient (out, in) W + Σ scatter(η_a, φ_a) in the pass's dtype, used once; e.g. a
    4-bit layer's kept fused launch), without autocast and without ``premerged``.
    Backward is :class:`SparseDeltaLinear`'s: it rebuilds the merged weight itself."""

    @staticmethod
    def forward(ctx, x, merged, bias, spec, *indices_and_values):
        dtype = merged.dtype
        x_in = x if x.dtype == dtype else x.to(dtype)  # (..., in)
        y = F.linear(x_in, merged, bias if bias is None or bias.dtype == dtype else bias.to(dtype))  # (..., out)
        del merged, x_in
        ctx.spec, ctx.dtype, ctx.generation = spec, dtype, None
        ctx.x_meta = (x.shape, x.dtype)
        keep_for_backward(ctx, x, getattr(spec[2], "rebuild_inputs", "all"), indices_and_values, values_need_grad(ctx, spec[5]))
        return y

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, *rest = SparseDeltaLinear.backward(ctx, grad_out)
        return (grad_x, None, *rest)


class MergedDeltaLinear(SparseDeltaLinear):
    """:class:`SparseDeltaLinear` for a steady training pass of one adapter merged in place (``premerged``):
    X and the bias already in the stored weight's dtype, autocast off — what the caller checked, so forward
    multiplies by the stored weight without the generic pass's decisions. Arguments are
    :class:`SparseDeltaLinear`'s (``spec``'s ``premerged`` is the merge); backward takes the generic one's
    decisions for these passes in a lean form, and hands over to it for anything else."""

    @staticmethod
    def forward(ctx, x, bias, spec, indices, values):
        merge = spec[4]
        weight = merge.weight  # W + scatter(η, φ): (out, in), in place
        y = F.linear(x, weight, bias)  # (..., out)
        ctx.spec, ctx.dtype, ctx.generation, ctx.x_meta = spec, weight.dtype, merge.generation, (x.shape, x.dtype)
        keep_for_backward(ctx, x, spec[2]._rebuild_inputs, (indices, values), ctx.needs_input_grad[4])  # (its one adapter's values)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        # The steady pass's backward: the generic one's decisions for what forward checked (one adapter,
        # merged in place; X, weight and output of one dtype, so no casts), without its general lookups —
        # this runs once per layer call in the backward pass, whose host time can bound a step. Anything
        # else (an AG window's dense gradients, a bias to differentiate, the merge written back since
        # forward) takes the generic backward.
        spec = ctx.spec
        layer, merge = spec[2], spec[4]
        needs = ctx.needs_input_grad  # (x, bias, spec, indices, values)
        if layer.dense_grad_consumer is not None or needs[1] or not merge.still_merged(ctx.generation) or torch.is_grad_enabled():
            return SparseDeltaLinear.backward(ctx, grad_out)
        x_shape = ctx.x_meta[0]
        in_features = x_shape[-1]
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # G: (tokens, out)
        grad_x = g2.mm(merge.weight).view(x_shape) if needs[0] else None  # (..., in)
        saved = ctx.saved_tensors  # (read in every case, as the generic backward does: autograd's in-place edit check)
        if not needs[4]:
            return grad_x, None, None, None, None
        x, indices, values = saved if ctx.x_saved else (None, *saved)
        method = layer.value_grad_method
        block = chosen_block(spec[3][0] if spec[3] else None, method, g2, in_features, values)
        factors = None
        if x is None:  # rebuilt (ctx.x_rebuild); X = A ⊙ B read only by the block kernel: formed tile by tile
            factors = ctx.x_rebuild.factors() if block is not None else None
            if factors is None:
                x = ctx.x_rebuild.get()
        x2, x2_factor = (f.reshape(-1, in_features) for f in factors) if factors is not None else (x.reshape(-1, in_features), None)
        return grad_x, None, None, None, values_gradient(g2, x2, x2_factor, block, indices, values, method, layer)


sparse_delta_apply = internals.direct_apply(SparseDeltaLinear)
given_weight_apply = internals.direct_apply(GivenWeightLinear)
merged_apply = internals.direct_apply(MergedDeltaLinear, fixed=True)


def remember(layer, active: list, values, indices, blocks: Optional[list], premerged) -> None:
    """Remember a training pass of one adapter without extra arguments that just ran (merged in place, or on a
    quantized layer, never merged: the same call in every pass while nothing above changes) for the next one.
    ``blocks``: the pass's block layouts (None: the layer's current ones)."""
    if len(layer.active_adapters) != 1 or len(active) != 1 or indices.is_inference():
        return
    if blocks is None:
        blocks = [layer.block_metadata(a) for a in active]
    base = layer.get_base_layer()
    current = layer._active_adapter
    current = current if isinstance(current, str) else list(current)  # (a copy: compared by value)
    layer._steady = (current, active[0], values, values.dtype, indices, (internals.version(indices), indices.data_ptr()), base, base.weight,
                     premerged, blocks, base.weight.device.type)  # fmt: skip


def quantized_training_pass(layer, x: torch.Tensor, active: list) -> Optional[torch.Tensor]:
    """The ``"quantized"`` pass of training with gradients: the reference's, remembered for the next pass
    (:func:`remember`). None for any other pass."""
    if not (active and layer.training and torch.is_grad_enabled()):
        return None
    y = passes.linear_pass(layer, x, active, (), {})
    name = active[0]
    remember(layer, active, layer.sparse_values[name], layer.sparse_indices[name], None, None)
    return y


def steady_forward(layer, x: torch.Tensor, active: list) -> Optional[torch.Tensor]:
    """A training pass like the layer's last one: the same single adapter (values, indices, blocks), still merged
    in place and current (or, on a quantized layer, rebuilt as in every pass). Each decision of the full path is
    checked again here, only without its lookups: the host time of a layer call bounds the step when kernels are
    short. Returns the output, or None when the full path must run."""
    steady = layer._steady
    if steady is None:
        return None
    current, name, values, dtype, indices, indices_key, base, weight, merge, blocks, device = steady
    if (
        layer.training
        and layer._active_adapter == current
        and not layer._disable_adapters
        and not layer.merged_adapters
        and layer._training_merge is merge
        and layer._modules["base_layer"] is base
        and base._parameters.get("weight") is weight
        and layer._modules["sparse_values"]._parameters.get(name) is values
        and "bias" not in base.__dict__  # (a bias with its own delta, read through base.bias: the full path)
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
                    return y.to(x.dtype)
                layer._nf4_rebuild = None  # (it did not apply: the generic path plans anew, without checking it again)
            return sparse_delta_apply(x, base._parameters.get("bias"), spec, indices, values).to(x.dtype)
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
                return merged_apply(x, bias, spec, indices, values)  # (the generic pass would make no other decision)
            return sparse_delta_apply(x, bias, spec, indices, values)
    layer._steady = None  # (assigned only when set: nn.Module.__setattr__ costs host time on every pass)
    return None
