"""Merging a sparse layer's adapters into its base weight and back (PEFT's ``merge`` / ``unmerge``), and the dense
views of its deltas: a mixin of :class:`peft_sparse.core.layer.SparseLayer`."""

from __future__ import annotations

import contextlib
import warnings
from typing import Optional

import torch
from peft.tuners.tuners_utils import check_adapters_to_merge

from .base import add_delta_to_base, managed_by_sharding, storage_positions
from .functional import compose_weight


class MergeLayer:
    def logical_delta(self, adapter_name: str) -> torch.Tensor:
        """The dense delta scatter(η, φ) of one adapter as a logical (out, in) matrix, in the values' dtype; zero where
        the layer does not hold the adapter (its outputs do not change)."""
        values = self.sparse_values.get(adapter_name)
        if values is None:
            return torch.zeros(self.out_features, self.in_features, device=self._base_device())
        delta = torch.zeros(self.numel, dtype=values.dtype, device=values.device)
        delta.index_add_(0, self.sparse_indices[adapter_name], values.detach())
        return delta.view(self.out_features, self.in_features)

    def get_delta_weight(self, adapter_name: str) -> torch.Tensor:
        """PEFT's contract: the dense delta of one adapter in the layout of the base layer's weight, W' = W + ΔW —
        (out, in) for ``nn.Linear`` and 4-bit layers (as LoRA's), (in, out) for GPT-2 ``Conv1D``, (num_embeddings, dim)
        for embeddings. PEFT's ``convert_to_lora`` factorizes it by a truncated SVD; it is exact, only the SVD is lossy."""
        delta = self.logical_delta(adapter_name)
        return delta.t() if self.fan_in_fan_out else delta

    def supports_lora_conversion(self, adapter_name: str = "default") -> bool:
        """A linear layer's sparse delta is additive, W' = W + ΔW, so PEFT's ``convert_to_lora`` can factor it into a
        LoRA (``lora_B @ lora_A`` = ΔW up to the rank asked for). Embeddings answer False (:class:`SparseEmbedding`)."""
        return True

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


@contextlib.contextmanager
def merged_for_inference(model):
    """Generate (or evaluate) at the base model's speed with adapters that stay unmerged outside the block::

        with peft_sparse.merged_for_inference(model):
            out = model.generate(**inputs)

    Every sparse layer's active adapters are merged into its float base weight in place — the d_φ entries they
    overwrite are kept — and written back bit for bit when the block ends, also on an error: O(d_φ) memory, not a
    weight-sized copy, and each pass inside is the base layer's own (outputs equal the merged model's). The block runs
    under ``torch.no_grad()`` (a merged adapter gets no gradient). Left unmerged, and computed from δ's entries as
    outside the block: 4-bit layers (requantizing would not restore them bit for bit), base weights a sharding
    wrapper manages (FSDP, DeepSpeed ZeRO-3), layers already merged, and layers whose weight another module shares.
    Not for ``adapter_names`` mixed batches (they need unmerged adapters). Yields the layers it merged."""
    merged = []
    try:
        with torch.no_grad():
            for layer in model.modules():
                if not isinstance(layer, MergeLayer) or layer.merged or layer.quantization_backend is not None:
                    continue
                active = [a for a in layer.active_adapters if a in layer.sparse_values]
                if not active or layer.disable_adapters:
                    continue
                weight = layer.get_base_layer().weight
                if (managed_by_sharding(weight) or not weight.dtype.is_floating_point or weight.device.type == "meta"
                        or (weight.is_inference() and not torch.is_inference_mode_enabled())
                        or layer._weight_is_shared(weight)):  # fmt: skip
                    continue
                merged.append(layer)  # (first: a merge that fails half-way is still undone)
                layer.merge(adapter_names=active)
            yield merged
    finally:
        for layer in reversed(merged):
            if layer.merged:
                layer.unmerge()
