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
    from peft_sparse.core import passes

    calls = []
    original = passes.sparse_delta_product
    monkeypatch.setattr(passes, "sparse_delta_product", lambda *a, **k: calls.append(1) or original(*a, **k))
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


@pytest.mark.parametrize("name", sorted(MODELS))
def test_merged_for_inference_equals_the_merged_model_and_restores_the_base_bit_for_bit(name):
    """Inside ``merged_for_inference`` every pass is the base layer's own over W + δ (the merged model's outputs
    exactly, no product from δ's entries) and no gradient is recorded; on leaving, every base weight is θ₀ bit for
    bit and the adapter is unmerged — after an error inside too."""
    build, targets, output = MODELS[name]
    torch.manual_seed(0)
    model = get_peft_model(build(), SparseFTConfig(target_modules=targets, density=0.1))
    randomize_values(model, scale=0.1)
    model.eval()
    layers = sparse_layers(model)
    theta0 = {l.module_name: l.get_base_layer().weight.detach().clone() for l in layers}
    x = inputs(seed=4, batch=1, length=5)
    with torch.no_grad():
        before = output(model(x))
    with peft_sparse.merged_for_inference(model) as merged:
        assert len(merged) == len(layers) and all(l.merged for l in layers)
        inside = output(model(x))
        assert not inside.requires_grad
    assert not any(l.merged for l in layers)
    for l in layers:
        assert torch.equal(l.get_base_layer().weight, theta0[l.module_name])
    with pytest.raises(RuntimeError, match="inside"):
        with peft_sparse.merged_for_inference(model):
            assert all(l.merged for l in layers)
            raise RuntimeError("inside")
    assert not any(l.merged for l in layers)
    for l in layers:
        assert torch.equal(l.get_base_layer().weight, theta0[l.module_name])
    with torch.no_grad():
        assert torch.equal(output(model(x)), before)
        want = output(model.merge_and_unload()(x))  # (merge_and_unload: the same W + δ, written the same way)
    assert torch.equal(inside, want)


def test_merged_for_inference_leaves_tied_and_disabled_layers_unmerged_and_evaluation_uses_it(monkeypatch):
    """A base weight another module shares (a tied lm_head) is not merged (its embedding rows would change); with
    the adapters disabled nothing is merged; ``exact_match``'s generation runs with every other layer merged, and
    its replies equal those outside the block."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from peft_sparse import evaluation

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))  # fmt: skip
    model = get_peft_model(base, SparseFTConfig(target_modules=["lm_head", "q_proj", "down_proj"], density=0.2))
    randomize_values(model, scale=0.1)
    embeddings = model.get_input_embeddings().weight.detach().clone()
    with peft_sparse.merged_for_inference(model) as merged:
        names = sorted(l.module_name.split(".")[-1] for l in merged)
        assert names == ["down_proj", "q_proj"]
        assert torch.equal(model.get_input_embeddings().weight, embeddings)
    with model.disable_adapter(), peft_sparse.merged_for_inference(model) as merged:
        assert merged == []
    seen = []
    layer = next(l for l in sparse_layers(model) if l.module_name.endswith("q_proj"))
    layer.register_forward_pre_hook(lambda m, a: seen.append(m.merged))

    class Tok:  # (the smallest tokenizer generate_answers needs)
        padding_side, pad_token_id = "right", 0

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
            return messages[-1]["content"]

        def __call__(self, texts, **kw):
            ids = torch.tensor([[int(t) for t in s.split()] for s in texts])
            return type("Enc", (dict,), {"to": lambda self, d: self})(input_ids=ids, attention_mask=torch.ones_like(ids))

        def batch_decode(self, rows, skip_special_tokens=True):
            return [" ".join(str(int(t)) for t in r) for r in rows]

    prompts = [[{"role": "user", "content": "5 7 9"}], [{"role": "user", "content": "11 3 2"}]]
    replies = evaluation.generate_answers(model, Tok(), prompts, max_new_tokens=3)
    assert seen and all(seen)
    assert not layer.merged
    with torch.no_grad():
        monkeypatch.setattr(evaluation, "merged_for_inference", lambda m: __import__("contextlib").nullcontext())
        assert evaluation.generate_answers(model, Tok(), prompts, max_new_tokens=3) == replies


@pytest.mark.parametrize("task_type, fast", [("CAUSAL_LM", True), ("CAUSAL_LM", False), (None, True)], ids=["fast", "reference", "untyped"])
def test_generate_merges_the_adapter_for_the_call_on_the_fast_paths(task_type, fast):
    """``generate`` on a sparse PeftModelForCausalLM: on the fast paths every pass runs with the adapter merged in
    place (the base model's own decoding speed); with ``fast_paths(False)``, and in a PeftModel without a task type
    (whose ``generate`` goes to the base model past the tuner), every layer adds its delta unmerged. Either way the
    tokens are the merged model's, and afterwards — after an error inside too — the base weights are θ₀ bit for bit
    and nothing is merged."""
    import copy

    build, targets, _ = MODELS["llama"]
    torch.manual_seed(0)
    model = get_peft_model(build(), SparseFTConfig(target_modules=targets, density=0.1, task_type=task_type))
    assert type(model).__name__ == ("PeftModelForCausalLM" if task_type else "PeftModel")
    randomize_values(model, scale=0.1)
    model.eval()
    layers = sparse_layers(model)
    theta0 = {l.module_name: l.get_base_layer().weight.detach().clone() for l in layers}
    merged_during = []
    hook = layers[0].register_forward_pre_hook(lambda module, args: merged_during.append(module.merged))
    x = inputs(seed=3, batch=2, length=5)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with peft_sparse.fast_paths(fast):
        tokens = model.generate(input_ids=x, **kwargs)
    assert len(merged_during) == 5 and set(merged_during) == {fast and task_type is not None}
    assert not any(l.merged for l in layers)
    assert all(torch.equal(l.get_base_layer().weight, theta0[l.module_name]) for l in layers)
    hook.remove()

    def fail(module, args):
        raise RuntimeError("inside generate")

    hook = layers[-1].register_forward_pre_hook(fail)
    with peft_sparse.fast_paths(fast), pytest.raises(RuntimeError, match="inside generate"):
        model.generate(input_ids=x, **kwargs)
    hook.remove()
    assert not any(l.merged for l in layers)
    assert all(torch.equal(l.get_base_layer().weight, theta0[l.module_name]) for l in layers)
    want = copy.deepcopy(model).merge_and_unload().generate(input_ids=x, **kwargs)
    assert torch.equal(tokens, want)
    with model.disable_adapter():
        assert not torch.equal(model.generate(input_ids=x, **kwargs), want)  # (the adapter changes the tokens)
