"""Steady training steps of one variant at the benchmark's shapes, with the host time of each phase: a run
to attach a sampling profiler to (its stacks filtered on :func:`steady_steps`). (``py-spy record --native``
at 250 Hz did not finish within 170 s around it on an H100 host: BENCHMARKS.md, round s18.)

    python benchmarks/host_steps.py spiel-ma [--steps 60] [--size tinyllama]

After 7 warm-up steps (SpIEL: the first reselection and the kernels' compilation behind it), it runs
``--steps`` steps inside :func:`steady_steps` with the SpIEL scheduler no longer stepped, so that no window or
reselection comes (every step a steady one; a sampler's stacks are filtered on that function's name),
each followed by a synchronisation. It prints the median host time of each phase and the median step.
"""

import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/ and the repository
from bench_step import PHASES, profiling_setup, train_step  # noqa: E402

WARMUP = 7


def steady_steps(model, optimizer, ids, steps: int) -> tuple[list, list]:
    phases, walls = [], []
    for _ in range(steps):
        start = time.perf_counter()
        phases.append(train_step(model, optimizer, None, ids))
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    return phases, walls


def steady_setup(steps: int) -> tuple:
    """The command line (``--steps``, default ``steps``; then :func:`profiling_setup`'s) and a prepared
    variant after the warm-up steps: (steps, args, model, optimizer, per-step hook, input ids). The caller
    holds the hook (a SpIEL scheduler's ``step``) without calling it: while the scheduler lives, its layers'
    training observers stay idle, as in training."""
    if "--steps" in sys.argv:
        i = sys.argv.index("--steps")
        steps = int(sys.argv[i + 1])
        del sys.argv[i : i + 2]
    args, model, optimizer, hook, ids = profiling_setup(rows=0)
    for _ in range(WARMUP):
        train_step(model, optimizer, hook, ids)
    torch.cuda.synchronize()
    return steps, args, model, optimizer, hook, ids


def main():
    steps, args, model, optimizer, hook, ids = steady_setup(60)  # (hook held: the scheduler lives, not stepped)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the unscheduled-training guard: the scheduler is paused on purpose)
        phases, walls = steady_steps(model, optimizer, ids, steps)
    host = {name: statistics.median(p[i] for p in phases) * 1e3 for i, name in enumerate(PHASES)}
    print(f"{torch.cuda.get_device_name()}: {args.variant}, {steps} steady steps: median step {statistics.median(walls) * 1e3:.1f} ms; "
          "host per phase (median ms): " + ", ".join(f"{k} {v:.1f}" for k, v in host.items()))  # fmt: skip


if __name__ == "__main__":
    main()
