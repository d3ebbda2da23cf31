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


@pytest.mark.parametrize("seed", ["both", "second", "none"])
def test_seed_moments_chooses_which_moments_of_grown_weights_are_seeded(seed):
    scheduler, optimizer = _train(_model(seed_moments=seed), 2)  # t = γ = 2: the first reselection
    assert bool(scheduler.seeding.pending) == (seed != "none")
    layer = sparse_layers(scheduler.model)[0]
    state = optimizer.state[layer.sparse_values["default"]]
    grown = layer.sparse_ages["default"] == 2
    assert grown.any()
    # (re-gathered: grown slots start at zero; the next step's pre-hook seeds them)
    assert bool((state["exp_avg"][grown] == 0).all()) and bool((state["exp_avg_sq"][grown] == 0).all())
    x = inputs(seed=3, batch=4, length=9)
    scheduler.model(x, labels=x).loss.backward()
    captured = {}
    handle = optimizer.register_step_post_hook(lambda *a: None)
    hook = optimizer.register_step_pre_hook(lambda *a: captured.update(m=state["exp_avg"].clone(), v=state["exp_avg_sq"].clone()))
    optimizer.step()  # (the seeding pre-hook was registered first: it runs before the capture)
    hook.remove(), handle.remove()
    seeded_m = bool((captured["m"][grown] != 0).any())
    seeded_v = bool((captured["v"][grown] != 0).any())
    assert (seeded_m, seeded_v) == {"both": (True, True), "second": (False, True), "none": (False, False)}[seed]


def _snapshot_window(monkeypatch) -> dict:
    """The window's candidates, Σg, Σg² and length as each reselection reads them."""
    seen = {}
    original = SpIELScheduler._reselect

    def spy(self, t):
        seen[t] = ({n: (s.candidates.clone(), s.grad_sum.clone(), s.grad_sq_sum.clone()) for n, s in self.statistics.items()},
                   self.steps_in_window)  # fmt: skip
        return original(self, t)

    monkeypatch.setattr(SpIELScheduler, "_reselect", spy)
    return seen


@pytest.mark.parametrize("grow_init", ["zero", "gradient"])
def test_grow_init_starts_grown_weights_at_zero_or_at_the_windows_adam_steps(grow_init, monkeypatch):
    """'gradient': exactly −lr·γ·ĝ/(√ŝ + ε) of the window's sums; 'zero': 0."""
    seen = _snapshot_window(monkeypatch)
    model = _model(grow_init=grow_init, reselection_steps=6, gradient_estimation_steps=3)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-3, eps=1e-8, weight_decay=0.0)
    scheduler = SpIELScheduler(model, optimizer, total_steps=T)
    model.train()
    for step in (1, 2, 3):
        x = inputs(seed=step, batch=4, length=9)
        model(x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    stats, gamma = seen[3]
    assert gamma == 3
    nonzero = 0
    for layer in sparse_layers(model):
        candidates, g, s2 = stats[layer.module_name]
        indices = layer.sparse_indices["default"].long()
        values = layer.sparse_values["default"].detach()
        grown = layer.sparse_ages["default"] == 3
        rows = torch.searchsorted(candidates.long(), indices[grown])
        if grow_init == "zero":
            assert bool((values[grown] == 0).all())
            continue
        expected = -3e-3 * gamma * (g[rows] / gamma) / ((s2[rows] / gamma).sqrt() + 1e-8)
        torch.testing.assert_close(values[grown], expected.to(values.dtype), rtol=1e-5, atol=1e-10)
        nonzero += int((values[grown] != 0).sum())
    assert grow_init == "zero" or nonzero > 0


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


@pytest.mark.parametrize("field,value", [("drop_criterion", "abs"), ("grow_init", "random"), ("first_full_replacement", 1),
                                         ("seed_moments", True), ("budget_split", "even"), ("score_normalization", "row")])  # fmt: skip
def test_bad_settings_are_refused_with_the_field_named(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        SpIELConfig(target_modules="all-linear", density=0.1, **{field: value})


@pytest.mark.parametrize("field,value", [("grow_init", "gradient"), ("seed_moments", "both")])
def test_ma_refuses_window_settings(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r}.*SpIEL-MA"):
        SpIELConfig(target_modules="all-linear", density=0.1, growth="ma", **{field: value})


def test_seed_moments_defaults_to_second_for_ag_and_round_trips():
    config = SpIELConfig(target_modules="all-linear", density=0.1)
    assert config.seed_moments == "second"
    assert SpIELConfig(target_modules="all-linear", density=0.1, growth="ma").seed_moments == "none"  # (beside Adam: 'second' on request)
    again = SpIELConfig(**{k: v for k, v in config.to_dict().items() if k in SpIELConfig.__dataclass_fields__})
    assert again.seed_moments == "second"


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


def _greedy_capped(row, col, kept, k, cap):
    """Brute force: every free weight by (R_i·C_j desc, index asc), taken while its column has room."""
    out_features, in_features = row.numel(), col.numel()
    count = torch.bincount(kept % in_features, minlength=in_features).tolist()
    kept_set = set(kept.tolist())
    entries = sorted((-float((row[i] * col[j]).float()), i * in_features + j) for i in range(out_features) for j in range(in_features) if i * in_features + j not in kept_set)
    chosen = []
    for _, flat in entries:
        if len(chosen) == k:
            break
        if count[flat % in_features] < cap:
            count[flat % in_features] += 1
            chosen.append(flat)
    return sorted(chosen)


@pytest.mark.parametrize("seed", range(6))
def test_capped_ma_growth_equals_a_brute_force_greedy(seed):
    from peft_sparse.methods.spiel.rank_one import top_k_row_col_products_capped as grow_ma_capped

    g = torch.Generator().manual_seed(seed)
    out_features, in_features = 12, 9
    row = torch.rand(out_features, generator=g, dtype=torch.float64) ** 4  # (a few large rows, as gradients have)
    col = torch.rand(in_features, generator=g, dtype=torch.float64) ** 4
    kept = torch.randperm(out_features * in_features, generator=g)[:20].sort().values
    k, cap = 10, 4 + seed % 2  # (4 × 9 columns hold the 20 kept and 10 grown weights)
    got = grow_ma_capped(row, col, kept, k, cap)
    assert got.tolist() == _greedy_capped(row, col, kept, k, cap)
    with pytest.raises(ValueError, match="a column cap of 3 weights leaves no room for 20 kept and 10 grown weights in 9 columns"):
        grow_ma_capped(row, col, kept, k, 3)
    uncapped = grow_ma_capped(row, col, kept, k, out_features)  # (a cap no column reaches: the plain ranking)
    assert uncapped.tolist() == _greedy_capped(row, col, kept, k, out_features)


def test_column_cap_spreads_ma_growth_over_the_columns():
    """SpIEL-MA with column_cap trains through the scheduler; grown weights never fill a column past the cap, the
    mask covers more columns than without it, and the reference path (fast paths off) chooses the same indices."""
    import peft_sparse

    def run(cap, indices=None):
        model = _model(growth="ma", density=0.1, column_cap=cap)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = peft_sparse.SM3(params, lr=0.05)
        scheduler = SpIELScheduler(model, optimizer, total_steps=T)
        for step in range(1, 9):
            x = inputs(seed=step, batch=4, length=9)
            model(x, labels=x).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            before = _indices(model)
            scheduler.step()
            if cap is not None and scheduler.last_statistics:
                for layer, old in zip(sparse_layers(model), before):
                    new = layer.sparse_indices["default"].long()
                    grown = new[~torch.isin(new, old.long())]
                    limit = math.ceil(cap * new.numel() / layer.in_features)
                    counts = torch.bincount(new % layer.in_features, minlength=layer.in_features)
                    assert bool((counts[grown % layer.in_features] <= limit).all()), layer.module_name
        empty = [float((torch.bincount(l.sparse_indices["default"].long() % l.in_features, minlength=l.in_features) == 0).float().mean()) for l in sparse_layers(model)]
        if indices is not None:
            indices.extend(_indices(model))
        return sum(empty) / len(empty)

    fast, reference = [], []
    assert run(1.5, fast) < run(None)
    with peft_sparse.fast_paths(False):
        run(1.5, reference)
    assert fast and all(torch.equal(a, b) for a, b in zip(fast, reference))


def test_column_cap_is_for_unstructured_ma():
    with pytest.raises(ValueError, match="column_cap=2.0 caps SpIEL-MA's unstructured growth"):
        SpIELConfig(target_modules="all-linear", density=0.1, growth="ag", column_cap=2.0)
    with pytest.raises(ValueError, match="column_cap must be a number >= 1"):
        SpIELConfig(target_modules="all-linear", density=0.1, growth="ma", column_cap=0.5)


def test_ma_unseen_is_checked_and_is_mas():
    assert SpIELConfig(target_modules="all-linear", density=0.1, growth="ma", ma_unseen="mean").ma_unseen == "mean"
    with pytest.raises(ValueError, match="ma_unseen must be 'mean' or 'zero', got ma_unseen='max'"):
        SpIELConfig(target_modules="all-linear", density=0.1, growth="ma", ma_unseen="max")
    with pytest.raises(ValueError, match="ma_unseen='mean' is a setting of SpIEL-MA's growth; got growth='ag'"):
        SpIELConfig(target_modules="all-linear", density=0.1, growth="ag", ma_unseen="mean")


def test_ma_regrow_dropped_is_checked_and_is_mas():
    assert SpIELConfig(target_modules="all-linear", density=0.1, growth="ma", ma_regrow_dropped=False).ma_regrow_dropped is False
    with pytest.raises(ValueError, match="ma_regrow_dropped must be True or False, got ma_regrow_dropped=0"):
        SpIELConfig(target_modules="all-linear", density=0.1, growth="ma", ma_regrow_dropped=0)
    with pytest.raises(ValueError, match="ma_regrow_dropped=False is a setting of SpIEL-MA's growth; got growth='ag'"):
        SpIELConfig(target_modules="all-linear", density=0.1, growth="ag", ma_regrow_dropped=False)
    with pytest.raises(ValueError, match=r"ma_regrow_dropped=False does not combine with column_cap=2.0"):
        SpIELConfig(target_modules="all-linear", density=0.1, growth="ma", ma_regrow_dropped=False, column_cap=2.0)
