"""Triton kernels for the value gradient ∂L/∂φ without the dense dW (thesis App. E.4).

They compute entries of dW = Gᵀ·X (G = ∂L/∂Y, (tokens, out); X, (tokens, in)) at given positions:

* :func:`sddmm` — unstructured: one dot product over tokens per index, on CUDA cores. Costs
  nnz·tokens multiply-adds; G and X are transposed once so each dot product reads two contiguous
  rows (consecutive sorted indices share a row of Gᵀ, which stays in cache).
* :func:`block_sddmm_into` — (bh, bw) blocks of at least 16×16, what block adapters use: ``tl.dot``
  tile products on tensor cores over token chunks, cost ∝ density. Each program takes up to 4 blocks
  sharing a block row or column (:class:`BlockGroups`), so the shared operand's tile is read once,
  and writes the results straight into the values' order (:class:`~peft_sparse.core.kernels.BlockLayout`).
* :func:`block_sddmm` — one program per block, tiles out (also bh = 1, a row-vector × tile product).

When a layer has few active blocks, the token axis is cut into slices (partial results summed
afterwards) so that the launch still fills the GPU. Besides these: the merged-weight and scatter
kernels, SM3's step for many tensors in one launch (:class:`MultiSM3`; one program per block for
block adapters), the RMSNorm-output rebuild and the NF4 dequantization fused with the delta. The
step's kernels go through :func:`launch`, which skips the Python work Triton repeats at every launch.

Shipped as Python source (compiled by Triton at first use); the torch references in
:mod:`peft_sparse.core.kernels` compute the same values and are what the tests compare against
(on CPU through Triton's interpreter, ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch
import triton
import triton.language as tl

from ..core.block_kernels import BlockLayout
from ..core.devices import current_cuda_device as _current_cuda_device, on_device, table, to_device_async
from . import internals

# (kernel, device, specialization, options) → the kernel Triton compiled for them (see launch)
_COMPILED: dict = {}
_FAST_LAUNCH: list = []  # [whether this Triton's internals are the ones launch uses], once known


def _cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for the host's grid sizes (``triton.cdiv`` is a constexpr function whose wrapper costs microseconds
    per call: several hundred calls in a training step's launches)."""
    return -(-a // b)


def _hook_set(hook) -> bool:
    return bool(getattr(hook, "calls", hook))  # a hook chain's calls (Triton 3.5+), else the hook itself


def _plain_launch(kernel) -> bool:
    """Whether nothing asks Triton's launch of ``kernel`` to do more than launch: no pre-run hooks on the
    kernel, no launch hooks (profilers), no debug or instrumentation mode."""
    knobs = triton.knobs
    return not (
        kernel.pre_run_hooks
        or _hook_set(knobs.runtime.launch_enter_hook) or _hook_set(knobs.runtime.launch_exit_hook)
        or getattr(knobs.runtime, "debug", False) or getattr(knobs.compilation, "instrumentation_mode", "")
    )  # fmt: skip


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` without the Python work Triton repeats at every such call (its
    cache key's string form, launch metadata, empty hook chains — about as much host time as a
    torch operation, on every launch of a training step): the kernel that Triton compiled for this
    specialization — found by Triton's own argument binder, so the one Triton itself would pick — is
    launched directly. Triton's launch serves the first call of each specialization, calls while
    launch hooks are set (profilers) or pre-run hooks, debug or instrumentation modes, kernels that
    read module globals, callable grids, the interpreter, and Triton versions without these internals."""
    _launch(kernel, grid, args, kwargs, None)


def launch_plan(kernel, grid: tuple, slot, *args, **kwargs) -> Optional["LaunchPlan"]:
    """:func:`launch`, and when it went straight to a kept compiled kernel, a :class:`LaunchPlan` that
    repeats this launch with only the tensor argument named ``slot`` (or the tensor arguments of a tuple
    of names) replaced (None when Triton's launch served, e.g. at the first calls of a specialization)."""
    return _launch(kernel, grid, args, kwargs, slot)


def _launch(kernel, grid: tuple, args: tuple, kwargs: dict, slot: Optional[str]) -> Optional["LaunchPlan"]:
    if not _FAST_LAUNCH:
        _FAST_LAUNCH.append(internals.triton_fast_launch_supported())
    caches = internals.triton_device_caches(kernel)
    if (
        not _FAST_LAUNCH[0] or caches is None or not isinstance(grid, tuple)
        or getattr(kernel, "used_global_vals", None)  # (Triton checks those globals at every launch)
        or not _plain_launch(kernel)
    ):  # fmt: skip
        kernel[grid](*args, **kwargs)
        return None
    device = torch.cuda.current_device()
    entry = caches.get(device)
    if entry is None:  # Triton's first launch of this kernel on this device sets up its binder
        kernel[grid](*args, **kwargs)
        return None
    params, specialization, options = entry[4](*args, **kwargs)
    try:
        key = (kernel, device, tuple(specialization), tuple(options.items()))
        compiled = _COMPILED.get(key)
    except TypeError:  # an unhashable constant
        key = compiled = None
    if compiled is None:
        compiled = kernel[grid](*args, **kwargs)
        if key is not None and all(hasattr(compiled, a) for a in ("function", "packed_metadata", "run")):
            _COMPILED[key] = compiled  # (not a pending compilation, nor another Triton's kernel object)
        return None
    grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    compiled.run(*grid3, internals.cuda_raw_stream(device), compiled.function, compiled.packed_metadata, None, None, None, *params.values())
    if slot is None:
        return None
    slots = (slot,) if isinstance(slot, str) else tuple(slot)
    if not all(isinstance(params.get(name), torch.Tensor) for name in slots):
        return None
    return LaunchPlan(kernel, device, grid3, compiled, params, slots)


# (kernel, key) → a LaunchPlan whose slots are all the launch's tensors (see launch_kept); room for a few kernels
# per layer of a large model, whose layers' budgets may all differ (a plan holds no tensor: a few hundred bytes each)
_KEPT_LAUNCHES: dict = {}
_KEPT_LAUNCHES_MAX = 4096


def launch_kept(kernel, grid: tuple, key: tuple, slots: tuple, tensors: tuple, *args, **kwargs) -> None:
    """:func:`launch`, repeated for later calls with the same ``key`` from a kept :class:`LaunchPlan` with
    every tensor argument a slot (``slots``: their names; ``tensors``: this call's, in that order), so
    the plan holds no tensor. ``key`` must fix everything else the launch depends on — the grid, every
    scalar and constexpr argument, the device — e.g. a layer shape's: the layers of a model share a
    handful of shapes, and a training step launches each such kernel once per layer."""
    whole_key = (kernel, tensors[0].device, key)
    plan = _KEPT_LAUNCHES.get(whole_key)
    if plan is not None and plan(*tensors):
        return
    made = launch_plan(kernel, grid, slots, *args, **kwargs)
    if made is not None:
        _evict_oldest(_KEPT_LAUNCHES, _KEPT_LAUNCHES_MAX)
        _KEPT_LAUNCHES[whole_key] = made


def _evict_oldest(table: dict, limit: int) -> None:
    """Drop the oldest entries of ``table`` until fewer than ``limit`` remain. Safe while other threads
    launch too (``nn.DataParallel``'s replicas): one of them may drop or add an entry meanwhile."""
    while len(table) >= limit:
        try:
            table.pop(next(iter(table)), None)
        except (StopIteration, RuntimeError):  # (emptied, or changed during the lookup, by another thread)
            return


class LaunchPlan:
    """One direct launch (see :func:`launch`) to repeat: the same compiled kernel, grid and arguments
    except some tensors (``slots``, e.g. an output allocated anew for each launch, or inputs that change
    at every call). The plan passes the other tensors to Triton's launcher as the addresses they had
    when it was made (the launcher then skips its per-tensor lookups) and holds them, so they stay
    allocated: the caller keeps the plan only while those tensors are the ones it would pass (same
    storage, dtype and size; contents may change). ``plan(*tensors)`` (one per slot, in order) launches
    and returns True, or returns False without launching when a tensor would select another
    specialization (its dtype or 16-byte alignment differ), is not on the plan's device, is not
    contiguous or has another number of elements than the planned one, or when Triton's launch would do
    more than launch (hooks, debug modes): the caller then launches as usual. It launches on its own
    device (made current for the launch when another one is), on that device's current stream."""

    __slots__ = ("kernel", "device", "grid", "function", "run", "prefix", "values", "at", "aligned", "dtypes", "numels", "tensors",
                 "names", "kept_names")  # fmt: skip

    def __init__(self, kernel, device: int, grid: tuple, compiled, params: dict, slots: tuple):
        names = self.names = tuple(params)
        self.at = tuple(names.index(name) for name in slots)
        outs = [params[name] for name in slots]
        self.kernel, self.device, self.grid, self.function = kernel, device, grid, compiled.function
        self.aligned = tuple(t.data_ptr() % 16 == 0 for t in outs)
        self.dtypes = tuple(t.dtype for t in outs)
        self.numels = tuple(t.numel() for t in outs)
        self.kept_names = tuple(n for n, v in params.items() if n not in slots and isinstance(v, torch.Tensor))
        self.tensors = tuple(params[n] for n in self.kept_names)
        self.values = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in params.values()]
        launcher = compiled.run
        if (
            getattr(launcher, "global_scratch_size", None) == 0 and getattr(launcher, "profile_scratch_size", None) == 0
            and all(hasattr(launcher, a) for a in ("launch", "launch_cooperative_grid", "launch_pdl"))
        ):  # the launcher object only forwards to its compiled launch (no scratch memory to allocate)
            self.run = launcher.launch
            self.prefix = (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None, compiled.packed_metadata, None, None, None)
        else:
            self.run = launcher
            self.prefix = (compiled.packed_metadata, None, None, None)

    def __call__(self, *tensors: torch.Tensor) -> bool:
        if len(tensors) != len(self.at) or not _plain_launch(self.kernel):
            return False
        values = self.values.copy()
        for tensor, at, aligned, dtype, numel in zip(tensors, self.at, self.aligned, self.dtypes, self.numels):
            ptr = tensor.data_ptr()
            if (
                (ptr % 16 == 0) is not aligned or tensor.dtype is not dtype or tensor.numel() != numel
                or not tensor.is_contiguous() or tensor.get_device() != self.device
            ):  # fmt: skip
                return False
            values[at] = ptr
        if _current_cuda_device() != self.device:  # (the compiled function belongs to its device's context)
            with torch.cuda.device(self.device):
                return self(*tensors)
        gx, gy, gz = self.grid
        self.run(gx, gy, gz, internals.cuda_raw_stream(self.device), self.function, *self.prefix, *values)
        return True

    def retargeted(self, **tensors: torch.Tensor) -> Optional["LaunchPlan"]:
        """This launch with some of the tensors it holds (by parameter name) replaced by others of the
        same dtype, number of elements, device and 16-byte alignment, contiguous — e.g. a block
        layout's plan tables after a reselection rebuilt them in new tensors of the same sizes — as a
        new plan, without Triton's argument binding; None when a replacement differs (the caller then
        launches as usual). Naming a slot or a parameter that is not a tensor is an error."""
        kept = dict(zip(self.kept_names, self.tensors))
        values = self.values.copy()
        for name, tensor in tensors.items():
            if name not in kept:
                raise ValueError(f"retargeted: {name!r} is not a tensor this launch holds (held: {self.kept_names})")
            old = kept[name]
            if (
                tensor.dtype is not old.dtype or tensor.numel() != old.numel() or tensor.device != old.device
                or (tensor.data_ptr() % 16 == 0) is not (old.data_ptr() % 16 == 0) or not tensor.is_contiguous()
            ):  # fmt: skip
                return None
            kept[name] = tensor
            values[self.names.index(name)] = tensor.data_ptr()
        plan = LaunchPlan.__new__(LaunchPlan)
        for attr in LaunchPlan.__slots__:
            setattr(plan, attr, getattr(self, attr))
        plan.tensors, plan.values = tuple(kept[n] for n in self.kept_names), values
        return plan


@triton.jit
def _sddmm_kernel(GT, XT, ROWS, COLS, OUT, nnz, T, stride_g, stride_x, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < nnz
    r = tl.load(ROWS + offs, mask=mask, other=0).to(tl.int64)
    c = tl.load(COLS + offs, mask=mask, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        m = mask[:, None] & (t[None, :] < T)
        g = tl.load(GT + r[:, None] * stride_g + t[None, :], mask=m, other=0.0)
        x = tl.load(XT + c[:, None] * stride_x + t[None, :], mask=m, other=0.0)
        acc += tl.sum(g.to(tl.float32) * x.to(tl.float32), axis=1)
    tl.store(OUT + offs, acc, mask=mask)


def sddmm(grad_out2d: torch.Tensor, x2d: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Σ_t G[t, rows[j]]·X[t, cols[j]] for every j, float32."""
    tokens = grad_out2d.shape[0]
    nnz = rows.numel()
    out = torch.empty(nnz, dtype=torch.float32, device=grad_out2d.device)
    if nnz == 0 or tokens == 0:
        return out.zero_()
    gt = grad_out2d.t().contiguous()  # (out, tokens)
    xt = x2d.t().contiguous()  # (in, tokens)
    block_n, block_t = 64, 64
    grid = (_cdiv(nnz, block_n),)
    _sddmm_kernel[grid](gt, xt, rows, cols, out, nnz, tokens, gt.stride(0), xt.stride(0), BLOCK_N=block_n, BLOCK_T=block_t)
    return out


@triton.jit
def _block_sddmm_kernel(
    G, X, BLOCK_ROWS, BLOCK_COLS, OUT, T, split_tokens, n_blocks, stride_g, stride_x,
    BH: tl.constexpr, BW: tl.constexpr, BLOCK_T: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # program (b, s): block b over the token range [s·split_tokens, (s+1)·split_tokens)
    b = tl.program_id(0)
    s = tl.program_id(1)
    rows = tl.load(BLOCK_ROWS + b).to(tl.int64) * BH + tl.arange(0, BH)
    cols = tl.load(BLOCK_COLS + b).to(tl.int64) * BW + tl.arange(0, BW)
    acc = tl.zeros((BH, BW), dtype=tl.float32)
    t_start = s * split_tokens
    t_end = tl.minimum(T, t_start + split_tokens)
    for t0 in range(t_start, t_end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tm = t < t_end
        gt = tl.load(G + t[None, :].to(tl.int64) * stride_g + rows[:, None], mask=tm[None, :], other=0.0)  # (BH, BLOCK_T)
        x = tl.load(X + t[:, None].to(tl.int64) * stride_x + cols[None, :], mask=tm[:, None], other=0.0)  # (BLOCK_T, BW)
        acc += tl.dot(gt, x, input_precision=PRECISION)
    offs = (s * n_blocks + b).to(tl.int64) * BH * BW + tl.arange(0, BH)[:, None] * BW + tl.arange(0, BW)[None, :]
    tl.store(OUT + offs, acc)


@triton.jit
def _row_block_sddmm_kernel(
    G, X, BLOCK_ROWS, BLOCK_COLS, OUT, T, split_tokens, n_blocks, stride_g, stride_x, BW: tl.constexpr, BLOCK_T: tl.constexpr
):
    b = tl.program_id(0)
    s = tl.program_id(1)
    row = tl.load(BLOCK_ROWS + b).to(tl.int64)
    cols = tl.load(BLOCK_COLS + b).to(tl.int64) * BW + tl.arange(0, BW)
    acc = tl.zeros((BW,), dtype=tl.float32)
    t_start = s * split_tokens
    t_end = tl.minimum(T, t_start + split_tokens)
    for t0 in range(t_start, t_end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tm = t < t_end
        g = tl.load(G + t.to(tl.int64) * stride_g + row, mask=tm, other=0.0).to(tl.float32)  # (BLOCK_T,)
        x = tl.load(X + t[:, None].to(tl.int64) * stride_x + cols[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
        acc += tl.sum(g[:, None] * x, axis=0)
    tl.store(OUT + (s * n_blocks + b).to(tl.int64) * BW + tl.arange(0, BW), acc)


# programs to aim for per launch: a few waves of the GPU's multiprocessors, so that layers with few
# active blocks still fill the GPU (each program then covers a slice of the tokens)
_PROGRAMS_PER_SM = 4
_SM_COUNT: dict[int, int] = {}


def token_splits(n_blocks: int, tokens: int, block_t: int, target_programs: int) -> tuple[int, int]:
    """(splits, tokens per split): how many token slices each block's product is cut into.

    A block's product runs over all tokens inside one program, so with few blocks most of the GPU
    idles while each program walks the token axis alone; cutting the tokens into slices (partial
    products summed afterwards) gives ≈ ``target_programs`` programs, each slice at least 4 steps of
    ``block_t`` tokens long. The slice length is a multiple of ``block_t``.
    """
    want = max(1, -(-target_programs // max(1, n_blocks)))
    most = max(1, tokens // (4 * block_t))
    splits = min(want, most)
    per = -(-tokens // splits)
    per = -(-per // block_t) * block_t
    return -(-tokens // per), per


def _target_programs(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _PROGRAMS_PER_SM * _SM_COUNT[index]


def block_sddmm(
    grad_out2d: torch.Tensor, x2d: torch.Tensor, block_rows: torch.Tensor, block_cols: torch.Tensor, bh: int, bw: int,
    target_programs: Optional[int] = None,
) -> torch.Tensor:
    """(nblocks, bh, bw) float32: the dW tiles of the given blocks (block row/column numbers).

    ``target_programs`` (default: 4 per multiprocessor on CUDA, 1 elsewhere) sets how finely the
    token axis is sliced (:func:`token_splits`).
    """
    n = block_rows.numel()
    tokens = grad_out2d.shape[0]
    if n == 0 or tokens == 0:
        return torch.zeros(n, bh, bw, dtype=torch.float32, device=grad_out2d.device)
    if not (bh == 1 or (bh >= 16 and bw >= 16)):
        raise ValueError(f"block_sddmm supports block_shape (1, bw) or (≥16, ≥16), got ({bh}, {bw})")
    g = grad_out2d.contiguous()
    x = x2d.contiguous()
    if bh > 1 and g.dtype != x.dtype:
        x = x.to(g.dtype)
    block_t = 64 if max(bh, bw) <= 64 else 32
    target = target_programs or (_target_programs(g.device) if g.is_cuda else 1)
    splits, per = token_splits(n, tokens, block_t, target)
    out = torch.empty(splits, n, bh, bw, dtype=torch.float32, device=g.device)
    grid = (n, splits)
    if bh == 1:
        _row_block_sddmm_kernel[grid](g, x, block_rows, block_cols, out, tokens, per, n, g.stride(0), x.stride(0), BW=bw, BLOCK_T=block_t)
    else:
        _block_sddmm_kernel[grid](
            g, x, block_rows, block_cols, out, tokens, per, n, g.stride(0), x.stride(0), BH=bh, BW=bw, BLOCK_T=block_t,
            PRECISION=dot_precision(g.dtype),
        )  # fmt: skip
    return out[0] if splits == 1 else out.sum(0)


@triton.jit
def _x_tile(X, X2, offs, mask, PRODUCT: tl.constexpr):
    """A tile of X, or of X ⊙ X2 rounded to X's type as torch's multiplication rounds it (float32
    product, one rounding)."""
    x = tl.load(X + offs, mask=mask, other=0.0)
    if PRODUCT:
        x = _round_to(x.to(tl.float32) * tl.load(X2 + offs, mask=mask, other=0.0).to(tl.float32), X)
    return x


@triton.jit
def _grouped_block_sddmm_kernel(
    G, X, X2, LINE, OTHER, BASE, STRIDE, OUT, T, split_tokens, split_stride, stride_g, stride_x,
    SHARE_ROWS: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr,
    ACCUMULATE: tl.constexpr, PRODUCT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # program (p, s): group p — up to GROUP blocks on one block row (SHARE_ROWS: one ∂L/∂Y tile read
    # for all of them) or one block column (one X tile) — over the token slice s. Element (i, j) of a
    # block goes to OUT[s·split_stride + base + i·stride + j] (ascending element order of the values).
    # PRODUCT: X is the elementwise product X ⊙ X2 (same layout), formed tile by tile as torch's
    # multiplication rounds it, so that the product never goes through memory
    p = tl.program_id(0)
    s = tl.program_id(1)
    line = tl.load(LINE + p).to(tl.int64)
    if line < 0:  # the plan's spare rows (its size is a bound, known without a host sync)
        return
    t_start = s * split_tokens
    t_end = tl.minimum(T, t_start + split_tokens)
    if SHARE_ROWS:  # acc (BH, GROUP·BW) = G[:, row block]ᵀ · X[:, the members' column blocks]
        k = tl.arange(0, GROUP * BW)
        member = k // BW
        other = tl.load(OTHER + p * GROUP + member)
        valid = other >= 0
        rows = line * BH + tl.arange(0, BH)
        cols = other.to(tl.int64) * BW + k % BW
        acc = tl.zeros((BH, GROUP * BW), dtype=tl.float32)
        for t0 in range(t_start, t_end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tm = t < t_end
            gt = tl.load(G + t[None, :].to(tl.int64) * stride_g + rows[:, None], mask=tm[None, :], other=0.0)
            x = _x_tile(X, X2, t[:, None].to(tl.int64) * stride_x + cols[None, :], tm[:, None] & valid[None, :], PRODUCT)
            acc += tl.dot(gt, x, input_precision=PRECISION)
        base = tl.load(BASE + p * GROUP + member, mask=valid, other=0)
        stride = tl.load(STRIDE + p * GROUP + member, mask=valid, other=0).to(tl.int64)
        offs = base[None, :] + tl.arange(0, BH)[:, None].to(tl.int64) * stride[None, :] + (k % BW)[None, :]
        mask = valid[None, :]
    else:  # acc (GROUP·BH, BW) = G[:, the members' row blocks]ᵀ · X[:, column block]
        k = tl.arange(0, GROUP * BH)
        member = k // BH
        other = tl.load(OTHER + p * GROUP + member)
        valid = other >= 0
        rows = other.to(tl.int64) * BH + k % BH
        cols = line * BW + tl.arange(0, BW)
        acc = tl.zeros((GROUP * BH, BW), dtype=tl.float32)
        for t0 in range(t_start, t_end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tm = t < t_end
            gt = tl.load(G + t[None, :].to(tl.int64) * stride_g + rows[:, None], mask=tm[None, :] & valid[:, None], other=0.0)
            x = _x_tile(X, X2, t[:, None].to(tl.int64) * stride_x + cols[None, :], tm[:, None], PRODUCT)
            acc += tl.dot(gt, x, input_precision=PRECISION)
        base = tl.load(BASE + p * GROUP + member, mask=valid, other=0)
        stride = tl.load(STRIDE + p * GROUP + member, mask=valid, other=0).to(tl.int64)
        offs = base[:, None] + (k % BH)[:, None].to(tl.int64) * stride[:, None] + tl.arange(0, BW)[None, :]
        mask = valid[:, None]
    offs += s.to(tl.int64) * split_stride
    if ACCUMULATE:
        acc += tl.load(OUT + offs, mask=mask, other=0.0)
    tl.store(OUT + offs, acc, mask=mask)


class BlockGroups:
    """The launch plan of :func:`block_sddmm_into` for one block layout: the active blocks cut into
    groups of up to ``group`` blocks that share a block row (``share_rows``) or a block column, so
    that each group reads the shared operand's tile once for all its blocks. Row p of the plan holds
    group p's shared line and, per member, its other coordinate (−1: no member), base and stride.

    Built on the device with a handful of torch operations and no host synchronisation (:meth:`of_layouts`,
    for many layouts at once): the number of groups is bounded by ``n // group + lines`` and the spare
    rows of the plan hold line −1."""

    __slots__ = ("line", "other", "base", "stride", "share_rows", "group", "size")

    def __init__(self, line, other, base, stride, share_rows: bool, group: int):
        self.line, self.other, self.base, self.stride = line, other, base, stride
        self.share_rows, self.group, self.size = share_rows, group, line.numel()

    @staticmethod
    def of_layouts(layouts: list, share_rows: bool, group: int) -> list:
        """The plans of ``layouts`` (one device and block shape) in one orientation, built together:
        the launches do not grow with the number of layouts."""
        bh, bw = layouts[0].block_shape
        dev = layouts[0].rows.device
        ns = [layout.rows.numel() for layout in layouts]
        lines = [layout.out_features // bh if share_rows else layout.in_features // bw for layout in layouts]
        # rows per plan: a bound on its groups, rounded up to 4 so that every plan's arrays start 16-byte
        # aligned inside the shared ones (Triton compiles a kernel variant per alignment of its pointers)
        sizes = [-(-max(1, n // group + min(m, n)) // 4) * 4 for n, m in zip(ns, lines)]
        total = sum(sizes)
        line_t = torch.full((total,), -1, dtype=torch.int32, device=dev)
        other_t = torch.full((total, group), -1, dtype=torch.int32, device=dev)
        base_t = torch.zeros((total, group), dtype=torch.int64, device=dev)
        stride_t = torch.zeros((total, group), dtype=torch.int32, device=dev)
        n_all = sum(ns)
        if n_all:
            # blocks keyed by (layout, line); they come in (row, col) order, so a stable sort by the key
            # groups them by column when columns are shared
            seg = torch.repeat_interleave(torch.arange(len(layouts), device=dev), table(ns, dev), output_size=n_all)
            line = torch.cat([layout.rows if share_rows else layout.cols for layout in layouts]).long()
            other = torch.cat([layout.cols if share_rows else layout.rows for layout in layouts])
            base = torch.cat([layout.base for layout in layouts])
            stride = torch.cat([layout.stride for layout in layouts])
            key = (seg << 32) | line
            if not share_rows:
                key, order = torch.sort(key, stable=True)
                line, other, base, stride = line[order], other[order], base[order], stride[order]
            rank = torch.arange(n_all, device=dev) - torch.searchsorted(key, key)  # place on its line
            slot = rank % group
            gid = torch.cumsum(slot == 0, 0) - 1  # groups numbered over all layouts
            first, offset, firsts, offsets = 0, 0, [], []
            for n, size in zip(ns, sizes):
                firsts.append(min(first, n_all - 1))
                offsets.append(offset)
                first, offset = first + n, offset + size
            # each layout's first group goes to the first row of its own plan
            shift = table(offsets, dev) - gid[table(firsts, dev)]
            row = gid + shift[seg]
            line_t[row] = line.to(torch.int32)
            other_t[row, slot] = other.to(torch.int32)
            base_t[row, slot] = base.long()
            stride_t[row, slot] = stride.to(torch.int32)
        parts = zip(line_t.split(sizes), other_t.split(sizes), base_t.split(sizes), stride_t.split(sizes))
        return [BlockGroups(a, b, c, d, share_rows, group) for a, b, c, d in parts]


def default_group(block_shape) -> int:
    """Blocks per program: 4 of up to 32×32, fewer for larger blocks (a program's tile stays within
    128 rows or columns)."""
    return max(1, 128 // max(block_shape))


def plan_key(layout, group: Optional[int] = None, x_reads: int = 1) -> tuple[bool, int]:
    """(share_rows, group) of the plan :func:`block_group_plan` uses for ``layout``. Groups share the
    operand whose sharing saves more reads: per block, a program reads bh/m rows of ∂L/∂Y and
    x_reads·bw of X when ``m`` blocks share a block row (m = the group size, or fewer when block rows
    hold fewer active blocks on average), or x_reads·bw/m and bh when they share a block column.
    ``x_reads`` is 2 when X is formed from two factors in the kernel."""
    bh, bw = layout.block_shape
    group = group or default_group(layout.block_shape)
    rows, cols = layout.out_features // bh, layout.in_features // bw
    n = layout.rows.numel()
    by_rows = bh / min(group, max(1.0, n / rows)) + x_reads * bw
    by_cols = x_reads * bw / min(group, max(1.0, n / cols)) + bh
    return by_rows <= by_cols, group


def block_group_plan(layout, group: Optional[int] = None, x_reads: int = 1) -> BlockGroups:
    """The :class:`BlockGroups` of ``layout`` (a :class:`~peft_sparse.core.kernels.BlockLayout`) for
    :func:`plan_key`'s orientation, cached on it."""
    key = plan_key(layout, group, x_reads)
    plan = layout.plans.get(key)
    if plan is None:
        build_plans([layout], [key])
        plan = layout.plans[key]
    return plan


def build_plans(layouts: list, keys: list) -> None:
    """Cache ``layouts[i].plans[keys[i]]`` (keys: (share_rows, group)) where missing: for all layouts
    of one key and device at once — a fixed number of launches, not one plan's worth per layout —
    (:meth:`BlockGroups.of_layouts`)."""
    todo: dict = {}
    for layout, key in zip(layouts, keys):
        if key not in layout.plans:
            todo.setdefault((key, layout.rows.device, layout.block_shape), []).append(layout)
    for ((share_rows, group), _, _), members in todo.items():
        plans = BlockGroups.of_layouts(members, share_rows, group)
        for layout, plan in zip(members, plans):
            layout.plans[(share_rows, group)] = plan


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision for float32 operands that follows torch's matmul setting: full
    float32 unless TF32 is allowed (``torch.backends.cuda.matmul.allow_tf32`` /
    ``torch.set_float32_matmul_precision``); 16-bit operands are exact either way."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def block_sddmm_into(
    grad_out2d: torch.Tensor, x2d: torch.Tensor, layout, out: torch.Tensor, accumulate: bool = False,
    group: Optional[int] = None, target_programs: Optional[int] = None, x_factor: Optional[torch.Tensor] = None,
    keep: Optional[list] = None,
) -> torch.Tensor:  # fmt: skip
    """The block-sparse dW of ``layout``'s blocks written (or, ``accumulate``, added) into the float32
    ``out`` in ascending element order — the values' order — without an intermediate tile tensor:
    element (i, j) of block b lands at ``layout.base[b] + i·layout.stride[b] + j``. ``group`` (default:
    4 blocks of up to 32×32, fewer for larger blocks, so a program's tile stays within 128 rows or
    columns) caps the blocks per program. ``x_factor`` (X's shape and dtype): X is ``x2d ⊙ x_factor``,
    formed tile by tile in the kernel with torch's rounding. ``keep``: see :func:`launch_grouped`."""
    bh, bw = layout.block_shape
    if bh < 16 or bw < 16:
        raise ValueError(f"block_sddmm_into supports blocks of at least 16×16, got {(bh, bw)}")
    tokens = grad_out2d.shape[0]
    if layout.rows.numel() == 0:
        return out
    if tokens == 0:
        return out if accumulate else out.zero_()
    g = grad_out2d.contiguous()
    x = x2d.contiguous()
    if x_factor is not None:
        if x_factor.shape != x.shape or x_factor.dtype != x.dtype:
            raise ValueError(f"x_factor must match x2d's shape and dtype, got {tuple(x_factor.shape)} {x_factor.dtype} "
                             f"against {tuple(x.shape)} {x.dtype}")  # fmt: skip
        x_factor = x_factor.contiguous()
        if x.dtype != g.dtype:  # the product in X's type first, as torch forms it
            x, x_factor = (x * x_factor).to(g.dtype), None
    elif g.dtype != x.dtype:
        x = x.to(g.dtype)
    block_t = 64 if max(bh, bw) <= 64 else 32
    target = target_programs or (_target_programs(g.device) if g.is_cuda else 1)
    plan = block_group_plan(layout, group, 1 if x_factor is None else 2)
    return launch_grouped(g, x, layout.block_shape, plan, out, accumulate, block_t, target, x_factor=x_factor, keep=keep)


def block_value_gradient(grad_out2d: torch.Tensor, x2d: torch.Tensor, layout, x_factor: Optional[torch.Tensor] = None,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
    """:func:`block_sddmm_into` of ``layout``'s blocks into a new float32 tensor: a block adapter's value
    gradient, in the values' order; or, given ``out`` (float32, contiguous, the layout's size), added to
    ``out`` (e.g. an AG window's sums at candidate blocks). The launch made for a call shape (tokens,
    element types, ``tl.dot`` precision, X formed in the kernel or not, new tensor or sum) is kept on
    the layout (``layout.launches``, a :class:`LaunchPlan` and its token slices) and repeated for the
    next calls of that shape with their tensors — a training step's backward makes one such call per
    layer, and the repeat skips the choice of group plan and token slices and Triton's argument
    binding. The same kernel, grid and settings, so the same bits."""
    bh, bw = layout.block_shape
    n = layout.rows.numel() * bh * bw
    g, x = grad_out2d.contiguous(), x2d.contiguous()
    x2 = x if x_factor is None else x_factor.contiguous()
    accumulate = out is not None
    key = (g.shape[0], g.dtype, x.dtype, x2.dtype, x_factor is not None, dot_precision(g.dtype), accumulate)
    kept = layout.launches.get(key)
    if kept is not None and (x_factor is None or x_factor.shape == x.shape):
        plan, splits = kept
        if splits > 1:
            dest = torch.empty(splits, n, dtype=torch.float32, device=g.device)
        else:
            dest = out if accumulate else torch.empty(n, dtype=torch.float32, device=g.device)
        if plan(g, x, x2, dest):
            if splits == 1:
                return dest
            if not accumulate:
                return dest.sum(0)
            out += dest.sum(0)  # (as launch_grouped sums its token slices into an accumulated output)
            return out
        layout.launches.pop(key, None)  # (it does not apply: launched as usual, and kept anew if it can be)
    if not accumulate:
        out = torch.empty(n, dtype=torch.float32, device=g.device)
    made = [] if g.dtype == x.dtype == x2.dtype else None  # (no conversion in between: the plan's tensors are these)
    block_sddmm_into(g, x, layout, out, accumulate=accumulate, x_factor=x_factor, keep=made)
    if made and made[0][0] is not None:
        _evict_oldest(layout.launches, _LAUNCHES_KEPT)  # (e.g. token counts that change from step to step)
        layout.launches[key] = made[0]
    return out


_LAUNCHES_KEPT = 4  # kept value-gradient launches per layout (call shapes)


def carry_launches(old, new) -> None:
    """Give the layout ``new`` the value-gradient launches kept on ``old`` (see
    :func:`block_value_gradient`) when both place as many blocks in a tensor of the same shape — a
    reselection's new layout of a layer —, retargeted to ``new``'s group plans, which must be built
    already (e.g. by :func:`build_plans` with ``old``'s plan keys): a plan's size depends only on the
    block count and the tensor's shape (:meth:`BlockGroups.of_layouts`), so the grid, the token slices
    and the compiled kernel stay; only the plan tables change."""
    if (not old.launches or old.rows.numel() != new.rows.numel() or old.block_shape != new.block_shape
            or (old.out_features, old.in_features) != (new.out_features, new.in_features)):  # fmt: skip
        return
    for key, (plan, splits) in old.launches.items():
        groups_key = plan_key(new, None, 2 if key[4] else 1)  # (key[4]: X formed from two factors)
        was, now = old.plans.get(groups_key), new.plans.get(groups_key)
        if key in new.launches or was is None or now is None or now.size != was.size:
            continue
        moved = plan.retargeted(LINE=now.line, OTHER=now.other, BASE=now.base, STRIDE=now.stride)
        if moved is not None:
            new.launches[key] = (moved, splits)


def launch_grouped(g, x, block_shape, plan: BlockGroups, out, accumulate: bool, block_t: int, target: int,
                   num_warps: int = 4, num_stages: int = 2, x_factor: Optional[torch.Tensor] = None,
                   keep: Optional[list] = None) -> torch.Tensor:  # fmt: skip
    """One launch of the grouped block kernel with explicit settings (``target`` 0: no token slices);
    :func:`block_sddmm_into` picks them (chosen by a sweep of these settings on an H200). ``x_factor``: X is
    ``x ⊙ x_factor`` (same strides). ``keep`` (a list): receives (a :class:`LaunchPlan` repeating the
    launch with new G, X, X2 and output tensors, or None; the number of token slices)."""
    bh, bw = block_shape
    tokens = g.shape[0]
    splits, per = token_splits(plan.size, tokens, block_t, target) if target else (1, tokens)
    dest = out if splits == 1 else torch.empty(splits, out.numel(), dtype=torch.float32, device=out.device)
    made = launch_plan(_grouped_block_sddmm_kernel, (plan.size, splits), ("G", "X", "X2", "OUT") if keep is not None else None,
        g, x, x if x_factor is None else x_factor, plan.line, plan.other, plan.base, plan.stride, dest, tokens, per,
        out.numel(), g.stride(0), x.stride(0),
        SHARE_ROWS=plan.share_rows, BH=bh, BW=bw, GROUP=plan.group, BLOCK_T=block_t, ACCUMULATE=accumulate and splits == 1,
        PRODUCT=x_factor is not None, PRECISION=dot_precision(g.dtype), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if keep is not None:
        keep.append((made, splits))
    if splits > 1:
        if accumulate:
            out += dest.sum(0)
        else:
            torch.sum(dest, 0, out=out)
    return out


@triton.jit
def _lower_bound(IDX, n, target, n_iter, K: tl.constexpr):
    """First j in [0, n] with IDX[j] ≥ target (IDX ascending), by K-ary search: each round loads K
    evenly spaced entries of the bracket at once (one memory round trip, not one per halving) and
    shrinks it to the gap between two of them; ``n_iter`` rounds (:func:`_search_rounds`) suffice."""
    lo = tl.program_id(0).to(tl.int64) * 0  # a tensor even when Triton specialises n == 1 into a constant
    hi = lo + n
    for _ in range(n_iter):
        step = (hi - lo + K - 1) // K
        probes = lo + tl.arange(0, K).to(tl.int64) * step
        below = (probes < hi) & (tl.load(IDX + probes, mask=probes < hi, other=0).to(tl.int64) < target)
        count = tl.sum(below.to(tl.int64), axis=0)  # probes below target: a prefix of them
        hi = tl.minimum(hi, lo + count * step)  # the first probe not below target (or the old end)
        lo = tl.where(count > 0, lo + (count - 1) * step + 1, lo)
    return lo


def _search_rounds(n: int, k: int) -> int:
    """Rounds of :func:`_lower_bound` that shrink a bracket of n entries to none."""
    rounds = 0
    while n > 0:
        n = -(-n // k) - 1
        rounds += 1
    return max(rounds, 1)


@triton.jit
def _block_score_keys_kernel(DENSE, KEYS, in_features, grid_cols, BH: tl.constexpr, BW: tl.constexpr):
    # program u: block u of the grid (row-major); key = float32 bits of Σ|block| << 32 | (2³²−1 − u)
    u = tl.program_id(0).to(tl.int64)
    r = u // grid_cols
    c = u % grid_cols
    offs = (r * BH + tl.arange(0, BH))[:, None] * in_features + c * BW + tl.arange(0, BW)[None, :]
    total = tl.sum(tl.sum(tl.abs(tl.load(DENSE + offs).to(tl.float32)), axis=1), axis=0)
    bits = total.to(tl.int32, bitcast=True).to(tl.int64)
    tl.store(KEYS + u, (bits << 32) | (tl.full((), 4294967295, tl.int64) - u))


def block_score_keys(dense: torch.Tensor, block_shape) -> torch.Tensor:
    """:func:`~peft_sparse.core.kernels.block_score_keys_reference` in one launch (contiguous ``dense``)."""
    bh, bw = block_shape
    out_f, in_f = dense.shape
    n = (out_f // bh) * (in_f // bw)
    keys = torch.empty(n, dtype=torch.int64, device=dense.device)
    if n:
        launch_kept(_block_score_keys_kernel, (n,), (out_f, in_f, dense.dtype, bh, bw), ("DENSE", "KEYS"), (dense, keys),
                    dense, keys, in_f, in_f // bw, BH=bh, BW=bw, num_warps=4)  # fmt: skip
    return keys


_TOP_BLOCKS_CHUNK = 1024


@triton.jit
def _top_blocks_kernel(KEYS, n, k, OUT, CHUNK: tl.constexpr):
    # one program. The keys' high 32 bits (the signed float32 bits of a block's sum, shifted to unsigned
    # order) decide; ties go to lower positions, as the low 32 bits (2³²−1 − position) rank them. Four
    # radix levels of 8 bits find the high bits of the k-th largest key and how many keys lie above
    # them; one pass over the keys then writes, in ascending order, the positions above those bits and
    # the lowest tied positions still needed
    bins = tl.arange(0, 256)
    kth = tl.full((), 0, tl.int64)  # the k-th largest key's high bits, found 8 bits at a time
    need = tl.full((), 0, tl.int64) + k  # how many of the keys that share kth's bits found so far to take
    for level in tl.static_range(4):
        shift = 24 - 8 * level
        hist = tl.zeros((256,), tl.int32)
        for start in range(0, n, CHUNK):
            offs = start + tl.arange(0, CHUNK).to(tl.int64)
            m = offs < n
            high = (tl.load(KEYS + offs, mask=m, other=0) >> 32) + 2147483648  # in [0, 2³²)
            match = m & ((high >> (shift + 8)) == (kth >> (shift + 8)))
            hist += tl.histogram(((high >> shift) & 255).to(tl.int32), 256, mask=match)
        counts = hist.to(tl.int64)
        above = tl.sum(counts, axis=0) - tl.cumsum(counts, 0)  # keys in the bins above each bin
        pick = (above < need) & (above + counts >= need)
        kth += tl.sum(tl.where(pick, bins.to(tl.int64), 0), axis=0) << shift
        need -= tl.sum(tl.where(pick, above, 0), axis=0)
    written = tl.full((), 0, tl.int64)
    tied = tl.full((), 0, tl.int64)
    for start in range(0, n, CHUNK):
        offs = start + tl.arange(0, CHUNK).to(tl.int64)
        m = offs < n
        high = (tl.load(KEYS + offs, mask=m, other=0) >> 32) + 2147483648
        eq = (m & (high == kth)).to(tl.int64)
        rank = tied + tl.cumsum(eq, 0) - eq
        take = ((m & (high > kth)) | ((eq > 0) & (rank < need))).to(tl.int64)
        tl.store(OUT + written + tl.cumsum(take, 0) - take, offs, mask=take > 0)
        written += tl.sum(take, axis=0)
        tied += tl.sum(eq, axis=0)


def top_blocks(keys: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`~peft_sparse.core.kernels.top_blocks` for 0 < k < ``keys.numel()`` (contiguous int64 keys of
    :func:`block_score_keys`) in one launch: no top-k, no sort."""
    out = torch.empty(k, dtype=torch.int64, device=keys.device)
    n = keys.numel()
    launch_kept(_top_blocks_kernel, (1,), (n, k), ("KEYS", "OUT"), (keys, out), keys, n, k, out, CHUNK=_TOP_BLOCKS_CHUNK, num_warps=4)
    return out


# top_magnitudes, top_scaled_magnitudes: the k largest of non-negative integer keys by radix selection, 8 bits a
# level from the top and 7 in the last. |x| of a 16-bit float is a 15-bit key (its bits with the sign cleared:
# non-negative floats order like their bit patterns), selected in two levels; |x / s_j| of a 16-bit x over its
# column's float32 scale a 31-bit key (the float32 quotient's bits, sign cleared), in four
_RADIX_BINS, _SELECT_BLOCK = 256, 4096
_NARROW_COLUMNS = 2**31 - _SELECT_BLOCK  # the most columns whose chunk offsets stay 32-bit (_radix_chunk)


@triton.jit
def _radix_chunk(c, n, in_features, SCALED: tl.constexpr, WIDE: tl.constexpr, BLOCK: tl.constexpr):
    """(positions, mask, columns) of chunk ``c``: its BLOCK flat positions, which lie below n, and with SCALED their
    columns in an (·, in_features) matrix — one 64-bit remainder for the chunk, 32-bit ones per entry (the chunk's
    first column plus an offset below BLOCK stays under 2³¹ unless WIDE: in_features > 2³¹ − BLOCK, then 64-bit
    ones), where a 64-bit remainder per entry would cost a long instruction sequence in every pass."""
    start = c.to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if SCALED and WIDE:
        cols = offs % in_features
    elif SCALED:
        cols = ((start % in_features).to(tl.int32) + tl.arange(0, BLOCK)) % in_features
    else:
        cols = tl.arange(0, BLOCK)  # (not read)
    return offs, offs < n, cols


@triton.jit
def _radix_keys(X, S, offs, m, cols, SCALED: tl.constexpr):
    """(key, x as float32) of the entries at ``offs``: with SCALED the quotient x / S[column] rounded to nearest (the
    division torch does), else x itself."""
    x = tl.load(X + offs, mask=m, other=0.0)
    xf = x.to(tl.float32)
    if SCALED:
        s = tl.load(S + cols, mask=m, other=1.0)
        key = tl.math.div_rn(xf, s).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    else:
        key = x.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF
    return key, xf


@triton.jit
def _radix_bin(HIST, k, NBINS: tl.constexpr):
    """(bin, count above it): the bin, from the top, where the k-th largest key falls."""
    rev = tl.load(HIST + NBINS - 1 - tl.arange(0, NBINS)).to(tl.int64)  # counts from the highest bin down
    upto = tl.cumsum(rev, 0)
    j = tl.sum((upto < k).to(tl.int32), axis=0)  # bins (from the top) holding fewer than k together
    above = tl.sum(tl.where(tl.arange(0, NBINS) < j, rev, 0), axis=0)
    return NBINS - 1 - j, above


@triton.jit
def _radix_prefix(HIST, k, UPTO: tl.constexpr, LEVELS: tl.constexpr, BINS: tl.constexpr):
    """(prefix, count of keys above it): the bits of the k-th largest key that levels 0 … UPTO − 1 fix, from
    their histograms (level l's at HIST + l·BINS; the last level has BINS / 2 bins); UPTO = LEVELS: the key."""
    prefix = tl.full((), 0, tl.int64)
    above = tl.full((), 0, tl.int64)
    for level in tl.static_range(UPTO):
        if level == LEVELS - 1:
            b, a = _radix_bin(HIST + level * BINS, k - above, BINS // 2)
            prefix = prefix * (BINS // 2) + b
        else:
            b, a = _radix_bin(HIST + level * BINS, k - above, BINS)
            prefix = prefix * BINS + b
        above += a
    return prefix, above


@triton.jit
def _radix_histogram_kernel(
    X, S, in_features, n, HIST, k, LEVEL: tl.constexpr, LEVELS: tl.constexpr, SCALED: tl.constexpr, WIDE: tl.constexpr,
    BINS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # level LEVEL's histogram of the keys whose higher levels' bits are the k-th largest key's (level 0: of all
    # keys); each program finds those bits from the earlier levels' histograms
    offs, m, cols = _radix_chunk(tl.program_id(0), n, in_features, SCALED, WIDE, BLOCK)
    key, _ = _radix_keys(X, S, offs, m, cols, SCALED)
    if LEVEL == 0:
        sel = m
    else:
        prefix, _ = _radix_prefix(HIST, k, LEVEL, LEVELS, BINS)
        sel = m & ((key >> (8 * (LEVELS - LEVEL) - 1)) == prefix)
    # (only the chunk's bins that hold keys are added: after level 0 most chunks hold none, and at level 0 the
    # keys' exponents fill few of the bins)
    if LEVEL == LEVELS - 1:
        counts = tl.histogram(key & (BINS // 2 - 1), BINS // 2, mask=sel)
        tl.atomic_add(HIST + LEVEL * BINS + tl.arange(0, BINS // 2), counts.to(tl.int64), mask=counts > 0)
    else:
        digit = (key >> (8 * (LEVELS - 1 - LEVEL) - 1)) & (BINS - 1)
        counts = tl.histogram(digit, BINS, mask=sel)
        tl.atomic_add(HIST + LEVEL * BINS + tl.arange(0, BINS), counts.to(tl.int64), mask=counts > 0)


@triton.jit
def _radix_counts_kernel(
    X, S, in_features, n, HIST, k, COUNTS, n_chunks, LEVELS: tl.constexpr, SCALED: tl.constexpr, WIDE: tl.constexpr,
    BINS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # per chunk: how many keys lie above the k-th largest key, and how many equal it
    c = tl.program_id(0)
    offs, m, cols = _radix_chunk(c, n, in_features, SCALED, WIDE, BLOCK)
    key, _ = _radix_keys(X, S, offs, m, cols, SCALED)
    kth, _ = _radix_prefix(HIST, k, LEVELS, LEVELS, BINS)
    tl.store(COUNTS + c, tl.sum((m & (key > kth)).to(tl.int64), axis=0))
    tl.store(COUNTS + n_chunks + c, tl.sum((m & (key == kth)).to(tl.int64), axis=0))


@triton.jit
def _radix_select_kernel(
    X, S, in_features, n, HIST, k, PREFIX, n_chunks, IDX, OUT, LEVELS: tl.constexpr, SCALED: tl.constexpr,
    WIDE: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # chunk c writes its chosen entries — all keys above the k-th largest, and the tied ones while fewer
    # than the k − (count above) ties before them were taken — at their ranks among all chosen entries
    c = tl.program_id(0)
    offs, m, cols = _radix_chunk(c, n, in_features, SCALED, WIDE, BLOCK)
    key, x = _radix_keys(X, S, offs, m, cols, SCALED)
    kth, above_total = _radix_prefix(HIST, k, LEVELS, LEVELS, BINS)
    need = k - above_total  # ties to take, lowest positions first
    above = (m & (key > kth)).to(tl.int64)
    tied = (m & (key == kth)).to(tl.int64)
    above_before = tl.load(PREFIX + c)  # in earlier chunks (exclusive prefix sums)
    tied_before = tl.load(PREFIX + n_chunks + c)
    tied_rank = tied_before + tl.cumsum(tied, 0) - tied
    chosen = (above + tied * (tied_rank < need).to(tl.int64)) > 0
    pos = above_before + tl.minimum(tied_before, need) + tl.cumsum(chosen.to(tl.int64), 0) - chosen.to(tl.int64)
    tl.store(IDX + pos, offs.to(IDX.dtype.element_ty), mask=chosen)
    tl.store(OUT + pos, x, mask=chosen)


def _radix_top(flat: torch.Tensor, scale: Optional[torch.Tensor], k: int, index_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascending positions of the k largest keys of ``flat`` (16-bit; with ``scale``, a contiguous (out, in) matrix's
    entries over their column's scale) and the entries there in float32: the levels' histograms, per-chunk counts
    and one prefix sum place every chosen entry, no sort and no key array."""
    n = flat.numel()
    dev = flat.device
    levels = 2 if scale is None else 4
    hist = torch.zeros(levels * _RADIX_BINS, dtype=torch.int64, device=dev)  # (a bin may hold 2³¹ entries or more)
    chunks = _cdiv(n, _SELECT_BLOCK)
    scales, in_features = (flat, 1) if scale is None else (scale, scale.numel())  # (not read without a scale)
    wide = in_features > _NARROW_COLUMNS  # (columns then as 64-bit remainders: _radix_chunk)
    consts = dict(LEVELS=levels, SCALED=scale is not None, WIDE=wide, BINS=_RADIX_BINS, BLOCK=_SELECT_BLOCK)
    for level in range(levels):
        launch(_radix_histogram_kernel, (chunks,), flat, scales, in_features, n, hist, k, LEVEL=level, **consts)
    counts = torch.empty(2, chunks, dtype=torch.int64, device=dev)
    launch(_radix_counts_kernel, (chunks,), flat, scales, in_features, n, hist, k, counts, chunks, **consts)
    prefix = counts.cumsum(1) - counts  # exclusive, per row
    idx = torch.empty(k, dtype=index_dtype, device=dev)
    out = torch.empty(k, dtype=torch.float32, device=dev)
    launch(_radix_select_kernel, (chunks,), flat, scales, in_features, n, hist, k, prefix, chunks, idx, out, **consts)
    return idx, out


def top_magnitudes(dense: torch.Tensor, k: int, index_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~peft_sparse.core.kernels.top_magnitudes_reference` for a contiguous 16-bit ``dense`` and 0 < k < its
    size: two radix levels of |x| (:func:`_radix_top`)."""
    return _radix_top(dense.view(-1), None, k, index_dtype)


def top_scaled_magnitudes(dense: torch.Tensor, scale: torch.Tensor, k: int, index_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~peft_sparse.core.kernels.top_scaled_magnitudes_reference` for a contiguous 16-bit (out, in) ``dense``,
    a contiguous float32 ``scale`` of its columns and 0 < k < its size: four radix levels of |x / scale|, the
    quotient formed in registers (:func:`_radix_top`)."""
    return _radix_top(dense.view(-1), scale, k, index_dtype)


@triton.jit
def _gather_blocks_kernel(
    UNITS, n, n_iter, grid_cols, DENSE, in_features, ROWS, COLS, BASE, STRIDE, IDX, OUT,
    BH: tl.constexpr, BW: tl.constexpr, K: tl.constexpr,
):  # fmt: skip
    # program b: the b-th of the ascending blocks UNITS. Its block row's first active block and count
    # come from two searches of UNITS; its layout entry (see BlockLayout) places its elements, whose
    # flat indices and dense entries land at those places
    b = tl.program_id(0).to(tl.int64)
    u = tl.load(UNITS + b).to(tl.int64)
    r = u // grid_cols
    c = u % grid_cols
    first = _lower_bound(UNITS, n, r * grid_cols, n_iter, K)
    count = _lower_bound(UNITS, n, (r + 1) * grid_cols, n_iter, K) - first
    base = first * (BH * BW) + (b - first) * BW
    stride = count * BW
    tl.store(ROWS + b, r.to(tl.int32))
    tl.store(COLS + b, c.to(tl.int32))
    tl.store(BASE + b, base)
    tl.store(STRIDE + b, stride.to(tl.int32))
    i = tl.arange(0, BH).to(tl.int64)[:, None]
    j = tl.arange(0, BW).to(tl.int64)[None, :]
    pos = base + i * stride + j
    elem = (r * BH + i) * in_features + c * BW + j
    tl.store(IDX + pos, elem.to(IDX.dtype.element_ty))
    tl.store(OUT + pos, tl.load(DENSE + elem).to(tl.float32))


def gather_blocks(dense: torch.Tensor, units: torch.Tensor, block_shape, index_dtype: torch.dtype):
    """:func:`~peft_sparse.core.kernels.gather_blocks_reference` in one launch (contiguous ``dense``)."""
    bh, bw = block_shape
    out_f, in_f = dense.shape
    n = units.numel()
    dev = dense.device
    rows, cols, stride = (torch.empty(n, dtype=torch.int32, device=dev) for _ in range(3))
    base = torch.empty(n, dtype=torch.int64, device=dev)
    idx = torch.empty(n * bh * bw, dtype=index_dtype, device=dev)
    out = torch.empty(n * bh * bw, dtype=torch.float32, device=dev)
    if n:
        launch_kept(_gather_blocks_kernel, (n,), (n, out_f, in_f, dense.dtype, units.dtype, index_dtype, bh, bw),
                    ("UNITS", "DENSE", "ROWS", "COLS", "BASE", "STRIDE", "IDX", "OUT"), (units, dense, rows, cols, base, stride, idx, out),
                    units, n, _search_rounds(n, 64), in_f // bw, dense, in_f, rows, cols, base, stride, idx, out, BH=bh, BW=bw, K=64)  # fmt: skip
    return BlockLayout(rows, cols, base, stride, block_shape, out_f, in_f, units.long()), idx, out


@triton.jit
def _round_to(x, OUT):
    """float32 → OUT's element type, rounding to nearest even like torch's conversions."""
    if OUT.dtype.element_ty == tl.float32:
        return x
    else:
        return x.to(OUT.dtype.element_ty, fp_downcast_rounding="rtne")


@triton.jit
def _compose_kernel(
    W, OUT, IDX, VAL, numel, nnz, n_iter, COPY: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
    SBLOCK: tl.constexpr, K: tl.constexpr,
):  # fmt: skip
    # program p owns the flat range [p·BLOCK, (p+1)·BLOCK) of the merged weight: copies it from W (COPY)
    # and then adds the values whose (sorted) indices fall in it — found by searching the indices, so
    # no other program touches these positions and no atomics are needed. Arithmetic as torch does it
    # for 16-bit types: operands converted to the output type, added in float32, rounded once.
    start = tl.program_id(0).to(tl.int64) * BLOCK
    lo = _lower_bound(IDX, nnz, start, n_iter, K)
    hi = _lower_bound(IDX, nnz, start + BLOCK, n_iter, K)
    if COPY:
        for c in range(0, BLOCK, CHUNK):
            offs = start + c + tl.arange(0, CHUNK)
            m = offs < numel
            tl.store(OUT + offs, _round_to(tl.load(W + offs, mask=m).to(tl.float32), OUT), mask=m)
        tl.debug_barrier()  # the copy's stores land before this program overwrites some of them
    for j0 in range(lo, hi, SBLOCK):
        j = j0 + tl.arange(0, SBLOCK)
        jm = j < hi
        i = tl.load(IDX + j, mask=jm, other=0).to(tl.int64)
        if COPY:
            base = _round_to(tl.load(W + i, mask=jm, other=0.0).to(tl.float32), OUT)
        else:
            base = tl.load(OUT + i, mask=jm, other=0.0)
        v = _round_to(tl.load(VAL + j, mask=jm, other=0.0).to(tl.float32), OUT)
        tl.store(OUT + i, _round_to(base.to(tl.float32) + v.to(tl.float32), OUT), mask=jm)


_COMPOSE_BLOCK, _COMPOSE_CHUNK, _SEARCH_K = 16384, 4096, 512


def scatter_add_into(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, source: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out.view(-1)[indices] = base[indices] + values.to(out.dtype)`` for sorted distinct ``indices``, one launch.

    ``base`` is ``out`` itself, or — with ``source`` (same numel, any float dtype) — ``source`` copied
    into ``out`` first (converted to ``out.dtype``) in the same launch. The addition rounds like torch's
    ``base[indices] + values.to(out.dtype)``. ``out`` must be contiguous.
    """
    numel, nnz = out.numel(), indices.numel()
    if numel == 0:
        return out
    source = source.reshape(-1) if source is not None else None
    if source is not None and not source.is_contiguous():
        source = source.contiguous()
    grid = (_cdiv(numel, _COMPOSE_BLOCK),)
    launch(_compose_kernel, grid,
        source if source is not None else out, out, indices, values, numel, nnz, _search_rounds(nnz, _SEARCH_K),
        COPY=source is not None, BLOCK=_COMPOSE_BLOCK, CHUNK=_COMPOSE_CHUNK, SBLOCK=512, K=_SEARCH_K, num_warps=8,
    )  # fmt: skip
    return out


@triton.jit
def _scatter_sum_kernel(OUT, IDX, BASE, VAL, nnz, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < nnz
    i = tl.load(IDX + offs, mask=m, other=0).to(tl.int64)
    base = tl.load(BASE + offs, mask=m, other=0.0).to(tl.float32)
    v = _round_to(tl.load(VAL + offs, mask=m, other=0.0).to(tl.float32), OUT).to(tl.float32)
    tl.store(OUT + i, _round_to(base + v, OUT), mask=m)


def scatter_sum_into(out: torch.Tensor, indices: torch.Tensor, base: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``out.view(-1)[indices] = base + values.to(out.dtype)`` (``base`` in ``out``'s dtype), one launch."""
    nnz = indices.numel()
    if nnz:
        block = 1024
        launch(_scatter_sum_kernel, (_cdiv(nnz, block),), out, indices, base, values, nnz, BLOCK=block)
    return out


_SWAP_BLOCK = 1024


@triton.jit
def _swap_in_kernel(OUT, IDX, SAVED, VAL, nnz, BLOCK: tl.constexpr):
    # SAVED[j] = OUT[i_j]; OUT[i_j] = SAVED[j] + VAL[j] (rounded as _scatter_sum_kernel rounds)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < nnz
    i = tl.load(IDX + offs, mask=m, other=0).to(tl.int64)
    old = tl.load(OUT + i, mask=m, other=0.0)
    tl.store(SAVED + offs, old, mask=m)
    v = _round_to(tl.load(VAL + offs, mask=m, other=0.0).to(tl.float32), OUT).to(tl.float32)
    tl.store(OUT + i, _round_to(old.to(tl.float32) + v, OUT), mask=m)


def swap_in(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``saved = out[indices]``, then ``out[indices] = saved + values.to(out.dtype)`` (``out`` flat, sorted distinct
    ``indices``), one launch: :func:`scatter_sum_into` with ``base`` read from ``out`` itself. Returns ``saved``."""
    nnz = indices.numel()
    saved = torch.empty(nnz, dtype=out.dtype, device=out.device)
    if nnz:  # (kept per sizes and types: a layer's write and write-back repeat every pass of every step)
        key = (nnz, out.numel(), out.dtype, indices.dtype, values.dtype)
        launch_kept(_swap_in_kernel, (_cdiv(nnz, _SWAP_BLOCK),), key, ("OUT", "IDX", "SAVED", "VAL"), (out, indices, saved, values),
                    out, indices, saved, values, nnz, BLOCK=_SWAP_BLOCK)  # fmt: skip
    return saved


@triton.jit
def _scatter_copy_kernel(OUT, IDX, SRC, nnz, BLOCK: tl.constexpr):
    # OUT[i_j] = SRC[j], the bits as they are
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < nnz
    i = tl.load(IDX + offs, mask=m, other=0).to(tl.int64)
    tl.store(OUT + i, tl.load(SRC + offs, mask=m), mask=m)


def scatter_copy(out: torch.Tensor, indices: torch.Tensor, source: torch.Tensor) -> None:
    """``out[indices] = source`` bit for bit (``out`` flat, ``source`` of its dtype), one launch."""
    nnz = indices.numel()
    if nnz:
        key = (nnz, out.numel(), out.dtype, indices.dtype, source.dtype)
        launch_kept(_scatter_copy_kernel, (_cdiv(nnz, _SWAP_BLOCK),), key, ("OUT", "IDX", "SRC"), (out, indices, source),
                    out, indices, source, nnz, BLOCK=_SWAP_BLOCK)  # fmt: skip


class WriteLane:
    """One layer's write and write-back of the default pass (:func:`swap_in`, then :func:`scatter_copy` of what it
    kept) for one flat weight, indices and values, repeated from launches kept with their addresses bound: a
    training step repeats them in forward and in backward of every layer, and the generic calls (key, lookup,
    a check per tensor, a fresh ``saved``) cost the host more than the launch itself. What the write keeps goes
    to a buffer of this thread and stream (:func:`scratch`), read back by the write-back that follows it.

    :meth:`serves` says whether a write's tensors are the ones the launches were made for: the same flat weight,
    and indices and values at the same addresses, of the same types and sizes, contiguous (the tensors the lane
    was made with, or other tensors over their memory: what a checkpointed region's recomputation hands over)."""

    __slots__ = ("out", "indices", "values", "pointers", "kinds", "size", "grid", "swap", "copy", "pending")

    def __init__(self, out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor):
        self.out, self.indices, self.values = out, indices, values  # (flat weight, (d_φ,), (d_φ,))
        self.pointers = (out.data_ptr(), indices.data_ptr(), values.data_ptr())
        self.kinds, self.size = (indices.dtype, values.dtype), indices.numel()
        self.grid = (_cdiv(self.size, _SWAP_BLOCK),)
        self.swap = self.copy = self.pending = None

    def serves(self, out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> bool:
        pointers, (index_type, value_type), size = self.pointers, self.kinds, self.size
        return (
            out is self.out and out.data_ptr() == pointers[0]
            and indices.data_ptr() == pointers[1] and values.data_ptr() == pointers[2]
            and indices.dtype is index_type and values.dtype is value_type
            and indices.numel() == size and values.numel() == size
            and indices.is_contiguous() and values.is_contiguous()
        )  # fmt: skip

    def swap_in(self) -> list:
        """:func:`swap_in` of the lane's tensors; returns ``[saved]`` (a :func:`scratch` buffer: valid until this
        thread's next write on this stream), which :meth:`restore` takes."""
        out, nnz = self.out, self.size
        saved = scratch(out, nnz)
        if nnz and not (self.swap is not None and self.swap(saved)):
            with on_device(out):  # (made: the next calls launch it on its device)
                self.swap = launch_plan(_swap_in_kernel, self.grid, "SAVED", out, self.indices, saved, self.values, nnz, BLOCK=_SWAP_BLOCK)
        pending = self.pending = [saved]
        return pending

    def restore(self, pending: list) -> bool:
        """:func:`scatter_copy` of what :meth:`swap_in` kept (``pending``, the list it returned) back into the
        weight; False (nothing done) for any other list."""
        if pending is not self.pending:
            return False
        self.pending = None
        saved, nnz = pending[0], self.size
        if nnz and not (self.copy is not None and self.copy(saved)):
            with on_device(self.out):
                self.copy = launch_plan(_scatter_copy_kernel, self.grid, "SRC", self.out, self.indices, saved, nnz, BLOCK=_SWAP_BLOCK)
        return True


_SCRATCH = threading.local()  # .tables: (device, stream, dtype) → (buffer, {n: its first n entries})
_SCRATCH_TABLES_MAX = 16


def scratch(like: torch.Tensor, n: int) -> torch.Tensor:
    """n entries of ``like``'s dtype on its device, from a buffer of this thread for the device's current stream
    (grown to the largest n asked, the largest layer's d_φ; the same tensor for the same n): what one write keeps
    until its write-back, which runs before this thread's next write on the stream (the launches follow in the
    stream's order, so one buffer serves every layer). While the stream is captured into a CUDA graph: a new
    tensor (from the graph's own memory pool, as the graph's replays need)."""
    if like.is_cuda:
        device = like.get_device()
        if torch.cuda.is_current_stream_capturing():
            return torch.empty(n, dtype=like.dtype, device=like.device)
        key = (device, internals.cuda_raw_stream(device), like.dtype)
    else:  # (Triton's interpreter)
        key = (like.device, None, like.dtype)
    tables = getattr(_SCRATCH, "tables", None)
    if tables is None:
        tables = _SCRATCH.tables = {}
    entry = tables.get(key)
    if entry is None or entry[0].numel() < n:
        if entry is None and len(tables) >= _SCRATCH_TABLES_MAX:
            tables.clear()  # (streams made and dropped one after another)
        entry = tables[key] = (torch.empty(max(n, 1), dtype=like.dtype, device=like.device), {})
    views = entry[1]
    view = views.get(n)
    if view is None:
        view = views[n] = entry[0][:n]
    return view


@triton.jit
def _gather_kernel(SRC, IDX, OUT, n, BLOCK: tl.constexpr):
    # OUT[j] = SRC[IDX[j]] converted to OUT's element type
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    i = tl.load(IDX + offs, mask=m, other=0)
    tl.store(OUT + offs, tl.load(SRC + i, mask=m, other=0.0).to(OUT.dtype.element_ty), mask=m)


_GATHER_BLOCK = 1024


def gather_as(flat: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``flat.index_select(0, indices).to(dtype)`` in one launch (no intermediate in ``flat``'s type):
    ``flat`` a contiguous 1-D tensor, ``indices`` int32 or int64 within its bounds (not checked here: the
    layers' indices are checked when they are set or loaded). Launches are kept per sizes and types."""
    n = indices.numel()
    out = torch.empty(n, dtype=dtype, device=flat.device)
    if n:
        key = (n, flat.numel(), flat.dtype, indices.dtype, dtype)  # (a kept launch checks every slot's size)
        launch_kept(_gather_kernel, (_cdiv(n, _GATHER_BLOCK),), key, ("SRC", "IDX", "OUT"),
                    (flat, indices, out), flat, indices, out, n, BLOCK=_GATHER_BLOCK)  # fmt: skip
    return out


@triton.jit
def _segment_max(row_a, value_a, row_b, value_b):
    # combine of a scan over (row, value) runs: restart at a new row
    return row_b, tl.where(row_a == row_b, tl.maximum(value_a, value_b), value_b)


def sm3_sparse_step(
    values, grad, indices, in_features, row_acc, col_acc, momentum_buffer, lr, momentum, eps, weight_decay,
    row_new=None, col_new=None, beta2=None, step: int = 1,
):  # fmt: skip
    """One fused SM3-II step over sparse values; returns the new (row, col) accumulators.

    ν is read from the previous accumulators and the max-updates go to copies (atomic max), so no
    element sees another's update of the same step — the same result as the sequential definition.
    ``row_new``/``col_new``: buffers already holding copies of the accumulators (β₂ times them with ``beta2``);
    by default they are made here. (:class:`MultiSM3` with one tensor; the optimizer batches all its tensors.)
    """
    if row_new is None or col_new is None:
        row_new, col_new = row_acc.clone(), col_acc.clone()
        if beta2 is not None:
            row_new.mul_(beta2)
            col_new.mul_(beta2)
    if values.numel():
        plan = MultiSM3([values], [grad], [indices], [in_features], [row_acc], [col_acc], [row_new], [col_new], [momentum_buffer])
        plan([grad], lr, momentum, eps, weight_decay, beta2, step)
    return row_new, col_new


_MULTI_BLOCK = 1024  # entries per program of the multi-tensor kernels


def _address_table(tensors, device: torch.device) -> torch.Tensor:
    """The tensors' data addresses, on ``device`` (the multi-tensor kernels reach the tensors through it)."""
    return to_device_async(torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64), device)


def _program_map(counts: list, device: torch.device) -> tuple:
    """(programs, counts, tensor of each program, first entry of each program) for tensors of ``counts``
    entries, ``_MULTI_BLOCK`` entries per program: the two per-program tables are computed on ``device``
    from one small copy (no program-sized host tensor to fill, pin and copy)."""
    blocks = [-(-n // _MULTI_BLOCK) for n in counts]
    programs = sum(blocks)
    sizes = to_device_async(torch.tensor([counts, blocks], dtype=torch.int64).reshape(2, len(counts)), device)
    counts_t, blocks_t = sizes[0], sizes[1]
    tensor_of = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32, device=device), blocks_t, output_size=programs)
    first = torch.cumsum(blocks_t, 0) - blocks_t  # first program of each tensor
    start = (torch.arange(programs, dtype=torch.int64, device=device) - first[tensor_of.long()]) * _MULTI_BLOCK
    return programs, counts_t, tensor_of, start


@triton.jit
def _sm3_accumulators(ROW_OLD_PTRS, COL_OLD_PTRS, ROW_NEW_PTRS, COL_NEW_PTRS, t, ACC_T):
    """Tensor t's previous and updated (row, col) accumulators, from the multi-tensor address tables."""
    acc = tl.pointer_type(ACC_T.dtype.element_ty)
    return (tl.load(ROW_OLD_PTRS + t).to(acc), tl.load(COL_OLD_PTRS + t).to(acc),
            tl.load(ROW_NEW_PTRS + t).to(acc), tl.load(COL_NEW_PTRS + t).to(acc))  # fmt: skip


@triton.jit
def _sm3_apply(VALUES_PTRS, MOM_PTRS, t, offs, m, g, nu, VALUES_T, ACC_T, lr, momentum, eps, decay, scale, HAS_MOMENTUM: tl.constexpr):
    """The SM3-II update of tensor t's values at ``offs`` (mask ``m``) from their gradients and ν (times ``scale``:
    the moving average's bias correction, 1 for the sums) — shared by the per-element and per-block kernels, so
    both give the same bits."""
    values = tl.load(VALUES_PTRS + t).to(tl.pointer_type(VALUES_T.dtype.element_ty))
    update = g / tl.sqrt(nu * scale + eps)
    if HAS_MOMENTUM:
        mom = tl.load(MOM_PTRS + t).to(tl.pointer_type(ACC_T.dtype.element_ty))
        buf = tl.load(mom + offs, mask=m, other=0.0) * momentum + (1 - momentum) * update
        tl.store(mom + offs, buf, mask=m)
        update = buf
    v = tl.load(values + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(values + offs, (v * decay - lr * update).to(VALUES_T.dtype.element_ty), mask=m)


@triton.jit
def _multi_sm3_kernel(
    VALUES_PTRS, GRAD_PTRS, IDX_PTRS, ROW_OLD_PTRS, COL_OLD_PTRS, ROW_NEW_PTRS, COL_NEW_PTRS, MOM_PTRS, COUNTS, IN_FEATURES,
    PROG_TENSOR, PROG_START, VALUES_T, GRAD_T, IDX_T, ACC_T, lr, momentum, eps, decay, keep, fresh, scale,
    HAS_MOMENTUM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # one SM3-II step (see :func:`sm3_sparse_step`) for many tensors: program p takes entries
    # [PROG_START[p], +BLOCK) of tensor PROG_TENSOR[p], reached through tables of addresses (element
    # types from the *_T templates). Indices are sorted, so a block holds a few runs of one row each:
    # each run is reduced with a scan and issues one atomic (its last element) instead of one per element
    p = tl.program_id(0)
    t = tl.load(PROG_TENSOR + p)
    start = tl.load(PROG_START + p)
    n = tl.load(COUNTS + t)
    in_features = tl.load(IN_FEATURES + t)
    grad = tl.load(GRAD_PTRS + t).to(tl.pointer_type(GRAD_T.dtype.element_ty))
    idx_ptr = tl.load(IDX_PTRS + t).to(tl.pointer_type(IDX_T.dtype.element_ty))
    row_old, col_old, row_new, col_new = _sm3_accumulators(ROW_OLD_PTRS, COL_OLD_PTRS, ROW_NEW_PTRS, COL_NEW_PTRS, t, ACC_T)
    offs = start + tl.arange(0, BLOCK)
    m = offs < n
    # row and column of each index: in 32-bit arithmetic when the indices are int32 (a matrix of fewer
    # than 2³¹ elements; 64-bit division costs several times more)
    if IDX_T.dtype.element_ty == tl.int32:
        in_features = in_features.to(tl.int32)
        idx = tl.load(idx_ptr + offs, mask=m, other=0)
        next_r = tl.load(idx_ptr + offs + 1, mask=offs + 1 < n, other=0) // in_features
    else:
        idx = tl.load(idx_ptr + offs, mask=m, other=0).to(tl.int64)
        next_r = tl.load(idx_ptr + offs + 1, mask=offs + 1 < n, other=0).to(tl.int64) // in_features
    r = idx // in_features
    c = idx - r * in_features
    g = tl.load(grad + offs, mask=m, other=0.0).to(tl.float32)
    nu = tl.minimum(tl.load(row_old + r, mask=m, other=0.0), tl.load(col_old + c, mask=m, other=0.0)) * keep + fresh * (g * g)
    _, run_max = tl.associative_scan((r, nu), 0, _segment_max)
    last_of_run = (next_r != r) | (tl.arange(0, BLOCK) == BLOCK - 1) | (offs + 1 >= n)
    tl.atomic_max(row_new + r, run_max, mask=m & last_of_run, sem="relaxed")  # max commutes: no ordering needed
    # a column's entries are spread over many programs, one atomic each: skip those whose ν is below the
    # column's maximum so far (read from L2; a stale read is lower, never higher: the maximum only grows),
    # so most entries issue none. Only strictly lower ones: an equal ν may differ in the sign of zero, which
    # the atomic orders by bit pattern; a NaN ν (never below anything) still goes.
    seen = tl.load(col_new + c, mask=m, other=0.0, cache_modifier=".cg")
    tl.atomic_max(col_new + c, nu, mask=m & ~(nu < seen), sem="relaxed")
    _sm3_apply(VALUES_PTRS, MOM_PTRS, t, offs, m, g, nu, VALUES_T, ACC_T, lr, momentum, eps, decay, scale, HAS_MOMENTUM)


@triton.jit
def _multi_sm3_block_kernel(
    VALUES_PTRS, GRAD_PTRS, ROW_OLD_PTRS, COL_OLD_PTRS, ROW_NEW_PTRS, COL_NEW_PTRS, MOM_PTRS, B_TENSOR, B_ROW0, B_COL0,
    B_BASE, B_STRIDE, VALUES_T, GRAD_T, ACC_T, lr, momentum, eps, decay, keep, fresh, scale,
    HAS_MOMENTUM: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    # _multi_sm3_kernel for block adapters: program b takes block b of the tables (its tensor, first row
    # and column, and where its elements sit: BlockLayout's base and stride). The same arithmetic per
    # element; the block's row and column maxima are reduced in the program, so each block issues bh + bw
    # atomics instead of one per element and run
    b = tl.program_id(0)
    t = tl.load(B_TENSOR + b)
    r = tl.load(B_ROW0 + b).to(tl.int64) + tl.arange(0, BH)
    c = tl.load(B_COL0 + b).to(tl.int64) + tl.arange(0, BW)
    offs = tl.load(B_BASE + b).to(tl.int64) + tl.arange(0, BH)[:, None].to(tl.int64) * tl.load(B_STRIDE + b).to(tl.int64) + tl.arange(0, BW)[None, :]
    grad = tl.load(GRAD_PTRS + t).to(tl.pointer_type(GRAD_T.dtype.element_ty))
    row_old, col_old, row_new, col_new = _sm3_accumulators(ROW_OLD_PTRS, COL_OLD_PTRS, ROW_NEW_PTRS, COL_NEW_PTRS, t, ACC_T)
    g = tl.load(grad + offs).to(tl.float32)
    nu = tl.minimum(tl.load(row_old + r)[:, None], tl.load(col_old + c)[None, :]) * keep + fresh * (g * g)
    tl.atomic_max(row_new + r, tl.max(nu, axis=1), sem="relaxed")  # max commutes: no ordering needed
    tl.atomic_max(col_new + c, tl.max(nu, axis=0), sem="relaxed")
    _sm3_apply(VALUES_PTRS, MOM_PTRS, t, offs, offs >= 0, g, nu, VALUES_T, ACC_T, lr, momentum, eps, decay, scale, HAS_MOMENTUM)


def sm3_block_shape_supported(block_shape) -> bool:
    """Whether :class:`MultiSM3` steps adapters of these blocks one program per block (sides powers of
    two, at most 4096 elements); others take the per-element kernel."""
    bh, bw = block_shape
    return bh * bw > 1 and bh & (bh - 1) == 0 and bw & (bw - 1) == 0 and bh * bw <= 4096


class MultiSM3:
    """:func:`sm3_sparse_step` for many sparse values tensors of one element-type combination in one
    launch. Arguments are per tensor: values, grads (for their element type), indices, in_features,
    previous (row, col) accumulators, the buffers the updated ones go to (already holding copies of the
    previous ones), momentum buffers (or None). The address tables are built once and kept while no
    tensor moves (:meth:`key_of`); only element types are kept, never the tensors. A call takes the
    step's gradients. ``layouts``: the tensors' :class:`~peft_sparse.core.kernels.BlockLayout` s, all of
    one block shape (:func:`sm3_block_shape_supported`): one program per block (same results); the
    plan is valid while these layout objects are the tensors' (:meth:`holds`)."""

    def __init__(self, values, grads, indices, in_features, row_old, col_old, row_new, col_new, moms, layouts=None):
        device = self.device = values[0].device
        self.key = self.key_of(values, indices, in_features, row_old, col_old, row_new, col_new, moms)
        self.templates = tuple(torch.empty(0, dtype=t.dtype, device=device) for t in (values[0], grads[0], indices[0], row_old[0]))
        self.has_momentum = moms[0] is not None
        self.block_shape, self.layouts = None, None
        if layouts is not None:
            self.block_shape = layouts[0].block_shape
            self.layouts = [weakref.ref(layout) for layout in layouts]
            bh, bw = self.block_shape
            n = [layout.rows.numel() for layout in layouts]
            self.programs = sum(n)
            self.blocks = (
                to_device_async(torch.repeat_interleave(torch.arange(len(n), dtype=torch.int32), torch.tensor(n)), device),
                torch.cat([layout.rows.long() * bh for layout in layouts]), torch.cat([layout.cols.long() * bw for layout in layouts]),
                torch.cat([layout.base.long() for layout in layouts]), torch.cat([layout.stride.to(torch.int32) for layout in layouts]),
            )  # fmt: skip
            tables = (values, row_old, col_old, row_new, col_new, moms if self.has_momentum else values)
            self.tables = [_address_table(t, device) for t in tables]
            return
        tables = (values, indices, row_old, col_old, row_new, col_new, moms if self.has_momentum else values)
        self.tables = [_address_table(t, device) for t in tables]
        self.in_features = to_device_async(torch.tensor(in_features, dtype=torch.int64), device)
        self.programs, self.counts, self.prog_tensor, self.prog_start = _program_map([v.numel() for v in values], device)

    def holds(self, layouts) -> bool:
        """Whether this plan was built for these block layouts (the same objects; None: unstructured)."""
        if self.layouts is None or layouts is None:
            return self.layouts is None and layouts is None
        return len(layouts) == len(self.layouts) and all(ref() is layout for ref, layout in zip(self.layouts, layouts))

    @staticmethod
    def key_of(values, indices, in_features, *accumulators_and_moms) -> tuple:
        """What the plan depends on: every tensor's address, the sizes and widths. Not the gradients:
        they are fresh tensors at every step, so their table is written at every call."""
        pointers = tuple(tuple(t.data_ptr() if t is not None else 0 for t in ts) for ts in (values, indices, *accumulators_and_moms))
        return pointers + (tuple(v.numel() for v in values), tuple(in_features))

    def __call__(self, grads, lr: float, momentum: float, eps: float, weight_decay: float, beta2=None, step: int = 1) -> None:
        """One step. ``beta2`` (SM3's moving-average form): ν = β₂·min(R, C) + (1 − β₂)·g², the update from ν / (1 −
        β₂^step), and the buffers of the updated accumulators must hold β₂ times the previous ones; None: the sums."""
        keep, fresh, scale = (1.0, 1.0, 1.0) if beta2 is None else (beta2, 1.0 - beta2, 1.0 / (1.0 - beta2**step))
        if self.programs and self.block_shape is not None:
            values, *rest = self.tables
            launch(_multi_sm3_block_kernel, (self.programs,),
                values, _address_table(grads, self.device), *rest, *self.blocks, self.templates[0], self.templates[1],
                self.templates[3], lr, momentum, eps, 1.0 - lr * weight_decay, keep, fresh, scale, HAS_MOMENTUM=self.has_momentum,
                BH=self.block_shape[0], BW=self.block_shape[1], num_warps=4, enable_fp_fusion=False,
            )  # fmt: skip
        elif self.programs:
            values, indices, *rest = self.tables
            launch(_multi_sm3_kernel, (self.programs,),
                values, _address_table(grads, self.device), indices, *rest, self.counts, self.in_features,
                self.prog_tensor, self.prog_start, *self.templates, lr, momentum, eps, 1.0 - lr * weight_decay,
                keep, fresh, scale, HAS_MOMENTUM=self.has_momentum, BLOCK=_MULTI_BLOCK, enable_fp_fusion=False,
            )  # fmt: skip


@triton.jit
def _scaled_product_kernel(OUT, P, Q, S, n_rows, H, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    # OUT[r, h] = S[h] · (P[r, h] · Q[r]).to(OUT) — the product in float32, then each rounding torch makes
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    rm = rows < n_rows
    cm = cols < H
    m = rm[:, None] & cm[None, :]
    p = tl.load(P + rows[:, None] * H + cols[None, :], mask=m, other=0.0).to(tl.float32)
    q = tl.load(Q + rows, mask=rm, other=0.0).to(tl.float32)
    s = tl.load(S + cols, mask=cm, other=0.0).to(tl.float32)
    inner = _round_to(p * q[:, None], OUT).to(tl.float32)
    tl.store(OUT + rows[:, None] * H + cols[None, :], _round_to(s[None, :] * inner, OUT), mask=m)


def scaled_product(scale: torch.Tensor, full: torch.Tensor, per_row: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale * (full * per_row).to(dtype)`` in one pass: ``full`` float32 (..., H) contiguous,
    ``per_row`` float32 with one entry per row of ``full`` (shape (..., 1)), ``scale`` (H,) in ``dtype``
    (float16/bfloat16). Same bits as the three torch operations (see kernels.scaled_product)."""
    h = full.shape[-1]
    n_rows = full.numel() // max(h, 1)
    out = torch.empty(full.shape, dtype=dtype, device=full.device)
    if out.numel():
        block_r, block_h = 16, 256
        grid = (_cdiv(n_rows, block_r), _cdiv(h, block_h))
        # (kept per shape: one such rebuild per RMSNorm output in a training step's backward)
        launch_kept(_scaled_product_kernel, grid, (n_rows, h, dtype), ("OUT", "P", "Q", "S"), (out, full, per_row, scale),
                    out, full, per_row, scale, n_rows, h, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=4)  # fmt: skip
    return out


@triton.jit
def _multi_scatter_sum_kernel(
    OUT_PTRS, IDX_PTRS, BASE_PTRS, VAL_PTRS, COUNTS, PROG_TENSOR, PROG_START, OUT_T, IDX_T, BASE_T, VAL_T, BLOCK: tl.constexpr,
    ADD: tl.constexpr,
):  # fmt: skip
    # program p: entries [PROG_START[p], PROG_START[p] + BLOCK) of tensor PROG_TENSOR[p]; the tensors are
    # reached through tables of their addresses, their element types are those of the *_T templates.
    # ADD off: the bases are stored as they are (bit for bit, −0.0 included)
    p = tl.program_id(0)
    t = tl.load(PROG_TENSOR + p)
    offs = tl.load(PROG_START + p) + tl.arange(0, BLOCK)
    m = offs < tl.load(COUNTS + t)
    out = tl.load(OUT_PTRS + t).to(tl.pointer_type(OUT_T.dtype.element_ty))
    idx_ptr = tl.load(IDX_PTRS + t).to(tl.pointer_type(IDX_T.dtype.element_ty))
    base_ptr = tl.load(BASE_PTRS + t).to(tl.pointer_type(BASE_T.dtype.element_ty))
    val_ptr = tl.load(VAL_PTRS + t).to(tl.pointer_type(VAL_T.dtype.element_ty))
    i = tl.load(idx_ptr + offs, mask=m, other=0).to(tl.int64)
    if ADD:
        base = tl.load(base_ptr + offs, mask=m, other=0.0).to(tl.float32)
        v = _round_to(tl.load(val_ptr + offs, mask=m, other=0.0).to(tl.float32), OUT_T).to(tl.float32)
        tl.store(out + i, _round_to(base + v, OUT_T), mask=m)
    else:
        tl.store(out + i, tl.load(base_ptr + offs, mask=m, other=0.0), mask=m)



class MultiScatterSum:
    """:func:`scatter_sum_into` for many tensors in one launch: ``outs[k].view(-1)[indices[k]] = bases[k] +
    values[k].to(outs[k].dtype)``, or with ``values`` None ``= bases[k]`` (bases in the outputs' type,
    stored bit for bit). Every list holds one element type (the caller groups them). The address tables
    are built once and kept while the tensors' storage does not move (:meth:`key`)."""

    def __init__(self, outs, indices, bases, values=None):
        device = outs[0].device
        self.key = self.key_of(outs, indices, bases, values)
        self.add = values is not None
        values = values if values is not None else bases  # (not read without ADD)
        # element types only: the plan must not keep the tensors themselves alive
        self.templates = tuple(torch.empty(0, dtype=t.dtype, device=device) for t in (outs[0], indices[0], bases[0], values[0]))
        self.tables = [_address_table(t, device) for t in (outs, indices, bases, values)]
        self.programs, self.counts, self.prog_tensor, self.prog_start = _program_map([i.numel() for i in indices], device)

    @staticmethod
    def key_of(outs, indices, bases, values=None) -> tuple:
        values = values if values is not None else [None] * len(outs)
        return tuple((o.data_ptr(), i.data_ptr(), b.data_ptr(), v.data_ptr() if v is not None else None, i.numel())
                     for o, i, b, v in zip(outs, indices, bases, values))  # fmt: skip

    def __call__(self) -> None:
        if self.programs:
            launch(_multi_scatter_sum_kernel, (self.programs,),
                *self.tables, self.counts, self.prog_tensor, self.prog_start, *self.templates, BLOCK=_MULTI_BLOCK, ADD=self.add
            )


@triton.jit
def _nf4_chunk(Q, CODE, ABSMAX, ABSMAX_Q, ABSMAX2, CODE2, offset, e0, numel, CHUNK: tl.constexpr,
               BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr):  # fmt: skip
    """float32 NF4 values of elements [e0, e0 + CHUNK) in order (e0 a multiple of CHUNK, CHUNK and BLOCKSIZE
    powers of two): the chunk's bytes in one contiguous load, both nibbles decoded (the high one is the
    first element), code[nibble] · absmax[e // BLOCKSIZE] with one absmax per quantization block broadcast
    over it; nested (double-quantized) absmax = code2[q] · absmax2[block // BLOCKSIZE2] + offset."""
    HALF: tl.constexpr = CHUNK // 2
    b = e0 // 2 + tl.arange(0, HALF)
    byte = tl.load(Q + b, mask=b < (numel + 1) // 2, other=0).to(tl.int32)
    code = tl.reshape(tl.join(tl.load(CODE + (byte >> 4)), tl.load(CODE + (byte & 15))), (CHUNK,))
    n_blocks = (numel + BLOCKSIZE - 1) // BLOCKSIZE
    if BLOCKSIZE <= CHUNK:
        NB: tl.constexpr = CHUNK // BLOCKSIZE
        blk = e0 // BLOCKSIZE + tl.arange(0, NB)
    else:  # the whole chunk lies in one quantization block
        NB: tl.constexpr = 1
        blk = e0 // BLOCKSIZE + tl.arange(0, 1)
    bm = blk < n_blocks
    if NESTED:
        q = tl.load(ABSMAX_Q + blk, mask=bm, other=0).to(tl.int32)
        amax = tl.load(CODE2 + q, mask=bm, other=0.0) * tl.load(ABSMAX2 + blk // BLOCKSIZE2, mask=bm, other=0.0)
        amax = amax + offset
    else:
        amax = tl.load(ABSMAX + blk, mask=bm, other=0.0)
    if BLOCKSIZE <= CHUNK:
        return tl.reshape(tl.reshape(code, (NB, BLOCKSIZE)) * amax[:, None], (CHUNK,))
    else:
        return tl.reshape(tl.reshape(code, (1, CHUNK)) * amax[:, None], (CHUNK,))


@triton.jit
def _nf4_compose_kernel(
    Q, CODE, ABSMAX, ABSMAX_Q, ABSMAX2, CODE2, offset, OUT, IDX, VAL, STARTS, numel, nnz, n_iter,
    BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr, BLOCK: tl.constexpr,
    CHUNK: tl.constexpr, SBLOCK: tl.constexpr, K: tl.constexpr, HAS_STARTS: tl.constexpr,
):  # fmt: skip
    # as _compose_kernel, with the copy replaced by the NF4 dequantization of the range; the range's
    # slice of the indices from STARTS (HAS_STARTS: STARTS[p] = first j with IDX[j] ≥ p·BLOCK) or searched
    p = tl.program_id(0)
    start = p.to(tl.int64) * BLOCK
    if HAS_STARTS:
        lo = tl.load(STARTS + p).to(tl.int64)
        hi = tl.load(STARTS + p + 1).to(tl.int64)
    else:
        lo = _lower_bound(IDX, nnz, start, n_iter, K)
        hi = _lower_bound(IDX, nnz, start + BLOCK, n_iter, K)
    for c in range(0, BLOCK, CHUNK):
        e0 = start + c
        w = _nf4_chunk(Q, CODE, ABSMAX, ABSMAX_Q, ABSMAX2, CODE2, offset, e0, numel, CHUNK, BLOCKSIZE, BLOCKSIZE2, NESTED)
        e = e0 + tl.arange(0, CHUNK)
        tl.store(OUT + e, _round_to(w, OUT), mask=e < numel)
    tl.debug_barrier()  # the dequantized values land before this program overwrites some of them
    for j0 in range(lo, hi, SBLOCK):
        j = j0 + tl.arange(0, SBLOCK)
        jm = j < hi
        i = tl.load(IDX + j, mask=jm, other=0).to(tl.int64)
        base = tl.load(OUT + i, mask=jm, other=0.0).to(tl.float32)  # this program's own store, before the barrier
        v = _round_to(tl.load(VAL + j, mask=jm, other=0.0).to(tl.float32), OUT).to(tl.float32)
        tl.store(OUT + i, _round_to(base + v, OUT), mask=jm)


# elements per program and per chunk of the fused NF4 launch (a sweep on an H200: with
# starts given, 4096/2048 took 54 µs for one layer's seven TinyLlama projections, 16384/4096 searching 89 µs)
_NF4_BLOCK, _NF4_CHUNK = 4096, 2048


def compose_starts(indices: torch.Tensor, numel: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """For :func:`nf4_compose`'s ``starts``: where each program's range of the weight begins in the sorted
    ``indices`` (and where the last one ends), int32. ``out``: an earlier result for indices of this size
    into a weight of ``numel`` elements, rewritten in place (a kept launch that reads it stays valid)."""
    bounds = torch.arange(0, _cdiv(numel, _NF4_BLOCK) + 1, device=indices.device, dtype=torch.int64) * _NF4_BLOCK
    starts = torch.searchsorted(indices, bounds.clamp_(max=numel).to(indices.dtype))
    if out is None:
        return starts.to(torch.int32)
    if out.shape != starts.shape or out.dtype != torch.int32:
        raise ValueError(f"compose_starts: out must be int32 of shape {tuple(starts.shape)}, got {out.dtype} {tuple(out.shape)}")
    return out.copy_(starts)


def nf4_compose(packed, code, absmax, nested, blocksize, shape, dtype, indices=None, values=None, starts=None, plan: bool = False):
    """Dequantized NF4 weight (``shape``, ``dtype``) plus scatter(indices, values), in one launch.

    ``nested``: None, or (quantized absmax (uint8), absmax2 (float32), code2 (float32), blocksize2, offset)
    of double quantization. The arithmetic is bitsandbytes': float32 products (the nested absmax's product
    and offset added as two roundings, never fused), rounded once to ``dtype``; the values are added as
    :func:`scatter_add_into` adds them. ``starts``: :func:`compose_starts` of these indices (kept by the
    caller while they do not change), else each program searches its slice of the indices. ``plan``:
    return (weight, :class:`LaunchPlan` with the output as its slot, or None) — the plan rebuilds the
    weight from these same operands into a new output (kept by a 4-bit layer: ``layer._NF4Rebuild``)."""
    numel = shape[0] * shape[1]
    out = torch.empty(shape, dtype=dtype, device=packed.device)
    if numel == 0:
        return (out, None) if plan else out
    if indices is None:
        indices = torch.zeros(0, dtype=torch.int32, device=packed.device)
        values = torch.zeros(0, dtype=torch.float32, device=packed.device)
    if nested is not None:
        absmax_q, absmax2, code2, blocksize2, offset = nested
        absmax = absmax2  # not read
    else:  # the nested operands are not read
        absmax_q, absmax2, code2, blocksize2, offset = absmax, absmax, code, 1, 0.0
    nnz = indices.numel()
    grid = (-(-numel // _NF4_BLOCK),)
    made = launch_plan(_nf4_compose_kernel, grid, "OUT",
        packed, code, absmax, absmax_q, absmax2, code2, float(offset), out, indices, values,
        starts if starts is not None else indices, numel, nnz, _search_rounds(nnz, _SEARCH_K), BLOCKSIZE=blocksize,
        BLOCKSIZE2=blocksize2, NESTED=nested is not None, BLOCK=_NF4_BLOCK, CHUNK=_NF4_CHUNK, SBLOCK=512,
        K=_SEARCH_K, HAS_STARTS=starts is not None, num_warps=8, enable_fp_fusion=False,
    )  # fmt: skip
    return (out, made) if plan else out
