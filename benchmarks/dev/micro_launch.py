"""Host time of one Triton launch: ``kernel[grid](...)`` against :func:`triton_kernels.launch` (GPU).

    python benchmarks/micro_launch.py [--calls 3000]

Launches two of the training step's kernels on tiny operands — the RMSNorm-output rebuild (8
arguments) and the fused NF4 weight (24 arguments) — back to back; the GPU finishes each before the
host has issued the next, so the time per call is the host's. Both ways alternate, three rounds each.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/ and the repository

from peft_sparse.accel import triton_kernels as tk  # noqa: E402


def per_call(fn, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    dev = "cuda"
    full, per_row = torch.randn(16, 256, device=dev), torch.rand(16, 1, device=dev)
    scale, out = torch.randn(256, device=dev).to(torch.bfloat16), torch.empty(16, 256, device=dev, dtype=torch.bfloat16)
    sp = (out, full, per_row, scale, 16, 256)
    sp_kw = dict(BLOCK_R=16, BLOCK_H=256, num_warps=4)
    packed = torch.randint(0, 255, (2048,), device=dev, dtype=torch.uint8)
    code, absmax2 = torch.randn(16, device=dev), torch.rand(1, device=dev)
    absmax_q, code2 = torch.randint(0, 255, (64,), device=dev, dtype=torch.uint8), torch.randn(256, device=dev)
    w = torch.empty(4096, device=dev, dtype=torch.bfloat16)
    idx = torch.arange(0, 4096, 16, device=dev, dtype=torch.int32)
    val, starts = torch.randn(idx.numel(), device=dev), torch.tensor([0, idx.numel()], device=dev, dtype=torch.int32)
    nf = (packed, code, absmax2, absmax_q, absmax2, code2, 0.0, w, idx, val, starts, 4096, idx.numel(), 1)
    nf_kw = dict(BLOCKSIZE=64, BLOCKSIZE2=256, NESTED=True, BLOCK=4096, CHUNK=2048, SBLOCK=512, K=512, HAS_STARTS=True,
                 num_warps=8, enable_fp_fusion=False)  # fmt: skip
    cases = {
        "scaled_product (8 args)": (tk._scaled_product_kernel, (1, 1), sp, sp_kw),
        "nf4_compose (24 args)": (tk._nf4_compose_kernel, (1,), nf, nf_kw),
    }
    print(f"{torch.cuda.get_device_name()}; host µs per launch (median of 3 rounds of {args.calls})")
    for name, (kernel, grid, a, kw) in cases.items():
        plain = lambda: kernel[grid](*a, **kw)  # noqa: E731
        fast = lambda: tk.launch(kernel, grid, *a, **kw)  # noqa: E731
        plain(), fast(), fast()
        times = {"kernel[grid]": [], "launch": []}
        for _ in range(3):
            times["kernel[grid]"].append(per_call(plain, args.calls))
            times["launch"].append(per_call(fast, args.calls))
        print(f"  {name:<26}" + "  ".join(f"{k} {statistics.median(v) * 1e6:6.1f}" for k, v in times.items()), flush=True)


if __name__ == "__main__":
    main()
