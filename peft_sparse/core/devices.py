"""Kernel registries per device type, and the device plumbing every kernel call shares.

The core computes every kernel in torch (the ``*_reference`` functions of :mod:`.kernels` and
:mod:`.block_kernels`); a faster kernel for a device type registers itself in the registry of its
operation and takes over for tensors of that type while the fast paths are on
(:data:`peft_sparse.core.dispatch.ON`). GPU kernels are registered at the first CUDA tensor that asks,
by the loaders in :data:`GPU_KERNEL_LOADERS` (the fast paths put theirs there: no import cost on CPU).

The two torch internals the core reads (a tensor's version counter, the current CUDA device) are in
:mod:`.internals`, each with a fallback.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from . import dispatch
from .internals import current_cuda_device, version  # noqa: F401 (re-exported)

# device type → kernel, one registry per operation (signatures: see the dispatching function in .kernels)
SDDMM_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}  # (grad_out2d, x2d, rows, cols) → (nnz,) float32
BLOCK_SDDMM_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}  # (grad_out2d, x2d, block_rows, block_cols, bh, bw)
BLOCK_SDDMM_INTO_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}  # (grad_out2d, x2d, layout, out, accumulate)
BLOCK_VALUE_GRADIENT_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}  # (grad_out2d, x2d, layout, x_factor, out)
SCATTER_ADD_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}  # (out, indices, values, source) → out
SCATTER_SUM_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}  # (out, indices, base, values) → out
GATHER_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}  # (flat, indices, dtype)
SCALED_PRODUCT_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}  # (scale, full, per_row, dtype)
NF4_COMPOSE_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}  # (packed, code, absmax, nested, blocksize, shape, dtype, indices, values)
TOP_MAGNITUDES_KERNELS: dict[str, Callable[..., tuple]] = {}  # (dense, k, index_dtype) → (indices, values)
TOP_SCALED_MAGNITUDES_KERNELS: dict[str, Callable[..., tuple]] = {}  # (dense, scale, k, index_dtype) → (indices, values)
TOP_BLOCKS_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}  # (keys, k) → ascending block numbers
BLOCK_SCORE_KEYS_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}  # (dense, block_shape) → keys
GATHER_BLOCKS_KERNELS: dict[str, Callable[..., tuple]] = {}  # (dense, units, block_shape, index_dtype) → (layout, indices, values)

# callables that fill the registries above for CUDA (see load_gpu_kernels)
GPU_KERNEL_LOADERS: list[Callable[[], None]] = []
# the Triton kernels' module once a loader found it (its multi-tensor launches and launch plans), else None
TRITON: list = [None]
_GPU_KERNELS_TRIED = False

KERNEL_FLOAT_TYPES = {torch.float32, torch.float16, torch.bfloat16}  # what the Triton kernels compute in float32
REFERENCE_CHUNK_BYTES = 64 * 2**20  # scratch memory the torch references of the sampled products may use per chunk


def load_gpu_kernels() -> None:
    """Run the GPU kernel loaders once, the first time a CUDA tensor asks for a kernel."""
    global _GPU_KERNELS_TRIED
    if _GPU_KERNELS_TRIED:
        return
    _GPU_KERNELS_TRIED = True
    for load in GPU_KERNEL_LOADERS:
        load()


def triton():
    """The Triton kernels' module, or None (no Triton, or no loader)."""
    load_gpu_kernels()
    return TRITON[0]


def device_type(tensor: torch.Tensor) -> str:
    """``tensor.device.type``, without building a device object for a CUDA tensor (calls made once per
    layer and step)."""
    return "cuda" if tensor.is_cuda else tensor.device.type


def kernel_for(registry: dict, tensor: torch.Tensor):
    """The kernel ``registry`` holds for ``tensor``'s device type, or None (then the torch reference
    serves): none while the fast paths are off; the GPU kernels are registered at the first CUDA tensor."""
    if not dispatch.ON:
        return None
    kind = device_type(tensor)
    if kind == "cuda":
        load_gpu_kernels()
    return registry.get(kind)


def power_of_two_blocks(block_shape) -> bool:
    """Whether both sides of the block shape are powers of two (the Triton block kernels' tiles)."""
    return all(v & (v - 1) == 0 for v in block_shape)


def grouped_block_shape(block_shape) -> bool:
    """Whether the grouped Triton block kernel takes blocks of this shape (powers of two, at least 16×16)."""
    return power_of_two_blocks(block_shape) and min(block_shape) >= 16


def dense_block_kernel(registry: dict, dense: torch.Tensor, block_shape):
    """The registered kernel reading blocks of ``dense`` for its device, when the blocks tile as Triton
    tiles and ``dense`` is in a type the kernels read; else None (the torch reference serves)."""
    kernel = kernel_for(registry, dense)
    return kernel if kernel is not None and power_of_two_blocks(block_shape) and dense.dtype in KERNEL_FLOAT_TYPES else None


def gpu_kernel(registry: dict, out: torch.Tensor, *operands: Optional[torch.Tensor]):
    """The registered kernel for ``out``'s device when it applies (contiguous ``out``, operands in types
    the Triton kernels compute in float32), else None."""
    kernel = kernel_for(registry, out)
    dtypes = {t.dtype for t in (out, *operands) if t is not None}
    return kernel if kernel is not None and dtypes <= KERNEL_FLOAT_TYPES and out.is_contiguous() else None


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types and float32, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


# ------------------------------------------------------------------------------------- device plumbing
_SAME_DEVICE = contextlib.nullcontext()  # (stateless: entered again and again)


def on_device(tensor: torch.Tensor):
    """A context making ``tensor``'s GPU the current one (Triton launches on the current device), or a
    no-op when it already is or ``tensor`` is not on a CUDA device."""
    if tensor.is_cuda:  # (no device objects built: this runs around kernel launches in every step)
        index = tensor.get_device()
        if index != current_cuda_device():
            return torch.cuda.device(index)
    return _SAME_DEVICE


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor (a launch plan's or a selection's table) on ``device`` without waiting for
    the device: from pinned memory, copied asynchronously (a copy from pageable memory would
    synchronise the host with every kernel queued before it). Torch's pinned-memory cache keeps the
    source until the copy ran."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def table(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device`` through :func:`to_device_async`."""
    return to_device_async(torch.tensor(values, dtype=dtype), torch.device(device))


# ------------------------------------------------------------------------------------- version counters
def increment_versions(tensors: list) -> None:
    """``torch.autograd.graph.increment_version`` of every tensor: one call for the list where torch
    takes one (2.5 on), else one per tensor."""
    try:
        torch.autograd.graph.increment_version(tensors)
    except TypeError:  # (torch before 2.5: one tensor per call; nothing was bumped)
        for tensor in tensors:
            torch.autograd.graph.increment_version(tensor)
