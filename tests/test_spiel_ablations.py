"""Each SpIEL setting the quality benchmark ablates changes what it says, on a tiny model."""

import math

import pytest
import torch
from peft import get_peft_model

from peft_sparse import SparseFTConfig, SpIELConfig, SpIELScheduler
from peft_sparse.core.budget import split_budget, split_weights
from peft_sparse.schedules.reselection import replacement_count

from .models import inputs, sparse_layers, tiny_llama

T = 20


def _model(**fields):
    base = dict(target_modules="all-linear", density=0.1, reselection_steps=6, gradient_estimation_steps=2)
    base.update(fields)
    return get_peft_model(tiny_llama(), SpIELConfig(**base))


def _train(model, steps, lr=1e-2, on_step=None):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    scheduler = SpIELScheduler(model, optimizer, total_steps=T)
    model.train()
    for step in range(1, steps + 1):
        x = inputs(seed=step, batch=4, length=9)
        model(x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if on_step is not None:
            on_step(step, scheduler, optimizer)
        scheduler.step()
    return scheduler, optimizer


def _indices(model):
    return [layer.sparse_indices["default"].clone() for layer in sparse_layers(model)]


def test_first_full_replacement_off_replaces_only_the_scheduled_share_at_gamma():
    for full in (True, False):
        model = _model(first_full_replacement=full, initial_reselection_rate=0.3)
        before = _indices(model)
        scheduler, _ = _train(model, 2)  # t = γ = 2: the first reselection
        report = scheduler.last_statistics
        total = sum(i.numel() for i in before)
        expected = sum(replacement_count(2, T, i.numel(), 0.3, "linear", 2, full) for i in before)
        assert report["spiel/replaced"] == expected
        assert (expected == total) == full
        kept = sum(int(torch.isin(b, a).sum()) for b, a in zip(before, _indices(model)))
        assert kept >= total - expected  # at least the unreplaced indices stay
        if not full:
            assert kept > 0


def test_drop_change_ranks_by_the_change_since_the_last_reselection():
    """drop_criterion='change' (Algorithm 2, line 10) drops the k smallest |φ − φ₀|, φ₀ being the values
    right after the previous reselection; 'magnitude' the k smallest |φ|."""
    captured = {}

    def at(step, scheduler, optimizer):
        if step == 14:  # the reselection at t = γ + 2S = 14 (φ₀ taken at 8), values as it sees them
            captured["values"] = [layer.sparse_values["default"].detach().clone() for layer in sparse_layers(scheduler.model)]
            captured["reference"] = {k: v.clone() for k, v in scheduler.drop_reference.items()}
            captured["indices"] = _indices(scheduler.model)

    model = _model(drop_criterion="change")
    scheduler, _ = _train(model, 14, on_step=at)
    after = _indices(model)
    layers = sparse_layers(model)
    some_differ = False
    for layer, values, old, new in zip(layers, captured["values"], captured["indices"], after):
        change = (values - captured["reference"][layer.module_name]).abs()
        k = replacement_count(14, T, values.numel(), 0.2, "linear", 2)
        if k == 0:
            continue
        dropped = old[torch.sort(change, stable=True).indices[:k]]
        survivors = old[torch.sort(change, stable=True).indices[k:]]
        assert torch.isin(survivors, new).all()  # the kept ones are those that changed most
        by_magnitude = old[torch.sort(values.abs(), stable=True).indices[:k]]
        some_differ |= not torch.equal(dropped.sort().values, by_magnitude.sort().values)
    assert some_differ  # (the two criteria disagree somewhere: the test tells them apart)
    # φ₀ is taken again after the reselection
    for layer in layers:
        assert torch.equal(scheduler.drop_reference[layer.module_name], layer.sparse_values["default"].detach())


def test_drop_change_state_resumes(tmp_path):
    model = _model(drop_criterion="change")
    scheduler, optimizer = _train(model, 9)
    scheduler.save(tmp_path)
    other = SpIELScheduler(model, optimizer, total_steps=T)
    other.load(tmp_path)
    assert set(other.drop_reference) == set(scheduler.drop_reference)
    for name, v in scheduler.drop_reference.items():
        assert torch.equal(other.drop_reference[name], v)


def test_ag_seeds_only_the_second_moment_of_grown_weights():
    scheduler, optimizer = _train(_model(), 2)  # t = γ = 2: the first reselection
    assert bool(scheduler.seeding.pending)
    layer = sparse_layers(scheduler.model)[0]
    state = optimizer.state[layer.sparse_values["default"]]
    grown = layer.sparse_ages["default"] == 2
    assert grown.any()
    # (re-gathered: grown slots start at zero; the next step's pre-hook seeds them)
    assert bool((state["exp_avg"][grown] == 0).all()) and bool((state["exp_avg_sq"][grown] == 0).all())
    x = inputs(seed=3, batch=4, length=9)
    scheduler.model(x, labels=x).loss.backward()
    captured = {}
    hook = optimizer.register_step_pre_hook(lambda *a: captured.update(m=state["exp_avg"].clone(), v=state["exp_avg_sq"].clone()))
    optimizer.step()  # (the seeding pre-hook was registered first: it runs before the capture)
    hook.remove()
    assert bool((captured["m"][grown] == 0).all()) and bool((captured["v"][grown] != 0).any())


def test_fractions_of_total_steps_resolve_with_the_run_length():
    config = SpIELConfig(target_modules="all-linear", density=0.1, reselection_steps=0.2, gradient_estimation_steps=0.05)
    assert config.steps_for(60) == (12, 3)
    assert config.steps_for(1000) == (200, 50)
    assert config.steps_for(10) == (2, 1)
    with pytest.raises(ValueError, match="γ=3 ≥ S=3"):
        SpIELConfig(target_modules="all-linear", density=0.1, reselection_steps=0.05, gradient_estimation_steps=3).steps_for(60)
    with pytest.raises(ValueError, match="reselection_steps=1.5"):
        SpIELConfig(target_modules="all-linear", density=0.1, reselection_steps=1.5)
    model = _model(reselection_steps=0.3, gradient_estimation_steps=0.1)
    scheduler, _ = _train(model, 2)
    assert (scheduler.S, scheduler.gamma) == (6, 2)
    assert scheduler.last_statistics  # t = γ = 2 reselected


def test_auto_steps_keep_the_papers_20_and_5_up_to_150_steps_and_scale_beyond(tmp_path):
    """The default S, γ ('auto'): S = max(20, round(2T/15)), γ = max(5, round(T/30)), γ kept below a set S."""
    config = SpIELConfig(target_modules="all-linear", density=0.1)
    assert (config.reselection_steps, config.gradient_estimation_steps) == ("auto", "auto")
    assert [config.steps_for(T) for T in (11, 60, 150, 600, 1000)] == [(20, 5), (20, 5), (20, 5), (80, 20), (133, 33)]
    small = SpIELConfig(target_modules="all-linear", density=0.1, reselection_steps=4)
    assert small.steps_for(600) == (4, 3) and small.earliest_first_reselection() == 3
    assert SpIELConfig(target_modules="all-linear", density=0.1, reselection_steps=0.2).steps_for(600) == (120, 20)
    with pytest.raises(ValueError, match="reselection_steps=1 leaves no γ"):
        SpIELConfig(target_modules="all-linear", density=0.1, reselection_steps=1)
    with pytest.raises(ValueError, match="reselection_steps='Auto'"):
        SpIELConfig(target_modules="all-linear", density=0.1, reselection_steps="Auto")
    model = _model(reselection_steps="auto", gradient_estimation_steps="auto")
    model.peft_config["default"].save_pretrained(tmp_path)
    loaded = SpIELConfig.from_pretrained(tmp_path)
    assert (loaded.reselection_steps, loaded.gradient_estimation_steps) == ("auto", "auto")
    scheduler, _ = _train(model, 4)
    assert (scheduler.S, scheduler.gamma) == config.steps_for(T) == (20, 5) and not scheduler.last_statistics
    scheduler, _ = _train(_model(reselection_steps="auto", gradient_estimation_steps="auto"), 5)
    assert scheduler.last_statistics  # (the first reselection, at t = γ = 5)


@pytest.mark.parametrize("field,value", [("drop_criterion", "abs"), ("first_full_replacement", 1), ("budget_split", "even"),
                                         ("score_normalization", "row"), ("reference", "thesis")])  # fmt: skip
def test_bad_settings_are_refused_with_the_field_named(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        SpIELConfig(target_modules="all-linear", density=0.1, **{field: value})


def test_lora_budget_split_is_proportional_to_out_plus_in():
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.2, budget_split="lora"))
    counts = model.peft_config["default"].tunable_weights_per_module
    shapes = model.peft_config["default"].module_shapes
    total = sum(counts.values())
    share = {n: s[0] + s[1] for n, s in shapes.items()}
    for name, count in counts.items():
        assert abs(count - total * share[name] / sum(share.values())) < 1 + 1e-9
    uniform = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.2)).peft_config["default"]
    assert sum(uniform.tunable_weights_per_module.values()) == total
    small = min(shapes, key=lambda n: shapes[n][0] * shapes[n][1])
    big = max(shapes, key=lambda n: shapes[n][0] * shapes[n][1])
    density = {n: counts[n] / (shapes[n][0] * shapes[n][1]) for n in (small, big)}
    assert density[small] > density[big]  # small matrices get the higher density


def test_split_caps_a_tensor_at_its_size_and_shares_the_rest():
    sizes = {"a": 10, "b": 1000}
    counts = split_budget(sizes, 500, weights={"a": 100, "b": 1})
    assert counts == {"a": 10, "b": 490}
    assert split_weights({"a": (2, 5)}, "lora") == {"a": 7}
    assert math.isclose(sum(split_budget({"x": 7, "y": 9, "z": 11}, 13, weights={"x": 1, "y": 1, "z": 1}).values()), 13)


def test_column_normalization_is_refused_where_it_does_not_apply():
    with pytest.raises(ValueError, match="score_normalization='column' applies to unstructured SpIEL-AG"):
        SpIELConfig(target_modules="all-linear", density=0.1, growth="ma", score_normalization="column")
    with pytest.raises(ValueError, match="block_shape"):
        SpIELConfig(target_modules="all-linear", density=0.1, block_shape=(4, 4), score_normalization="column")


def test_score_normalization_defaults_to_column_for_unstructured_ag_only():
    assert SpIELConfig(target_modules="all-linear", density=0.1).score_normalization == "column"
    assert SpIELConfig(target_modules="all-linear", density=0.1, growth="ma").score_normalization == "none"
    assert SpIELConfig(target_modules="all-linear", density=0.1, block_shape=(4, 4)).score_normalization == "none"
