"""Where SpIEL's window and reselection steps spend their time (GPU), by op, for one variant.

    python benchmarks/profile_reselection.py spiel-ag [--rows 20]

Runs the benchmark setup (S=20, γ=5, T=46) to step 26 and profiles steps 21 (first window step)
and 25 (window + reselection), timing the scheduler's step on its own too.
"""

import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/ and the repository
from bench_step import profiling_setup  # noqa: E402


def main():
    args, model, optimizer, hook, ids = profiling_setup(rows=20)

    def fwd_bwd_opt():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for step in range(1, 27):
        profile = step in (21, 25)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if profile:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        fwd_bwd_opt()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        hook()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if profile:
            prof.__exit__(None, None, None)
        print(f"step {step}: fwd+bwd+opt {1e3 * (t1 - t0):.1f} ms, scheduler {1e3 * (t2 - t1):.1f} ms", flush=True)
        if profile:
            events = prof.key_averages()
            for key, label in ((lambda e: -e.self_device_time_total, "GPU"), (lambda e: -e.self_cpu_time_total, "CPU")):
                print(f"  top {label} self time:")
                for e in sorted(events, key=key)[: args.rows]:
                    print(f"    gpu {e.self_device_time_total / 1e3:8.2f} ms  cpu {e.self_cpu_time_total / 1e3:8.2f} ms  {e.count:6d}×  {e.key[:80]}")


if __name__ == "__main__":
    main()
