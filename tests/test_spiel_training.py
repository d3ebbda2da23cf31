"""SpIEL in training loops: optimizer surgery, SM3, windows, accumulation, learning, errors."""

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from peft import get_peft_model

from peft_sparse import SM3, SparseLayer, SpIELConfig, SpIELScheduler
from peft_sparse.optim.surgery import reindex_optimizer_state, seed_optimizer_state
from peft_sparse.schedules.reselection import in_estimation_window, is_reselection_step

from .models import sparse_layers, tiny_llama


def _spiel(growth="ag", dtype=torch.float32, **kwargs):
    base = dict(target_modules="all-linear", density=0.05, growth=growth, reselection_steps=6, gradient_estimation_steps=2)
    base.update(kwargs)
    return get_peft_model(tiny_llama(dtype=dtype), SpIELConfig(**base))


def _optimizer(model, growth, lr=1e-2):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0) if growth == "ag" else SM3(params, lr=lr)


def _batch(seed=0, n=8, length=12):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (n, length), generator=g)


def _run(model, opt, scheduler, steps, first_seed=0):
    """``steps`` plain training steps on fresh batches, the scheduler stepped after each optimizer step."""
    model.train()
    for step in range(steps):
        _loss(model, _batch(first_seed + step)).backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()


def _loss(model, x, total_tokens=None):
    """Token-summed next-token loss divided by the tokens of the whole (accumulated) batch."""
    logits = model(x).logits[:, :-1]
    target = x[:, 1:]
    total = total_tokens or target.numel()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum") / total


def _train_to_reselection(model, opt, scheduler, count, after_backward=None, before_reselect=None):
    """Plain steps until the scheduler's ``count``-th reselection; returns that step. ``after_backward`` runs after each
    backward pass, ``before_reselect`` after each optimizer step, before the scheduler's."""
    model.train()
    reselections = 0
    for step in range(1, scheduler.total_steps + 1):
        _loss(model, _batch(step)).backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        opt.zero_grad()
        if before_reselect is not None:
            before_reselect()
        reselections += bool(scheduler.step())
        if reselections == count:
            return step
    raise AssertionError(f"fewer than {count} reselections")


def _snapshot_second_moments(layers, opt, into: dict) -> None:
    """Each layer's indices and Adam second moments, into ``into`` by layer name (the state before a reselection)."""
    into.update({m.module_name: (m.sparse_indices["default"].clone(), opt.state[m.sparse_values["default"]]["exp_avg_sq"].clone()) for m in layers})


# ------------------------------------------------------------------------------------------- optimizer state
def test_stock_adamw_seeding_recovers_window_moments_and_next_update():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.AdamW([p], lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    for _ in range(3):
        p.grad = torch.randn(4)
        opt.step()
    before = opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()
    g_hat, s_hat = torch.tensor([0.5, -0.2]), torch.tensor([0.3, 0.1])
    source = torch.tensor([2, -1, 0, -1])
    with torch.no_grad():
        p.copy_(torch.where(source >= 0, p[source.clamp(min=0)], torch.zeros(4)))
    reindex_optimizer_state(opt, p, source)
    assert (opt.state[p]["exp_avg"][[1, 3]] == 0).all()
    seed_optimizer_state(opt, p, torch.tensor([1, 3]), g_hat, s_hat)
    m, v = opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]
    t = 3
    # Adam's bias correction now yields exactly ĝ and ŝ for the grown slots
    torch.testing.assert_close(m[[1, 3]] / (1 - 0.9**t), g_hat)
    torch.testing.assert_close(v[[1, 3]] / (1 - 0.99**t), s_hat)
    torch.testing.assert_close(m[[0, 2]], before[0][[2, 0]])
    torch.testing.assert_close(v[[0, 2]], before[1][[2, 0]])
    # and the next stock step is the one implied by the seeded moments
    g_next = torch.tensor([0.1, 0.4, -0.3, 0.2])
    p_before = p.detach().clone()
    m_exp = 0.9 * m + 0.1 * g_next
    v_exp = 0.99 * v + 0.01 * g_next**2
    step = 0.1 * (m_exp / (1 - 0.9**4)) / ((v_exp / (1 - 0.99**4)).sqrt() + 1e-8)
    p.grad = g_next
    opt.step()
    torch.testing.assert_close(p.detach(), p_before - step)


def test_amsgrad_and_unknown_optimizers_are_refused():
    model = _spiel()
    params = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(ValueError, match="amsgrad=True"):
        SpIELScheduler(model, torch.optim.AdamW(params, amsgrad=True), total_steps=10)
    with pytest.raises(TypeError, match="optimizer Adagrad cannot follow a reselection"):
        SpIELScheduler(model, torch.optim.Adagrad(params), total_steps=10)
    with pytest.raises(TypeError, match="optimizer Adagrad cannot follow a reselection"):
        SpIELScheduler(_spiel("ma"), torch.optim.Adagrad([p for p in _spiel("ma").parameters() if p.requires_grad]), 10)


# ------------------------------------------------------------------------------------------- SpIEL-MA beside any optimizer
def _dense_sm3_accumulators(layers, rows, cols):
    """SM3-II's accumulators written densely (the test's reference): ν = min(R_i, C_j) + G_ij² over the whole
    matrix, G the values' gradient scattered into it (zero off the active set, where ν ≤ R_i, C_j changes nothing)."""
    for layer in layers:
        name = layer.module_name
        values, idx = layer.sparse_values["default"], layer.sparse_indices["default"].long()
        G = torch.zeros(layer.out_features * layer.in_features)
        if values.grad is not None:
            G[idx] = values.grad
        nu = torch.minimum(rows[name][:, None], cols[name][None, :]) + G.view(layer.out_features, layer.in_features) ** 2
        rows[name] = torch.maximum(rows[name], nu.amax(dim=1))
        cols[name] = torch.maximum(cols[name], nu.amax(dim=0))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_spiel_ma_beside_another_optimizer_keeps_sm3_accumulators_and_grows_by_them(optimizer):
    """Under AdamW (or SGD) the scheduler keeps SM3's row and column accumulators itself from each optimizer step's
    gradients: equal to a dense SM3 reference at every step (across reselections that move the indices), and each
    reselection chooses the indices Algorithm 3 chooses from them."""
    from peft_sparse.methods.spiel.selection import reselect_ma
    from peft_sparse.schedules.reselection import replacement_count

    torch.manual_seed(0)
    model = _spiel("ma", reselection_steps=4)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2) if optimizer == "adamw" else torch.optim.SGD(params, lr=0.5)
    scheduler = SpIELScheduler(model, opt, total_steps=12)
    layers = sparse_layers(model)
    rows = {m.module_name: torch.zeros(m.out_features) for m in layers}
    cols = {m.module_name: torch.zeros(m.in_features) for m in layers}
    reselections = 0
    model.train()
    for step in range(1, 13):
        _loss(model, _batch(step)).backward()
        _dense_sm3_accumulators(layers, rows, cols)
        opt.step()
        before = {m.module_name: (m.sparse_values["default"].detach().clone(), m.sparse_indices["default"].clone()) for m in layers}
        opt.zero_grad()
        report = scheduler.step()
        for m in layers:
            r, c = scheduler.ma_accumulators.views[m.module_name]
            assert torch.equal(r, rows[m.module_name]) and torch.equal(c, cols[m.module_name]), (step, m.module_name)
        if report:
            reselections += 1
            changed = 0
            for m in layers:
                values, indices = before[m.module_name]
                k = replacement_count(step, 12, values.numel(), scheduler.config.initial_reselection_rate,
                                      scheduler.config.schedule, scheduler.gamma, scheduler.first_full)
                expected = reselect_ma(values, indices, k, rows[m.module_name], cols[m.module_name]).indices
                assert torch.equal(m.sparse_indices["default"], expected.to(indices.dtype)), (step, m.module_name)
                changed += int((m.sparse_indices["default"] != indices).any())
            assert changed > 0
    assert reselections >= 2


def test_spiel_ma_beside_adamw_without_seeds_starts_grown_weights_with_zero_moments(monkeypatch):
    """With the seeds off (the quality benchmark's ``--ma-seeds none``), a grown slot's Adam moments start at 0 at a
    reselection beside AdamW; kept slots keep theirs, re-gathered."""
    monkeypatch.setattr(SpIELScheduler, "_ma_seeds", None)
    torch.manual_seed(0)
    model = _spiel("ma", reselection_steps=4)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.99))
    scheduler = SpIELScheduler(model, opt, total_steps=12)
    layers = sparse_layers(model)
    before = {}
    # (to the second reselection, t = γ + S: it keeps some slots, the first replaces all)
    step = _train_to_reselection(model, opt, scheduler, 2, before_reselect=lambda: _snapshot_second_moments(layers, opt, before))
    assert step == scheduler.gamma + scheduler.S
    grown_total = kept = 0
    for m in layers:
        state = opt.state[m.sparse_values["default"]]
        indices, ages = m.sparse_indices["default"], m.sparse_ages["default"]
        grown = ages == step
        old_indices, old_v = before[m.module_name]
        kept_old = torch.isin(old_indices, indices[~grown])  # (old slots that stayed, in index order as the new ones)
        assert torch.equal(state["exp_avg_sq"][~grown], old_v[kept_old])  # (kept slots: their own, re-gathered)
        assert bool((state["exp_avg_sq"][grown] == 0).all()) and bool((state["exp_avg"][grown] == 0).all())
        kept += int((~grown).sum())
        grown_total += int(grown.sum())
    assert kept > 0 and grown_total > 0


@pytest.mark.parametrize("optimizer", ["adamw", "aged_adamw"])
def test_spiel_ma_seeds_grown_second_moments_from_the_sm3_cover(monkeypatch, optimizer):
    """With MA's seeds on (the quality benchmark's ``--ma-seeds``), a grown slot (i, j) beside Adam starts with the
    second moment SM3 would give it: min(R_i, C_j) / t of a dense SM3 reference of the accumulators, in Adam's stored
    units (stock AdamW: × (1 − β₂ᵗ); AgedAdamW: × (1 − β₂ᵗ) with the slot's age set to t), the first moment at 0; kept
    slots keep theirs. The next optimizer step then moves a grown weight by that optimizer's update from the seed."""
    from peft_sparse import AgedAdamW

    monkeypatch.setattr(SpIELScheduler, "_ma_seeds", "cover")
    torch.manual_seed(0)
    model = _spiel("ma", reselection_steps=4)
    params = [p for p in model.parameters() if p.requires_grad]
    beta2 = 0.99
    kind = torch.optim.AdamW if optimizer == "adamw" else AgedAdamW
    opt = kind(params, lr=1e-2, betas=(0.9, beta2), weight_decay=0.0)
    scheduler = SpIELScheduler(model, opt, total_steps=12)
    layers = sparse_layers(model)
    rows = {m.module_name: torch.zeros(m.out_features) for m in layers}
    cols = {m.module_name: torch.zeros(m.in_features) for m in layers}
    before = {}
    step = _train_to_reselection(model, opt, scheduler, 2, lambda: _dense_sm3_accumulators(layers, rows, cols),
                                 lambda: _snapshot_second_moments(layers, opt, before))  # fmt: skip
    grown_total = 0
    for m in layers:
        state = opt.state[m.sparse_values["default"]]
        indices, ages = m.sparse_indices["default"], m.sparse_ages["default"]
        grown = ages == step
        r, c = indices.long() // m.in_features, indices.long() % m.in_features
        cover = torch.minimum(rows[m.module_name][r], cols[m.module_name][c]) / step
        expected = (cover.double() * (1 - beta2**step)).float()
        assert torch.allclose(state["exp_avg_sq"][grown], expected[grown], rtol=1e-6, atol=0), m.module_name
        assert bool((state["exp_avg"][grown] == 0).all())
        if optimizer == "aged_adamw":
            assert bool((state["age"][grown] == step).all())
        old_indices, old_v = before[m.module_name]
        assert torch.equal(state["exp_avg_sq"][~grown], old_v[torch.isin(old_indices, indices[~grown])])
        grown_total += int(grown.sum())
    assert grown_total > 0 and bool((torch.cat([opt.state[m.sparse_values["default"]]["exp_avg_sq"] for m in layers]) > 0).all())
    # the next step: a grown weight moves by lr · m̂ / (√v̂ + ε), m and v from the seed and this step's gradient
    m0 = layers[0]
    values = m0.sparse_values["default"]
    grown = m0.sparse_ages["default"] == step
    v_seed, p_before = opt.state[values]["exp_avg_sq"].clone(), values.detach().clone()
    _loss(model, _batch(99)).backward()
    g = values.grad.detach().clone()
    opt.step()
    v = beta2 * v_seed.double() + (1 - beta2) * g.double() ** 2
    m = (1 - 0.9) * g.double()
    if optimizer == "adamw":  # (the step count is now t + 1; ε after the bias correction)
        expected_move = -1e-2 * (m / (1 - 0.9 ** (step + 1))) / ((v / (1 - beta2 ** (step + 1))).sqrt() + 1e-8)
    else:  # (the slot's age is t; ε before the bias correction)
        expected_move = -1e-2 * m / ((v.sqrt() + 1e-8) * (1 - 0.9**step) / math.sqrt(1 - beta2**step))
    moved = (values.detach() - p_before).double()
    assert torch.allclose(moved[grown], expected_move[grown], rtol=1e-4, atol=1e-9)


def test_spiel_ma_neighbour_seeds_are_the_kept_weights_row_and_column_means():
    """By default (``"neighbours"``) a grown slot (i, j) beside AdamW starts with √(r_i·c_j) of the mean bias-corrected
    second moments of the weights kept in row i and in column j (one of them alone where the other holds no kept
    weight, the tensor's mean where neither does), checked against a loop over the slots; the first moment at 0."""
    assert SpIELScheduler._ma_seeds == "neighbours"
    torch.manual_seed(0)
    model = _spiel("ma", reselection_steps=4)
    params = [p for p in model.parameters() if p.requires_grad]
    beta2 = 0.99
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, beta2), weight_decay=0.0)
    scheduler = SpIELScheduler(model, opt, total_steps=12)
    layers = sparse_layers(model)
    step = _train_to_reselection(model, opt, scheduler, 2)
    checked = 0
    for m in layers:
        state = opt.state[m.sparse_values["default"]]
        indices, grown = m.sparse_indices["default"].long(), m.sparse_ages["default"] == step
        s_hat = state["exp_avg_sq"].double() / (1 - beta2**step)
        rows, cols = indices // m.in_features, indices % m.in_features
        kept = ~grown
        for slot in torch.nonzero(grown).squeeze(1)[:40].tolist():
            in_row, in_col = kept & (rows == rows[slot]), kept & (cols == cols[slot])
            if in_row.any() and in_col.any():
                want = (s_hat[in_row].mean() * s_hat[in_col].mean()).sqrt()
            elif in_row.any() or in_col.any():
                want = s_hat[in_row | in_col].mean()
            else:
                want = s_hat[kept].mean()
            assert torch.allclose(s_hat[slot], want, rtol=1e-5), (m.module_name, slot)
            assert state["exp_avg"][slot] == 0
            checked += 1
    assert checked > 0


def test_spiel_ma_neighbour_seeds_leave_a_fully_replaced_tensor_as_unseeded(monkeypatch):
    """At the first full replacement no weight is kept, so ``"neighbours"`` has nothing to seed from: under AgedAdamW
    the grown weights keep the unseeded run's zero moments and ages, bit for bit."""
    from peft_sparse import AgedAdamW

    def states(seeds):
        monkeypatch.setattr(SpIELScheduler, "_ma_seeds", seeds)
        torch.manual_seed(0)
        model = _spiel("ma", reselection_steps=4)
        opt = AgedAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, betas=(0.9, 0.99))
        scheduler = SpIELScheduler(model, opt, total_steps=12)
        _train_to_reselection(model, opt, scheduler, 1)
        assert scheduler.first_full
        return [{k: v.clone() for k, v in opt.state[m.sparse_values["default"]].items()} for m in sparse_layers(model)]

    for seeded, plain in zip(states("neighbours"), states(None)):
        assert all(torch.equal(seeded[k], plain[k]) for k in plain)


def test_spiel_ma_seeds_only_beside_adam_kept_accumulators(monkeypatch):
    """The seeds need the scheduler's accumulators: beside SM3 (whose own cover already gives a new weight its second
    moment) and with ``reference='authors'`` nothing is seeded, the run the same bits as without the switch."""
    def run(seeds):
        monkeypatch.setattr(SpIELScheduler, "_ma_seeds", seeds)
        torch.manual_seed(0)
        model = _spiel("ma", reselection_steps=4)
        opt = _optimizer(model, "ma")
        scheduler = SpIELScheduler(model, opt, total_steps=12)
        _run(model, opt, scheduler, 12)
        return [m.sparse_values["default"].detach().clone() for m in sparse_layers(model)]

    plain = run(None)
    assert all(torch.equal(a, b) for a, b in zip(run("cover"), plain))
    assert all(torch.equal(a, b) for a, b in zip(run("neighbours"), plain))


def test_scheduler_kept_ma_accumulators_equal_sm3s_own():
    """The accumulators the scheduler keeps beside another optimizer are SM3's: kept beside SM3 itself, they equal
    SM3's state bit for bit through training with reselections."""
    from peft_sparse.methods.spiel.statistics import RowColumnAccumulators

    torch.manual_seed(0)
    model = _spiel("ma", reselection_steps=4)
    opt = _optimizer(model, "ma")
    scheduler = SpIELScheduler(model, opt, total_steps=12)
    assert scheduler.ma_accumulators is None  # (SM3's own state ranks the growth)
    kept = RowColumnAccumulators(scheduler.layers, "default")
    opt.register_step_pre_hook(kept.update)
    model.train()
    for step in range(1, 13):
        _loss(model, _batch(step)).backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()  # (a reselection edits the indices: the kept accumulators see it by themselves)
        for m in scheduler.layers:
            state = opt.state[m.sparse_values["default"]]
            r, c = kept.views[m.module_name]
            assert torch.equal(r, state["row_accumulator"]) and torch.equal(c, state["col_accumulator"]), (step, m.module_name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_ma_accumulators_from_each_tensors_gradient_or_zeros(dtype):
    """One update of the kept accumulators equals SM3's update of each tensor's own R and C from its gradient cast
    to float32, a tensor without a gradient counting as zeros (half-precision values: the gradients joined first,
    then cast once)."""
    from peft_sparse.methods.spiel.statistics import RowColumnAccumulators
    from peft_sparse.optim.sm3 import accumulate_sparse

    torch.manual_seed(0)
    model = _spiel("ma", dtype=dtype)
    layers = sparse_layers(model)
    kept = RowColumnAccumulators(layers, "default")
    expected = {}
    for step in range(2):
        for i, m in enumerate(layers):
            values = m.sparse_values["default"]
            values.grad = None if (i + step) % 3 == 0 else torch.randn_like(values)
            rows, cols = m.sparse_indices["default"] // m.in_features, m.sparse_indices["default"] % m.in_features
            r, c = expected.setdefault(m.module_name, (torch.zeros(m.out_features), torch.zeros(m.in_features)))
            g = torch.zeros(values.numel()) if values.grad is None else values.grad.float()
            accumulate_sparse(r, c, rows.long(), cols.long(), g)
        kept.update()
        for m in layers:
            r, c = kept.views[m.module_name]
            assert torch.equal(r, expected[m.module_name][0]) and torch.equal(c, expected[m.module_name][1]), (step, m.module_name)


def test_spiel_ma_beside_adamw_resumes_exactly(tmp_path):
    """The kept accumulators travel with the scheduler's state: save at step 5, close that scheduler (its hook
    goes), load the state into a new one, and the adapter after 12 steps equals the uninterrupted run's."""

    def fresh():
        torch.manual_seed(0)
        model = _spiel("ma", reselection_steps=4)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        return model, opt, SpIELScheduler(model, opt, total_steps=12)

    model, opt, scheduler = fresh()
    _run(model, opt, scheduler, 12)
    expected = {k: v.clone() for k, v in model.state_dict().items() if "sparse_" in k}

    model, opt, scheduler = fresh()
    _run(model, opt, scheduler, 5)
    scheduler.save(tmp_path / "sched")
    scheduler.close()
    scheduler = SpIELScheduler(model, opt, total_steps=12)
    scheduler.load(tmp_path / "sched")
    _run(model, opt, scheduler, 7, first_seed=5)
    got = {k: v for k, v in model.state_dict().items() if "sparse_" in k}
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    # a state saved beside AdamW does not load into a scheduler whose optimizer is SM3 (its accumulators would be dropped)
    model, _, _ = fresh()
    with pytest.raises(ValueError, match="resume with the optimizer the run was saved with"):
        SpIELScheduler(model, _optimizer(model, "ma"), total_steps=12).load(tmp_path / "sched")


@pytest.mark.parametrize("beta2", [None, 0.9])
def test_sm3_equals_dense_sm3_restricted_to_the_active_set(beta2):
    """SM3 over a layer's sparse values against SM3-II on the whole dense matrix with zero gradients outside the active
    set: the sums (Anil et al.) and the moving-average form (ν = β₂·min(R, C) + (1 − β₂)·g², R and C decayed by β₂
    before their maxima, the update from ν / (1 − β₂ᵗ))."""
    torch.manual_seed(0)
    model = _spiel("ma")
    layer = sparse_layers(model)[0]
    values = layer.sparse_values["default"]
    opt = SM3([values], lr=0.05, momentum=0.5, weight_decay=0.1, beta2=beta2)
    out, inn = layer.out_features, layer.in_features
    idx = layer.sparse_indices["default"].long()
    dense = torch.zeros(out * inn)
    row, col, mom = torch.zeros(out), torch.zeros(inn), torch.zeros(out * inn)
    for step in range(1, 5):
        g = torch.randn(values.numel())
        values.grad = g.clone()
        opt.step()
        # plain dense SM3-II on the whole matrix, gradient zero outside the active set
        G = torch.zeros(out * inn)
        G[idx] = g
        G = G.view(out, inn)
        if beta2 is None:
            nu = torch.minimum(row[:, None], col[None, :]) + G * G
            row, col = torch.maximum(row, nu.amax(1)), torch.maximum(col, nu.amax(0))
            corrected = nu
        else:
            nu = beta2 * torch.minimum(row[:, None], col[None, :]) + (1 - beta2) * G * G
            row, col = torch.maximum(beta2 * row, nu.amax(1)), torch.maximum(beta2 * col, nu.amax(0))
            corrected = nu / (1 - beta2**step)
        update = (G / (corrected + 1e-30).sqrt()).reshape(-1)
        mom = 0.5 * mom + 0.5 * update
        dense = dense * (1 - 0.05 * 0.1) - 0.05 * mom
    torch.testing.assert_close(values.detach(), dense[idx], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[values]["row_accumulator"], row)
    torch.testing.assert_close(opt.state[values]["col_accumulator"], col)


def test_sm3_beta2_refused_by_name():
    values = torch.nn.Parameter(torch.zeros(3))
    for bad in (0.0, 1.0, 1.5, True, "0.9"):
        with pytest.raises(ValueError, match=r"beta2"):
            SM3([values], beta2=bad)


# ------------------------------------------------------------------------------------------- windows
def test_dense_gradient_seam_fires_only_on_window_micro_batches():
    S, gamma, T, accumulation = 6, 2, 15, 2
    model = _spiel(reselection_steps=S, gradient_estimation_steps=gamma)
    opt = _optimizer(model, "ag")
    scheduler = SpIELScheduler(model, opt, total_steps=T)
    layers = sparse_layers(model)
    model.train()
    fired = []
    for step in range(1, T + 1):
        for micro in range(accumulation):
            before = layers[0].dense_grad_count
            _loss(model, _batch(step * 10 + micro)).backward()
            fired.append(layers[0].dense_grad_count - before)
            assert all(l.dense_grad_count == layers[0].dense_grad_count for l in layers)
        opt.step()
        opt.zero_grad()
        scheduler.step()
    expected = [int(in_estimation_window(s, S, gamma, T)) for s in range(1, T + 1) for _ in range(accumulation)]
    assert fired == expected and sum(expected) == 2 * accumulation * 3  # windows end at 2, 8, 14
    assert all(l.dense_grad_consumer is None for l in layers)


def test_spiel_ma_never_forms_the_dense_gradient():
    model = _spiel("ma")
    opt = _optimizer(model, "ma")
    scheduler = SpIELScheduler(model, opt, total_steps=12)
    _run(model, opt, scheduler, 12)
    assert all(l.dense_grad_count == 0 for l in sparse_layers(model))
    assert all((l.sparse_ages["default"] > 0).any() for l in sparse_layers(model))


@pytest.mark.parametrize("growth", ["ag", "ma"])
def test_learns_and_indices_change_exactly_when_scheduled(growth):
    S, gamma, T = 8, 3, 40
    # lm_head too: with only the blocks adapted, the frozen RMSNorm scale and output head cap the logits
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    model = _spiel(growth, density=0.2, reselection_steps=S, gradient_estimation_steps=gamma, target_modules=targets)
    opt = _optimizer(model, growth, lr=3e-2 if growth == "ag" else 0.3)
    scheduler = SpIELScheduler(model, opt, total_steps=T)
    x = _batch(0, n=4, length=10)
    model.train()
    losses, changed_at = [], []
    for step in range(1, T + 1):
        loss = _loss(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        before = [l.sparse_indices["default"].clone() for l in sparse_layers(model)]
        scheduler.step()
        losses.append(loss.item())
        if any(not torch.equal(b, l.sparse_indices["default"]) for b, l in zip(before, sparse_layers(model))):
            changed_at.append(step)
    assert changed_at == [s for s in range(1, T + 1) if is_reselection_step(s, S, gamma, T)] == [3, 11, 19, 27, 35]
    assert losses[-1] < 0.25 * losses[0], losses
    for layer in sparse_layers(model):
        idx = layer.sparse_indices["default"]
        assert idx.dtype == torch.int32 and bool((idx[1:] > idx[:-1]).all())
        assert layer.sparse_ages["default"].dtype == torch.int32
        assert set(layer.sparse_ages["default"].unique().tolist()) <= {3, 11, 19, 27, 35}


def test_optimizer_keeps_the_same_parameters_and_state_objects():
    model = _spiel()
    opt = _optimizer(model, "ag")
    scheduler = SpIELScheduler(model, opt, total_steps=10)
    params = [p for g in opt.param_groups for p in g["params"]]
    model.train()
    for step in range(3):
        _loss(model, _batch(step)).backward()
        opt.step()
        opt.zero_grad()
        if step == 1:
            states = {id(p): (opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]) for p in params}
        scheduler.step()
    assert [p for g in opt.param_groups for p in g["params"]] == params
    assert all(l.sparse_values["default"] is p for l, p in zip(sparse_layers(model), params))
    assert all(opt.state[p]["exp_avg"] is states[id(p)][0] for p in params)


# ------------------------------------------------------------------------------------------- accumulation
def test_accumulating_two_micro_batches_selects_like_one_concatenated_batch():
    S, gamma, T = 4, 2, 9
    results = []
    for accumulation in (1, 2):
        model = _spiel(dtype=torch.float64, density=0.05, reselection_steps=S, gradient_estimation_steps=gamma,
                       candidate_ratio=1000.0, values_dtype="float64", score_normalization="none")  # fmt: skip
        # (the column scale, like the candidates, comes from the window's first micro-batch: with
        # score_normalization='column' the choice depends on how the first step is split)
        opt = _optimizer(model, "ag", lr=1e-2)
        scheduler = SpIELScheduler(model, opt, total_steps=T)
        model.train()
        for step in range(T):
            x = _batch(step, n=8)
            tokens = x[:, 1:].numel()
            for part in x.chunk(accumulation):
                _loss(model, part, total_tokens=tokens).backward()
            opt.step()
            opt.zero_grad()
            scheduler.step()
        results.append([(l.sparse_indices["default"].clone(), l.sparse_values["default"].detach().clone()) for l in sparse_layers(model)])
    for (i1, v1), (i2, v2) in zip(*results):
        assert torch.equal(i1, i2)
        torch.testing.assert_close(v1, v2, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------------------------- errors and guard
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"growth": "rigl"}, "growth='rigl'"),
        ({"reselection_steps": 0}, "reselection_steps=0"),
        ({"gradient_estimation_steps": 0}, "gradient_estimation_steps=0"),
        ({"gradient_estimation_steps": 20, "reselection_steps": 20}, "gradient_estimation_steps=20 and reselection_steps=20"),
        ({"initial_reselection_rate": 0.0}, "initial_reselection_rate=0.0"),
        ({"initial_reselection_rate": 1.5}, "initial_reselection_rate=1.5"),
        ({"candidate_ratio": 0.5}, "candidate_ratio=0.5"),
        ({"candidate_ratio": float("inf")}, "candidate_ratio=inf"),
        ({"candidate_ratio": "2"}, "candidate_ratio='2'"),
        ({"candidate_ratio": None}, "candidate_ratio=None"),
        ({"initial_reselection_rate": "0.2"}, "initial_reselection_rate='0.2'"),
        ({"initial_reselection_rate": True}, "initial_reselection_rate=True"),
        ({"initial_reselection_rate": float("nan")}, "initial_reselection_rate=nan"),
        ({"schedule": "step"}, "schedule='step'"),
        ({"init": "magnitude"}, "init='magnitude'"),
    ],
)
def test_bad_spiel_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpIELConfig(target_modules="all-linear", density=0.1, **kwargs)


@pytest.mark.parametrize("block_shape", [(1, 1), (4, 4)])
def test_window_candidates_follow_the_candidate_ratio(block_shape):
    """An AG window keeps K = ⌈candidate_ratio · d_φ⌉ growth candidates per tensor (in whole blocks for
    block adapters), rounded up — not ⌈⌊ratio · d_φ⌋⌉."""
    unit = block_shape[0] * block_shape[1]
    config = SpIELConfig(target_modules=["q_proj", "v_proj"], num_tunable_weights=2 * 2 * 7 * unit, candidate_ratio=1.5,
                         reselection_steps=4, gradient_estimation_steps=2, block_shape=block_shape)  # fmt: skip
    model = get_peft_model(tiny_llama(), config)
    scheduler = SpIELScheduler(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2), total_steps=20)
    layers = [layer for layer in model.modules() if isinstance(layer, SparseLayer)]
    counts = [layer.sparse_values["default"].numel() // unit for layer in layers]
    assert any(n % 2 for n in counts)  # (an odd count: 1.5·n is not whole)
    for layer, n in zip(layers, counts):
        assert scheduler.statistics[layer.module_name].num_candidate_units == min(math.ceil(1.5 * n), layer.numel // unit)


def test_stepping_past_total_steps_warns_once():
    """The schedule ends at total_steps: a step past it warns once, and no reselection happens after it."""
    model = _spiel()
    scheduler = SpIELScheduler(model, _optimizer(model, "ag"), total_steps=3)
    for _ in range(3):
        scheduler.step()
    indices = [layer.sparse_indices["default"].clone() for layer in model.modules() if isinstance(layer, SparseLayer)]
    with pytest.warns(UserWarning, match=r"step 4 is past total_steps=3"):
        scheduler.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(30):
            assert scheduler.step() == {}
    after = [layer.sparse_indices["default"] for layer in model.modules() if isinstance(layer, SparseLayer)]
    assert all(torch.equal(a, b) for a, b in zip(indices, after))


def test_bad_scheduler_arguments():
    model = _spiel()
    opt = _optimizer(model, "ag")
    for bad in (0, -3):
        with pytest.raises(ValueError, match=f"total_steps={bad}"):
            SpIELScheduler(model, opt, total_steps=bad)
    from peft_sparse import SparseFTConfig

    sft = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.1))
    with pytest.raises(ValueError, match="needs a model with a SpIEL adapter"):
        SpIELScheduler(sft, torch.optim.AdamW([p for p in sft.parameters() if p.requires_grad]), total_steps=10)
    with pytest.raises(ValueError, match="does not hold the SpIEL values"):
        SpIELScheduler(model, torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]), total_steps=10)


def test_a_scheduler_whose_optimizer_was_flattened_after_creation_is_refused_at_reselection():
    """accelerator.prepare under DeepSpeed or FSDP with flattened parameters re-groups the optimizer it was given:
    a scheduler created before that would edit state nobody steps. The next reselection refuses, naming the step."""
    model = _spiel()
    opt = _optimizer(model, "ag")
    scheduler = SpIELScheduler(model, opt, total_steps=20)
    values = [p for g in opt.param_groups for p in g["params"]]
    flat = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in values]))
    opt.param_groups[0]["params"] = [flat]  # (what a flattening wrapper leaves in the optimizer)
    model.train()
    before = [layer.sparse_indices["default"].clone() for layer in sparse_layers(model)]
    with pytest.raises(ValueError, match=r"at step 2 the optimizer no longer holds the SpIEL values .*accelerator\.prepare"):
        for step in range(3):
            x = _batch(step)
            model(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
            scheduler.step()
    assert all(torch.equal(a, layer.sparse_indices["default"]) for a, layer in zip(before, sparse_layers(model)))


def test_training_without_a_scheduler_warns_once():
    model = _spiel(gradient_estimation_steps=2)
    model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            _loss(model, _batch(step)).backward()
    hits = [w for w in caught if "no SpIELScheduler attached" in str(w.message)]
    assert len(hits) == 1
    model2 = _spiel(gradient_estimation_steps=2)
    scheduler = SpIELScheduler(model2, _optimizer(model2, "ag"), total_steps=20)  # noqa: F841
    model2.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            _loss(model2, _batch(step)).backward()
    assert not [w for w in caught if "no SpIELScheduler attached" in str(w.message)]


@pytest.mark.fast_only  # (the steady pass skips an idle guard)
def test_the_guard_idles_while_a_scheduler_lives_and_a_copy_gets_its_own():
    """While a scheduler drives the adapter the guard is idle, and steady passes call no idle observer;
    it wakes when the last attached scheduler is gone (not when an older one goes while a newer one
    lives). A copy of the model taken meanwhile has a guard of its own, attached to nothing."""
    import gc
    import pickle

    model = _spiel(gradient_estimation_steps=2, training_merge=True)  # (steady passes: the training merge's)
    layers = sparse_layers(model)
    guard = layers[0].training_observer
    assert guard is not None and all(layer.training_observer is guard for layer in layers) and not guard.idle
    opt = _optimizer(model, "ag")
    scheduler = SpIELScheduler(model, opt, total_steps=20)
    assert guard.idle

    class Observer:
        idle = True

        def __init__(self):
            self.calls = 0

        def __call__(self, layer):
            self.calls += 1

    observer = layers[1].training_observer = Observer()
    model.train()
    for step in range(3):
        _loss(model, _batch(step)).backward()
        opt.step()
        opt.zero_grad()
    assert layers[1]._steady is not None
    calls = observer.calls  # (the full passes before the layer was steady call it)
    _loss(model, _batch(3)).backward()
    assert observer.calls == calls  # a steady pass skips an idle observer
    observer.idle = False
    _loss(model, _batch(4)).backward()
    assert observer.calls == calls + 1
    opt.zero_grad()
    layers[1].training_observer = guard

    clone = copy.deepcopy(model)
    own = sparse_layers(clone)[0].training_observer
    assert own is not guard and not own.idle and own.scheduler is None
    assert all(layer.training_observer is own for layer in sparse_layers(clone))
    assert pickle.loads(pickle.dumps(guard)).scheduler is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            _loss(clone, _batch(step)).backward()
    assert len([w for w in caught if "no SpIELScheduler attached" in str(w.message)]) == 1

    twin = copy.deepcopy(scheduler)  # (with its own copy of the model, whose guard it drives)
    twin_guard = sparse_layers(twin.model)[0].training_observer
    assert twin_guard is not guard and twin_guard.idle and twin_guard.scheduler() is twin and guard.scheduler() is scheduler
    del twin
    gc.collect()
    assert not twin_guard.idle and guard.idle

    newer = SpIELScheduler(model, opt, total_steps=20)
    del scheduler
    gc.collect()
    assert guard.idle  # (the newer one lives)
    del newer
    gc.collect()
    assert not guard.idle
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            _loss(model, _batch(step)).backward()
    assert len([w for w in caught if "no SpIELScheduler attached" in str(w.message)]) == 1

    # a scheduler closed (as the Trainer callback closes it at the end of training) stops driving the adapter
    # while it is still held: training on without one is watched again
    guard.warned = False
    held = SpIELScheduler(model, opt, total_steps=20)
    assert guard.idle
    held.close()
    assert not guard.idle and guard.scheduler is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            _loss(model, _batch(step)).backward()
    assert len([w for w in caught if "no SpIELScheduler attached" in str(w.message)]) == 1 and held is not None


def test_state_dict_round_trip_inside_a_window():
    model = _spiel(reselection_steps=6, gradient_estimation_steps=3)
    opt = _optimizer(model, "ag")
    scheduler = SpIELScheduler(model, opt, total_steps=20)
    _run(model, opt, scheduler, 2)
    state = scheduler.state_dict()
    assert state["armed"] and state["t"] == 2 and state["steps_in_window"] == 2
    other = SpIELScheduler(model, opt, total_steps=20)
    other.load_state_dict(state)
    for name, stats in scheduler.statistics.items():
        for key, value in stats.tensors().items():
            assert torch.equal(other.statistics[name].tensors()[key], value)
    with pytest.raises(ValueError, match="total_steps=20"):
        SpIELScheduler(model, opt, total_steps=30).load_state_dict(state)


def test_a_state_from_another_world_size_loads_and_a_changed_schedule_names_the_world_sizes(tmp_path):
    """The scheduler's state is the same on every rank (window sums are averaged every step), so a checkpoint
    written by 2 processes resumes in 1 exactly when max_steps carries over; when the schedule changed, the error
    names both world sizes and the fix."""
    import json

    model = _spiel(reselection_steps=6, gradient_estimation_steps=3)
    opt = _optimizer(model, "ag")
    scheduler = SpIELScheduler(model, opt, total_steps=20)
    _run(model, opt, scheduler, 2)
    scheduler.save(tmp_path)
    path = tmp_path / "spiel_scheduler.json"
    saved = json.loads(path.read_text())
    assert saved["world_size"] == 1
    saved["world_size"] = 2  # (as rank 0 of a 2-process run writes it)
    path.write_text(json.dumps(saved))
    other = SpIELScheduler(model, opt, total_steps=20)
    other.load(tmp_path)
    assert other.t == 2
    for name, stats in scheduler.statistics.items():
        for key, value in stats.tensors().items():
            assert torch.equal(other.statistics[name].tensors()[key], value)
    with pytest.raises(ValueError, match=r"total_steps=20.*written by 2 process\(es\) and this run has 1.*max_steps"):
        SpIELScheduler(model, opt, total_steps=40).load(tmp_path)


@pytest.mark.parametrize("max_norm", [None, 0.05])
def test_seeds_are_written_at_the_next_step_in_the_units_the_optimizer_sees(max_norm):
    """Grown slots' Adam second moments: ŝ·(1−β₂ᵗ) times the next step's clip factor c²; the first stays 0."""
    S, gamma, T = 6, 2, 12
    model = _spiel(reselection_steps=S, gradient_estimation_steps=gamma)
    opt = _optimizer(model, "ag")
    scheduler = SpIELScheduler(model, opt, total_steps=T)
    params = [l.sparse_values["default"] for l in sparse_layers(model)]
    model.train()
    for step in range(1, gamma + 2):
        _loss(model, _batch(step)).backward()
        if step == gamma + 1:
            raw = torch.sqrt(sum(p.grad.square().sum() for p in params))
            pending = dict(scheduler.seeding.pending)
            assert pending, "the reselection left no seeds"
            moments = {id(p): (opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()) for p in params}
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        if step == gamma + 1:
            seen = torch.sqrt(sum(p.grad.square().sum() for p in params))
            grads = {id(p): p.grad.clone() for p in params}
        opt.step()
        opt.zero_grad()
        scheduler.step()
    c = float(seen / raw)
    assert (c == 1.0) if max_norm is None else (c < 0.5)
    assert float(scheduler.seeding.last_factor) == pytest.approx(c, rel=1e-6)
    t = gamma  # Adam's step count when the seeds were written
    for p in params:
        slots, g_hat, s_hat, age = pending[id(p)]
        assert age == gamma
        m = 0.1 * grads[id(p)][slots]
        v = 0.999 * (c * c * s_hat * (1 - 0.999**t)) + 0.001 * grads[id(p)][slots] ** 2
        torch.testing.assert_close(opt.state[p]["exp_avg"][slots], m, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"][slots], v, rtol=1e-5, atol=1e-12)
        assert (moments[id(p)][0][slots] == 0).all()  # zero between the reselection and the next step


@pytest.mark.parametrize("save_ages", [True, False])
def test_a_reloaded_trainable_adapter_keeps_training_with_its_ages_or_from_age_0(tmp_path, save_ages):
    """save_pretrained(save_ages=True) keeps every index's age; a plain save holds none, and the reloaded
    adapter trains on with every index counted as initial (age 0)."""
    from peft import PeftModel

    model = _spiel(reselection_steps=4, gradient_estimation_steps=2)
    opt = _optimizer(model, "ag")
    scheduler = SpIELScheduler(model, opt, total_steps=8)
    _run(model, opt, scheduler, 3)
    model.save_pretrained(tmp_path, save_ages=save_ages)
    saved_ages = [l.sparse_ages["default"].clone() for l in sparse_layers(model)]
    assert any((a == 2).any() for a in saved_ages)

    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path, is_trainable=True)
    want = saved_ages if save_ages else [torch.zeros_like(a) for a in saved_ages]
    assert all(torch.equal(a, l.sparse_ages["default"]) for a, l in zip(want, sparse_layers(loaded)))
    opt2 = _optimizer(loaded, "ag")
    scheduler2 = SpIELScheduler(loaded, opt2, total_steps=8)
    loaded.train()
    before = [l.sparse_indices["default"].clone() for l in sparse_layers(loaded)]
    for step in range(3):
        _loss(loaded, _batch(10 + step)).backward()
        opt2.step()
        opt2.zero_grad()
        scheduler2.step()
    assert any(not torch.equal(b, l.sparse_indices["default"]) for b, l in zip(before, sparse_layers(loaded)))


@pytest.mark.fast_only  # (the batched reselection's device flag)
@pytest.mark.parametrize("block_shape", [(1, 1), (4, 4)])
@pytest.mark.parametrize("at", [2, 8], ids=["first-reselection", "partial-reselection"])
def test_a_nan_window_gradient_raises_at_the_reselection_with_the_adapter_untouched(block_shape, at):
    """The reselection's edits are conditioned on its flag on the device, read once at the end: with a
    NaN in one tensor's window sums it raises, and values, indices, ages, optimizer moments, the base
    weights (merged in place for training; one moved to new storage holding θ₀, which the reselection
    merged anew), the block layouts (the same objects) and the seeds waiting for the next step are all
    as they were."""
    model = _spiel("ag", block_shape=block_shape, density=0.1, training_merge=True)
    opt = _optimizer(model, "ag")
    scheduler = SpIELScheduler(model, opt, total_steps=20)
    _run(model, opt, scheduler, at - 1)  # the first step of the reselection's window (γ=2): statistics exist
    stats = max(scheduler.statistics.values(), key=lambda s: s.grad_sum.numel())  # (a tensor with units to replace)
    stats.grad_sum[3] = float("nan")  # as if a NaN gradient had reached one tensor's window sums
    model.train()
    _loss(model, _batch(1)).backward()
    opt.step()
    opt.zero_grad()
    layers = sparse_layers(model)
    moved = layers[1]  # θ₀ moved to new storage since the last pass: the reselection sets its merge up anew
    weight, merge = moved.get_base_layer().weight, moved._training_merge
    theta0 = weight.detach().clone()
    theta0.view(-1)[merge.indices.long()] = merge.base
    weight.data = theta0
    waiting = {id(layers[0].sparse_values["default"]): (torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.zeros(0))}
    scheduler.seeding.pending.update(waiting)  # seeds of an earlier reselection that no step has taken yet
    before = {m.module_name: (m.sparse_indices["default"].clone(), m.sparse_values["default"].detach().clone(),
                              m.sparse_ages["default"].clone(), m.get_base_layer().weight.detach().clone(),
                              m.cached_block_metadata("default"),
                              [opt.state[m.sparse_values["default"]][k].clone() for k in ("exp_avg", "exp_avg_sq")])
              for m in layers}  # fmt: skip
    assert sum(m._training_merge is not None for m in layers) > 0
    with pytest.raises(ValueError, match="NaN"):
        scheduler.step()  # t = at: the reselection
    for m in layers:
        indices, values, ages, weight, layout, moments = before[m.module_name]
        assert torch.equal(m.sparse_indices["default"], indices)
        assert torch.equal(m.sparse_values["default"].detach(), values)
        assert torch.equal(m.sparse_ages["default"], ages)
        assert torch.equal(m.get_base_layer().weight.detach(), weight)
        assert m.cached_block_metadata("default") is layout
        for key, moment in zip(("exp_avg", "exp_avg_sq"), moments):
            assert torch.equal(opt.state[m.sparse_values["default"]][key], moment)
    assert scheduler.seeding.pending == waiting


def test_a_shortfall_is_reselected_tensor_by_tensor_and_reported():
    """Too few eligible candidates (impossible with SpIEL's own K ≥ d_φ, so forced here) send the
    reselection down the checked per-tensor path: the result equals reselect_ag's, and is reported."""
    from peft_sparse.methods.spiel.selection import reselect_ag

    model = _spiel("ag")
    opt = _optimizer(model, "ag")
    scheduler = SpIELScheduler(model, opt, total_steps=20)
    _run(model, opt, scheduler, 1)
    layer = sparse_layers(model)[0]
    stats = scheduler.statistics[layer.module_name]
    keep = torch.arange(3)  # only 3 candidates left for the first layer
    stats.candidates = stats.candidates[keep].clone()
    stats.step_sum, stats.grad_sum, stats.grad_sq_sum = (x[keep].clone() for x in (stats.step_sum, stats.grad_sum, stats.grad_sq_sum))
    model.train()
    _loss(model, _batch(1)).backward()
    opt.step()
    opt.zero_grad()
    values, indices = layer.sparse_values["default"].detach().clone(), layer.sparse_indices["default"].clone()
    d = values.numel()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grad_sum = stats.grad_sum + stats.step_sum  # the window's sums once its last step is added
        want = reselect_ag(values, indices, d, stats.candidates, grad_sum.abs())
        logged = scheduler.step()  # t = γ: full replacement wanted, only 3 growable
    assert want.shortfall == d - 3
    assert logged["spiel/shortfall"] == d - 3
    assert any("fewer weights replaced" in str(w.message) for w in caught)
    assert torch.equal(layer.sparse_indices["default"].long(), want.indices)
    new_values = layer.sparse_values["default"].detach()
    grown = want.source < 0
    assert torch.equal(new_values[grown], torch.zeros(int(grown.sum())))
    assert torch.equal(new_values[~grown], values[want.source[~grown]])


def test_sm3_state_reloads_exactly_over_bfloat16_values():
    """A saved SM3 state loads back with its float32 accumulators and momentum unrounded (torch's loader
    would cast them to the bfloat16 parameters' dtype), into tensors of its own, and training resumes
    exactly as it would have gone on."""
    torch.manual_seed(0)
    values = torch.nn.Parameter(torch.zeros(30, dtype=torch.bfloat16))
    dense = torch.nn.Parameter(torch.zeros(4, 5, dtype=torch.bfloat16))
    opt = SM3([values, dense], lr=0.05, momentum=0.5)
    grads = [(torch.randn(30).bfloat16(), torch.randn(4, 5).bfloat16()) for _ in range(4)]
    for gv, gd in grads[:2]:
        values.grad, dense.grad = gv.clone(), gd.clone()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    twin_values, twin_dense = (torch.nn.Parameter(p.detach().clone()) for p in (values, dense))
    twin = SM3([twin_values, twin_dense], lr=0.05, momentum=0.5)
    twin.load_state_dict(saved)
    for p, q in ((values, twin_values), (dense, twin_dense)):
        for key, value in opt.state[p].items():
            if key != "step":
                assert value.dtype == torch.float32 and torch.equal(twin.state[q][key], value), key
                assert twin.state[q][key].data_ptr() != saved["state"][0 if p is values else 1][key].data_ptr()
    for gv, gd in grads[2:]:
        for o, (v, d) in ((opt, (values, dense)), (twin, (twin_values, twin_dense))):
            v.grad, d.grad = gv.clone(), gd.clone()
            o.step()
    assert torch.equal(values, twin_values) and torch.equal(dense, twin_dense)


@pytest.mark.fast_only  # (it switches the paths itself)
@pytest.mark.parametrize("block_shape", [(1, 1), (4, 4)])
@pytest.mark.parametrize("growth", ["ag", "ma"])
def test_training_is_bit_identical_on_the_fast_and_reference_paths(growth, block_shape):
    """SpIEL through three reselections with every fast path on (training merge, steady memos, input
    rebuilds, the batched reselection) and with peft_sparse.fast_paths(False): the same bits."""
    import peft_sparse

    results = []
    for fast in (True, False):
        with peft_sparse.fast_paths(fast):
            model = _spiel(growth, block_shape=block_shape, density=0.1)
            for layer in sparse_layers(model):
                layer.merge_for_training = True
            opt = _optimizer(model, growth)
            scheduler = SpIELScheduler(model, opt, total_steps=20)
            _run(model, opt, scheduler, 16)
            results.append([(m.sparse_indices["default"].clone(), m.sparse_values["default"].detach().clone()) for m in sparse_layers(model)])
    for (ia, va), (ib, vb) in zip(*results):
        assert torch.equal(ia, ib)
        assert torch.equal(va, vb)
