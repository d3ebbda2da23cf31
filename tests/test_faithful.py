"""``reference="authors"``: the authors' released selection and optimizer-state rules, on worked examples.

Each row of the table in docs/differences.md has a small case worked by hand here — a few weights, a known gradient
stream, a known schedule — that ``reference="authors"`` reproduces index for index and value for value, and the
default is shown to differ exactly where the table says (the default runs with the other rows' settings made equal,
so only the row's own difference shows). The gradient stream is exact: :class:`Probe`'s loss is Σ W'∘G, so the
adapted matrix's gradient at step t is the hand-written G_t.
"""

import math

import pytest
import torch
import torch.nn as nn
from peft import get_peft_model

import peft_sparse
from peft_sparse import SM3, AgedAdamW, LTSFTConfig, LTSFTScheduler, SparseLayer, SpIELConfig, SpIELScheduler
from peft_sparse.core import edit
from peft_sparse.methods.spiel.selection import reselect_ag, reselect_ma
from peft_sparse.schedules.reselection import (
    in_estimation_window,
    released_in_estimation_window,
    released_replacement_count,
    replacement_count,
)

from .models import inputs, sparse_layers, tiny_llama

B1, B2 = 0.9, 0.999


class Probe(nn.Module):
    """One (out, in) Linear layer whose loss is Σ W'∘G for a given G: ∂L/∂W' = G exactly."""

    def __init__(self, out_features: int = 2, in_features: int = 4):
        super().__init__()
        self.lin = nn.Linear(in_features, out_features, bias=False)
        nn.init.zeros_(self.lin.weight)

    def forward(self, G):
        y = self.lin(torch.eye(self.lin.in_features))  # (in, out): W'ᵀ
        return (y * G.T).sum()


def _probe(indices, values=None, shape=(2, 4), **fields):
    """A Probe adapted by SpIEL with the given active indices (and values)."""
    fields.setdefault("reselection_steps", 6)
    fields.setdefault("gradient_estimation_steps", 2)
    model = get_peft_model(Probe(*shape), SpIELConfig(target_modules=["lin"], num_tunable_weights=len(indices), **fields))
    layer = sparse_layers(model)[0]
    edit.set_indices(model, {layer.module_name: torch.tensor(indices)},
                     values={layer.module_name: torch.tensor(values if values is not None else [0.0] * len(indices))})  # fmt: skip
    return model, layer


def _optimizer(model, reference, lr=0.0, growth="ag"):
    params = [p for p in model.parameters() if p.requires_grad]
    if growth == "ma":
        return SM3(params, lr=lr or 0.01)  # (SM3 needs a positive rate; the full replacement drops every value anyway)
    return AgedAdamW(params, lr=lr) if reference == "authors" else torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def _steps(model, optimizer, scheduler, grads) -> dict:
    """One optimizer step per G in ``grads``; returns {t: report} of the reselections."""
    reports = {}
    for G in grads:
        model(torch.as_tensor(G, dtype=torch.float32)).backward()
        optimizer.step()
        optimizer.zero_grad()
        report = scheduler.step()
        if report:
            reports[scheduler.t] = report
    return reports


def _state(layer):
    return layer.sparse_indices["default"].tolist(), layer.sparse_values["default"].detach().tolist(), layer.sparse_ages["default"].tolist()


# ------------------------------------------------------------------------------------------- SpIEL-AG


G1 = [[0.1, 0.0, 0.0, 0.0], [0.0, 0.5, -0.9, 0.0]]
G2 = [[0.0, 0.0, 0.2, 0.0], [0.0, 0.4, -0.3, 0.0]]


def test_ag_keeps_a_dropped_index_grown_again_with_its_value_and_adam_state():
    """Active {0, 5} with φ = (0.3, −0.2), lr 0 so φ stays as set. The window is steps 1–2; candidates (K = d_φ = 2)
    are the top |G1|: 6 (0.9) and 5 (0.5). The first reselection (t = γ = 2) replaces both; it grows 5 and 6, so 5
    is dropped and grown at once. The released code keeps 5 in place: φ₅ = −0.2, its Adam state after two steps
    (age 3, m = 0.9·0.1·0.5 + 0.1·0.4, v = 0.999·0.001·0.25 + 0.001·0.16); 6 is new. The default treats 5 as new."""
    model, layer = _probe([0, 5], [0.3, -0.2], reference="authors")
    opt = _optimizer(model, "authors")
    scheduler = SpIELScheduler(model, opt, total_steps=20)
    reports = _steps(model, opt, scheduler, [G1, G2])
    indices, values, ages = _state(layer)
    assert indices == [5, 6] and ages == [0, 2]
    assert values == torch.tensor([-0.2, 0.0]).tolist() and reports[2]["spiel/replaced"] == 1
    state = opt.state[layer.sparse_values["default"]]
    g_hat, s_hat = (-0.9 - 0.3) / 2, (0.81 + 0.09) / 2  # the new index 6: ĝ, ŝ over the window's two steps
    torch.testing.assert_close(state["age"], torch.tensor([3.0, 2.0]))
    torch.testing.assert_close(state["exp_avg"], torch.tensor([0.9 * 0.1 * 0.5 + 0.1 * 0.4, g_hat * (1 - B1**2)]))
    torch.testing.assert_close(state["exp_avg_sq"], torch.tensor([B2 * 0.001 * 0.25 + 0.001 * 0.16, s_hat * (1 - B2**2)]))

    model, layer = _probe([0, 5], [0.3, -0.2], score_normalization="none")  # the default
    opt = _optimizer(model, None)
    scheduler = SpIELScheduler(model, opt, total_steps=20)
    _steps(model, opt, scheduler, [G1, G2])
    indices, values, ages = _state(layer)
    assert indices == [5, 6] and values == [0.0, 0.0] and ages == [2, 2]  # 5 came back as a new weight
    assert opt.state[layer.sparse_values["default"]]["exp_avg"].tolist() == [0.0, 0.0]


def test_ag_seeds_both_moments_of_grown_weights_with_their_own_age_in_the_bias_correction():
    """The grown index 6 above: m = ĝ(1 − β₁²), v = ŝ(1 − β₂²), age γ = 2, written at the reselection; the next step
    (lr 0.1, G3) corrects 6 by its age 2 and the kept 5 by its age 3:
    φ ← φ − lr·m'/((√v' + ε)(1 − β₁ᵃ)/√(1 − β₂ᵃ)). The default seeds only v, by the global step, at the next step."""
    G3 = [[0.0, 0.0, 0.0, 0.0], [0.0, 0.2, 0.7, 0.0]]
    model, layer = _probe([0, 5], [0.3, -0.2], reference="authors")
    opt = _optimizer(model, "authors")
    scheduler = SpIELScheduler(model, opt, total_steps=20)
    _steps(model, opt, scheduler, [G1, G2])
    for group in opt.param_groups:
        group["lr"] = 0.1
    _steps(model, opt, scheduler, [G3])
    m_prev = {5: 0.9 * 0.1 * 0.5 + 0.1 * 0.4, 6: -0.6 * (1 - B1**2)}
    v_prev = {5: B2 * 0.001 * 0.25 + 0.001 * 0.16, 6: 0.45 * (1 - B2**2)}
    g3, age, start = {5: 0.2, 6: 0.7}, {5: 3, 6: 2}, {5: -0.2, 6: 0.0}
    want = []
    for i in (5, 6):
        m = B1 * m_prev[i] + (1 - B1) * g3[i]
        v = B2 * v_prev[i] + (1 - B2) * g3[i] ** 2
        want.append(start[i] - 0.1 * m / ((math.sqrt(v) + 1e-8) * (1 - B1 ** age[i]) / math.sqrt(1 - B2 ** age[i])))
    torch.testing.assert_close(layer.sparse_values["default"].detach(), torch.tensor(want))
    torch.testing.assert_close(opt.state[layer.sparse_values["default"]]["age"], torch.tensor([4.0, 3.0]))

    model, layer = _probe([0, 5], [0.3, -0.2], score_normalization="none")  # the default: AdamW, second moment by step t
    opt = _optimizer(model, None)
    scheduler = SpIELScheduler(model, opt, total_steps=20)
    _steps(model, opt, scheduler, [G1, G2])
    state = opt.state[layer.sparse_values["default"]]
    assert state["exp_avg"].tolist() == [0.0, 0.0] and state["exp_avg_sq"].tolist() == [0.0, 0.0]  # (seeds wait for the next step)
    _steps(model, opt, scheduler, [G3])
    torch.testing.assert_close(state["exp_avg"], torch.tensor([0.1 * 0.2, 0.1 * 0.7]))  # (no first-moment seed)
    s_hat = {5: (0.25 + 0.16) / 2, 6: 0.45}
    torch.testing.assert_close(state["exp_avg_sq"], torch.tensor([B2 * s_hat[i] * (1 - B2**2) + (1 - B2) * g3[i] ** 2 for i in (5, 6)]))


def test_cosine_schedule_has_no_full_first_replacement():
    """Cosine, ξ = 0.5, T = 20, first reselection at t = γ = 2: the released k = int(4·0.5·(1 + cos(π/10))/2) =
    int(1.951) = 1, so only the smallest |φ| (index 1) is dropped and the best candidate (4, |Σg| = 1.8) grown;
    the default replaces all 4 there (Eq. 7.6's first case under either schedule)."""
    grads = [[[0.05, 0.01, 0.02, 0.03], [0.9, 0.8, 0.7, 0.6]]] * 2
    assert released_replacement_count(2, 20, 4, 0.5, "cosine", 2) == 1
    model, layer = _probe([0, 1, 2, 3], [0.4, 0.1, 0.3, 0.2], reference="authors", schedule="cosine", initial_reselection_rate=0.5)
    opt = _optimizer(model, "authors")
    reports = _steps(model, opt, SpIELScheduler(model, opt, total_steps=20), grads)
    indices, values, _ = _state(layer)
    assert reports[2]["spiel/replaced"] == 1
    assert indices == [0, 2, 3, 4] and values == torch.tensor([0.4, 0.3, 0.2, 0.0]).tolist()

    model, layer = _probe([0, 1, 2, 3], [0.4, 0.1, 0.3, 0.2], schedule="cosine", initial_reselection_rate=0.5, score_normalization="none")
    opt = _optimizer(model, None)
    reports = _steps(model, opt, SpIELScheduler(model, opt, total_steps=20), grads)
    assert reports[2]["spiel/replaced"] == 4 and _state(layer)[0] == [4, 5, 6, 7]


def test_windows_after_the_first_are_gamma_plus_one_steps_from_step_kS():
    """S = 6, γ = 2: reselections at 2, 8, 14. The released windows are 1–2, 6–8, 12–14 (candidates from the first
    step of each), the default's 1–2, 7–8, 13–14. G6 points at index 7, G7 at index 4: the released reselection at
    t = 8 drops index 1 (smallest |φ|) and grows 7 (Σg = 5 + 0 + 1 over three steps), seeded with ĝ = 6/3,
    ŝ = 26/3 and age 3; the default grows 4 (Σg = 3 + 1 over its two steps)."""
    assert [t for t in range(1, 15) if released_in_estimation_window(t, 6, 2, 20)] == [1, 2, 6, 7, 8, 12, 13, 14]
    assert [t for t in range(1, 15) if in_estimation_window(t, 6, 2, 20)] == [1, 2, 7, 8, 13, 14]
    row0 = [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]  # steps 1–2: row 0 is the best, so it stays
    zero = [[0.0] * 4, [0.0] * 4]
    G6, G7, G8 = [[0.0] * 4, [0.0, 0.0, 0.0, 5.0]], [[0.0] * 4, [3.0, 0.0, 0.0, 0.0]], [[0.0] * 4, [1.0, 0.0, 0.0, 1.0]]

    def run(reference):
        fields = {"reference": "authors"} if reference else {"score_normalization": "none"}
        model, layer = _probe([0, 1, 2, 3], initial_reselection_rate=0.5, **fields)
        opt = _optimizer(model, reference)
        scheduler = SpIELScheduler(model, opt, total_steps=20)
        _steps(model, opt, scheduler, [row0, row0])
        edit.set_values(model, {layer.module_name: torch.tensor([0.4, 0.1, 0.3, 0.2])})
        reports = _steps(model, opt, scheduler, [zero, zero, zero, G6, G7, G8])
        return layer, opt, reports

    layer, opt, reports = run("authors")
    assert reports[8]["spiel/replaced"] == 1 and _state(layer)[0] == [0, 2, 3, 7]
    state = opt.state[layer.sparse_values["default"]]
    torch.testing.assert_close(state["age"][3], torch.tensor(3.0))
    torch.testing.assert_close(state["exp_avg"][3], torch.tensor(2.0 * (1 - B1**3)))
    torch.testing.assert_close(state["exp_avg_sq"][3], torch.tensor(26 / 3 * (1 - B2**3)))
    layer, _, reports = run(None)
    assert reports[8]["spiel/replaced"] == 1 and _state(layer)[0] == [0, 2, 3, 4]


def test_k_is_computed_in_floating_point():
    """ξ = 0.2, T = 20, d_φ = 25 at t = 16: ξ(T − t)/T·d = 1 exactly, but 25·(0.2·(1 − 16/20)) = 0.999… in floating
    point, so the released code replaces 0 where the exact floor replaces 1."""
    assert released_replacement_count(16, 20, 25, 0.2, "linear", 2) == 0
    assert replacement_count(16, 20, 25, 0.2, "linear", 2) == 1
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 10, generator=g) for _ in range(17)]
    for reference, want in (("authors", 0), (None, 1)):
        fields = {"reference": reference} if reference else {"score_normalization": "none"}
        model, _ = _probe(list(range(0, 50, 2)), shape=(5, 10), reselection_steps=7, initial_reselection_rate=0.2, **fields)
        opt = _optimizer(model, reference)
        reports = _steps(model, opt, SpIELScheduler(model, opt, total_steps=20), grads[:16])
        assert sorted(reports) == [2, 9, 16] and reports[16]["spiel/replaced"] == want


def test_growth_ranks_candidates_by_the_sum_of_gradients_not_column_normalised():
    """G = [[3, 0, 0, 0], [4, 1, 0, 0]] at both window steps; active {2, 3} (gradient 0). |Σg| picks 4 (8) and 0 (6).
    The default divides by each column's RMS gradient (col 0: √12.5, col 1: √0.5): 5 (1.41) and 4 (1.13) win."""
    G = [[3.0, 0.0, 0.0, 0.0], [4.0, 1.0, 0.0, 0.0]]
    model, layer = _probe([2, 3], reference="authors")
    opt = _optimizer(model, "authors")
    _steps(model, opt, SpIELScheduler(model, opt, total_steps=20), [G, G])
    assert _state(layer)[0] == [0, 4]
    model, layer = _probe([2, 3])  # the default: score_normalization='column'
    opt = _optimizer(model, None)
    _steps(model, opt, SpIELScheduler(model, opt, total_steps=20), [G, G])
    assert _state(layer)[0] == [4, 5]


def test_gradient_accumulation_seeds_average_micro_batches():
    """Two micro-batches per optimizer step: the released seeds average the window's micro-batch gradients,
    ĝ = Σg/4, ŝ = Σg²/4 over 2 steps × 2 micro-batches, with age 2 (the steps)."""
    model, layer = _probe([0, 5], [0.3, -0.2], reference="authors")
    opt = _optimizer(model, "authors")
    scheduler = SpIELScheduler(model, opt, total_steps=20)
    micro = [([[0.0] * 4, [0.0, 0.1, -0.5, 0.0]], [[0.0] * 4, [0.0, 0.2, -0.4, 0.0]]),
             ([[0.0] * 4, [0.0, 0.3, 0.1, 0.0]], [[0.0] * 4, [0.0, 0.1, -0.6, 0.0]])]  # fmt: skip
    for a, b in micro:
        model(torch.tensor(a)).backward()
        model(torch.tensor(b)).backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
    assert _state(layer)[0] == [5, 6]
    g6 = [-0.5, -0.4, 0.1, -0.6]
    state = opt.state[layer.sparse_values["default"]]
    torch.testing.assert_close(state["exp_avg"][1], torch.tensor(sum(g6) / 4 * (1 - B1**2)))
    torch.testing.assert_close(state["exp_avg_sq"][1], torch.tensor(sum(x * x for x in g6) / 4 * (1 - B2**2)))
    assert float(state["age"][1]) == 2.0


# ------------------------------------------------------------------------------------------- SpIEL-MA


def test_ma_never_grows_an_index_that_was_active_before_the_reselection():
    """3×3, active (0,0) and (1,1) with gradients 2 and 1 at step 1: SM3's R = C = (4, 1, 0), scores
    √⁴(R_i·C_j): (0,0) 2, (0,1) = (1,0) 1.41, (1,1) 1. At the full replacement (t = γ = 1) the released code grows
    outside every old index: (0,1) and (1,0); the default re-picks (0,0). In a partial reselection the default grows
    back the weight it drops where that scores best; the released code takes the best weight inactive before."""
    G = [[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    for reference, want in (("authors", [1, 3]), (None, [0, 1])):
        fields = {"reference": reference} if reference else {}
        model, layer = _probe([0, 4], shape=(3, 3), growth="ma", reselection_steps=4, gradient_estimation_steps=1, **fields)
        opt = _optimizer(model, reference, growth="ma")
        reports = _steps(model, opt, SpIELScheduler(model, opt, total_steps=10), [G])
        assert reports[1]["spiel/replaced"] == 2
        assert _state(layer)[0] == want and _state(layer)[1] == [0.0, 0.0]
    row, col = torch.tensor([4.0, 1.0, 0.0]), torch.tensor([4.0, 1.0, 0.0])
    values, indices = torch.tensor([0.1, 0.5]), torch.tensor([0, 4], dtype=torch.int32)  # drop (0,0), the best scored
    assert reselect_ma(values, indices, 1, row, col).indices.tolist() == [0, 4]
    assert reselect_ma(values, indices, 1, row, col, exclude_active=True).indices.tolist() == [1, 4]


def test_ag_selection_keeps_regrown_units_in_their_slots():
    """reselect_ag on its own: drop 3 (|φ| 0.01), grow the best eligible candidates 3 and 4; 3 stays in slot 0
    with keep_regrown (no weight left), and comes back as a new slot (−1) without."""
    values, indices = torch.tensor([0.01, 0.9]), torch.tensor([3, 6], dtype=torch.int32)
    kept = reselect_ag(values, indices, 1, torch.tensor([3, 4], dtype=torch.int32), torch.tensor([2.0, 1.0]), keep_regrown=True)
    assert kept.indices.tolist() == [3, 6] and kept.source.tolist() == [0, 1] and kept.dropped == 0
    assert kept.units.tolist() == [3, 6] and kept.grown_from.tolist() == [-1, -1]
    new = reselect_ag(values, indices, 1, torch.tensor([3, 4], dtype=torch.int32), torch.tensor([2.0, 1.0]))
    assert new.indices.tolist() == [3, 6] and new.source.tolist() == [-1, 1] and new.dropped == 1


# ------------------------------------------------------------------------------------------- the budget


def test_budget_is_a_fraction_of_all_the_models_parameters_split_by_size_with_floors():
    """tiny_llama: 21,728 parameters, of which the 14 projections hold 15,360 (q, o 1,024; k, v 512; gate, up, down
    1,536). density 0.01: the released N = ⌊217.28⌋ = 217, per tensor ⌊217·n/15,360⌋ = 14, 7, 7, 14, 21, 21, 21 per
    layer, 210 in all; the default takes 1% of the targeted weights, round(153.6) = 154."""
    released = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.01, reference="authors"))
    counts = released.peft_config["default"].tunable_weights_per_module
    per_layer = [14, 7, 7, 14, 21, 21, 21]
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert counts == {f"model.layers.{i}.{n}": c for i in (0, 1) for n, c in zip(names, per_layer)}
    assert sum(counts.values()) == 210
    default = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.01))
    assert sum(default.peft_config["default"].tunable_weights_per_module.values()) == 154


# ------------------------------------------------------------------------------------------- LT-SFT


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 2, bias=False), nn.Linear(4, 2, bias=False)

    def forward(self, x):
        return self.a(x).sum() + self.b(x).sum()


def _lt_selected(deltas: dict, **fields) -> dict:
    """LT-SFT's selection after a dense phase that moved the weights by ``deltas`` (|θ₁ − θ₀| = |φ|)."""
    model = get_peft_model(Two(), LTSFTConfig(target_modules=["a", "b"], dense_steps=1, sparse_steps=1, **fields))
    layers = {layer.module_name: layer for layer in model.modules() if isinstance(layer, SparseLayer)}
    with torch.no_grad():
        for name, delta in deltas.items():
            layers[name].sparse_values["default"].copy_(torch.tensor(delta))
    LTSFTScheduler(model).select_and_rewind()
    return {name: layer.sparse_indices["default"].tolist() for name, layer in layers.items()}


def test_lt_sft_selects_one_global_top_k():
    """K = 4 of 16 weights: the released selection takes the 4 largest |φ| over both tensors (all in a), the default
    each tensor's share (2 and 2)."""
    deltas = {"a": [0.9, 0.8, 0.7, 0.6, 0, 0, 0, 0], "b": [0.1, 0.05, 0, 0, 0, 0, 0, 0]}
    assert _lt_selected(deltas, density=0.25, reference="authors") == {"a": [0, 1, 2, 3], "b": []}
    assert _lt_selected(deltas, density=0.25) == {"a": [0, 1], "b": [0, 1]}


class EmbedAndPool(nn.Module):
    """A word embedding and a pooler-like Linear: the released LT-SFT ranks both with the other weights."""

    def __init__(self):
        super().__init__()
        self.embed, self.pooler = nn.Embedding(4, 2), nn.Linear(2, 2, bias=False)

    def forward(self, ids):
        return self.pooler(self.embed(ids)).sum()


def test_lt_sft_ranks_targeted_embeddings_and_pooler_in_the_one_threshold():
    """The eligible-weights row, as far as it is reproduced: targeted embeddings and a pooler stand in the same global
    threshold as every other weight. 12 weights (embedding 4×2, pooler 2×2), density 0.25: K = ⌊3⌋ = 3; the
    embedding holds the three largest |φ| (0.9, 0.8, 0.75), so the released selection keeps those three and no pooler
    weight. The default splits K by size (2 to the embedding, 1 to the pooler). Biases, which the released code also
    ranks, cannot be targeted here in either mode (docs/differences.md)."""
    deltas = {"embed": [0.9, 0.0, 0.8, 0.0, 0.0, 0.75, 0.0, 0.0], "pooler": [0.5, 0.0, 0.0, 0.7]}

    def selected(**fields):
        model = get_peft_model(EmbedAndPool(), LTSFTConfig(target_modules=["embed", "pooler"], density=0.25, dense_steps=1,
                                                           sparse_steps=1, **fields))  # fmt: skip
        layers = {layer.module_name: layer for layer in model.modules() if isinstance(layer, SparseLayer)}
        with torch.no_grad():
            for name, delta in deltas.items():
                layers[name].sparse_values["default"].copy_(torch.tensor(delta))
        LTSFTScheduler(model).select_and_rewind()
        return {name: layer.sparse_indices["default"].tolist() for name, layer in layers.items()}

    assert selected(reference="authors") == {"embed": [0, 2, 5], "pooler": []}
    assert selected() == {"embed": [0, 2], "pooler": [3]}


def test_lt_sft_keeps_every_weight_tied_with_the_kth():
    """density 0.16 of 16 weights: the released K = ⌊2.56⌋ = 2, and the 2nd largest |φ| is 0.3, which four more
    weights share: 5 are kept. The default (global too, to isolate the rule) keeps exactly round(2.56) = 3, ties
    going to the lowest position in tensor order."""
    deltas = {"a": [0.5, 0.3, 0.3, 0.3, 0, 0, 0, 0], "b": [0.3, 0, 0, 0, 0, 0, 0, 0]}
    assert _lt_selected(deltas, density=0.16, reference="authors") == {"a": [0, 1, 2, 3], "b": [0]}
    assert _lt_selected(deltas, density=0.16, selection="global") == {"a": [0, 1, 2], "b": []}


def test_lt_sft_trains_without_the_l1_term_as_the_released_code_does():
    """The released penalty λ/N·Σ|θ − θ₀| builds θ₀ as a copy that keeps gradient history, so its gradient cancels
    (here: the gradient is the loss's alone at λ = 1000). The reference setting trains without it and refuses a
    nonzero l1_reg; the default adds λ/N·sign(φ) before each step."""
    p = nn.Parameter(torch.tensor([0.5, -0.2, 0.0]))
    theta0 = torch.zeros_like(p).copy_(p)  # (the released copy: it carries p's history)
    loss = (p * torch.tensor([1.0, 2.0, 3.0])).sum() + 1000 / 3 * (p - theta0).abs().sum()
    loss.backward()
    assert p.grad.tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="l1_reg=0.1: leave it at 0"):
        LTSFTConfig(target_modules=["a"], density=0.25, reference="authors", l1_reg=0.1)

    def gradient_seen(**fields):
        model = get_peft_model(Two(), LTSFTConfig(target_modules=["a", "b"], density=0.25, dense_steps=2, sparse_steps=1, **fields))
        lt = LTSFTScheduler(model)
        values = [layer.sparse_values["default"] for layer in sparse_layers(model)]
        with torch.no_grad():
            values[0].copy_(torch.tensor([0.5, -0.2, 0, 0, 0, 0, 0, 0]))
        opt = lt.attach(torch.optim.SGD(lt.trainable_parameters(), lr=0.0))
        seen = []
        opt.register_step_post_hook(lambda *a: seen.append(values[0].grad.clone()))
        model(torch.ones(4)).backward()
        opt.step()
        return seen[0], lt.num_parameters

    released, _ = gradient_seen(reference="authors")
    assert released.tolist() == [1.0] * 8  # (∂/∂W of Σ a(x) with x = 1: every weight 1)
    default, n = gradient_seen(l1_reg=1000.0)
    torch.testing.assert_close(default, torch.tensor([1 + 1000 / n, 1 - 1000 / n] + [1.0] * 6))


# ------------------------------------------------------------------------------------------- refusals and composition


@pytest.mark.parametrize("field,value", [("block_shape", (2, 2)), ("budget_split", "adaptive"), ("candidate_ratio", 2.0),
                                         ("drop_criterion", "change"), ("first_full_replacement", True),
                                         ("score_normalization", "column")])  # fmt: skip
def test_settings_the_released_code_fixes_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"reference='authors' runs the released code, which has {field}="):
        SpIELConfig(target_modules="all-linear", density=0.1, reference="authors", **{field: value})
    with pytest.raises(ValueError, match="ma_signal="):
        SpIELConfig(target_modules="all-linear", density=0.1, growth="ma", reference="authors", ma_signal="io")
    with pytest.raises(ValueError, match="selection='per_tensor'"):
        LTSFTConfig(target_modules="all-linear", density=0.1, reference="authors", selection="per_tensor")


def test_the_papers_s_and_gamma_and_the_window_that_would_empty_the_first():
    config = SpIELConfig(target_modules="all-linear", density=0.1, reference="authors")
    assert config.steps_for(600) == (20, 5)  # (the default scales them: 80, 20)
    with pytest.raises(ValueError, match="γ=5 = S − 1"):
        SpIELConfig(target_modules="all-linear", density=0.1, reference="authors", reselection_steps=6).steps_for(100)


def test_the_optimizers_the_released_rules_need():
    model, _ = _probe([0, 5], reference="authors")
    with pytest.raises(TypeError, match="peft_sparse.AgedAdamW"):
        SpIELScheduler(model, torch.optim.AdamW(model.parameters(), lr=0.1), total_steps=20)
    model, _ = _probe([0, 4], shape=(3, 3), growth="ma", reference="authors", reselection_steps=4, gradient_estimation_steps=1)
    params = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(TypeError, match="peft_sparse.SM3"):
        SpIELScheduler(model, torch.optim.AdamW(params), total_steps=10)
    with pytest.raises(ValueError, match="momentum=0.9"):
        SpIELScheduler(model, SM3(params, lr=0.1, momentum=0.9), total_steps=10)
    model, _ = _probe([0, 1, 3, 4, 5], shape=(3, 3), growth="ma", reference="authors", reselection_steps=4, gradient_estimation_steps=1)
    with pytest.raises(ValueError, match="too few inactive ones for the 5"):
        SpIELScheduler(model, SM3([p for p in model.parameters() if p.requires_grad], lr=0.1), total_steps=10)


def test_trainer_with_accumulation_resumes_inside_a_window_exactly(tmp_path):
    """Through transformers.Trainer (AgedAdamW from optimizer_cls_and_kwargs, 2 micro-batches per step): the
    reselections and the optimizer's ages; stopped inside the window of step 7 (steps 5–7) and resumed, the run
    ends bit for bit as the uninterrupted one."""
    from datasets import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from peft_sparse import SpIELCallback

    ids = torch.randint(0, 97, (48, 12), generator=torch.Generator().manual_seed(0)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids, "attention_mask": [[1] * 12] * 48})

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 6

    def trainer(out, *callbacks, **kwargs):
        model = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.1, reference="authors",
                                                         reselection_steps=5, gradient_estimation_steps=2))  # fmt: skip
        args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=12,
                                 logging_steps=1, report_to="none", use_cpu=True, seed=0, **kwargs)  # fmt: skip
        return Trainer(model=model, args=args, train_dataset=data, callbacks=[SpIELCallback(), *callbacks],
                       optimizer_cls_and_kwargs=(AgedAdamW, {"lr": 1e-2}))  # fmt: skip

    full = trainer(tmp_path / "full")
    full.train()
    assert [h["spiel/step"] for h in full.state.log_history if "spiel/step" in h] == [2, 7]
    ages = torch.cat([full.optimizer.state[v]["age"] for v in (l.sparse_values["default"] for l in sparse_layers(full.model))])
    assert set(ages.unique().tolist()) > {13.0}  # (initial weights: 1 + 12 steps; grown ones younger)
    cut = trainer(tmp_path / "cut", StopAt(), save_strategy="steps", save_steps=6)
    cut.train()
    resumed = trainer(tmp_path / "cut")
    resumed.train(resume_from_checkpoint=True)
    for a, b in zip(sparse_layers(full.model), sparse_layers(resumed.model)):
        assert torch.equal(a.sparse_indices["default"], b.sparse_indices["default"])
        assert torch.equal(a.sparse_values["default"], b.sparse_values["default"])
        for key in ("age", "exp_avg", "exp_avg_sq"):
            assert torch.equal(full.optimizer.state[a.sparse_values["default"]][key], resumed.optimizer.state[b.sparse_values["default"]][key])


@pytest.mark.parametrize("growth,stop", [("ag", 4), ("ag", 6), ("ag", 8), ("ma", 5)])
def test_a_plain_loop_resumes_exactly(growth, stop, tmp_path):
    """S = 5, γ = 2: reselections at 2, 7, 12; the released windows are 1–2, 5–7, 10–12. Stopped after step 4 (the
    window opens with step 5: only the released rule arms it there), 6 (inside it) or 8 (between windows), the
    optimizer's state (AgedAdamW's ages and moments, SM3's accumulators) and the scheduler's saved, both rebuilt, and
    the run continued: the adapter after 13 steps is bit for bit the uninterrupted run's."""
    optimizer_cls = AgedAdamW if growth == "ag" else SM3

    def fresh():
        torch.manual_seed(0)
        model = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.1, growth=growth, reference="authors",
                                                         reselection_steps=5, gradient_estimation_steps=2))  # fmt: skip
        opt = optimizer_cls([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        return model, opt, SpIELScheduler(model, opt, total_steps=13)

    def train(model, opt, scheduler, first, last):
        model.train()
        for step in range(first, last):
            x = inputs(seed=step, batch=2, length=9)
            model(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
            scheduler.step()

    model, opt, scheduler = fresh()
    train(model, opt, scheduler, 0, 13)
    expected = {k: v.clone() for k, v in model.state_dict().items() if "sparse_" in k}
    model, opt, scheduler = fresh()
    train(model, opt, scheduler, 0, stop)
    assert bool(scheduler.statistics) == (growth == "ag" and stop in (4, 6))
    scheduler.save(tmp_path / "scheduler")
    state = opt.state_dict()
    scheduler.close()
    opt = optimizer_cls([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    opt.load_state_dict(state)
    scheduler = SpIELScheduler(model, opt, total_steps=13)
    scheduler.load(tmp_path / "scheduler")
    train(model, opt, scheduler, stop, 13)
    got = {k: v for k, v in model.state_dict().items() if "sparse_" in k}
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def test_trl_sft_trainer_runs_the_released_rules(tmp_path):
    """TRL's SFTTrainer with reference='authors' (AgedAdamW through optimizer_cls_and_kwargs, 2 micro-batches per
    step): reselections at 2 and 7 (S = 5, γ = 2); weights grown at 7 were seeded with the age of their window, steps
    5–7, and have taken one step since (age 4). Without AgedAdamW
    the callback refuses the run, naming the optimizer it needs."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from peft_sparse import SpIELCallback

    from .models import tiny_tokenizer

    ids = torch.randint(0, 97, (48, 12), generator=torch.Generator().manual_seed(0)).tolist()
    data = Dataset.from_dict({"input_ids": ids})

    def collate(rows):
        x = torch.tensor([r["input_ids"] for r in rows])
        return {"input_ids": x, "labels": x.clone(), "attention_mask": torch.ones_like(x)}

    def trainer(**kwargs):
        args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=8,
                         learning_rate=1e-2, logging_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
                         dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False)  # fmt: skip
        config = SpIELConfig(target_modules="all-linear", density=0.1, reference="authors", reselection_steps=5, gradient_estimation_steps=2)
        return SFTTrainer(model=tiny_llama(), args=args, train_dataset=data, peft_config=config, callbacks=[SpIELCallback()],
                          data_collator=collate, processing_class=tiny_tokenizer(), **kwargs)  # fmt: skip

    run = trainer(optimizer_cls_and_kwargs=(AgedAdamW, {"lr": 1e-2}))
    run.train()
    assert [h["step"] for h in run.state.log_history if "spiel/replaced" in h] == [2, 7]
    layers = sparse_layers(run.model)
    ages = torch.cat([run.optimizer.state[l.sparse_values["default"]]["age"] for l in layers])
    grown_at_7 = torch.cat([l.sparse_ages["default"] == 7 for l in layers])
    assert grown_at_7.any() and bool((ages[grown_at_7] == 4.0).all())
    with pytest.raises(TypeError, match="peft_sparse.AgedAdamW"):
        trainer().train()


def test_a_reference_adapter_saves_loads_and_merges(tmp_path):
    from peft import PeftConfig, PeftModel

    model = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.1, reference="authors", init_weights=False))
    model.save_pretrained(tmp_path)
    config = PeftConfig.from_pretrained(tmp_path)
    assert config.reference == "authors" and config.score_normalization == "none" and config.tunable_weights_per_module == model.peft_config["default"].tunable_weights_per_module
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path)
    x = inputs()
    torch.testing.assert_close(loaded(x).logits, model(x).logits)
    torch.testing.assert_close(loaded.merge_and_unload()(x).logits, model(x).logits, rtol=1e-5, atol=1e-6)


def test_fast_paths_off_choose_the_same_indices():
    """The released rules take the per-tensor selection either way; with the fast paths off the whole run is the
    reference path (same indices, same values)."""
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(4, 6, generator=g) for _ in range(15)]

    def run():
        model, layer = _probe(list(range(0, 24, 3)), shape=(4, 6), reference="authors", initial_reselection_rate=0.5)
        opt = AgedAdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
        _steps(model, opt, SpIELScheduler(model, opt, total_steps=16), grads)
        return layer.sparse_indices["default"].clone(), layer.sparse_values["default"].detach().clone()

    fast = run()
    with peft_sparse.fast_paths(False):
        reference = run()
    assert torch.equal(fast[0], reference[0]) and torch.equal(fast[1], reference[1])


def test_the_differences_page_example_runs():
    """docs/differences.md opens with a runnable example of the switch; it runs as shown (reselections at 5 and 25)."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "differences.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(blocks) == 1
    scope: dict = {}
    exec(compile(blocks[0], "docs/differences.md", "exec"), scope)
    assert scope["scheduler"].t == 30 and scope["config"].steps_for(30) == (20, 5)
    ages = torch.cat([layer.sparse_ages["default"] for layer in sparse_layers(scope["model"])])
    assert set(ages.unique().tolist()) <= {0, 5, 25} and bool((ages == 25).any())
