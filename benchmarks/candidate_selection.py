"""SpIEL-AG's candidate choice at the first step of an estimation window (unstructured, ``score_normalization="column"``,
the default): for every targeted tensor, its columns' RMS gradient, then the K_i largest |∂L/∂W_ij| / RMS_j and the
gradients there (``_WindowStatistics``). Times the whole choice for all tensors of a model's shapes, the torch
reference (a float32 copy, the quotients, the top-K of their bit patterns, a cumulative count) against the fast
paths' radix selection over quotients formed in registers, and checks on this device that both choose the same
indices and gradients, bit for bit.

    python benchmarks/candidate_selection.py --size llama2-7b --out results.jsonl   # appends one JSON line

Gradients: random bf16 (scaled per column so the column normalization matters), one per targeted tensor, made
before the timing; K_i = LoRA r = 64's trainable count of that tensor (r·(in + out)), as the step tables' budget.
Rounds alternate the two ways (the second round in the other order); each timing is one synchronised pass over
every tensor.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peft_sparse.core import kernels  # noqa: E402
from peft_sparse.core.base import index_dtype  # noqa: E402
from peft_sparse.methods.spiel.statistics import column_scale  # noqa: E402

SIZES = {  # (hidden, intermediate, layers, key-value width)
    "tinyllama": (2048, 5632, 22, 256),  # (4 key-value heads of 64)
    "llama2-7b": (4096, 11008, 32, 4096),
}


def shapes(size: str) -> list:
    hidden, inter, layers, kv = SIZES[size]
    one = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden), (hidden, inter)]
    return one * layers


def choose(grads: list, ks: list, reference: bool) -> list:
    """The window's first-step choice of every tensor, as ``_WindowStatistics.__call__`` makes it."""
    out = []
    for grad, k in zip(grads, ks):
        scale = column_scale(grad, torch.float32)
        pick = kernels.top_scaled_magnitudes_reference if reference else kernels.top_scaled_magnitudes
        out.append(pick(grad, scale, k, index_dtype(grad.numel())))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="llama2-7b")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("candidate_selection.py times a GPU: no CUDA device here")
    kernels.load_gpu_kernels()
    g = torch.Generator(device="cuda").manual_seed(0)
    grads, ks = [], []
    for out_f, in_f in shapes(args.size):
        column = torch.rand(in_f, generator=g, device="cuda") * 4 + 0.25  # columns of different RMS
        grads.append((torch.randn(out_f, in_f, generator=g, device="cuda") * column * 1e-3).to(torch.bfloat16))
        ks.append(args.rank * (out_f + in_f))
    first = {way: choose(grads, ks, way == "reference") for way in ("reference", "kernel")}  # (warm-up and compile)
    same = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first["reference"], first["kernel"]))
    del first
    times: dict = {"reference": [], "kernel": []}
    for r in range(args.rounds):
        for way in ("reference", "kernel") if r % 2 == 0 else ("kernel", "reference"):
            torch.cuda.synchronize()
            start = time.perf_counter()
            choose(grads, ks, way == "reference")
            torch.cuda.synchronize()
            times[way].append(time.perf_counter() - start)
    record = {
        "benchmark": "candidate_selection", "size": args.size, "tensors": len(grads), "weights": sum(x.numel() for x in grads),
        "candidates": sum(ks), "same_bits": same, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        **{f"{way}_ms_median": 1000 * statistics.median(t) for way, t in times.items()},
        **{f"{way}_ms_all": [round(1000 * x, 2) for x in t] for way, t in times.items()},
    }  # fmt: skip
    print(f"{args.size}: {len(grads)} tensors, {record['weights']:,} weights, {record['candidates']:,} candidates; "
          f"reference {record['reference_ms_median']:.1f} ms, kernel {record['kernel_ms_median']:.1f} ms a window start; "
          f"same indices and gradients: {same}")  # fmt: skip
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
