"""Host time of putting a small host-side table (a few hundred integers) on the GPU while the GPU is busy.

    python benchmarks/micro_tables.py

Reselections and kernel plans need small tables (sizes, offsets, addresses). Ways timed, each 20 times
behind ~50 ms of queued GPU work, host time per table (µs):

* ``pageable``: ``torch.tensor(values, device="cuda")`` — a copy from pageable memory waits for the queue;
* ``pinned``: ``kernels.table`` — ``pin_memory()`` then an asynchronous copy;
* ``arena``: ``kernels.table`` if it stages through a reused pinned buffer (see the code).
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/ and the repository
from peft_sparse.core import kernels  # noqa: E402


def busy(a):
    for _ in range(40):
        a = a @ a
        a = a / a.norm()
    return a


def main():
    a = torch.randn(4096, 4096, device="cuda")
    values = list(range(300))
    ways = {
        "pageable": lambda: torch.tensor(values, device="cuda"),
        "pinned": lambda: kernels.table(values, torch.device("cuda")),
    }
    print(torch.cuda.get_device_name())
    for name, make in ways.items():
        for label in ("first round", "later rounds"):
            times = []
            for _ in range(5 if label == "later rounds" else 1):
                busy(a)
                start = time.perf_counter()
                for _ in range(20):
                    make()
                times.append((time.perf_counter() - start) / 20 * 1e6)
                torch.cuda.synchronize()
            print(f"  {name:<10} {label:<13} {statistics.median(times):9.1f} µs per table")


if __name__ == "__main__":
    main()
