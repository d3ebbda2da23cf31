"""Micro-timings (GPU) of the AG window's candidate choice at TinyLlama shapes: ``top_magnitudes`` (the
k largest |dW| of a bf16 dW, k = the layer's share of the budget) as shipped, per launch, and with other
chunk sizes. Every result is checked against the torch reference first.

    python benchmarks/micro_topmag.py

On an H200 (2026-11-27, ``benchmarks/results/2026-11-27-h200-micro-s17.txt``): 0.19–0.23 ms per layer with
the shipped chunk of 4096 entries, the best or within 10% of the best of 1024, 4096 and 16384 at each
TinyLlama shape.
"""

import torch
import triton
import triton.testing as tt

from peft_sparse.core import kernels
from peft_sparse.accel import triton_kernels as tk

DENSITY = 0.0521


def main():
    torch.manual_seed(0)
    for out_f, in_f in [(256, 2048), (2048, 2048), (5632, 2048)]:
        n = out_f * in_f
        k = int(n * DENSITY)
        dense = (torch.randn(out_f, in_f, device="cuda") * 1e-3).to(torch.bfloat16)
        want_idx, _ = kernels.top_magnitudes_reference(dense, k, torch.int32)
        want = want_idx.sort().values
        for block in (1024, 4096, 16384):
            tk._SELECT_BLOCK = block
            idx, _ = tk.top_magnitudes(dense, k, torch.int32)
            assert torch.equal(idx.sort().values, want), (out_f, in_f, block)
            t = tt.do_bench(lambda: tk.top_magnitudes(dense, k, torch.int32))
            flat = dense.view(-1)
            chunks = triton.cdiv(n, block)
            consts = dict(HIGH=tk._HIGH_BINS, LOW=tk._LOW_BINS, BLOCK=block)
            hist = torch.zeros(tk._HIGH_BINS + tk._LOW_BINS, dtype=torch.int64, device="cuda")
            parts = {}
            parts["hist0"] = tt.do_bench(lambda: tk._magnitude_histogram_kernel[(chunks,)](flat, n, hist, k, LEVEL=0, **consts))
            hist.zero_()
            tk._magnitude_histogram_kernel[(chunks,)](flat, n, hist, k, LEVEL=0, **consts)
            tk._magnitude_histogram_kernel[(chunks,)](flat, n, hist, k, LEVEL=1, **consts)
            counts = torch.empty(2, chunks, dtype=torch.int64, device="cuda")
            parts["counts"] = tt.do_bench(lambda: tk._magnitude_counts_kernel[(chunks,)](flat, n, hist, k, counts, chunks, **consts))
            prefix = counts.cumsum(1) - counts
            out_i = torch.empty(k, dtype=torch.int32, device="cuda")
            out_v = torch.empty(k, dtype=torch.float32, device="cuda")
            parts["select"] = tt.do_bench(lambda: tk._magnitude_select_kernel[(chunks,)](flat, n, hist, k, prefix, chunks, out_i, out_v, **consts))
            print(f"{out_f}x{in_f} k={k} block {block:6d}: top_magnitudes {t:.4f} ms  ("
                  + ", ".join(f"{name} {v:.4f}" for name, v in parts.items()) + ")", flush=True)
        tk._SELECT_BLOCK = 4096


if __name__ == "__main__":
    main()
