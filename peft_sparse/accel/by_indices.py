"""Tensors derived from an adapter's indices alone, kept on the layer while the indices stay as they are.

Between reselections an adapter's indices do not change, yet some passes need them in another form every
step: as int64 positions (what ``take``, ``put_`` and ``index_copy_`` index with on the CPU, :mod:`.transient_merge`)
and as the CSR pattern the CPU value gradient samples at (``kernels.sampled_pattern``, served as
``STEPS.sampled_pattern``). :func:`kept` builds each once and gives it back while the indices tensor is the same
object, at the same address, with the same version counter; the listeners drop everything kept when the core
announces new indices or replaced tensors (an in-place copy under a ``TorchDispatchMode`` can leave the version
counter as it was). What is kept is the size of the indices (d_φ), never of the weight: 8 bytes a position for
the int64 positions and 8 for the pattern (int32 offsets and columns, and the zeros it samples into).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..core import kernels
from . import internals

# entries kept per layer: a few kinds for each of a layer's adapters
_KEPT_PER_LAYER = 8


def kept(layer, idx: torch.Tensor, key: tuple, build: Callable[[torch.Tensor], torch.Tensor]):
    """``build(idx)``, kept on ``layer`` under ``key`` (what it is, e.g. ``("int64",)``) while ``idx`` stays the
    same object, address and version; built each time for a ``layer`` that keeps nothing (gradient hooks that
    are not a sparse layer)."""
    entries = getattr(layer, "_by_indices", None)
    if entries is None:
        return build(idx)
    version, address = internals.version(idx), idx.data_ptr()
    for entry in entries:
        if entry[0] is idx and entry[1] == key and entry[2] == version and entry[3] == address:
            return entry[4]
    value = build(idx)
    others = [e for e in entries if not (e[0] is idx and e[1] == key)]
    layer._by_indices = others[-(_KEPT_PER_LAYER - 1) :] + [(idx, key, version, address, value)]
    return value


def positions(layer, idx: torch.Tensor) -> torch.Tensor:
    """``idx`` as int64 positions (itself when it is int64)."""
    if idx.dtype == torch.int64:
        return idx
    return kept(layer, idx, ("int64",), torch.Tensor.long)


def sampled_pattern(layer, idx: torch.Tensor, out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """``STEPS.sampled_pattern``: the (out, in) CSR pattern of ``idx`` for the CPU value gradient, values of ``dtype``."""

    def build(indices: torch.Tensor) -> torch.Tensor:
        rows, cols = kernels.rows_cols(indices, in_features)
        return kernels.sampled_pattern(rows, cols, out_features, in_features, dtype)

    return kept(layer, idx, ("sampled", out_features, in_features, dtype), build)
