"""Launch settings of the grouped block value-gradient kernel per layer shape (GPU).

    python benchmarks/tune_block.py [--density 0.052] [--block 32] [--tokens 8192]

For TinyLlama's projection shapes at the benchmark's density, times (median, ``triton.testing.do_bench``):

* ``dense``: the dense path (GEMM + gather of the active elements);
* ``per-block``: the one-block-per-program kernel ``block_sddmm`` followed by the placement of its
  tiles in the values' order (``index_copy_``), the path before the grouped kernel;
* ``grouped``: ``block_sddmm_into`` as shipped;

for ``down_proj``, whose input is the gated activation silu(gate) ⊙ up: that product formed by torch
and then the kernel, against the kernel forming it tile by tile from the two factors (as training does);
then every combination of group size (blocks sharing one block row or column per program),
orientation (shared rows, columns, or chosen by the shape as shipped), token step (``BLOCK_T``),
pipeline stages and token slicing (``target_programs``: none or the default), with 4 warps; and the
settings with the least time per layer (all 7 projections) over the shipped orientation rule.
Every result is checked against the dense product first.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent)]  # benchmarks/ and the repository

from value_grad import shapes  # noqa: E402

from peft_sparse.core import kernels

from peft_sparse.accel import triton_kernels  # noqa: E402
from peft_sparse.core.selection import BlockGrid  # noqa: E402


def _problem(args, out_f: int, in_f: int, gen):
    """A layer's bf16 ∂L/∂Y and X (``args.tokens`` rows), a random block layout at ``args.density``
    (``args.block``-square blocks), its active elements (ascending) and the dense product there."""
    go = torch.randn(args.tokens, out_f, device="cuda", dtype=torch.bfloat16, generator=gen)
    x = torch.randn(args.tokens, in_f, device="cuda", dtype=torch.bfloat16, generator=gen)
    grid = BlockGrid(out_f, in_f, (args.block, args.block))
    nb = max(1, int(args.density * grid.numel))
    blocks = torch.randperm(grid.numel, device="cuda", generator=gen)[:nb].sort().values
    layout = kernels.BlockLayout.of_blocks(blocks, out_f, in_f, (args.block, args.block))
    idx = grid.expand(blocks)
    return go, x, layout, idx, go.float().t().mm(x.float()).view(-1)[idx]


def main():
    from triton.testing import do_bench

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--density", type=float, default=0.052)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--wide", action="store_true",
                        help="instead: the shipped orientation rule with groups 4 and 8, BLOCK_T 64 and 128, 2–4 stages, 4 and 8 "
                             "warps, and half, the default and twice the default token-slice target")  # fmt: skip
    args = parser.parse_args()
    if args.wide:
        return wide(args)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bh = bw = args.block
    default_target = triton_kernels._target_programs(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, tokens={args.tokens}, density={args.density}, block {bh}×{bw}; ms (median)")
    total = {}
    for name, (out_f, in_f) in shapes("tinyllama").items():
        go, x, layout, idx, want = _problem(args, out_f, in_f, gen)
        nb = layout.rows.numel()
        slots = layout.slots()
        out = torch.empty(idx.numel(), device="cuda")

        def per_block():
            tiles = triton_kernels.block_sddmm(go, x, layout.rows, layout.cols, bh, bw)
            return torch.empty_like(out).index_copy_(0, slots, tiles.reshape(-1))

        dense = do_bench(lambda: kernels.dense_weight_gradient(go, x).view(-1).index_select(0, idx).float(), warmup=5, rep=30, return_mode="median")
        old = do_bench(per_block, warmup=5, rep=30, return_mode="median")
        torch.testing.assert_close(triton_kernels.block_sddmm_into(go, x, layout, out), want, rtol=2e-2, atol=2e-1)
        shipped = do_bench(lambda: triton_kernels.block_sddmm_into(go, x, layout, out), warmup=5, rep=30, return_mode="median")
        results = []
        for group, orient, block_t, stages, target in itertools.product((2, 4), ("auto", "rows", "cols"), (32, 64), (2, 3), (0, default_target)):
            if orient == "auto":  # the shipped rule
                plan = triton_kernels.block_group_plan(layout, group)
            else:
                share_rows = orient == "rows"
                plan = triton_kernels.BlockGroups.of_layouts([layout], share_rows, group)[0]
            got = triton_kernels.launch_grouped(go, x, (bh, bw), plan, out, False, block_t, target, 4, stages)
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-1)
            ms = do_bench(lambda: triton_kernels.launch_grouped(go, x, (bh, bw), plan, out, False, block_t, target, 4, stages), warmup=5, rep=30, return_mode="median")
            results.append((ms, (group, orient, block_t, stages, target)))
        if name.startswith("down"):  # X = silu(gate) ⊙ up: formed by torch first, or tile by tile in the kernel
            a = torch.randn(args.tokens, in_f, device="cuda", dtype=torch.bfloat16, generator=gen)
            formed = do_bench(lambda: triton_kernels.block_sddmm_into(go, a * x, layout, out), warmup=5, rep=30, return_mode="median")
            line = f"{name:<14} X as two factors: product, then the kernel {formed:.4f}; the kernel forming it, by"
            for share_rows in (True, False):
                plan = triton_kernels.BlockGroups.of_layouts([layout], share_rows, 4)[0]
                dest = out.clone()
                launch = lambda x2, f: triton_kernels.launch_grouped(go, x2, (bh, bw), plan, dest, False, 64, default_target, x_factor=f)  # noqa: E731
                assert torch.equal(launch(a, x).clone(), launch(a * x, None))  # one plan: the same bits
                ms = do_bench(lambda: launch(a, x), warmup=5, rep=30, return_mode="median")
                line += f" {'rows' if share_rows else 'columns'} {ms:.4f}"
            as_shipped = do_bench(lambda: triton_kernels.block_sddmm_into(go, a, layout, out, x_factor=x), warmup=5, rep=30, return_mode="median")
            print(line + f"; as shipped {as_shipped:.4f}")
        by_config = {c: ms for ms, c in results}
        results.sort()
        print(f"{name:<14} blocks {nb:5d}  dense {dense:.4f}  per-block {old:.4f}  grouped {shipped:.4f}  best (group, orientation, BLOCK_T, stages, target; 4 warps):")
        for ms, c in results[:5]:
            print(f"    {ms:.4f}  {c}")
        total[name] = (dense, old, shipped, by_config)
    # one setting for every shape, orientation chosen by the shape: the sum over a layer's projections
    per_layer = {"q/o (h,h)": 2, "k/v (kv,h)": 2, "gate/up (i,h)": 2, "down (h,i)": 1}
    layer = {c: sum(per_layer[n] * t[3][c] for n, t in total.items()) for c in next(iter(total.values()))[3] if c[1] == "auto"}
    print("ms per layer (q, k, v, o, gate, up, down): dense {:.4f}, per-block {:.4f}, grouped as shipped {:.4f}".format(
        *(sum(per_layer[n] * t[i] for n, t in total.items()) for i in range(3))))  # fmt: skip
    for c, ms in sorted(layer.items(), key=lambda kv: kv[1])[:8]:
        print(f"    {ms:.4f}  {c}")


def wide(args):
    """The wider sweep of launch settings (shipped orientation rule): per shape the four fastest, then the
    time per layer of each setting used for every shape."""
    from triton.testing import do_bench

    gen = torch.Generator(device="cuda").manual_seed(0)
    bh = bw = args.block
    default_target = triton_kernels._target_programs(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, tokens={args.tokens}, density={args.density}, block {bh}×{bw}, default target "
          f"{default_target}; ms (median); settings (group, BLOCK_T, stages, warps, target × default)")  # fmt: skip
    per_layer = {"q/o (h,h)": 2, "k/v (kv,h)": 2, "gate/up (i,h)": 2, "down (h,i)": 1}
    total: dict = {}
    shipped_total = 0.0
    for name, (out_f, in_f) in shapes("tinyllama").items():
        go, x, layout, _, want = _problem(args, out_f, in_f, gen)
        nb = layout.rows.numel()
        out = torch.empty(want.numel(), device="cuda")
        shipped = do_bench(lambda: triton_kernels.block_sddmm_into(go, x, layout, out), warmup=5, rep=30, return_mode="median")
        shipped_total += per_layer[name] * shipped
        results = []
        for setting in itertools.product((4, 8), (64, 128), (2, 3, 4), (4, 8), (0.5, 1, 2)):
            group, block_t, stages, warps, factor = setting
            plan = triton_kernels.block_group_plan(layout, group)
            target = int(default_target * factor)
            run = lambda: triton_kernels.launch_grouped(go, x, (bh, bw), plan, out, False, block_t, target, warps, stages)  # noqa: E731
            try:
                torch.testing.assert_close(run(), want, rtol=2e-2, atol=2e-1)
                ms = do_bench(run, warmup=5, rep=30, return_mode="median")
            except Exception:  # (e.g. more shared memory than the GPU has)
                ms = float("inf")
            results.append((ms, setting))
            total[setting] = total.get(setting, 0.0) + per_layer[name] * ms
        results.sort()
        print(f"{name:<14} blocks {nb:5d}  as shipped {shipped:.4f}  fastest: " + "  ".join(f"{ms:.4f} {c}" for ms, c in results[:4]))
    print(f"ms per layer (q, k, v, o, gate, up, down): as shipped {shipped_total:.4f}; one setting for every shape:")
    for setting, ms in sorted(total.items(), key=lambda kv: kv[1])[:10]:
        print(f"    {ms:.4f}  {setting}")


if __name__ == "__main__":
    main()
