"""Value gradient of a sparse delta: ∂L/∂φ_j = (∂L/∂Y)ᵀ·X at (r_j, c_j) (thesis App. E.4, Eq. E.5).

Two ways to get it, chosen per call by :func:`value_gradient`:

* ``"dense"`` — form dW = (∂L/∂Y)ᵀ X with one GEMM, gather the active entries, free dW. Cheap when
  the GEMM is efficient and the layer is small; transiently allocates one (out, in) tensor.
* ``"sddmm"`` — a sampled dense-dense product: one dot product over tokens per active index, never
  forming dW. :func:`sddmm_reference` is the portable torch version (chunked so its scratch memory is
  bounded); a GPU kernel registers itself in ``SDDMM_KERNELS`` for its device type and takes over.

The dense path is also the *seam* for gradient-estimation windows: when a consumer is armed on a
layer, the layer calls :func:`dense_weight_gradient` itself and hands the dense dW to the consumer.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Optional

import torch

from .. import accel
from ..accel import internals

# device type → callable(grad_out2d, x2d, rows, cols) -> (nnz,) float32
SDDMM_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}
# device type → callable(grad_out2d, x2d, block_rows, block_cols, bh, bw) -> (nblocks, bh, bw) float32
BLOCK_SDDMM_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}
# device type → callable(grad_out2d, x2d, layout, out, accumulate) -> out (see block_sddmm_into)
BLOCK_SDDMM_INTO_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}
# device type → callable(grad_out2d, x2d, layout, x_factor) -> new tensor (see block_value_gradient)
BLOCK_VALUE_GRADIENT_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}
# device type → callable(out, indices, values, source) -> out (see scatter_add_into)
SCATTER_ADD_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}
# device type → callable(out, indices, base, values) -> out (see scatter_sum_into)
SCATTER_SUM_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}
# device type → callable(flat, indices, dtype) -> tensor (see gather_as)
GATHER_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}
# device type → callable(scale, full, per_row, dtype) -> tensor (see scaled_product)
SCALED_PRODUCT_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}
# device type → callable(packed, code, absmax, nested, blocksize, shape, dtype, indices, values) (see nf4_compose)
NF4_COMPOSE_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}
# device type → callable(dense, k, index_dtype) -> (indices, values) (see top_magnitudes)
TOP_MAGNITUDES_KERNELS: dict[str, Callable[..., tuple]] = {}
# device type → callable(keys, k) -> ascending block numbers (see top_blocks)
TOP_BLOCKS_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}
# device type → callable(dense, block_shape) -> keys (see block_score_keys)
BLOCK_SCORE_KEYS_KERNELS: dict[str, Callable[..., torch.Tensor]] = {}
# device type → callable(dense, units, block_shape, index_dtype) -> (layout, indices, values) (see gather_blocks)
GATHER_BLOCKS_KERNELS: dict[str, Callable[..., tuple]] = {}
_GPU_KERNELS_TRIED = False


def _load_gpu_kernels() -> None:
    """Register the GPU kernels the first time a CUDA tensor asks (no import cost on CPU): the fast paths
    (:mod:`peft_sparse.accel.gpu`) put their loader in ``GPU_KERNEL_LOADERS``; this module never imports them."""
    global _GPU_KERNELS_TRIED
    if _GPU_KERNELS_TRIED:
        return
    _GPU_KERNELS_TRIED = True
    for load in GPU_KERNEL_LOADERS:
        load()


# callables that fill the registries above for CUDA (see _load_gpu_kernels)
GPU_KERNEL_LOADERS: list[Callable[[], None]] = []
# the Triton kernels' module once a loader found it (what the kept-launch helpers below call), else None
TRITON: list = [None]


def _triton():
    """The Triton kernels' module, or None (no Triton, or no loader)."""
    _load_gpu_kernels()
    return TRITON[0]

# bytes of scratch memory the reference SDDMM may use per chunk
_REFERENCE_CHUNK_BYTES = 64 * 2**20


_KERNEL_FLOAT_TYPES = {torch.float32, torch.float16, torch.bfloat16}  # what the Triton kernels compute in float32


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


def on_device(tensor: torch.Tensor):
    """A context making ``tensor``'s GPU the current one (Triton launches on the current device), or a
    no-op when it already is or ``tensor`` is not on a CUDA device."""
    if tensor.is_cuda:  # (no device objects built: this runs around kernel launches in every step)
        index = tensor.get_device()
        if index != _current_cuda_device():
            return torch.cuda.device(index)
    return _SAME_DEVICE


_SAME_DEVICE = contextlib.nullcontext()  # (stateless: entered again and again)
_current_cuda_device = internals.current_cuda_device


def increment_versions(tensors: list) -> None:
    """``torch.autograd.graph.increment_version`` of every tensor: one call for the list where torch
    takes one (2.5 on), else one per tensor."""
    try:
        torch.autograd.graph.increment_version(tensors)
    except TypeError:  # (torch before 2.5: one tensor per call; nothing was bumped)
        for tensor in tensors:
            torch.autograd.graph.increment_version(tensor)


def _power_of_two_blocks(block_shape) -> bool:
    """Whether both sides of the block shape are powers of two (the Triton block kernels' tiles)."""
    return all(v & (v - 1) == 0 for v in block_shape)


def device_type(tensor: torch.Tensor) -> str:
    """``tensor.device.type``, without building a device object for a CUDA tensor (calls made once per
    layer and step)."""
    return "cuda" if tensor.is_cuda else tensor.device.type


def _kernel_for(registry: dict, tensor: torch.Tensor):
    """The kernel ``registry`` holds for ``tensor``'s device type, or None; the GPU kernels are registered
    at the first CUDA tensor."""
    if not accel.ON:  # the fast paths are off: the torch references serve
        return None
    kind = device_type(tensor)
    if kind == "cuda":
        _load_gpu_kernels()
    return registry.get(kind)


def _grouped_block_shape(block_shape) -> bool:
    """Whether the grouped Triton block kernel takes blocks of this shape (powers of two, at least 16×16)."""
    return _power_of_two_blocks(block_shape) and min(block_shape) >= 16


def _dense_block_kernel(registry: dict, dense: torch.Tensor, block_shape):
    """The registered kernel reading blocks of ``dense`` for its device, when the blocks tile as Triton
    tiles and ``dense`` is in a type the kernels read; else None (the torch reference serves)."""
    kernel = _kernel_for(registry, dense)
    return kernel if kernel is not None and _power_of_two_blocks(block_shape) and dense.dtype in _KERNEL_FLOAT_TYPES else None


def _gpu_kernel(registry: dict, out: torch.Tensor, *operands: Optional[torch.Tensor]):
    """The registered kernel for ``out``'s device when it applies (contiguous ``out``, operands in types
    the Triton kernels compute in float32), else None."""
    kernel = _kernel_for(registry, out)
    dtypes = {t.dtype for t in (out, *operands) if t is not None}
    return kernel if kernel is not None and dtypes <= _KERNEL_FLOAT_TYPES and out.is_contiguous() else None


def scatter_add_into(
    out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, source: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """:func:`scatter_add_reference` for sorted distinct indices into a contiguous ``out``; on CUDA one
    fused Triton launch (copy and scatter together) instead of five torch operations."""
    kernel = _gpu_kernel(SCATTER_ADD_KERNELS, out, values, source)
    if kernel is None:
        return scatter_add_reference(out, indices, values, source)
    with on_device(out):
        return kernel(out, indices, values, source)


def scatter_sum_into(out: torch.Tensor, indices: torch.Tensor, base: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """:func:`scatter_sum_reference` with ``base`` in ``out``'s dtype: the merged weight's entries at the
    indices, rounded exactly as :func:`scatter_add_into` rounds them when ``base`` holds the weight's
    values there. On CUDA one Triton launch."""
    kernel = _gpu_kernel(SCATTER_SUM_KERNELS, out, values)
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
        if _gpu_kernel(SCATTER_SUM_KERNELS, out, value, bases[k]) is None:
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
    MultiScatterSum = _triton().MultiScatterSum  # (grouped only where a CUDA kernel is registered)

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
    _load_gpu_kernels()
    if NF4_COMPOSE_KERNELS.get("cuda") is None:
        return None
    with on_device(indices):
        return _triton().compose_starts(indices, numel, out)


def nf4_compose(packed, code, absmax, nested, blocksize: int, shape, dtype, indices=None, values=None, starts=None, plan: bool = False):
    """The dequantized NF4 weight plus scatter(indices, values) (see :func:`nf4_dequantize_reference` and
    :func:`scatter_add_into`); on CUDA one Triton launch (dequantization and scatter fused). ``starts``:
    :func:`nf4_compose_starts` of ``indices`` (optional). ``plan``: return (weight, a
    :class:`~peft_sparse.accel.triton_kernels.LaunchPlan` that repeats the launch into a new output, or None)."""
    if packed.device.type == "cuda":
        _load_gpu_kernels()
        power_of_two = blocksize > 0 and blocksize & (blocksize - 1) == 0  # (the kernel's chunks hold whole blocks)
        if NF4_COMPOSE_KERNELS.get("cuda") is not None and dtype in _KERNEL_FLOAT_TYPES and power_of_two:
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
    kernel = _kernel_for(SCALED_PRODUCT_KERNELS, p)
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
    kernel = _gpu_kernel(GATHER_KERNELS, flat) if flat.dim() == 1 and dtype in _KERNEL_FLOAT_TYPES else None
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


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types and float32, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def sddmm_reference(grad_out2d: torch.Tensor, x2d: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Σ_t grad_out2d[t, rows[j]] · x2d[t, cols[j]] for every j, accumulated in float32 (float64 for float64).

    On CPU, for ascending row-major positions (what an adapter's indices give), torch's sampled dense-dense
    product over a CSR pattern computes it (one dot product over the tokens per position); elsewhere, chunks
    of gathered columns multiplied and summed."""
    if grad_out2d.device.type == "cpu" and grad_out2d.dtype in (torch.float32, torch.float64) and x2d.dtype == grad_out2d.dtype:
        return _sampled_product(grad_out2d, x2d, rows, cols)
    tokens = grad_out2d.shape[0]
    nnz = rows.numel()
    acc = accumulation_dtype(grad_out2d.dtype)
    out = torch.empty(nnz, dtype=acc, device=grad_out2d.device)
    chunk = max(1, _REFERENCE_CHUNK_BYTES // max(1, 2 * acc.itemsize * tokens))
    g = grad_out2d.to(acc)
    x = x2d.to(acc)
    for start in range(0, nnz, chunk):
        r = rows[start : start + chunk]
        c = cols[start : start + chunk]
        # (tokens, chunk) · (tokens, chunk) → (chunk,)
        out[start : start + chunk] = (g.index_select(1, r) * x.index_select(1, c)).sum(0)
    return out


def _sampled_product(grad_out2d: torch.Tensor, x2d: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """(∂L/∂Y)ᵀX at (rows, cols), rows ascending (row-major order): ``torch.sparse.sampled_addmm`` over the
    CSR pattern of the positions."""
    pattern = csr_pattern(rows, cols, torch.zeros(rows.numel(), dtype=grad_out2d.dtype), (grad_out2d.shape[1], x2d.shape[1]))
    return torch.sparse.sampled_addmm(pattern, grad_out2d.t(), x2d, beta=0.0).values()


_CSR_BETA_WARNED = [False]


def csr_pattern(rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A CSR matrix of ``shape`` with ``values`` at (rows, cols), rows ascending (row-major positions)."""
    crow = torch.zeros(shape[0] + 1, dtype=torch.long, device=rows.device)
    crow[1:] = torch.bincount(rows, minlength=shape[0]).cumsum(0)
    if _CSR_BETA_WARNED[0]:
        return torch.sparse_csr_tensor(crow, cols.long(), values, shape, check_invariants=False)
    with warnings.catch_warnings():  # torch's one-time notice that CSR support is in beta: our own, internal use
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        _CSR_BETA_WARNED[0] = True
        return torch.sparse_csr_tensor(crow, cols.long(), values, shape, check_invariants=False)


def sddmm(grad_out2d: torch.Tensor, x2d: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    kernel = _kernel_for(SDDMM_KERNELS, grad_out2d)
    if kernel is not None:
        with on_device(grad_out2d):
            return kernel(grad_out2d, x2d, rows, cols)
    return sddmm_reference(grad_out2d, x2d, rows, cols)


def block_sddmm_reference(
    grad_out2d: torch.Tensor, x2d: torch.Tensor, block_rows: torch.Tensor, block_cols: torch.Tensor, bh: int, bw: int
) -> torch.Tensor:
    """dW tiles (nblocks, bh, bw) of the given blocks, chunked over blocks, accumulated in float32 (float64 for float64)."""
    acc = accumulation_dtype(grad_out2d.dtype)
    tokens = grad_out2d.shape[0]
    g = grad_out2d.to(acc).view(tokens, -1, bh)  # (tokens, out/bh, bh)
    x = x2d.to(acc).view(tokens, -1, bw)  # (tokens, in/bw, bw)
    n = block_rows.numel()
    out = torch.empty(n, bh, bw, dtype=acc, device=grad_out2d.device)
    chunk = max(1, _REFERENCE_CHUNK_BYTES // max(1, acc.itemsize * tokens * (bh + bw)))
    for start in range(0, n, chunk):
        gb = g.index_select(1, block_rows[start : start + chunk].long())  # (tokens, chunk, bh)
        xb = x.index_select(1, block_cols[start : start + chunk].long())  # (tokens, chunk, bw)
        out[start : start + chunk] = torch.einsum("tbi,tbj->bij", gb, xb)
    return out


def block_sddmm(grad_out2d, x2d, block_rows, block_cols, bh: int, bw: int) -> torch.Tensor:
    kernel = _kernel_for(BLOCK_SDDMM_KERNELS, grad_out2d)
    if kernel is not None and _power_of_two_blocks((bh, bw)) and (bh == 1 or min(bh, bw) >= 16):
        with on_device(grad_out2d):
            return kernel(grad_out2d, x2d, block_rows, block_cols, bh, bw)
    return block_sddmm_reference(grad_out2d, x2d, block_rows, block_cols, bh, bw)


class BlockLayout:
    """Where the active (bh, bw) blocks of an (out, in) matrix sit in its ascending flat indices.

    Over ascending indices a block row's elements come row by row, each row holding bw entries of
    every active block of that block row in block order: element (i, j) of the block of rank q among
    the n active blocks of its block row, whose elements start at position s, is at
    s + i·n·bw + q·bw + j. So two numbers per block — ``base`` (s + q·bw) and ``stride`` (n·bw) —
    place every element, found in O(blocks). ``plans`` caches kernel launch plans for this layout;
    ``units`` holds the ascending block numbers (row-major on the block grid, int64) when the layout
    was made from them, else None (:meth:`block_numbers` computes them)."""

    __slots__ = ("rows", "cols", "base", "stride", "block_shape", "out_features", "in_features", "plans", "launches", "units",
                 "__weakref__")  # fmt: skip

    def __init__(self, rows, cols, base, stride, block_shape, out_features: int, in_features: int, units=None):
        self.rows, self.cols, self.base, self.stride = rows, cols, base, stride
        self.block_shape = tuple(block_shape)
        self.out_features, self.in_features = out_features, in_features
        self.plans: dict = {}
        self.launches: dict = {}  # kept kernel launches of this layout's value gradient, per call shape
        self.units = units

    def block_numbers(self) -> torch.Tensor:
        """The ascending active block numbers (int64), row-major on the block grid."""
        if self.units is not None:
            return self.units
        return self.rows.long() * (self.in_features // self.block_shape[1]) + self.cols.long()

    @staticmethod
    def positions(row_key: torch.Tensor, block_shape, start: Optional[torch.Tensor] = None) -> tuple:
        """(base, stride) of ascending blocks whose block rows are ``row_key`` (ascending; blocks of the
        same block row share a key), the values starting at block ``start`` (per block; default 0) —
        the formula of the class docstring. Many tensors at once: give each its own keys and starts."""
        bh, bw = block_shape
        first = torch.searchsorted(row_key, row_key)  # first active block of the same block row
        count = torch.searchsorted(row_key, row_key, right=True) - first
        rank = torch.arange(row_key.numel(), device=row_key.device) - first
        if start is not None:
            first = first - start
        return first * (bh * bw) + rank * bw, (count * bw).to(torch.int32)

    @classmethod
    def of_blocks(cls, blocks: torch.Tensor, out_features: int, in_features: int, block_shape) -> "BlockLayout":
        """The layout of the ascending block numbers ``blocks`` (row-major on the block grid)."""
        cols = in_features // block_shape[1]
        blocks = blocks.long()
        block_rows = blocks // cols
        base, stride = cls.positions(block_rows, block_shape)
        return cls(block_rows.to(torch.int32), (blocks % cols).to(torch.int32), base, stride, block_shape, out_features, in_features, blocks)

    @staticmethod
    def element_slots(base: torch.Tensor, stride: torch.Tensor, block_shape) -> torch.Tensor:
        """(blocks, bh, bw): ``base[b] + i·stride[b] + j``, where element (i, j) of block b sits."""
        bh, bw = block_shape
        i = torch.arange(bh, device=base.device)
        j = torch.arange(bw, device=base.device)
        return base[:, None, None] + i[None, :, None] * stride.long()[:, None, None] + j[None, None, :]

    def slots(self) -> torch.Tensor:
        """Position of element (i, j) of block b at [b·bh·bw + i·bw + j]."""
        return self.element_slots(self.base, self.stride, self.block_shape).reshape(-1)

    def __getstate__(self):
        return {k: getattr(self, k) for k in self.__slots__ if k not in ("plans", "launches", "__weakref__")}

    def __setstate__(self, state):
        for k, v in state.items():
            setattr(self, k, v)
        self.plans, self.launches = {}, {}


def _place_tiles(out: torch.Tensor, layout: BlockLayout, tiles: torch.Tensor, accumulate: bool) -> torch.Tensor:
    tiles = tiles.reshape(-1).to(out.dtype)
    if accumulate:
        return out.index_add_(0, layout.slots(), tiles)
    return out.index_copy_(0, layout.slots(), tiles)


def block_sddmm_into_reference(grad_out2d, x2d, layout: BlockLayout, out: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
    """``out[slots] (+)= `` the block-sparse dW of ``layout``'s blocks (see :func:`block_sddmm_reference`)."""
    bh, bw = layout.block_shape
    return _place_tiles(out, layout, block_sddmm_reference(grad_out2d, x2d, layout.rows, layout.cols, bh, bw), accumulate)


def block_sddmm_into(grad_out2d, x2d, layout: BlockLayout, out: torch.Tensor, accumulate: bool = False,
                     x_factor: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
    """The value gradient of a block adapter straight into ``out`` (ascending element order, float32):
    on CUDA one grouped Triton launch for blocks of at least 16×16 (blocks sharing a block row or
    column read its tile once); otherwise :func:`block_sddmm`'s tiles, placed. ``accumulate`` adds to
    ``out`` instead of overwriting it. ``x_factor``: the layer input is the product ``x2d ⊙ x_factor``
    (same shape and dtype), which the kernel forms tile by tile with the bits of torch's product; the
    blocks may be grouped otherwise than for a formed X (X is read twice), which can change the order
    of the float32 sums."""
    kernel = _kernel_for(BLOCK_SDDMM_INTO_KERNELS, grad_out2d)
    bh, bw = layout.block_shape
    if kernel is not None and _grouped_block_shape((bh, bw)) and out.dtype == torch.float32 and out.is_contiguous():
        with on_device(grad_out2d):
            return kernel(grad_out2d, x2d, layout, out, accumulate, x_factor=x_factor)
    if x_factor is not None:
        x2d = x2d * x_factor
    return _place_tiles(out, layout, block_sddmm(grad_out2d, x2d, layout.rows, layout.cols, bh, bw), accumulate)


def block_value_gradient(grad_out2d, x2d, layout: BlockLayout, x_factor: Optional[torch.Tensor] = None,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
    """The value gradient of a block adapter in a new tensor, in the values' order (float32; float64 for
    float64 inputs): :func:`block_sddmm_into` into it; given ``out``, added to ``out`` instead
    (``accumulate``). On CUDA, where the Triton block kernel applies, each call shape's launch is kept
    on the layout and repeated (``triton_kernels.block_value_gradient``)."""
    kernel = _kernel_for(BLOCK_VALUE_GRADIENT_KERNELS, grad_out2d)
    bh, bw = layout.block_shape
    dtype = accumulation_dtype(grad_out2d.dtype) if out is None else out.dtype
    if kernel is not None and dtype == torch.float32 and _grouped_block_shape((bh, bw)) and (out is None or out.is_contiguous()):
        with on_device(grad_out2d):
            return kernel(grad_out2d, x2d, layout, x_factor, out)
    accumulate = out is not None
    if out is None:
        out = torch.empty(layout.rows.numel() * bh * bw, dtype=dtype, device=grad_out2d.device)
    return block_sddmm_into(grad_out2d, x2d, layout, out, accumulate=accumulate, x_factor=x_factor)


def top_magnitudes_reference(dense: torch.Tensor, k: int, index_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The k entries of ``dense`` with the largest |entry| (ties → lowest flat index): their ascending
    flat indices (``index_dtype``) and the entries there in float32. Magnitudes are ranked by their
    bit patterns with the sign cleared — the order of |x| for numbers, −0.0 tying +0.0, NaN above
    every number (as ``torch.topk`` ranks it), so a NaN gradient is chosen, not lost."""
    from .selection import top_k_set

    flat = dense.reshape(-1)
    bits = {2: (torch.int16, 0x7FFF), 4: (torch.int32, 0x7FFFFFFF), 8: (torch.int64, 0x7FFFFFFFFFFFFFFF)}
    as_int, mask = bits[flat.element_size()]
    idx = top_k_set(flat.view(as_int) & mask, k)  # integer keys of the weight's own width
    return idx.to(index_dtype), flat.index_select(0, idx).float()


def top_magnitudes(dense: torch.Tensor, k: int, index_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_magnitudes_reference`; on CUDA for 16-bit ``dense`` a radix selection in a handful of
    Triton launches and four passes over ``dense`` (no |dense| copy, no sort, no weight-sized scan)."""
    kernel = _kernel_for(TOP_MAGNITUDES_KERNELS, dense)
    if kernel is not None and dense.dtype in (torch.float16, torch.bfloat16) and 0 < k < dense.numel():
        with on_device(dense):
            return kernel(dense.contiguous(), k, index_dtype)
    return top_magnitudes_reference(dense, k, index_dtype)


def block_score_keys_reference(dense: torch.Tensor, block_shape) -> torch.Tensor:
    """int64 keys of the (bh, bw) blocks of the (out, in) ``dense``, row-major on the block grid: the
    float32 Σ|entries| of the block in the high 32 bits (non-negative floats order like their bit
    patterns), 2³²−1 − block number in the low ones. Larger key ⇔ larger sum, ties → lower block: one
    ``topk`` over them picks an exact, deterministic set."""
    from .selection import BlockGrid

    sums = BlockGrid(*dense.shape, block_shape).reduce(dense.abs().float())  # Σ|entries| per block, float32
    low = 0xFFFFFFFF - torch.arange(sums.numel(), device=dense.device, dtype=torch.int64)
    return (sums.view(torch.int32).to(torch.int64) << 32) | low


def block_score_keys(dense: torch.Tensor, block_shape) -> torch.Tensor:
    """:func:`block_score_keys_reference`; on CUDA one Triton launch (no |dense| copy, no separate sum)."""
    kernel = _dense_block_kernel(BLOCK_SCORE_KEYS_KERNELS, dense, block_shape)
    if kernel is not None:
        with on_device(dense):
            return kernel(dense.contiguous(), block_shape)
    return block_score_keys_reference(dense, block_shape)


def top_blocks_reference(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending block numbers (int64) of the k largest :func:`block_score_keys` (ties → lower blocks)."""
    k = min(k, keys.numel())
    top = torch.topk(keys, k, sorted=False).values
    return (0xFFFFFFFF - (top & 0xFFFFFFFF)).sort().values


def top_blocks(keys: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`top_blocks_reference`; on CUDA one Triton launch (a radix selection over the keys' sums
    and an ordered compaction) instead of a top-k, two integer operations and a sort."""
    kernel = _kernel_for(TOP_BLOCKS_KERNELS, keys)
    if kernel is not None and keys.dtype == torch.int64 and 0 < k < keys.numel():
        with on_device(keys):
            return kernel(keys.contiguous(), k)
    return top_blocks_reference(keys, k)


def gather_blocks_reference(dense: torch.Tensor, units: torch.Tensor, block_shape, index_dtype: torch.dtype):
    """For ascending blocks ``units`` of the (out, in) ``dense``: their :class:`BlockLayout`, their
    elements' flat indices in ascending order (``index_dtype``), and ``dense`` there in float32."""
    from .selection import BlockGrid

    layout = BlockLayout.of_blocks(units, *dense.shape, block_shape)
    block_major = BlockGrid(*dense.shape, block_shape).block_major(units).reshape(-1)
    flat = torch.empty_like(block_major)
    flat[layout.slots()] = block_major
    return layout, flat.to(index_dtype), dense.reshape(-1).index_select(0, flat).float()


def gather_blocks(dense: torch.Tensor, units: torch.Tensor, block_shape, index_dtype: torch.dtype):
    """:func:`gather_blocks_reference`; on CUDA one Triton launch for the layout, the indices and the values."""
    kernel = _dense_block_kernel(GATHER_BLOCKS_KERNELS, dense, block_shape)
    if kernel is not None:
        with on_device(dense):
            return kernel(dense.contiguous(), units, block_shape, index_dtype)
    return gather_blocks_reference(dense, units, block_shape, index_dtype)


def prepare_block_plans(layouts: list, keys: Optional[list] = None, x_reads: tuple = (1,)) -> None:
    """Build the grouped block kernel's launch plans of many :class:`BlockLayout` s at once, where that
    kernel serves their device (CUDA): a fixed number of launches for all of them, instead of each
    layout building its own at its first use inside a backward pass. ``keys[i]``: the plans (as in
    ``layouts[i].plans``) to build for layout i; default: the ones its products use with X read
    ``x_reads`` times (1: X formed; 2: X formed from two factors in the kernel). Layouts the kernel
    does not serve (other devices, block shapes) are skipped: they need no plan."""
    chosen, chosen_keys = [], []
    for i, layout in enumerate(layouts):
        if layout is None or layout.rows.device.type != "cuda":
            continue
        if not _grouped_block_shape(layout.block_shape):
            continue
        _load_gpu_kernels()
        if "cuda" not in BLOCK_SDDMM_INTO_KERNELS:
            return
        triton_kernels = _triton()
        for key in (keys[i] if keys is not None else {triton_kernels.plan_key(layout, x_reads=r) for r in x_reads}):
            chosen.append(layout)
            chosen_keys.append(key)
    if chosen:
        _triton().build_plans(chosen, chosen_keys)


def carry_launches(olds: list, news: list) -> None:
    """For each pair of layouts of one tensor (``olds[i]`` before a reselection, ``news[i]`` after it,
    its group plans built): the value-gradient launches kept on the old layout, retargeted to the new
    one (``triton_kernels.carry_launches``), so the next backward pass repeats them instead of planning
    each layer's launch anew."""
    pairs = [(old, new) for old, new in zip(olds, news) if old is not None and new is not None and old.launches]
    if not pairs:
        return
    triton_kernels = _triton()  # (launches are only kept where the Triton kernels ran)
    for old, new in pairs:
        triton_kernels.carry_launches(old, new)


class CostModel:
    """Chooses ``"dense"`` or ``"sddmm"`` for a layer from its shape, token count and number of indices.

    Times are modelled as ``flops / rate``: the dense path costs one GEMM of tokens·out·in
    multiply-adds plus a gather; the SDDMM path costs tokens·nnz multiply-adds at a much lower rate
    (no tensor-core reuse). ``sddmm_relative_rate`` is the SDDMM rate as a fraction of the GEMM
    rate, measured per device (``benchmarks/``); the CPU value comes from the torch reference.
    """

    def __init__(self, sddmm_relative_rate: Optional[dict[str, float]] = None):
        # measured: benchmarks/value_grad.py. On an H200 at 8192 tokens the Triton SDDMM lost to the
        # bf16 GEMM + gather at every density from 0.2% to 10% (docs/perf-log.md). On 2 CPU cores
        # (SmolLM2-135M's shapes, 440 tokens, float32) torch's sampled product ran at 0.025–0.12 of the
        # GEMM's rate: 2–4× faster than the dense path at 1% density, 1.0–2.5× at 4.6%.
        self.sddmm_relative_rate = {"cpu": 0.05, "cuda": 0.0005}
        if sddmm_relative_rate:
            self.sddmm_relative_rate.update(sddmm_relative_rate)

    # block kernels: a fixed launch/latency cost (in GEMM multiply-add equivalents) plus their MACs at a
    # fraction of the GEMM rate; the dense path also pays a fixed cost (GEMM launch, the gather, the
    # GEMM's poor efficiency on small shapes). The fixed costs: an H100 (benchmarks/value_grad.py, 8192
    # tokens): dense dW + gather of a 256×2048 layer took 0.037 ms for 0.013 ms of MACs. The rates: the
    # grouped kernel (block_sddmm_into) on an H200 at TinyLlama's shapes, 5.2% and 10% density, where
    # the MACs outweigh the fixed cost (docs/perf-log.md, round s21): 64×64 ran at 0.18–0.25 of the GEMM
    # rate, 32×32 at 0.16–0.20, 16×16 at 0.067–0.087; 1×64 (one block per program) at 0.004.
    block_relative_rate = {(64, 64): 0.22, (32, 32): 0.2, (16, 16): 0.065, (1, 64): 0.004}
    block_overhead = {"cuda": 6e9, "cpu": 0.0}
    dense_overhead = {"cuda": 8e9, "cpu": 0.0}

    def block_rate(self, block_shape) -> float:
        """The block kernel's rate (fraction of the GEMM rate) for ``block_shape``: the measured one, else
        that of the largest measured shape that fits inside it (row vectors within row vectors, tiles
        within tiles) — a larger block reads fewer operand bytes per multiply-add, so it runs at least
        as fast per element as a block it contains; the slowest measured rate when none fits."""
        # (a measured shape given as a tuple looked up at once: this runs in every block layer's backward)
        rate = self.block_relative_rate.get(block_shape) if type(block_shape) is tuple else None
        if rate is not None:
            return rate
        bh, bw = (int(d) for d in block_shape)
        rate = self.block_relative_rate.get((bh, bw))
        if rate is not None:
            return rate
        inside = [(h * w, r) for (h, w), r in self.block_relative_rate.items() if h <= bh and w <= bw and (h == 1) == (bh == 1)]
        return max(inside)[1] if inside else min(self.block_relative_rate.values())

    def choose_block(self, device: torch.device, tokens: int, out_features: int, in_features: int, nnz: int, block_shape) -> str:
        """``"block"`` (block-sparse product) or ``"dense"`` (GEMM + gather) for a block adapter (``device``:
        a ``torch.device`` or its type's name)."""
        rate = self.block_rate(block_shape)
        kind = device if type(device) is str else device.type
        block_cost = self.block_overhead.get(kind, 0.0) + tokens * nnz / rate
        dense_cost = self.dense_overhead.get(kind, 0.0) + tokens * out_features * in_features
        return "block" if block_cost < dense_cost else "dense"

    # inference without gradients (generation, evaluation): the delta applied from its nnz entries (a
    # sparse product, tokens·nnz multiply-adds) or a weight-sized W + δ rebuilt per call. On 2 CPU cores at
    # SmolLM2-135M's shapes the sparse product was cheaper up to tokens·density ≈ 0.3 (1 token: 0.05 against
    # 0.09–0.15 ms per layer); on CUDA the ratio is a conservative guess until measured.
    inference_sparse_ratio = {"cpu": 0.3, "cuda": 0.02}

    def choose_inference(self, x: torch.Tensor, tokens: int, out_features: int, in_features: int, nnz: int) -> str:
        """``"sparse"`` (X·Wᵀ + X·δᵀ from δ's entries) or ``"rebuild"`` (X·(W + δ)ᵀ) for a pass without gradients."""
        ratio = self.inference_sparse_ratio.get(device_type(x), 0.0)
        if x.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            return "rebuild"
        return "sparse" if tokens * nnz < ratio * out_features * in_features else "rebuild"

    def choose(self, device: torch.device, tokens: int, out_features: int, in_features: int, nnz: int) -> str:
        rate = self.sddmm_relative_rate.get(device.type, 0.0)
        if device.type not in SDDMM_KERNELS and device.type != "cpu":
            rate = min(rate, self.sddmm_relative_rate["cpu"])
        dense_cost = tokens * out_features * in_features
        sddmm_cost = tokens * nnz / max(rate, 1e-12)
        return "sddmm" if sddmm_cost < dense_cost else "dense"


COST_MODEL = CostModel()


def value_gradient(
    grad_out2d: torch.Tensor,
    x2d: torch.Tensor,
    indices: torch.Tensor,
    out_features: int,
    in_features: int,
    method: str = "auto",
) -> torch.Tensor:
    """∂L/∂φ for flat indices into the (out, in) matrix (float32, or float64 for float64 inputs)."""
    if method == "auto":
        method = COST_MODEL.choose(grad_out2d.device, grad_out2d.shape[0], out_features, in_features, indices.numel())
    if method == "dense":
        return gather_as(dense_weight_gradient(grad_out2d, x2d).view(-1), indices, accumulation_dtype(grad_out2d.dtype))
    if method == "sddmm":
        rows, cols = rows_cols(indices, in_features)
        return sddmm(grad_out2d, x2d, rows, cols)
    raise ValueError(f"value-gradient method={method!r} is not one of 'auto', 'dense', 'sddmm'")
