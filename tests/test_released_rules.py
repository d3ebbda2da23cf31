"""The released rules one at a time (``peft_sparse.methods.spiel.rules``): the ablation the differences page's
"measured effect" column comes from. Every rule switched on alone over the defaults trains exactly as
``reference="authors"`` does once the settings the reference fixes are given, so the rows partition the reference
mode; each rule alone changes what its row says and nothing else."""

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore:SpIEL. the learning rate has not decayed")
from peft import get_peft_model

from peft_sparse import SM3, AgedAdamW, SpIELConfig, SpIELScheduler
from peft_sparse.methods.spiel.model import released_budget
from peft_sparse.methods.spiel.rules import RULES, released, with_released_rules

from .models import inputs, sparse_layers, tiny_llama, train_on

# what reference='authors' fixes beside its rules (S and γ: the paper's 20 and 5, here a short run's)
FIXED = dict(score_normalization="none", budget_split="uniform", reselection_steps=5, gradient_estimation_steps=2)


def _run(growth: str, rules=None, reference=None, steps=13, **fields):
    """A tiny Llama trained ``steps`` steps (reselections at 2, 7, 12); the adapter's tensors at the end."""
    torch.manual_seed(0)
    config = SpIELConfig(target_modules="all-linear", density=0.1, growth=growth, reference=reference, **fields)
    if rules is not None:
        with_released_rules(config, rules)
    model = get_peft_model(tiny_llama(), config)
    params = [p for p in model.parameters() if p.requires_grad]
    if growth == "ma":
        opt = SM3(params, lr=1e-2)
    elif reference == "authors" or (rules and "seeds" in rules):
        opt = AgedAdamW(params, lr=1e-2)
    else:
        opt = torch.optim.AdamW(params, lr=1e-2)
    train_on(model, opt, SpIELScheduler(model, opt, total_steps=steps), lambda step: inputs(seed=step, batch=2, length=9), steps)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "sparse_" in k}, model


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("growth", ["ag", "ma"])
def test_every_rule_alone_together_is_the_reference_mode(growth):
    """All the growth criterion's rules switched on over the defaults, with the settings the reference fixes: the
    adapter after three reselections is bit for bit reference='authors''s."""
    rules = [r for r in RULES if r not in ({"no_regrowth"} if growth == "ag" else {"keep_regrown", "seeds"})]
    fields = {k: v for k, v in FIXED.items() if growth == "ag" or k != "score_normalization"}
    got, _ = _run(growth, rules=rules, **fields)
    expected, _ = _run(growth, reference="authors", reselection_steps=5, gradient_estimation_steps=2)
    assert _equal(got, expected)
    defaults, _ = _run(growth, **fields)
    assert not _equal(defaults, expected)


@pytest.mark.parametrize("growth,rule", [("ag", "keep_regrown"), ("ag", "windows"), ("ag", "seeds"), ("ag", "budget"),
                                         ("ma", "no_regrowth")])  # fmt: skip
def test_one_rule_alone_changes_the_run(growth, rule):
    """Each rule the benchmark measures changes the trained adapter on its own (a rule that changed nothing would
    measure nothing). SpIEL-MA ranks by SM3's accumulators, which need no window: 'windows' is AG's row there."""
    fields = {k: v for k, v in FIXED.items() if growth == "ag" or k != "score_normalization"}
    got, _ = _run(growth, rules=[rule], **fields)
    defaults, _ = _run(growth, **fields)
    assert not _equal(got, defaults)


def test_rules_change_what_their_rows_say():
    """count: k(t) in floating point; cosine_first: no full first replacement with the cosine schedule; budget: the
    split by size with floors; windows: γ + 1 steps; and the switch is read by the scheduler of the wrapped model."""
    config = with_released_rules(SpIELConfig(target_modules="all-linear", density=0.1, schedule="cosine"), ["cosine_first"])
    assert released(config, "cosine_first") and not released(config, "windows")
    assert config.first_replacement_is_full(100) is False
    assert SpIELConfig(target_modules="all-linear", density=0.1, schedule="cosine").first_replacement_is_full(100) is True
    config = with_released_rules(SpIELConfig(target_modules="all-linear", density=0.1, reselection_steps=5, gradient_estimation_steps=2),
                                 ["budget"])  # fmt: skip
    model = get_peft_model(tiny_llama(), config)
    counts = {layer.module_name: layer.sparse_indices["default"].numel() for layer in sparse_layers(model)}
    assert counts == released_budget(model.peft_config["default"], model)
    assert released(model.peft_config["default"], "budget")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    assert [t for t in range(1, 13) if SpIELScheduler(model, opt, total_steps=13)._in_window(t)] == [1, 2, 6, 7, 11, 12]
    with_released_rules(model.peft_config["default"], ["windows"])  # (S = 5, γ = 2: later windows open after step kS − 1)
    assert [t for t in range(1, 13) if SpIELScheduler(model, opt, total_steps=13)._in_window(t)] == [1, 2, 5, 6, 7, 10, 11, 12]


@pytest.mark.parametrize("fields,rules,match", [
    ({}, ["keep"], "unknown released rules"),
    ({"growth": "ma"}, ["keep_regrown"], "'keep_regrown' is SpIEL-AG's; got growth='ma'"),
    ({"growth": "ag"}, ["no_regrowth"], "'no_regrowth' is SpIEL-MA's"),
    ({"block_shape": (2, 2)}, ["windows"], "block_shape=\\(2, 2\\)"),
    ({"budget_split": "adaptive"}, ["keep_regrown"], "budget_split='adaptive'"),
    ({"reference": "authors"}, ["windows"], "already runs every released rule"),
])  # fmt: skip
def test_bad_rules_are_refused_by_name(fields, rules, match):
    with pytest.raises(ValueError, match=match):
        with_released_rules(SpIELConfig(target_modules="all-linear", density=0.1, **fields), rules)


def test_the_seeds_rule_needs_aged_adamw():
    config = with_released_rules(SpIELConfig(target_modules="all-linear", density=0.1), ["seeds"])
    model = get_peft_model(tiny_llama(), config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with pytest.raises(TypeError, match="released rule 'seeds'.*AgedAdamW"):
        SpIELScheduler(model, opt, total_steps=10)
