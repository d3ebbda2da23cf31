"""Registers the Triton kernels with the core's kernel registries, for CUDA tensors, at their first use.

The core (:mod:`peft_sparse.core.kernels`) holds the registries and the torch references and never imports
the fast paths; this module, imported with the package, hands it a loader. Without Triton the loader
registers nothing and the references serve everywhere.
"""

from __future__ import annotations

from ..core import kernels


def _register_triton_kernels() -> None:
    try:
        from . import triton_kernels
    except ImportError:  # no Triton: the torch references serve
        return
    kernels.TRITON[0] = triton_kernels
    registries = [
        (kernels.SDDMM_KERNELS, triton_kernels.sddmm),
        (kernels.BLOCK_SDDMM_KERNELS, triton_kernels.block_sddmm),
        (kernels.BLOCK_SDDMM_INTO_KERNELS, triton_kernels.block_sddmm_into),
        (kernels.BLOCK_VALUE_GRADIENT_KERNELS, triton_kernels.block_value_gradient),
        (kernels.SCATTER_ADD_KERNELS, triton_kernels.scatter_add_into),
        (kernels.SCATTER_SUM_KERNELS, triton_kernels.scatter_sum_into),
        (kernels.GATHER_KERNELS, triton_kernels.gather_as),
        (kernels.SCALED_PRODUCT_KERNELS, triton_kernels.scaled_product),
        (kernels.NF4_COMPOSE_KERNELS, triton_kernels.nf4_compose),
        (kernels.BLOCK_SCORE_KEYS_KERNELS, triton_kernels.block_score_keys),
        (kernels.GATHER_BLOCKS_KERNELS, triton_kernels.gather_blocks),
        (kernels.TOP_MAGNITUDES_KERNELS, triton_kernels.top_magnitudes),
        (kernels.TOP_BLOCKS_KERNELS, triton_kernels.top_blocks),
    ]
    for registry, kernel in registries:
        registry.setdefault("cuda", kernel)


if _register_triton_kernels not in kernels.GPU_KERNEL_LOADERS:
    kernels.GPU_KERNEL_LOADERS.append(_register_triton_kernels)
