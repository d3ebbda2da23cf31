"""Decoupled weight decay λ for a run of T steps at learning rate lr: ``weight_decay: auto`` in a recipe.

Decoupled decay (AdamW, SM3 here) shrinks every value by (1 − lr_t·λ) per step, e^(−λ·Σ lr_t) over a run.
SpIEL-AG relies on it (its drop criterion is |φ|: decay pulls the values of unused weights towards 0). Write the
schedule's sum of rates as Σ lr_t = m·lr·T, with m the schedule's mean rate as a fraction of its peak:

    linear decay to 0, or cosine, each after a linear warm-up of any length:  m = 1/2
    constant:                                                                m = 1
    constant after a linear warm-up of w steps:                              m = 1 − w/(2T)

Under linear decay, λ = 3 (λ·lr = 3e-3 per step at lr 1e-3, the paper's rate per step) suits runs up to a few
hundred steps; over longer runs the total shrink grows with T and costs quality (BENCHMARKS.md, Quality: 1,000
steps on the skills set at λ = 3 fell below LoRA). The rule holds λ·lr·T at 1 beyond the point where λ = 3 would
pass it, and gives any other schedule the same total shrink λ·Σ lr_t as linear decay would:

    λ = min(3, 1 / (lr · T)) · 1 / (2m)

Linear decay (m = 1/2): 3 at T = 60 and 150 (lr 1e-3), 1.67 at 600, 1.0 at 1,000 — the values behind the quality
table's rows. A constant rate (m = 1) gets half of that: 1.5 at 150 steps.
"""

from __future__ import annotations

import math

MAX_WEIGHT_DECAY = 3.0
# schedules (transformers' lr_scheduler_type names) with a closed-form mean rate m
SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")


def schedule_mean_rate(schedule: str, total_steps: int, warmup_steps: int = 0) -> float:
    """m = Σ_t lr_t / (lr · T) of ``schedule`` over ``total_steps`` with ``warmup_steps`` of linear warm-up."""
    if schedule not in SCHEDULES:
        raise ValueError(
            f"weight_decay='auto' knows the schedules {list(SCHEDULES)}, got schedule={schedule!r}; give the weight decay as a number"
        )
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps must be an integer in [0, total_steps={total_steps}], got warmup_steps={warmup_steps!r}")
    if schedule in ("linear", "cosine"):  # (warm-up and decay each average half the peak)
        return 0.5
    if schedule == "constant":
        return 1.0
    return 1.0 - warmup_steps / (2 * total_steps)


def auto_weight_decay(learning_rate: float, total_steps: int, schedule: str = "linear", warmup_steps: int = 0) -> float:
    """λ = min(3, 1 / (learning_rate · total_steps)) / (2m), m the schedule's mean rate (see the module's text);
    ``schedule`` is a ``lr_scheduler_type`` of transformers: ``linear`` (the default), ``cosine``, ``constant`` or
    ``constant_with_warmup`` (after ``warmup_steps`` steps of warm-up)."""
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)) or not (math.isfinite(learning_rate) and learning_rate > 0):
        raise ValueError(f"weight_decay='auto' needs a positive finite learning rate, got learning_rate={learning_rate!r}")
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps <= 0:
        raise ValueError(f"weight_decay='auto' needs the run's length as a positive step count, got total_steps={total_steps!r}")
    mean_rate = schedule_mean_rate(schedule, total_steps, warmup_steps)
    return min(MAX_WEIGHT_DECAY, 1.0 / (learning_rate * total_steps)) / (2 * mean_rate)
