"""Which threads of the process spend the host time of steady training steps, and how much of the
backward pass is the sparse layers' own Python (GPU host).

    python benchmarks/host_threads.py spiel-ma-block [--steps 30] [--size tinyllama]

After 7 warm-up steps it runs ``--steps`` steady steps (the SpIEL scheduler no longer stepped, as in
``host_steps.py``), each followed by a synchronisation, twice: as they run, then with the interpreter's
thread switch interval at 50 µs instead of 5 ms (a thread waiting for the GIL held by another waits up
to one interval). For each it prints the median step and host time per phase and, per thread of the
process (Linux ``/proc/self/task``), the CPU time and context switches over the steps. For the sparse
variants it also prints the host time spent inside the layers' backward functions per step, measured
around each call, and the host time between the end of one such call and the start of the next.
The script imports ``bench_step.py`` beside it, which puts its own tree first on the import path: to
compare two trees, run each tree's copy of the scripts.
"""

import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/ and the repository
from bench_step import PHASES, train_step  # noqa: E402
from host_steps import steady_setup  # noqa: E402


def thread_counters() -> dict:
    """{tid: (name, user+system CPU seconds, voluntary, involuntary context switches)} for this process."""
    ticks = float(os.sysconf("SC_CLK_TCK"))  # (Linux: the unit of /proc's CPU times)
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            status = (task / "status").read_text().splitlines()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        switches = {line.split(":")[0]: int(line.split()[1]) for line in status if "ctxt_switches" in line}
        out[int(task.name)] = (name, cpu, switches.get("voluntary_ctxt_switches", 0), switches.get("nonvoluntary_ctxt_switches", 0))
    return out


class BackwardTimer:
    """Wraps the sparse autograd functions' backward with host timers (two clock reads per call)."""

    def __init__(self):
        from peft_sparse.core import functional

        self.calls = []  # (start, end) per call, perf_counter seconds
        self.originals = {}
        # (GivenWeightLinear's backward calls SparseDeltaLinear's; MergedDeltaLinear's hands over to it only
        # in AG windows and after a merge was written back, which steady steps never see)
        for cls in (functional.SparseDeltaLinear, functional.MergedDeltaLinear):
            original = cls.__dict__["backward"]
            self.originals[cls] = original
            cls.backward = staticmethod(self._wrap(original.__func__))

    def _wrap(self, backward):
        calls = self.calls
        clock = time.perf_counter

        def timed(ctx, *grads):
            start = clock()
            out = backward(ctx, *grads)
            calls.append((start, clock()))
            return out

        return timed


def run(model, optimizer, ids, steps: int, timer):
    before = thread_counters()
    phases, walls, inside, between = [], [], [], []
    for _ in range(steps):
        if timer is not None:
            timer.calls.clear()
        start = time.perf_counter()
        phases.append(train_step(model, optimizer, None, ids))
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
        if timer is not None and timer.calls:
            calls = sorted(timer.calls)
            inside.append(sum(b - a for a, b in calls))
            between.append(sum(max(0.0, c[0] - p[1]) for p, c in zip(calls, calls[1:])))
    after = thread_counters()
    print(f"  median step {statistics.median(walls) * 1e3:.1f} ms (min {min(walls) * 1e3:.1f}, max {max(walls) * 1e3:.1f}); host per phase (median ms): "
          + ", ".join(f"{name} {statistics.median(p[i] for p in phases) * 1e3:.1f}" for i, name in enumerate(PHASES)))  # fmt: skip
    if inside:
        print(f"  sparse backward functions per step: {len(timer.calls)} calls, {statistics.median(inside) * 1e3:.1f} ms inside them, "
              f"{statistics.median(between) * 1e3:.1f} ms from one call's end to the next one's start (median)")  # fmt: skip
    print("  threads (CPU ms per step, voluntary / involuntary context switches per step):")
    for tid, (name, cpu, vol, invol) in sorted(after.items(), key=lambda kv: -(kv[1][1] - before.get(kv[0], (None, 0.0))[1])):
        was = before.get(tid, (name, 0.0, 0, 0))
        used = (cpu - was[1]) / steps * 1e3
        if used > 0.05 or invol - was[3] > 0:
            print(f"    {tid:>8} {name:<16} {used:7.1f} ms  {(vol - was[2]) / steps:7.1f} / {(invol - was[3]) / steps:5.1f}")


def main():
    steps, args, model, optimizer, hook, ids = steady_setup(30)
    timer = BackwardTimer() if not args.variant.endswith("floor") else None
    print(f"{torch.cuda.get_device_name()}: {args.variant}, {steps} steady steps, {len(thread_counters())} threads")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the unscheduled-training guard: the scheduler is paused on purpose)
        for interval in (sys.getswitchinterval(), 5e-5):
            sys.setswitchinterval(interval)
            print(f"switch interval {interval * 1e3:g} ms:")
            run(model, optimizer, ids, steps, timer)


if __name__ == "__main__":
    main()
