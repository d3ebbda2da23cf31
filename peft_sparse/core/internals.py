"""The torch internals the core reads, each with a fallback (the fast paths' own are in
:mod:`peft_sparse.accel.internals`): a tensor's version counter, which tells a cached result (a block
layout, a memo) that its inputs changed, the current CUDA device without torch's Python-level check, and the
saved-tensor hooks in force (a wrapped parameter's pass rebuilds what autograd saves of it only under none)."""

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


def current_saved_tensor_hooks():
    """The innermost ``(pack, unpack)`` of ``torch.autograd.graph.saved_tensors_hooks`` in force, None when none
    is — or False where torch does not tell (then assume some are)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return False
    try:
        return top(False)
    except (RuntimeError, TypeError):
        return False
