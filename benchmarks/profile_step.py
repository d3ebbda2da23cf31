"""Where a training step's GPU time goes: top kernels of a variant over 3 steps (after warm-up).

    python benchmarks/profile_step.py spiel-ma [--rows 25]
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import profiling_setup, train_step  # noqa: E402


def main():
    args, model, optimizer, hook, ids = profiling_setup(rows=25)

    def step():
        train_step(model, optimizer, hook, ids)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    loss = model(input_ids=ids, labels=ids).loss
    saved = torch.cuda.memory_allocated() - base
    loss.backward()
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    print(f"{args.variant}: resident before forward {base / 2**30:.2f} GiB, held by the forward for backward {saved / 2**30:.2f} GiB")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events) / 3 / 1e3
    cpu = sum(e.self_cpu_time_total for e in events) / 3 / 1e3
    print(f"per step: GPU kernels {total:.1f} ms, CPU (all ops, profiled) {cpu:.1f} ms")
    for e in events[: args.rows]:
        print(f"  {e.self_device_time_total / 3 / 1e3:8.2f} ms/step  {e.count // 3:6d}×  {e.key[:90]}")


if __name__ == "__main__":
    main()
