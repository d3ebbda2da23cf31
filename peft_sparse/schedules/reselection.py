"""When SpIEL reselects and how many indices it replaces: k(i, t) (thesis Eq. 7.6 and E.1).

Optimizer steps are counted t = 1 … T. Reselections happen at t = γ, γ+S, γ+2S, … (t < T), so the
first one comes right after the first gradient-estimation window instead of after S steps; it
replaces every index (Eq. 7.6, first case). Later ones replace

* linear (Eq. 7.6):  k(i, t) = ⌊ξ · (T − t)/T · d_φ(i)⌋
* cosine (Eq. E.1):  k(i, t) = ⌊ξ/2 · (1 + cos(π t / T)) · d_φ(i)⌋

A SpIEL-AG estimation window is the γ steps ending at a reselection: steps t_r − γ + 1 … t_r.

The authors' released code (``SpIELConfig(reference="authors")``) differs in three places, each a function
here: k(t) is ``int(d · ξ·(1 − t/T))`` in floating point (:func:`released_replacement_count`; Eq. E.1's
cosine in the same way, with no full first replacement), and each window after the first opens after step
kS − 1, so it is the γ + 1 steps kS … kS + γ (:func:`released_in_estimation_window`).
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


def released_in_estimation_window(t: int, reselection_steps: int, gradient_estimation_steps: int, total_steps: int) -> bool:
    """:func:`in_estimation_window` as the authors' released trainer arms its windows: the first is steps 1 … γ, each
    later one opens after step kS − 1, so it is the γ + 1 steps kS … kS + γ (its candidates come from step kS)."""
    if t < 1:
        return False
    S, gamma = reselection_steps, gradient_estimation_steps
    reselection = gamma if t <= gamma else t // S * S + gamma
    return reselection < total_steps and (t <= gamma or t % S <= gamma)


def released_replacement_count(t: int, total_steps: int, d_phi: int, initial_reselection_rate: float, schedule: str,
                               gradient_estimation_steps: int) -> int:
    """k(i, t) as the authors' released code computes it, ``int(d · p)`` with p in floating point: linear, p = 1 at the
    first reselection (t = γ) and ξ·(1 − t/T) after it; cosine, p = ξ·(1 + cos(πt/T))/2 at every reselection, the
    first included (Eq. E.1 with no full first replacement)."""
    xi = float(initial_reselection_rate)
    if schedule == "linear":
        p = 1 if t == gradient_estimation_steps else xi * (1 - t / total_steps)
    elif schedule == "cosine":
        p = xi * (1 + math.cos(math.pi * t / total_steps)) / 2
    else:
        raise ValueError(f"schedule={schedule!r} is not one of 'linear', 'cosine'")
    return max(0, min(d_phi, int(d_phi * p)))


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
