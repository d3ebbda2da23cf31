"""Registers the Triton kernels with the core's kernel registries, for CUDA tensors, at their first use.

The core (:mod:`peft_sparse.core.devices`) holds the registries, :mod:`peft_sparse.core.kernels` the torch
references, and neither imports the fast paths; this module, imported with them, hands the core a loader.
Without Triton the loader registers nothing and the references serve everywhere.
"""

from __future__ import annotations

from ..core import devices


def _register_triton_kernels() -> None:
    try:
        from . import triton_kernels
    except ImportError:  # no Triton: the torch references serve
        return
    devices.TRITON[0] = triton_kernels
    registries = [
        (devices.SDDMM_KERNELS, triton_kernels.sddmm),
        (devices.BLOCK_SDDMM_KERNELS, triton_kernels.block_sddmm),
        (devices.BLOCK_SDDMM_INTO_KERNELS, triton_kernels.block_sddmm_into),
        (devices.BLOCK_VALUE_GRADIENT_KERNELS, triton_kernels.block_value_gradient),
        (devices.SCATTER_ADD_KERNELS, triton_kernels.scatter_add_into),
        (devices.SCATTER_SUM_KERNELS, triton_kernels.scatter_sum_into),
        (devices.GATHER_KERNELS, triton_kernels.gather_as),
        (devices.SCALED_PRODUCT_KERNELS, triton_kernels.scaled_product),
        (devices.NF4_COMPOSE_KERNELS, triton_kernels.nf4_compose),
        (devices.BLOCK_SCORE_KEYS_KERNELS, triton_kernels.block_score_keys),
        (devices.GATHER_BLOCKS_KERNELS, triton_kernels.gather_blocks),
        (devices.TOP_MAGNITUDES_KERNELS, triton_kernels.top_magnitudes),
        (devices.TOP_SCALED_MAGNITUDES_KERNELS, triton_kernels.top_scaled_magnitudes),
        (devices.TOP_BLOCKS_KERNELS, triton_kernels.top_blocks),
    ]
    for registry, kernel in registries:
        registry.setdefault("cuda", kernel)


if _register_triton_kernels not in devices.GPU_KERNEL_LOADERS:
    devices.GPU_KERNEL_LOADERS.append(_register_triton_kernels)
