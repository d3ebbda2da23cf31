"""When SpIEL reselects and how many indices it replaces: k(i, t) (thesis Eq. 7.6 and E.1).

Optimizer steps are counted t = 1 … T. Reselections happen at t = γ, γ+S, γ+2S, … (t < T), so the
first one comes right after the first gradient-estimation window instead of after S steps; it
replaces every index (Eq. 7.6, first case). Later ones replace

* linear (Eq. 7.6):  k(i, t) = ⌊ξ · (T − t)/T · d_φ(i)⌋
* cosine (Eq. E.1):  k(i, t) = ⌊ξ/2 · (1 + cos(π t / T)) · d_φ(i)⌋

A SpIEL-AG estimation window is the γ steps ending at a reselection: steps t_r − γ + 1 … t_r.

``replacement_rounding="apportioned"`` (:func:`apportioned_replacement_counts`) replaces the per-tensor floor by
the step's total ⌊ξ(t) · Σᵢ d_φ(i)⌋ apportioned over the tensors by largest remainder: each tensor gets
⌊ξ(t) · d_φ(i)⌋ and the leftover units go to the largest fractional parts, ties taking turns from one
reselection to the next. It matters for blocks, where a tensor holds a handful of units (SmolLM2-135M at
LoRA r=16's budget in 64×64 blocks: about 10 per MLP tensor, 1 per k/v) and the per-tensor floor rounds
most k(i, t) to 0, so reselection replaces under half of what Eq. 7.6 asks in aggregate and stops early.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction


def is_reselection_step(t: int, reselection_steps: int, gradient_estimation_steps: int, total_steps: int) -> bool:
    return t >= gradient_estimation_steps and t < total_steps and (t - gradient_estimation_steps) % reselection_steps == 0


def first_reselection_step(gradient_estimation_steps: int) -> int:
    return gradient_estimation_steps


def in_estimation_window(t: int, reselection_steps: int, gradient_estimation_steps: int, total_steps: int) -> bool:
    """Whether the backward passes of optimizer step t feed the window of an upcoming reselection."""
    if t < 1:
        return False
    # the next reselection at or after t
    if t <= gradient_estimation_steps:
        next_reselection = gradient_estimation_steps
    else:
        n = math.ceil((t - gradient_estimation_steps) / reselection_steps)
        next_reselection = gradient_estimation_steps + n * reselection_steps
    return next_reselection < total_steps and next_reselection - gradient_estimation_steps < t


def replacement_count(
    t: int, total_steps: int, d_phi: int, initial_reselection_rate: float, schedule: str, gradient_estimation_steps: int,
    first_full_replacement: bool = True,
) -> int:
    """k(i, t): how many of the d_φ(i) indices of one tensor to replace at reselection step t (all of them
    at the first reselection unless ``first_full_replacement`` is off)."""
    return _replacement_count(int(t), int(total_steps), int(d_phi), float(initial_reselection_rate), schedule, int(gradient_estimation_steps),
                              bool(first_full_replacement))  # fmt: skip


@functools.lru_cache(maxsize=4096)  # (a reselection asks once per tensor, for a few distinct sizes)
def _replacement_count(
    t: int, total_steps: int, d_phi: int, initial_reselection_rate: float, schedule: str, gradient_estimation_steps: int, first_full: bool
) -> int:
    if first_full and t == first_reselection_step(gradient_estimation_steps):
        return d_phi
    return max(0, min(d_phi, math.floor(_quota(t, total_steps, d_phi, initial_reselection_rate, schedule))))


def _quota(t: int, total_steps: int, d_phi: int, initial_reselection_rate: float, schedule: str) -> Fraction:
    """ξ(t)·d_φ before rounding, at a later reselection: exact rational arithmetic on ξ as written for the linear
    schedule (so ξ=0.3 gives ⌊0.3·…⌋ and not ⌊0.2999…·…⌋), the float product for the cosine one."""
    if schedule == "linear":
        return Fraction(repr(initial_reselection_rate)) * (total_steps - t) * d_phi / total_steps
    if schedule == "cosine":
        return Fraction(initial_reselection_rate / 2 * (1 + math.cos(math.pi * t / total_steps)) * d_phi)
    raise ValueError(f"schedule={schedule!r} is not one of 'linear', 'cosine'")


def apportioned_replacement_counts(
    t: int, total_steps: int, d_phis, initial_reselection_rate: float, schedule: str, gradient_estimation_steps: int,
    first_full_replacement: bool = True, turn: int = 0,
) -> list[int]:
    """k(i, t) for every tensor of an adapter at reselection step t, in its units (weights, or blocks): the
    step's total ⌊ξ(t) · Σ d_φ⌋ split by largest remainder (see the module's help). Each tensor gets at least
    its per-tensor :func:`replacement_count` and at most one unit more, and at most its d_φ(i). ``turn`` (the
    reselection's ordinal) rotates the order in which tensors with equal remainders get a leftover unit, so none
    is always last. The first reselection replaces everything unless ``first_full_replacement`` is off."""
    d_phis = [int(d) for d in d_phis]
    if any(d < 0 for d in d_phis):
        raise ValueError(f"d_phis must be non-negative counts, got {d_phis!r}")
    t, total_steps, rate = int(t), int(total_steps), float(initial_reselection_rate)
    if first_full_replacement and t == first_reselection_step(int(gradient_estimation_steps)):
        return list(d_phis)
    quotas = [min(Fraction(d), max(Fraction(0), _quota(t, total_steps, d, rate, schedule))) for d in d_phis]
    counts = [math.floor(q) for q in quotas]
    total = min(sum(d_phis), math.floor(_quota(t, total_steps, sum(d_phis), rate, schedule)))
    n = len(d_phis)
    order = sorted((i for i in range(n) if quotas[i] > counts[i]), key=lambda i: (counts[i] - quotas[i], (i - int(turn)) % n))
    for i in order[: max(0, total - sum(counts))]:  # (a positive remainder means counts[i] < d_φ(i))
        counts[i] += 1
    return counts
