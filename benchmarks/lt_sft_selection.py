"""LT-SFT's global selection at Llama-2-7B shapes: peak extra GPU memory and time of the streaming top-K
(``peft_sparse.core.selection.global_top_k``) against concatenating every score into one vector.
Produces BENCHMARKS.md, "Two and four GPUs; LT-SFT selection at 7B shapes": the LT-SFT global top-K line.

    python benchmarks/lt_sft_selection.py --out results.jsonl    # appends one JSON line

The dense phase's deltas θ₁ − θ₀ of all 224 targeted tensors (32 blocks × q, k, v, o, gate, up, down; random
values, float32 as the dense phase keeps them) are allocated first; "extra" is the peak above that. K is
LoRA r = 64's trainable count (159,907,840, 2.4% of the 6.5B targeted weights).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peft_sparse.core.selection import global_top_k  # noqa: E402

SHAPES = {"q_proj": (4096, 4096), "k_proj": (4096, 4096), "v_proj": (4096, 4096), "o_proj": (4096, 4096),
          "gate_proj": (11008, 4096), "up_proj": (11008, 4096), "down_proj": (4096, 11008)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--k", type=int, default=159_907_840)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    deltas = {f"layers.{i}.{n}": torch.randn(s, device=device, generator=g) for i in range(args.layers) for n, s in SHAPES.items()}
    total = sum(d.numel() for d in deltas.values())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    result = {"device": torch.cuda.get_device_name(0), "targeted_weights": total, "k": args.k, "deltas_gib": base / 2**30}

    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    chosen = global_top_k({name: (lambda d=d: d.abs()) for name, d in deltas.items()}, args.k)
    torch.cuda.synchronize()
    result["streaming"] = {"seconds": time.perf_counter() - start, "extra_peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
                           "selected": sum(v.numel() for v in chosen.values())}  # fmt: skip
    threshold = min(float(deltas[n].flatten()[v.to(device)].abs().min()) for n, v in chosen.items() if v.numel())
    del chosen

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        flat = torch.cat([d.abs().flatten() for d in deltas.values()])
        kth = torch.topk(flat, args.k, sorted=False).values.min()
        torch.cuda.synchronize()
        result["concatenated"] = {"seconds": time.perf_counter() - start, "extra_peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
                                  "same_threshold": float(kth) == threshold}  # fmt: skip
        del flat
    except torch.OutOfMemoryError as error:
        result["concatenated"] = {"error": f"out of memory: {error}"[:200]}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "a") as out:
            out.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
