"""Launch settings of the block value-gradient kernel per layer shape (GPU).

    python benchmarks/tune_block.py [--density 0.052] [--block 32] [--tokens 8192]

For TinyLlama's projection shapes at the benchmark's density, times (median, ``triton.testing.do_bench``)
the dense path (GEMM + gather) and ``block_sddmm`` for every combination of token step (``BLOCK_T``),
warps, pipeline stages and token slicing (``target_programs``: none, the default, twice the default).
Every result is checked against the dense product first. Prints the best settings per shape. (A
row-major load of ∂L/∂Y with a transposed dot was swept too in the run recorded in
``benchmarks/results/2026-11-26-h100-tune-block.txt``; it never reached the five best settings of any
shape and is no longer swept.)
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from value_grad import shapes  # noqa: E402

from peft_sparse.core import kernels, triton_kernels  # noqa: E402
from peft_sparse.core.selection import BlockGrid  # noqa: E402


def run(kernel, g, x, br, bc, bh, bw, block_t, warps, stages, target):
    n, tokens = br.numel(), g.shape[0]
    splits, per = triton_kernels.token_splits(n, tokens, block_t, target) if target else (1, tokens)
    out = torch.empty(splits, n, bh, bw, dtype=torch.float32, device=g.device)
    kernel[(n, splits)](g, x, br, bc, out, tokens, per, n, g.stride(0), x.stride(0), BH=bh, BW=bw, BLOCK_T=block_t,
                        num_warps=warps, num_stages=stages)  # fmt: skip
    return out[0] if splits == 1 else out.sum(0)


def main():
    from triton.testing import do_bench

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--density", type=float, default=0.052)
    parser.add_argument("--block", type=int, default=32)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bh = bw = args.block
    default_target = triton_kernels._target_programs(torch.device("cuda"))
    kernels_ = {"shipped": triton_kernels._block_sddmm_kernel}
    print(f"{torch.cuda.get_device_name()}, tokens={args.tokens}, density={args.density}, block {bh}×{bw}; ms (median)")
    total = {}
    for name, (out_f, in_f) in shapes("tinyllama").items():
        go = torch.randn(args.tokens, out_f, device="cuda", dtype=torch.bfloat16, generator=gen)
        x = torch.randn(args.tokens, in_f, device="cuda", dtype=torch.bfloat16, generator=gen)
        grid = BlockGrid(out_f, in_f, (bh, bw))
        nb = max(1, int(args.density * grid.numel))
        blocks = torch.randperm(grid.numel, device="cuda", generator=gen)[:nb].sort().values
        br, bc = (blocks // grid.cols).to(torch.int32), (blocks % grid.cols).to(torch.int32)
        want = go.float().t().mm(x.float()).view(grid.rows, bh, grid.cols, bw).permute(0, 2, 1, 3)[br.long(), bc.long()]
        idx = grid.block_major(blocks.long()).reshape(-1)
        dense = do_bench(lambda: kernels.dense_weight_gradient(go, x).view(-1)[idx].float(), warmup=5, rep=30, return_mode="median")
        shipped = do_bench(lambda: triton_kernels.block_sddmm(go, x, br, bc, bh, bw), warmup=5, rep=30, return_mode="median")
        results = []
        for kname, block_t, warps, stages in itertools.product(kernels_, (32, 64, 128), (2, 4, 8), (2, 3, 4)):
            for target in (0, default_target, 2 * default_target):
                try:
                    got = run(kernels_[kname], go, x, br, bc, bh, bw, block_t, warps, stages, target)
                except Exception as e:  # out of shared memory etc.
                    print(f"  {kname} T{block_t} w{warps} s{stages}: {type(e).__name__}")
                    break
                torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-1)
                ms = do_bench(lambda: run(kernels_[kname], go, x, br, bc, bh, bw, block_t, warps, stages, target), warmup=5, rep=30, return_mode="median")
                results.append((ms, kname, block_t, warps, stages, target))
        results.sort()
        print(f"{name:<14} blocks {nb:5d}  dense {dense:.4f}  shipped {shipped:.4f}  best:")
        for r in results[:5]:
            print(f"    {r[0]:.4f}  {r[1]:<9} BLOCK_T={r[2]:<4} warps={r[3]} stages={r[4]} target={r[5]}")
        total[name] = (dense, shipped, results[0])
    print("per shape: dense / shipped / best")
    for name, (d, s, b) in total.items():
        print(f"  {name:<14} {d:.4f} / {s:.4f} / {b[0]:.4f} {b[1:]}")


if __name__ == "__main__":
    main()
