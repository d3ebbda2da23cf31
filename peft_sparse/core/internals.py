"""The two torch internals the core reads, each with a fallback (the fast paths' own are in
:mod:`peft_sparse.accel.internals`): a tensor's version counter, which tells a cached result (a block
layout, a memo) that its inputs changed, and the current CUDA device without torch's Python-level check."""

from __future__ import annotations

import torch


def version(tensor: torch.Tensor):
    """``tensor._version`` (moves on with every in-place edit), or an object equal to nothing (never a match
    for a kept key) where the counter is missing — and for inference tensors, which have none."""
    try:
        return tensor._version
    except (AttributeError, RuntimeError):
        return object()


# torch.cuda.current_device() without its Python-level initialisation check (a CUDA tensor exists, so CUDA is
# initialised); the public call where the entry point is missing
current_cuda_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
