"""Trainable-weight budget: ``density`` or ``num_tunable_weights`` → exact per-tensor counts.

Every targeted tensor gets the same density (thesis §7.3, footnote 2): tensor *i* with
:math:`n_i` elements receives the quota :math:`q_i = N n_i / \\sum_j n_j`. Quotas are rounded by the
largest-remainder method, so the counts sum to exactly :math:`N`. Remainder ties go to the tensor
that comes first in model order, which makes the split deterministic.
"""

from __future__ import annotations

from collections.abc import Mapping


def total_budget(total_weights: int, density: float | None, num_tunable_weights: int | None, unit: int = 1) -> int:
    """Total number of tunable weights implied by the config, validated against the targeted size.

    ``unit`` is the granularity (block size in weights) the budget must be a multiple of.
    """
    if total_weights <= 0:
        raise ValueError(f"the targeted modules hold no weights (total_weights={total_weights})")
    if num_tunable_weights is not None:
        if num_tunable_weights > total_weights:
            raise ValueError(
                f"num_tunable_weights={num_tunable_weights} exceeds the {total_weights} weights of the targeted modules"
            )
        budget = num_tunable_weights
        if budget % unit:
            raise ValueError(f"num_tunable_weights={budget} is not a multiple of the block size {unit}")
        return budget
    # density: the nearest whole number of weights (of blocks, when selecting blocks)
    budget = int(density * total_weights / unit + 0.5) * unit
    if budget < unit:
        raise ValueError(
            f"density={density} of the {total_weights} targeted weights leaves no whole "
            f"{'weight' if unit == 1 else f'block of {unit} weights'}; raise density"
        )
    return budget


def split_budget(sizes: Mapping[str, int], budget: int, unit: int = 1) -> dict[str, int]:
    """Split ``budget`` over tensors in proportion to ``sizes`` (largest remainder, exact total).

    ``sizes`` maps module names (in model order) to their number of weights; with ``unit > 1`` both
    the sizes and the result are counted in weights but allocated in whole units of ``unit``.
    """
    names = list(sizes)
    units = [sizes[n] // unit for n in names]
    total_units = sum(units)
    budget_units = budget // unit
    if budget_units > total_units:
        raise ValueError(f"budget of {budget} weights exceeds the {total_units * unit} weights of the targeted modules")
    floors = [budget_units * u // total_units for u in units]
    remainders = [budget_units * u % total_units for u in units]
    left = budget_units - sum(floors)
    # largest remainder first; ties → earlier tensor in model order
    order = sorted(range(len(names)), key=lambda i: (-remainders[i], i))
    for i in order[:left]:
        floors[i] += 1
    return {n: f * unit for n, f in zip(names, floors)}
