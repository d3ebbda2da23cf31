"""The default training pass (peft_sparse.accel.transient_merge): W + δ written into the base weight only for the
length of each product, θ₀ written back right after.

It must give the reference's results bit for bit, and nothing outside the layer's own forward and backward may
ever see the base weight differ from θ₀: checked for every tensor operation that reads the weight's storage
(a dispatch mode watching them all), for hooks of every kind, state_dict and named_parameters read from them,
gradient checkpointing (re-entrant and not), activation offloading, torch.compile, DDP, FSDP2 and other threads.
"""

import os
import tempfile
import threading

import pytest
import torch
from peft import get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import peft_sparse
from peft_sparse import SM3, SparseFTConfig, SpIELConfig, SpIELScheduler
from peft_sparse.accel import transient_merge
from peft_sparse.core import dispatch

from .models import inputs, randomize_values, sparse_layers, tiny_llama

pytestmark = pytest.mark.fast_only  # (these tests switch the paths themselves)


def _count_passes(monkeypatch) -> list:
    """The passes transient_merge_pass took (one entry per forward it computed)."""
    taken = []
    entry = dispatch._KINDS["linear"]

    def counted(layer, x, active):
        y = transient_merge.transient_merge_pass(layer, x, active)
        if y is not None:
            taken.append(layer)
        return y

    monkeypatch.setattr(entry, "implementations", [counted if f is transient_merge.transient_merge_pass else f for f in entry.implementations])
    return taken


def _spiel(dtype=torch.float32, growth="ag", block_shape=(1, 1), **kw):
    config = SpIELConfig(
        target_modules="all-linear", density=0.2, growth=growth, reselection_steps=3, gradient_estimation_steps=2,
        block_shape=block_shape, **kw,
    )  # fmt: skip
    return get_peft_model(tiny_llama(dtype=dtype), config)


def _weights(model) -> dict:
    return {layer.module_name: layer.get_base_layer().weight.detach().clone() for layer in sparse_layers(model)}


def _train(model, growth, steps=8, step_fn=None) -> list:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = SM3(params, lr=1e-2) if growth == "ma" else torch.optim.AdamW(params, lr=1e-2)
    scheduler = SpIELScheduler(model, opt, total_steps=steps)
    model.train()
    losses = []
    for step in range(steps):
        x = inputs(seed=step)
        loss = step_fn(model, x) if step_fn is not None else model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses


def _state(model) -> list:
    return [(l.sparse_indices["default"].clone(), l.sparse_values["default"].detach().clone(), l.sparse_ages["default"].clone()) for l in sparse_layers(model)]


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """torch's CPU threads for the test: the CPU write and write-back go one way on one thread (index_select,
    index_add_, index_copy_) and another on several (take, put_)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("growth", ["ag", "ma"])
@pytest.mark.parametrize("block_shape", [(1, 1), (4, 4)])
def test_training_is_bit_identical_to_the_reference(monkeypatch, dtype, growth, block_shape, threads):
    """Losses, indices, values and ages step for step (with reselections and windows) as with every fast path
    off (PEFT_SPARSE_FAST=0), and as with the fast paths on but this one not registered; θ₀ intact throughout."""
    runs = []
    entry = dispatch._KINDS["linear"]
    others = [f for f in entry.implementations if f is not transient_merge.transient_merge_pass]
    for setting in ("reference", "without", "transient"):
        model = _spiel(dtype, growth, block_shape)
        theta0 = _weights(model)
        with monkeypatch.context() as m:
            taken = _count_passes(m)
            if setting == "without":
                m.setattr(entry, "implementations", others)
            with peft_sparse.fast_paths(setting != "reference"):
                losses = _train(model, growth)
        assert bool(taken) == (setting == "transient")
        assert all(torch.equal(w, theta0[name]) for name, w in _weights(model).items())
        runs.append((losses, _state(model)))
    for losses, state in runs[1:]:
        assert losses == runs[0][0]
        for a, b in zip(state, runs[0][1]):
            assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_two_adapters_with_overlapping_indices_and_autocast(monkeypatch, threads):
    """Two active adapters sharing positions: W + δ₁ + δ₂ rounded as the reference's copy, θ₀ back exactly (the
    entries read before each write, restored in reverse order). Autocast to the weight's own dtype takes the
    pass; autocast to another dtype leaves it to the reference."""
    taken = _count_passes(monkeypatch)
    layer = torch.nn.Linear(24, 16).to(torch.bfloat16).requires_grad_(False)
    from peft_sparse.core.layer import SparseLinear

    sparse = SparseLinear(layer, "proj")
    sparse.update_layer("a", torch.arange(0, 384, 3), torch.float32)
    sparse.update_layer("b", torch.arange(0, 384, 2), torch.float32)
    sparse.set_adapter(["a", "b"])
    g = torch.Generator().manual_seed(0)
    for name in ("a", "b"):
        with torch.no_grad():
            sparse.sparse_values[name].copy_(torch.randn(sparse.sparse_values[name].shape, generator=g) * 0.37)
    theta0 = layer.weight.detach().clone()
    x = torch.randn(5, 24, generator=g, dtype=torch.bfloat16)
    results = []
    for fast, autocast_dtype in ((False, None), (True, None), (False, torch.bfloat16), (True, torch.bfloat16), (True, torch.float16)):
        xi = x.clone().requires_grad_()
        with peft_sparse.fast_paths(fast), torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            y = sparse(xi)
            y.float().square().sum().backward()
        results.append((y.detach(), xi.grad, [sparse.sparse_values[n].grad.clone() for n in ("a", "b")]))
        for n in ("a", "b"):
            sparse.sparse_values[n].grad = None
        assert torch.equal(layer.weight, theta0)
    assert len(taken) == 2  # the plain pass and autocast to bfloat16; not autocast to float16
    for reference, fast in ((results[0], results[1]), (results[2], results[3])):
        assert torch.equal(reference[0], fast[0]) and torch.equal(reference[1], fast[1])
        assert all(torch.equal(a, b) for a, b in zip(reference[2], fast[2]))


class _WeightWatch(TorchDispatchMode):
    """Every tensor operation that reads a watched base weight's storage: whether the weight held θ₀ then, and
    whether its layer was inside its own product (``_writing_thread`` set). ``outside``: operations that saw
    the weight differ from θ₀ outside the product; ``inside``: the operations run inside it."""

    def __init__(self, model):
        super().__init__()
        self.watched = {}
        for layer in sparse_layers(model):
            weight = layer.get_base_layer().weight
            self.watched[weight.untyped_storage().data_ptr()] = (layer, weight, weight.detach().clone())
        self.outside, self.inside, self.seen = [], set(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat, _ = tree_flatten((args, kwargs or {}))
        for t in flat:
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and not t.is_sparse and t.layout == torch.strided:
                entry = self.watched.get(t.untyped_storage().data_ptr())
                if entry is None:
                    continue
                layer, weight, theta0 = entry
                self.seen += 1
                if layer._writing_thread is not None:
                    self.inside.add(func.overloadpacket.__name__)
                elif not torch.equal(weight.data, theta0):
                    self.outside.append((layer.module_name, str(func)))
        return func(*args, **(kwargs or {}))


def _assert_unseen(watch: _WeightWatch) -> None:
    assert watch.seen and not watch.outside, watch.outside[:5]
    # inside the product: θ₀ read at η, W' written, the product (and its views of W), θ₀ written back
    # (on the CPU: index_select, index_add_, index_copy_ on one thread; take, put_ on several)
    assert watch.inside <= {"index_select", "index_add_", "index_copy_", "take", "put_", "_to_copy", "index_put_", "add", "t", "mm", "addmm", "view", "_unsafe_view", "matmul", "linear", "expand", "transpose", "reshape", "bmm", "unsqueeze", "squeeze"}, watch.inside
    written = {"index_add_", "index_copy_"} if torch.get_num_threads() == 1 else {"take", "put_"}
    assert written <= watch.inside and watch.inside & {"mm", "addmm", "bmm"}


def _hooked_model(model, theta0: dict, seen: list):
    """Hooks of every kind that look at the base weights (directly, through state_dict and named_parameters)."""

    def look(*_):
        sd = model.state_dict()
        params = dict(model.named_parameters())
        for layer in sparse_layers(model):
            assert layer._writing_thread is None
            for key, weights in ((".base_layer.weight", sd), (".base_layer.weight", params)):
                name = next(k for k in weights if k.endswith(layer.module_name + key))
                assert torch.equal(weights[name], theta0[layer.module_name])
            assert torch.equal(layer.get_base_layer().weight, theta0[layer.module_name])
        seen.append(1)

    for layer in sparse_layers(model):
        layer.register_forward_pre_hook(look)
        layer.register_forward_hook(look)
        layer.register_full_backward_pre_hook(look)
        layer.register_full_backward_hook(look)
        layer.sparse_values["default"].register_post_accumulate_grad_hook(look)
        layer.sparse_values["default"].register_hook(lambda g: look() or None)
    return look


@pytest.mark.parametrize("setting", ["plain", "hooks", "checkpoint-reentrant", "checkpoint", "save_on_cpu", "compile"])
def test_nothing_outside_the_layer_sees_the_written_weight(monkeypatch, setting, threads):
    """Training steps (AG windows and reselections included) under each setting: no tensor operation outside a
    layer's own product reads its base weight while it differs from θ₀, no hook of any kind runs inside one, and
    the results are the reference's. (A pass that torch.compile traces is left to the reference:
    test_passes_it_does_not_take.)"""
    taken = _count_passes(monkeypatch)
    results = []
    for fast in (False, True):
        model = _spiel()
        randomize_values(model, scale=0.1)
        theta0 = _weights(model)
        seen: list = []
        step_fn = None
        if setting == "hooks":
            look = _hooked_model(model, theta0, seen)
            step_fn = lambda m, x: m(x, labels=x).loss  # noqa: E731
            for block in model.get_base_model().model.layers:
                block.register_forward_hook(look)
        elif setting.startswith("checkpoint"):
            model.get_base_model().gradient_checkpointing_enable({"use_reentrant": setting.endswith("reentrant")})
            model.enable_input_require_grads()
        elif setting == "save_on_cpu":

            def step_fn(m, x):
                with torch.autograd.graph.save_on_cpu():
                    return m(x, labels=x).loss

        elif setting == "compile":
            compiled = torch.compile(model.get_base_model().model.layers[0], backend="aot_eager")
            model.get_base_model().model.layers[0] = compiled
        watch = _WeightWatch(model)
        with peft_sparse.fast_paths(fast), watch:
            losses = _train(model, "ag", steps=6, step_fn=step_fn)
        if fast:
            _assert_unseen(watch)
        assert not watch.outside
        assert setting != "hooks" or seen
        assert all(torch.equal(w, theta0[name]) for name, w in _weights(model).items())
        results.append((losses, _state(model)))
    assert taken  # (under torch.compile too: dynamo runs the sparse layers' passes eagerly, between its graphs)
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_a_pending_backward_that_saved_the_weight_stays_valid():
    """A pass with the adapters disabled saves the base weight for its backward (plain nn.Linear); a pass with the
    adapter then writes and restores the weight: autograd sees no change of the weight (its version counter is
    untouched), and the first pass's gradients are the reference's."""
    grads = []
    for fast in (False, True):
        model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["q_proj", "down_proj"], density=0.2))
        randomize_values(model, scale=0.1)
        model.train()
        x = inputs()
        with peft_sparse.fast_paths(fast):
            emb = model.get_base_model().model.embed_tokens(x).detach().requires_grad_()
            with model.disable_adapter():
                base_out = model(inputs_embeds=emb).logits
            versions = [layer.get_base_layer().weight._version for layer in sparse_layers(model)]
            adapted = model(inputs_embeds=emb).logits
            assert [layer.get_base_layer().weight._version for layer in sparse_layers(model)] == versions
            (base_out.square().sum() + adapted.square().sum()).backward()
        grads.append((emb.grad.clone(), [l.sparse_values["default"].grad.clone() for l in sparse_layers(model)]))
    assert torch.equal(grads[0][0], grads[1][0])
    assert all(torch.equal(a, b) for a, b in zip(grads[0][1], grads[1][1]))


def test_a_failing_product_leaves_theta0(monkeypatch):
    """An error inside the product propagates, with θ₀ back in the weight; the next pass runs as usual."""
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["q_proj"], density=0.2))
    randomize_values(model, scale=0.1)
    layer = sparse_layers(model)[0]
    theta0 = layer.get_base_layer().weight.detach().clone()
    calls = []
    real_linear = torch.nn.functional.linear

    def failing(x, w, b=None):
        calls.append(torch.equal(w, theta0))
        raise RuntimeError("product failed")

    monkeypatch.setattr(transient_merge.F, "linear", failing)
    model.train()
    with pytest.raises(RuntimeError, match="product failed"):
        layer(torch.randn(3, layer.in_features, requires_grad=True))
    assert calls == [False]  # (it ran with W' written)
    assert torch.equal(layer.get_base_layer().weight, theta0) and layer._writing_thread is None
    monkeypatch.setattr(transient_merge.F, "linear", real_linear)
    x = torch.randn(3, layer.in_features, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    with peft_sparse.fast_paths(False):
        assert torch.equal(y, layer(x))
    assert torch.equal(layer.get_base_layer().weight, theta0)


def test_another_thread_is_refused_by_name_while_the_weight_is_written():
    """While one thread is inside a layer's product, a pass of that layer from another thread (ours or the
    reference's) and a look through the layer (state_dict) are refused naming the layer; the writing thread
    finishes with θ₀ back."""
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["q_proj"], density=0.2))
    randomize_values(model, scale=0.1)
    model.train()
    layer = sparse_layers(model)[0]
    theta0 = layer.get_base_layer().weight.detach().clone()
    inside, release = threading.Event(), threading.Event()
    errors = []
    real_linear = transient_merge.F.linear

    def slow_linear(x, w, b=None):
        inside.set()
        release.wait(10)
        return real_linear(x, w, b)

    transient_merge.F.linear = slow_linear
    try:
        worker = threading.Thread(target=lambda: layer(torch.randn(2, layer.in_features, requires_grad=True)).sum().backward())
        worker.start()
        assert inside.wait(10)
        transient_merge.F.linear = real_linear
        for fast, look in (
            (True, lambda: layer(torch.randn(2, layer.in_features, requires_grad=True))),  # this pass
            (False, lambda: layer(torch.randn(2, layer.in_features, requires_grad=True))),  # the reference's
            (True, lambda: model.state_dict()),
        ):
            try:
                with peft_sparse.fast_paths(fast):
                    look()
            except RuntimeError as error:
                errors.append(str(error))
        release.set()
        worker.join(10)
    finally:
        transient_merge.F.linear = real_linear
        release.set()
    assert len(errors) == 3 and all(layer.module_name in e and "another thread" in e for e in errors)
    assert torch.equal(layer.get_base_layer().weight, theta0) and layer._writing_thread is None
    assert layer.sparse_values["default"].grad is not None


def test_passes_it_does_not_take(monkeypatch):
    """Without gradients, with a trained base weight, a sharded weight (FSDP's flag), a layer merged for training,
    while torch.compile traces and inside a functorch transform: the reference (or the training merge)."""
    taken = _count_passes(monkeypatch)
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["q_proj"], density=0.2))
    randomize_values(model, scale=0.1)
    model.train()
    layer = sparse_layers(model)[0]
    x = torch.randn(2, layer.in_features)
    with torch.no_grad():
        layer(x)
    weight = layer.get_base_layer().weight
    weight.requires_grad_(True)
    layer(x)
    weight.requires_grad_(False)
    weight._fsdp_flattened = True
    layer(x)
    del weight._fsdp_flattened
    layer.merge_for_training = True
    layer(x)
    layer.release_training_merge()
    layer.merge_for_training = False
    monkeypatch.setattr(transient_merge, "_compiling", lambda: True)  # (as while dynamo traces the pass)
    layer(x)
    monkeypatch.setattr(transient_merge, "_compiling", lambda: False)
    monkeypatch.setattr(transient_merge, "_transforms_active", lambda: True)
    layer(x)
    monkeypatch.setattr(transient_merge, "_transforms_active", lambda: False)
    assert not taken
    layer(x)
    assert len(taken) == 1


def _ddp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = {}
    for fast in (False, True):
        torch.manual_seed(0)
        model = _spiel()
        theta0 = _weights(model)
        ddp = DDP(model, broadcast_buffers=False)
        watch = _WeightWatch(model)
        with peft_sparse.fast_paths(fast), watch:
            losses = _train(ddp, "ag", steps=5, step_fn=lambda m, x: m(x[rank : rank + 1], labels=x[rank : rank + 1]).loss)
        assert not watch.outside
        assert all(torch.equal(w, theta0[name]) for name, w in _weights(model).items())
        out[fast] = (losses, _state(model), watch.inside, torch.get_num_threads())
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def test_ddp_trains_as_the_reference_and_shows_theta0():
    import torch.multiprocessing as mp

    from .test_distributed import _free_port

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_ddp_worker, args=(2, _free_port(), out_dir), nprocs=2, join=True)
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in (0, 1)]
    for out in ranks:
        assert out[False][0] == out[True][0]
        assert ("index_copy_" if out[True][3] == 1 else "put_") in out[True][2] and not out[False][2]
        for a, b in zip(out[False][1], out[True][1]):
            assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_steady_passes_skip_the_lookups_but_see_every_change(monkeypatch):
    """A training pass like the layer's last one reuses its decisions (no lookups, no adapter checks); anything that
    changes one of them sends the pass through the full path. Outputs always equal the reference's."""
    from .models import record_full_passes

    model = get_peft_model(tiny_llama(), SpIELConfig(target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], density=0.2))
    randomize_values(model, scale=0.1)
    model.add_adapter("other", SpIELConfig(target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], density=0.1))
    randomize_values(model, adapter_name="other", seed=3, scale=0.1)
    model.base_model.set_adapter("default")
    for layer in sparse_layers(model):
        layer.training_observer = None  # (no scheduler here: no unscheduled-training warning)
    layers = sparse_layers(model)
    x = inputs()
    model.train()
    full_passes = record_full_passes(monkeypatch)

    def check(steady, expect_full=None):
        full_passes.clear()
        out = model(x).logits
        assert full_passes == (expect_full if expect_full is not None else ([] if steady else layers))
        with peft_sparse.fast_paths(False):
            assert torch.equal(out, model(x).logits)

    check(steady=False)
    check(steady=True)
    with torch.no_grad():
        check(steady=False)
    check(steady=True)  # (a pass without gradients leaves the memo as it was)
    with model.disable_adapter():
        full_passes.clear()
        model(x)
        assert not full_passes
    check(steady=False)  # (the disabled pass released the layers: what they kept is forgotten)
    model.base_model.set_adapter("other")
    check(steady=False)
    model.base_model.set_adapter("default")
    check(steady=False)
    check(steady=True)
    with torch.no_grad():  # an in-place edit of the indices (same values): their version moves
        idx = layers[0].sparse_indices["default"]
        idx.copy_(idx)
    check(steady=False, expect_full=[layers[0]])
    layers[1].sparse_indices["default"] = layers[1].sparse_indices["default"].clone()  # a new indices tensor
    check(steady=False, expect_full=[layers[1]])
    layers[2].sparse_values["default"] = torch.nn.Parameter(layers[2].sparse_values["default"].detach() * 2)
    check(steady=False, expect_full=[layers[2]])
    check(steady=True)
    base = layers[3].get_base_layer()
    base.weight = torch.nn.Parameter(base.weight.detach().clone(), requires_grad=False)  # a new weight object
    check(steady=False, expect_full=[layers[3]])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float32 weights, bf16 compute: the reference's copy
        full_passes.clear()
        out = model(x).logits
        assert full_passes == layers
        with peft_sparse.fast_paths(False):
            assert torch.equal(out, model(x).logits)
    check(steady=False)  # (the autocast passes were the reference's: remembered nothing)
    layers[0].merge_for_training = True
    full_passes.clear()
    model(x)
    assert full_passes[0] is layers[0]
    layers[0].release_training_merge()
    layers[0].merge_for_training = False
    check(steady=False, expect_full=[layers[0]])


def test_a_steady_layer_is_freed_without_the_cycle_collector():
    """What a layer remembers of its last default training pass holds no reference back to it: deleting the model
    frees its layers at once, not at the next collection."""
    import gc
    import weakref

    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["q_proj"], density=0.2))
    model.train()
    model(inputs(), labels=inputs()).loss.backward()
    layer = sparse_layers(model)[0]
    assert layer._transient_steady is not None
    layer_ref, weight_ref = weakref.ref(layer), weakref.ref(layer.get_base_layer().weight)
    del layer
    gc.collect()
    gc.disable()
    try:
        del model
        assert layer_ref() is None and weight_ref() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("growth", ["ag", "ma"])
def test_the_cpu_value_gradient_keeps_its_pattern_until_the_indices_change(monkeypatch, growth, threads):
    """Value gradients by the SDDMM on the CPU: with the fast paths the indices' sampled pattern is kept between
    steps (by_indices.py), and training is the reference's bit for bit through reselections and windows."""
    from peft_sparse.core import kernels

    runs = []
    for fast in (False, True):
        builds = []
        real = kernels.sampled_pattern
        model = _spiel(growth=growth)
        for layer in sparse_layers(model):
            layer.value_grad_method = "sddmm"
        with monkeypatch.context() as m:
            m.setattr(kernels, "sampled_pattern", lambda *a: builds.append(a) or real(*a))
            with peft_sparse.fast_paths(fast):
                losses = _train(model, growth)
        runs.append((losses, _state(model), len(builds)))
    (ref_losses, ref_state, ref_builds), (losses, state, builds) = runs
    assert losses == ref_losses
    for a, b in zip(state, ref_state):
        assert all(torch.equal(u, v) for u, v in zip(a, b))
    layers = len(ref_state)
    assert ref_builds > 0 and ref_builds % layers == 0  # the reference: one pattern per value gradient
    assert 0 < builds < ref_builds  # kept: one per layer for each indices tensor it trained with
    assert builds % layers == 0


def test_index_memos_follow_the_indices():
    """What the fast paths keep of an adapter's indices is given back while they are the same tensor, address and
    version, and built again after an in-place edit, for a new tensor, another key, or a core announcement."""
    from peft_sparse.accel import by_indices
    from peft_sparse.core import kernels

    model = get_peft_model(tiny_llama(), SpIELConfig(target_modules=["q_proj"], density=0.2))
    layer = sparse_layers(model)[0]
    idx = layer.sparse_indices["default"]
    out_features, in_features = layer.get_base_layer().weight.shape
    pattern = by_indices.sampled_pattern(layer, idx, out_features, in_features, torch.float32)
    rows, cols = kernels.rows_cols(idx, in_features)
    assert torch.equal(pattern.crow_indices()[1:] - pattern.crow_indices()[:-1], torch.bincount(rows, minlength=out_features))
    assert torch.equal(pattern.col_indices().long(), cols) and pattern.values().dtype == torch.float32
    assert pattern.col_indices().dtype == pattern.crow_indices().dtype == torch.int32  # (8 bytes a position in all)
    positions = by_indices.positions(layer, idx)
    assert positions.dtype == torch.int64 and torch.equal(positions, idx.long())
    assert by_indices.sampled_pattern(layer, idx, out_features, in_features, torch.float32) is pattern
    assert by_indices.positions(layer, idx) is positions
    assert by_indices.sampled_pattern(layer, idx, out_features, in_features, torch.float64).values().dtype == torch.float64
    with torch.no_grad():
        idx.copy_(idx.flip(0).sort().values)  # an in-place edit: the version moves
    assert by_indices.sampled_pattern(layer, idx, out_features, in_features, torch.float32) is not pattern
    pattern = by_indices.sampled_pattern(layer, idx, out_features, in_features, torch.float32)
    assert by_indices.positions(layer, idx) is not positions
    clone = idx.clone()
    assert by_indices.sampled_pattern(layer, clone, out_features, in_features, torch.float32) is not pattern
    dispatch.reindex([layer], lambda: None)  # the core announces new indices: everything kept is dropped
    assert layer._by_indices == []
    by_indices.positions(layer, idx)
    dispatch.forget(layer, "default")
    assert layer._by_indices == []
