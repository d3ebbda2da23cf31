"""A block adapter's layout (block rows and columns, where each block's elements sit in the values), cached per
adapter until its indices change: a mixin of :class:`peft_sparse.core.layer.SparseLayer`."""

from __future__ import annotations

import torch

from .block_kernels import BlockLayout
from .devices import version
from .selection import BlockGrid


class BlockLayoutLayer:
    def block_metadata(self, adapter_name: str):
        """For a block adapter: its :class:`~peft_sparse.core.block_kernels.BlockLayout` (block rows and
        columns, ascending, and where each block's elements sit in the values); None when unstructured.

        Cached until the indices change (their version counter moves on every in-place edit)."""
        bh, bw = self.block_shape.get(adapter_name, (1, 1))
        if bh * bw == 1:
            return None
        indices = self._modules["sparse_indices"]._buffers[adapter_name]
        cached = self._block_metadata.get(adapter_name)
        if cached is not None and cached[0] == self._indices_key(indices):
            return cached[1]
        blocks = BlockGrid(self.out_features, self.in_features, (bh, bw)).units(indices)
        if blocks.numel() * bh * bw != indices.numel():
            raise ValueError(f"{self.module_name}: indices of adapter {adapter_name!r} are not whole {(bh, bw)} blocks")
        return self.set_block_metadata(adapter_name, blocks)

    @staticmethod
    def _indices_key(indices: torch.Tensor) -> tuple:
        if indices.is_inference():  # (no version counter follows an edit: a key equal to no other, so never cached)
            return (indices.data_ptr(), object(), indices.numel())
        return (indices.data_ptr(), version(indices), indices.numel())

    def cached_block_metadata(self, adapter_name: str):
        """The block layout cached for ``adapter_name`` (None: none), current or not — e.g. to learn which
        kernel plans it used before a reselection replaces it."""
        cached = self._block_metadata.get(adapter_name)
        return cached[1] if cached is not None else None

    def set_block_metadata(self, adapter_name: str, blocks: torch.Tensor, metadata=None):
        """Cache the block layout of the (ascending) active block numbers ``blocks`` (``metadata``: a
        :class:`~peft_sparse.core.block_kernels.BlockLayout` already computed for the current indices, e.g.
        by a batched reselection)."""
        indices = self.sparse_indices[adapter_name]
        if metadata is None:
            metadata = BlockLayout.of_blocks(blocks, self.out_features, self.in_features, self.block_shape[adapter_name])
        self._block_metadata[adapter_name] = (self._indices_key(indices), metadata)
        return metadata
