"""SM3's steady step and the merge rewrites' steady hook: the decisions of the last full step repeated
without their lookups, and every change that must take the full step again taking it.

Both live on the GPU paths (the fused multi-tensor SM3 launch, the multi-tensor merge write). Here they
run on CPU in Triton's interpreter, the GPU paths selected by hand; on a GPU (marked gpu) compiled.
"""

import gc

import pytest
import torch
from peft import get_peft_model

from peft_sparse import SM3, SparseLayer, SpIELConfig, SpIELScheduler
from peft_sparse.core import kernels
from peft_sparse.accel import training_merge as merge_module
from peft_sparse.core.selection import BlockGrid
from peft_sparse.optim import sm3

from .models import (
    assert_backward_matches_reference,
    inputs,
    randomize_values,
    sparse_layers,
    tiny_llama,
    train_on,
)

pytest.importorskip("triton", reason="Triton is not installed: no fused paths")

@pytest.fixture(autouse=True)
def _training_merge_on(monkeypatch):
    """The training merge is opt-in (``training_merge=True``); these tests check it, so it is on unless a test turns it off."""
    monkeypatch.setattr(SparseLayer, "merge_for_training", True)



@pytest.fixture
def fused_paths(monkeypatch):
    """The fused SM3 step and the multi-tensor merge write for the tensors' device (on CPU: Triton's
    interpreter). Returns the devices to build models on."""
    from .test_triton_kernels import _let_the_interpreter_index_scalars

    if torch.cuda.is_available():
        return "cuda"
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before starting Python to run the Triton kernels on CPU")
    _let_the_interpreter_index_scalars()
    from peft_sparse.accel import triton_kernels

    monkeypatch.setattr(sm3, "_fused_device", lambda param: sm3._fused_kernel() is not None)
    monkeypatch.setitem(kernels.SCATTER_SUM_KERNELS, "cpu", triton_kernels.scatter_sum_into)
    return "cpu"


def _count_calls(monkeypatch, owner, name, log: list, tag):
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        result = original(*args, **kwargs)
        log.append((tag, result))
        return result

    monkeypatch.setattr(owner, name, counted)


@pytest.mark.parametrize("block_shape, beta2", [((1, 1), None), ((16, 16), None), ((1, 1), 0.99), ((16, 16), 0.99)])
def test_sm3_steady_steps_equal_the_torch_step_and_see_every_change(fused_paths, monkeypatch, block_shape, beta2):
    """Fourteen SM3 steps (momentum, weight decay, two groups) through the fused launch, against its torch
    step: the same values, momenta and accumulators. Steady steps run back to back (both sets of
    accumulator buffers, and an odd number of them before a change hands the scratch buffers back).
    Between steps: the first group's lr halves (the two groups, one launch at first, split), then both
    lrs halve (read at each steady step), the first layer's indices change in place (as a reselection
    changes them), the state is reloaded, the weight decay changes, a gradient is missing, a values
    tensor moves to new storage. Each forces the full step; every other step is a steady one. Both the sums and
    the moving-average form (β₂: the bias correction follows the step counter on the steady steps too)."""
    device = fused_paths
    runs = []
    for fused in (True, False):
        full_steps = []
        if fused:
            _count_calls(monkeypatch, sm3.SM3, "_fused_steps", full_steps, "full")
        else:
            monkeypatch.setattr(sm3, "_fused_kernel", lambda: None)
        torch.manual_seed(0)
        config = SpIELConfig(target_modules=["q_proj", "k_proj", "gate_proj", "down_proj"], density=0.25, growth="ma",
                             block_shape=block_shape, reselection_steps=50)  # fmt: skip
        model = get_peft_model(tiny_llama(hidden_size=64, intermediate_size=128), config).to(device)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if "mlp" in n]}, {"params": [p for n, p in named if "mlp" not in n]}]
        opt = SM3(groups, lr=0.02, momentum=0.5, weight_decay=0.1, beta2=beta2)
        x = inputs().to(device)
        full_at, kept = [], set()
        for step in range(14):
            model(x, labels=x).loss.backward()
            if step == 10:
                named[1][1].grad = None
            before = len(full_steps)
            opt.step()
            full_at.append(len(full_steps) > before)
            if fused and step == 7:  # the full step after three steady ones used the buffers they handed back
                assert all(id(opt.state[p][k]) in kept for _, p in named for k in ("row_accumulator", "col_accumulator"))
            opt.zero_grad()
            if fused and step == 6:
                kept = {id(t) for buffers in opt._steady.sets for pair in buffers for t in pair}
            if step == 2:
                opt.param_groups[0]["lr"] *= 0.5
            if step == 3:
                for group in opt.param_groups:
                    group["lr"] *= 0.5
            if step == 6:  # other indices for the first layer, in place
                layer = sparse_layers(model)[0]
                indices = layer.sparse_indices["default"]
                layer.release_training_merge()
                bh, bw = block_shape
                grid = BlockGrid(layer.out_features, layer.in_features, block_shape)
                units = (layer.out_features // bh) * (layer.in_features // bw)
                chosen = torch.randperm(units, generator=torch.Generator().manual_seed(5))[: indices.numel() // (bh * bw)].sort().values
                with torch.no_grad():
                    indices.copy_(grid.expand(chosen.to(device)).to(indices.dtype))
            if step == 7:
                opt.load_state_dict(opt.state_dict())
            if step == 8:
                opt.param_groups[1]["weight_decay"] = 0.2
            if step == 11:  # a values tensor on new storage (same object)
                named[2][1].data = named[2][1].data.clone()
        states = [opt.state[p] for _, p in named]
        if fused:  # (the last step was a steady one: the step counters are views of the one tensor it increments)
            assert all(state["step"]._base is opt._steady.steps for state in states)
        runs.append(([p.detach().clone() for _, p in named], states, full_at))
    (v_fused, s_fused, full_at), (v_torch, s_torch, _) = runs
    for a, b in zip(v_fused, v_torch):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the momenta average steps g/√ν̂ of order 1 in the moving-average form (its bias correction: ×7.7 at step 14), where
    # the kernel's division and square root differ from torch's by float32 ulps of that size: atol 1e-5 there
    mom_atol = 1e-6 if beta2 is None else 1e-5
    for a, b in zip(s_fused, s_torch):
        for key in ("row_accumulator", "col_accumulator", "momentum_buffer"):
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=mom_atol if key == "momentum_buffer" else 1e-6)
        assert a["step"].item() == b["step"].item()
    assert [s["step"].item() for s in s_fused].count(13) == 1  # (the one without a gradient at step 10)
    # full at: the first step; after the lr split (2 → 3); after three steady steps, the indices (6 → 7);
    # the reload (8); the weight decay (9); with the missing gradient (10) and the step after it (no memo
    # from 10); the move (12)
    assert full_at == [True, False, False, True, False, False, False, True, True, True, True, True, True, False]


def test_sm3_steady_step_joins_the_step_counters_only_when_they_match(tmp_path):
    """The steady step makes the parameters' step counters views of one tensor (same values; one
    addition increments them all; a saved and loaded state dict keeps them), and leaves them as they are
    when they differ in dtype or shape."""
    items = [(None, {"step": torch.tensor(float(k))}, None, None) for k in range(3)]
    steps = [item[1]["step"] for item in items]
    joined = sm3._SteadyStep._joined_counters(items, steps)
    assert isinstance(joined, torch.Tensor) and joined.tolist() == [0.0, 1.0, 2.0]
    assert all(item[1]["step"]._base is joined and item[1]["step"].dim() == 0 for item in items)
    joined.add_(1)
    assert [item[1]["step"].item() for item in items] == [1.0, 2.0, 3.0]
    held = [item[1]["step"] for item in items]  # (a later steady step keeps them: still the states' counters)
    assert sm3._SteadyStep._joined_counters(items, held) is joined
    assert all(item[1]["step"] is h for item, h in zip(items, held))
    shuffled = [items[1], items[0], items[2]]  # (views out of order: joined anew, values kept)
    again = sm3._SteadyStep._joined_counters(shuffled, [item[1]["step"] for item in shuffled])
    assert again is not joined and again.tolist() == [2.0, 1.0, 3.0]
    torch.save({k: item[1] for k, item in enumerate(items)}, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt")
    assert [loaded[k]["step"].item() for k in range(3)] == [1.0, 2.0, 3.0]
    for odd in (torch.tensor(1.0, dtype=torch.float64), torch.tensor([1.0])):
        mixed = [(None, {"step": torch.tensor(0.0)}, None, None), (None, {"step": odd}, None, None)]
        counters = [item[1]["step"] for item in mixed]
        assert sm3._SteadyStep._joined_counters(mixed, counters) is counters
        assert all(item[1]["step"] is c for item, c in zip(mixed, counters))  # (the states' own tensors, untouched)


def test_a_copied_sm3_steps_like_the_original(fused_paths):
    """copy.deepcopy of an SM3 optimizer (which carries defaults, state and groups only) steps: its own
    scratch buffers, plans and steady step start empty."""
    import copy

    device = fused_paths
    config = SpIELConfig(target_modules=["q_proj", "down_proj"], density=0.25, growth="ma", reselection_steps=50)
    model = get_peft_model(tiny_llama(), config).to(device)
    x = inputs().to(device)
    opt = SM3([p for p in model.parameters() if p.requires_grad], lr=0.01)
    model(x, labels=x).loss.backward()
    opt.step()
    twin = copy.deepcopy(opt)
    assert twin._steady is None and twin._scratch == {} and twin._plans == {}
    twin.step()  # (its own parameters: copies, with their gradients)


def test_sm3_steady_step_keeps_no_layer_alive(fused_paths):
    """The steady step refers to layers weakly: a model deleted while its optimizer lives is freed
    (its base weights with it)."""
    import gc
    import weakref

    device = fused_paths
    config = SpIELConfig(target_modules=["q_proj", "down_proj"], density=0.25, growth="ma")
    model = get_peft_model(tiny_llama(), config).to(device)
    x = inputs().to(device)
    opt = SM3([p for p in model.parameters() if p.requires_grad], lr=0.01)
    model(x, labels=x).loss.backward()
    opt.step()
    assert opt._steady is not None
    weight = weakref.ref(sparse_layers(model)[0].get_base_layer().weight)
    del model
    gc.collect()
    assert weight() is None


def _train_merged(device, steps, events, merge=True, built=None):
    """SpIEL-AG (AdamW) with reselections, merged in place or not; ``events[step](model, opt)`` runs
    after that step; ``built`` (a list) receives the model when built. Returns (losses, values,
    indices, model, opt)."""
    torch.manual_seed(0)
    config = SpIELConfig(target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], density=0.2, growth="ag",
                         reselection_steps=4, gradient_estimation_steps=2)  # fmt: skip
    model = get_peft_model(tiny_llama(), config).to(device)
    if built is not None:
        built.append(model)
    randomize_values(model, scale=0.1)
    for layer in sparse_layers(model):
        layer.merge_for_training = merge
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = SpIELScheduler(model, opt, total_steps=steps)
    losses = train_on(model, opt, scheduler, inputs().to(device), steps, lambda step: step in events and events[step](model, opt))
    values = [layer.sparse_values["default"].detach().clone() for layer in sparse_layers(model)]
    indices = [layer.sparse_indices["default"].clone() for layer in sparse_layers(model)]
    return losses, values, indices, model, opt


def test_steady_merge_rewrites_train_bit_for_bit_and_see_every_change(fused_paths, monkeypatch):
    """The step hook's repeated rewrites (one kept launch, no lookups) train bit for bit like the
    transient copies, through reselections (indices rewritten in place), an eval/train switch (merges
    released and set up again), values moved to new storage, a layer leaving the in-place merge, a
    disabled adapter, a layer merging again, a base weight on new storage (and a step before the next
    forward pass), a layer's values replaced by another Parameter (which the optimizer does not
    hold: the hook leaves that layer alone) and an optimizer group's member replaced in place for a step. Right after each steady rewrite every merged layer's weight holds θ₀ + φ, known
    to be current (the next forward writes nothing), one generation on and its version counter moved."""
    device = fused_paths
    built, ran = [], []
    original_run = merge_module._SteadyRefresh.run

    def probed_run(self, groups):
        held = {id(p) for g in groups for p in g["params"]}
        layers = [layer for layer in sparse_layers(built[0])
                  if layer._training_merge is not None and id(layer.sparse_values["default"]) in held]  # fmt: skip
        before = [(layer._training_merge.generation, layer.get_base_layer().weight._version) for layer in layers]
        others = [layer for layer in sparse_layers(built[0]) if layer not in layers]  # (layers compare by identity)
        untouched = [(layer.get_base_layer().weight.detach().clone(), layer._training_merge and layer._training_merge.generation)
                     for layer in others]  # fmt: skip
        result = original_run(self, groups)
        ran.append(result)
        for layer, (weight, generation) in zip(others, untouched):  # not the hook's to write
            assert torch.equal(layer.get_base_layer().weight, weight)
            assert (layer._training_merge and layer._training_merge.generation) == generation
        if result:
            for layer, (generation, version) in zip(layers, before):
                merge, values, weight = layer._training_merge, layer.sparse_values["default"], layer.get_base_layer().weight
                assert merge.current(values)
                assert merge.generation == generation + 1 and weight._version > version
                got = weight.detach().view(-1)[layer.sparse_indices["default"].long()]
                assert torch.equal(got, (merge.base + values.detach()).to(got.dtype))
        return result

    monkeypatch.setattr(merge_module._SteadyRefresh, "run", probed_run)

    def move_values(model, opt):
        values = sparse_layers(model)[1].sparse_values["default"]
        values.data = values.data.clone()

    def leave_merge(model, opt):
        sparse_layers(model)[2].merge_for_training = False

    def switch(model, opt):
        model.eval()
        model.train()

    def disable_once(model, opt):
        with model.disable_adapter():
            model(inputs().to(device))

    def new_weight_storage(model, opt):  # θ₀ in new storage (the merged one holds θ₀ + φ at η)
        layer = sparse_layers(model)[0]
        weight = layer.get_base_layer().weight
        theta0 = weight.detach().clone()
        if layer._training_merge is not None:
            theta0.view(-1)[layer.sparse_indices["default"].long()] = layer._training_merge.base
        weight.data = theta0
        opt.step()  # (no gradients: the values stay) a step hook before any forward pass saw the new storage

    def merge_again(model, opt):
        sparse_layers(model)[2].merge_for_training = True

    def new_values_parameter(model, opt):  # e.g. an assign-load: the optimizer keeps the old one
        layer = sparse_layers(model)[3]
        layer.sparse_values["default"] = torch.nn.Parameter(layer.sparse_values["default"].detach().clone())

    def drop_from_optimizer(model, opt):  # a group's member replaced in place: that layer's values are not held
        params = opt.param_groups[0]["params"]
        held = params[0]
        params[0] = torch.nn.Parameter(torch.zeros(1))
        opt.step()  # (no gradients: nothing changes but the rewrites of the step hook)
        params[0] = held  # (the scheduler's reselections need every values tensor in the optimizer)

    events = {2: move_values, 5: switch, 7: new_weight_storage, 9: leave_merge, 11: disable_once, 12: merge_again,
              15: new_values_parameter, 16: drop_from_optimizer}  # fmt: skip
    merged = _train_merged(device, 19, events, built=built)
    transient = _train_merged(device, 19, events, merge=False)
    assert merged[0] == transient[0]
    for a, b in zip(merged[1], transient[1]):
        assert torch.equal(a, b)
    for a, b in zip(merged[2], transient[2]):
        assert torch.equal(a, b)
    assert ran.count(True) >= 5 and ran.count(False) >= 3  # steady rewrites ran, and changes were seen


def test_a_reselection_keeps_the_step_hooks_rewrites(fused_paths, monkeypatch):
    """A reselection moves every merge to its new indices in place (the same merge objects and θ₀
    tensors): the step hook's kept rewrites survive it, the next step repeats them steady and leaves
    θ₀ + φ at the new indices; training stays bit for bit that of the transient copies."""
    ran, seen = [], {}
    _count_calls(monkeypatch, merge_module._SteadyRefresh, "run", ran, "run")

    def probe(model, opt):
        layers = [layer for layer in sparse_layers(model) if layer._training_merge is not None]
        seen[len(seen)] = (merge_module._STEADY_REFRESH.get(opt), [(layer._training_merge, layer._training_merge.base) for layer in layers],
                           [layer.sparse_indices["default"].clone() for layer in layers], len(ran))  # fmt: skip
        for layer in layers:
            merge, values = layer._training_merge, layer.sparse_values["default"].detach()
            got = layer.get_base_layer().weight.detach().view(-1)[layer.sparse_indices["default"].long()]
            assert torch.equal(got, (merge.base + values).to(got.dtype))

    # steps are counted from 0 here: the reselection at t = 6 ends step 5
    merged = _train_merged(fused_paths, 9, {4: probe, 5: probe, 6: probe})
    (memo, merges, indices, _), (memo_after, merges_after, indices_after, _), (memo_next, merges_next, _, runs) = (seen[i] for i in range(3))
    assert memo is not None and memo_after is memo and memo_next is memo
    assert all(a[0] is b[0] and a[1] is b[1] for a, b in zip(merges, merges_after)) and len(merges) == len(merges_after) > 0
    assert all(a[0] is b[0] for a, b in zip(merges, merges_next))
    assert not all(torch.equal(a, b) for a, b in zip(indices, indices_after))  # (the reselection moved indices)
    assert ran[runs - 1] == ("run", True)  # the step after the reselection: steady
    transient = _train_merged(fused_paths, 9, {}, merge=False)
    assert merged[0] == transient[0] and all(torch.equal(a, b) for a, b in zip(merged[1], transient[1]))


def test_steady_merge_rewrite_before_a_pending_backward(fused_paths, monkeypatch):
    """An optimizer step between a forward and its backward (no gradients yet: the values stay), its
    rewrite a steady one: the backward notices the rewrite and builds W + scatter(η, φ) itself, the
    gradients as with transient copies."""
    import copy

    device = fused_paths
    _, _, _, model, opt = _train_merged(device, 3, {})
    reference = copy.deepcopy(model)
    for layer in sparse_layers(reference):
        layer.merge_for_training = False
    ran = []
    _count_calls(monkeypatch, merge_module._SteadyRefresh, "run", ran, "steady")
    x = inputs(seed=3).to(device)
    loss = model(x, labels=x).loss
    opt.step()
    assert ran == [("steady", True)]
    assert_backward_matches_reference(loss, model, reference, x)


def test_steady_merge_rewrites_keep_no_layer_alive(fused_paths):
    import gc
    import weakref

    _, _, _, model, opt = _train_merged(fused_paths, 3, {})
    steady = merge_module._STEADY_REFRESH.get(opt)
    assert steady is not None
    weight = weakref.ref(sparse_layers(model)[0].get_base_layer().weight)
    storages = {layer.get_base_layer().weight.untyped_storage().data_ptr() for layer in sparse_layers(model)}
    del model
    gc.collect()
    assert weight() is None
    # nothing the steady rewrites hold keeps a weight's storage (e.g. a view of it)
    assert not any(t.untyped_storage().data_ptr() in storages for t in _tensors_reachable(steady) if t.numel())


def _tensors_reachable(root, depth: int = 5) -> list:
    seen, found, frontier = {}, [], [root]  # (seen holds the objects, so that no id is reused while it counts)
    for _ in range(depth):
        nxt = []
        for obj in frontier:
            if id(obj) in seen or isinstance(obj, (type, str, bytes, int, float)):
                continue
            seen[id(obj)] = obj
            if isinstance(obj, torch.Tensor):
                found.append(obj)
                continue
            slots = getattr(type(obj), "__slots__", ())
            nxt.extend(getattr(obj, name) for name in slots if name != "__weakref__" and hasattr(obj, name))
            nxt.extend(gc.get_referents(obj))
        frontier = nxt
    return found
