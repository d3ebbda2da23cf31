"""Value-gradient paths per layer shape: dense dW + gather vs the SDDMM (Triton kernels on a GPU, torch on CPU).
Produces BENCHMARKS.md, "Value gradient: where the dense GEMM and the SDDMM cross".

    python benchmarks/value_grad.py [--tokens 8192] [--size tinyllama]
    python benchmarks/value_grad.py --device cpu --size smollm2-135m --tokens 440 --densities 0.01,0.046

On CPU it times (median of repeats, float32) the dense GEMM + gather against the SDDMM the plain path
takes there (``kernels.sddmm_reference``: torch's sampled product over the indices' CSR pattern) and
prints the SDDMM's rate relative to the GEMM: the CPU entry of the cost model's ``sddmm_relative_rate``.

For each (out, in) of the model's projections and each density, times (median, triton.testing.do_bench):
``dense`` (one bf16 GEMM dW = Gᵀ·X, then gather), ``sddmm`` (unstructured kernel), and the block
kernels as block adapters call them: 16×16, 32×32 and 64×64 through ``block_sddmm_into`` (the grouped
kernel, values' order), 1×64 through ``block_sddmm``. Checks every kernel against the dense result
first. Prints the table, the density below which the SDDMM beats the dense path (the crossover) and
each kernel's rate relative to the GEMM where its multiply-adds outweigh its fixed cost (the cost
model's ``sddmm_relative_rate`` and ``block_relative_rate``), and appends JSON lines to benchmarks/results/<date>-<gpu>-value-grad.jsonl.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench_step import SIZES  # noqa: E402

from peft_sparse.core import kernels  # noqa: E402
from peft_sparse.core.selection import BlockGrid  # noqa: E402


def shapes(size):
    c = SIZES[size]
    h, i = c["hidden_size"], c["intermediate_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    return {"q/o (h,h)": (h, h), "k/v (kv,h)": (kv, h), "gate/up (i,h)": (i, h), "down (h,i)": (h, i)}


def cpu_main(args, densities) -> None:
    """Dense GEMM + gather against the plain path's CPU SDDMM, and the SDDMM's rate relative to the GEMM."""
    import statistics
    import time

    def median_ms(fn, repeats=20):
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    g = torch.Generator().manual_seed(0)
    T = args.tokens
    print(f"CPU ({torch.get_num_threads()} threads), tokens={T}, float32; times in ms (median)")
    print(f"{'shape':<16}{'density':>8}{'dense':>9}{'sddmm':>9}{'rate':>9}")
    rates = []
    for name, (out_f, in_f) in shapes(args.size).items():
        go, x = torch.randn(T, out_f, generator=g), torch.randn(T, in_f, generator=g)
        for density in densities:
            nnz = int(density * out_f * in_f)
            idx = torch.randperm(out_f * in_f, generator=g)[:nnz].sort().values
            rows, cols = kernels.rows_cols(idx, in_f)
            torch.testing.assert_close(kernels.sddmm_reference(go, x, rows, cols), go.t().mm(x).view(-1)[idx], rtol=1e-4, atol=1e-3)
            dense = median_ms(lambda: kernels.dense_weight_gradient(go, x).view(-1)[idx])
            sddmm = median_ms(lambda: kernels.sddmm_reference(go, x, rows, cols))
            rate = dense / sddmm * density  # the SDDMM does `density` of the GEMM's multiply-adds in its time
            rates.append(rate)
            print(f"{name:<16}{density:>8.3f}{dense:>9.3f}{sddmm:>9.3f}{rate:>9.4f}", flush=True)
    rates.sort()
    print(f"\nCPU SDDMM rate relative to the GEMM: {rates[0]:.4f} – {rates[-1]:.4f} (median {rates[len(rates) // 2]:.4f})")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--size", default="tinyllama")
    parser.add_argument("--densities", default="0.002,0.005,0.01,0.02,0.052,0.1")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    densities = [float(d) for d in args.densities.split(",")]
    if args.device == "cpu":
        return cpu_main(args, densities)
    from triton.testing import do_bench

    from peft_sparse.accel import triton_kernels
    gpu = torch.cuda.get_device_name()
    out_path = HERE / "results" / f"{datetime.date.today().isoformat()}-{gpu.lower().replace('nvidia', '').strip().replace(' ', '-')}-value-grad.jsonl"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    T = args.tokens
    print(f"{gpu}, tokens={T}, bf16; times in ms (median)")
    blocks_of = {"blk16": (16, 16), "blk32": (32, 32), "blk64": (64, 64), "row64": (1, 64)}
    print(f"{'shape':<16}{'density':>8}{'dense':>9}{'sddmm':>9}" + "".join(f"{label:>9}" for label in blocks_of))
    records = []
    for name, (out_f, in_f) in shapes(args.size).items():
        go = torch.randn(T, out_f, device="cuda", dtype=torch.bfloat16, generator=g)
        x = torch.randn(T, in_f, device="cuda", dtype=torch.bfloat16, generator=g)
        dense_ref = go.float().t().mm(x.float())
        for density in densities:
            row = {"shape": name, "out": out_f, "in": in_f, "tokens": T, "density": density, "gpu": gpu}
            nnz = int(density * out_f * in_f)
            idx = torch.randperm(out_f * in_f, device="cuda", generator=g)[:nnz].sort().values
            rows, cols = (idx // in_f).to(torch.int32), (idx % in_f).to(torch.int32)
            got = triton_kernels.sddmm(go, x, rows, cols)
            torch.testing.assert_close(got, dense_ref.view(-1)[idx], rtol=2e-2, atol=2e-1)
            row["dense"] = do_bench(lambda: kernels.dense_weight_gradient(go, x).view(-1)[idx].float(), return_mode="median")
            row["sddmm"] = do_bench(lambda: triton_kernels.sddmm(go, x, rows, cols), return_mode="median")
            for label, (bh, bw) in blocks_of.items():
                grid = BlockGrid(out_f, in_f, (bh, bw))
                nb = max(1, nnz // (bh * bw))
                row[f"{label}_density"] = nb * bh * bw / (out_f * in_f)  # (whole blocks: at most the density)
                blocks = torch.randperm(grid.numel, device="cuda", generator=g)[:nb].sort().values
                if bh == 1:  # (row vectors: the one-block-per-program kernel, tiles out)
                    br, bc = (blocks // grid.cols).to(torch.int32), (blocks % grid.cols).to(torch.int32)
                    tiles = triton_kernels.block_sddmm(go, x, br, bc, bh, bw)
                    want = dense_ref.view(grid.rows, bh, grid.cols, bw).permute(0, 2, 1, 3)[br.long(), bc.long()]
                    torch.testing.assert_close(tiles, want, rtol=2e-2, atol=2e-1)
                    row[label] = do_bench(lambda: triton_kernels.block_sddmm(go, x, br, bc, bh, bw), return_mode="median")
                    continue
                layout = kernels.BlockLayout.of_blocks(blocks, out_f, in_f, (bh, bw))
                out = torch.empty(nb * bh * bw, device="cuda")
                got = triton_kernels.block_sddmm_into(go, x, layout, out)
                torch.testing.assert_close(got, dense_ref.view(-1)[grid.expand(blocks)], rtol=2e-2, atol=2e-1)
                row[label] = do_bench(lambda: triton_kernels.block_sddmm_into(go, x, layout, out), return_mode="median")
            records.append(row)
            print(f"{name:<16}{density:>8.3f}{row['dense']:>9.3f}{row['sddmm']:>9.3f}" + "".join(f"{row[label]:>9.3f}" for label in blocks_of),
                  flush=True)  # fmt: skip
    with open(out_path, "a") as f:
        for r in records:
            f.write(json.dumps({**r, "date": datetime.date.today().isoformat()}) + "\n")
    # crossover: per shape, the largest density at which sddmm beat dense
    print("\ncrossover (largest measured density where the unstructured SDDMM beats dense dW + gather):")
    for name in shapes(args.size):
        wins = [r["density"] for r in records if r["shape"] == name and r["sddmm"] < r["dense"]]
        print(f"  {name:<16} {max(wins) if wins else 'none (dense always faster)'}")
    # rate relative to the GEMM: the kernel does (its density) of the GEMM's multiply-adds in its time.
    # Taken at the densities where those multiply-adds outweigh the kernel's fixed cost (the cost model
    # has a separate fixed cost): 5% and up, on the shapes with at least 2048×2048 weights.
    big = [r for r in records if r["density"] >= 0.05 and r["out"] * r["in"] >= 2048 * 2048]
    print("\nrate relative to the GEMM (the cost model's sddmm_relative_rate, block_relative_rate), density ≥ 5%, shapes ≥ 2048×2048:")
    for label in ("sddmm", *blocks_of):
        rates = sorted(r["dense"] / r[label] * r.get(f"{label}_density", r["density"]) for r in big)
        if rates:
            print(f"  {label:<8} {rates[0]:.4f} – {rates[-1]:.4f} (median {rates[len(rates) // 2]:.4f})")


if __name__ == "__main__":
    main()
