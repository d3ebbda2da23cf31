"""Host time of steady steps with layers that read one input grouped into one autograd node, against the
same layers alone (``SparseLayer.group_shared_inputs``), in one process, alternating blocks of steps so
that both see the same host.

    python benchmarks/host_groups.py spiel-ma-block [--steps 10] [--blocks 10] [--size tinyllama]

After :func:`host_steps.steady_setup`'s warm-up, each block runs ``--steps`` steady steps (each followed by a
synchronisation, so the host is never held back by a full launch queue) in one mode, the next block in the
other. It prints per mode the median host time of each phase, the median step and the number of
sparse autograd nodes of one step's graph.
"""

import statistics
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import PHASES  # noqa: E402
from host_steps import steady_setup, steady_steps  # noqa: E402

from peft_sparse import SparseLayer  # noqa: E402


def graph_nodes(model, ids) -> dict:
    """Sparse autograd node type → count in one training pass's graph (the pass is then dropped)."""
    loss = model(input_ids=ids, labels=ids).loss
    counts, stack, seen = {}, [loss.grad_fn], {}
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        name = type(node).__name__
        if "Linear" in name:
            counts[name] = counts.get(name, 0) + 1
        stack.extend(f for f, _ in node.next_functions)
    return counts


def main():
    blocks = 10
    if "--blocks" in sys.argv:
        i = sys.argv.index("--blocks")
        blocks = int(sys.argv[i + 1])
        del sys.argv[i : i + 2]
    steps, args, model, optimizer, hook, ids = steady_setup(10)
    layers = [m for m in model.modules() if isinstance(m, SparseLayer)]
    results = {True: ([], []), False: ([], [])}
    nodes = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the unscheduled-training guard: the scheduler is paused on purpose)
        for block in range(2 * blocks):
            grouped = block % 2 == 0
            for layer in layers:
                layer.group_shared_inputs = grouped
            steady_steps(model, optimizer, ids, 2)  # (the first pass after a switch finds the groups again)
            if grouped not in nodes:
                nodes[grouped] = graph_nodes(model, ids)
                steady_steps(model, optimizer, ids, 1)
            phases, walls = steady_steps(model, optimizer, ids, steps)
            results[grouped][0].extend(phases)
            results[grouped][1].extend(walls)
    print(f"{torch.cuda.get_device_name()}: {args.variant}, {blocks} blocks of {steps} steady steps per mode")
    for grouped in (True, False):
        phases, walls = results[grouped]
        host = {name: statistics.median(p[i] for p in phases) * 1e3 for i, name in enumerate(PHASES)}
        print(f"  {'grouped' if grouped else 'alone  '}: median step {statistics.median(walls) * 1e3:.1f} ms; host per phase (median ms): "
              + ", ".join(f"{k} {v:.2f}" for k, v in host.items()) + f"; nodes {nodes[grouped]}")  # fmt: skip


if __name__ == "__main__":
    main()
