"""The merged weight W + scatter(η, φ): fused Triton kernel vs torch operations (GPU).

    python benchmarks/micro_compose.py

For each projection shape of TinyLlama at the benchmark's density (5.2%), times (median,
``triton.testing.do_bench``) building the bf16 merged weight from the bf16 base weight and float32
values with the fused kernel and with the torch reference (copy, gather, add, index_put), after
checking that both give the same bits. The copy alone (``torch.clone``) is the memory-bound floor.
"""

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/ and the repository

from peft_sparse.core import kernels

from peft_sparse.accel import triton_kernels  # noqa: E402

SHAPES = {"q/o": (2048, 2048), "k/v": (256, 2048), "gate/up": (5632, 2048), "down": (2048, 5632)}


def main():
    from triton.testing import do_bench

    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; ms (median); density 0.052")
    print(f"{'shape':<10}{'clone':>9}{'torch ops':>11}{'fused':>9}")
    for name, (o, i) in SHAPES.items():
        w = torch.randn(o, i, device="cuda", generator=g).to(torch.bfloat16)
        nnz = int(0.052 * o * i)
        idx = torch.randperm(o * i, device="cuda", generator=g)[:nnz].sort().values.to(torch.int32)
        val = torch.randn(nnz, device="cuda", generator=g) * 1e-2
        out = torch.empty_like(w)
        ref = kernels.scatter_add_reference(torch.empty_like(w), idx, val, w)
        assert torch.equal(triton_kernels.scatter_add_into(out, idx, val, w), ref)
        t_clone = do_bench(lambda: w.clone(), return_mode="median")
        t_ref = do_bench(lambda: kernels.scatter_add_reference(out, idx, val, w), return_mode="median")
        t_fused = do_bench(lambda: triton_kernels.scatter_add_into(out, idx, val, w), return_mode="median")
        print(f"{name:<10}{t_clone:>9.4f}{t_ref:>11.4f}{t_fused:>9.4f}", flush=True)


if __name__ == "__main__":
    main()
