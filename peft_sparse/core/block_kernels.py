"""Value gradients of block adapters, and the block selections' dense reductions.

A block adapter's active weights are whole (bh, bw) blocks; :class:`BlockLayout` says where each block's
elements sit in the ascending values, and the value gradient of its blocks is a block-sparse product —
dW's tiles at the active blocks, (∂L/∂Y)ᵀ·X restricted to them — written straight into the values' order.
Every operation has a torch reference (``*_reference``) and a kernel registry (:mod:`.devices`); the
launch plans of the grouped Triton block kernel, where it is registered, are built ahead
(:func:`prepare_block_plans`) and carried over a reselection (:func:`carry_launches`).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import devices
from .devices import (
    BLOCK_SCORE_KEYS_KERNELS,
    BLOCK_SDDMM_INTO_KERNELS,
    BLOCK_SDDMM_KERNELS,
    BLOCK_VALUE_GRADIENT_KERNELS,
    GATHER_BLOCKS_KERNELS,
    TOP_BLOCKS_KERNELS,
    accumulation_dtype,
    dense_block_kernel,
    grouped_block_shape,
    kernel_for,
    load_gpu_kernels,
    on_device,
    power_of_two_blocks,
    triton,
)
from .selection import BlockGrid


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
    chunk = max(1, devices.REFERENCE_CHUNK_BYTES // max(1, acc.itemsize * tokens * (bh + bw)))
    for start in range(0, n, chunk):
        gb = g.index_select(1, block_rows[start : start + chunk].long())  # (tokens, chunk, bh)
        xb = x.index_select(1, block_cols[start : start + chunk].long())  # (tokens, chunk, bw)
        out[start : start + chunk] = torch.einsum("tbi,tbj->bij", gb, xb)
    return out


def block_sddmm(grad_out2d, x2d, block_rows, block_cols, bh: int, bw: int) -> torch.Tensor:
    kernel = kernel_for(BLOCK_SDDMM_KERNELS, grad_out2d)
    if kernel is not None and power_of_two_blocks((bh, bw)) and (bh == 1 or min(bh, bw) >= 16):
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
    kernel = kernel_for(BLOCK_SDDMM_INTO_KERNELS, grad_out2d)
    bh, bw = layout.block_shape
    if kernel is not None and grouped_block_shape((bh, bw)) and out.dtype == torch.float32 and out.is_contiguous():
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
    kernel = kernel_for(BLOCK_VALUE_GRADIENT_KERNELS, grad_out2d)
    bh, bw = layout.block_shape
    dtype = accumulation_dtype(grad_out2d.dtype) if out is None else out.dtype
    if kernel is not None and dtype == torch.float32 and grouped_block_shape((bh, bw)) and (out is None or out.is_contiguous()):
        with on_device(grad_out2d):
            return kernel(grad_out2d, x2d, layout, x_factor, out)
    accumulate = out is not None
    if out is None:
        out = torch.empty(layout.rows.numel() * bh * bw, dtype=dtype, device=grad_out2d.device)
    return block_sddmm_into(grad_out2d, x2d, layout, out, accumulate=accumulate, x_factor=x_factor)



def block_score_keys_reference(dense: torch.Tensor, block_shape) -> torch.Tensor:
    """int64 keys of the (bh, bw) blocks of the (out, in) ``dense``, row-major on the block grid: the
    float32 Σ|entries| of the block in the high 32 bits (non-negative floats order like their bit
    patterns), 2³²−1 − block number in the low ones. Larger key ⇔ larger sum, ties → lower block: one
    ``topk`` over them picks an exact, deterministic set."""
    sums = BlockGrid(*dense.shape, block_shape).reduce(dense.abs().float())  # Σ|entries| per block, float32
    low = 0xFFFFFFFF - torch.arange(sums.numel(), device=dense.device, dtype=torch.int64)
    return (sums.view(torch.int32).to(torch.int64) << 32) | low


def block_score_keys(dense: torch.Tensor, block_shape) -> torch.Tensor:
    """:func:`block_score_keys_reference`; on CUDA one Triton launch (no |dense| copy, no separate sum)."""
    kernel = dense_block_kernel(BLOCK_SCORE_KEYS_KERNELS, dense, block_shape)
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
    kernel = kernel_for(TOP_BLOCKS_KERNELS, keys)
    if kernel is not None and keys.dtype == torch.int64 and 0 < k < keys.numel():
        with on_device(keys):
            return kernel(keys.contiguous(), k)
    return top_blocks_reference(keys, k)


def gather_blocks_reference(dense: torch.Tensor, units: torch.Tensor, block_shape, index_dtype: torch.dtype):
    """For ascending blocks ``units`` of the (out, in) ``dense``: their :class:`BlockLayout`, their
    elements' flat indices in ascending order (``index_dtype``), and ``dense`` there in float32."""
    layout = BlockLayout.of_blocks(units, *dense.shape, block_shape)
    block_major = BlockGrid(*dense.shape, block_shape).block_major(units).reshape(-1)
    flat = torch.empty_like(block_major)
    flat[layout.slots()] = block_major
    return layout, flat.to(index_dtype), dense.reshape(-1).index_select(0, flat).float()


def gather_blocks(dense: torch.Tensor, units: torch.Tensor, block_shape, index_dtype: torch.dtype):
    """:func:`gather_blocks_reference`; on CUDA one Triton launch for the layout, the indices and the values."""
    kernel = dense_block_kernel(GATHER_BLOCKS_KERNELS, dense, block_shape)
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
        if not grouped_block_shape(layout.block_shape):
            continue
        load_gpu_kernels()
        if "cuda" not in BLOCK_SDDMM_INTO_KERNELS:
            return
        triton_kernels = triton()
        for key in (keys[i] if keys is not None else {triton_kernels.plan_key(layout, x_reads=r) for r in x_reads}):
            chosen.append(layout)
            chosen_keys.append(key)
    if chosen:
        triton().build_plans(chosen, chosen_keys)


def carry_launches(olds: list, news: list) -> None:
    """For each pair of layouts of one tensor (``olds[i]`` before a reselection, ``news[i]`` after it,
    its group plans built): the value-gradient launches kept on the old layout, retargeted to the new
    one (``triton_kernels.carry_launches``), so the next backward pass repeats them instead of planning
    each layer's launch anew."""
    pairs = [(old, new) for old, new in zip(olds, news) if old is not None and new is not None and old.launches]
    if not pairs:
        return
    triton_kernels = triton()  # (launches are only kept where the Triton kernels ran)
    for old, new in pairs:
        triton_kernels.carry_launches(old, new)

