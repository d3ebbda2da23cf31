"""Batches whose rows use different adapters (PEFT's ``adapter_names`` keyword): a mixin of
:class:`peft_sparse.core.layer.SparseLayer`."""

from __future__ import annotations

from typing import Any

import torch

from .functional import sparse_delta_product


class MixedBatchLayer:
    def _mixed_batch_forward(self, x: torch.Tensor, adapter_names: list, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Row i of the batch gets adapter ``adapter_names[i]``'s delta (``"__base__"``, or an adapter this layer
        does not hold: none): the base output plus each adapter's delta on its rows, from its d_φ entries."""
        if self.merged:
            raise ValueError(f"{self.module_name}: adapter_names needs unmerged adapters; unmerge first")
        if len(adapter_names) != x.shape[0]:
            raise ValueError(f"{self.module_name}: {len(adapter_names)} adapter_names for a batch of {x.shape[0]} rows")
        y = self._mixed_base_output(x, *args, **kwargs)
        rows_of: dict = {}
        for i, name in enumerate(adapter_names):
            if name != "__base__" and name in self.sparse_values:
                rows_of.setdefault(name, []).append(i)
        for name, rows in rows_of.items():
            self._check_ready(name)
            rows = torch.tensor(rows, device=x.device)
            y = y.index_add(0, rows, self._rows_delta(x[rows], name).to(y.dtype))
        return y

    def _mixed_base_output(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.release_training_merge()
        return self.base_layer(x, *args, **kwargs)

    def _rows_delta(self, x_rows: torch.Tensor, name: str) -> torch.Tensor:
        """X_rows · δᵀ of adapter ``name``."""
        return sparse_delta_product(x_rows, [self.sparse_indices[name]], [self.sparse_values[name]], self.out_features)
