"""The kernels of the sparse core: scatter W + δ, the value gradient, gathers, and the 4-bit weight.

Value gradient of a sparse delta: ∂L/∂φ_j = (∂L/∂Y)ᵀ·X at (r_j, c_j) (thesis App. E.4, Eq. E.5). Two ways to
get it, chosen per call by :func:`value_gradient` (the cost model, :mod:`.cost_model`):

* ``"dense"`` — form dW = (∂L/∂Y)ᵀ X with one GEMM, gather the active entries, free dW. Cheap when
  the GEMM is efficient and the layer is small; transiently allocates one (out, in) tensor.
* ``"sddmm"`` — a sampled dense-dense product: one dot product over tokens per active index, never
  forming dW. :func:`sddmm_reference` is the portable torch version (chunked so its scratch memory is
  bounded); a GPU kernel registered for its device type takes over.

Every operation here has a torch reference (``*_reference``) and a registry of faster kernels per device type
(:mod:`.devices`), used while the fast paths are on. Block adapters' products live in :mod:`.block_kernels`;
this module also re-exports them, the registries and the cost model, so ``kernels.X`` names every kernel.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from . import devices
from .block_kernels import (  # noqa: F401 (re-exported: kernels.X names every kernel)
    BlockLayout,
    block_score_keys,
    block_score_keys_reference,
    block_sddmm,
    block_sddmm_into,
    block_sddmm_into_reference,
    block_sddmm_reference,
    block_value_gradient,
    carry_launches,
    gather_blocks,
    gather_blocks_reference,
    prepare_block_plans,
    top_blocks,
    top_blocks_reference,
)
from .cost_model import COST_MODEL, CostModel  # noqa: F401 (re-exported)
from .devices import (  # noqa: F401 (re-exported)
    BLOCK_SCORE_KEYS_KERNELS,
    BLOCK_SDDMM_INTO_KERNELS,
    BLOCK_SDDMM_KERNELS,
    BLOCK_VALUE_GRADIENT_KERNELS,
    GATHER_BLOCKS_KERNELS,
    GATHER_KERNELS,
    GPU_KERNEL_LOADERS,
    KERNEL_FLOAT_TYPES,
    NF4_COMPOSE_KERNELS,
    SCALED_PRODUCT_KERNELS,
    SCATTER_ADD_KERNELS,
    SCATTER_SUM_KERNELS,
    SDDMM_KERNELS,
    TOP_BLOCKS_KERNELS,
    TOP_MAGNITUDES_KERNELS,
    TOP_SCALED_MAGNITUDES_KERNELS,
    TRITON,
    accumulation_dtype,
    device_type,
    gpu_kernel,
    increment_versions,
    kernel_for,
    load_gpu_kernels,
    on_device,
    table,
    to_device_async,
    triton,
    version,
)
from .selection import top_k_set


def scatter_sum_reference(out: torch.Tensor, indices: torch.Tensor, base: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``out.view(-1)[indices] = base + values.to(out.dtype)`` — an add and a scatter: indices
    are distinct, so no atomics (which for 16-bit types are compare-and-swap loops that contend
    wherever active weights sit side by side)."""
    out.view(-1).index_put_((indices,), base + values.to(out.dtype))
    return out


def scatter_add_reference(
    out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, source: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``out`` ← ``source`` (converted; when given), then ``out.view(-1)[indices] += values.to(out.dtype)``."""
    if source is not None:
        out.copy_(source.reshape(out.shape))
    return scatter_sum_reference(out, indices, out.view(-1)[indices], values)


def scatter_add_into(
    out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, source: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """:func:`scatter_add_reference` for sorted distinct indices into a contiguous ``out``; on CUDA one
    fused Triton launch (copy and scatter together) instead of five torch operations."""
    kernel = gpu_kernel(SCATTER_ADD_KERNELS, out, values, source)
    if kernel is None:
        return scatter_add_reference(out, indices, values, source)
    with on_device(out):
        return kernel(out, indices, values, source)


def scatter_sum_into(out: torch.Tensor, indices: torch.Tensor, base: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """:func:`scatter_sum_reference` with ``base`` in ``out``'s dtype: the merged weight's entries at the
    indices, rounded exactly as :func:`scatter_add_into` rounds them when ``base`` holds the weight's
    values there. On CUDA one Triton launch."""
    kernel = gpu_kernel(SCATTER_SUM_KERNELS, out, values)
    if kernel is not None:
        with on_device(out):
            kernel(out.view(-1), indices, base, values)
        return out
    return scatter_sum_reference(out, indices, base, values)


# (device, element types) → the last multi-tensor scatter plan for such a group (kept while its tensors stay put)
_MULTI_SCATTER_PLANS: dict = {}


def scatter_sum_many(outs, indices, bases, values) -> Optional[list]:
    """:func:`scatter_sum_into` for each ``(outs[k], indices[k], bases[k], values[k])``; on CUDA one Triton
    launch per group of tensors of the same device and element types, not one per tensor. ``values``
    None: ``outs[k].view(-1)[indices[k]] = bases[k]`` exactly (bases in the outputs' dtype).

    Returns the launches made, ``(plan, an empty tensor on its device)`` each — calling ``plan()`` on
    that device repeats its group's writes while no tensor moved (``plan.key``); neither holds the
    tensors — when every tensor took one of them; else None."""
    groups: dict = {}
    alone = []  # on the per-tensor path: no multi-tensor kernel for the device, or a group of one
    for k, out in enumerate(outs):
        value = values[k] if values is not None else None
        if gpu_kernel(SCATTER_SUM_KERNELS, out, value, bases[k]) is None:
            alone.append(k)
            continue
        key = (out.device, out.dtype, indices[k].dtype, bases[k].dtype, value.dtype if value is not None else None)
        groups.setdefault(key, []).append(k)
    for key in [key for key, ks in groups.items() if len(ks) == 1]:
        alone += groups.pop(key)
    for k in alone:
        if values is None:
            outs[k].view(-1).index_put_((indices[k],), bases[k])
        else:
            scatter_sum_into(outs[k], indices[k], bases[k], values[k])
    if not groups:
        return None
    MultiScatterSum = triton().MultiScatterSum  # (grouped only where a CUDA kernel is registered)

    launches = []
    for key, ks in groups.items():
        vals = [values[k] for k in ks] if values is not None else None
        args = ([outs[k].view(-1) for k in ks], [indices[k] for k in ks], [bases[k] for k in ks], vals)
        plan = _MULTI_SCATTER_PLANS.get(key)
        with on_device(args[0][0]):
            if plan is None or plan.key != MultiScatterSum.key_of(*args):
                plan = _MULTI_SCATTER_PLANS[key] = MultiScatterSum(*args)
            plan()
        launches.append((plan, torch.empty(0, device=args[0][0].device)))
    return None if alone else launches



def nf4_dequantize_reference(packed, code, absmax, nested, blocksize: int, shape, dtype) -> torch.Tensor:
    """bitsandbytes' NF4 dequantization in torch: element e is code[nibble e] · absmax[e // blocksize], the
    high nibble of each byte first; ``nested`` = (quantized absmax, absmax2, code2, blocksize2, offset) of
    double quantization gives absmax = code2[q] · absmax2[b // blocksize2] + offset. float32, rounded once."""
    numel = shape[0] * shape[1]
    b = packed.reshape(-1)
    nib = torch.stack([b >> 4, b & 15], -1).reshape(-1)[:numel].long()
    if nested is not None:
        absmax_q, absmax2, code2, blocksize2, offset = nested
        blocks = torch.arange(absmax_q.numel(), device=packed.device) // blocksize2
        absmax = code2.float()[absmax_q.long()] * absmax2.float()[blocks]
        absmax = absmax + offset
    blocks = torch.arange(numel, device=packed.device) // blocksize
    return (code.float()[nib] * absmax.float()[blocks]).to(dtype).view(shape[0], shape[1])


def nf4_compose_starts(indices: torch.Tensor, numel: int, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """What the fused CUDA launch of :func:`nf4_compose` can be given as ``starts`` for these sorted
    indices into a weight of ``numel`` elements (where each of its programs finds its slice of them:
    a lookup instead of a search), to keep while they do not change; None where there is no such launch.
    ``out``: an earlier result for indices of this size, rewritten in place for their new contents."""
    if indices.device.type != "cuda":
        return None
    load_gpu_kernels()
    if NF4_COMPOSE_KERNELS.get("cuda") is None:
        return None
    with on_device(indices):
        return triton().compose_starts(indices, numel, out)


def nf4_compose(packed, code, absmax, nested, blocksize: int, shape, dtype, indices=None, values=None, starts=None, plan: bool = False):
    """The dequantized NF4 weight plus scatter(indices, values) (see :func:`nf4_dequantize_reference` and
    :func:`scatter_add_into`); on CUDA one Triton launch (dequantization and scatter fused). ``starts``:
    :func:`nf4_compose_starts` of ``indices`` (optional). ``plan``: return (weight, a
    :class:`~peft_sparse.accel.triton_kernels.LaunchPlan` that repeats the launch into a new output, or None)."""
    if packed.device.type == "cuda":
        load_gpu_kernels()
        power_of_two = blocksize > 0 and blocksize & (blocksize - 1) == 0  # (the kernel's chunks hold whole blocks)
        if NF4_COMPOSE_KERNELS.get("cuda") is not None and dtype in KERNEL_FLOAT_TYPES and power_of_two:
            with on_device(packed):
                return NF4_COMPOSE_KERNELS["cuda"](packed, code, absmax, nested, blocksize, shape, dtype, indices, values, starts, plan=plan)
    out = nf4_dequantize_reference(packed, code, absmax, nested, blocksize, shape, dtype)
    if indices is not None:
        scatter_add_reference(out, indices, values)
    return (out, None) if plan else out



def scaled_product_reference(scale: torch.Tensor, p: torch.Tensor, q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale * (p * q).to(dtype)`` — an RMSNorm's 16-bit output from its float32 input and rsqrt."""
    return scale * (p * q).to(dtype)


def scaled_product(scale: torch.Tensor, p: torch.Tensor, q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`scaled_product_reference`; on CUDA one Triton pass (instead of three, with a float32
    intermediate) when its shapes are an RMSNorm's: one of ``p``, ``q`` a contiguous float32 (..., H)
    tensor, the other float32 with one entry per row ((..., 1)), ``scale`` H entries of ``dtype`` (16-bit).
    The same bits: float32 products are commutative and each rounding happens as in torch."""
    kernel = kernel_for(SCALED_PRODUCT_KERNELS, p)
    if kernel is not None and dtype in (torch.float16, torch.bfloat16):
        full, per_row = (p, q) if p.dim() >= q.dim() and p.shape[-1] != 1 else (q, p)
        h = full.shape[-1]
        if (
            full.dtype == per_row.dtype == torch.float32
            and scale.dtype == dtype
            and full.is_contiguous() and per_row.is_contiguous() and scale.is_contiguous()
            and per_row.shape == full.shape[:-1] + (1,)
            and scale.numel() == h and scale.shape[-1] == h and scale.dim() <= full.dim()
            and full.device == per_row.device == scale.device
        ):  # fmt: skip
            with on_device(full):
                return kernel(scale, full, per_row, dtype)
    return scaled_product_reference(scale, p, q, dtype)



def gather_as(flat: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``flat.index_select(0, indices).to(dtype)``: e.g. the value gradient's entries of a 16-bit dW, as
    float32. On CUDA one Triton launch that converts as it gathers (the same values: every 16-bit and
    float32 value converts exactly to float32)."""
    kernel = gpu_kernel(GATHER_KERNELS, flat) if flat.dim() == 1 and dtype in KERNEL_FLOAT_TYPES else None
    if kernel is None or indices.dtype not in (torch.int32, torch.int64) or indices.device != flat.device:
        return flat.index_select(0, indices).to(dtype)
    with on_device(flat):
        return kernel(flat, indices.reshape(-1).contiguous(), dtype)


def dense_weight_gradient(grad_out2d: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
    """dW = (∂L/∂Y)ᵀ X in the logical (out, in) layout. grad_out2d: (tokens, out), x2d: (tokens, in)."""
    return grad_out2d.t().mm(x2d)  # (out, in)


def rows_cols(indices: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of flat row-major indices into an (out, in) matrix."""
    idx = indices.long()
    return idx // in_features, idx % in_features



def sddmm_reference(grad_out2d: torch.Tensor, x2d: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Σ_t grad_out2d[t, rows[j]] · x2d[t, cols[j]] for every j, accumulated in float32 (float64 for float64).

    On CPU, for ascending row-major positions (what an adapter's indices give), torch's sampled dense-dense
    product over a CSR pattern computes it (one dot product over the tokens per position); elsewhere, chunks
    of gathered columns multiplied and summed."""
    if sampled_product_applies(grad_out2d, x2d):
        return sampled_product(grad_out2d, x2d, sampled_pattern(rows, cols, grad_out2d.shape[1], x2d.shape[1], grad_out2d.dtype))
    tokens = grad_out2d.shape[0]
    nnz = rows.numel()
    acc = accumulation_dtype(grad_out2d.dtype)
    out = torch.empty(nnz, dtype=acc, device=grad_out2d.device)
    chunk = max(1, devices.REFERENCE_CHUNK_BYTES // max(1, 2 * acc.itemsize * tokens))
    g = grad_out2d.to(acc)
    x = x2d.to(acc)
    for start in range(0, nnz, chunk):
        r = rows[start : start + chunk]
        c = cols[start : start + chunk]
        # (tokens, chunk) · (tokens, chunk) → (chunk,)
        out[start : start + chunk] = (g.index_select(1, r) * x.index_select(1, c)).sum(0)
    return out


def sampled_product_applies(grad_out2d: torch.Tensor, x2d: torch.Tensor) -> bool:
    """Whether :func:`sddmm_reference` computes with torch's sampled product (:func:`sampled_product`): CPU,
    float32 or float64, G and X of one dtype."""
    return grad_out2d.device.type == "cpu" and grad_out2d.dtype in (torch.float32, torch.float64) and x2d.dtype == grad_out2d.dtype


def sampled_pattern(rows: torch.Tensor, cols: torch.Tensor, out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The (out, in) CSR pattern :func:`sampled_product` samples at: (rows, cols) ascending row-major, zeros of
    ``dtype`` (G's) as values; int32 row offsets and columns where they fit (8 bytes a position with the values)."""
    index_dtype = torch.int32 if rows.numel() < 2**31 and in_features < 2**31 else torch.int64
    zeros = torch.zeros(rows.numel(), dtype=dtype, device=rows.device)
    return csr_pattern(rows, cols, zeros, (out_features, in_features), index_dtype)


def sampled_product(grad_out2d: torch.Tensor, x2d: torch.Tensor, pattern: torch.Tensor) -> torch.Tensor:
    """(∂L/∂Y)ᵀX at ``pattern``'s positions (:func:`sampled_pattern`), in their order: ``torch.sparse.sampled_addmm``."""
    return torch.sparse.sampled_addmm(pattern, grad_out2d.t(), x2d, beta=0.0).values()


_CSR_BETA_WARNED = [False]


def csr_pattern(rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, shape: tuple, index_dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A CSR matrix of ``shape`` with ``values`` at (rows, cols), rows ascending (row-major positions); row offsets
    and columns of ``index_dtype``."""
    crow = torch.zeros(shape[0] + 1, dtype=index_dtype, device=rows.device)
    crow[1:] = torch.bincount(rows, minlength=shape[0]).cumsum(0)
    cols = cols.to(index_dtype)
    if _CSR_BETA_WARNED[0]:
        return torch.sparse_csr_tensor(crow, cols, values, shape, check_invariants=False)
    with warnings.catch_warnings():  # torch's one-time notice that CSR support is in beta: our own, internal use
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        _CSR_BETA_WARNED[0] = True
        return torch.sparse_csr_tensor(crow, cols, values, shape, check_invariants=False)


def sddmm(grad_out2d: torch.Tensor, x2d: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    kernel = kernel_for(SDDMM_KERNELS, grad_out2d)
    if kernel is not None:
        with on_device(grad_out2d):
            return kernel(grad_out2d, x2d, rows, cols)
    return sddmm_reference(grad_out2d, x2d, rows, cols)



def top_magnitudes_reference(dense: torch.Tensor, k: int, index_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The k entries of ``dense`` with the largest |entry| (ties → lowest flat index): their ascending
    flat indices (``index_dtype``) and the entries there in float32. Magnitudes are ranked by their
    bit patterns with the sign cleared — the order of |x| for numbers, −0.0 tying +0.0, NaN above
    every number (as ``torch.topk`` ranks it), so a NaN gradient is chosen, not lost."""
    flat = dense.reshape(-1)
    bits = {2: (torch.int16, 0x7FFF), 4: (torch.int32, 0x7FFFFFFF), 8: (torch.int64, 0x7FFFFFFFFFFFFFFF)}
    as_int, mask = bits[flat.element_size()]
    idx = top_k_set(flat.view(as_int) & mask, k)  # integer keys of the weight's own width
    return idx.to(index_dtype), flat.index_select(0, idx).float()


def top_magnitudes(dense: torch.Tensor, k: int, index_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_magnitudes_reference`; on CUDA for 16-bit ``dense`` a radix selection in a handful of
    Triton launches and four passes over ``dense`` (no |dense| copy, no sort, no weight-sized scan)."""
    kernel = kernel_for(TOP_MAGNITUDES_KERNELS, dense)
    if kernel is not None and dense.dtype in (torch.float16, torch.bfloat16) and 0 < k < dense.numel():
        with on_device(dense):
            return kernel(dense.contiguous(), k, index_dtype)
    return top_magnitudes_reference(dense, k, index_dtype)


def top_scaled_magnitudes_reference(dense: torch.Tensor, scale: torch.Tensor, k: int, index_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The k entries of the (out, in) ``dense`` with the largest |entry / scale[column]|, the quotient formed in
    ``scale``'s dtype (ties → lowest flat index; NaN ranks first, as in :func:`top_magnitudes_reference`): their
    ascending flat indices (``index_dtype``) and the entries of ``dense`` there, in ``scale``'s dtype."""
    scores = dense.to(scale.dtype) / scale  # (out, in)
    idx, _ = top_magnitudes_reference(scores, k, index_dtype)
    return idx, dense.reshape(-1).index_select(0, idx).to(scale.dtype)


def top_scaled_magnitudes(dense: torch.Tensor, scale: torch.Tensor, k: int, index_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_scaled_magnitudes_reference`; on CUDA for 16-bit ``dense`` and a float32 ``scale`` a radix
    selection over the quotients formed in registers (no float32 copy of ``dense``, no key array, no sort)."""
    kernel = kernel_for(TOP_SCALED_MAGNITUDES_KERNELS, dense)
    applies = dense.dim() == 2 and scale.shape == dense.shape[1:] and scale.dtype == torch.float32 and 0 < k < dense.numel()
    if kernel is not None and applies and dense.dtype in (torch.float16, torch.bfloat16):  # (else the reference: broadcasts or raises)
        with on_device(dense):
            return kernel(dense.contiguous(), scale.contiguous(), k, index_dtype)
    return top_scaled_magnitudes_reference(dense, scale, k, index_dtype)



def value_gradient(
    grad_out2d: torch.Tensor,
    x2d: torch.Tensor,
    indices: torch.Tensor,
    out_features: int,
    in_features: int,
    method: str = "auto",
    pattern: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """∂L/∂φ for flat indices into the (out, in) matrix (float32, or float64 for float64 inputs). ``pattern``:
    the indices' :func:`sampled_pattern` in G's dtype where the caller keeps one (used where
    :func:`sampled_product_applies` and the SDDMM is chosen; built here otherwise)."""
    if method == "auto":
        method = COST_MODEL.choose(grad_out2d.device, grad_out2d.shape[0], out_features, in_features, indices.numel())
    if method == "dense":
        return gather_as(dense_weight_gradient(grad_out2d, x2d).view(-1), indices, accumulation_dtype(grad_out2d.dtype))
    if method == "sddmm" and pattern is not None and sampled_product_applies(grad_out2d, x2d):
        return sampled_product(grad_out2d, x2d, pattern)
    if method == "sddmm":
        rows, cols = rows_cols(indices, in_features)
        return sddmm(grad_out2d, x2d, rows, cols)
    raise ValueError(f"value-gradient method={method!r} is not one of 'auto', 'dense', 'sddmm'")

