"""Passes without gradients apply the delta from its entries (X·Wᵀ + X·δᵀ) where that is cheaper."""

import pytest
import torch
from peft import get_peft_model

import peft_sparse
from peft_sparse import SparseFTConfig
from peft_sparse.core import kernels

from .models import MODELS, inputs, randomize_values, sparse_layers


def _count_products(monkeypatch) -> list:
    """Every pass that applies a delta from its entries: the plain path's product, or the fast path's kept CSR one."""
    from peft_sparse.accel import inference
    from peft_sparse.core import layer as layer_module

    calls = []
    original = layer_module.sparse_delta_product
    monkeypatch.setattr(layer_module, "sparse_delta_product", lambda *a, **k: calls.append(1) or original(*a, **k))
    kept = inference.add_delta
    monkeypatch.setattr(inference, "add_delta", lambda *a, **k: calls.append(1) or kept(*a, **k))
    return calls


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "reference"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_no_grad_passes_equal_the_merged_model(name, fast, monkeypatch):
    build, targets, output = MODELS[name]
    model = get_peft_model(build(), SparseFTConfig(target_modules=targets, density=0.1))
    randomize_values(model, scale=0.1)
    model.eval()
    monkeypatch.setitem(kernels.COST_MODEL.inference_sparse_ratio, "cpu", 1e9)  # always the sparse product
    calls = _count_products(monkeypatch)
    x = inputs(seed=4, batch=1, length=5)
    with peft_sparse.fast_paths(fast), torch.no_grad():
        got = output(model(x))
        again = output(model(x))  # (the kept CSR deltas, on the fast paths)
    assert len(calls) == 2 * len(sparse_layers(model))
    merged = model.merge_and_unload()
    with torch.no_grad():
        want = output(merged(x))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # float32: the same sums in another order
    assert torch.equal(got, again)


def test_the_cost_model_rebuilds_for_many_tokens_and_training_passes_never_take_the_product(monkeypatch):
    build, targets, output = MODELS["llama"]
    model = get_peft_model(build(), SparseFTConfig(target_modules=targets, density=0.1))
    calls = _count_products(monkeypatch)
    layer = sparse_layers(model)[0]
    nnz = layer.sparse_values["default"].numel()
    x = torch.zeros(1, layer.in_features)
    assert kernels.COST_MODEL.choose_inference(x, 1, layer.out_features, layer.in_features, nnz) == "sparse"
    assert kernels.COST_MODEL.choose_inference(x, 10_000, layer.out_features, layer.in_features, nnz) == "rebuild"
    model.eval()
    with torch.no_grad():
        model(inputs(seed=1, batch=1, length=1))
    assert calls  # one token: the product
    calls.clear()
    model.train()
    x = inputs(seed=1, batch=1, length=1)
    model(x, labels=x).loss.backward()  # a training pass: the autograd function, as always
    assert not calls


def test_a_values_edit_is_seen_by_the_next_inference_pass(monkeypatch):
    build, targets, output = MODELS["llama"]
    model = get_peft_model(build(), SparseFTConfig(target_modules=targets, density=0.1)).eval()
    monkeypatch.setitem(kernels.COST_MODEL.inference_sparse_ratio, "cpu", 1e9)
    x = inputs(seed=2, batch=1, length=3)
    with torch.no_grad():
        before = output(model(x))
        randomize_values(model, scale=0.1)  # in place: the kept CSR deltas must follow
        after = output(model(x))
        model.disable_adapter_layers()
        base = output(model(x))
        model.enable_adapter_layers()
    assert torch.equal(before, base)  # (zero values: the base model)
    assert not torch.equal(after, before)
    merged = model.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(after, output(merged(x)), rtol=1e-5, atol=1e-5)


def test_the_kept_inference_delta_follows_adapters_edits_and_switches(monkeypatch):
    """The fast path's kept CSR delta (accel/inference.py) is rebuilt whenever what it was built from changes: an
    index edit through the core's API, another active adapter, adapters disabled; each pass equals the plain path."""
    from peft_sparse.core import edit

    build, targets, output = MODELS["llama"]
    monkeypatch.setitem(kernels.COST_MODEL.inference_sparse_ratio, "cpu", 1e9)
    model = get_peft_model(build(), SparseFTConfig(target_modules=targets, density=0.1, seed=0))
    model.add_adapter("other", SparseFTConfig(target_modules=targets, density=0.1, seed=1))
    randomize_values(model, "default", seed=1, scale=0.1)
    randomize_values(model, "other", seed=2, scale=0.1)
    model.eval()
    x = inputs(seed=3, batch=1, length=1)  # one token: the matrix-vector product

    def both() -> tuple:
        with torch.no_grad():
            fast = output(model(x))
            assert torch.equal(output(model(x)), fast)  # (built, then reused)
            with peft_sparse.fast_paths(False):
                plain = output(model(x))
        return fast, plain

    seen = []
    fast, plain = both()
    torch.testing.assert_close(fast, plain, rtol=1e-6, atol=1e-6)
    seen.append(fast)
    layer = next(m for m in sparse_layers(model) if m.module_name.endswith("v_proj"))  # (one token: q, k do not matter)
    with torch.no_grad():
        old = layer.sparse_indices["default"]
        free = torch.tensor(sorted(set(range(layer.out_features * layer.in_features)) - set(old.tolist()))[:2])
    edit.replace(model, {layer.module_name: (torch.tensor([0, 1]), free, torch.tensor([0.3, -0.3]))})
    fast, plain = both()
    torch.testing.assert_close(fast, plain, rtol=1e-6, atol=1e-6)
    assert not torch.equal(fast, seen[-1])
    seen.append(fast)
    model.set_adapter("other")
    fast, plain = both()
    torch.testing.assert_close(fast, plain, rtol=1e-6, atol=1e-6)
    assert not torch.equal(fast, seen[-1])
    with model.disable_adapter():
        fast, plain = both()
    assert torch.equal(fast, plain)  # (the base model on both paths)
    model.set_adapter("default")
    fast, _ = both()
    assert torch.equal(fast, seen[1])


@pytest.mark.parametrize("hook", ["none", "module", "global"])
def test_one_token_passes_equal_the_merged_model_and_base_layer_hooks_still_fire(hook, monkeypatch):
    """At one token the fast path adds δ·x into the base output in place and computes a plain ``nn.Linear``'s
    output itself; a forward hook on the base layer, or a global one, still sees every call."""
    build, targets, output = MODELS["llama"]
    model = get_peft_model(build(), SparseFTConfig(target_modules=targets, density=0.1))
    randomize_values(model, scale=0.1)
    model.eval()
    monkeypatch.setitem(kernels.COST_MODEL.inference_sparse_ratio, "cpu", 1e9)
    calls = _count_products(monkeypatch)
    layers = sparse_layers(model)
    seen = []
    handles = []
    if hook == "module":
        handles = [m.base_layer.register_forward_hook(lambda mod, args, out: seen.append(mod)) for m in layers]
    elif hook == "global":
        handles = [torch.nn.modules.module.register_module_forward_hook(lambda mod, args, out: seen.append(mod))]
    x = inputs(seed=7, batch=1, length=1)
    try:
        with torch.no_grad():
            got = output(model(x))
    finally:
        for h in handles:
            h.remove()
    assert len(calls) == len(layers)
    base_layers = {id(m.base_layer) for m in layers}
    assert sum(id(m) in base_layers for m in seen) == (0 if hook == "none" else len(layers))
    merged = model.merge_and_unload()
    with torch.no_grad():
        want = output(merged(x))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
