"""Decoupled weight decay λ for a run of T steps at learning rate lr: ``weight_decay: auto`` in a recipe.

Decoupled decay (AdamW, SM3 here) shrinks every value by (1 − lr_t·λ) per step, e^(−λ·Σ lr_t) over a run:
about e^(−λ·lr·T/2) under a linear decay of the rate. SpIEL-AG relies on it (its drop criterion is |φ|: decay
pulls the values of unused weights towards 0). λ = 3 (λ·lr = 3e-3 per step at lr 1e-3, the paper's rate per step)
suits runs up to a few hundred steps; over longer runs the total shrink grows with T and costs quality
(BENCHMARKS.md, Quality: 1,000 steps on the skills set at λ = 3 fell below LoRA). The rule holds λ·lr·T at 1
beyond the point where λ = 3 would pass it:

    λ = min(3, 1 / (lr · T))

3 at T = 60 and 150 (lr 1e-3), 1.67 at 600, 1.0 at 1,000: the values behind the quality table's rows.
"""

from __future__ import annotations

import math

MAX_WEIGHT_DECAY = 3.0


def auto_weight_decay(learning_rate: float, total_steps: int) -> float:
    """λ = min(3, 1 / (learning_rate · total_steps)) (see the module's text)."""
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)) or not (math.isfinite(learning_rate) and learning_rate > 0):
        raise ValueError(f"weight_decay='auto' needs a positive finite learning rate, got learning_rate={learning_rate!r}")
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps <= 0:
        raise ValueError(f"weight_decay='auto' needs the run's length as a positive step count, got total_steps={total_steps!r}")
    return min(MAX_WEIGHT_DECAY, 1.0 / (learning_rate * total_steps))
