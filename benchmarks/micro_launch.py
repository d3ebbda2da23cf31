"""Host time of one kernel launch (GPU): Triton's own launch path against peft_sparse's direct launch.

    python benchmarks/micro_launch.py

Times 2000 back-to-back launches of a tiny scatter (64 entries) with the GPU kept idle in between
(CUDA-side work is negligible): Triton's ``kernel[grid](...)``, ``triton_kernels._launch``, and one
torch operation (``index_put_``) for scale.
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peft_sparse.core import triton_kernels as tk  # noqa: E402


def per_launch_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / n * 1e6


def main():
    out = torch.zeros(1 << 20, device="cuda", dtype=torch.bfloat16)
    idx = torch.arange(0, 1 << 20, 1 << 14, device="cuda", dtype=torch.int32)
    base = torch.zeros(idx.numel(), device="cuda", dtype=torch.bfloat16)
    vals = torch.ones(idx.numel(), device="cuda")
    grid = (1,)
    triton_path = per_launch_us(lambda: tk._scatter_sum_kernel[grid](out, idx, base, vals, idx.numel(), BLOCK=1024))
    direct = per_launch_us(lambda: tk._launch(tk._scatter_sum_kernel, grid, out, idx, base, vals, idx.numel(), BLOCK=1024))
    torch_op = per_launch_us(lambda: out.index_put_((idx,), base))
    print(f"{torch.cuda.get_device_name()}: host µs per launch — Triton {triton_path:.1f}, direct {direct:.1f}, torch index_put_ {torch_op:.1f}")


if __name__ == "__main__":
    main()
