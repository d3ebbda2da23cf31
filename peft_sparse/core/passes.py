r"""The reference pass of a linear layer (``"linear"`` and ``"quantized"`` base kinds, see :mod:`.dispatch`):

.. math::
    Y = X\,\big(W + \textstyle\sum_a \mathrm{scatter}(\eta_a, \phi_a)\big)^\top + b \qquad \text{(thesis Eq. 7.2, 7.8)}

over the active adapters a, with W the base weight as (out, in) — dequantized per pass for a 4-bit weight —
and W + δ built transiently in forward and again in backward (:class:`~.functional.SparseDeltaLinear`).
Without gradients and with few tokens the delta is applied from its d_φ entries instead,
Y = X·Wᵀ + b + X·δᵀ, where the cost model finds that cheaper than a weight-sized W + δ.
"""

from __future__ import annotations

import torch

from . import dispatch, kernels
from .base import gather_partitioned_base
from .functional import sparse_delta_linear, sparse_delta_linear_reference, sparse_delta_product


def linear_pass(layer, x: torch.Tensor, active: list, args: tuple, kwargs: dict) -> torch.Tensor:
    """The reference pass of ``layer`` (a ``SparseLinear``) over ``x`` (..., in) → (..., out) with the adapters
    ``active`` (their tensors checked: ``layer.check_ready``); the base layer's own pass when none is (adapters
    disabled, or none of this layer's active)."""
    if not active:
        layer.release_training_merge()
        return layer.base_layer(x, *args, **kwargs)
    base = layer.get_base_layer()
    if not base.weight.numel() and hasattr(base.weight, "ds_id"):  # partitioned by DeepSpeed ZeRO-3, not gathered
        gather_partitioned_base(layer, base)
    indices = [layer.sparse_indices[a] for a in active]  # η_a: (d_φ,) each
    values = [layer.sparse_values[a] for a in active]  # φ_a: (d_φ,) each
    quantized = layer.quantization_backend is not None
    if not quantized and base.weight.requires_grad:
        # the base weight itself is being trained: plain autograd keeps what it needs
        return sparse_delta_linear_reference(x, layer.logical_weight(), base.bias, indices, values)
    if not torch.is_grad_enabled() and not args and not kwargs and _delta_from_entries(layer, x, values):
        # no backward pass can follow (generation, evaluation): Y = X·Wᵀ + b + X·δᵀ from δ's d_φ entries
        layer.release_weight_merge()
        y = layer.base_layer(x)  # (..., out)
        kept = dispatch.STEPS.delta_matrices if dispatch.ON else None
        matrices = kept(layer, active, indices, values) if kept is not None else None
        delta = sparse_delta_product(x, indices, values, layer.out_features, matrices)  # (..., out)
        return y + delta.to(y.dtype)
    layer.release_weight_merge()
    blocks = [layer.block_metadata(a) for a in active]  # block adapters' layouts (None: unstructured)
    y = sparse_delta_linear(x, layer._stored_weight, base.bias, indices, values, hooks=layer, owned=quantized, blocks=blocks)
    return y.to(x.dtype) if quantized else y


def _delta_from_entries(layer, x: torch.Tensor, values: list) -> bool:
    """Whether the cost model applies the delta from its entries in a pass without gradients (few tokens)."""
    nnz = sum(v.numel() for v in values)
    tokens = x.numel() // max(1, x.shape[-1])
    return kernels.COST_MODEL.choose_inference(x, tokens, layer.out_features, layer.in_features, nnz) == "sparse"
