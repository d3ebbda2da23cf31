"""Host-side cost of an optimizer step of a SpIEL model (SM3 or AdamW, with the step hook that rewrites
the training merges), measured on CPU with the GPU launches replaced by no-ops.

    python benchmarks/host_optimizer.py [--variants spiel-ma,spiel-ma-block,spiel-ag] [--steps 200] [--cprofile N]

The model has TinyLlama's 22 layers and 7 projections (154 sparse layers) at hidden size 64. For the
timed ``optimizer.step()`` calls, the SM3 step takes its CUDA path (one multi-tensor launch plan, the
accumulator copy) and the hook its multi-tensor scatter, with every kernel launch and host-to-device
copy skipped: what remains is the Python and dispatcher work a GPU step spends issuing them, the part
that bounds a step when the GPU waits for the host. Forward and backward passes run between the timed
steps, on the CPU paths, so every step sees fresh gradients.
"""

import argparse
import contextlib
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/ and the repository
from host_overhead import build  # noqa: E402


@contextlib.contextmanager
def gpu_paths_without_launches():
    """The CUDA code paths of the SM3 step and the merge rewrite, every launch and copy to the device
    skipped."""
    from peft_sparse.core import kernels
    from peft_sparse.accel import triton_kernels
    from peft_sparse.optim import sm3

    class QuietSM3(triton_kernels.MultiSM3):
        def __call__(self, grads, lr, momentum, eps, weight_decay):
            triton_kernels._address_table(grads, self.device)  # the host work of the call, without the launch

    saved = [(sm3, "_fused_device", sm3._fused_device), (sm3, "_fused_kernel", sm3._fused_kernel),
             (sm3, "_block_kernel_takes", sm3._block_kernel_takes),
             (triton_kernels.MultiScatterSum, "__call__", triton_kernels.MultiScatterSum.__call__)]  # fmt: skip
    sm3._fused_device = lambda param: True
    sm3._fused_kernel = lambda: QuietSM3
    sm3._block_kernel_takes = lambda block_shape: True
    kernels.SCATTER_SUM_KERNELS["cpu"] = "no-op"  # (what _gpu_kernel finds for a CUDA tensor)
    triton_kernels.MultiScatterSum.__call__ = lambda self: None
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        kernels.SCATTER_SUM_KERNELS.pop("cpu")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="spiel-ma,spiel-ma-block,spiel-ag,spiel-ag-block")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--cprofile", type=int, default=0, help="print this many lines of a cProfile of the timed steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ids = torch.randint(0, 128, (1, 8))
    for variant in args.variants.split(","):
        model, optimizer, scheduler = build(variant, density=0.25)
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        times = []
        profile = cProfile.Profile() if args.cprofile else None
        for step in range(args.steps + 5):
            with gpu_paths_without_launches():
                if profile is not None and step >= 5:
                    profile.enable()
                start = time.perf_counter()
                optimizer.step()
                elapsed = time.perf_counter() - start
                if profile is not None:
                    profile.disable()
            if step >= 5:
                times.append(elapsed)
            if step % 20 == 0:  # fresh gradients now and then (a pass costs far more than a step)
                optimizer.zero_grad(set_to_none=True)
                model(input_ids=ids, labels=ids).loss.backward()
        print(f"{variant:15s} optimizer.step() host {1e3 * statistics.median(times):6.2f} ms (median of {args.steps})", flush=True)
        if profile is not None:
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.cprofile)


if __name__ == "__main__":
    main()
