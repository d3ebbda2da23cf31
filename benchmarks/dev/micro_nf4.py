"""The 4-bit layer's transient weight: NF4 dequantization plus scatter(η, φ) in one Triton launch,
against bitsandbytes' own dequantization (GPU).

    python benchmarks/micro_nf4.py [--sweep]

For each projection shape of TinyLlama (bitsandbytes NF4, blocksize 64, double quantization, bf16),
times (GPU time per call: CUDA graphs of back-to-back calls) ``bitsandbytes.functional.dequantize_4bit`` and
``nf4_compose`` without values (dequantization alone) and with the benchmark's density (5.2%) of
values (each program searching its slice of the indices, or reading it from precomputed starts), after checking that the fused kernel gives bitsandbytes' bits (plus the reference scatter).
``--sweep`` also times other program and chunk sizes of the fused kernel.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/ and the repository

from peft_sparse.core import kernels

from peft_sparse.accel import triton_kernels  # noqa: E402

SHAPES = {"q/o": (2048, 2048), "k/v": (256, 2048), "gate/up": (5632, 2048), "down": (2048, 5632)}


def gpu_ms(fn, reps: int = 50, rounds: int = 7) -> float:
    """GPU time of one call (median over rounds of a CUDA graph of ``reps`` back-to-back calls): no host
    launch time, as in a training step whose host runs ahead."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[len(times) // 2]


def main():
    import bitsandbytes.functional as bnb_f

    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; µs per call (GPU); density 0.052")
    print(f"{'shape':<10}{'bnb':>9}{'fused, no values':>18}{'fused':>9}{'fused, starts':>15}")
    cases = []
    for name, (o, i) in SHAPES.items():
        w = torch.randn(o, i, device="cuda", generator=g).to(torch.bfloat16)
        packed, state = bnb_f.quantize_4bit(w, quant_type="nf4", compress_statistics=True, blocksize=64)
        nested = (state.absmax, state.state2.absmax, state.state2.code, state.state2.blocksize, float(state.offset))
        ops = (packed, state.code, state.absmax, nested, state.blocksize, (o, i), torch.bfloat16)
        nnz = int(0.052 * o * i)
        idx = torch.randperm(o * i, device="cuda", generator=g)[:nnz].sort().values.to(torch.int32)
        val = torch.randn(nnz, device="cuda", generator=g) * 1e-2
        plain = bnb_f.dequantize_4bit(packed, state)
        assert torch.equal(triton_kernels.nf4_compose(*ops), plain)
        want = kernels.scatter_add_reference(plain.clone(), idx, val)
        assert torch.equal(triton_kernels.nf4_compose(*ops, idx, val), want)
        starts = triton_kernels.compose_starts(idx, o * i) if hasattr(triton_kernels, "compose_starts") else None
        if starts is not None:
            assert torch.equal(triton_kernels.nf4_compose(*ops, idx, val, starts=starts), want)
        t_bnb = gpu_ms(lambda: bnb_f.dequantize_4bit(packed, state))
        t_plain = gpu_ms(lambda: triton_kernels.nf4_compose(*ops))
        t_fused = gpu_ms(lambda: triton_kernels.nf4_compose(*ops, idx, val))
        t_starts = gpu_ms(lambda: triton_kernels.nf4_compose(*ops, idx, val, starts=starts)) if starts is not None else float("nan")
        print(f"{name:<10}{t_bnb * 1e3:>9.1f}{t_plain * 1e3:>18.1f}{t_fused * 1e3:>9.1f}{t_starts * 1e3:>15.1f}", flush=True)
        cases.append((name, ops, idx, val))
    if not args.sweep:
        return
    print("fused, starts (µs per call, GPU) by program size BLOCK and chunk CHUNK:")
    for block in (4096, 8192, 16384, 32768):
        for chunk in (1024, 2048, 4096):
            if chunk > block:
                continue
            triton_kernels._NF4_BLOCK, triton_kernels._NF4_CHUNK = block, chunk
            times = []
            for _, ops, idx, val in cases:
                starts = triton_kernels.compose_starts(idx, ops[5][0] * ops[5][1])
                times.append(gpu_ms(lambda: triton_kernels.nf4_compose(*ops, idx, val, starts=starts)))
            print(f"  BLOCK {block:>6} CHUNK {chunk:>5}: " + "  ".join(f"{n} {t * 1e3:.1f}" for (n, *_), t in zip(cases, times)), flush=True)


if __name__ == "__main__":
    main()
