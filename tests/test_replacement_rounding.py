"""``replacement_rounding``: k(t) per tensor as Eq. 7.6's floor, or the step's total apportioned over the tensors by
largest remainder: the counts against exact arithmetic, the scheduler's use of them (blocks, AG and MA), and the
config's checks and round-trip."""

import math
import random
from fractions import Fraction

import pytest
import torch
from peft import PeftConfig, get_peft_model

import peft_sparse.methods.spiel.scheduler as scheduler_module
from peft_sparse import SM3, SpIELConfig, SpIELScheduler
from peft_sparse.schedules.reselection import apportioned_replacement_counts, is_reselection_step, replacement_count

from .models import inputs, sparse_layers, tiny_llama

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _exact_rate(t, T, xi, schedule):
    if schedule == "linear":
        return Fraction(repr(xi)) * (T - t) / T
    return Fraction(xi / 2 * (1 + math.cos(math.pi * t / T)))


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_apportioned_counts_sum_to_the_steps_total_and_stay_within_one_of_each_quota(schedule):
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 12)
        d = [rng.choice([0, 1, 2, 3, 7, 10, 27]) for _ in range(n)]
        T, gamma, S = rng.randint(20, 400), rng.randint(1, 5), rng.randint(6, 20)
        xi = rng.choice([0.1, 0.2, 0.3, 0.5, 1.0])
        for t in range(gamma, T, S):
            counts = apportioned_replacement_counts(t, T, d, xi, schedule, gamma, True, turn=(t - gamma) // S)
            if t == gamma:
                assert counts == d  # the first reselection replaces everything
                continue
            rate = _exact_rate(t, T, xi, schedule)
            assert sum(counts) == math.floor(rate * sum(d)), (d, t, T, xi)
            for k, di in zip(counts, d):
                assert 0 <= k <= di
                assert math.floor(rate * di) <= k <= math.floor(rate * di) + 1
            # never fewer than the per-tensor floor of Eq. 7.6 (which can lose up to one unit per tensor), never more than one above
            per_tensor = [replacement_count(t, T, di, xi, schedule, gamma) for di in d]
            assert all(p <= k <= p + 1 for k, p in zip(counts, per_tensor))


def test_apportioned_counts_give_leftover_units_to_the_largest_remainders_and_rotate_ties():
    # ξ(t) = 0.4·(20 − 10)/20 = 0.2. Quotas 0.2·(3, 10, 1) = 0.6, 2, 0.2: floors 0, 2, 0 and total ⌊2.8⌋ = 2, nothing
    # left over. Quotas 0.2·(4, 10, 3) = 0.8, 2, 0.6: floors 0, 2, 0, total ⌊3.4⌋ = 3: the leftover unit to 0.8
    assert apportioned_replacement_counts(10, 20, [3, 10, 1], 0.4, "linear", 2) == [0, 2, 0]
    assert apportioned_replacement_counts(10, 20, [4, 10, 3], 0.4, "linear", 2) == [1, 2, 0]
    # ξ(t) = 0.25 over four tensors of 1 unit: one unit in all, the tensor whose turn it is
    d = [1, 1, 1, 1]
    seen = [apportioned_replacement_counts(15, 20, d, 1.0, "linear", 2, turn=turn) for turn in range(4)]
    assert seen == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    # a larger remainder wins over the turn: quotas 0.25·(1, 3) = 0.25, 0.75
    assert apportioned_replacement_counts(15, 20, [1, 3], 1.0, "linear", 2, turn=0) == [0, 1]
    # the first reselection follows the schedule when first_full_replacement is off: ξ(2) = 0.45, quotas 4.5 each
    assert apportioned_replacement_counts(2, 20, [10, 10], 0.5, "linear", 2, False) == [5, 4]
    assert apportioned_replacement_counts(2, 20, [10, 10], 0.5, "linear", 2, True) == [10, 10]
    with pytest.raises(ValueError, match="schedule='step'"):
        apportioned_replacement_counts(5, 20, [3], 0.2, "step", 2)
    with pytest.raises(ValueError, match="d_phis"):
        apportioned_replacement_counts(5, 20, [3, -1], 0.2, "linear", 2)


def _run(growth, rounding, monkeypatch, total=40):
    """Trains a tiny Llama with 16×16 blocks and records each reselection's k per tensor as the scheduler hands it to
    the selection (in blocks), with the reports."""
    config = SpIELConfig(target_modules=TARGETS, density=0.25, growth=growth, block_shape=(16, 16), reselection_steps=4,
                         gradient_estimation_steps=2, initial_reselection_rate=0.2, replacement_rounding=rounding)  # fmt: skip
    model = get_peft_model(tiny_llama(hidden_size=64, intermediate_size=128), config)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = SM3(params, lr=0.05) if growth == "ma" else torch.optim.AdamW(params, lr=1e-2)
    scheduler = SpIELScheduler(model, opt, total_steps=total)
    handed = []
    original = scheduler_module.TensorReselection

    def recording(values, indices, k, *args, **kwargs):
        handed.append((values, k))
        return original(values, indices, k, *args, **kwargs)

    monkeypatch.setattr(scheduler_module, "TensorReselection", recording)
    layers = sparse_layers(model)
    units = [m.sparse_indices["default"].numel() // 256 for m in layers]
    by_values = {id(m.sparse_values["default"]): at for at, m in enumerate(layers)}
    x = inputs(batch=4, length=9)
    model.train()
    ks, reports = {}, {}
    for step in range(1, total + 1):
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        handed.clear()
        report = scheduler.step()
        if is_reselection_step(step, scheduler.S, scheduler.gamma, total):
            k = [0] * len(layers)
            for values, count in handed:
                k[by_values[id(values)]] = count
            ks[step], reports[step] = k, report
    return scheduler, units, ks, reports


@pytest.mark.parametrize("growth", ["ag", "ma"])
def test_the_scheduler_replaces_the_apportioned_counts_where_the_per_tensor_floor_stops(growth, monkeypatch):
    scheduler, units, ks, reports = _run(growth, "apportioned", monkeypatch)
    _, units_pt, ks_pt, reports_pt = _run(growth, "per_tensor", monkeypatch)
    assert units == units_pt and len(set(units)) > 1
    assert sorted(ks) == sorted(ks_pt) == list(range(2, 40, 4))
    for t, k in ks.items():
        turn = (t - scheduler.gamma) // scheduler.S
        want = apportioned_replacement_counts(t, 40, units, 0.2, "linear", 2, scheduler.first_full, turn=turn)
        assert k == want, t
        assert reports[t]["spiel/replaced"] == sum(want) * 256
        per_tensor = [replacement_count(t, 40, u, 0.2, "linear", 2, scheduler.first_full) for u in units]
        assert ks_pt[t] == per_tensor, t
        assert reports_pt[t]["spiel/replaced"] == sum(per_tensor) * 256
    later = [t for t in ks if t > scheduler.gamma]
    small = [at for at, u in enumerate(units) if u <= 4]  # (2 and 4 blocks; the MLP's tensors hold 8)
    # the per-tensor floor never reselects the small tensors after the first reselection, and nothing from t = 18 on
    # (ξ(t)·8 < 1) ...
    assert all(ks_pt[t][at] == 0 for t in later for at in small)
    stopped = [t for t in later if sum(ks_pt[t]) == 0]
    assert stopped and stopped[0] < 20
    # ... while the apportioned counts replace ⌊ξ(t)·Σ d_φ⌋ blocks (every later reselection but the last, ξ(38)·72 < 1),
    # the small tensors among them
    assert all(sum(ks[t]) > 0 for t in later if t < 38)
    assert any(ks[t][at] for t in later for at in small)
    assert sum(map(sum, ks.values())) > sum(map(sum, ks_pt.values()))


def test_replacement_rounding_is_checked_by_name_and_round_trips(tmp_path):
    with pytest.raises(ValueError, match="replacement_rounding='nearest'"):
        SpIELConfig(target_modules=TARGETS, density=0.1, replacement_rounding="nearest")
    with pytest.raises(ValueError, match="replacement_rounding='apportioned'.*budget_split='adaptive'"):
        SpIELConfig(target_modules=TARGETS, density=0.1, replacement_rounding="apportioned", budget_split="adaptive")
    assert SpIELConfig(target_modules=TARGETS, density=0.1).replacement_rounding == "per_tensor"
    config = SpIELConfig(target_modules=TARGETS, density=0.25, block_shape=(16, 16), replacement_rounding="apportioned")
    model = get_peft_model(tiny_llama(hidden_size=64, intermediate_size=128), config)
    model.save_pretrained(tmp_path)
    loaded = PeftConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, SpIELConfig) and loaded.replacement_rounding == "apportioned"
