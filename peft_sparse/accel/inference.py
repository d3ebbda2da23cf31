"""Passes without gradients (generation, evaluation) on the fast paths (a memo of the ``"linear"`` and ``"quantized"``
passes): Y = base(X) + X·δᵀ with δ kept per layer as one CSR matrix with 32-bit indices (kept with the full path's,
one copy: the ``delta_matrices`` step), and the decisions of the reference pass checked again here without its lookups. At decode (one token) the product is a sparse matrix-vector product: host time per layer call is
what bounds batch-1 generation, so the checks are attribute reads only. The plain path builds the same product
from the entries on every call (:func:`peft_sparse.core.functional.sparse_delta_product`)."""

from __future__ import annotations

from typing import Optional

import torch

from ..core import dispatch, kernels
from ..core.functional import delta_matrix
from . import internals

_SPARSE_DTYPES = {"cpu": (torch.float32, torch.float64)}  # CPU sparse products have no 16-bit kernels


class _Memo:
    __slots__ = ("active", "name", "count", "values", "values_key", "indices", "indices_key", "dtype", "csr", "nnz")


def inference_forward(layer, x: torch.Tensor, active: list) -> Optional[torch.Tensor]:
    """The layer's output for a pass without gradients, or None where the full path must decide (gradients,
    several adapters, a training merge in place, a dtype without sparse kernels, or more tokens than the cost
    model gives the product)."""
    if len(active) != 1 or torch.is_grad_enabled():
        return None
    tokens = x.numel() // layer.in_features if x.dim() else 0
    memo = layer._inference_memo
    if memo is None or not _current(layer, memo):
        memo = layer._inference_memo = _remember(layer, x, tokens)
        if memo is None:
            return None
    if x.device != memo.csr.device or not _serves(layer, x, tokens, memo.nnz):
        return None  # (the full path: W + δ rebuilt, where that is cheaper)
    return add_delta(memo.csr, x, base_output(layer._modules["base_layer"], x), tokens, layer.in_features)


def base_output(base, x: torch.Tensor) -> torch.Tensor:
    """The base layer's output: ``F.linear`` itself for a plain ``nn.Linear`` that no hook watches (the module
    call's own host time is a share of a one-token pass), else the module call."""
    if type(base) is torch.nn.Linear and not internals.module_hooks_anywhere(base):
        return torch.nn.functional.linear(x, base.weight, base.bias)
    return base(x)


def _serves(layer, x: torch.Tensor, tokens: int, nnz: int) -> bool:
    """Whether the cost model gives this pass the product from δ's entries (the full path's own decision)."""
    return kernels.COST_MODEL.choose_inference(x, tokens, layer.out_features, layer.in_features, nnz) == "sparse"


def add_delta(csr: torch.Tensor, x: torch.Tensor, y: torch.Tensor, tokens: int, in_features: int) -> torch.Tensor:
    """Y + X·δᵀ: a matrix-vector product for one token (added in place where Y holds it), a sparse × dense
    product for more."""
    if tokens == 1:
        if x.dtype is csr.dtype and y.dtype is csr.dtype and y.is_contiguous():
            y.view(-1).addmv_(csr, x.reshape(-1))  # (one call: Y += δ·x)
            return y
        return y + torch.mv(csr, x.reshape(-1).to(csr.dtype)).reshape(y.shape).to(y.dtype)
    x2 = x.reshape(tokens, in_features).to(csr.dtype)
    return y + torch.sparse.mm(csr, x2.t()).t().reshape(y.shape).to(y.dtype)


def _current(layer, memo: _Memo) -> bool:
    values, indices = memo.values, memo.indices
    return (
        layer._active_adapter == memo.active
        and not layer._disable_adapters
        and not layer.merged_adapters
        and layer._training_merge is None
        and len(layer._modules["sparse_values"]._parameters) == memo.count
        and layer._modules["sparse_values"]._parameters.get(memo.name) is values
        and layer._ready.get(memo.name) is values
        and values.dtype is memo.dtype
        and (internals.version(values), values.data_ptr()) == memo.values_key
        and layer._modules["sparse_indices"]._buffers.get(memo.name) is indices
        and (internals.version(indices), indices.data_ptr()) == memo.indices_key
    )


def _remember(layer, x: torch.Tensor, tokens: int) -> Optional[_Memo]:
    """A memo of the single active adapter's delta, where the full path would take the sparse product."""
    if layer._disable_adapters or layer.merged_adapters or layer._training_merge is not None:
        return None
    values_of, indices_of = layer.sparse_values, layer.sparse_indices
    active = [a for a in layer.active_adapters if a in values_of]
    if len(active) != 1:
        return None
    name = active[0]
    values, indices = values_of[name], indices_of[name]
    if not _serves(layer, x, tokens, values.numel()):
        return None  # (not built for a pass the product would not serve)
    if layer._ready.get(name) is not values or values.dtype != layer.values_dtype[name]:
        layer._check_ready(name)  # (as the full path would)
        values = values_of[name]
    if values.is_inference() or indices.is_inference():
        return None  # (no version counter follows their edits)
    if layer.quantization_backend is None and layer.get_base_layer().weight.requires_grad:
        return None
    if values.dtype not in _SPARSE_DTYPES.get(values.device.type, (values.dtype,)) or not x.dtype.is_floating_point:
        return None
    kept = kept_delta_matrices(layer, [name], [indices], [values])
    if kept is None:
        return None
    memo = _Memo()
    memo.active = layer._active_adapter if isinstance(layer._active_adapter, str) else list(layer._active_adapter)
    memo.name, memo.count, memo.dtype, memo.csr, memo.nnz = name, len(values_of), values.dtype, kept[0], values.numel()
    memo.values, memo.values_key = values, (internals.version(values), values.data_ptr())
    memo.indices, memo.indices_key = indices, (internals.version(indices), indices.data_ptr())
    return memo


def kept_delta_matrices(layer, active: list, indices: list, values: list) -> Optional[list]:
    """The adapters' deltas as CSR matrices (32-bit indices where they fit), kept in ``layer._delta_csr`` while
    their indices and values are unchanged: the one copy both the memo above and the full path's
    :func:`~peft_sparse.core.functional.sparse_delta_product` use. None when the fast paths are off: the product
    then builds them."""
    if not dispatch.ON:
        return None
    cache = layer._delta_csr
    out = []
    for name, idx, val in zip(active, indices, values):
        if idx.is_inference() or val.is_inference():
            return None  # (no version counter follows their edits)
        key = (idx.data_ptr(), internals.version(idx), val.data_ptr(), internals.version(val), val.dtype, val.device)
        kept = cache.get(name)
        if kept is None or kept[0] != key or kept[1] is not idx or kept[2] is not val:
            kept = (key, idx, val, _csr32(delta_matrix(idx, val.detach(), layer.out_features, layer.in_features)))
            cache[name] = kept
        out.append(kept[3])
    return out


def _csr32(csr: torch.Tensor) -> torch.Tensor:
    """The same CSR matrix with 32-bit row and column indices where the matrix allows them (faster products)."""
    if csr.shape[0] * csr.shape[1] >= 2**31:
        return csr
    crow, cols = csr.crow_indices().to(torch.int32), csr.col_indices().to(torch.int32)
    return torch.sparse_csr_tensor(crow, cols, csr.values(), csr.shape, check_invariants=False)
