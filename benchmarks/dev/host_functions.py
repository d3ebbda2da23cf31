"""Host time of steady training steps, per phase and per function of the sparse layers' path (GPU host).

    python benchmarks/host_functions.py spiel-ma-block [--steps 12] [--rounds 2] [--size tinyllama]

After 7 warm-up steps (``host_steps.py``'s setup: the SpIEL scheduler held, not stepped, so every step is
a steady one), it runs ``--rounds`` rounds of ``--steps`` steps, each followed by a synchronisation. Each
round prints the median host time of the forward pass, the backward pass, the optimizer step and
``zero_grad``, the median step, and for each function below its host time per step, its calls per step
and its time per call. A wrapper around each function takes its real time (about a microsecond per call
of the wrapper's own is included; nested functions count in their callers too). ``F.linear`` is timed in
every variant, so the floor's calls (inside ``nn.Linear``) compare with the sparse layers' ones.

Round s24 of ``BENCHMARKS.md`` used it to find where a sparse layer call's host time goes. The script
imports ``bench_step.py`` beside it, which puts its own tree first on the import path: to compare two
trees, run each tree's copy of the scripts.
"""

import functools
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/ and the repository
from host_steps import steady_setup  # noqa: E402

_CLOCK = time.perf_counter


def timed(owner, name: str, label: str, totals: dict, static: bool = False) -> None:
    """Replace ``owner.name`` by a wrapper adding each call's time and count to ``totals[label]``."""
    function = getattr(owner, name)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        start = _CLOCK()
        try:
            return function(*args, **kwargs)
        finally:
            entry = totals.setdefault(label, [0.0, 0])
            entry[0] += _CLOCK() - start
            entry[1] += 1

    setattr(owner, name, staticmethod(wrapper) if static else wrapper)


def wrap_functions(totals: dict) -> None:
    from peft_sparse.accel import input_rebuild as rebuilds
    from peft_sparse.accel import internals
    from peft_sparse.core import functional, kernels
    from peft_sparse.core import layer as layer_module
    from peft_sparse.accel import triton_kernels
    from peft_sparse.optim import sm3

    timed(F, "linear", "F.linear", totals)
    timed(rebuilds, "input_rebuild", "input_rebuild (forward)", totals)
    timed(rebuilds, "_new_rebuild", "_new_rebuild (a new record)", totals)
    timed(rebuilds.InputRebuild, "get", "InputRebuild.get (backward)", totals)
    timed(rebuilds.InputRebuild, "factors", "InputRebuild.factors", totals)
    timed(functional, "_chosen_block", "_chosen_block", totals)
    timed(functional, "_value_gradient", "_value_gradient", totals)
    timed(kernels, "block_value_gradient", "block_value_gradient", totals)
    timed(triton_kernels.LaunchPlan, "__call__", "LaunchPlan.__call__", totals)
    timed(sm3._SteadyStep, "run", "SM3 steady step", totals)
    timed(functional.MergedDeltaLinear, "forward", "MergedDeltaLinear.forward", totals, static=True)
    timed(functional.MergedDeltaLinear, "backward", "MergedDeltaLinear.backward", totals, static=True)
    # the lean forward's apply, rebuilt around the timed forward (its direct apply binds the class's methods)
    layer_module.merged_apply = internals.direct_apply(functional.MergedDeltaLinear, fixed=True)
    timed(layer_module, "merged_apply", "merged_apply (apply and forward)", totals)


def main():
    rounds = 2
    if "--rounds" in sys.argv:
        i = sys.argv.index("--rounds")
        rounds = int(sys.argv[i + 1])
        del sys.argv[i : i + 2]
    steps, args, model, optimizer, hook, ids = steady_setup(12)  # (hook held: the scheduler lives, not stepped)
    totals: dict = {}
    wrap_functions(totals)
    clock = _CLOCK
    for r in range(rounds):
        totals.clear()
        rows = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the unscheduled-training guard: the scheduler is paused on purpose)
            for _ in range(steps):
                torch.cuda.synchronize()
                t0 = clock()
                loss = model(input_ids=ids, labels=ids).loss
                t1 = clock()
                loss.backward()
                t2 = clock()
                if optimizer is not None:
                    optimizer.step()
                t3 = clock()
                if optimizer is not None:
                    optimizer.zero_grad(set_to_none=True)
                t4 = clock()
                torch.cuda.synchronize()
                rows.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, clock() - t0))
        forward, backward, step, zero, wall = (statistics.median(row[k] for row in rows) * 1e3 for k in range(5))
        print(f"{torch.cuda.get_device_name()}: {args.variant}, round {r + 1}: host forward {forward:.2f} ms, backward "
              f"{backward:.2f}, optimizer step {step:.2f}, zero_grad {zero:.2f}; median step {wall:.2f} ms")  # fmt: skip
        for label, (seconds, calls) in sorted(totals.items(), key=lambda item: -item[1][0]):
            print(f"   {label:<34} {seconds / steps * 1e3:7.2f} ms/step {calls / steps:7.1f} calls/step "
                  f"{seconds / calls * 1e6:8.1f} µs/call", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
