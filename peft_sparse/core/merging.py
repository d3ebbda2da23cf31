"""Merging a sparse layer's adapters into its base weight and back (PEFT's ``merge`` / ``unmerge``), and the dense
views of its deltas: a mixin of :class:`peft_sparse.core.layer.SparseLayer`."""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from peft.tuners.tuners_utils import check_adapters_to_merge

from .base import add_delta_to_base, storage_positions
from .functional import compose_weight


class MergeLayer:
    def get_delta_weight(self, adapter_name: str) -> torch.Tensor:
        """The dense (out, in) delta scatter(η, φ) of one adapter, in the values' dtype."""
        values = self.sparse_values[adapter_name]
        delta = torch.zeros(self.numel, dtype=values.dtype, device=values.device)
        delta.index_add_(0, self.sparse_indices[adapter_name], values.detach())
        return delta.view(self.out_features, self.in_features)

    def merge(self, safe_merge: bool = False, adapter_names: Optional[list[str]] = None) -> None:
        self.release_training_merge()
        adapter_names = check_adapters_to_merge(self, adapter_names)
        for name in adapter_names:
            if name in self.sparse_values:
                self._check_ready(name)
                self.add_scaled_delta(name, 1.0, safe=safe_merge, keep_backup=True)
                self.merged_adapters.append(name)

    def unmerge(self) -> None:
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            if name not in self.sparse_values:
                continue
            backup = self._merge_backup.pop(name, None)
            if backup is not None:  # float weights: restore the exact pre-merge values
                base = self.get_base_layer()
                base.weight.data.view(-1)[storage_positions(base, self.sparse_indices[name])] = backup
            else:
                self.add_scaled_delta(name, -1.0)

    def add_scaled_delta(self, adapter_name: str, scale: float, safe: bool = False, keep_backup: bool = False) -> None:
        """θ ← θ + scale·scatter(η, φ) in the base layer's own storage (requantized for 4-bit)."""
        backup = add_delta_to_base(
            self,
            self.sparse_indices[adapter_name],
            self.sparse_values[adapter_name].detach(),
            scale,
            safe=safe,
            what=f"adapter {adapter_name}",
        )
        if keep_backup and backup is not None:
            self._merge_backup[adapter_name] = backup

    def merged_weight(self, adapter_names: Optional[list[str]] = None) -> torch.Tensor:
        """W + Σ scatter(η, φ) over the given (default: active) adapters, as a new (out, in) tensor."""
        names = adapter_names if adapter_names is not None else [a for a in self.active_adapters if a in self.sparse_values]
        weight = self.logical_weight()
        return compose_weight(
            weight,
            [self.sparse_indices[a] for a in names],
            [self.sparse_values[a].detach() for a in names],
            weight.dtype,
            owned=self.quantization_backend is not None,
        )
