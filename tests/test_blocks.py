"""Block-structured selection: exact expected blocks on hand-built tensors, and block adapters end to end."""

import pytest
import torch
from peft import PeftModel, get_peft_model

from peft_sparse import SM3, SparseFTConfig, SpIELConfig, SpIELScheduler
from peft_sparse.core import kernels
from peft_sparse.core.selection import BlockGrid
from peft_sparse.methods.spiel.selection import reselect_ag, reselect_ma

from .models import inputs, randomize_values, sparse_layers, tiny_llama


def test_block_grid_expand_and_reduce():
    grid = BlockGrid(4, 6, (2, 3))  # 2×2 grid of 2×3 blocks
    assert grid.expand(torch.tensor([1])).tolist() == [3, 4, 5, 9, 10, 11]
    assert grid.expand(torch.tensor([2])).tolist() == [12, 13, 14, 18, 19, 20]
    assert grid.block_of(torch.tensor([0, 5, 13, 23])).tolist() == [0, 1, 2, 3]
    dense = torch.arange(24.0).view(4, 6)
    assert grid.reduce(dense).tolist() == [0 + 1 + 2 + 6 + 7 + 8, 3 + 4 + 5 + 9 + 10 + 11, 12 + 13 + 14 + 18 + 19 + 20, 15 + 16 + 17 + 21 + 22 + 23]
    with pytest.raises(ValueError, match=r"block_shape=\(3, 3\) does not tile a \(4, 6\) matrix"):
        BlockGrid(4, 6, (3, 3))


def test_block_ag_drops_and_grows_whole_blocks():
    grid = BlockGrid(4, 4, (2, 2))  # blocks: 0 = rows 0-1 cols 0-1, 1 = rows 0-1 cols 2-3, 2, 3 below
    indices = grid.expand(torch.tensor([0, 3])).to(torch.int32)  # [0,1,4,5, 10,11,14,15]
    values = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.5, -0.5, 0.5, 0.5])  # block 0 has Σ|φ| 0.4 < 2.0
    candidates = grid.expand(torch.tensor([0, 1, 2]))  # [0,1,2,3,4,5,6,7,8,9,12,13]
    score = torch.zeros(candidates.numel())
    score[torch.isin(candidates, grid.expand(torch.tensor([1])))] = 0.3  # block 1: Σ 1.2
    score[torch.isin(candidates, grid.expand(torch.tensor([2])))] = 0.2  # block 2: Σ 0.8
    r = reselect_ag(values, indices, 1, candidates, score, grid)
    assert r.indices.tolist() == [2, 3, 6, 7, 10, 11, 14, 15]  # block 0 out, block 1 in
    assert r.source.tolist() == [-1, -1, -1, -1, 4, 5, 6, 7]
    assert r.grown_from.tolist() == [2, 3, 6, 7, -1, -1, -1, -1]


def test_block_ties_break_by_lowest_block():
    grid = BlockGrid(4, 4, (2, 2))
    indices = grid.expand(torch.tensor([0, 1, 3])).to(torch.int32)
    values = torch.full((12,), 0.25)  # all blocks tie on Σ|φ| → drop block 0
    candidates = grid.expand(torch.tensor([0, 2]))
    r = reselect_ag(values, indices, 1, candidates, torch.ones(8), grid)  # 0 (just dropped) ties 2 → regrow 0
    assert r.indices.tolist() == indices.tolist()
    assert (r.source[:2] == -1).all()


def test_block_ma_scores_are_block_sums_of_fourth_roots():
    grid = BlockGrid(4, 4, (2, 2))
    row_acc = torch.tensor([16.0, 16.0, 1.0, 1.0])  # √⁴: 2, 2, 1, 1 → block rows 4, 2
    col_acc = torch.tensor([1.0, 1.0, 81.0, 0.0])  # √⁴: 1, 1, 3, 0 → block cols 2, 3
    indices = grid.expand(torch.tensor([1, 2])).to(torch.int32)  # block 1 (score 4·3=12), block 2 (2·2=4)
    values = torch.tensor([1.0] * 4 + [0.1] * 4)  # drop block 2
    r = reselect_ma(values, indices, 1, row_acc, col_acc, grid)
    # outside kept {1}: block 0 = 4·2 = 8, block 2 = 4, block 3 = 2·3 = 6 → grow block 0
    assert r.indices.tolist() == grid.expand(torch.tensor([0, 1])).tolist()


def _block_targets():
    return ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # dims divisible by 16


def _train_with_sm3(model, steps: int = 16):
    """Train ``model``'s SpIEL adapter with SM3 (lr 0.1) and a scheduler over ``steps`` tiny batches; yields each
    step's reselection report (empty between reselections)."""
    opt = SM3([p for p in model.parameters() if p.requires_grad], lr=0.1)
    scheduler = SpIELScheduler(model, opt, total_steps=steps)
    model.train()
    for step in range(1, steps + 1):
        x = inputs(seed=step, batch=4, length=9)
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        yield scheduler.step()


def test_block_ma_growth_under_sm3_stays_in_the_cross_the_initial_blocks_cover():
    """SM3 sees only the rows and columns of active blocks, so with ma_signal='sm3' every block ever active lies in
    the cross of the block rows and block columns the initial mask covered (the rest score 0; Eq. 7.7). The reference
    path (fast paths off) chooses the same blocks."""
    import peft_sparse

    def run():
        config = SpIELConfig(target_modules=_block_targets(), density=0.125, block_shape=(16, 16), growth="ma",
                             ma_signal="sm3", reselection_steps=4, gradient_estimation_steps=2)  # fmt: skip
        model = get_peft_model(tiny_llama(hidden_size=64, intermediate_size=128), config)
        layers = sparse_layers(model)
        grids = [BlockGrid(l.out_features, l.in_features, (16, 16)) for l in layers]

        def blocks():
            return [set(torch.unique(g.block_of(l.sparse_indices["default"])).tolist()) for l, g in zip(layers, grids)]

        ever = blocks()
        cross = [{r * g.cols + c for r in {b // g.cols for b in bs} for c in {b % g.cols for b in bs}} for bs, g in zip(ever, grids)]
        for _ in _train_with_sm3(model):
            ever = [e | b for e, b in zip(ever, blocks())]
        assert any(len(c) < g.numel for c, g in zip(cross, grids))  # (the cross leaves blocks out)
        return ever, cross, [l.sparse_indices["default"].clone() for l in layers]

    ever, cross, fast = run()
    assert all(e <= c for e, c in zip(ever, cross))
    with peft_sparse.fast_paths(False):
        _, _, reference = run()
    assert all(torch.equal(a, b) for a, b in zip(fast, reference))


@pytest.mark.parametrize("growth", ["ag", "ma"])
def test_block_spiel_trains_with_whole_blocks_saves_and_loads(growth, tmp_path):
    # (MA: blocks' default signal, 'io'; a full first replacement, which 'auto' leaves off in a run this short)
    config = SpIELConfig(target_modules=_block_targets(), density=0.25, block_shape=(16, 16), growth=growth,
                         reselection_steps=4, gradient_estimation_steps=2, first_full_replacement=True)  # fmt: skip
    model = get_peft_model(tiny_llama(), config)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2) if growth == "ag" else SM3(params, lr=0.1)
    scheduler = SpIELScheduler(model, opt, total_steps=12)
    x = inputs(batch=4, length=9)
    model.train()
    initial = [l.sparse_indices["default"].clone() for l in sparse_layers(model)]
    for _ in range(12):
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
    for layer, before in zip(sparse_layers(model), initial):
        grid = BlockGrid(layer.out_features, layer.in_features, (16, 16))
        idx = layer.sparse_indices["default"]
        blocks = torch.unique(grid.block_of(idx))
        assert torch.equal(grid.expand(blocks), idx.long()), "indices are not whole blocks"
        assert idx.numel() == before.numel()
    assert any(not torch.equal(a, l.sparse_indices["default"]) for a, l in zip(initial, sparse_layers(model)))
    model.eval()
    with torch.no_grad():
        out = model(x).logits
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, out)
    assert loaded.peft_config["default"].block_shape == (16, 16)


@pytest.mark.parametrize("method", ["sddmm", "dense", "auto"])  # sddmm = the block-sparse product for blocks
def test_block_value_gradient_matches_dense_reference(method):
    config = SparseFTConfig(target_modules=["gate_proj"], density=0.25, block_shape=(16, 16))
    model = get_peft_model(tiny_llama(), config)
    randomize_values(model)
    layer = sparse_layers(model)[0]
    layer.value_grad_method = method
    assert layer.block_metadata("default") is not None
    x = torch.randn(3, 5, layer.in_features)
    y = layer(x)
    grad = torch.randn_like(y)
    y.backward(grad)
    dW = grad.reshape(-1, layer.out_features).t().mm(x.reshape(-1, layer.in_features))
    torch.testing.assert_close(layer.sparse_values["default"].grad, dW.view(-1)[layer.sparse_indices["default"].long()])


def test_block_value_gradient_adds_into_a_given_output():
    """kernels.block_value_gradient with ``out`` adds the blocks' dW to it (the torch path on CPU)."""
    g = torch.Generator().manual_seed(3)
    grid = BlockGrid(64, 96, (16, 32))
    units = torch.tensor([0, 4, 5, 11])
    layout = kernels.BlockLayout.of_blocks(units, 64, 96, (16, 32))
    go, x = torch.randn(7, 64, generator=g), torch.randn(7, 96, generator=g)
    start = torch.randn(units.numel() * 16 * 32, generator=g)
    out = start.clone()
    got = kernels.block_value_gradient(go, x, layout, out=out)
    dW = go.t().mm(x).reshape(-1)
    want = start.clone()
    want[layout.slots()] += dW[grid.block_major(units).reshape(-1)]
    assert got is out
    torch.testing.assert_close(out, want)


def test_block_shape_errors():
    with pytest.raises(ValueError, match=r"block_shape=\(0, 4\)"):
        SpIELConfig(target_modules="all-linear", density=0.1, block_shape=(0, 4))
    with pytest.raises(ValueError, match=r"block_shape=\(5, 5\) does not tile target module 'model.layers.0.self_attn.q_proj'"):
        get_peft_model(tiny_llama(), SpIELConfig(target_modules=["q_proj"], density=0.1, block_shape=(5, 5)))


def test_block_metadata_after_a_batched_reselection_equals_a_fresh_computation():
    from peft import get_peft_model

    from peft_sparse import SpIELConfig, SpIELScheduler

    from .models import sparse_layers, tiny_llama

    config = SpIELConfig(target_modules="all-linear", density=0.25, growth="ag", reselection_steps=4,
                         gradient_estimation_steps=2, block_shape=(16, 16))  # fmt: skip
    model = get_peft_model(tiny_llama(), config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = SpIELScheduler(model, opt, total_steps=8)
    model.train()
    g = torch.Generator().manual_seed(0)
    for _ in range(6):  # reselections at 2 and 6
        x = torch.randint(0, 97, (4, 12), generator=g)
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
    for layer in sparse_layers(model):
        cached = layer.block_metadata("default")  # as the reselection left it
        layer._block_metadata.pop("default")
        fresh = layer.block_metadata("default")  # recomputed from the indices alone
        for key in ("rows", "cols", "base", "stride"):
            assert torch.equal(getattr(cached, key), getattr(fresh, key)), (layer.module_name, key)
        assert (cached.block_shape, cached.out_features, cached.in_features) == (fresh.block_shape, fresh.out_features, fresh.in_features)
        grid = BlockGrid(layer.out_features, layer.in_features, (16, 16))
        units = cached.rows.long() * grid.cols + cached.cols.long()
        # the block numbers the layouts carry (the reselection's, the fresh one's) and those computed
        assert cached.units is not None and fresh.units is not None
        assert torch.equal(cached.block_numbers(), units) and torch.equal(fresh.block_numbers(), units)
        assert torch.equal(grid.units(layer.sparse_indices["default"]), units)
        bare = kernels.BlockLayout(cached.rows, cached.cols, cached.base, cached.stride, (16, 16), cached.out_features, cached.in_features)
        assert torch.equal(bare.block_numbers(), units)
        # every element's place in the values, as a search over the indices finds it
        assert torch.equal(cached.slots(), torch.searchsorted(layer.sparse_indices["default"].long(), grid.block_major(units).reshape(-1)))


def test_block_ag_window_gathers_candidate_gradients_with_the_block_kernel(monkeypatch):
    """After the window's first micro-batch chose the candidate blocks, their gradients come from the
    block kernel, not a dense dW: the same statistics (up to summation order) and the same reselection,
    one dense dW per layer and window."""
    from peft_sparse.core import kernels
    from peft_sparse.methods.spiel import statistics as spiel

    def run(sparse_windows: bool):
        if not sparse_windows:
            monkeypatch.setattr(spiel._WindowStatistics, "block_kernel", False)
        dense_calls, factored = [], []
        original = kernels.dense_weight_gradient
        monkeypatch.setattr(kernels, "dense_weight_gradient", lambda g, x: dense_calls.append(1) or original(g, x))
        add = spiel._WindowStatistics.add_candidate_gradients
        monkeypatch.setattr(spiel._WindowStatistics, "add_candidate_gradients", lambda self, g, x, f=None: factored.append(f is not None) or add(self, g, x, f))
        config = SpIELConfig(target_modules=["gate_proj", "down_proj"], density=0.03, growth="ag", block_shape=(16, 16),
                             reselection_steps=4, gradient_estimation_steps=3)  # fmt: skip
        model = get_peft_model(tiny_llama(hidden_size=128, intermediate_size=256), config)
        randomize_values(model, scale=0.05)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2)
        scheduler = SpIELScheduler(model, opt, total_steps=8)
        model.train()
        snapshots = []
        for step in range(1, 4):
            x = inputs(seed=step)
            model(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
            if step == 3:  # the window's statistics, before the reselection consumes them
                snapshots = {n: {k: v.clone() for k, v in s.tensors().items()} for n, s in scheduler.statistics.items()}
            scheduler.step()
        monkeypatch.undo()
        return snapshots, [l.sparse_indices["default"].clone() for l in sparse_layers(model)], len(dense_calls), factored

    sparse_stats, sparse_indices, sparse_dense, factored = run(True)
    dense_stats, dense_indices, dense_dense, _ = run(False)
    layers = len(sparse_indices)
    assert dense_dense == 3 * layers and sparse_dense == layers  # one dense dW per layer: the first micro-batch
    # the two later micro-batches: down_proj's silu(gate) ⊙ up formed by the kernel in the second layer
    # (in the first, up is computed without gradient, its product keeps one factor and X is kept)
    assert len(factored) == 2 * layers and sum(factored) == 2
    for name, tensors in dense_stats.items():
        assert torch.equal(sparse_stats[name]["candidates"], tensors["candidates"])
        for key in ("grad_sum", "grad_sq_sum"):
            torch.testing.assert_close(sparse_stats[name][key], tensors[key], rtol=1e-4, atol=1e-7)
    for a, b in zip(sparse_indices, dense_indices):
        assert torch.equal(a, b)


def test_candidate_slots_formula_matches_a_search():
    """Element (i, j) of each candidate block at its place in the ascending flat candidates: the
    O(blocks) formula == searching every element, for rows with one, several or no candidate blocks."""
    from peft_sparse.methods.spiel.statistics import _WindowStatistics

    for shape, block, units in (((8, 12), (2, 3), [0, 1, 3, 5, 6, 7]), ((6, 8), (3, 4), [1, 2]), ((4, 8), (1, 4), [0, 1, 3, 6, 7])):
        grid = BlockGrid(*shape, block)
        stats = _WindowStatistics(len(units), grid)
        stats.candidate_units = torch.tensor(units)
        stats.candidates = grid.expand(stats.candidate_units)
        stats.index_candidate_blocks()
        want = torch.searchsorted(stats.candidates, grid.block_major(stats.candidate_units).reshape(-1))
        assert torch.equal(stats.candidate_blocks.slots(), want), (shape, block, units)


def test_window_first_step_picks_the_top_blocks_by_float32_gradient_sums():
    """Hand-built ∂L/∂W: the candidates are the K blocks of largest Σ|g| (ties → lower block number),
    in ascending element order, with this micro-batch's gradients there; the window sums come at the
    step's end."""
    from peft_sparse.methods.spiel.statistics import _WindowStatistics

    grid = BlockGrid(4, 6, (2, 2))  # 2 × 3 blocks
    dense = torch.zeros(4, 6, dtype=torch.bfloat16)
    dense[0:2, 2:4] = -0.5  # block 1: Σ|g| 2.0
    dense[2:4, 0:2] = 0.5  # block 3: 2.0 (ties block 1, which is lower)
    dense[2:4, 4:6] = torch.tensor([[1.0, -1.0], [0.25, 0.5]])  # block 5: 2.75
    dense[0, 0] = 1.5  # block 0: 1.5
    stats = _WindowStatistics(2, grid)
    stats(None, dense)
    assert stats.candidate_units.tolist() == [1, 5]
    assert stats.candidates.tolist() == [2, 3, 8, 9, 16, 17, 22, 23]
    assert torch.equal(stats.step_sum, dense.reshape(-1)[stats.candidates.long()].float())
    assert stats.grad_sum is None and stats.grad_sq_sum is None
    assert torch.equal(stats.candidate_blocks.slots(), torch.searchsorted(stats.candidates.long(), grid.block_major(stats.candidate_units).reshape(-1)))
    stats3 = _WindowStatistics(3, grid)
    stats3(None, dense)
    assert stats3.candidate_units.tolist() == [1, 3, 5]  # both tied blocks once K reaches them
    stats(None, dense)  # a second micro-batch of the same step adds to the step's sum
    step = 2 * dense.reshape(-1)[stats.candidates.long()].float()
    assert torch.equal(stats.step_sum, step)
    stats.end_step()
    assert torch.equal(stats.grad_sum, step) and torch.equal(stats.grad_sq_sum, step * step) and not stats.step_sum.any()


def test_window_first_step_picks_the_top_weights_by_gradient_magnitude():
    """Unstructured: the K weights of largest |g| (ties → lower flat index), ascending, with this
    micro-batch's gradients there."""
    from peft_sparse.methods.spiel.statistics import _WindowStatistics

    dense = torch.tensor([[0.5, -2.0, 0.0, 1.0], [-1.0, 0.25, 1.0, -0.0]], dtype=torch.bfloat16)
    stats = _WindowStatistics(3, BlockGrid(2, 4))
    stats(None, dense)
    assert stats.candidates.tolist() == [1, 3, 4]  # |−2|, then three tied at 1.0: positions 3 and 4 first
    assert stats.candidates.dtype == torch.int32
    assert stats.step_sum.tolist() == [-2.0, 1.0, -1.0] and stats.step_sum.dtype == torch.float32
    assert stats.grad_sum is None
    stats.end_step()
    assert stats.grad_sum.tolist() == [-2.0, 1.0, -1.0] and stats.grad_sq_sum.tolist() == [4.0, 1.0, 1.0]


def test_the_cost_model_rates_an_unmeasured_block_shape_by_the_measured_shapes_inside_it():
    """A block shape without a measured rate gets that of the largest measured shape inside it (tiles in
    tiles, row vectors in row vectors), not the slowest rate: a larger block runs at least as fast per
    element as a block it contains, so at the benchmark's budget it takes the block kernel too."""
    model = kernels.CostModel()
    rates = model.block_relative_rate
    assert model.block_rate((32, 32)) == rates[(32, 32)] and model.block_rate((1, 64)) == rates[(1, 64)]
    assert model.block_rate((128, 128)) == rates[(64, 64)] == model.block_rate((64, 128))
    assert model.block_rate((64, 32)) == rates[(32, 32)] == model.block_rate((32, 128))
    assert model.block_rate((16, 32)) == rates[(16, 16)] == model.block_rate((32, 16))
    assert model.block_rate((1, 128)) == rates[(1, 64)]
    assert model.block_rate((8, 8)) == min(rates.values()) == model.block_rate((1, 16))
    cuda = torch.device("cuda")  # (only the device's type is read)
    nnz = int(0.052 * 2048 * 2048)  # TinyLlama's q_proj at the benchmark's budget, 8192 tokens
    shapes = [(32, 32), (64, 64), (128, 128), (1, 64)]
    assert [model.choose_block(cuda, 8192, 2048, 2048, nnz, s) for s in shapes] == ["block", "block", "block", "dense"]


def test_the_cost_model_follows_the_measured_16x16_crossover():
    """16×16 blocks of TinyLlama's gate_proj (5632×2048, 8192 tokens): on an H200 the grouped kernel took
    0.22 ms at 5.2% density against 0.285 ms for dense dW + gather, and 0.335 against 0.286 at 10%
    (docs/perf-log.md, round s21). The cost model picks the faster path at both densities."""
    model = kernels.CostModel()
    cuda = torch.device("cuda")
    choices = [model.choose_block(cuda, 8192, 5632, 2048, int(d * 5632 * 2048), (16, 16)) for d in (0.052, 0.1)]
    assert choices == ["block", "dense"]


def test_a_64x64_block_adapter_takes_the_block_kernel_with_the_dense_gradients(monkeypatch):
    """A 64×64 block adapter computes its value gradient with the block kernel, no dense dW, and gets the
    dense path's gradients."""
    def grads(method):
        config = SpIELConfig(target_modules=["gate_proj", "down_proj"], density=0.1, growth="ma", block_shape=(64, 64))
        model = get_peft_model(tiny_llama(hidden_size=256, intermediate_size=512), config)
        randomize_values(model, scale=0.05)
        for layer in sparse_layers(model):
            layer.value_grad_method = method
        x = inputs()
        model.train()
        model(x, labels=x).loss.backward()
        return [layer.sparse_values["default"].grad for layer in sparse_layers(model)]

    dense = grads("dense")
    calls = []
    original = kernels.dense_weight_gradient
    monkeypatch.setattr(kernels, "dense_weight_gradient", lambda g, x: calls.append(1) or original(g, x))
    auto = grads("auto")
    assert calls == [] and len(auto) == 4
    for a, b in zip(auto, dense):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
