r"""Sparse deltas over input embeddings (``nn.Embedding``): thesis §4.4.2 trains them in language SFTs.

.. math::
    Y_t = \big(E + \mathrm{scatter}(\eta, \phi)\big)[\,\mathrm{ids}_t\,] = E[\mathrm{ids}_t] + \delta[\mathrm{ids}_t]

with E the frozen (num_embeddings, embedding_dim) table and η flat row-major indices into it, exactly as for a
linear layer's (out, in) weight. A pass touches only the rows of the batch's distinct tokens U:

* forward scatters the active entries that fall in those rows into a (|U|, H) block and gathers it per token;
* backward sums ∂L/∂Y per distinct token, G = Σ_{t: ids_t = u} ∂L/∂Y_t (|U|, H), and reads each active entry
  η_j = (r_j, c_j) from it: ∂L/∂φ_j = G[r_j, c_j] when r_j ∈ U, else 0.

So a step costs O(tokens·H + d_φ) and never forms a (V, H) gradient — except inside a SpIEL gradient-estimation
window, whose consumer asks for the dense ∂L/∂E (built from the same sum, then freed). ``padding_idx``'s row
gets no gradient, as ``nn.Embedding`` gives it none.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional

import torch
from torch import nn

from . import dispatch
from .base import supported_embedding, unsupported_embedding_reason  # noqa: F401 (re-exported)
from .layer import SparseLayer


_LORA_EMBEDDING_FACTORS = contextvars.ContextVar("lora_embedding_factors", default=False)


@contextlib.contextmanager
def lora_embedding_factors() -> Iterator[None]:
    """Inside: sparse embeddings report ``supports_lora_conversion()``, for a caller that renames their factors into
    LoRA's embedding layout (:func:`peft_sparse.convert_to_lora`). Outside they do not: PEFT's own ``convert_to_lora``
    writes every factor as ``lora_A.weight`` / ``lora_B.weight``, which LoRA's embedding layer does not load."""
    token = _LORA_EMBEDDING_FACTORS.set(True)
    try:
        yield
    finally:
        _LORA_EMBEDDING_FACTORS.reset(token)


class SparseEmbeddingDelta(torch.autograd.Function):
    """δ[ids] for one adapter: (…,) token ids → (…, H), differentiable in the values only (module docstring)."""

    @staticmethod
    def forward(ctx, ids, indices, values, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int], hooks):
        flat = ids.reshape(-1)  # (tokens,)
        used, inverse = torch.unique(flat, return_inverse=True)  # U sorted (|U|,), (tokens,)
        idx = indices.long()
        rows, cols = idx // embedding_dim, idx % embedding_dim  # (d_φ,)
        slot = torch.searchsorted(used, rows).clamp_max_(used.numel() - 1)  # where row r_j would sit in U
        hit = used[slot] == rows  # (d_φ,) active entries in a looked-up row
        block = values.new_zeros(used.numel(), embedding_dim)  # (|U|, H)
        block[slot[hit], cols[hit]] = values[hit]
        ctx.save_for_backward(flat, inverse, slot, hit, cols, rows)
        ctx.meta = (used.numel(), num_embeddings, embedding_dim, padding_idx, values.dtype)
        ctx.hooks = hooks
        return block[inverse].view(*ids.shape, embedding_dim)

    @staticmethod
    def backward(ctx, grad_out):
        flat, inverse, slot, hit, cols, rows = ctx.saved_tensors
        n_used, num_embeddings, embedding_dim, padding_idx, dtype = ctx.meta
        g = grad_out.reshape(-1, embedding_dim).float()  # (tokens, H)
        per_row = g.new_zeros(n_used, embedding_dim).index_add_(0, inverse, g)  # G (|U|, H)
        hooks = ctx.hooks
        consumer = getattr(hooks, "dense_grad_consumer", None)
        if consumer is not None:  # a gradient-estimation window: the dense ∂L/∂E, formed once and freed on return
            dense = g.new_zeros(num_embeddings, embedding_dim).index_add_(0, flat, g)
            if padding_idx is not None:
                dense[padding_idx] = 0
            hooks.dense_grad_count += 1
            consumer(hooks, dense)
            del dense
        grad_values = torch.zeros(hit.numel(), dtype=torch.float32, device=g.device)
        grad_values[hit] = per_row[slot[hit], cols[hit]]
        if padding_idx is not None:
            grad_values[rows == padding_idx] = 0
        return None, None, grad_values.to(dtype), None, None, None, None


def sparse_embedding_delta(ids: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, base: nn.Embedding, hooks=None) -> torch.Tensor:
    """δ[ids] of one adapter over the embedding ``base`` (see :class:`SparseEmbeddingDelta`)."""
    return SparseEmbeddingDelta.apply(ids, indices, values, base.num_embeddings, base.embedding_dim, base.padding_idx, hooks)


def embedding_pass(layer, x: torch.Tensor, active: list, args: tuple, kwargs: dict) -> torch.Tensor:
    """The reference pass of a ``SparseEmbedding`` (module docstring): ids (…,) → E[ids] + Σ_a δ_a[ids] (…, H)."""
    y = layer.base_layer(x, *args, **kwargs)  # E[ids]: (…, H)
    base = layer.get_base_layer()
    for name in active:
        delta = sparse_embedding_delta(x, layer.sparse_indices[name], layer.sparse_values[name], base, hooks=layer)  # (…, H)
        y = y + delta.to(y.dtype)
    return y


class SparseEmbedding(nn.Module, SparseLayer):
    """Sparse adapter around ``nn.Embedding``: the base lookup plus each active adapter's δ[ids].

    Merging, unmerging, saving and composition are the core's (the table is an (out=V, in=H) matrix to them);
    the fast paths of linear layers (training merge, fused kernels) do not apply to lookups."""

    base_kind = "embedding"
    __getstate__ = SparseLayer.__getstate__

    def __init__(self, base_layer: nn.Module, module_name: str) -> None:
        super().__init__()
        SparseLayer.__init__(self, base_layer, module_name)

    forward = SparseLayer.forward
    train = SparseLayer.train
    _apply = SparseLayer._apply
    _replicate_for_data_parallel = SparseLayer._replicate_for_data_parallel
    __repr__ = SparseLayer.__repr__

    def supports_lora_conversion(self, adapter_name: str = "default") -> bool:
        """Only inside :func:`lora_embedding_factors` (see there): LoRA's embeddings answer False to PEFT for the same
        reason."""
        return _LORA_EMBEDDING_FACTORS.get()

    def _rows_delta(self, x_rows: torch.Tensor, name: str) -> torch.Tensor:
        return sparse_embedding_delta(x_rows, self.sparse_indices[name], self.sparse_values[name], self.get_base_layer())


dispatch.register_kind("embedding", embedding_pass)
