"""bitsandbytes Linear4bit (nf4, double quantization) under the sparse core, on CPU."""

import pytest
import torch
from peft import PeftModel, get_peft_model

from peft_sparse import SparseFTConfig
from peft_sparse.accel import nf4, steady
from peft_sparse.core.quant import standard_4bit_layout

from .models import inputs, randomize_values, record_full_passes, sparse_layers, tiny_llama, train_on

bnb = pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    # bitsandbytes' CPU 4-bit matmul needs in_features to be a multiple of its 64-element blocks
    tiny_llama(hidden_size=64, intermediate_size=128).save_pretrained(path)
    return path


def _quantized(path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32
    )
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, device_map="cpu").eval()


def _dequantized_reference(model):
    """The same model with every adapted Linear4bit replaced by W_deq + scatter(η, φ) in float."""
    weights = {}
    for layer in sparse_layers(model):
        weights[layer.module_name] = layer.merged_weight()
    return weights


def test_forward_and_value_gradients_match_dequantized_dense_reference(quantized_dir):
    model = get_peft_model(_quantized(quantized_dir), SparseFTConfig(target_modules="all-linear", density=0.1))
    randomize_values(model, scale=0.05)
    layer = sparse_layers(model)[0]
    assert isinstance(layer.get_base_layer(), bnb.nn.Linear4bit)
    assert int(layer.sparse_indices["default"].max()) < layer.out_features * layer.in_features
    x = torch.randn(3, 4, layer.in_features, requires_grad=True)
    y = layer(x)
    grad = torch.randn_like(y)
    y.backward(grad)
    w = layer.logical_weight().detach()  # dequantized (out, in)
    values = layer.sparse_values["default"].detach().clone().requires_grad_()
    idx = layer.sparse_indices["default"].long()
    xr = x.detach().clone().requires_grad_()
    yr = torch.nn.functional.linear(xr, w.reshape(-1).index_add(0, idx, values).view_as(w), layer.get_base_layer().bias)
    yr.backward(grad)
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.sparse_values["default"].grad, values.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)


def test_nothing_weight_sized_saved_for_backward(quantized_dir):
    model = get_peft_model(_quantized(quantized_dir), SparseFTConfig(target_modules=["gate_proj"], density=0.1))
    layer = sparse_layers(model)[0]
    x = torch.randn(5, layer.in_features, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    assert saved and all(t.numel() != layer.out_features * layer.in_features for t in saved)
    y.sum().backward()


def test_save_load_and_merge(quantized_dir, tmp_path):
    model = get_peft_model(_quantized(quantized_dir), SparseFTConfig(target_modules="all-linear", density=0.1))
    randomize_values(model, scale=0.05)
    x = inputs()
    with torch.no_grad():
        out = model(x).logits
        base_out = _quantized(quantized_dir)(x).logits
    assert not torch.allclose(out, base_out)
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(_quantized(quantized_dir), tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, out)
    want = _dequantized_reference(loaded)
    merged = loaded.merge_and_unload()
    with torch.no_grad():
        merged_out = merged(x).logits
    # requantization is lossy: the merged model is much closer to the adapter than to the base
    assert (merged_out - out).abs().mean() < 0.25 * (base_out - out).abs().mean()
    for name, w in want.items():
        module = merged.get_submodule(name)
        standard_4bit_layout(module)  # bitsandbytes repacked it for its CPU kernel during merged(x)
        deq = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
        assert (deq - w).abs().max() < 0.1


@pytest.mark.parametrize("growth", ["ag", "ma"])
def test_qspiel_trains_and_reselects_over_4bit_weights(quantized_dir, growth):
    from peft_sparse import SM3, SpIELConfig, SpIELScheduler

    config = SpIELConfig(target_modules="all-linear", density=0.1, growth=growth, reselection_steps=3, gradient_estimation_steps=1)
    model = get_peft_model(_quantized(quantized_dir), config)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2) if growth == "ag" else SM3(params, lr=0.05)
    scheduler = SpIELScheduler(model, opt, total_steps=6)
    x = inputs(batch=4, length=9)
    before = [l.sparse_indices["default"].clone() for l in sparse_layers(model)]
    losses = train_on(model, opt, scheduler, x, 6)
    layers = sparse_layers(model)
    assert all(isinstance(l.get_base_layer(), bnb.nn.Linear4bit) for l in layers)
    assert all(l.sparse_values["default"].dtype == torch.float32 for l in layers)
    assert any(not torch.equal(a, l.sparse_indices["default"]) for a, l in zip(before, layers))
    assert {int(a) for l in layers for a in l.sparse_ages["default"].unique()} <= {0, 1, 4}
    assert losses[-1] < losses[0]


def test_nf4_index_slices_are_not_kept_for_inference_tensors(quantized_dir):
    """The per-program slices of a layer's indices for the fused CUDA launch are kept per indices tensor
    and version (tests/test_gpu.py); an inference tensor, which has no version, gets none (the launch
    then searches) instead of an error. On CPU there is no fused launch: none is built either way."""
    model = get_peft_model(_quantized(quantized_dir), SparseFTConfig(target_modules=["q_proj"], density=0.1))
    layer = sparse_layers(model)[0]
    indices = layer.sparse_indices["default"]
    assert nf4.nf4_starts(layer, indices) is None  # CPU: no fused launch
    with torch.inference_mode():
        frozen = indices.clone()
    assert frozen.is_inference() and nf4.nf4_starts(layer, frozen) is None


def test_steady_passes_of_quantized_layers_see_every_change(quantized_dir, monkeypatch):
    """A 4-bit layer's training pass after the first reuses the last pass's decisions (no per-pass
    lookups) and still rebuilds the weight from the current values; anything that changes a decision
    sends the pass through the full path. Outputs always equal the full path's."""
    model = get_peft_model(_quantized(quantized_dir), SparseFTConfig(target_modules=["q_proj", "gate_proj"], density=0.1))
    randomize_values(model, scale=0.05)
    model.add_adapter("other", SparseFTConfig(target_modules=["q_proj", "gate_proj"], density=0.1))
    randomize_values(model, adapter_name="other", seed=3, scale=0.05)
    model.base_model.set_adapter("default")
    layers = sparse_layers(model)
    x = inputs()
    model.train()
    full_passes = record_full_passes(monkeypatch)

    def check(steady, expect_full=None):
        full_passes.clear()
        out = model(x).logits
        assert full_passes == (expect_full if expect_full is not None else ([] if steady else layers))
        kept = [layer._steady for layer in layers]
        for layer in layers:  # the same pass through the full path
            layer._steady = None
        want = model(x).logits
        for layer, memo in zip(layers, kept):
            layer._steady = memo
        assert torch.equal(out, want)
        model(x)  # (steady again where the decisions allow)

    model(x)
    assert all(layer._steady is not None for layer in layers)
    check(steady=True)
    with torch.no_grad():  # values edited in place: the next pass rebuilds the weight from them, steady
        layers[0].sparse_values["default"].mul_(2)
    check(steady=True)
    with torch.no_grad():
        check(steady=False)
    with model.disable_adapter():
        model(x)
    check(steady=False)
    model.base_model.set_adapter("other")
    check(steady=False)
    model.base_model.set_adapter("default")
    check(steady=False)
    check(steady=True)
    with torch.no_grad():  # in place: the indices' version moves
        layers[1].sparse_indices["default"].copy_(layers[1].sparse_indices["default"].flip(0).sort().values)
    check(steady=False, expect_full=[layers[1]])
    layers[0].sparse_indices["default"] = layers[0].sparse_indices["default"].clone()  # a new indices tensor
    check(steady=False, expect_full=[layers[0]])
    held = layers[1].sparse_values["default"]
    layers[1].sparse_values["default"] = torch.nn.Parameter(held.detach() * 2)
    check(steady=False, expect_full=[layers[1]])
    check(steady=True)
    model.eval()
    check(steady=False)


def test_training_steps_keep_quantized_passes_steady(quantized_dir, monkeypatch):
    """A training step's backward leaves a 4-bit layer's next pass steady (the backward reads θ₀ without
    forgetting the last pass), and a run of steady steps trains exactly as full passes do: the same
    losses and values bit for bit, with an optimizer step between passes."""
    torch.manual_seed(0)
    runs = []
    for steady in (True, False):
        model = get_peft_model(_quantized(quantized_dir), SparseFTConfig(target_modules=["q_proj", "gate_proj"], density=0.1))
        randomize_values(model, scale=0.05)
        layers = sparse_layers(model)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        x = inputs()
        model.train()
        full_passes = record_full_passes(monkeypatch)
        losses, full = [], []
        for _ in range(4):
            full_passes.clear()
            if not steady:
                for layer in layers:
                    layer._steady = None
            loss = model(x, labels=x).loss
            full.append(list(full_passes))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        runs.append((torch.stack(losses), [layer.sparse_values["default"].detach().clone() for layer in layers]))
        if steady:
            assert full[0] == layers and all(f == [] for f in full[1:]), full
            assert all(layer._steady is not None for layer in layers)
        else:
            assert all(f == layers for f in full)
    (steady_losses, steady_values), (full_losses, full_values) = runs
    assert torch.equal(steady_losses, full_losses)
    assert all(torch.equal(a, b) for a, b in zip(steady_values, full_values))


def test_kept_nf4_launch_is_not_copied_and_is_dropped_once_it_no_longer_applies(quantized_dir):
    """A 4-bit layer's kept fused launch (its _NF4Rebuild, whose LaunchPlan refers to a jitted kernel
    that cannot be copied) does not travel with ``copy.deepcopy`` or pickling: the copy has none and
    the original keeps its own. When the kept launch does not apply to a call, the layer drops it (it
    holds the tensors it planned with)."""
    import copy
    import pickle

    pytest.importorskip("triton")
    from peft_sparse.accel import triton_kernels as tk
    from peft_sparse.accel.nf4 import _NF4Rebuild

    model = get_peft_model(_quantized(quantized_dir), SparseFTConfig(target_modules=["q_proj"], density=0.1))
    layer = sparse_layers(model)[0]
    plan = object.__new__(tk.LaunchPlan)
    plan.kernel = tk._nf4_compose_kernel
    rebuild = object.__new__(_NF4Rebuild)
    rebuild.plan = plan
    layer._nf4_rebuild = rebuild
    copied = copy.deepcopy(model)
    assert sparse_layers(copied)[0]._nf4_rebuild is None and layer._nf4_rebuild is rebuild
    assert pickle.loads(pickle.dumps(rebuild)) is None

    class Stale:
        def __call__(self, *args):
            return None

    indices, values = layer.sparse_indices["default"], layer.sparse_values["default"]
    for adapters in (1, 2):  # (with two adapters, no kept single-adapter launch applies)
        layer._nf4_rebuild = Stale()
        nf4.fused_merged_weight(layer, [indices] * adapters, [values] * adapters, None)  # (None on CPU: no fused path)
        assert layer._nf4_rebuild is None


def _with_stand_in_launch(quantized_dir):
    """A 4-bit q_proj model and its first layer, whose kept fused launch is a stand-in (CPU has no fused
    launch): it returns the merged weight the full path builds and records its calls.
    Returns (model, layer, inputs, stand-in, calls)."""
    model = get_peft_model(_quantized(quantized_dir), SparseFTConfig(target_modules=["q_proj"], density=0.1))
    randomize_values(model, scale=0.05)
    layer = sparse_layers(model)[0]
    merged = layer.merged_weight()
    calls = []

    class Kept:
        def __call__(self, layer_, indices, values, dtype):
            calls.append(layer_)
            return merged.clone()

    return model, layer, inputs(), Kept(), calls


def test_steady_training_passes_take_the_kept_launch_and_train_as_full_passes(quantized_dir, monkeypatch):
    """A steady training pass of a 4-bit layer calls its kept fused launch itself and multiplies by the
    weight it gives (GivenWeightLinear) — one launch per forward and per backward — and trains exactly as
    full passes without any kept launch: the same losses, values and input gradients bit for bit. The
    stand-in launch (CPU has no fused one) builds θ₀ + scatter(η, φ) from the values of each call."""
    from peft_sparse.core import functional
    from peft_sparse.core.functional import compose_weight

    runs = []
    for kept in (True, False):
        torch.manual_seed(0)
        model = get_peft_model(_quantized(quantized_dir), SparseFTConfig(target_modules=["q_proj", "gate_proj"], density=0.1))
        randomize_values(model, scale=0.05)
        layers = sparse_layers(model)
        calls = []

        class Kept:
            def __init__(self, layer):
                self.theta0 = layer.logical_weight().detach().clone()

            def __call__(self, layer_, indices, values, dtype):
                calls.append(layer_)
                return compose_weight(self.theta0, [indices], [values.detach()], self.theta0.dtype, owned=False)

        stand_ins = [Kept(layer) for layer in layers]
        given = []
        original = steady.GivenWeightLinear.forward
        monkeypatch.setattr(steady.GivenWeightLinear, "forward", staticmethod(lambda *a: given.append(1) or original(*a)))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model.train()
        embeddings = model.get_input_embeddings()
        x = inputs()
        losses, input_grads = [], []
        for step in range(4):
            if kept:
                for layer, stand_in in zip(layers, stand_ins):
                    layer._nf4_rebuild = stand_in
            calls.clear(), given.clear()
            embedded = embeddings(x).detach().requires_grad_()
            loss = model(inputs_embeds=embedded, labels=x).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
            input_grads.append(embedded.grad)
            if kept and step > 0:  # steady: the layer's own call in forward, the generic one in backward
                assert len(given) == len(layers) and sorted(map(id, calls)) == sorted(map(id, layers + layers)), (given, calls)
            elif not kept:
                assert given == [] and calls == []
        runs.append((torch.stack(losses), torch.stack(input_grads), [layer.sparse_values["default"].detach().clone() for layer in layers]))
        monkeypatch.undo()
    (losses, grads, values), (full_losses, full_grads, full_values) = runs
    assert torch.equal(losses, full_losses) and torch.equal(grads, full_grads)
    assert all(torch.equal(a, b) for a, b in zip(values, full_values))


def test_steady_pass_frees_the_kept_launch_weight_before_the_output_cast(quantized_dir):
    """The transient merged weight of a steady 4-bit pass is freed before the output is cast back to
    X's dtype (as inside the autograd function), so the cast's memory adds to no W-sized tensor."""
    import weakref

    from torch.overrides import TorchFunctionMode

    from peft_sparse.core.functional import compose_weight

    model = get_peft_model(_quantized(quantized_dir), SparseFTConfig(target_modules=["q_proj"], density=0.1))
    randomize_values(model, scale=0.05)
    model.train()
    layer = sparse_layers(model)[0]
    theta0 = layer.logical_weight().detach().clone()
    built = []

    class Kept:
        def __call__(self, layer_, indices, values, dtype):
            merged = compose_weight(theta0, [indices], [values.detach()], theta0.dtype, owned=False)
            built.append(weakref.ref(merged))
            return merged

    x = torch.randn(2, 5, layer.in_features, dtype=torch.float64, requires_grad=True)  # (not the compute dtype)
    layer(x).sum().backward()  # a full pass: the next one is steady
    layer._nf4_rebuild = Kept()
    alive_at_cast = []

    class Probe(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.to and built and args[0].dtype == theta0.dtype:  # (the output's cast, not X's)
                alive_at_cast.append(built[-1]() is not None)
            return func(*args, **(kwargs or {}))

    with Probe():
        y = layer(x)
    assert len(built) == 1 and y.dtype == torch.float64
    assert alive_at_cast == [False], alive_at_cast


def test_steady_pass_drops_a_kept_launch_that_does_not_apply(quantized_dir):
    """A steady 4-bit training pass whose kept launch refuses (returns None) drops it once, without the
    generic path checking it again, and gives the full path's output."""
    model = get_peft_model(_quantized(quantized_dir), SparseFTConfig(target_modules=["q_proj"], density=0.1))
    randomize_values(model, scale=0.05)
    model.train()
    layer = sparse_layers(model)[0]
    x = inputs()
    want = model(x).logits  # a full pass: the next one is steady
    assert layer._steady is not None
    calls = []

    class Stale:
        def __call__(self, *args):
            calls.append(1)
            return None

    layer._nf4_rebuild = Stale()
    assert torch.equal(model(x).logits, want)
    assert calls == [1] and layer._nf4_rebuild is None


def test_kept_nf4_launch_serves_passes_outside_training(quantized_dir):
    """A 4-bit layer's kept fused launch also serves eval and no-grad passes: their full path writes θ₀
    back only where a weight is merged, so it no longer drops the kept launch of a layer that never
    merges."""
    model, layer, x, kept, calls = _with_stand_in_launch(quantized_dir)
    model.eval()
    with torch.no_grad():
        want = model(x).logits
    for mode in ("eval", "train"):
        model.train(mode == "train")
        layer._nf4_rebuild = kept
        calls.clear()
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(x).logits, want)
        assert calls == [layer, layer] and layer._nf4_rebuild is kept, mode


def test_kept_nf4_launch_applies_only_to_its_own_operands(quantized_dir):
    """_NF4Rebuild's checks, on CPU with a stand-in plan (which fills nothing): it serves a call with the
    operands it was planned with — also after the values or the indices changed in place — and refuses
    (None) another requested dtype, other indices or new index storage, new value storage or dtype, a new 4-bit weight storage
    or quantization state, another compute dtype and another base layer; a refused plan launches nothing."""
    import copy

    from peft_sparse.accel.nf4 import _NF4Rebuild

    model = get_peft_model(_quantized(quantized_dir), SparseFTConfig(target_modules=["q_proj"], density=0.1))
    layer = sparse_layers(model)[0]
    base = layer.get_base_layer()
    indices, values = layer.sparse_indices["default"], layer.sparse_values["default"]
    launches = []

    def plan(out):
        launches.append(out)
        return True

    def fresh():
        return _NF4Rebuild(plan, base, indices, values, torch.empty(layer.out_features, layer.in_features))

    def serves(rebuild, idx=None, val=None, dtype=None):
        before = len(launches)
        out = rebuild(layer, indices if idx is None else idx, values if val is None else val, dtype)
        assert len(launches) == before + (out is not None)
        return out is not None

    rebuild = fresh()
    assert serves(rebuild) and serves(rebuild, dtype=torch.float32)
    assert launches[-1].shape == (layer.out_features, layer.in_features) and launches[-1].dtype == torch.float32
    with torch.no_grad():
        values.mul_(2)  # contents only: still the planned operands
    assert serves(rebuild)
    assert not serves(rebuild, dtype=torch.bfloat16)
    assert not serves(rebuild, idx=indices.clone())
    assert not serves(rebuild, val=values.detach().clone())
    assert not serves(rebuild, val=values.detach().double())
    with torch.no_grad():
        indices.copy_(torch.randperm(layer.numel)[: indices.numel()].sort().values.to(indices.dtype))
    assert serves(rebuild)  # rewritten in place (a reselection): followed
    assert serves(rebuild)
    indices.data = indices.data.clone()  # new storage
    assert not serves(rebuild)
    rebuild = fresh()
    assert serves(rebuild)
    values.data = values.data.clone()
    assert not serves(rebuild)
    rebuild = fresh()
    state = base.weight.quant_state
    base.weight.quant_state = copy.copy(state)
    assert not serves(rebuild)
    base.weight.quant_state = state
    assert serves(rebuild)
    base.compute_dtype, compute = torch.float64, base.compute_dtype
    assert not serves(rebuild)
    base.compute_dtype = compute
    assert serves(rebuild)
    base.weight.data = base.weight.data.clone()
    assert not serves(rebuild)
    rebuild = fresh()
    assert serves(rebuild)
    layer.base_layer = copy.deepcopy(base)  # another base layer
    assert not serves(rebuild)


def test_kept_nf4_launch_recomputes_its_slices_in_place(quantized_dir, monkeypatch):
    """After an in-place rewrite of the indices (a reselection), the kept launch rewrites the per-program
    slices it reads — the same tensor, now equal to what the full path computes for the new indices —
    and the layer's kept slices follow; slices planned under ``torch.inference_mode`` cannot be rewritten
    outside it, so the launch is refused (the full path plans anew). ``compose_starts`` refuses an
    ``out`` of another shape or type. (CPU: the slices' computation is torch's; the launch a stand-in.)"""
    from peft_sparse.core import kernels
    from peft_sparse.accel import triton_kernels as tk
    from peft_sparse.accel.nf4 import _NF4Rebuild

    # a layer large enough for several programs of the fused launch
    model = get_peft_model(_quantized(quantized_dir), SparseFTConfig(target_modules=["gate_proj"], density=0.1))
    layer = sparse_layers(model)[0]
    assert layer.numel >= 2 * tk._NF4_BLOCK
    base = layer.get_base_layer()
    indices, values = layer.sparse_indices["default"], layer.sparse_values["default"]
    monkeypatch.setattr(kernels, "nf4_compose_starts", lambda idx, numel, out=None: tk.compose_starts(idx, numel, out))
    launches = []

    def plan(out):
        launches.append(out)
        return True

    g = torch.Generator().manual_seed(0)

    def rewrite():
        with torch.no_grad():
            indices.copy_(torch.randperm(layer.numel, generator=g)[: indices.numel()].sort().values.to(indices.dtype))

    starts = tk.compose_starts(indices, layer.numel)
    rebuild = _NF4Rebuild(plan, base, indices, values, torch.empty(layer.out_features, layer.in_features), starts)
    for _ in range(2):
        rewrite()
        assert not torch.equal(starts, tk.compose_starts(indices, layer.numel))  # (the old slices are stale)
        assert rebuild(layer, indices, values, None) is not None
        assert torch.equal(starts, tk.compose_starts(indices, layer.numel))
        cached = layer._nf4_starts_cache
        assert cached[0]() is indices and cached[2] is starts and cached[1] == (indices.data_ptr(), indices._version, indices.numel())
    assert len(launches) == 2
    with torch.inference_mode():
        frozen = tk.compose_starts(indices, layer.numel)
    rebuild = _NF4Rebuild(plan, base, indices, values, torch.empty(layer.out_features, layer.in_features), frozen)
    assert rebuild(layer, indices, values, None) is not None  # (the indices as planned: nothing to rewrite)
    rewrite()
    assert rebuild(layer, indices, values, None) is None and len(launches) == 3
    with pytest.raises(ValueError, match="out must be int32"):
        tk.compose_starts(indices, layer.numel, out=torch.zeros(starts.numel(), dtype=torch.int64))
    with pytest.raises(ValueError, match="out must be int32"):
        tk.compose_starts(indices, layer.numel, out=torch.zeros(2 * starts.numel(), dtype=torch.int32))


def test_full_training_pass_keeps_the_nf4_launch(quantized_dir):
    """A 4-bit layer's full training pass (no steady memo) writes θ₀ back only where a weight is merged:
    it keeps the layer's kept fused launch and uses it, and the pass equals one without it."""
    model, layer, x, kept, calls = _with_stand_in_launch(quantized_dir)
    model.train()
    want = model(x).logits
    layer._nf4_rebuild = kept
    layer._steady = None
    out = model(x).logits
    assert calls == [layer] and layer._nf4_rebuild is kept and torch.equal(out, want)


def test_quantized_steady_pass_is_forgotten_and_observed_as_the_full_path(quantized_dir, tmp_path):
    """What a 4-bit layer remembers of its last pass (it holds the layer's tensors) is dropped when the
    layer's state changes (an adapter deleted, eval); the training observer runs only where the full
    path runs it; indices loaded under inference mode (no version counter) are never remembered."""
    from peft import PeftModel

    model = get_peft_model(_quantized(quantized_dir), SparseFTConfig(target_modules=["q_proj", "gate_proj"], density=0.1))
    model.add_adapter("b", SparseFTConfig(target_modules=["q_proj"], density=0.1))
    model.base_model.set_adapter("default")
    layers = sparse_layers(model)
    gate = next(layer for layer in layers if "gate_proj" in layer.module_name)
    calls = []
    gate.training_observer = lambda layer: calls.append(layer)
    model.train()
    x = inputs()
    model(x)
    assert all(layer._steady is not None for layer in layers) and len(calls) == 1
    model.base_model.set_adapter("b")  # not on gate_proj: the full path there is the base layer's, unobserved
    model(x)
    assert len(calls) == 1
    model.base_model.set_adapter("default")
    model(x)
    assert all(layer._steady is not None for layer in layers)
    model.delete_adapter("b")
    assert all(layer._steady is None for layer in layers)
    model(x)
    model.eval()
    assert all(layer._steady is None for layer in layers)
    model.save_pretrained(tmp_path)
    with torch.inference_mode():
        loaded = PeftModel.from_pretrained(_quantized(quantized_dir), tmp_path)
    loaded.train()
    loaded(x)  # (no version counter to remember)
    assert all(layer._steady is None for layer in sparse_layers(loaded))


def test_the_quant_extra_allows_only_bitsandbytes_that_transformers_quantizes_with():
    """pyproject's quant extra may not admit a bitsandbytes older than transformers' minimum for 4-bit loading."""
    import os
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version
    from transformers.utils.import_utils import BITSANDBYTES_MIN_VERSION

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["quant"]
    (requirement,) = [Requirement(r) for r in extra if Requirement(r).name == "bitsandbytes"]
    lowest = min(Version(s.version) for s in requirement.specifier if s.operator in (">=", "==", "~="))
    assert lowest >= Version(BITSANDBYTES_MIN_VERSION), f"quant extra {requirement} admits bitsandbytes below {BITSANDBYTES_MIN_VERSION}"
