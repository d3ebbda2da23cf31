"""SpIEL-MA's row and column accumulators beside AdamW (``RowColumnAccumulators.update``: ν = min(R_r, C_c) + g²,
then R and C take each row's and column's maximum ν) at TinyLlama-1.1B shapes, LoRA r=16's budget: the time of one
update with the maxima by ``scatter_reduce_`` on the floats (the library's) and on their bits read as integers (for
non-negative floats the same order, so the same maxima; a native atomic on a GPU), single weights (sorted rows) and
64×64 blocks. On an H100 both take 1.1–1.3 ms (docs/perf-log.md, 2026-12-07 (third)), so the library keeps the floats.

    python benchmarks/ma_accumulators.py --out $OUT/ma-accumulators.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SHAPES = [(2048, 2048), (256, 2048), (256, 2048), (2048, 2048), (5632, 2048), (5632, 2048), (2048, 5632)]  # (out, in) per layer


def positions(layers: int, blocks: bool, device: str):
    rows, cols, row_at, col_at = [], [], 0, 0
    for _ in range(layers):
        for out, inn in SHAPES:
            budget = 16 * (out + inn)
            if blocks:
                nb = budget // 4096
                picked = torch.randperm((out // 64) * (inn // 64), device=device)[:nb].sort().values
                br, bc = picked // (inn // 64), picked % (inn // 64)
                span = torch.arange(64, device=device)
                r = (br[:, None, None] * 64 + span[None, :, None]).expand(-1, 64, 64).reshape(-1)
                c = (bc[:, None, None] * 64 + span[None, None, :]).expand(-1, 64, 64).reshape(-1)
            else:
                flat = torch.randperm(out * inn, device=device)[:budget].sort().values
                r, c = flat // inn, flat % inn
            rows.append(r + row_at)
            cols.append(c + col_at)
            row_at += out
            col_at += inn
    return torch.cat(rows), torch.cat(cols), row_at, col_at


def update(row, col, rows, cols, grad, as_int: bool):
    nu = torch.minimum(row.index_select(0, rows), col.index_select(0, cols)).add_(grad * grad)
    if as_int:
        row.view(torch.int32).scatter_reduce_(0, rows, nu.view(torch.int32), reduce="amax", include_self=True)
        col.view(torch.int32).scatter_reduce_(0, cols, nu.view(torch.int32), reduce="amax", include_self=True)
    else:
        row.scatter_reduce_(0, rows, nu, reduce="amax", include_self=True)
        col.scatter_reduce_(0, cols, nu, reduce="amax", include_self=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    for blocks in (False, True):
        rows, cols, n_rows, n_cols = positions(args.layers, blocks, device)
        grads = [torch.randn(rows.numel(), device=device) * 1e-3 for _ in range(args.iters)]
        results = {}
        finals = {}
        for as_int in (False, True, False, True):
            row = torch.zeros(n_rows, device=device)
            col = torch.zeros(n_cols, device=device)
            times = []
            for grad in grads:
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                update(row, col, rows, cols, grad, as_int)
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            results.setdefault("int" if as_int else "float", []).append(statistics.median(times[2:]))
            finals["int" if as_int else "float"] = (row, col)
        same = all(torch.equal(a, b) for a, b in zip(finals["float"], finals["int"]))
        record = {"values": rows.numel(), "blocks": blocks, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  "float_ms": min(results["float"]) * 1e3, "int_ms": min(results["int"]) * 1e3, "same_bits": same}  # fmt: skip
        print(json.dumps(record))
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
