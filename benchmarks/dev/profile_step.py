"""Where a steady training step's time goes (GPU): kernels, idle gaps, host issue time, syncs, allocator.

    python benchmarks/profile_step.py spiel-ma [--rows 25] [--size tinyllama]

After 7 warm-up steps (SpIEL: the first reselection at step 5 and the kernels' compilation are
behind it; the next window starts at step 21, so every measured step is a steady one), it prints:

* the memory the forward holds for backward;
* over 8 steps (13–20), the wall time per step and the host's issue time (until the step's Python returns,
  before synchronising): when the two are close, the GPU waits for the host; and the Python garbage
  collections that ran in each step, with their generation and duration;
* host-device synchronisations of one step (``torch.cuda.set_sync_debug_mode``) and the caching
  allocator's device allocations, frees and retries over those steps (each cudaFree synchronises);
* under the profiler, 3 steps: the sum of GPU kernel times per step (wall − kernels = GPU idle) and
  the top kernels;
* the host issue time split into forward, backward, optimizer and scheduler hook; and, under cProfile
  over 2 more steady steps, the Python functions with the most host time of their own.
"""

import cProfile
import gc
import io
import pstats
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/ and the repository
from bench_step import PHASES, phase_ends, profiling_setup, train_step  # noqa: E402

WARMUP = 7
STEADY_STEPS = 6  # steps 13–18, then 2 under cProfile: all before the next window (21) and reselection (25)
CPROFILE_STEPS = 2
_ALLOCATOR_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def main():
    args, model, optimizer, hook, ids = profiling_setup(rows=25)

    def step():
        train_step(model, optimizer, hook, ids)

    phases = {name: [] for name in PHASES}  # host time of each phase
    host_done = {name: [] for name in PHASES}  # phase_ends, per phase
    gpu_done = {name: [] for name in PHASES}

    def timed_step():  # step() with phase events; returns (host time of each phase, the events to read after a sync)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(PHASES) + 1)]
        events[0].record()
        return train_step(model, optimizer, hook, ids, phase_events=events[1:]), events

    def record(issued, events):
        for name, seconds, host, gpu in zip(PHASES, issued, *phase_ends(issued, events)):
            phases[name].append(seconds)
            host_done[name].append(host)
            gpu_done[name].append(gpu)

    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    loss = model(input_ids=ids, labels=ids).loss
    saved = torch.cuda.memory_allocated() - base
    loss.backward()
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    print(f"{args.variant}: resident before forward {base / 2**30:.2f} GiB, held by the forward for backward {saved / 2**30:.2f} GiB")

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        step()
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchronizing CUDA operation" in str(w.message)]
    print(f"host-device synchronisations in one step: {len(syncs)}")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # where the first one is: its Python stack
    try:
        step()
    except RuntimeError as error:
        frames = [f for f in traceback.extract_tb(error.__traceback__) if "site-packages/torch/" not in f.filename]
        print("  the first one, innermost frames last:")
        for f in frames[-6:]:
            print(f"    {f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}: {f.line}")
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    profiled_wall = (time.perf_counter() - start) / 3 * 1e3
    events = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events) / 3 / 1e3
    cpu = sum(e.self_cpu_time_total for e in events) / 3 / 1e3
    launches = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA) // 3
    print(f"per step (profiled): {launches} kernels, profiled wall {profiled_wall:.1f} ms, CPU ops {cpu:.1f} ms; "
          f"device time summed over ops and kernels (kernels count twice) {total:.1f} ms")  # fmt: skip
    for e in events[: args.rows]:
        print(f"  {e.self_device_time_total / 3 / 1e3:8.2f} ms/step  {e.count // 3:6d}×  {e.key[:90]}")
    if args.kernel_table:  # every GPU kernel, to compare variants
        with open(args.kernel_table, "w") as f:
            for e in events:
                if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0:
                    f.write(f"{e.self_device_time_total / 3 / 1e3:.4f}\t{e.count // 3}\t{e.key}\n")

    gc_log = []  # (generation, seconds) of every garbage collection
    gc_start = {}

    def on_gc(phase, info):
        if phase == "start":
            gc_start["t"] = time.perf_counter()
        else:
            gc_log.append((info["generation"], time.perf_counter() - gc_start.pop("t", time.perf_counter())))

    gc.callbacks.append(on_gc)
    stats0 = torch.cuda.memory_stats()
    walls, issues, gc_per_step = [], [], []
    for _ in range(STEADY_STEPS):
        torch.cuda.synchronize()
        seen = len(gc_log)
        start = time.perf_counter()
        issued, events = timed_step()
        issues.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
        record(issued, events)
        gc_per_step.append(gc_log[seen:])
    gc.callbacks.remove(on_gc)
    stats1 = torch.cuda.memory_stats()
    counts = {k: stats1.get(k, 0) - stats0.get(k, 0) for k in _ALLOCATOR_KEYS}
    print(f"wall per step {statistics.median(walls) * 1e3:.1f} ms (min {min(walls) * 1e3:.1f}, max {max(walls) * 1e3:.1f}); "
          f"host issue time {statistics.median(issues) * 1e3:.1f} ms (max {max(issues) * 1e3:.1f})")  # fmt: skip
    print(f"allocator over {STEADY_STEPS} steps: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    print("per step: wall ms / garbage collections (generation: ms)")
    for w, g in zip(walls, gc_per_step):
        print(f"  {w * 1e3:6.1f}  " + " ".join(f"{gen}:{sec * 1e3:.1f}" for gen, sec in g))
    print("host issue time per phase (median ms): " + ", ".join(f"{k} {statistics.median(v) * 1e3:.1f}" for k, v in phases.items()))
    # the GPU reaching a phase's end shortly after the host issued it: that phase waited for the host
    print("end of each phase from the step's start, host issued / GPU done (median ms): " + ", ".join(
        f"{k} {statistics.median(host_done[k]) * 1e3:.1f} / {statistics.median(gpu_done[k]) * 1e3:.1f}" for k in phases))  # fmt: skip

    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(CPROFILE_STEPS):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    if args.pstats:
        profiler.dump_stats(args.pstats)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(args.rows)
    stats.sort_stats("cumulative").print_stats("peft_sparse|torch/optim|autograd", args.rows)
    print(f"cProfile over {CPROFILE_STEPS} steady steps (host time of each function itself; cProfile slows Python calls):")
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip() and "Ordered by" not in line and "List reduced" not in line))


if __name__ == "__main__":
    main()
