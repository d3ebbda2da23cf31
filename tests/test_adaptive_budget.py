"""budget_split='adaptive': SpIEL-AG reselects over all tensors at once, so tensors gain and lose weights."""

import pytest
import torch
from peft import PeftModel, get_peft_model

import peft_sparse
from peft_sparse import SparseFTConfig, SpIELConfig, SpIELScheduler
from peft_sparse.core import edit

from .models import inputs, sparse_layers, tiny_llama

T = 20


def _model(seed=0, **fields):
    base = dict(target_modules="all-linear", density=0.1, reselection_steps=6, gradient_estimation_steps=2, budget_split="adaptive")
    base.update(fields)
    return get_peft_model(tiny_llama(seed=seed), SpIELConfig(**base))


def _train(model, steps, lr=1e-2):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    scheduler = SpIELScheduler(model, optimizer, total_steps=T)
    model.train()
    reports = []
    loss = None
    for step in range(1, steps + 1):
        x = inputs(seed=step, batch=4, length=9)
        loss = model(x, labels=x).loss  # (the previous step's graph stays alive until here, as in most loops)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        reports.append(scheduler.step())
    return scheduler, optimizer, reports


def _sizes(model):
    return {m.module_name: m.sparse_values["default"].numel() for m in sparse_layers(model)}


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "reference"])
def test_budget_moves_between_tensors_and_the_total_stays(fast):
    model = _model()
    before = _sizes(model)
    values_objects = [m.sparse_values["default"] for m in sparse_layers(model)]
    with peft_sparse.fast_paths(fast):
        scheduler, optimizer, reports = _train(model, 14)  # reselections at t = 2, 8, 14
    after = _sizes(model)
    assert sum(after.values()) == sum(before.values())
    assert after != before  # some tensor gained weights, another lost them
    assert min(after.values()) >= 1
    assert model.peft_config["default"].tunable_weights_per_module == after
    assert any(r.get("spiel/budget_moved", 0) > 0 for r in reports)
    for m, values in zip(sparse_layers(model), values_objects):
        assert m.sparse_values["default"] is values  # resized in place: the optimizer still holds them
        idx = m.sparse_indices["default"]
        assert idx.numel() == values.numel() == m.sparse_ages["default"].numel()
        assert bool((idx[1:] > idx[:-1]).all())  # ascending and distinct
        state = optimizer.state[values]
        assert state["exp_avg"].shape == values.shape and state["exp_avg_sq"].shape == values.shape


def test_fast_and_reference_paths_choose_the_same_indices():
    got = []
    for fast in (True, False):
        model = _model()
        with peft_sparse.fast_paths(fast):
            _train(model, 14)
        got.append([(m.sparse_indices["default"].clone(), m.sparse_values["default"].detach().clone()) for m in sparse_layers(model)])
    for (ia, va), (ib, vb) in zip(*got):
        assert torch.equal(ia, ib)
        torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-6)


def test_the_grown_weights_are_the_largest_adam_steps_of_all_candidates(monkeypatch):
    """At the first (full) reselection, every grown index is among the candidates with the largest |ĝ|/√ŝ
    over all tensors, and the kept weights are the largest |φ| over all tensors."""
    model = _model()
    seen = {}

    from peft_sparse.methods.spiel import adaptive

    original = adaptive.reselect_adaptive

    def spy(scheduler, t):
        n = max(1, scheduler.steps_in_window)
        scores = {}
        for layer in scheduler.layers:
            s = scheduler.statistics[layer.module_name]
            g, s2 = s.grad_sum / n, s.grad_sq_sum / n
            active = layer.sparse_indices["default"].long()
            ok = ~torch.isin(s.candidates.long(), active)
            scores[layer.module_name] = (s.candidates.long()[ok], (g.abs() / (s2.sqrt() + 1e-30))[ok])
        seen[t] = scores
        return original(scheduler, t)

    monkeypatch.setattr("peft_sparse.methods.spiel.reselect.reselect_adaptive", spy)
    before = {m.module_name: m.sparse_indices["default"].clone() for m in sparse_layers(model)}
    _train(model, 2)  # t = γ = 2: the first, full replacement
    scores = seen[2]
    all_scores = torch.cat([s for _, s in scores.values()])
    grown = []
    for m in sparse_layers(model):
        idx = m.sparse_indices["default"].long()
        new = idx[~torch.isin(idx, before[m.module_name].long())]
        cand, s = scores[m.module_name]
        pos = torch.searchsorted(cand.sort().values, new)
        grown.append(s[cand.argsort()][pos])
    grown = torch.cat(grown)
    threshold = torch.topk(all_scores, grown.numel()).values.min()
    assert bool((grown >= threshold).all())


def test_a_saved_adaptive_adapter_loads_with_its_sizes_and_gives_the_same_outputs(tmp_path):
    model = _model()
    _train(model, 14)
    model.eval()
    x = inputs(seed=99, batch=2, length=7)
    with torch.no_grad():
        want = model(x).logits
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(tiny_llama(seed=0), tmp_path)
    loaded.eval()
    assert _sizes(loaded) == _sizes(model)
    with torch.no_grad():
        got = loaded(x).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_loading_a_resized_checkpoint_into_the_model_as_first_built_resizes_it(tmp_path):
    """A Trainer resume loads the checkpoint's adapter into the model built from the original config: the
    layers of an adaptive adapter take the saved sizes (the same Parameter objects)."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    model = _model()
    _train(model, 14)
    model.save_pretrained(tmp_path)
    fresh = _model()
    objects = [m.sparse_values["default"] for m in sparse_layers(fresh)]
    set_peft_model_state_dict(fresh, load_peft_weights(str(tmp_path)))
    assert _sizes(fresh) == _sizes(model)
    assert fresh.peft_config["default"].tunable_weights_per_module == _sizes(model)
    for m, values, ref in zip(sparse_layers(fresh), objects, sparse_layers(model)):
        assert m.sparse_values["default"] is values
        assert torch.equal(m.sparse_indices["default"].long(), ref.sparse_indices["default"].long())
        assert torch.equal(values.detach(), ref.sparse_values["default"].detach())


def test_resize_slots_keeps_values_ages_and_adam_state_of_kept_slots():
    model = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.1, budget_split="adaptive"))
    layer = sparse_layers(model)[0]
    values = layer.sparse_values["default"]
    optimizer = torch.optim.AdamW([values], lr=1e-2)
    with torch.no_grad():
        values.copy_(torch.arange(values.numel(), dtype=values.dtype))
    values.grad = torch.ones_like(values)
    optimizer.step()
    old_idx = layer.sparse_indices["default"].long().clone()
    old_vals = values.detach().clone()
    old_m = optimizer.state[values]["exp_avg"].clone()
    free = torch.tensor(sorted(set(range(layer.numel)) - set(old_idx.tolist()))[:3])
    keep = torch.arange(1, old_idx.numel())  # drop slot 0, grow three: one weight more
    new = torch.cat([old_idx[keep], free]).sort()
    source = torch.cat([keep, torch.full((3,), -1)])[new.indices]
    edit.resize_slots([layer], "default", [source], [new.values], optimizer=optimizer, step=5)
    assert values.numel() == old_idx.numel() + 2
    grown = source < 0
    assert torch.equal(values.detach()[~grown], old_vals[source[~grown]])
    assert bool((values.detach()[grown] == 0).all())
    assert torch.equal(optimizer.state[values]["exp_avg"][~grown], old_m[source[~grown]])
    assert bool((optimizer.state[values]["exp_avg"][grown] == 0).all())
    assert bool((layer.sparse_ages["default"][grown] == 5).all())
    values.grad = torch.ones_like(values)
    optimizer.step()  # the optimizer follows the new size


@pytest.mark.parametrize(
    "config, match",
    [
        (lambda: SparseFTConfig(target_modules="all-linear", density=0.1, budget_split="adaptive"), "SparseFTConfig keeps its indices"),
        (lambda: SpIELConfig(target_modules="all-linear", density=0.1, budget_split="adaptive", growth="ma"), "growth='ma'"),
        (lambda: SpIELConfig(target_modules="all-linear", density=0.1, budget_split="adaptive", block_shape=(4, 4)), r"block_shape=\(4, 4\)"),
    ],
)
def test_adaptive_split_is_refused_where_nothing_moves_budget(config, match):
    with pytest.raises(ValueError, match=match):
        config()


@pytest.mark.parametrize("stop", [6, 7], ids=["inside-window", "right-after-reselection"])
def test_trainer_resume_of_an_adaptive_adapter_is_bit_identical(stop, tmp_path):
    """The checkpoint holds resized tensors; the resumed run's model, built from the original config, takes
    their sizes when the Trainer loads it, and the rest of the run is the same as without the stop."""
    from transformers import Trainer

    from peft_sparse import SpIELCallback

    from .test_spiel_trainer import GAMMA, S, _args, _assert_same, _dataset, _snapshot, _StopAt

    def build():
        config = SpIELConfig(target_modules="all-linear", density=0.1, reselection_steps=S, gradient_estimation_steps=GAMMA,
                             budget_split="adaptive")  # fmt: skip
        return get_peft_model(tiny_llama(), config)

    T = 14
    full = Trainer(model=build(), args=_args(tmp_path / "full", T), train_dataset=_dataset(), callbacks=[SpIELCallback()])
    full.train()
    want = _snapshot(full)
    assert _sizes(full.model) != _sizes(build())  # budget moved
    first = Trainer(model=build(), args=_args(tmp_path / "cut", T, save_strategy="steps", save_steps=stop),
                    train_dataset=_dataset(), callbacks=[SpIELCallback(), _StopAt(stop)])  # fmt: skip
    first.train()
    resumed = Trainer(model=build(), args=_args(tmp_path / "cut", T), train_dataset=_dataset(), callbacks=[SpIELCallback()])
    resumed.train(resume_from_checkpoint=True)
    _assert_same(want, _snapshot(resumed))


def test_a_resize_keeps_the_seeding_hooks_and_works_while_an_old_graph_is_alive():
    model = _model()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    scheduler = SpIELScheduler(model, optimizer, total_steps=T)
    model.train()
    kept_graph = None
    for step in range(1, 4):  # the first reselection at t = 2 resizes; step 3's backward follows it
        x = inputs(seed=step, batch=4, length=9)
        loss = model(x, labels=x).loss
        loss.backward()
        if step == 3:
            assert scheduler.seeding.raw  # the post-accumulate hooks of the resized values fired
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        kept_graph = loss  # noqa: F841 (held across the reselection on purpose)
    assert _sizes(model) != {m.module_name: m.numel // 10 for m in sparse_layers(model)}


def test_a_reselection_reads_the_device_twice_not_per_tensor(monkeypatch):
    """Every read of a device value (tolist, item, bool, int, nonzero) waits for a GPU's queue; the adaptive
    reselection ranks over the concatenations and reads twice, whatever the number of tensors."""
    import peft_sparse.methods.spiel.reselect as scheduler_module

    reads = []
    original = scheduler_module.reselect_adaptive

    def counted(*args, **kwargs):
        with monkeypatch.context() as m:
            for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
                method = getattr(torch.Tensor, name)
                m.setattr(torch.Tensor, name, lambda self, *a, _f=method, _n=name, **k: (reads.append(_n), _f(self, *a, **k))[1])
            nonzero = torch.nonzero
            m.setattr(torch, "nonzero", lambda *a, **k: (reads.append("torch.nonzero"), nonzero(*a, **k))[1])
            before = len(reads)
            report = original(*args, **kwargs)
            assert len(reads) - before == 2 or not report, reads[before:]
            return report

    monkeypatch.setattr(scheduler_module, "reselect_adaptive", counted)
    model = _model()
    _, _, reports = _train(model, 13)
    assert sum(1 for r in reports if r) == 2 and len(sparse_layers(model)) == 14 and set(reads) == {"tolist"}


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda idx, src: (idx.flip(0), src.flip(0)), "unsorted"),
        (lambda idx, src: (torch.cat([idx[:1], idx[:-1]]), src), "duplicate"),
        (lambda idx, src: (torch.cat([idx[:-1], torch.tensor([10**6])]), src), "outside the tensor"),
        (lambda idx, src: (idx, torch.cat([src[:-1], torch.tensor([10**6])])), "source slot is outside"),
        (lambda idx, src: (idx, src[:-1]), "sources for"),
    ],
    ids=["unsorted", "duplicate", "index-out-of-range", "source-out-of-range", "count-mismatch"],
)
def test_resize_slots_refuses_bad_indices_by_layer_and_changes_nothing(bad, match):
    model = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.1, budget_split="adaptive"))
    layers = sparse_layers(model)[:2]
    before = [(m.sparse_indices["default"].clone(), m.sparse_values["default"].detach().clone()) for m in layers]
    sources = [torch.arange(m.sparse_values["default"].numel()) for m in layers]
    fresh = [m.sparse_indices["default"].long().clone() for m in layers]
    fresh[1], sources[1] = bad(fresh[1], sources[1])
    with pytest.raises(ValueError, match=match) as error:
        edit.resize_slots(layers, "default", sources, fresh)
    assert layers[1].module_name in str(error.value)
    for m, (idx, vals) in zip(layers, before):
        assert torch.equal(m.sparse_indices["default"], idx) and torch.equal(m.sparse_values["default"].detach(), vals)


def test_the_step_after_an_adaptive_reselection_reads_the_device_no_more_than_a_steady_step(monkeypatch):
    """resize_slots checks the new indices once for all tensors (or takes them as vouched for), so the next
    forward pass does not check each tensor again (three reads of the device per tensor, ~600 on SmolLM2)."""
    reads = []
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
        method = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _f=method, **k: (reads.append(1), _f(self, *a, **k))[1])
    model = _model()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    scheduler = SpIELScheduler(model, optimizer, total_steps=T)
    per_step, reports = [], []
    for step in range(1, 11):  # reselection at t = 2 and 8
        x = inputs(seed=step, batch=2, length=9)
        before = len(reads)
        model(x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reports.append(scheduler.step())
        per_step.append(len(reads) - before)
    assert reports[1] and reports[7] and reports[1]["spiel/budget_moved"] > 0
    steady = per_step[4]  # (t = 5: no window, no reselection)
    assert per_step[2] == steady and per_step[8] == steady, per_step


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_slot_maps_of_all_tensors_at_once_equal_each_tensors_own(seed):
    """The adaptive reselection maps every tensor's slots over the concatenation (:func:`edit.slot_maps`); each
    tensor's part must be exactly :func:`edit.slot_map`'s for that tensor (sources, new indices, where each grown
    index went)."""
    g = torch.Generator().manual_seed(seed)
    model = _model(seed=seed)
    layers = sparse_layers(model)
    offsets, olds, drops, grows, owners = [], [], [], [], []
    at_element = at_slot = 0
    for at, layer in enumerate(layers):
        old = layer.sparse_indices["default"].long()
        n = old.numel()
        drop = torch.randperm(n, generator=g)[: int(torch.randint(0, n + 1, (1,), generator=g))]
        free = torch.ones(layer.numel, dtype=torch.bool)
        free[old[torch.isin(torch.arange(n), drop, invert=True)]] = False  # (grown: anything not kept, dropped ones too)
        pool = free.nonzero().squeeze(1)
        grow = pool[torch.randperm(pool.numel(), generator=g)[: int(torch.randint(0, min(pool.numel(), 2 * n) + 1, (1,), generator=g))]]
        offsets.append(at_element)
        olds.append(old + at_element)
        drops.append(drop.sort().values + at_slot)
        grows.append(grow + at_element)
        owners.append(torch.full((grow.numel(),), at))
        at_element += layer.numel
        at_slot += n
    sizes = [o.numel() for o in olds]
    new_sizes = [s - d.numel() + gr.numel() for s, d, gr in zip(sizes, drops, grows)]
    sources, news, new_slots = edit.slot_maps(torch.cat(olds), torch.cat(drops), torch.cat(grows), sizes, new_sizes, offsets,
                                              torch.cat(owners))  # fmt: skip
    sources, news = sources.split(new_sizes), news.split(new_sizes)
    new_slots = new_slots.split([gr.numel() for gr in grows])
    for at, layer in enumerate(layers):
        expected = edit.slot_map(layer, "default", drops[at] - sum(sizes[:at]), grows[at] - offsets[at], same_count=False)
        assert torch.equal(sources[at], expected[0]), layer.module_name
        assert torch.equal(news[at], expected[1]), layer.module_name
        assert torch.equal(new_slots[at], expected[2]), layer.module_name
