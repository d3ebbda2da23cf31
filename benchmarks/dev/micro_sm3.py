"""Micro-timings (GPU) of unstructured SpIEL-MA's per-step extras at TinyLlama shapes: the multi-tensor
SM3 step over all 154 layers (50.46M values, 5.2% density, sorted int32 indices) and the value-gradient
gather (bf16 dW → float32 values' gradient), each shipped kernel against variants of it. Every variant
is checked against the shipped result first (bit for bit).

    python benchmarks/micro_sm3.py

On an H200 (2026-11-27, ``benchmarks/results/2026-11-27-h200-micro-s17.txt``): the SM3 kernel before
round s17 took 2.32 ms; 32-bit index arithmetic 1.74 ms; that and skipping the column atomics that cannot
raise a column's maximum 1.46–1.49 ms (what ships); with no column atomics at all (not a valid step)
0.49–0.57 ms. Gather and cast per layer: 16.5–22.1 µs as two torch operations, 5.4–13.9 µs in one launch.
"""

import torch
import triton
import triton.language as tl
import triton.testing as tt

from peft_sparse.accel import triton_kernels as tk

SHAPES = [(2048, 2048), (256, 2048), (256, 2048), (2048, 2048), (5632, 2048), (5632, 2048), (2048, 5632)] * 22
DENSITY = 0.0521


@triton.jit
def _sm3_variant(
    VALUES_PTRS, GRAD_PTRS, IDX_PTRS, ROW_OLD_PTRS, COL_OLD_PTRS, ROW_NEW_PTRS, COL_NEW_PTRS, COUNTS, IN_FEATURES,
    PROG_TENSOR, PROG_START, lr, decay, eps,
    INT32_INDEX: tl.constexpr, INT_ATOMICS: tl.constexpr, ROW_SCAN: tl.constexpr, COL_ATOMICS: tl.constexpr, CHECK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    t = tl.load(PROG_TENSOR + p)
    start = tl.load(PROG_START + p)
    n = tl.load(COUNTS + t)
    grad = tl.load(GRAD_PTRS + t).to(tl.pointer_type(tl.float32))
    idx_ptr = tl.load(IDX_PTRS + t).to(tl.pointer_type(tl.int32))
    row_old = tl.load(ROW_OLD_PTRS + t).to(tl.pointer_type(tl.float32))
    col_old = tl.load(COL_OLD_PTRS + t).to(tl.pointer_type(tl.float32))
    values = tl.load(VALUES_PTRS + t).to(tl.pointer_type(tl.float32))
    offs = start + tl.arange(0, BLOCK)
    m = offs < n
    if INT32_INDEX:
        in_features = tl.load(IN_FEATURES + t).to(tl.int32)
        idx = tl.load(idx_ptr + offs, mask=m, other=0)
        r = idx // in_features
        c = idx - r * in_features
        next_r = tl.load(idx_ptr + offs + 1, mask=offs + 1 < n, other=-1) // in_features
    else:
        in_features = tl.load(IN_FEATURES + t)
        idx = tl.load(idx_ptr + offs, mask=m, other=0).to(tl.int64)
        r = idx // in_features
        c = idx % in_features
        next_r = tl.load(idx_ptr + offs + 1, mask=offs + 1 < n, other=-1).to(tl.int64) // in_features
    g = tl.load(grad + offs, mask=m, other=0.0)
    nu = tl.minimum(tl.load(row_old + r, mask=m, other=0.0), tl.load(col_old + c, mask=m, other=0.0)) + g * g
    if INT_ATOMICS:
        row_new = tl.load(ROW_NEW_PTRS + t).to(tl.pointer_type(tl.int32))
        col_new = tl.load(COL_NEW_PTRS + t).to(tl.pointer_type(tl.int32))
    else:
        row_new = tl.load(ROW_NEW_PTRS + t).to(tl.pointer_type(tl.float32))
        col_new = tl.load(COL_NEW_PTRS + t).to(tl.pointer_type(tl.float32))
    if ROW_SCAN:
        _, run_max = tl.associative_scan((r, nu), 0, tk._segment_max)
        last_of_run = (next_r != r) | (tl.arange(0, BLOCK) == BLOCK - 1) | (offs + 1 >= n)
        if INT_ATOMICS:
            tl.atomic_max(row_new + r, run_max.to(tl.int32, bitcast=True), mask=m & last_of_run, sem="relaxed")
        else:
            tl.atomic_max(row_new + r, run_max, mask=m & last_of_run, sem="relaxed")
    else:
        if INT_ATOMICS:
            tl.atomic_max(row_new + r, nu.to(tl.int32, bitcast=True), mask=m, sem="relaxed")
        else:
            tl.atomic_max(row_new + r, nu, mask=m, sem="relaxed")
    if CHECK:  # skip the atomic where the column's running maximum is already at least ν (NaN still goes)
        cur = tl.load(col_new + c, mask=m, other=0, cache_modifier=".cg")
        if INT_ATOMICS:
            tl.atomic_max(col_new + c, nu.to(tl.int32, bitcast=True), mask=m & (nu.to(tl.int32, bitcast=True) > cur), sem="relaxed")
        else:
            tl.atomic_max(col_new + c, nu, mask=m & ~(nu <= cur), sem="relaxed")
    elif COL_ATOMICS:
        if INT_ATOMICS:
            tl.atomic_max(col_new + c, nu.to(tl.int32, bitcast=True), mask=m, sem="relaxed")
        else:
            tl.atomic_max(col_new + c, nu, mask=m, sem="relaxed")
    update = g / tl.sqrt(nu + eps)
    v = tl.load(values + offs, mask=m, other=0.0)
    tl.store(values + offs, v * decay - lr * update, mask=m)


@triton.jit
def _gather_f32(SRC, IDX, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    i = tl.load(IDX + offs, mask=m, other=0)
    tl.store(OUT + offs, tl.load(SRC + i, mask=m, other=0.0).to(tl.float32), mask=m)


def random_indices(out_f, in_f, k, device):
    return torch.randperm(out_f * in_f, device=device)[:k].sort().values.to(torch.int32)


def main():
    device = torch.device("cuda")
    torch.manual_seed(0)
    idx, vals, grads, rows, cols, in_fs = [], [], [], [], [], []
    for out_f, in_f in SHAPES:
        k = int(out_f * in_f * DENSITY)
        idx.append(random_indices(out_f, in_f, k, device))
        vals.append(torch.randn(k, device=device) * 1e-3)
        grads.append(torch.randn(k, device=device) * 1e-2)
        rows.append(torch.rand(out_f, device=device) * 1e-4)
        cols.append(torch.rand(in_f, device=device) * 1e-4)
        in_fs.append(in_f)
    total = sum(v.numel() for v in vals)
    print(f"{len(SHAPES)} tensors, {total} values")
    row_new = [r.clone() for r in rows]
    col_new = [c.clone() for c in cols]
    lr, eps, wd = 1e-3, 1e-30, 0.0
    plan = tk.MultiSM3(vals, grads, idx, in_fs, rows, cols, row_new, col_new, [None] * len(vals))
    base_vals = [v.clone() for v in vals]

    def reset():
        for v, b in zip(vals, base_vals):
            v.copy_(b)
        for a, b in zip(row_new, rows):
            a.copy_(b)
        for a, b in zip(col_new, cols):
            a.copy_(b)

    def reset_accumulators():  # as the optimizer does before each step: the new accumulators start as copies
        torch._foreach_copy_(row_new, rows)
        torch._foreach_copy_(col_new, cols)

    def shipped():
        reset_accumulators()
        plan(grads, lr, 0.0, eps, wd)

    reset()
    shipped()
    want = [torch.cat(vals).clone(), torch.cat(row_new).clone(), torch.cat(col_new).clone()]
    t_reset = tt.do_bench(reset_accumulators)
    print(f"(each timing below includes resetting the accumulators: {t_reset:.3f} ms)")
    print(f"shipped MultiSM3 {tt.do_bench(shipped):8.3f} ms")

    tables = [tk._address_table(t, device) for t in (vals, grads, idx, rows, cols, row_new, col_new)]
    in_feat = torch.tensor(in_fs, dtype=torch.int64, device=device)
    for block in (1024, 2048):
        programs, counts, prog_tensor, prog_start = tk._program_map([v.numel() for v in vals], device) if block == 1024 else (None,) * 4
        if block != 1024:
            old = tk._MULTI_BLOCK
            tk._MULTI_BLOCK = block
            programs, counts, prog_tensor, prog_start = tk._program_map([v.numel() for v in vals], device)
            tk._MULTI_BLOCK = old
        for int32_index, int_atomics, row_scan, col_atomics, check in [
            (False, False, True, True, False), (True, False, True, True, False), (True, True, True, True, False),
            (True, True, True, False, False), (False, False, True, True, True), (True, False, True, True, True),
            (True, True, True, True, True),
        ]:  # fmt: skip
            for warps in (4, 8) if block == 1024 else (8,):
                def run():
                    reset_accumulators()
                    _sm3_variant[(programs,)](*tables, counts, in_feat, prog_tensor, prog_start, lr, 1.0 - lr * wd, eps,
                                              INT32_INDEX=int32_index, INT_ATOMICS=int_atomics, ROW_SCAN=row_scan,
                                              COL_ATOMICS=col_atomics, CHECK=check, BLOCK=block, num_warps=warps, enable_fp_fusion=False)  # fmt: skip

                reset()
                run()
                got = [torch.cat(vals), torch.cat(row_new), torch.cat(col_new)]
                same = all(torch.equal(a, b) for a, b in zip(got, want))
                label = f"block {block} warps {warps} int32_index={int32_index} int_atomics={int_atomics} row_scan={row_scan} col_atomics={col_atomics} check={check}"
                print(f"{label:95s} {tt.do_bench(run):8.3f} ms  {'same bits' if same else 'DIFFERENT'}", flush=True)

    # value-gradient gather: bf16 dW → float32 at int32 indices, per layer shape
    tokens = 8192
    for out_f, in_f in [(256, 2048), (2048, 2048), (5632, 2048), (2048, 5632)]:
        k = int(out_f * in_f * DENSITY)
        ind = random_indices(out_f, in_f, k, device)
        g = torch.randn(tokens, out_f, device=device, dtype=torch.bfloat16)
        x = torch.randn(tokens, in_f, device=device, dtype=torch.bfloat16)
        dw = g.t().mm(x)
        flat = dw.view(-1)
        ref = flat.index_select(0, ind).to(torch.float32)
        out = torch.empty(k, device=device)

        def fused(block=1024):
            _gather_f32[(triton.cdiv(k, block),)](flat, ind, out, k, BLOCK=block)
            return out

        assert torch.equal(fused(), ref)
        t_gemm = tt.do_bench(lambda: g.t().mm(x))
        t_ref = tt.do_bench(lambda: flat.index_select(0, ind).to(torch.float32))
        t_sel = tt.do_bench(lambda: flat.index_select(0, ind))
        t_fused = tt.do_bench(fused)
        t_fused4 = tt.do_bench(lambda: fused(4096))
        print(f"{out_f}x{in_f} k={k}: dW GEMM {t_gemm:.4f} ms; index_select+cast {t_ref:.4f} (index_select alone {t_sel:.4f}); "
              f"Triton gather→f32 {t_fused:.4f} (block 4096: {t_fused4:.4f})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
