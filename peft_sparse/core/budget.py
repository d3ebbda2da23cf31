"""Trainable-weight budget: ``density`` or ``num_tunable_weights`` → exact per-tensor counts.

``budget_split="uniform"`` gives every targeted tensor the same density (thesis §7.3, footnote 2):
tensor *i* with :math:`n_i` elements receives the quota :math:`q_i = N n_i / \\sum_j n_j`.
``budget_split="lora"`` gives tensor *i* of shape (m, n) a quota in proportion to m + n, as LoRA's
rank r gives it r·(m + n) parameters: small matrices (attention projections of grouped-query models)
get a higher density than large ones. ``budget_split="adaptive"`` (SpIEL-AG) starts uniform and lets the
reselections move budget between tensors. A quota larger than its tensor is capped and the rest shared
among the others. Quotas are rounded by the largest-remainder method, so the counts sum to exactly
:math:`N`; remainder ties go to the tensor that comes first in model order (deterministic).
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


BUDGET_SPLITS = ("uniform", "lora", "adaptive")


def split_weights(shapes: Mapping[str, tuple], how: str) -> dict[str, int]:
    """The share each tensor's quota is proportional to: its size (uniform) or out + in (lora)."""
    if how in ("uniform", "adaptive"):  # (adaptive: uniform until a reselection moves budget)
        return {n: int(s[0]) * int(s[1]) for n, s in shapes.items()}
    if how == "lora":
        return {n: int(s[0]) + int(s[1]) for n, s in shapes.items()}
    raise ValueError(f"budget_split must be one of {BUDGET_SPLITS}, got budget_split={how!r}")


def split_budget(sizes: Mapping[str, int], budget: int, unit: int = 1, weights: Mapping[str, int] | None = None) -> dict[str, int]:
    """Split ``budget`` over tensors in proportion to ``weights`` (default: ``sizes``), largest
    remainder, exact total, no tensor above its size.

    ``sizes`` maps module names (in model order) to their number of weights; with ``unit > 1`` both
    the sizes and the result are counted in weights but allocated in whole units of ``unit``.
    """
    names = list(sizes)
    units = [sizes[n] // unit for n in names]
    shares = units if weights is None else [int(weights[n]) for n in names]
    budget_units = budget // unit
    if budget_units > sum(units):
        raise ValueError(f"budget of {budget} weights exceeds the {sum(units) * unit} weights of the targeted modules")
    counts = [0] * len(names)
    free = list(range(len(names)))  # tensors not (yet) capped at their size
    left = budget_units
    while free and left:
        total = sum(shares[i] for i in free)
        floors = {i: left * shares[i] // total for i in free}
        capped = [i for i in free if floors[i] >= units[i]]
        if capped:  # full tensors take their size; the rest is shared again among the others
            for i in capped:
                counts[i] = units[i]
                left -= units[i]
            free = [i for i in free if i not in capped]
            continue
        remainders = {i: left * shares[i] % total for i in free}
        extra = left - sum(floors.values())
        # largest remainder first; ties → earlier tensor in model order
        for rank, i in enumerate(sorted(free, key=lambda i: (-remainders[i], i))):
            counts[i] = floors[i] + (1 if rank < extra else 0)
        left = 0
    return {n: c * unit for n, c in zip(names, counts)}
