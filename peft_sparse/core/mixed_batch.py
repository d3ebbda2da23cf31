"""Batches whose rows use different adapters (PEFT's ``adapter_names`` keyword): a mixin of
:class:`peft_sparse.core.layer.SparseLayer`."""

from __future__ import annotations

from typing import Any

import torch

from .functional import sparse_delta_product


class MixedBatchLayer:
    def _mixed_batch_forward(self, x: torch.Tensor, adapter_names: list, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Row i of the batch gets adapter ``adapter_names[i]``'s delta (``"__base__"``, or an adapter this layer
        does not hold: none): the base output plus X_rows · δᵀ from each adapter's d_φ entries."""
        if self.merged:
            raise ValueError(f"{self.module_name}: adapter_names needs unmerged adapters; unmerge first")
        if len(adapter_names) != x.shape[0]:
            raise ValueError(f"{self.module_name}: {len(adapter_names)} adapter_names for a batch of {x.shape[0]} rows")
        self.release_training_merge()
        y = self._base_forward(x, *args, **kwargs)
        rows_of: dict = {}
        for i, name in enumerate(adapter_names):
            if name != "__base__" and name in self.sparse_values:
                rows_of.setdefault(name, []).append(i)
        for name, rows in rows_of.items():
            self._check_ready(name)
            rows = torch.tensor(rows, device=x.device)
            values = self.sparse_values[name]
            delta = sparse_delta_product(x[rows], [self.sparse_indices[name]], [values], self.out_features)
            y = y.index_add(0, rows, delta.to(y.dtype))
        return y
