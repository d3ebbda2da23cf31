"""The check that a run's learning rate anneals: sparse values trained at a constant rate end up far worse.

A sparse delta's values take Adam steps of about the learning rate each, every step, to the last one. On the
quality benchmark's dev family ``skills2`` a constant 1e-3 cost a fixed mask 8.5 points of exact match against
linear decay on one seed and gained it 4 on another (docs/quality-families.md): the cost is real but uneven.
:func:`warn_if_rate_not_decayed` runs at every optimizer step of a SpIEL run (``SpIELScheduler.step``, and so
under ``SpIELCallback`` too) and warns once when, at the middle of the run, the rate is still at least 90% of
its peak.
"""

from __future__ import annotations

import warnings
import weakref

DECAYED_BELOW = 0.9  # (a rate at or above this fraction of its peak at the middle of the run has not decayed)
MIN_STEPS = 10  # (shorter runs are smoke tests: not checked)

# optimizer → the peak rate of each param group seen so far, or None once checked (weakly held: dies with it)
_PEAKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def warn_if_rate_not_decayed(optimizer, step: int, total_steps: int) -> None:
    """Call after optimizer step ``step`` (1 … ``total_steps``). Tracks each param group's peak ``lr`` (and the
    ``initial_lr`` a torch LR scheduler records) and, at step ⌈total_steps / 2⌉, warns once per optimizer when a
    group with a positive rate still runs at ≥ 90% of its peak. Runs of fewer than 10 steps are not checked."""
    if total_steps < MIN_STEPS:
        return
    try:
        peaks = _PEAKS.setdefault(optimizer, [0.0] * len(optimizer.param_groups))
    except TypeError:  # (an optimizer object that takes no weak reference: nothing to remember it by)
        return
    if peaks is None:
        return
    rates = [float(g["lr"]) for g in optimizer.param_groups]
    if len(peaks) != len(rates):  # (groups added since: their peaks start here)
        peaks += [0.0] * (len(rates) - len(peaks))
    for i, (group, rate) in enumerate(zip(optimizer.param_groups, rates)):
        peaks[i] = max(peaks[i], rate, float(group.get("initial_lr", 0.0)))
    middle = (total_steps + 1) // 2
    if step < middle:
        return
    _PEAKS[optimizer] = None
    if step > middle:  # (first seen past the middle: a resumed run whose peak is unknown here)
        return
    flat = [(rate, peak) for rate, peak in zip(rates, peaks) if rate > 0 and rate >= DECAYED_BELOW * peak]
    if not flat:
        return
    rate, peak = flat[0]
    warnings.warn(
        f"SpIEL: the learning rate has not decayed by the middle of the run (step {step} of {total_steps}: lr {rate:g}, "
        f"{100 * rate / peak:.0f}% of its peak {peak:g}). Sparse values need an annealed rate: at a constant rate they "
        "can end far below linear decay (docs/quality-families.md). With a Trainer or SFTTrainer keep "
        "lr_scheduler_type='linear' (the default) or 'cosine'; in your own loop step a decaying schedule after each "
        "optimizer step, e.g. transformers.get_linear_schedule_with_warmup(optimizer, warmup_steps, total_steps). If the "
        "rate must stay constant, a smaller one loses less. A schedule that decays only later in the run "
        "(warmup-stable-decay) is outside this check.",
        UserWarning,
        stacklevel=3,
    )
