"""Host time per layer call on a GPU host: forward and backward of one projection, plain and sparse.

    python benchmarks/host_layer.py [--calls 500] [--size 256] [--tokens 64]

With small shapes the GPU finishes each kernel faster than the host issues the next, so the time per
call is what the host spends issuing it — the cost that bounds a training step whose kernels are
short (qSpIEL on an H100). Variants: ``linear`` (nn.Linear, bf16), ``linear4bit`` (bitsandbytes NF4,
double quantization), ``sparse`` (SpIEL over nn.Linear: merged in place), ``sparse-4bit`` (SpIEL over
the NF4 layer: fused dequantization + delta), each forward (graph built) and backward (input and, for
sparse layers, value gradients), call by call as training runs them: sparse layers take an SM3 step
(not timed) after each backward, so every forward pass is a steady one. ``sparse-block``: 32×32 blocks,
value gradients from the grouped block kernel. ``--product-input``: the input is a product a ⊙ b, which
sparse layers rebuild in backward instead of keeping it.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/ and the repository


class One(nn.Module):
    def __init__(self, proj):
        super().__init__()
        self.proj = proj

    def forward(self, x):
        return self.proj(x)


def build(variant: str, size: int):
    from peft import get_peft_model

    import peft_sparse

    if "4bit" in variant:
        import bitsandbytes as bnb

        proj = bnb.nn.Linear4bit(size, size, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=True)
        proj.weight = bnb.nn.Params4bit(torch.randn(size, size, dtype=torch.bfloat16) * 0.02, requires_grad=False, quant_type="nf4", compress_statistics=True)
        proj = proj.cuda()
    else:
        proj = nn.Linear(size, size, bias=False, dtype=torch.bfloat16, device="cuda")
    proj.weight.requires_grad_(False)
    model = One(proj)
    if variant.startswith("sparse"):
        block_shape = (32, 32) if variant == "sparse-block" else (1, 1)
        model = get_peft_model(model, peft_sparse.SparseFTConfig(target_modules=["proj"], density=0.05, block_shape=block_shape))
        if variant == "sparse-block":  # the block kernel, whatever the cost model says at these small shapes
            model.base_model.model.proj.value_grad_method = "block"
    model.train()
    return model


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


class _Linear(torch.autograd.Function):
    """F.linear inside an autograd function's forward (as the sparse layer calls it), input gradient only."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return torch.nn.functional.linear(x, w)

    @staticmethod
    def backward(ctx, g):
        return g.mm(ctx.saved_tensors[0]), None


def _no_grad_linear(x, w):
    with torch.no_grad():
        return torch.nn.functional.linear(x, w)


def ops_table(args) -> None:
    """Host µs of single operations at the layer benchmark's shapes (the GPU never waits at these sizes)."""
    x = torch.randn(args.tokens, args.size, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)
    flat = w.view(-1)
    idx = torch.randint(0, flat.numel(), (flat.numel() // 20,), device="cuda").sort().values
    xr = x.clone().requires_grad_()
    ops = {
        "torch.empty": lambda: torch.empty(w.shape, dtype=w.dtype, device=w.device),
        "F.linear": lambda: torch.nn.functional.linear(x, w),
        "mm": lambda: x.mm(w),
        "t().mm (dW)": lambda: x.t().mm(x),
        "index_select": lambda: flat.index_select(0, idx),
        ".to(float32)": lambda: x.to(torch.float32),
        ".to(same dtype)": lambda: x.to(torch.bfloat16),
        "reshape": lambda: x.reshape(-1, args.size),
        "detach": lambda: w.detach(),
        "Function.apply (identity)": lambda: _Identity.apply(xr),
        "F.linear, input needs grad": lambda: torch.nn.functional.linear(xr, w),
        "F.linear under no_grad": lambda: _no_grad_linear(xr, w),
        "Function.apply(F.linear)": lambda: _Linear.apply(xr, w),
        "torch.cuda.current_device": torch.cuda.current_device,
        "data_ptr + _version": lambda: (w.data_ptr(), w._version),
    }
    print(f"{torch.cuda.get_device_name()}: host µs per operation (median of 5 rounds of {args.calls})")
    for name, fn in ops.items():
        print(f"  {name:<28} {host_us(fn, args.calls):6.2f}", flush=True)


def burst_ops_table(tokens: int, inp: int, out: int, rounds: int = 30, burst: int = 6) -> None:
    """Host µs of one call of the operations a layer makes at a model's real shapes, where each GEMM
    keeps the GPU busy longer than the host takes to issue it: every call is timed alone, in bursts of
    ``burst`` calls after a synchronisation (too few to fill the launch queue), median over all."""
    import torch.nn.functional as F

    x3 = torch.randn(8, tokens // 8, inp, device="cuda", dtype=torch.bfloat16)
    x2 = x3.view(-1, inp)
    w = torch.randn(out, inp, device="cuda", dtype=torch.bfloat16)
    g2 = torch.randn(tokens, out, device="cuda", dtype=torch.bfloat16)
    wt = w.t()
    ops = {
        "F.linear, 3-D input": lambda: F.linear(x3, w),
        "F.linear, 2-D input": lambda: F.linear(x2, w),
        "mm(x, w.t())": lambda: torch.mm(x2, w.t()),
        "mm(x, wt) (wt kept)": lambda: torch.mm(x2, wt),
        "matmul, 3-D input": lambda: torch.matmul(x3, wt),
        "mm (input gradient)": lambda: g2.mm(w),
        "t().mm (dW)": lambda: g2.t().mm(x2),
        "torch.empty (weight)": lambda: torch.empty(w.shape, dtype=w.dtype, device=w.device),
    }
    print(f"{torch.cuda.get_device_name()}: host µs per call at {tokens}×{inp} → {out} (median of {rounds} bursts of {burst})")
    for name, fn in ops.items():
        times = []
        for r in range(rounds + 1):
            torch.cuda.synchronize()
            for _ in range(burst):
                start = time.perf_counter()
                fn()
                if r:
                    times.append((time.perf_counter() - start) * 1e6)
        print(f"  {name:<28} {statistics.median(times):6.2f}", flush=True)


def host_us(fn, calls: int) -> float:
    """Host µs per call of ``fn``: the median of 5 rounds of ``calls`` calls after one warm-up round,
    the GPU idle at the start of each round."""
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times[1:])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--variants", default="linear,linear4bit,sparse,sparse-block,sparse-4bit")
    parser.add_argument("--cprofile", action="store_true", help="then the host time's top functions per variant (cProfile)")
    parser.add_argument("--pstats", help="with --cprofile: also write each variant's and phase's statistics to <this prefix>-<variant>-<phase>.prof")
    parser.add_argument("--product-input", action="store_true",
                        help="the input is a product a ⊙ b (as a gated MLP's down_proj reads): sparse layers rebuild it in backward instead of keeping it")
    parser.add_argument("--ops", action="store_true", help="first, the host time of single operations a layer call makes")
    parser.add_argument("--burst-ops", help="TOKENS,IN,OUT: first, host time of single operations at these real shapes, timed call by call")
    args = parser.parse_args()
    if args.burst_ops:
        burst_ops_table(*(int(v) for v in args.burst_ops.split(",")))
    if args.ops:
        ops_table(args)
    print(f"{torch.cuda.get_device_name()}: host µs per call (median of 5 rounds of {args.calls}), {args.tokens}×{args.size}")
    import peft_sparse

    for variant in args.variants.split(","):
        model = build(variant, args.size)
        # Training's order, call by call: forward (timed), backward (timed), and for sparse layers an SM3
        # step (not timed), so each forward pass is a steady one, the merge rewritten in place by the step
        # hook. The layer is called without PeftModel's wrapper.
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = peft_sparse.SM3(params, lr=1e-6) if variant.startswith("sparse") else None
        call = model.base_model.model if variant.startswith("sparse") else model
        x = torch.randn(args.tokens, args.size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        if args.product_input:  # every call reads the same X = a ⊙ b
            x = x * torch.randn(args.tokens, args.size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(args.tokens, args.size, device="cuda", dtype=torch.bfloat16)
        keep = args.product_input  # (backward through the shared product node more than once)

        def calls(n: int, forward_profile=None, backward_profile=None) -> tuple[float, float]:
            fwd = bwd = 0.0
            for _ in range(n):
                start = time.perf_counter()
                if forward_profile is not None:
                    forward_profile.enable()
                y = call(x)
                if forward_profile is not None:
                    forward_profile.disable()
                mid = time.perf_counter()
                if backward_profile is not None:
                    backward_profile.enable()
                y.backward(g, retain_graph=keep)
                if backward_profile is not None:
                    backward_profile.disable()
                fwd += mid - start
                bwd += time.perf_counter() - mid
                if optimizer is not None:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            return fwd / n * 1e6, bwd / n * 1e6

        fwd, bwd = [], []
        for _ in range(6):
            torch.cuda.synchronize()
            f, b = calls(args.calls)
            torch.cuda.synchronize()
            fwd.append(f)
            bwd.append(b)
        print(f"  {variant:<12} forward {statistics.median(fwd[1:]):6.1f}  backward {statistics.median(bwd[1:]):6.1f}", flush=True)
        if args.cprofile:
            import cProfile
            import io
            import pstats

            profiles = {"forward": cProfile.Profile(), "backward": cProfile.Profile()}
            calls(args.calls, profiles["forward"], profiles["backward"])
            torch.cuda.synchronize()
            for phase, profiler in profiles.items():
                if args.pstats:
                    profiler.dump_stats(f"{args.pstats}-{variant}-{phase}.prof")
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
                lines = [ln for ln in text.getvalue().splitlines() if ln.strip() and "Ordered" not in ln and "List reduced" not in ln]
                print(f"    cProfile {phase}, {args.calls} calls:\n" + "\n".join("      " + ln[:150] for ln in lines))
        if variant == "sparse-4bit":  # the fused weight alone, and bitsandbytes' dequantization alone
            import bitsandbytes.functional as bnb_f

            layer = model.base_model.model.proj
            idx, val = [layer.sparse_indices["default"]], [layer.sparse_values["default"]]
            weight = layer.get_base_layer().weight
            for label, fn in (("fused weight", lambda: layer.fused_merged_weight(idx, val, None)),
                              ("bnb dequantize_4bit", lambda: bnb_f.dequantize_4bit(weight.data, weight.quant_state))):  # fmt: skip
                print(f"    {label:<22} {host_us(fn, args.calls):6.1f}", flush=True)


if __name__ == "__main__":
    main()
