"""The host's speed as a benchmark process sees it (``bench_step.py`` and ``trainer_step.py`` record it with their runs)."""

from __future__ import annotations

import statistics
import time


def host_probe_us() -> float:
    """The host's speed as this process sees it: µs per iteration of a fixed loop of plain Python (dict
    lookups, attribute reads, calls, no tensor), the median of 5 repeats. Two variants' processes on the same
    host compare by it: a run whose probe is slower waited on a slower host, not on more work of its own."""

    class Probe:
        def __init__(self):
            self.value = 1

        def read(self, key):
            return self.value + key

    table, item = {i: i for i in range(64)}, Probe()
    repeats = []
    for _ in range(5):
        start = time.perf_counter()
        total = 0
        for i in range(20_000):
            total += item.read(table.get(i & 63, 0))
        repeats.append((time.perf_counter() - start) / 20_000 * 1e6)
    return statistics.median(repeats)
