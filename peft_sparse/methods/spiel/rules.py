"""The authors' released rules, one name per row of ``docs/differences.md`` ("The released code and this library").

``reference="authors"`` runs every rule. To measure what one row changes, the quality benchmark runs the defaults
with a single rule switched on (``benchmarks/quality.py --released-rule NAME``) through :func:`with_released_rules`:
an ablation of the benchmark, not a setting, so it is not saved with the config.

=================  ===========================================================================================
rule               the released code's behaviour
=================  ===========================================================================================
``budget``         the budget split over the targeted tensors by size, a floor per tensor (``released_budget``)
``count``          k(t) as ``int(d · ξ·(1 − t/T))`` in floating point
``windows``        later windows of γ + 1 steps, opened after step kS − 1
``cosine_first``   no full first replacement with the cosine schedule
``keep_regrown``   AG: a dropped index grown again at the same reselection keeps its value and Adam state
``no_regrowth``    MA: a dropped index is never grown again at that reselection
``seeds``          AG: both Adam moments of grown weights seeded at the reselection from the raw window averages
                   (micro-batch means), each weight's age in the bias correction (needs ``peft_sparse.AgedAdamW``)
=================  ===========================================================================================
"""

from __future__ import annotations

RULES = ("budget", "count", "windows", "cosine_first", "keep_regrown", "no_regrowth", "seeds")
_GROWTH_ONLY = {"keep_regrown": "ag", "no_regrowth": "ma", "seeds": "ag"}


def released(config, rule: str) -> bool:
    """Whether ``config`` runs the released code's ``rule`` (one of :data:`RULES`): every rule with
    ``reference='authors'``, otherwise those :func:`with_released_rules` switched on."""
    return config.reference == "authors" or rule in config.__dict__.get("_released_rules", ())


def with_released_rules(config, rules) -> "SpIELConfig":  # noqa: F821
    """``config`` (a :class:`~peft_sparse.SpIELConfig` with the defaults' rules) with the named released rules switched
    on, one row of the differences page at a time; returned for chaining. Unknown names, rules of the other growth
    criterion, block selection (the released code selects single weights) and the adaptive budget split (it keeps each
    tensor's share) are refused by name."""
    rules = tuple(rules)
    unknown = sorted(set(rules) - set(RULES))
    if unknown:
        raise ValueError(f"unknown released rules {unknown}; choose from {list(RULES)}")
    if config.reference == "authors":
        raise ValueError(f"reference='authors' already runs every released rule; got released rules {list(rules)}")
    if config.budget_split == "adaptive":
        raise ValueError(f"the released rules split the budget per tensor; got budget_split='adaptive' with rules {list(rules)}")
    if tuple(config.block_shape) != (1, 1):
        raise ValueError(f"the released rules select single weights; got block_shape={tuple(config.block_shape)} with rules {list(rules)}")
    for rule in rules:
        growth = _GROWTH_ONLY.get(rule)
        if growth is not None and config.growth != growth:
            raise ValueError(f"the released rule {rule!r} is SpIEL-{growth.upper()}'s; got growth={config.growth!r}")
    config.__dict__["_released_rules"] = frozenset(rules)
    return config
