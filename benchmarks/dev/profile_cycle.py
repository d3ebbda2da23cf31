"""Where a SpIEL cycle's extra time goes, step by step (GPU): windows, reselections, the step after.

    python benchmarks/profile_cycle.py spiel-ag-block [--rows 12] [--size tinyllama] [--host-profile]

Runs the benchmark's schedule (S=20, γ=5, T=46: windows 1–5, 21–25, 41–45; reselections at 5, 25,
45). Steps 7–26 run as in ``bench_step.py`` and print, per step, the wall time (synchronised) and the
host's issue time per phase (forward, backward, optimizer, scheduler hook; without synchronising):
when the host's total is close to the wall, the GPU waits for the host. Steps 35 (steady), 41 (a
window's first step), 42 (a later window step), 45 (reselection) and 46 (the step after) then run under
the profiler, one at a time and in two parts (forward + backward; optimizer + scheduler hook), each
synchronised: their kernel count, summed kernel time, the top kernels and top host operations (own
CPU time) of each part, and the host time of the four phases. ``--host-profile``: steps 21, 22, 25
and 26 (a window's first and second step, the reselection, the step after) also run whole under
cProfile, which prints where their host time goes by Python function (own time; cumulative time of
this library's functions;
cProfile slows Python calls, so these steps' wall times are not comparable with the others').
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/ and the repository
from bench_step import profiling_setup, train_step  # noqa: E402

HOST_PROFILED = {21: "window, first step", 22: "window, second step", 25: "reselection", 26: "after reselection"}
PROFILED = {35: "steady", 41: "window, first step", 42: "window, later step", 45: "reselection", 46: "after reselection"}


def _report(prof, title: str, rows: int) -> None:
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.key.startswith("Optimizer.")]
    n = sum(e.count for e in kernels)
    gpu = sum(e.self_device_time_total for e in kernels) / 1e3
    print(f"\n== {title}, profiled: {n} kernels, {gpu:.1f} ms of kernels")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:rows]:
        print(f"   gpu {e.self_device_time_total / 1e3:8.2f} ms {e.count:6d}×  {e.key[:80]}")
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    for e in sorted(cpu, key=lambda e: -e.self_cpu_time_total)[:rows]:
        print(f"   cpu {e.self_cpu_time_total / 1e3:8.2f} ms {e.count:6d}×  {e.key[:80]}")


def main():
    args, model, optimizer, hook, ids = profiling_setup(rows=12)

    def phases():  # host ms of forward, backward, optimizer, hook
        return [seconds * 1e3 for seconds in train_step(model, optimizer, hook, ids)]

    print(f"{args.variant}: step  wall ms  | host ms: forward backward optimizer hook (total)")
    walls, host_reports = {}, []
    for t in range(1, 47):
        torch.cuda.synchronize()
        if t in PROFILED:
            host = []
            for part in ("forward + backward", "optimizer + scheduler"):  # profiled apart, each synchronised
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
                    t0 = time.perf_counter()
                    if part.startswith("forward"):
                        loss = model(input_ids=ids, labels=ids).loss
                        t1 = time.perf_counter()
                        loss.backward()
                    else:
                        if optimizer is not None:
                            optimizer.step()
                            optimizer.zero_grad(set_to_none=True)
                        t1 = time.perf_counter()
                        if hook is not None:
                            hook()
                    t2 = time.perf_counter()
                    torch.cuda.synchronize()
                host += [(t1 - t0) * 1e3, (t2 - t1) * 1e3]
                _report(prof, f"step {t} ({PROFILED[t]}), {part}", args.rows)
            print("   host ms " + " ".join(f"{h:.1f}" for h in host) + f" ({sum(host):.1f})")
            continue
        start = time.perf_counter()
        if t in HOST_PROFILED and args.host_profile:  # the whole step under cProfile
            import cProfile
            import io
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
            host = phases()
            profiler.disable()
            for order, restriction in (("tottime", ()), ("cumulative", ("peft_sparse",))):
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(*restriction, 2 * args.rows)
                where = " (this library's functions)" if restriction else ""
                host_reports.append(f"step {t} ({HOST_PROFILED[t]}) under cProfile, by {order}{where}:\n" + text.getvalue())
        else:
            host = phases()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3
        walls[t] = wall
        if t >= 7 and t <= 26:
            print(f"  {t:3d}  {wall:7.1f}  | " + " ".join(f"{h:7.1f}" for h in host) + f"  ({sum(host):.1f})")
    for report in host_reports:
        print("\n" + report)
    steady = [walls[t] for t in range(7, 21)]
    print(f"\nsteady steps 7–20: median {statistics.median(steady):.1f} ms; cycle 7–26 mean {statistics.fmean(walls[t] for t in range(7, 27)):.1f} ms")


if __name__ == "__main__":
    main()
