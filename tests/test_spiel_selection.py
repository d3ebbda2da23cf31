"""SpIEL drop/grow as pure functions on hand-built tensors, with exact expected indices."""

import math

import pytest
import torch

from peft_sparse.core.selection import BlockGrid
from peft_sparse.core.selection import top_k_positions
from peft_sparse.methods.spiel.rank_one import _top_k_row_col_products_chunked, top_k_row_col_products
from peft_sparse.methods.spiel.selection import reselect_ag, reselect_ma
from peft_sparse.schedules.reselection import in_estimation_window, is_reselection_step, replacement_count


def t(*xs, dtype=torch.float32):
    return torch.tensor(xs, dtype=dtype)


def test_drop_smallest_magnitude_and_grow_largest_mean_gradient():
    indices = t(2, 5, 9, 14, dtype=torch.int32)
    values = t(0.5, -0.1, 0.3, -0.05)  # smallest |φ|: 14 (0.05) then 5 (0.1)
    candidates = t(0, 5, 7, 9, 11, dtype=torch.int32)
    score = t(0.2, 0.9, 0.8, 5.0, 0.1)  # 9 is active and kept, 5 is just dropped
    r = reselect_ag(values, indices, 2, candidates, score)
    # eligible: 0, 5 (just dropped: may regrow), 7, 11 → top-2 by score: 5 (0.9), 7 (0.8)
    assert r.indices.tolist() == [2, 5, 7, 9]
    assert r.source.tolist() == [0, -1, -1, 2]  # 5 regrew: a new slot (value restarts at 0)
    assert r.grown_from.tolist() == [-1, 1, 2, -1]
    assert r.dropped == 2 and r.shortfall == 0


def test_ties_break_by_lowest_flat_index():
    indices = t(1, 3, 4, 8, dtype=torch.int32)
    values = t(0.2, 0.2, 0.7, 0.2)  # three-way tie for the two smallest: drop 1 and 3, keep 8
    candidates = t(0, 2, 6, 10, 12, dtype=torch.int32)
    score = t(0.5, 0.9, 0.9, 0.9, 0.5)  # tie among 2, 6, 10 → grow 2 and 6
    r = reselect_ag(values, indices, 2, candidates, score)
    assert r.indices.tolist() == [2, 4, 6, 8]
    assert top_k_positions(t(1.0, 3.0, 3.0, 2.0, 3.0), 2).tolist() == [1, 2]
    assert top_k_positions(t(1.0, 3.0, 3.0, 2.0, 3.0), 4).tolist() == [1, 2, 4, 3]


def test_regrowth_of_a_dropped_index():
    indices = t(3, 6, dtype=torch.int32)
    values = t(0.01, 0.9)
    candidates = t(3, 4, dtype=torch.int32)
    score = t(2.0, 1.0)
    r = reselect_ag(values, indices, 1, candidates, score)
    assert r.indices.tolist() == [3, 6]
    assert r.source.tolist() == [-1, 1]  # index 3 came back as a new slot


def test_fewer_eligible_candidates_drops_only_what_can_be_grown():
    indices = t(1, 2, 3, 4, dtype=torch.int32)
    values = t(0.1, 0.2, 0.3, 0.4)
    candidates = t(2, 3, 4, 9, dtype=torch.int32)  # only 9 is inactive
    score = t(1.0, 1.0, 1.0, 1.0)
    r = reselect_ag(values, indices, 3, candidates, score)
    # k=3 would drop 1,2,3 → eligible 2,3,9 (3) ✓?  the largest k' with eligible ≥ k' is 3
    assert r.shortfall == 0 and r.indices.tolist() == [2, 3, 4, 9]
    candidates = t(4, 9, dtype=torch.int32)
    r = reselect_ag(values, indices, 3, candidates, t(1.0, 2.0))
    # k=3: keep {4}, eligible {9} (1 < 3) → k=1: drop {1}, keep {2,3,4}, eligible {9} ✓
    assert r.indices.tolist() == [2, 3, 4, 9] and r.shortfall == 2 and r.dropped == 1


def test_first_reselection_replaces_everything():
    indices = t(0, 1, 2, dtype=torch.int32)
    values = torch.zeros(3)
    candidates = t(0, 5, 6, 7, dtype=torch.int32)
    r = reselect_ag(values, indices, 3, candidates, t(0.1, 0.3, 0.2, 0.4))
    assert r.indices.tolist() == [5, 6, 7] and (r.source == -1).all()


def test_ma_grows_largest_row_column_products_outside_kept_set():
    # 3×4 matrix; R·C scores: row 1 col 3 is the best (6·5=30), then (1,0)=18 and (2,3)=20
    row_acc, col_acc = t(1.0, 6.0, 4.0), t(3.0, 1.0, 0.5, 5.0)
    indices = t(0, 7, 11, dtype=torch.int32)  # (0,0), (1,3), (2,3)
    values = t(0.05, 0.9, 0.8)  # drop index 0
    r = reselect_ma(values, indices, 1, row_acc, col_acc)
    # kept {7, 11}; best outside: (1,0)=18 → flat 4
    assert r.indices.tolist() == [4, 7, 11]
    assert r.source.tolist() == [-1, 1, 2]


@pytest.mark.parametrize("chunk", [1, 5, 7, 1 << 22])
def test_chunked_row_col_top_k_equals_brute_force(chunk):
    g = torch.Generator().manual_seed(0)
    row_acc = torch.randint(0, 4, (13,), generator=g).float()  # many ties on purpose
    col_acc = torch.randint(0, 4, (11,), generator=g).float()
    excluded = torch.randperm(143, generator=g)[:30].sort().values
    want_scores = (row_acc[:, None] * col_acc[None, :]).reshape(-1)
    mask = torch.ones(143, dtype=torch.bool)
    mask[excluded] = False
    pos = torch.nonzero(mask).squeeze(1)
    want = pos[torch.sort(want_scores[pos], descending=True, stable=True).indices[:17]].sort().values
    got = _top_k_row_col_products_chunked(row_acc, col_acc, excluded, 17, chunk)
    assert got.tolist() == want.tolist()


def test_linear_and_cosine_schedules():
    T, d, xi, gamma = 100, 1000, 0.2, 5
    assert replacement_count(5, T, d, xi, "linear", gamma) == d  # first reselection: everything
    assert replacement_count(25, T, d, xi, "linear", gamma) == 150  # ⌊0.2·75/100·1000⌋
    assert replacement_count(25, T, d, torch.tensor(xi, dtype=torch.float64), "linear", gamma) == 150  # (an unhashable rate)
    assert replacement_count(45, T, d, xi, "linear", gamma) == 110
    assert replacement_count(25, T, 7, 0.3, "linear", gamma) == 1  # ⌊0.3·0.75·7⌋ = ⌊1.575⌋
    assert replacement_count(50, 100, 10, 0.3, "linear", gamma) == 1  # exactly 1.5 → 1
    assert replacement_count(50, 100, 20, 0.3, "linear", gamma) == 3  # exactly 3.0, not 2.999…
    assert replacement_count(25, T, d, xi, "cosine", gamma) == math.floor(0.1 * (1 + math.cos(math.pi / 4)) * d)
    assert replacement_count(25, T, d, xi, "cosine", gamma) == 170
    assert replacement_count(99, T, d, xi, "cosine", gamma) == 0
    with pytest.raises(ValueError, match="schedule='step'"):
        replacement_count(25, T, d, xi, "step", gamma)


def test_reselection_steps_and_windows():
    S, gamma, T = 10, 3, 35
    steps = [s for s in range(1, T + 1) if is_reselection_step(s, S, gamma, T)]
    assert steps == [3, 13, 23, 33]
    window = [s for s in range(1, T + 1) if in_estimation_window(s, S, gamma, T)]
    assert window == [1, 2, 3, 11, 12, 13, 21, 22, 23, 31, 32, 33]
    assert [s for s in range(1, 34) if in_estimation_window(s, S, gamma, 33)] == [1, 2, 3, 11, 12, 13, 21, 22, 23]


def test_top_k_set_agrees_with_the_ordered_top_k_including_ties():
    from peft_sparse.core.selection import top_k_set

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        scores = torch.randint(0, 6, (500,), generator=g).to(dtype)  # heavy ties
        for k in (1, 7, 100, 499, 500):
            want = top_k_positions(scores.float(), k).sort().values
            assert top_k_set(scores, k).tolist() == want.tolist()


def _brute_force_row_col_top_k(row_acc, col_acc, excluded, k):
    scores = (row_acc.double()[:, None] * col_acc.double()[None, :]).reshape(-1).float()
    mask = torch.ones(scores.numel(), dtype=torch.bool)
    mask[excluded] = False
    pos = torch.nonzero(mask).squeeze(1)
    return pos[torch.sort(scores[pos], descending=True, stable=True).indices[:k]].sort().values


def _count_fallbacks(monkeypatch) -> list:
    """Spy on the exact chunked scan that the threshold path falls back to."""
    import peft_sparse.methods.spiel.rank_one as spiel

    calls = []
    exact = spiel._top_k_row_col_products_chunked

    def spy(*args, **kwargs):
        calls.append(1)
        return exact(*args, **kwargs)

    monkeypatch.setattr(spiel, "_top_k_row_col_products_chunked", spy)
    return calls


@pytest.mark.parametrize("case", ["continuous", "ties", "block-scores", "everything"])
def test_rank_one_threshold_path_equals_brute_force(case, monkeypatch):
    fallbacks = _count_fallbacks(monkeypatch)
    g = torch.Generator().manual_seed(3)
    rows, cols = 37, 53
    if case == "ties":  # few distinct positive values: many exactly tied products
        row_acc = torch.randint(1, 4, (rows,), generator=g).double()
        col_acc = torch.randint(1, 3, (cols,), generator=g).double()
    else:
        row_acc = torch.rand(rows, generator=g, dtype=torch.float64) ** 3 + 1e-9
        col_acc = torch.rand(cols, generator=g, dtype=torch.float64) ** 3 + 1e-9
    if case == "block-scores":  # SpIEL-MA's block scores: sums of fourth roots
        row_acc, col_acc = row_acc.pow(0.25) * 3, col_acc.pow(0.25) * 5
    n_excluded, k = (rows * cols - 40, 40) if case == "everything" else (90, 31)
    excluded = torch.randperm(rows * cols, generator=g)[:n_excluded].sort().values
    want = _brute_force_row_col_top_k(row_acc, col_acc, excluded, k)
    assert top_k_row_col_products(row_acc, col_acc, excluded, k).tolist() == want.tolist()
    if case != "ties":
        assert not fallbacks, "the threshold path should certify continuous scores"


def test_rank_one_path_gives_up_on_zero_scores_and_the_fallback_is_exact(monkeypatch):
    fallbacks = _count_fallbacks(monkeypatch)
    row_acc = torch.tensor([0.0, 2.0, 0.0, 1.0], dtype=torch.float64)
    col_acc = torch.tensor([3.0, 0.0, 1.0], dtype=torch.float64)
    excluded = torch.tensor([3, 5])  # (1,0) and (1,2): the two largest products
    k = 6  # only 2 positive products remain outside: zeros must fill the rest, lowest index first
    got = top_k_row_col_products(row_acc, col_acc, excluded, k)
    assert fallbacks == [1]
    assert got.tolist() == _brute_force_row_col_top_k(row_acc, col_acc, excluded, k).tolist() == [0, 1, 2, 4, 9, 11]


def _random_tensor_reselection(g, out_f, in_f, block, density, growth, ties):
    from peft_sparse.core.selection import BlockGrid
    from peft_sparse.methods.spiel.batched import TensorReselection

    grid = BlockGrid(out_f, in_f, block)
    n_units = max(2, int(grid.numel * density))
    units = torch.randperm(grid.numel, generator=g)[:n_units].sort().values
    indices = grid.expand(units).to(torch.int32 if torch.rand((), generator=g) < 0.7 else torch.int64)
    values = torch.randn(indices.numel(), generator=g)
    if ties:
        values = torch.randint(-2, 3, (indices.numel(),), generator=g).float() / 4
    k = int(torch.randint(1, n_units + 1, (1,), generator=g))
    given = grid.unit > 1 and torch.rand((), generator=g) < 0.7  # (otherwise derived from the indices)
    item = TensorReselection(values, indices, k, grid, units=units if given else None)
    if growth == "ag":
        n_cand = min(grid.numel, n_units + int(torch.randint(0, n_units + 1, (1,), generator=g)))
        item.candidate_units = torch.randperm(grid.numel, generator=g)[:n_cand].sort().values
        item.candidates = grid.expand(item.candidate_units).to(torch.int32)
        item.score = torch.rand(item.candidates.numel(), generator=g)
        if ties:
            item.score = torch.randint(0, 3, (item.candidates.numel(),), generator=g).float()
        if grid.unit == 1 or torch.rand((), generator=g) < 0.3:
            item.candidate_units = None
    else:
        item.row_acc = torch.rand(out_f, generator=g) + 0.01
        item.col_acc = torch.rand(in_f, generator=g) + 0.01
        if ties and out_f == 8:  # zeros and ties: these tensors take the exact fallback, the others the threshold
            item.row_acc = torch.zeros(out_f)
            item.row_acc[torch.randint(0, out_f, (2,), generator=g)] = 2.0  # too few positive scores for k
    return item


@pytest.mark.parametrize("growth", ["ag", "ma"])
@pytest.mark.parametrize("block, density", [((1, 1), 0.3), ((2, 4), 0.3), ((4, 2), 0.6), ((1, 8), 0.15)])
@pytest.mark.parametrize("ties", [False, True])
def test_reselect_all_equals_reselecting_each_tensor(growth, block, density, ties):
    """The batched drop/grow over many tensors gives, tensor by tensor, exactly the per-tensor result:
    indices, sources, candidate rows, dropped counts, new blocks and their layouts (block tensors work
    on blocks only), and the count of weights not active before (a dropped block grown again is none).
    MA: with SM3's zeros, which send the tensors with zero rows to the exact fallback, and a partial
    reselection in a tensor with fewer inactive units than k."""
    from peft_sparse.core.kernels import BlockLayout
    from peft_sparse.core.selection import isin_sorted as _isin_sorted
    from peft_sparse.methods.spiel.batched import reselect_all

    g = torch.Generator().manual_seed(7)
    shapes = [(8, 16), (16, 8), (8, 16), (24, 32), (8, 8)]
    items = [_random_tensor_reselection(g, o, i, block, density, growth, ties) for o, i in shapes]
    if growth == "ma":  # and a partial reselection in a tensor with fewer inactive units than k
        dense = _random_tensor_reselection(g, 8, 8, block, 0.7, growth, ties)
        dense.k = dense.indices.numel() // dense.grid.unit - 1
        assert 0 < dense.k and dense.grid.numel - (dense.k + 1) < dense.k
        items.append(dense)
    batched = reselect_all(items, growth)
    changed = 0
    d_start, c_start = 0, 0
    for i, it in enumerate(items):
        if growth == "ag":
            want = reselect_ag(it.values, it.indices, it.k, it.candidates, it.score, it.grid, it.units, it.candidate_units)
        else:
            want = reselect_ma(it.values, it.indices, it.k, it.row_acc, it.col_acc, it.grid, it.units)
        d = it.values.numel()
        if growth == "ag":
            assert want.shortfall == 0 and bool(batched.ok)
            c_start += it.candidates.numel()
            rows = batched.grown_from[d_start : d_start + d]
            assert torch.where(rows >= 0, rows - (c_start - it.candidates.numel()), -1).tolist() == want.grown_from.tolist()
        src = batched.source[d_start : d_start + d]
        assert batched.indices[i].tolist() == want.indices.tolist()
        assert torch.where(src >= 0, src - d_start, -1).tolist() == want.source.tolist()
        assert batched.dropped[i] == want.dropped
        if it.grid.unit > 1:
            assert batched.units[i].tolist() == want.units.tolist()
            layout, expected = batched.block_metadata[i], BlockLayout.of_blocks(want.units, it.grid.out_features, it.grid.in_features, block)
            for field in ("rows", "cols", "base", "stride"):
                got, wanted = getattr(layout, field), getattr(expected, field)
                assert got.dtype == wanted.dtype and torch.equal(got, wanted), field
            # weight (i, j) of each new block is the new index at its slot
            assert torch.equal(batched.indices[i][layout.slots()], it.grid.block_major(want.units).reshape(-1))
        changed += int((~_isin_sorted(want.indices, it.indices)).sum())
        d_start += d
    assert int(batched.changed) == changed
    assert batched.new_indices.dtype == batched.source.dtype == batched.grown_from.dtype == torch.int64
    if growth == "ag":
        assert batched.per_tensor_ok.tolist() == [True] * len(items)
    else:
        assert batched.per_tensor_ok is None and bool((batched.grown_from == -1).all())


def test_reselect_all_flags_a_shortfall_and_a_nan_score():
    from peft_sparse.methods.spiel.batched import TensorReselection, reselect_all

    grid = BlockGrid(2, 4)
    make = lambda cands, score: TensorReselection(  # noqa: E731
        torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([1, 2, 3, 4], dtype=torch.int32), 3, grid,
        candidates=torch.tensor(cands, dtype=torch.int32), score=torch.tensor(score))  # fmt: skip
    fine = make([0, 5, 6, 7], [1.0, 2.0, 3.0, 4.0])
    assert bool(reselect_all([fine, fine], "ag").ok)
    short = make([1, 4], [1.0, 2.0])  # keeps {4}: only 1 eligible candidate (1) for k=3
    result = reselect_all([fine, short], "ag")
    assert not bool(result.ok) and result.per_tensor_ok.tolist() == [True, False]
    nan = make([0, 5, 6, 7], [1.0, float("nan"), 3.0, 4.0])
    assert reselect_all([nan, fine], "ag").per_tensor_ok.tolist() == [False, True]


def test_reselect_all_flags_a_shortfall_of_candidate_blocks():
    """Block tensors: too few eligible candidate blocks, or a NaN among a candidate block's scores, lower
    that tensor's flag (its result is then discarded for the checked path); the others' are unharmed."""
    from peft_sparse.methods.spiel.batched import TensorReselection, reselect_all

    grid = BlockGrid(4, 8, (2, 2))  # 2 × 4 blocks
    active = torch.tensor([1, 2, 3, 4])

    def make(cand_units, score=None):
        cand_units = torch.tensor(cand_units)
        candidates = grid.expand(cand_units).to(torch.int32)
        return TensorReselection(
            torch.arange(1.0, 17.0), grid.expand(active).to(torch.int32), 3, grid, units=active, candidates=candidates,
            candidate_units=cand_units, score=score if score is not None else torch.arange(float(candidates.numel())),
        )  # fmt: skip

    fine = make([0, 5, 6, 7])
    assert bool(reselect_all([fine, fine], "ag").ok)
    short = make([1, 4])  # keeps block 4: only block 1 is eligible for k=3
    result = reselect_all([fine, short], "ag")
    assert not bool(result.ok) and result.per_tensor_ok.tolist() == [True, False]
    nan = make([0, 5, 6, 7], torch.tensor([1.0] * 5 + [float("nan")] + [1.0] * 10))
    assert reselect_all([fine, nan], "ag").per_tensor_ok.tolist() == [True, False]


def test_rank_one_counts_in_tensor_chunks_give_the_same_growth(monkeypatch):
    """The batched threshold search bounds its memory by counting a few tensors at a time."""
    import peft_sparse.methods.spiel.rank_one as spiel

    monkeypatch.setattr(spiel, "_COUNT_CHUNK", 40)  # one tensor per chunk
    test_reselect_all_equals_reselecting_each_tensor("ma", (1, 1), 0.3, False)
    test_reselect_all_equals_reselecting_each_tensor("ma", (2, 4), 0.3, True)


def test_window_steps_of_many_tensors_end_as_each_would_alone():
    """The batched end of a window step (multi-tensor operations over every tensor's statistics) leaves
    the same sums, bit for bit, as ending each tensor's step on its own; unarmed statistics are skipped.
    The window's first end allocates the sums of all tensors of a dtype in one buffer."""
    from peft_sparse.core.selection import BlockGrid
    from peft_sparse.methods.spiel.statistics import _end_steps, _WindowStatistics

    g = torch.Generator().manual_seed(0)
    batched, alone = [], []
    for n, dtype in ((7, torch.float32), (300, torch.float32), (5, torch.float64)):
        for store in (batched, alone):
            stats = _WindowStatistics(n, BlockGrid(1, 1), dtype)
            stats.candidates = torch.arange(n)
            stats.step_sum = torch.zeros(n, dtype=dtype)  # Σ g and Σ g² not yet allocated, as in a window's first step
            store.append(stats)
    idle = _WindowStatistics(3, BlockGrid(1, 1))  # never armed: no candidates
    for _ in range(3):
        for a, b in zip(batched, alone):
            step = torch.randn(a.step_sum.numel(), generator=g, dtype=torch.float64).to(a.dtype)
            a.step_sum.copy_(step)
            b.step_sum.copy_(step)
        _end_steps(batched + [idle])
        for b in alone:
            b.end_step()
    for a, b in zip(batched, alone):
        for key in ("step_sum", "grad_sum", "grad_sq_sum"):
            assert torch.equal(getattr(a, key), getattr(b, key)), key
    assert idle.step_sum is None and idle.grad_sum is None
    storage = batched[0].grad_sum.untyped_storage().data_ptr()
    assert all(s.grad_sum.untyped_storage().data_ptr() == storage for s in batched[:2])
    assert batched[0].grad_sq_sum.untyped_storage().data_ptr() == storage
    assert batched[2].grad_sum.untyped_storage().data_ptr() != storage  # (float64: a buffer of its own)
