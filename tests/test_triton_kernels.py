"""The Triton value-gradient kernels against the torch references.

On CPU they run in Triton's interpreter (TRITON_INTERPRET=1); on a GPU (marked gpu) compiled.
Without Triton installed these tests are skipped, and the torch references serve everywhere.
"""

import importlib
import os

import pytest
import torch

from peft_sparse.core import devices, kernels
from peft_sparse.core.selection import random_indices

pytest.importorskip("triton", reason="Triton is not installed; the torch reference paths are used instead")


@pytest.fixture(scope="module")
def tk():
    """The kernels module; on CPU conftest set TRITON_INTERPRET=1 before anything imported triton."""
    if not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("set TRITON_INTERPRET=1 before starting Python to run the Triton kernels on CPU")
        _let_the_interpreter_index_scalars()
    return importlib.import_module("peft_sparse.accel.triton_kernels")


def _let_the_interpreter_index_scalars():
    """Triton's interpreter turns a scalar kernel argument into a 1-element array and converts it with
    int(), which NumPy ≥ 2.3 refuses for arrays of ndim > 0; convert the single element instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_scalar_index_fix", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._scalar_index_fix = True
    interpreter._patch_lang_tensor = patched


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tokens, out_f, in_f, nnz", [(37, 48, 32, 100), (130, 16, 80, 1)])
def test_sddmm_matches_reference(tk, tokens, out_f, in_f, nnz):
    g = torch.Generator().manual_seed(tokens)
    go = torch.randn(tokens, out_f, generator=g).to(_device())
    x = torch.randn(tokens, in_f, generator=g).to(_device())
    idx = random_indices(out_f * in_f, nnz, g).to(_device()).to(torch.int32)
    rows, cols = kernels.rows_cols(idx, in_f)
    got = tk.sddmm(go, x, rows.to(torch.int32), cols.to(torch.int32))
    want = kernels.sddmm_reference(go, x, rows, cols)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bh, bw", [(16, 16), (32, 32), (1, 64), (16, 32)])
def test_block_sddmm_matches_reference(tk, bh, bw):
    g = torch.Generator().manual_seed(bh * 100 + bw)
    tokens, out_f, in_f = 70, 4 * bh, 3 * bw
    go = torch.randn(tokens, out_f, generator=g).to(_device())
    x = torch.randn(tokens, in_f, generator=g).to(_device())
    blocks = torch.tensor([0, 2, 7, 11])
    rows, cols = (blocks // 3).to(torch.int32).to(_device()), (blocks % 3).to(torch.int32).to(_device())
    got = tk.block_sddmm(go, x, rows, cols, bh, bw)
    want = kernels.block_sddmm_reference(go, x, rows, cols, bh, bw)
    # tl.dot on float32 may use TF32 on a GPU (≈1e-3 relative)
    tol = 2e-2 if _device() == "cuda" else 1e-4
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    dense = go.t().mm(x)
    torch.testing.assert_close(want[1], dense[0:bh, 2 * bw : 3 * bw], rtol=1e-4, atol=1e-4)


def test_block_sddmm_rejects_unsupported_shapes(tk):
    z = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"block_shape \(1, bw\) or \(≥16, ≥16\), got \(4, 4\)"):
        tk.block_sddmm(z, z, torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 4, 4)


@pytest.mark.parametrize("src_dtype, index_dtype, dtype", [(torch.bfloat16, torch.int32, torch.float32), (torch.float16, torch.int64, torch.float32),
                                                       (torch.float32, torch.int32, torch.float32), (torch.float32, torch.int32, torch.bfloat16)])
def test_gather_as_matches_index_select(tk, src_dtype, index_dtype, dtype):
    """The value gradient's gather: the same values as ``index_select`` + ``to`` (every 16-bit value is
    exact in float32; float32 → bfloat16 rounds as torch does when compiled), in one launch, ragged last
    block included; no indices give an empty result."""
    g = torch.Generator().manual_seed(11)
    flat = (torch.randn(3000, generator=g) * 1e-3).to(src_dtype).to(_device())
    flat[5] = float("nan")
    flat[7] = float("-inf")
    idx = torch.cat([torch.tensor([5, 7]), random_indices(3000, 1500, g)]).to(index_dtype).to(_device())
    got = tk.gather_as(flat, idx, dtype)
    want = flat.index_select(0, idx).to(dtype)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32 or _device() == "cuda":
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # (NaN payloads included)
    else:
        torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-2, atol=1e-5)
    assert tk.gather_as(flat, idx[:0], dtype).shape == (0,)


def test_gather_as_dispatch(monkeypatch):
    """``kernels.gather_as`` hands a contiguous 1-D tensor of a kernel type with int32/int64 indices on its
    device to the registered kernel, and takes the torch path otherwise (float64, a non-contiguous or
    2-D source, a float64 target) with the same values; other index types get index_select's error."""
    calls = []
    monkeypatch.setitem(kernels.GATHER_KERNELS, "cpu", lambda flat, idx, dtype: calls.append(1) or flat.index_select(0, idx).to(dtype))
    monkeypatch.setattr(devices, "_GPU_KERNELS_TRIED", True)
    idx = torch.tensor([9, 0, 3], dtype=torch.int32)
    for flat, index, dtype, kernel in [
        (torch.arange(10, dtype=torch.bfloat16), idx, torch.float32, True),
        (torch.arange(10, dtype=torch.float32), idx.long(), torch.bfloat16, True),
        (torch.arange(10, dtype=torch.float64), idx, torch.float32, False),
        (torch.arange(20, dtype=torch.float32)[::2], idx, torch.float32, False),
        (torch.arange(10, dtype=torch.float32), idx, torch.float64, False),
    ]:  # fmt: skip
        calls.clear()
        out = kernels.gather_as(flat, index, dtype)
        assert bool(calls) == kernel and out.dtype == dtype
        assert torch.equal(out, flat.index_select(0, index.long()).to(dtype))
    calls.clear()
    row = torch.tensor([1], dtype=torch.int32)
    assert kernels.gather_as(torch.arange(10.0).view(2, 5), row, torch.float32).tolist() == [[5.0, 6.0, 7.0, 8.0, 9.0]]
    with pytest.raises(RuntimeError, match="int32 or int64"):  # as index_select refuses them
        kernels.gather_as(torch.arange(10.0), idx.to(torch.int16), torch.float32)
    assert not calls


@pytest.mark.parametrize("momentum, weight_decay, out_f, in_f, nnz, index_dtype, beta2", [
    (0.0, 0.0, 12, 20, 70, torch.int32, None), (0.5, 0.1, 12, 20, 70, torch.int32, None), (0.0, 0.0, 40, 100, 3000, torch.int32, None),
    (0.0, 0.0, 40, 100, 3000, torch.int64, None), (0.5, 0.1, 12, 20, 70, torch.int32, 0.9), (0.0, 0.0, 40, 100, 3000, torch.int32, 0.999),
])  # fmt: skip
def test_fused_sm3_step_matches_torch_sm3(tk, momentum, weight_decay, out_f, in_f, nnz, index_dtype, beta2):
    """The fused step against the sequential definition; 3000 of 4000 entries: each column is met by
    tens of entries over several programs (the column maxima skip entries that cannot raise them),
    with 32-bit and 64-bit index arithmetic; the sums and the moving-average form (β₂, at step 3)."""
    from peft_sparse import SM3

    g = torch.Generator().manual_seed(3)
    idx = random_indices(out_f * in_f, nnz, g).to(index_dtype).to(_device())
    values = torch.randn(nnz, generator=g).to(_device())
    rows, cols = kernels.rows_cols(idx, in_f)
    row_acc, col_acc = torch.rand(out_f, generator=g).to(_device()), torch.rand(in_f, generator=g).to(_device())
    mom = torch.randn(nnz, generator=g).to(_device()) if momentum else None
    grad = torch.randn(nnz, generator=g).to(_device())
    # the sequential definition
    keep, scale = (1.0, 1.0) if beta2 is None else (beta2, 1.0 / (1.0 - beta2**3))
    nu = torch.minimum(row_acc[rows], col_acc[cols]) * keep + (1.0 - (beta2 or 0.0)) * (grad * grad)
    want_r = (row_acc * keep).scatter_reduce(0, rows, nu, reduce="amax", include_self=True)
    want_c = (col_acc * keep).scatter_reduce(0, cols, nu, reduce="amax", include_self=True)
    update = grad / (nu * scale + 1e-30).sqrt()
    if momentum:
        update = momentum * mom + (1 - momentum) * update
    want_v = values * (1 - 0.1 * weight_decay) - 0.1 * update
    v = values.clone()
    new_r, new_c = tk.sm3_sparse_step(v, grad, idx, in_f, row_acc, col_acc, mom, 0.1, momentum, 1e-30, weight_decay, beta2=beta2, step=3)
    torch.testing.assert_close(v, want_v, rtol=1e-5, atol=1e-6)
    assert torch.equal(new_r, want_r) and torch.equal(new_c, want_c)  # (maxima: exact)
    assert SM3 is not None


@pytest.mark.parametrize("bh, bw", [(32, 32), (1, 64)])
def test_block_sddmm_token_slices_match_reference(tk, bh, bw):
    """Few blocks over many tokens: the kernel cuts the token axis into slices (ragged last slice)
    and sums the partial tiles; the result is the same product."""
    g = torch.Generator().manual_seed(7 + bh)
    tokens, out_f, in_f = 1000, 2 * bh, 2 * bw
    go = torch.randn(tokens, out_f, generator=g).to(_device())
    x = torch.randn(tokens, in_f, generator=g).to(_device())
    rows = torch.tensor([0, 1, 1], dtype=torch.int32).to(_device())
    cols = torch.tensor([1, 0, 1], dtype=torch.int32).to(_device())
    splits, per = tk.token_splits(3, tokens, 64, target_programs=12)
    assert splits == 3 and per == 384 and (splits - 1) * per < tokens <= splits * per  # 3 slices, the last one ragged
    got = tk.block_sddmm(go, x, rows, cols, bh, bw, target_programs=12)
    want = kernels.block_sddmm_reference(go, x, rows, cols, bh, bw)
    tol = 2e-2 if _device() == "cuda" else 1e-4
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_token_splits_bounds(tk):
    assert tk.token_splits(1000, 8192, 64, 528) == (1, 8192)  # enough blocks: one program per block
    assert tk.token_splits(25, 8192, 64, 528) == (22, 384)  # ⌈528 / 25⌉ slices of 384 tokens
    assert tk.token_splits(1, 300, 64, 528) == (1, 320)  # too few tokens for slices of ≥ 4 steps
    assert tk.token_splits(1, 8192, 64, 528) == (32, 256)  # at most tokens / (4·64) slices


@pytest.mark.parametrize("source_dtype, out_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (None, torch.float32)])
def test_scatter_add_matches_reference(tk, source_dtype, out_dtype):
    """Fused copy + scatter-add == torch's copy, gather, add, index_put; ranges cross program
    boundaries, one range holds a dense run longer than a sub-block, and a second adapter adds onto
    the first. Compiled (GPU): bit for bit, including the rounding of 16-bit sums. Triton's CPU
    interpreter rounds float32 → 16-bit conversions its own way, so there 16-bit results may differ
    by a unit in the last place of each operand (float32 results are exact)."""
    g = torch.Generator().manual_seed(3)
    block = tk._COMPOSE_BLOCK  # elements per program
    numel = 3 * block + 77
    dense_run = torch.arange(block + 10, block + 10 + 1500)  # > the kernel's 512-entry sub-block
    edges = torch.tensor([0, block - 1, block, 2 * block - 1, numel - 1])
    idx = torch.unique(torch.cat([random_indices(numel, 3000, g), dense_run, edges]))
    idx2 = random_indices(numel, 300, g)
    vals = torch.randn(idx.numel(), generator=g)
    vals2 = torch.randn(idx2.numel(), generator=g)
    base = torch.randn(numel, generator=g)
    dev = _device()
    for index_dtype in (torch.int64, torch.int32):
        if source_dtype is None:  # in place: no copy, out already holds the weight
            want = base.to(out_dtype)
            got = want.clone().to(dev)
            source, source_ref = None, None
        else:
            source_ref = base.to(source_dtype)
            source, got = source_ref.to(dev), torch.empty(numel, dtype=out_dtype, device=dev)
            want = torch.empty(numel, dtype=out_dtype)
        kernels.scatter_add_reference(want, idx, vals, source_ref)
        kernels.scatter_add_reference(want, idx2, vals2)
        tk.scatter_add_into(got, idx.to(index_dtype).to(dev), vals.to(dev), source)
        tk.scatter_add_into(got, idx2.to(index_dtype).to(dev), vals2.to(dev))
        if dev == "cuda" or out_dtype == torch.float32:
            assert torch.equal(got.cpu(), want)
        else:
            torch.testing.assert_close(got.cpu(), want, rtol=2**-6, atol=2**-4)  # a few bf16 units at |x| ≤ 8


def _lower_bound_probe():
    """A kernel storing _lower_bound(IDX, n, TARGETS[p]) for each program p (Triton resolves the
    helper through this module's globals, so it is bound here)."""
    import triton
    import triton.language as tl

    from peft_sparse.accel.triton_kernels import _lower_bound

    globals()["_lower_bound"] = _lower_bound

    @triton.jit
    def probe(IDX, n, TARGETS, OUT, n_iter, K: tl.constexpr):
        p = tl.program_id(0)
        tl.store(OUT + p, _lower_bound(IDX, n, tl.load(TARGETS + p).to(tl.int64), n_iter, K))

    return probe


@pytest.mark.parametrize("n, k", [(0, 4), (1, 4), (2, 4), (37, 4), (1000, 4), (1000, 512), (5000, 16)])
def test_lower_bound_search_matches_searchsorted(tk, n, k):
    """The fused kernel's K-ary search finds every insertion point (== torch.searchsorted, left) in
    the number of rounds the launcher computes; small K forces many rounds."""
    probe = _lower_bound_probe()
    g = torch.Generator().manual_seed(n + k)
    idx = torch.unique(torch.randint(0, 3 * n + 5, (n,), generator=g)).to(torch.int32)
    hits = idx[torch.randperm(idx.numel(), generator=g)[:40]].long()  # present values, and their neighbours
    targets = torch.unique(torch.cat([torch.tensor([-1, 0, 3 * n + 6]), hits - 1, hits, hits + 1, torch.randint(0, 3 * n + 6, (40,), generator=g)]))
    want = torch.searchsorted(idx.long(), targets, side="left")
    dev = _device()
    got = torch.empty(targets.numel(), dtype=torch.int64, device=dev)
    probe[(targets.numel(),)](idx.to(dev), idx.numel(), targets.to(dev), got, tk._search_rounds(idx.numel(), k), K=k)
    assert torch.equal(got.cpu(), want)


def test_scatter_add_without_indices(tk):
    out = torch.empty(40000, dtype=torch.float32, device=_device())
    src = torch.randn(40000, device=_device()).to(torch.bfloat16)
    tk.scatter_add_into(out, torch.zeros(0, dtype=torch.int64, device=_device()), torch.zeros(0, device=_device()), src)
    assert torch.equal(out, src.float())



def _assert_16bit_equal(got, want, exact):
    """Bit for bit when compiled; in Triton's CPU interpreter (its own float32 → 16-bit rounding)
    the same infinities and finite values within a unit in the last place."""
    got = got.cpu()
    if exact:
        assert torch.equal(got, want)
        return
    finite = want.isfinite()
    assert torch.equal(got.isfinite(), finite) and torch.equal(got[~finite], want[~finite])
    torch.testing.assert_close(got[finite].float(), want[finite].float(), rtol=2**-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 37, 300), (5, 1, 256), (1, 19)])
def test_scaled_product_matches_rmsnorm_arithmetic(tk, monkeypatch, dtype, shape):
    """weight · (h · rsqrt).to(dtype) — an RMSNorm's output — in one pass == torch's three operations,
    for magnitudes from 16-bit subnormal to overflowing and rows/columns that are not multiples of the
    kernel's tiles; and the dispatcher sends either operand order to the kernel."""
    g = torch.Generator().manual_seed(shape[-1])
    dev = _device()
    h = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-30, 20, shape, generator=g).float())
    r = torch.rand(shape[:-1] + (1,), generator=g) + 0.01
    h.view(-1)[0] = 1e6  # beyond float16's range
    w = (torch.randn(shape[-1], generator=g) * 4).to(dtype)
    want = kernels.scaled_product_reference(w, h, r, dtype)
    got = tk.scaled_product(w.to(dev), h.to(dev), r.to(dev), dtype)
    assert got.shape == want.shape and got.dtype == dtype
    _assert_16bit_equal(got, want, exact=dev == "cuda")

    calls = []
    devices.load_gpu_kernels()  # registered first: the patch below must not be the first registration

    def kernel(*args):
        calls.append(args)
        return tk.scaled_product(*args)

    monkeypatch.setitem(kernels.SCALED_PRODUCT_KERNELS, dev, kernel)
    for p, q in ((h, r), (r, h)):
        _assert_16bit_equal(kernels.scaled_product(w.to(dev), p.to(dev), q.to(dev), dtype), want, exact=dev == "cuda")
    assert len(calls) == 2 and all(c[1].shape == shape for c in calls)
    # shapes that are not an RMSNorm's go to the reference: a per-column second factor
    col = torch.rand(shape[-1], generator=g)
    assert torch.equal(kernels.scaled_product(w.to(dev), h.to(dev), col.to(dev), dtype).cpu(), kernels.scaled_product_reference(w, h, col, dtype))
    assert len(calls) == 2


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_multi_tensor_scatter_sum_matches_per_tensor(tk, out_dtype):
    """One launch over several tensors (sizes across program boundaries, one without entries) ==
    scatter_sum_reference on each; a plan is reused while the tensors stay, rebuilt when one moves."""
    g = torch.Generator().manual_seed(5)
    dev = _device()
    sizes, counts = [5000, 300, 4096, 70], [2500, 0, 1025, 70]
    outs = [torch.randn(n, generator=g).to(out_dtype) for n in sizes]
    idx = [random_indices(n, c, g).to(torch.int32) for n, c in zip(sizes, counts)]
    bases = [torch.randn(c, generator=g).to(out_dtype) for c in counts]
    vals = [torch.randn(c, generator=g) for c in counts]
    want = [kernels.scatter_sum_reference(o.clone(), i, b, v) for o, i, b, v in zip(outs, idx, bases, vals)]
    got = [o.to(dev) for o in outs]
    args = [[t.to(dev) for t in ts] for ts in (idx, bases, vals)]
    plan = tk.MultiScatterSum(got, *args)
    assert plan.programs == sum(-(-c // tk._MULTI_BLOCK) for c in counts)
    plan()
    for a, b in zip(got, want):
        if dev == "cuda" or out_dtype == torch.float32:
            assert torch.equal(a.cpu(), b)
        else:  # the interpreter's own 16-bit rounding (see test_scatter_add_matches_reference)
            torch.testing.assert_close(a.cpu(), b, rtol=2**-6, atol=2**-4)
    assert plan.key == tk.MultiScatterSum.key_of(got, *args)
    moved = [got[0].clone()] + got[1:]
    assert plan.key != tk.MultiScatterSum.key_of(moved, *args)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_multi_tensor_scatter_without_values_stores_the_bases_bit_for_bit(tk, out_dtype):
    """values None (θ₀ written back): every base lands as it is, −0.0 and subnormals included."""
    g = torch.Generator().manual_seed(6)
    dev = _device()
    sizes, counts = [3000, 1500], [1100, 7]
    outs = [torch.randn(n, generator=g).to(out_dtype).to(dev) for n in sizes]
    idx = [random_indices(n, c, g).to(torch.int32).to(dev) for n, c in zip(sizes, counts)]
    bases = [torch.randn(c, generator=g).to(out_dtype) for c in counts]
    bases[0][:4] = torch.tensor([-0.0, 0.0, torch.finfo(out_dtype).tiny / 4, -torch.finfo(out_dtype).tiny / 4])
    bases = [b.to(dev) for b in bases]
    want = [o.clone().index_put_((i.long(),), b) for o, i, b in zip(outs, idx, bases)]
    tk.MultiScatterSum(outs, idx, bases)()
    bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
    for a, b in zip(outs, want):
        assert torch.equal(a.view(bits), b.view(bits))


def _nf4_case(shape, blocksize, nested, seed=0):
    """A bitsandbytes NF4 quantization (CPU) of a random weight, as nf4_compose operands."""
    bnb_f = pytest.importorskip("bitsandbytes.functional")
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 3).to(torch.bfloat16)
    packed, state = bnb_f.quantize_4bit(w, quant_type="nf4", compress_statistics=nested, blocksize=blocksize)
    inner = (state.absmax, state.state2.absmax, state.state2.code, state.state2.blocksize, float(state.offset)) if nested else None
    return packed, state, (packed, state.code, state.absmax, inner, state.blocksize, tuple(state.shape))


@pytest.mark.parametrize("nested", [True, False])
def test_nf4_reference_is_bitsandbytes_dequantization(nested):
    bnb_f = pytest.importorskip("bitsandbytes.functional")
    for shape, blocksize in (((96, 320), 64), ((40, 256), 128)):
        packed, state, ops = _nf4_case(shape, blocksize, nested)
        assert torch.equal(kernels.nf4_dequantize_reference(*ops, torch.bfloat16), bnb_f.dequantize_4bit(packed, state))


@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("shape, blocksize, chunk", [((48, 1024), 64, None), ((40, 200), 128, None), ((40, 200), 256, 64)])
def test_nf4_compose_matches_reference(tk, nested, shape, blocksize, chunk, monkeypatch):
    """Dequantization and scatter in one launch == bitsandbytes' dequantization, then scatter_add; ranges
    cross program boundaries (48×1024), a last chunk and quantization block end inside
    the weight (40×200), quantization blocks longer than a chunk (chunk 64), and a pass without values
    only dequantizes."""
    dev = _device()
    monkeypatch.setattr(tk, "_NF4_BLOCK", 4096)  # (48×1024: twelve programs)
    if chunk is not None:
        monkeypatch.setattr(tk, "_NF4_CHUNK", chunk)
    packed, _, ops = _nf4_case(shape, blocksize, nested, seed=1)
    g = torch.Generator().manual_seed(2)
    idx = random_indices(shape[0] * shape[1], shape[0] * shape[1] // 16, g).to(torch.int32)
    vals = torch.randn(idx.numel(), generator=g) * 0.1
    want_plain = kernels.nf4_dequantize_reference(*ops, torch.bfloat16)
    want = kernels.scatter_add_reference(want_plain.clone(), idx, vals)

    def moved(ops):
        packed, code, absmax, inner, blocksize, shape = ops
        inner = None if inner is None else (inner[0].to(dev), inner[1].to(dev), inner[2].to(dev), inner[3], inner[4])
        return packed.to(dev), code.to(dev), absmax.to(dev), inner, blocksize, shape

    got = tk.nf4_compose(*moved(ops), torch.bfloat16, idx.to(dev), vals.to(dev))
    plain = tk.nf4_compose(*moved(ops), torch.bfloat16)
    starts = tk.compose_starts(idx.to(dev), shape[0] * shape[1])  # each program's slice given, not searched
    assert torch.equal(tk.nf4_compose(*moved(ops), torch.bfloat16, idx.to(dev), vals.to(dev), starts=starts), got)
    if dev == "cuda":
        assert torch.equal(got.cpu(), want) and torch.equal(plain.cpu(), want_plain)
    else:  # the interpreter's own 16-bit rounding (see test_scatter_add_matches_reference)
        torch.testing.assert_close(got.cpu(), want, rtol=2**-6, atol=2**-6)
        torch.testing.assert_close(plain.cpu(), want_plain, rtol=2**-6, atol=2**-6)
        exact = tk.nf4_compose(*moved(ops), torch.float32, idx.to(dev), vals.to(dev))  # float32: no rounding question
        assert torch.equal(exact.cpu(), kernels.scatter_add_reference(kernels.nf4_dequantize_reference(*ops, torch.float32), idx, vals))
        untouched = torch.ones(want.numel(), dtype=torch.bool)
        untouched[idx.long()] = False
        assert torch.equal(got.cpu().view(-1)[untouched], plain.cpu().view(-1)[untouched])


@pytest.mark.parametrize("out_blocks, in_blocks", [(6, 3), (3, 6), (4, 4)])
@pytest.mark.parametrize("group, target", [(4, None), (2, 40)])
def test_block_sddmm_into_writes_dense_dw_at_the_active_elements(tk, out_blocks, in_blocks, group, target):
    """Grouped by block row (wide matrices) or column (tall), padded groups, token slices and the
    accumulate mode: every active element of the values' ascending order gets dW's entry, bit for
    bit the slot the index search finds, nothing else is touched."""
    from peft_sparse.core.selection import BlockGrid

    bh = bw = 16
    g = torch.Generator().manual_seed(out_blocks * 10 + in_blocks + group)
    tokens, out_f, in_f = 300, out_blocks * bh, in_blocks * bw
    grid = BlockGrid(out_f, in_f, (bh, bw))
    blocks = torch.randperm(grid.numel, generator=g)[: grid.numel // 2 + 1].sort().values
    indices = grid.expand(blocks)
    layout = kernels.BlockLayout.of_blocks(blocks.to(_device()), out_f, in_f, (bh, bw))
    assert torch.equal(layout.slots().cpu(), torch.searchsorted(indices, grid.block_major(blocks).reshape(-1)))
    go = torch.randn(tokens, out_f, generator=g).to(_device())
    x = torch.randn(tokens, in_f, generator=g).to(_device())
    want = go.double().t().mm(x.double()).reshape(-1)[indices.to(_device())].float()
    out = torch.full((indices.numel(),), float("nan"), device=_device())
    tk.block_sddmm_into(go, x, layout, out, group=group, target_programs=target)
    tol = 2e-2 if _device() == "cuda" else 1e-4
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    start = torch.randn(indices.numel(), generator=g).to(_device())
    acc = start.clone()
    tk.block_sddmm_into(go, x, layout, acc, accumulate=True, group=group, target_programs=target)
    torch.testing.assert_close(acc, start + want, rtol=tol, atol=tol)
    ref = kernels.block_sddmm_into_reference(go, x, layout, torch.zeros_like(out))
    torch.testing.assert_close(ref, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("share_rows", [True, False])
def test_block_sddmm_into_token_slices_add_the_partials_of_each_slice(tk, share_rows):
    """Token slices (several programs per group, a ragged last slice): bit for bit the partials of one
    launch per slice, summed; with ``accumulate``, added to what ``out`` held."""
    from peft_sparse.core.selection import BlockGrid

    bh = bw = 16
    g = torch.Generator().manual_seed(11)
    tokens, out_f, in_f = 1100, 5 * bh, 4 * bw
    grid = BlockGrid(out_f, in_f, (bh, bw))
    blocks = torch.randperm(grid.numel, generator=g)[:9].sort().values
    indices = grid.expand(blocks)
    layout = kernels.BlockLayout.of_blocks(blocks.to(_device()), out_f, in_f, (bh, bw))
    plan = tk.BlockGroups.of_layouts([layout], share_rows, 2)[0]
    go = torch.randn(tokens, out_f, generator=g).to(_device())
    x = torch.randn(tokens, in_f, generator=g).to(_device())
    splits, per = tk.token_splits(plan.size, tokens, 64, 40)
    assert splits == 4 and per == 320
    partials = [
        tk.launch_grouped(go[t : t + per].contiguous(), x[t : t + per].contiguous(), (bh, bw), plan, torch.empty(indices.numel(), device=_device()), False, 64, 0)
        for t in range(0, tokens, per)
    ]  # fmt: skip
    want = torch.stack(partials).sum(0)
    out = tk.launch_grouped(go, x, (bh, bw), plan, torch.full_like(want, float("nan")), False, 64, 40)
    assert torch.equal(out, want)
    start = torch.randn(indices.numel(), generator=g).to(_device())
    acc = tk.launch_grouped(go, x, (bh, bw), plan, start.clone(), True, 64, 40)
    assert torch.equal(acc, start + want)
    exact = go.double().t().mm(x.double()).reshape(-1)[indices.to(_device())].float()
    tol = 2e-2 if _device() == "cuda" else 1e-4
    torch.testing.assert_close(out, exact, rtol=tol, atol=tol)


def test_block_sddmm_into_bf16_and_empty_layout(tk):
    # bf16 operands on a GPU (the interpreter's tl.dot has no bf16), float32 on CPU
    dtype = torch.bfloat16 if _device() == "cuda" else torch.float32
    g = torch.Generator().manual_seed(5)
    go = torch.randn(130, 64, generator=g).to(_device(), dtype)
    x = torch.randn(130, 96, generator=g).to(_device(), dtype)
    blocks = torch.tensor([0, 2, 3, 5])
    from peft_sparse.core.selection import BlockGrid

    grid = BlockGrid(64, 96, (32, 32))
    indices = grid.expand(blocks).to(_device())
    layout = kernels.BlockLayout.of_blocks(blocks.to(_device()), 64, 96, (32, 32))
    out = tk.block_sddmm_into(go, x, layout, torch.empty(indices.numel(), device=_device()))
    want = go.float().t().mm(x.float()).reshape(-1)[indices]
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    empty = kernels.BlockLayout.of_blocks(torch.zeros(0, dtype=torch.long, device=_device()), 64, 96, (32, 32))
    assert tk.block_sddmm_into(go, x, empty, torch.empty(0, device=_device())).numel() == 0
    with pytest.raises(ValueError, match=r"at least 16×16, got \(1, 64\)"):
        tk.block_sddmm_into(go, x, kernels.BlockLayout.of_blocks(blocks, 64, 128, (1, 64)), torch.empty(4 * 64))


@pytest.mark.parametrize("out_blocks, in_blocks, plans", [(4, 12, 2), (12, 4, 1)])
def test_block_sddmm_into_forms_a_product_input_tile_by_tile(tk, out_blocks, in_blocks, plans):
    """X given as two factors (the gated MLP's silu(gate) and up): bit for bit the result for X = A ⊙ B
    formed by torch, with the blocks grouped by row or by column (the plan weighs X's double read)."""
    from peft_sparse.core.selection import BlockGrid

    dtype = torch.bfloat16 if _device() == "cuda" else torch.float32  # the interpreter's tl.dot has no bf16
    bh = bw = 16
    g = torch.Generator().manual_seed(out_blocks)
    out_f, in_f = out_blocks * bh, in_blocks * bw
    grid = BlockGrid(out_f, in_f, (bh, bw))
    blocks = torch.randperm(grid.numel, generator=g)[:20].sort().values
    layout = kernels.BlockLayout.of_blocks(blocks.to(_device()), out_f, in_f, (bh, bw))
    go, a, b = (torch.randn(150, n, generator=g).to(_device(), dtype) for n in (out_f, in_f, in_f))
    fused = tk.block_sddmm_into(go, a, layout, torch.empty(20 * bh * bw, device=_device()), group=4, x_factor=b)
    formed = tk.block_sddmm_into(go, a * b, layout, torch.empty(20 * bh * bw, device=_device()), group=4)
    assert len(layout.plans) == plans  # wide: block rows shared when X is read once, block columns for two factors
    plan = tk.block_group_plan(layout, 4, x_reads=2)
    target = tk._target_programs(go.device) if go.is_cuda else 1  # block_sddmm_into's token slicing
    same_plan = tk.launch_grouped(go, a * b, (bh, bw), plan, torch.empty_like(fused), False, 64, target)
    assert torch.equal(fused, same_plan)  # the product's bits: those of torch's a * b
    torch.testing.assert_close(fused, formed, rtol=1e-5, atol=1e-4)  # another grouping: float32 sums in another order
    ref = kernels.block_sddmm_into(go.cpu(), a.cpu(), _cpu_layout(layout), torch.empty(fused.numel()), x_factor=b.cpu())
    torch.testing.assert_close(fused.cpu(), ref, rtol=2e-2 if dtype == torch.bfloat16 else 1e-4, atol=2e-2 if dtype == torch.bfloat16 else 1e-4)
    with pytest.raises(ValueError, match="x_factor must match"):
        tk.block_sddmm_into(go, a, layout, torch.empty(20 * bh * bw, device=_device()), x_factor=b[:, :16])


@pytest.mark.parametrize("block_shape", [(16, 32), (32, 32), (1, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_score_keys_and_gather_blocks_match_the_references(tk, block_shape, dtype):
    """Keys: the block number bit for bit, Σ|g| up to float32 summation order (a near-tie may flip);
    gathered blocks: layout, ascending indices (int32 and int64) and values bit for bit."""
    bh, bw = block_shape
    g = torch.Generator().manual_seed(bh + bw)
    dense = torch.randn(4 * max(bh, 16), 5 * bw, generator=g).to(dtype)
    want = kernels.block_score_keys_reference(dense, block_shape)
    got = tk.block_score_keys(dense.to(_device()), block_shape).cpu()
    assert torch.equal(got & 0xFFFFFFFF, want & 0xFFFFFFFF)
    as_float = lambda k: (k >> 32).to(torch.int32).view(torch.float32)  # noqa: E731
    torch.testing.assert_close(as_float(got), as_float(want), rtol=1e-6, atol=0)
    units = kernels.top_blocks(want, 7)
    assert units.tolist() == sorted(units.tolist()) and len(set(units.tolist())) == 7
    for index_dtype in (torch.int32, torch.int64):
        layout, idx, vals = kernels.gather_blocks_reference(dense, units, block_shape, index_dtype)
        t_layout, t_idx, t_vals = tk.gather_blocks(dense.to(_device()), units.to(_device()), block_shape, index_dtype)
        for name in ("rows", "cols", "base", "stride", "units"):
            a, b = getattr(layout, name), getattr(t_layout, name).cpu()
            assert a.dtype == b.dtype and torch.equal(a, b), name
        assert torch.equal(t_layout.block_numbers().cpu(), units)
        assert t_idx.dtype == index_dtype and torch.equal(t_idx.cpu(), idx) and torch.equal(t_vals.cpu(), vals)
    from peft_sparse.core.selection import BlockGrid

    assert torch.equal(idx, BlockGrid(*dense.shape, block_shape).expand(units))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k", [(10000, 37), (9001, 4500), (13000, 1), (4096, 4095)])
def test_top_magnitudes_radix_selection_matches_the_reference(tk, dtype, n, k):
    """The k largest |x| (ties → lowest index, −0.0 ties +0.0), across chunk boundaries: the same
    ascending indices (int32 and int64) and float32 entries as the topk-threshold reference."""
    g = torch.Generator().manual_seed(n + k)
    dense = (torch.randn(n, generator=g) * 0.01).to(dtype)
    dense[::7] = dense[3]  # a magnitude shared by many entries, the k-th largest for some k
    dense[1::11] = -dense[3]
    dense[5], dense[6] = -0.0, 0.0
    for index_dtype in (torch.int32, torch.int64):
        want_idx, want_vals = kernels.top_magnitudes_reference(dense, k, index_dtype)
        got_idx, got_vals = tk.top_magnitudes(dense.to(_device()), k, index_dtype)
        assert got_idx.dtype == index_dtype and torch.equal(got_idx.cpu(), want_idx)
        assert torch.equal(got_vals.cpu(), want_vals)
    with_nan = dense.clone()
    with_nan[[17, 40, 41]] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    want_idx2, want_vals2 = kernels.top_magnitudes_reference(with_nan, k, torch.int64)
    got_idx2, got_vals2 = tk.top_magnitudes(with_nan.to(_device()), k, torch.int64)
    assert torch.equal(got_idx2.cpu(), want_idx2)  # NaN ranks above ±inf, which rank above every number
    torch.testing.assert_close(got_vals2.cpu(), want_vals2, rtol=0, atol=0, equal_nan=True)
    assert ({17, 40, 41} <= set(want_idx2.tolist())) if k >= 3 else want_idx2.tolist() == [17]
    big = dense.abs().float()
    chosen = big[want_idx.long()]
    rest = torch.ones(n, dtype=torch.bool)
    rest[want_idx.long()] = False
    assert chosen.min() >= big[rest].max()  # really the k largest


@pytest.mark.parametrize("n, k", [(6, 1), (6, 4), (3000, 1), (3000, 777), (2049, 2048), (5000, 4999)])
def test_top_blocks_radix_selection_matches_the_reference(tk, n, k):
    """The Triton selection of the k largest block keys: the reference's ascending blocks, with sums
    shared by many blocks (ties → lower blocks, across chunk boundaries), zeros, ±inf and NaNs of
    either sign bit (NaN above inf; a NaN with the sign bit set below every number, as its bits rank)."""
    g = torch.Generator().manual_seed(n + k)
    sums = torch.rand(n, generator=g) * 100
    sums[::5] = sums[2]  # a sum shared by a fifth of the blocks
    sums[3::17] = 0.0
    special = torch.tensor([float("nan"), float("inf"), -float("nan"), -float("inf")])
    sums[-4:] = special if n >= 8 else sums[-4:]
    bits = sums.view(torch.int32)
    if n >= 8:
        bits[-2] = torch.tensor(0xFFC00000 - 2**32, dtype=torch.int32)  # a NaN with the sign bit set
    keys = (bits.long() << 32) | (0xFFFFFFFF - torch.arange(n))
    want = kernels.top_blocks_reference(keys, k)
    got = tk.top_blocks(keys.to(_device()), k).cpu()
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(want, torch.topk(keys, k).indices.sort().values)  # really the k largest keys


def test_top_blocks_breaks_ties_toward_lower_blocks():
    sums = torch.tensor([1.0, 3.0, 2.0, 3.0, 0.0, 2.0])
    keys = (sums.view(torch.int32).long() << 32) | (0xFFFFFFFF - torch.arange(6))
    assert kernels.top_blocks(keys, 1).tolist() == [1]
    assert kernels.top_blocks(keys, 3).tolist() == [1, 2, 3]
    assert kernels.top_blocks(keys, 4).tolist() == [1, 2, 3, 5]
    assert kernels.top_blocks(keys, 9).tolist() == [0, 1, 2, 3, 4, 5]


def test_program_map_covers_every_entry_once(tk):
    """The multi-tensor kernels' program map: each program's tensor and first entry, ``_MULTI_BLOCK``
    entries apart, every entry of every tensor (an empty one included) in exactly one program."""
    counts = [1, tk._MULTI_BLOCK, 0, 2 * tk._MULTI_BLOCK + 5, 7]
    programs, counts_t, tensor_of, start = tk._program_map(counts, torch.device(_device()))
    assert programs == 1 + 1 + 0 + 3 + 1 and counts_t.tolist() == counts
    assert tensor_of.dtype == torch.int32 and tensor_of.tolist() == [0, 1, 3, 3, 3, 4]
    assert start.dtype == torch.int64 and start.tolist() == [0, 0, 0, tk._MULTI_BLOCK, 2 * tk._MULTI_BLOCK, 0]
    assert tk._program_map([], torch.device(_device()))[0] == 0


def test_plans_of_many_layouts_equal_the_plans_one_by_one(tk):
    """Layouts of several shapes (one empty) planned together: each plan equals its own one-layout plan,
    and every active block sits once in a group of its block row (column) with its base and stride."""
    from peft_sparse.core.selection import BlockGrid

    g = torch.Generator().manual_seed(4)
    layouts = []
    for out_f, in_f, share in ((64, 160, 0.4), (160, 64, 0.5), (32, 32, 0.0), (128, 128, 0.2)):
        grid = BlockGrid(out_f, in_f, (16, 16))
        blocks = torch.randperm(grid.numel, generator=g)[: int(share * grid.numel)].sort().values
        layouts.append(kernels.BlockLayout.of_blocks(blocks, out_f, in_f, (16, 16)))
    for share_rows in (True, False):
        many = tk.BlockGroups.of_layouts(layouts, share_rows, 4)
        for layout, plan in zip(layouts, many):
            one = tk.BlockGroups.of_layouts([layout], share_rows, 4)[0]
            for name in ("line", "other", "base", "stride"):
                assert torch.equal(getattr(plan, name), getattr(one, name)), name
            assert all(t.data_ptr() % 16 == 0 for t in (plan.line, plan.other, plan.base, plan.stride))  # one compiled variant
            seen = {}
            for p in range(plan.size):
                members = [m for m in range(4) if plan.other[p, m] >= 0]
                assert (plan.line[p] >= 0) == bool(members)
                for m in members:
                    line, other = int(plan.line[p]), int(plan.other[p, m])
                    seen[(line, other) if share_rows else (other, line)] = (int(plan.base[p, m]), int(plan.stride[p, m]))
            want = {(int(r), int(c)): (int(b), int(st)) for r, c, b, st in zip(layout.rows, layout.cols, layout.base, layout.stride)}
            assert seen == want and len(seen) == layout.rows.numel()


def _cpu_layout(layout):
    return kernels.BlockLayout(*(t.cpu() for t in (layout.rows, layout.cols, layout.base, layout.stride)),
                               layout.block_shape, layout.out_features, layout.in_features)  # fmt: skip


def test_block_kernels_follow_torch_float32_matmul_precision(tk):
    """float32 operands: full precision unless torch allows TF32 (then TF32, as torch's own matmul)."""
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert tk.dot_precision(torch.float32) == "ieee"
        if _device() == "cuda":  # compiled: within float32 rounding of a float64 product
            from peft_sparse.core.selection import BlockGrid

            g = torch.Generator().manual_seed(3)
            grid = BlockGrid(64, 64, (32, 32))
            blocks = torch.tensor([0, 3])
            layout = kernels.BlockLayout.of_blocks(blocks.cuda(), 64, 64, (32, 32))
            go, x = torch.randn(4096, 64, generator=g).cuda(), torch.randn(4096, 64, generator=g).cuda()
            out = tk.block_sddmm_into(go, x, layout, torch.empty(2048, device="cuda"))
            want = go.double().t().mm(x.double()).reshape(-1)[grid.expand(blocks).cuda()]
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)
        torch.set_float32_matmul_precision("high")
        assert tk.dot_precision(torch.float32) == "tf32"
        assert tk.dot_precision(torch.bfloat16) == "tf32"  # 16-bit operands: exact products either way
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_multi_tensor_sm3_step_equals_one_launch_per_tensor(tk, momentum):
    """Tensors of different sizes (one over several programs) and widths in one launch: values,
    momentum and both accumulators exactly as the per-tensor kernel leaves them."""
    g = torch.Generator().manual_seed(11)
    shapes = [(12, 20, 70), (40, 100, 2500), (8, 8, 1)]
    per, multi = [], []
    for out_f, in_f, nnz in shapes:
        idx = random_indices(out_f * in_f, nnz, g).to(torch.int32).to(_device())
        tensors = dict(
            values=torch.randn(nnz, generator=g), grad=torch.randn(nnz, generator=g), row=torch.rand(out_f, generator=g),
            col=torch.rand(in_f, generator=g), mom=torch.randn(nnz, generator=g) if momentum else None,
        )  # fmt: skip
        tensors = {k: v.to(_device()) if v is not None else None for k, v in tensors.items()}
        for store in (per, multi):
            store.append((idx, in_f, {k: v.clone() if v is not None else None for k, v in tensors.items()}))
    want = []
    for idx, in_f, t in per:
        r, c = tk.sm3_sparse_step(t["values"], t["grad"], idx, in_f, t["row"], t["col"], t["mom"], 0.1, momentum, 1e-30, 0.01)
        want.append((t["values"], t["mom"], r, c))
    ts = [t for _, _, t in multi]
    row_new, col_new = [t["row"].clone() for t in ts], [t["col"].clone() for t in ts]
    plan = tk.MultiSM3([t["values"] for t in ts], [t["grad"] for t in ts], [i for i, _, _ in multi], [f for _, f, _ in multi],
                       [t["row"] for t in ts], [t["col"] for t in ts], row_new, col_new, [t["mom"] for t in ts])  # fmt: skip
    assert plan.programs == 1 + 3 + 1
    plan([t["grad"] for t in ts], 0.1, momentum, 1e-30, 0.01)
    for (v, m, r, c), t, rn, cn in zip(want, ts, row_new, col_new):
        assert torch.equal(t["values"], v) and torch.equal(rn, r) and torch.equal(cn, c)
        assert m is None or torch.equal(t["mom"], m)
    # a second step with fresh gradient tensors (new addresses) through the same plan: the gradients'
    # table is written at each call, so the plan stays valid
    fresh = [torch.randn(t["grad"].numel(), generator=g).to(_device()) for t in ts]
    want2 = []
    for (idx, in_f, t), (_, _, r, c), grad in zip(per, want, fresh):
        want2.append(tk.sm3_sparse_step(t["values"], grad, idx, in_f, r, c, t["mom"], 0.1, momentum, 1e-30, 0.01))
    for t, rn, cn in zip(ts, row_new, col_new):  # the plan's "previous" buffers now hold step 1's accumulators
        t["row"].copy_(rn)
        t["col"].copy_(cn)
    plan([grad.clone() for grad in fresh], 0.1, momentum, 1e-30, 0.01)
    for (_, _, want_t), (r2, c2), t, rn, cn in zip(per, want2, ts, row_new, col_new):
        assert torch.equal(t["values"], want_t["values"]) and torch.equal(rn, r2) and torch.equal(cn, c2)
        assert want_t["mom"] is None or torch.equal(t["mom"], want_t["mom"])


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("block_shape", [(16, 16), (1, 64), (32, 16)])
def test_multi_tensor_sm3_step_of_block_adapters_equals_the_per_element_launch(tk, momentum, block_shape):
    """One program per block (row and column maxima reduced in the program) leaves values, momentum and
    both accumulators exactly as the per-element launch does, for tensors of several sizes and block
    rows holding different numbers of active blocks."""
    from peft_sparse.core.selection import BlockGrid

    bh, bw = block_shape
    g = torch.Generator().manual_seed(bh * 100 + bw)
    dev = _device()
    runs = []
    shapes = [(4 * bh, 3 * bw, 5), (2 * bh, 5 * bw, 7), (bh, bw, 1)]
    specs = []
    for out_f, in_f, n_blocks in shapes:
        grid = BlockGrid(out_f, in_f, block_shape)
        blocks = torch.randperm((out_f // bh) * (in_f // bw), generator=g)[:n_blocks].sort().values
        idx = grid.expand(blocks).to(torch.int32)
        nnz = idx.numel()
        tensors = dict(
            values=torch.randn(nnz, generator=g), grad=torch.randn(nnz, generator=g), row=torch.rand(out_f, generator=g),
            col=torch.rand(in_f, generator=g), mom=torch.randn(nnz, generator=g) if momentum else None,
        )  # fmt: skip
        specs.append((out_f, in_f, blocks, idx, tensors))
    for blocked in (False, True):
        ts = [{k: v.clone().to(dev) if v is not None else None for k, v in t.items()} for *_, t in specs]
        idx = [i.to(dev) for *_, i, _ in specs]
        layouts = [kernels.BlockLayout.of_blocks(b.to(dev), o, i, block_shape) for o, i, b, _, _ in specs] if blocked else None
        row_new, col_new = [t["row"].clone() for t in ts], [t["col"].clone() for t in ts]
        plan = tk.MultiSM3([t["values"] for t in ts], [t["grad"] for t in ts], idx, [i for _, i, *_ in specs],
                           [t["row"] for t in ts], [t["col"] for t in ts], row_new, col_new, [t["mom"] for t in ts],
                           layouts=layouts)  # fmt: skip
        assert plan.holds(layouts) and not plan.holds(None if blocked else [])
        plan([t["grad"] for t in ts], 0.1, momentum, 1e-30, 0.01)
        runs.append([(t["values"], t["mom"], r, c) for t, r, c in zip(ts, row_new, col_new)])
    for (v, m, r, c), (v2, m2, r2, c2) in zip(*runs):
        assert torch.equal(v, v2) and torch.equal(r, r2) and torch.equal(c, c2)
        assert m is None or torch.equal(m, m2)


@pytest.mark.parametrize("bh, bw", [(64, 64), (128, 32), (16, 128)])
def test_block_sddmm_into_large_blocks(tk, bh, bw):
    """Larger blocks take fewer blocks per program (the tile stays within 128 rows or columns)."""
    from peft_sparse.core.selection import BlockGrid

    g = torch.Generator().manual_seed(bh + bw)
    grid = BlockGrid(3 * bh, 2 * bw, (bh, bw))
    blocks = torch.tensor([0, 3, 4, 5])
    indices = grid.expand(blocks)
    go = torch.randn(70, 3 * bh, generator=g).to(_device())
    x = torch.randn(70, 2 * bw, generator=g).to(_device())
    layout = kernels.BlockLayout.of_blocks(blocks.to(_device()), 3 * bh, 2 * bw, (bh, bw))
    out = tk.block_sddmm_into(go, x, layout, torch.empty(indices.numel(), device=_device()))
    want = go.double().t().mm(x.double()).reshape(-1)[indices.to(_device())].float()
    tol = 2e-2 if _device() == "cuda" else 1e-4
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)


def test_launch_reuses_the_kernel_triton_compiled_for_a_specialization(tk, monkeypatch):
    """triton_kernels.launch, with a stand-in for a jitted kernel: Triton's own launch serves the first
    call on a device and each new specialization; a repeated one runs the kept compiled kernel with
    every argument in signature order; launch hooks, debug mode and unhashable constants go through
    Triton's launch. (The compiled path itself: tests/test_gpu.py.)"""
    import triton

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def __init__(self):
            self.runs = []

        def run(self, *args):
            self.runs.append(args)

    class Kernel:  # what launch reads of triton's JITFunction
        def __init__(self):
            self.pre_run_hooks, self.device_caches, self.triton_launches, self.compiled = [], {}, [], {}

        def binder(self, x, n, BLOCK=None, **options):
            spec = [("*fp32", "D" if x % 16 == 0 else None), ("i32", n % 16 == 0), ("constexpr", BLOCK)]
            return {"x": x, "n": n, "BLOCK": BLOCK}, spec, options

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                self.device_caches.setdefault(0, ({}, {}, None, None, self.binder))
                self.triton_launches.append((grid, args, kwargs))
                _, spec, options = self.binder(*args, **kwargs)
                try:
                    return self.compiled.setdefault((tuple(spec), tuple(options.items())), Compiled())
                except TypeError:  # (an unhashable constant)
                    return Compiled()
            return run

    monkeypatch.setattr(tk, "_FAST_LAUNCH", [True])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(tk, "_current_cuda_device", lambda: 0)  # (what a kept plan asks)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 99, raising=False)
    kernel = Kernel()
    tk.launch(kernel, (4,), 32, 7, BLOCK=64, num_warps=4)  # first call on the device: Triton's launch
    tk.launch(kernel, (4,), 48, 9, BLOCK=64, num_warps=4)  # same specialization, not kept yet: Triton's
    assert len(kernel.triton_launches) == 2
    tk.launch(kernel, (5, 2), 64, 11, BLOCK=64, num_warps=4)  # kept: launched directly
    assert len(kernel.triton_launches) == 2
    (compiled,) = kernel.compiled.values()
    assert compiled.runs == [(5, 2, 1, 99, "fn", "meta", None, None, None, 64, 11, 64)]
    for args, kwargs in (((33, 7), dict(BLOCK=64, num_warps=4)),  # a misaligned address: another specialization
                         ((32, 16), dict(BLOCK=64, num_warps=4)),  # a size divisible by 16
                         ((32, 7), dict(BLOCK=128, num_warps=4)),  # another constant
                         ((32, 7), dict(BLOCK=64, num_warps=8))):  # another option  # fmt: skip
        before = len(kernel.triton_launches)
        tk.launch(kernel, (4,), *args, **kwargs)
        assert len(kernel.triton_launches) == before + 1, (args, kwargs)
    before = len(kernel.triton_launches)
    monkeypatch.setattr(triton.knobs.runtime, "debug", True)
    tk.launch(kernel, (4,), 32, 7, BLOCK=64, num_warps=4)
    monkeypatch.setattr(triton.knobs.runtime, "debug", False)
    hook = lambda metadata: None  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        tk.launch(kernel, (4,), 32, 7, BLOCK=64, num_warps=4)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    tk.launch(kernel, (4,), 32, 7, BLOCK=[64], num_warps=4)  # an unhashable constant
    assert len(kernel.triton_launches) == before + 3
    tk.launch(kernel, (4,), 32, 7, BLOCK=64, num_warps=4)
    assert len(kernel.triton_launches) == before + 3 and len(compiled.runs) == 2


def test_launch_plan_repeats_a_direct_launch_with_one_tensor_replaced(tk, monkeypatch):
    """triton_kernels.launch_plan, with stand-ins for a jitted kernel and its launcher: no plan while
    Triton's launch serves; once the direct path launched, a plan whose launches pass the other tensors
    as their addresses (scalars and constants as given) and the new tensor's address in the slot, through
    the launcher's compiled launch when it needs no scratch memory and through ``run`` otherwise; it
    refuses (False, nothing launched) a tensor of another dtype, alignment, size or device and launches
    while a launch hook or debug mode is set; it holds the tensors it points at. (CPU tensors stand in
    for a device's: the current device is -1, what ``get_device`` gives for them.)"""
    import triton

    class Launcher:  # what the plan reads of Triton's CudaLauncher
        launch_cooperative_grid, launch_pdl = False, True

        def __init__(self, scratch):
            self.global_scratch_size = self.profile_scratch_size = scratch
            self.calls, self.launches = [], []

        def __call__(self, *args):
            self.calls.append(args)

        def launch(self, *args):
            self.launches.append(args)

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def __init__(self, scratch):
            self.run = Launcher(scratch)

    class Kernel:
        def __init__(self, scratch):
            self.pre_run_hooks, self.device_caches, self.triton_launches = [], {}, []
            self.compiled = Compiled(scratch)

        def binder(self, src, out, n, BLOCK=None, **options):
            spec = [(str(src.dtype), src.data_ptr() % 16 == 0), (str(out.dtype), out.data_ptr() % 16 == 0), ("i32", n % 16 == 0), ("constexpr", BLOCK)]
            return {"SRC": src, "OUT": out, "n": n, "BLOCK": BLOCK}, spec, options

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                self.device_caches.setdefault(torch.cuda.current_device(), ({}, {}, None, None, self.binder))
                self.triton_launches.append(grid)
                return self.compiled
            return run

    monkeypatch.setattr(tk, "_FAST_LAUNCH", [True])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)
    monkeypatch.setattr(tk, "_current_cuda_device", lambda: -1)  # (what a kept plan asks)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 99, raising=False)
    for scratch in (0, 64):
        kernel = Kernel(scratch)
        launcher = kernel.compiled.run
        src, out = torch.zeros(8), torch.zeros(8)
        assert tk.launch_plan(kernel, (4,), "OUT", src, out, 7, BLOCK=32) is None  # Triton's launch: sets up the binder
        assert tk.launch_plan(kernel, (4,), "OUT", src, out, 7, BLOCK=32) is None  # Triton's launch: compiles
        assert len(kernel.triton_launches) == 2
        plan = tk.launch_plan(kernel, (4, 2), "OUT", src, out, 7, BLOCK=32)  # direct: and a plan
        assert plan is not None and len(kernel.triton_launches) == 2
        assert launcher.calls[-1] == (4, 2, 1, 99, "fn", "meta", None, None, None, src, out, 7, 32)  # the direct launch itself
        del src
        new = torch.zeros(8)
        assert plan(new)
        source = plan.tensors[0]  # held by the plan
        if scratch == 0:  # the compiled launch, its launcher's settings first
            assert launcher.launches == [(4, 2, 1, 99, "fn", False, True, None, None, "meta", None, None, None, source.data_ptr(), new.data_ptr(), 7, 32)]
        else:
            assert launcher.launches == [] and launcher.calls[-1] == (4, 2, 1, 99, "fn", "meta", None, None, None, source.data_ptr(), new.data_ptr(), 7, 32)
        before = (len(launcher.calls), len(launcher.launches))
        assert not plan(torch.zeros(8, dtype=torch.float64))  # another dtype: another specialization
        assert not plan(torch.zeros(9)[1:])  # 4 bytes past an aligned address
        assert not plan(torch.zeros(32))  # another size than the planned output
        assert not plan(torch.zeros(16)[::2])  # not contiguous
        monkeypatch.setattr(triton.knobs.runtime, "debug", True)
        assert not plan(new)
        monkeypatch.setattr(triton.knobs.runtime, "debug", False)
        hook = lambda metadata: None  # noqa: E731
        triton.knobs.runtime.launch_enter_hook.add(hook)
        try:
            assert not plan(new)
        finally:
            triton.knobs.runtime.launch_enter_hook.remove(hook)
        assert (len(launcher.calls), len(launcher.launches)) == before
        assert plan(new) and len(launcher.calls) + len(launcher.launches) == sum(before) + 1
    # planned on device 0: a tensor of another device is refused
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(tk, "_current_cuda_device", lambda: 0)  # (what a kept plan asks)
    kernel = Kernel(0)
    src, out = torch.zeros(8), torch.zeros(8)
    for _ in range(2):
        tk.launch(kernel, (4,), src, out, 7, BLOCK=32)
    plan = tk.launch_plan(kernel, (4,), "OUT", src, out, 7, BLOCK=32)
    assert plan is not None and not plan(torch.zeros(8)) and kernel.compiled.run.launches == []
    # several slots: each tensor in its place, each checked
    monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)
    monkeypatch.setattr(tk, "_current_cuda_device", lambda: -1)  # (what a kept plan asks)
    kernel = Kernel(0)
    src, out = torch.zeros(8), torch.zeros(8)
    for _ in range(2):
        tk.launch(kernel, (4,), src, out, 7, BLOCK=32)
    plan = tk.launch_plan(kernel, (4,), ("SRC", "OUT"), src, out, 7, BLOCK=32)
    assert plan is not None and plan.tensors == ()
    new_src, new_out = torch.zeros(8), torch.zeros(8)
    assert plan(new_src, new_out)
    assert kernel.compiled.run.launches[-1][-4:] == (new_src.data_ptr(), new_out.data_ptr(), 7, 32)
    count = len(kernel.compiled.run.launches)
    assert not plan(new_src)  # one tensor for two slots
    assert not plan(new_src, torch.zeros(8, dtype=torch.float64))  # the second one of another dtype
    assert not plan(torch.zeros(9)[1:], new_out)  # the first one misaligned
    assert len(kernel.compiled.run.launches) == count
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(tk, "_current_cuda_device", lambda: 0)  # (what a kept plan asks)
    # a slot that is not a tensor, or no slot: no plan
    kernel = Kernel(0)
    src, out = torch.zeros(8), torch.zeros(8)
    for _ in range(2):
        tk.launch(kernel, (4,), src, out, 7, BLOCK=32)
    assert tk.launch_plan(kernel, (4,), "n", src, out, 7, BLOCK=32) is None
    assert tk.launch_plan(kernel, (4,), ("OUT", "n"), src, out, 7, BLOCK=32) is None
    assert tk.launch(kernel, (4,), src, out, 7, BLOCK=32) is None
    # a retargeted plan: a held tensor replaced by another like it (the old plan unchanged), or refused
    monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)
    monkeypatch.setattr(tk, "_current_cuda_device", lambda: -1)  # (what a kept plan asks)
    kernel = Kernel(0)
    for _ in range(2):
        tk.launch(kernel, (4,), src, out, 7, BLOCK=32)
    plan = tk.launch_plan(kernel, (4,), "OUT", src, out, 7, BLOCK=32)
    assert plan is not None and plan.kept_names == ("SRC",)
    other = torch.zeros(8)
    moved = plan.retargeted(SRC=other)
    assert moved is not None and moved.tensors == (other,) and plan.tensors == (src,)
    new_out = torch.zeros(8)
    assert moved(new_out) and kernel.compiled.run.launches[-1][-4:] == (other.data_ptr(), new_out.data_ptr(), 7, 32)
    assert plan(new_out) and kernel.compiled.run.launches[-1][-4:] == (src.data_ptr(), new_out.data_ptr(), 7, 32)
    assert plan.retargeted(SRC=torch.zeros(8, dtype=torch.float64)) is None
    assert plan.retargeted(SRC=torch.zeros(9)) is None
    assert plan.retargeted(SRC=torch.zeros(9)[1:]) is None
    assert plan.retargeted(SRC=torch.zeros(16)[::2]) is None
    with pytest.raises(ValueError, match="'OUT' is not a tensor this launch holds"):
        plan.retargeted(OUT=torch.zeros(8))


def test_evict_oldest_keeps_the_newest_entries(tk):
    """The kept-launch tables drop their oldest entries first, down to fewer than the limit; an empty table
    at a zero limit (or one another thread emptied) is left as it is."""
    table = {k: str(k) for k in range(6)}
    tk._evict_oldest(table, 4)
    assert list(table) == [3, 4, 5]
    tk._evict_oldest(table, 4)
    assert list(table) == [3, 4, 5]
    empty: dict = {}
    tk._evict_oldest(empty, 0)
    assert empty == {}


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_swap_in_and_scatter_copy_write_and_restore_bit_for_bit(tk, out_dtype):
    """swap_in keeps W[η] and writes W[η] + φ as scatter_sum_reference rounds it; scatter_copy writes the kept
    entries back: W's bits as before, −0.0 and subnormals included (the default training pass's write and restore)."""
    g = torch.Generator().manual_seed(7)
    dev = _device()
    n, nnz = 5000, 1100
    w = torch.randn(n, generator=g).to(out_dtype)
    idx = random_indices(n, nnz, g).to(torch.int32)
    w[idx[:4].long()] = torch.tensor([-0.0, 0.0, torch.finfo(out_dtype).tiny / 4, -torch.finfo(out_dtype).tiny / 4]).to(out_dtype)
    vals = torch.randn(nnz, generator=g)
    want = kernels.scatter_sum_reference(w.clone(), idx, w[idx.long()], vals)
    flat = w.clone().to(dev)
    saved = tk.swap_in(flat, idx.to(dev), vals.to(dev))
    bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
    assert torch.equal(saved.cpu().view(bits), w[idx.long()].view(bits))
    if dev == "cuda" or out_dtype == torch.float32:
        assert torch.equal(flat.cpu(), want)
    else:  # the interpreter's own 16-bit rounding (see test_scatter_add_matches_reference)
        torch.testing.assert_close(flat.cpu(), want, rtol=2**-6, atol=2**-4)
    tk.scatter_copy(flat, idx.to(dev), saved)
    assert torch.equal(flat.cpu().view(bits), w.view(bits))
    # the same sizes again with other tensors (a kept launch repeated): each call reads and writes its own
    w2 = torch.randn(n, generator=g).to(out_dtype)
    vals2 = torch.randn(nnz, generator=g)
    flat2 = w2.clone().to(dev)
    saved2 = tk.swap_in(flat2, idx.to(dev), vals2.to(dev))
    assert torch.equal(saved2.cpu().view(bits), w2[idx.long()].view(bits))
    assert torch.equal(flat.cpu().view(bits), w.view(bits))
    want2 = kernels.scatter_sum_reference(w2.clone(), idx, w2[idx.long()], vals2)
    if dev == "cuda" or out_dtype == torch.float32:
        assert torch.equal(flat2.cpu(), want2)
    tk.scatter_copy(flat2, idx.to(dev), saved2)
    assert torch.equal(flat2.cpu().view(bits), w2.view(bits))


def test_write_lane_writes_and_restores_as_swap_in_and_scatter_copy(tk):
    """A write lane's write and write-back have swap_in's and scatter_copy's bits, call after call; it serves its
    own tensors and other tensors over their memory, of their types and sizes, and nothing else; a write-back takes
    only what the lane's last write returned; what a write keeps lives in a buffer of the writing thread."""
    import threading

    g = torch.Generator().manual_seed(3)
    dev = _device()
    n, nnz = 4000, 900
    w = torch.randn(n, generator=g).to(dev)
    idx = random_indices(n, nnz, g).to(torch.int32).to(dev)
    vals = torch.nn.Parameter(torch.randn(nnz, generator=g).to(dev) * 0.01)
    want = w.clone()
    want_saved = tk.swap_in(want, idx, vals.detach())
    flat, original = w.clone(), w.clone()
    lane = tk.WriteLane(flat, idx, vals)
    for _ in range(3):  # (on CUDA: the first call plans the launches, the next ones repeat them)
        pending = lane.swap_in()
        assert torch.equal(pending[0], want_saved) and torch.equal(flat, want)
        assert not lane.restore([pending[0]])  # (another list: not this write's)
        assert torch.equal(flat, want)
        assert lane.restore(pending)
        assert torch.equal(flat, original)
        assert not lane.restore(pending)  # (written back once)
    assert lane.serves(flat, idx, vals)
    assert lane.serves(flat, idx.view(-1), vals.detach())  # (other tensors over the same memory)
    assert not lane.serves(flat, idx.clone(), vals)
    assert not lane.serves(flat, idx, vals.detach().clone())
    assert not lane.serves(flat, idx, vals.detach().view(torch.int32))  # (the same memory as another type)
    assert not lane.serves(flat, idx[:500], vals[:500])
    assert not lane.serves(flat.clone(), idx, vals)
    assert not lane.serves(flat, idx, torch.stack([vals.detach(), vals.detach()], 1)[:, 0])  # (not contiguous)
    vals.data = vals.data.clone()  # (the same object, new memory)
    assert not lane.serves(flat, idx, vals)

    mine = tk.scratch(flat, nnz)
    assert tk.scratch(flat, nnz) is mine and tk.scratch(flat, nnz // 2).data_ptr() == mine.data_ptr()
    seen = []
    thread = threading.Thread(target=lambda: seen.append(tk.scratch(flat, nnz)))
    thread.start()
    thread.join()
    assert seen[0].data_ptr() != mine.data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape, k", [((96, 130), 37), ((96, 130), 6240), ((41, 100), 1), ((64, 64), 4095)])
def test_top_scaled_magnitudes_radix_selection_matches_the_reference(tk, dtype, shape, k):
    """The k largest |x / s_column| in four radix levels, across chunk boundaries: the reference's ascending
    indices (int32 and int64) and float32 entries of x, bit for bit — with quotients tied within a column and
    between two equal columns, a zero column (its scale clamped to the tiny float), ±0.0, NaN and ±inf."""
    g = torch.Generator().manual_seed(shape[0] + k)
    dense = (torch.randn(*shape, generator=g) * 0.01).to(dtype)
    dense[:, 3] = dense[0, 3]  # one quotient shared by a column
    dense[:, 6] = dense[:, 5]  # two columns with the same scale: quotients tied across them
    dense[::5, 7] = -dense[1, 7]
    dense[:, 9] = 0.0
    dense[2, 2], dense[2, 4] = -0.0, 0.0

    def scale_of(d):
        return d.float().pow(2).mean(0).sqrt().clamp_min(torch.finfo(torch.float32).tiny)

    for index_dtype in (torch.int32, torch.int64):
        scale = scale_of(dense)
        want_idx, want_vals = kernels.top_scaled_magnitudes_reference(dense, scale, k, index_dtype)
        got_idx, got_vals = tk.top_scaled_magnitudes(dense.to(_device()), scale.to(_device()), k, index_dtype)
        assert got_idx.dtype == index_dtype and torch.equal(got_idx.cpu(), want_idx)
        assert got_vals.dtype == torch.float32 and torch.equal(got_vals.cpu(), want_vals)
    special = dense.clone()
    special[[1, 8, 20], [0, 11, 12]] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    scale = scale_of(special)  # (the NaN's and the infinities' columns: every quotient NaN there)
    want_idx2, want_vals2 = kernels.top_scaled_magnitudes_reference(special, scale, k, torch.int64)
    got_idx2, got_vals2 = tk.top_scaled_magnitudes(special.to(_device()), scale.to(_device()), k, torch.int64)
    assert torch.equal(got_idx2.cpu(), want_idx2)
    torch.testing.assert_close(got_vals2.cpu(), want_vals2, rtol=0, atol=0, equal_nan=True)
    quotients = (dense.float() / scale_of(dense)).abs().reshape(-1)
    chosen = torch.zeros(quotients.numel(), dtype=torch.bool)
    chosen[want_idx.long()] = True
    assert quotients[chosen].min() >= quotients[~chosen].max()  # really the k largest quotients
    assert want_idx.numel() == k and bool((want_idx[1:] > want_idx[:-1]).all())


def test_top_scaled_magnitudes_with_columns_past_32_bit_chunk_offsets(tk, monkeypatch):
    """Matrices with more than 2³¹ − BLOCK columns take each entry's column as a 64-bit remainder (a chunk's
    32-bit offsets would wrap there): with that bound lowered, the selection is still the reference's."""
    monkeypatch.setattr(tk, "_NARROW_COLUMNS", 0)
    g = torch.Generator().manual_seed(3)
    dense = (torch.randn(7, 1300, generator=g) * 0.01).to(torch.bfloat16)
    scale = dense.float().pow(2).mean(0).sqrt().clamp_min(torch.finfo(torch.float32).tiny)
    for k in (1, 2500, dense.numel() - 1):
        want_idx, want_vals = kernels.top_scaled_magnitudes_reference(dense, scale, k, torch.int64)
        got_idx, got_vals = tk.top_scaled_magnitudes(dense.to(_device()), scale.to(_device()), k, torch.int64)
        assert torch.equal(got_idx.cpu(), want_idx) and torch.equal(got_vals.cpu(), want_vals)


def test_top_scaled_magnitudes_dispatch_serves_the_reference_where_no_kernel_applies():
    """float32 entries, a float64 scale, k = 0 or every entry: the reference, the same answer as the kernel's contract."""
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(12, 10, generator=g)
    scale = dense.pow(2).mean(0).sqrt()
    for d, s, k in [(dense, scale, 7), (dense.double(), scale.double(), 7), (dense, scale, 120), (dense.bfloat16(), scale, 0)]:
        idx, vals = kernels.top_scaled_magnitudes(d, s, k, torch.int64)
        want_idx, want_vals = kernels.top_scaled_magnitudes_reference(d, s, k, torch.int64)
        assert torch.equal(idx, want_idx) and torch.equal(vals, want_vals) and vals.dtype == s.dtype
    quotients = (dense / scale).abs().reshape(-1)
    idx, _ = kernels.top_scaled_magnitudes(dense, scale, 7, torch.int64)
    assert torch.equal(idx, quotients.topk(7).indices.sort().values)


_COMPILE_RADIX_KERNELS = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from peft_sparse.accel import triton_kernels as tk

base = {"X": "*bf16", "S": "*fp32", "in_features": "i32", "n": "i32", "HIST": "*i64", "k": "i32"}
flags = dict.fromkeys(("LEVELS", "SCALED", "WIDE", "BINS", "BLOCK"), "constexpr")
target = GPUTarget("cuda", 90, 32)
found, remainders = {}, {}
for scaled, levels in ((True, 4), (False, 2)):
    const = {"LEVELS": levels, "SCALED": scaled, "WIDE": False, "BINS": 256, "BLOCK": 4096}
    ptxs = []
    for level in range(levels):
        ptxs.append(triton.compile(ASTSource(tk._radix_histogram_kernel, dict(base, LEVEL="constexpr", **flags), constexprs=dict(const, LEVEL=level)), target=target).asm["ptx"])
    ptxs.append(triton.compile(ASTSource(tk._radix_counts_kernel, dict(base, COUNTS="*i64", n_chunks="i32", **flags), constexprs=const), target=target).asm["ptx"])
    signature = dict(base, PREFIX="*i64", n_chunks="i32", IDX="*i32", OUT="*fp32", **flags)
    ptx = triton.compile(ASTSource(tk._radix_select_kernel, signature, constexprs=const), target=target).asm["ptx"]
    found[str(scaled)] = sorted(op for op in ("div.rn.f32", "div.full.f32", "div.approx.f32") if op in ptx)
    # 64-bit remainders in each kernel's code (a remainder per entry would appear once per entry a thread holds)
    remainders[str(scaled)] = [p.count("rem.s64") + p.count("rem.u64") for p in ptxs + [ptx]]
wide = dict(const, LEVELS=4, SCALED=True, WIDE=True)  # (more than 2**31 - BLOCK columns: 64-bit remainders)
ptx = triton.compile(ASTSource(tk._radix_select_kernel, signature, constexprs=wide), target=target).asm["ptx"]
remainders["wide"] = int(ptx.count("rem.s64") + ptx.count("rem.u64") > 1)
print("DIVISIONS" + json.dumps(found))
print("REMAINDERS" + json.dumps(remainders))
"""


def test_scaled_radix_kernels_compile_for_hopper_with_the_division_torch_rounds():
    """The radix selection's kernels compile for an H100 (sm_90) without a GPU (a process without Triton's
    interpreter), and the scaled keys' quotient is PTX's correctly rounded division (``div.rn``), the one torch's
    float32 ``/`` makes — not the approximate ``div.full`` of Triton's plain ``/`` — so the kernel ranks the
    quotients the reference ranks."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_RADIX_KERNELS], env=env, capture_output=True, text=True, timeout=600)
    if run.returncode != 0 and ("ptxas" in run.stderr or "No module named 'triton.backends" in run.stderr):
        pytest.skip(f"no CUDA toolchain in this Triton: {run.stderr[-300:]}")
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(line for line in run.stdout.splitlines() if line.startswith("DIVISIONS"))
    assert json.loads(line[len("DIVISIONS") :]) == {"True": ["div.rn.f32"], "False": []}
    # the entries' columns (scaled keys) cost each chunk one 64-bit remainder, not one per entry
    line = next(line for line in run.stdout.splitlines() if line.startswith("REMAINDERS"))
    assert json.loads(line[len("REMAINDERS") :]) == {"True": [1] * 6, "False": [0] * 4, "wide": 1}


@pytest.mark.parametrize("block_shape, checkpointing, copying_hook", [((1, 1), False, False), ((16, 16), True, False), ((1, 1), False, True)])
def test_write_lane_serves_every_default_write_in_training(tk, block_shape, checkpointing, copying_hook, monkeypatch):
    """The default pass with the layers' lanes (the Triton kernels in the interpreter on CPU, as on CUDA): a lane made
    at each layer's first write serves every later write and write-back, in forward, in backward and, under gradient
    checkpointing, in the recomputed forward (which hands over tensors over the same memory); a new lane only where
    the values or indices became other tensors, not for the copies a saved-tensor hook hands to backward (those
    take the generic calls). Losses and values are those of the generic calls (lane off) and of the device's own
    writes (the CPU's index ops), bit for bit; θ₀ intact after every step. On CUDA (bf16) compiled, the lanes'
    two launches planned and repeated."""
    import contextlib

    from peft import get_peft_model

    from peft_sparse import SpIELConfig, SpIELScheduler
    from peft_sparse.accel import transient_merge

    from .models import sparse_layers, tiny_llama, train_on

    served, made, writes = [], [], []
    write, swap_in, init = transient_merge.write, tk.WriteLane.swap_in, tk.WriteLane.__init__
    monkeypatch.setattr(transient_merge, "write", lambda *a: writes.append(1) or write(*a))
    monkeypatch.setattr(tk.WriteLane, "swap_in", lambda self: served.append(1) or swap_in(self))
    monkeypatch.setattr(tk.WriteLane, "__init__", lambda self, *a: made.append(1) or init(self, *a))
    kernels_for, dev = transient_merge._kernels_for, _device()
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # (on CPU the own writes' rounding is float32's)
    runs = []
    for way in ("lane", "generic", "own"):  # ("own": the device's own writes; on CUDA the generic Triton calls again)
        monkeypatch.setattr(transient_merge, "WRITE_LANE", way == "lane")
        monkeypatch.setattr(transient_merge, "_kernels_for", kernels_for if way == "own" else (lambda flat, values: tk))
        served.clear(), made.clear(), writes.clear()
        config = SpIELConfig(target_modules=["q_proj", "gate_proj", "down_proj"], density=0.2, reselection_steps=3,
                             gradient_estimation_steps=2, block_shape=block_shape)  # fmt: skip
        model = get_peft_model(tiny_llama(hidden_size=64, intermediate_size=128, dtype=dtype), config).to(dev)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        layers = sparse_layers(model)
        theta0 = [layer.get_base_layer().weight.detach().clone() for layer in layers]
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        x = torch.randint(0, 97, (2, 9), device=dev)

        def intact(step):
            for layer, w in zip(layers, theta0):
                assert torch.equal(layer.get_base_layer().weight, w), (way, step, layer.module_name)

        hook = torch.autograd.graph.saved_tensors_hooks(torch.clone, lambda t: t) if copying_hook else contextlib.nullcontext()
        with hook:  # (a copy of every tensor saved for backward, as activation offloading makes)
            losses = train_on(model, opt, SpIELScheduler(model, opt, total_steps=8), x, 8, after_step=intact)
        if way == "lane" and copying_hook:  # forward's writes served by the lanes; backward's through the generic calls
            assert len(served) >= 4 * len(layers) and len(writes) >= len(served) + 4 * len(layers)
            assert len(layers) <= len(made) <= 3 * len(layers)
        elif way == "lane":
            # forward, backward (and the recomputed forward): every write served by a lane, each written back
            assert len(served) == len(writes) >= (12 if checkpointing else 8) * len(layers)
            assert len(layers) <= len(made) <= 3 * len(layers)  # (again at most at the two reselections)
            assert all(layer._write_lane is not None and layer._write_lane.pending is None for layer in layers)
            if dev == "cuda":  # (the interpreter launches anew each time)
                assert all(layer._write_lane.swap is not None and layer._write_lane.copy is not None for layer in layers)
        else:
            assert not served and all(layer._write_lane is None for layer in layers)
        runs.append((losses, [layer.sparse_values["default"].detach().clone() for layer in layers]))
    for losses, values in runs[1:]:
        assert losses == runs[0][0]
        for a, b in zip(values, runs[0][1]):
            assert torch.equal(a, b)
