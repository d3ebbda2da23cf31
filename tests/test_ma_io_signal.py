"""SpIEL-MA's input/output growth signal (``ma_signal='io'``): the core's factor seam, the window sums against
hooks on the layers, the reselections they rank, exact resume, and the config's checks."""

import pytest
import torch
import torch.nn as nn
from peft import get_peft_model

import peft_sparse
from peft_sparse import SM3, SparseLayer, SpIELConfig, SpIELScheduler
from peft_sparse.core.layer import SparseLinear
from peft_sparse.core.selection import BlockGrid
from peft_sparse.core.tuner import SparseTuner
from peft_sparse.methods.spiel.selection import reselect_ma
from peft_sparse.methods.spiel.statistics import InputOutputStatistics
from peft_sparse.methods.spiel.config import IO_FULL_REPLACEMENT_MIN_FOLLOWING
from peft_sparse.schedules.reselection import is_reselection_step, replacement_count

from .models import inputs, sparse_layers, tiny_llama

BLOCK_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class _Factors:
    """A consumer that takes dW's factors: records G and X as handed over."""

    takes_factors = True

    def __init__(self):
        self.calls = []

    def add_factors(self, g2, x2, x_factor=None):
        self.calls.append((g2.clone(), (x2 if x_factor is None else x2 * x_factor).clone()))

    def __call__(self, layer, dense):  # pragma: no cover - a linear layer never hands dW to it
        raise AssertionError("a factor consumer got the dense gradient")


@pytest.mark.parametrize("training_merge", [False, True])
def test_a_factor_consumer_gets_g_and_x_and_leaves_the_value_gradients_as_they_are(training_merge):
    torch.manual_seed(0)
    linear = nn.Linear(7, 5).requires_grad_(False)
    layer = SparseLinear(linear, "layer")
    layer.update_layer("default", torch.tensor([0, 3, 9, 17, 22, 34]), torch.float32)
    layer.training_merge = training_merge
    layer.train()
    with torch.no_grad():
        layer.sparse_values["default"].copy_(torch.randn(6))
    x = torch.randn(2, 3, 7)
    grad = torch.randn(2, 3, 5)
    layer(x).backward(grad)  # (a first pass: a training merge is set up)
    layer.sparse_values["default"].grad = None
    layer(x).backward(grad)
    plain = layer.sparse_values["default"].grad.clone()
    layer.sparse_values["default"].grad = None
    consumer = _Factors()
    layer.dense_grad_consumer = consumer
    layer(x).backward(grad)
    assert layer.dense_grad_count == 0 and len(consumer.calls) == 1  # (no dense gradient formed)
    g2, x2 = consumer.calls[0]
    torch.testing.assert_close(g2, grad.reshape(-1, 5), rtol=0, atol=0)
    torch.testing.assert_close(x2, x.reshape(-1, 7), rtol=0, atol=0)
    assert torch.equal(layer.sparse_values["default"].grad, plain)


def _llama_ma(block_shape=(1, 1), **kwargs):
    fields = dict(target_modules=BLOCK_TARGETS, density=0.25, growth="ma", ma_signal="io", block_shape=block_shape,
                  reselection_steps=4, gradient_estimation_steps=2, initial_reselection_rate=0.5)  # fmt: skip
    fields.update(kwargs)
    return get_peft_model(tiny_llama(hidden_size=64, intermediate_size=128), SpIELConfig(**fields))


class _Reference:
    """Σ (∂L/∂Y)² per output and Σ X² per input of every sparse layer, from hooks on the modules (float64)."""

    def __init__(self, model):
        self.sums = {}
        self.on = False
        for layer in sparse_layers(model):
            layer.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if not self.on:
            return
        x = args[0].detach().double().reshape(-1, module.in_features)
        rows, cols = self.sums.setdefault(module.module_name, [torch.zeros(module.out_features, dtype=torch.float64),
                                                              torch.zeros(module.in_features, dtype=torch.float64)])  # fmt: skip
        cols += (x * x).sum(0)

        def on_grad(g):
            rows.add_((g.double().reshape(-1, module.out_features) ** 2).sum(0))

        output.register_hook(on_grad)


@pytest.mark.parametrize("block_shape", [(1, 1), (16, 16)])
def test_io_sums_match_hooks_and_rank_the_reselections(block_shape):
    """Over each window the scheduler's sums equal Σ G² and Σ X² recorded by hooks on the layers (inputs of the
    down projections are rebuilt from their factors); every reselection chooses what ``reselect_ma`` chooses from
    those reference sums, and the reference path (fast paths off) the same indices."""

    def run():
        torch.manual_seed(0)
        model = _llama_ma(block_shape)
        if block_shape != (1, 1):  # (the block kernel: down_proj's input reaches the consumer as its two factors)
            for m in sparse_layers(model):
                m.value_grad_method = "block"
        reference = _Reference(model)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = SM3(params, lr=0.1)
        total = 12
        scheduler = SpIELScheduler(model, opt, total_steps=total)
        layers = scheduler.layers
        x = inputs(batch=4, length=9)
        model.train()
        checked = 0
        for step in range(1, total + 1):
            reference.on = scheduler._in_window(step)
            if not reference.on:
                reference.sums = {}
            for micro in range(2):  # (two micro-batches per step: the sums add over both)
                xb = x[micro * 2 : micro * 2 + 2]
                model(xb, labels=xb).loss.backward()
            opt.step()
            opt.zero_grad()
            before = {m.module_name: (m.sparse_values["default"].detach().clone(), m.sparse_indices["default"].clone()) for m in layers}
            signal = {name: (s.row_sum.double().clone(), s.col_sum.double().clone()) for name, s in scheduler.statistics.items()}
            report = scheduler.step()
            if not report:
                continue
            assert set(signal) == {m.module_name for m in layers}
            for m in layers:
                rows, cols = reference.sums[m.module_name]
                torch.testing.assert_close(signal[m.module_name][0], rows, rtol=1e-5, atol=1e-12)
                torch.testing.assert_close(signal[m.module_name][1], cols, rtol=1e-5, atol=1e-12)
                assert (rows > 0).all() and (cols > 0).all()  # (every row and column seen, active or not)
                values, indices = before[m.module_name]
                grid = SparseTuner.grid(scheduler.config, m)
                k = replacement_count(step, total, values.numel() // grid.unit, 0.5, "linear", scheduler.gamma, scheduler.first_full)
                want = reselect_ma(values, indices, k, rows, cols, grid)
                assert torch.equal(m.sparse_indices["default"].long(), want.indices), (step, m.module_name)
                checked += 1
            reference.sums = {}
        assert checked >= 3 * len(layers)
        return [m.sparse_indices["default"].clone() for m in layers]

    fast = run()
    with peft_sparse.fast_paths(False):
        slow = run()
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))


def test_block_ma_io_grows_outside_the_rows_and_columns_of_its_blocks():
    """SM3's accumulators are zero outside the block rows and columns the mask has held, so block MA's growth
    stays in that cross; the io signal sees every row and column and grows blocks outside it."""

    def outside(signal):
        torch.manual_seed(0)
        model = _llama_ma((16, 16), ma_signal=signal, density=0.1)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = SM3(params, lr=0.1)
        scheduler = SpIELScheduler(model, opt, total_steps=12)
        grids = [BlockGrid(m.out_features, m.in_features, (16, 16)) for m in scheduler.layers]
        held = [set(torch.unique(g.block_of(m.sparse_indices["default"])).tolist()) for g, m in zip(grids, scheduler.layers)]
        x = inputs(batch=4, length=9)
        model.train()
        found = 0
        for _ in range(12):
            model(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
            cross = [{r * g.cols + c for r in {b // g.cols for b in h} for c in {b % g.cols for b in h}} for g, h in zip(grids, held)]
            scheduler.step()
            now = [set(torch.unique(g.block_of(m.sparse_indices["default"])).tolist()) for g, m in zip(grids, scheduler.layers)]
            found += sum(len(n - c) for n, c in zip(now, cross))
            held = [h | n for h, n in zip(held, now)]
        return found

    assert outside("sm3") == 0
    assert outside("io") > 0


def test_io_statistics_of_an_embedding_are_the_marginals_of_its_dense_gradient():
    torch.manual_seed(0)
    stats = InputOutputStatistics(5, 3, "cpu")
    dense = torch.randn(5, 3)
    stats(None, dense)
    stats(None, 2 * dense)
    torch.testing.assert_close(stats.row_sum, 5 * (dense**2).sum(1))
    torch.testing.assert_close(stats.col_sum, 5 * (dense**2).sum(0))
    assert stats.seen == 2


def train(model, opt, scheduler, steps, first=0):
    model.train()
    for step in range(first, first + steps):
        x = inputs(seed=step, batch=2, length=9)
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()


def resume(model, opt, path, total_steps=12) -> tuple:
    """A new AdamW with ``opt``'s state and a new scheduler loaded from ``path`` (``opt``'s scheduler closed first)."""
    state = opt.state_dict()
    opt2 = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    opt2.load_state_dict(state)
    scheduler = SpIELScheduler(model, opt2, total_steps=total_steps)
    scheduler.load(path)
    return opt2, scheduler


@pytest.mark.parametrize("stop", [5, 7])  # (inside a window: reselections at 2, 6, 10; between windows)
def test_ma_io_resumes_exactly(stop, tmp_path):
    def fresh():
        torch.manual_seed(0)
        model = _llama_ma((16, 16))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        return model, opt, SpIELScheduler(model, opt, total_steps=12)

    model, opt, scheduler = fresh()
    train(model, opt, scheduler, 12)
    expected = {k: v.clone() for k, v in model.state_dict().items() if "sparse_" in k}
    model, opt, scheduler = fresh()
    train(model, opt, scheduler, stop)
    assert bool(scheduler.statistics) == (stop == 5)
    scheduler.save(tmp_path / "sched")
    scheduler.close()
    opt2, scheduler = resume(model, opt, tmp_path / "sched")
    train(model, opt2, scheduler, 12 - stop, first=stop)
    got = {k: v for k, v in model.state_dict().items() if "sparse_" in k}
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    # a state saved inside an io window does not load into an SM3-signal scheduler, nor the other way round
    if stop == 5:
        torch.manual_seed(0)
        other = _llama_ma((16, 16), ma_signal="sm3")
        opt3 = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad], lr=1e-2)
        with pytest.raises(ValueError, match="window is open after step 5, but none is scheduled"):
            SpIELScheduler(other, opt3, total_steps=12).load(tmp_path / "sched")
        sm3_model, sm3_opt, sm3_sched = other, opt3, SpIELScheduler(other, opt3, total_steps=12)
        train(sm3_model, sm3_opt, sm3_sched, 5)
        sm3_sched.save(tmp_path / "sm3")
        model, opt, _ = fresh()
        with pytest.raises(ValueError, match="no estimation window open after step 5.*ma_signal='io'"):
            SpIELScheduler(model, opt, total_steps=12).load(tmp_path / "sm3")


def test_ma_io_beside_adamw_keeps_no_sm3_accumulators(tmp_path):
    """With ma_signal='io' nothing reads SM3's row and column accumulators beside AdamW: the scheduler keeps none
    (no per-step update), trains to the same bits as a run that keeps them, and resumes exactly from a state that
    holds them (saved by a scheduler that kept them)."""
    from peft_sparse.methods.spiel.statistics import RowColumnAccumulators

    def fresh(keep: bool):
        torch.manual_seed(0)
        model = _llama_ma((16, 16))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        scheduler = SpIELScheduler(model, opt, total_steps=12)
        assert scheduler.ma_accumulators is None and scheduler._ma_hook is None
        if keep:  # (what the scheduler kept before: the update at every optimizer step)
            scheduler.ma_accumulators = RowColumnAccumulators(scheduler.layers, "default")
            opt.register_step_pre_hook(scheduler.ma_accumulators.update)
        return model, opt, scheduler

    def sparse(model):
        return {k: v for k, v in model.state_dict().items() if "sparse_" in k}

    plain = fresh(False)
    train(*plain, 12)
    kept = fresh(True)
    train(*kept, 12)
    assert any(bool((r > 0).any()) for r, _ in kept[2].ma_accumulators.views.values())
    expected = sparse(plain[0])
    assert all(torch.equal(value, expected[key]) for key, value in sparse(kept[0]).items())
    model, opt, scheduler = fresh(True)
    train(model, opt, scheduler, 7)
    scheduler.save(tmp_path / "kept")
    scheduler.close()
    opt2, resumed = resume(model, opt, tmp_path / "kept")
    train(model, opt2, resumed, 5, first=7)
    assert all(torch.equal(value, expected[key]) for key, value in sparse(model).items())


def test_ma_signal_is_checked():
    assert SpIELConfig(target_modules="all-linear", density=0.1, growth="ma", ma_signal="io").ma_signal == "io"
    assert SpIELConfig(target_modules="all-linear", density=0.1, growth="ma").ma_signal == "sm3"
    with pytest.raises(ValueError, match="ma_signal must be 'sm3' or 'io', got ma_signal='grad'"):
        SpIELConfig(target_modules="all-linear", density=0.1, growth="ma", ma_signal="grad")
    with pytest.raises(ValueError, match="ma_signal='io' is a setting of SpIEL-MA's growth; got growth='ag'"):
        SpIELConfig(target_modules="all-linear", density=0.1, growth="ag", ma_signal="io")


def test_block_ma_defaults_to_io_and_unstructured_ma_and_ag_to_sm3():
    def signal(**kwargs):
        return SpIELConfig(target_modules="all-linear", density=0.1, **kwargs).ma_signal

    assert signal(growth="ma", block_shape=(64, 64)) == "io"
    assert signal(growth="ma", block_shape=(64, 8)) == "io"
    assert signal(growth="ma") == "sm3"
    assert signal(growth="ag") == "sm3" and signal(growth="ag", block_shape=(64, 64)) == "sm3"
    assert signal(growth="ma", block_shape=(64, 64), ma_signal="sm3") == "sm3"  # (a choice is kept)


def _following_reselections(config, T):
    """Reselections after the first in a run of T steps, counted off the schedule itself."""
    S, gamma = config.steps_for(T)
    return sum(is_reselection_step(t, S, gamma, T) for t in range(1, T + 1)) - 1


def test_auto_first_full_replacement_follows_the_reselections_after_it():
    """'auto': a full first replacement for SM3's signal and AG at any length; with ma_signal='io' only when at least
    IO_FULL_REPLACEMENT_MIN_FOLLOWING reselections follow the first (the paper's S = 20, γ = 5: from T = 86 on)."""
    block = SpIELConfig(target_modules="all-linear", density=0.1, growth="ma", block_shape=(64, 64))
    assert block.first_full_replacement == "auto"
    assert [block.first_replacement_is_full(T) for T in (60, 80, 85, 86, 100, 150, 600)] == [False] * 3 + [True] * 4
    for T in range(6, 700):
        assert block.first_replacement_is_full(T) == (_following_reselections(block, T) >= IO_FULL_REPLACEMENT_MIN_FOLLOWING), T
    counted = SpIELConfig(target_modules="all-linear", density=0.1, growth="ma", ma_signal="io", reselection_steps=4,
                          gradient_estimation_steps=2)  # fmt: skip
    for T in range(3, 40):
        assert counted.first_replacement_is_full(T) == (_following_reselections(counted, T) >= 4), T
    for other in (dict(growth="ma"), dict(growth="ag"), dict(growth="ag", block_shape=(64, 64))):
        config = SpIELConfig(target_modules="all-linear", density=0.1, **other)
        assert all(config.first_replacement_is_full(T) for T in (10, 60, 600)), other
    for given in (True, False):  # (a choice is kept)
        config = SpIELConfig(target_modules="all-linear", density=0.1, growth="ma", block_shape=(64, 64), first_full_replacement=given)
        assert all(config.first_replacement_is_full(T) == given for T in (60, 600))
    with pytest.raises(ValueError, match="first_full_replacement must be True, False or 'auto', got first_full_replacement='yes'"):
        SpIELConfig(target_modules="all-linear", density=0.1, first_full_replacement="yes")


@pytest.mark.parametrize("total,full", [(12, False), (24, True)])
def test_block_ma_by_default_replaces_all_at_gamma_only_when_enough_reselections_follow(total, full, tmp_path):
    """Block MA as configured by default (io, 'auto'): the scheduler's first reselection replaces every block when
    ≥ 4 reselections follow it (T = 24 with S = 4, γ = 2: five), else only k(γ) of the schedule (T = 12: two); the
    saved config keeps 'auto' and the resolved signal, so a reload trains the same way."""
    config = SpIELConfig(target_modules=BLOCK_TARGETS, density=0.25, growth="ma", block_shape=(16, 16), reselection_steps=4,
                         gradient_estimation_steps=2, initial_reselection_rate=0.5)  # fmt: skip
    model = get_peft_model(tiny_llama(hidden_size=64, intermediate_size=128), config)
    layers = sparse_layers(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = SM3(params, lr=0.1)
    scheduler = SpIELScheduler(model, opt, total_steps=total)
    assert scheduler.config.ma_signal == "io" and scheduler.first_full == full
    units = [m.sparse_indices["default"].numel() // 256 for m in layers]
    x = inputs(batch=4, length=9)
    model.train()
    for step in range(1, scheduler.gamma + 1):
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        report = scheduler.step()
    expected = sum(replacement_count(2, total, u, 0.5, "linear", 2, full) for u in units) * 256
    assert report["spiel/replaced"] == expected
    assert (expected == sum(u * 256 for u in units)) == full and expected > 0
    model.save_pretrained(tmp_path)
    from peft import PeftConfig

    loaded = PeftConfig.from_pretrained(tmp_path)
    assert loaded.ma_signal == "io" and loaded.first_full_replacement == "auto"
    assert loaded.first_replacement_is_full(total) == full


def test_ma_io_adapter_config_round_trips(tmp_path):
    model = _llama_ma((16, 16))
    model.save_pretrained(tmp_path)
    from peft import PeftConfig

    loaded = PeftConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, SpIELConfig) and loaded.ma_signal == "io"
    assert isinstance(sparse_layers(model)[0], SparseLayer)


def test_column_square_sums_widen_on_the_cpu_and_reduce_in_one_norm_form_alike():
    """The io sums' column reduction: on the CPU (and for float32 anywhere) the widened Σ t²; the norm form used for
    half precision on CUDA gives the same sums within float32 rounding (checked here on the CPU, where it can run)."""
    from peft_sparse.methods.spiel.statistics import column_square_sums

    torch.manual_seed(0)
    t = torch.randn(257, 33, dtype=torch.bfloat16)
    widened = (t.float() * t.float()).sum(0)
    assert torch.equal(column_square_sums(t, torch.float32), widened)
    assert torch.allclose(torch.linalg.vector_norm(t, 2, dim=0, dtype=torch.float32).square(), widened, rtol=1e-5, atol=0)
    assert column_square_sums(t, torch.float64).dtype == torch.float64
