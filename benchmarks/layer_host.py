"""Host time of one adapted layer's training pass on a GPU: how long the host takes to issue a forward and a
backward of one TinyLlama-shaped projection (2048 → 5632, bf16) when the GPU's work is short (16 tokens), so the
host is what each iteration waits for. A training step at TinyLlama shapes issues 154 such passes; where a
variant's host time per pass times 154 exceeds its GPU time per step, the step is bound by the host
(BENCHMARKS.md, "Default settings beside the opt-in merge").

    python benchmarks/layer_host.py [--iters 2000] [--out F.jsonl]

Rows: the frozen layer alone (``floor``: Y = X·Wᵀ with ∂L/∂X), LoRA r64, SpIEL-AG and block SpIEL-AG (64×64) with the
default pass and with the opt-in training merge, at LoRA r64's budget for this layer, each called through the
PeftModel and on the projection itself (``layer_``: what a step pays per layer); block SpIEL-AG's default write and
write-back as its forward calls them, from the layer's kept lane (``write_restore_us``) and through the generic
calls (``write_restore_generic_us``); then the primitives of the default pass (write
θ₀[η] + φ at η, write θ₀[η] back) by each available way. Median over 5 repeats of the mean host time per
iteration (µs), each repeat ``--iters`` iterations after a warm-up, one synchronisation per repeat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

IN, OUT, RANK = 2048, 5632, 64


def per_iteration_us(fn, iters: int, repeats: int = 5) -> float:
    import torch

    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    means = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        means.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(means)


def layer_rows(iters: int, tokens: int) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model

    import peft_sparse

    budget = RANK * (IN + OUT)
    budget -= budget % (64 * 64)
    rows = {}

    def build(kind: str):
        torch.manual_seed(0)
        model = torch.nn.Sequential()
        model.add_module("proj", torch.nn.Linear(IN, OUT, bias=False))
        model = model.to("cuda", torch.bfloat16)
        model.proj.weight.requires_grad_(False)
        if kind == "floor":
            return model
        if kind == "lora":
            return get_peft_model(model, LoraConfig(r=RANK, lora_alpha=16, target_modules=["proj"]))
        block = (64, 64) if "block" in kind else (1, 1)
        config = peft_sparse.SpIELConfig(target_modules=["proj"], num_tunable_weights=budget, block_shape=block,
                                         training_merge=kind.endswith("merge"), reselection_steps=10_000)  # fmt: skip
        return get_peft_model(model, config)

    x = torch.randn(tokens, IN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, OUT, device="cuda", dtype=torch.bfloat16)
    for kind in ("floor", "lora", "spiel-ag", "spiel-ag-merge", "spiel-ag-block", "spiel-ag-block-merge"):
        model = build(kind)

        layer = model.proj if kind == "floor" else model.base_model.model.proj  # (the projection itself: no PeftModel call)

        def forward():
            model(x)

        def forward_backward():
            model(x).backward(grad)

        def layer_forward():
            layer(x)

        def layer_forward_backward():
            layer(x).backward(grad)

        rows[kind] = {"forward_us": per_iteration_us(forward, iters), "forward_backward_us": per_iteration_us(forward_backward, iters),
                      "layer_forward_us": per_iteration_us(layer_forward, iters),
                      "layer_forward_backward_us": per_iteration_us(layer_forward_backward, iters)}  # fmt: skip
        if kind == "spiel-ag-block":  # the default pass's write and write-back as its forward calls them
            from peft_sparse.accel import transient_merge

            flat = transient_merge._alias(layer, layer.get_base_layer().weight)  # (the flat view the pass writes)
            indices, values = [layer.sparse_indices["default"]], [layer.sparse_values["default"]]

            def write_restore():
                transient_merge.restore(layer, flat, indices, transient_merge.write(layer, flat, indices, values))

            for lane, row in ((True, "write_restore_us"), (False, "write_restore_generic_us")):
                transient_merge.WRITE_LANE, layer._write_lane = lane, None  # (the layer's kept lane, or none)
                rows[kind][row] = per_iteration_us(write_restore, iters)
            transient_merge.WRITE_LANE = True
        del model, layer
    return rows


def primitive_rows(iters: int) -> dict:
    import torch

    from peft_sparse.core import kernels

    torch.manual_seed(0)
    weight = torch.randn(OUT * IN, device="cuda", dtype=torch.bfloat16)
    nnz = RANK * (IN + OUT)
    indices = torch.randperm(OUT * IN, device="cuda")[:nnz].sort().values.to(torch.int32)
    indices64 = indices.long()
    values = torch.randn(nnz, device="cuda", dtype=torch.bfloat16) * 1e-3
    rows = {}
    triton = kernels.triton()
    saved = triton.swap_in(weight, indices, values)
    triton.scatter_copy(weight, indices, saved)

    def triton_pair():
        kept = triton.swap_in(weight, indices, values)
        triton.scatter_copy(weight, indices, kept)

    def triton_pair_unkept():  # (each launch through Triton's argument binder)
        kept = torch.empty(nnz, dtype=weight.dtype, device=weight.device)
        grid = (triton.triton.cdiv(nnz, 1024),)
        triton.launch(triton._swap_in_kernel, grid, weight, indices, kept, values, nnz, BLOCK=1024)
        triton.launch(triton._scatter_copy_kernel, grid, weight, indices, kept, nnz, BLOCK=1024)

    def aten_pair():
        kept = weight.index_select(0, indices)
        weight.index_add_(0, indices, values)
        weight.index_copy_(0, indices64, kept)

    def aten_pair_int32():
        kept = weight.index_select(0, indices)
        weight.index_add_(0, indices, values)
        weight.index_put_((indices,), kept)

    def empty_alloc():
        torch.empty(nnz, device="cuda", dtype=torch.bfloat16)

    for name, fn in (("triton swap_in + scatter_copy", triton_pair), ("triton, each launch bound anew", triton_pair_unkept), ("aten index_select + index_add_ + index_copy_ (int64)", aten_pair),
                     ("aten index_select + index_add_ + index_put_ (int32)", aten_pair_int32), ("torch.empty", empty_alloc)):  # fmt: skip
        rows[name] = per_iteration_us(fn, iters)
    before = weight.clone()
    triton_pair()
    aten_pair()
    rows["bits kept"] = bool(torch.equal(before, weight))
    return rows


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("layer_host.py measures a GPU's host path: no CUDA device here")
    record = {"gpu": torch.cuda.get_device_name(), "tokens": args.tokens, "iters": args.iters,
              "layers": layer_rows(args.iters, args.tokens), "primitives": primitive_rows(args.iters)}  # fmt: skip
    floor = record["layers"]["floor"]
    print(f"{record['gpu']}: host µs per pass of one {IN}→{OUT} bf16 projection, {args.tokens} tokens")
    print(f"{'variant':<24}{'forward':>10}{'fwd+bwd':>10}{'fwd+bwd − floor':>18}{'layer fwd':>11}{'layer fwd+bwd':>15}")
    for name, row in record["layers"].items():
        print(f"{name:<24}{row['forward_us']:>10.1f}{row['forward_backward_us']:>10.1f}{row['forward_backward_us'] - floor['forward_backward_us']:>18.1f}"
              f"{row['layer_forward_us']:>11.1f}{row['layer_forward_backward_us']:>15.1f}")  # fmt: skip
    block = record["layers"].get("spiel-ag-block", {})
    if "write_restore_us" in block:
        print(f"  block SpIEL-AG, the default pass's write + restore: {block['write_restore_us']:.1f} µs "
              f"(generic calls, no lane: {block['write_restore_generic_us']:.1f} µs)")
    for name, value in record["primitives"].items():
        print(f"  {name}: {value:.1f} µs" if isinstance(value, float) else f"  {name}: {value}")
    if args.out:
        with open(args.out, "a") as handle:
            handle.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
