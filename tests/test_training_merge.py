"""The adapter merged into the base weight's storage while training (SparseLayer's default).

It must be invisible: bit-identical training to the transient-copy path, and θ₀ back in the base
weight whenever anything else can look at it.
"""

import copy

import pytest
import torch
from peft import get_peft_model

from peft_sparse import SM3, SparseLayer, SpIELConfig, SpIELScheduler

from .models import (
    assert_backward_matches_reference,
    inputs,
    randomize_values,
    record_full_passes,
    sparse_layers,
    tiny_llama,
    train_on,
)


@pytest.fixture(autouse=True)
def _training_merge_on(monkeypatch):
    """The training merge is opt-in (``training_merge=True``); these tests check it, so it is on unless a test turns it off."""
    monkeypatch.setattr(SparseLayer, "merge_for_training", True)


def _spiel(dtype=torch.float32, growth="ag", **kw):
    config = SpIELConfig(
        target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], density=0.2, growth=growth,
        reselection_steps=3, gradient_estimation_steps=2, **kw,
    )  # fmt: skip
    return get_peft_model(tiny_llama(dtype=dtype), config)


def _base_weights(model):
    return {layer.module_name: layer.get_base_layer().weight.detach().clone() for layer in sparse_layers(model)}


def _merged_after_one_forward():
    """(model, θ₀ per layer, inputs, first sparse layer) after one training forward with non-zero values."""
    model = _spiel()
    theta0 = _base_weights(model)
    randomize_values(model, scale=0.1)
    x = inputs()
    model.train()
    model(x)
    return model, theta0, x, sparse_layers(model)[0]


def _expected_merged(theta0, layer):
    want = theta0.clone()
    want.view(-1)[layer.sparse_indices["default"].long()] += layer.sparse_values["default"].detach()
    return want


def _train(model, growth, steps=8):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = SM3(params, lr=1e-2) if growth == "ma" else torch.optim.AdamW(params, lr=1e-2)
    scheduler = SpIELScheduler(model, opt, total_steps=steps)
    return train_on(model, opt, scheduler, inputs(), steps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("growth", ["ag", "ma"])
def test_training_is_bit_identical_to_the_transient_copy(dtype, growth):
    """Same losses, values, indices and ages, step for step, with reselections; θ₀ intact afterwards."""
    runs = []
    for merge in (True, False):
        model = _spiel(dtype, growth)
        theta0 = _base_weights(model)
        for layer in sparse_layers(model):
            layer.merge_for_training = merge
        losses = _train(model, growth)
        merged_during = any(layer._training_merge is not None for layer in sparse_layers(model))
        model.eval()
        assert _base_weights(model).keys() == theta0.keys()
        for name, w in _base_weights(model).items():
            assert torch.equal(w, theta0[name]), name
        runs.append((losses, model, merged_during))
    (losses_a, a, merged_a), (losses_b, b, merged_b) = runs
    assert merged_a and not merged_b  # the first run really trained merged in place
    assert losses_a == losses_b
    for la, lb in zip(sparse_layers(a), sparse_layers(b)):
        assert torch.equal(la.sparse_indices["default"], lb.sparse_indices["default"])
        assert torch.equal(la.sparse_values["default"], lb.sparse_values["default"])
        assert torch.equal(la.sparse_ages["default"], lb.sparse_ages["default"])


def test_base_weight_holds_the_merged_weight_only_while_training():
    model, theta0, x, layer = _merged_after_one_forward()
    stored = layer.get_base_layer().weight.detach().clone()
    assert torch.equal(stored, _expected_merged(theta0[layer.module_name], layer))  # merged in place, with the transient copy's rounding
    # every way of looking at the base weight sees θ₀
    sd = model.state_dict()
    for l in sparse_layers(model):
        key = next(k for k in sd if k.endswith(l.module_name + ".base_layer.weight"))
        assert torch.equal(sd[key], theta0[l.module_name])
    model(x)  # merged again
    assert torch.equal(layer.logical_weight(), theta0[layer.module_name])  # logical_weight releases
    model(x)
    model.float()  # .to() and friends release first
    assert torch.equal(layer.get_base_layer().weight, theta0[layer.module_name])


def test_outputs_match_with_adapter_disabled_merged_and_evaluated():
    model = _spiel()
    base = tiny_llama()
    randomize_values(model, scale=0.1)
    x = inputs()
    model.train()
    train_out = model(x).logits
    with model.disable_adapter():
        assert torch.equal(model(x).logits, base(x).logits)
    assert torch.equal(model(x).logits, train_out)  # merged again after the context
    model.eval()
    assert torch.equal(model(x).logits, train_out)  # the transient copy gives the same bits
    model.train()
    model(x)
    merged = model.merge_and_unload()
    merged_out = merged(x).logits
    torch.testing.assert_close(merged_out, train_out, rtol=1e-5, atol=1e-5)
    for name, module in merged.named_modules():
        if name.endswith(("q_proj", "v_proj", "gate_proj", "down_proj")):
            # merged exactly once: θ₀ + φ at η, θ₀ elsewhere
            assert not torch.equal(module.weight, dict(base.named_modules())[name].weight)


def test_backward_after_release_builds_the_merged_weight_itself():
    """A forward that ran merged, then something released θ₀ (here state_dict) before backward: the
    input gradient must still come from W + Δ, not θ₀."""
    x_embeds = torch.randn(2, 5, 32, requires_grad=True)
    grads = []
    for release in (False, True):
        model = _spiel()
        randomize_values(model, scale=0.5)
        model.train()
        layer = sparse_layers(model)[0]
        inp = x_embeds.detach().clone().requires_grad_(True)
        out = layer(inp)
        assert layer._training_merge is not None
        if release:
            model.state_dict()
            assert layer._training_merge is None
        out.sum().backward()
        grads.append((inp.grad, layer.sparse_values["default"].grad))
    assert torch.equal(grads[0][0], grads[1][0])
    assert torch.equal(grads[0][1], grads[1][1])


def test_two_active_adapters_and_autocast_use_the_transient_copy():
    model = _spiel()
    randomize_values(model, scale=0.1)
    model.add_adapter("other", SpIELConfig(target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], density=0.1))
    randomize_values(model, adapter_name="other", seed=3, scale=0.1)
    model.base_model.set_adapter(["default", "other"])
    model.train()
    x = inputs()
    out = model(x).logits
    assert all(layer._training_merge is None for layer in sparse_layers(model))
    for layer in sparse_layers(model):
        layer.merge_for_training = False
    assert torch.equal(model(x).logits, out)
    single = _spiel()
    single.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float32 weights, bf16 compute: no in-place merge
        single(x)
    assert all(layer._training_merge is None for layer in sparse_layers(single))


def test_deepcopy_and_load_state_dict_while_merged():
    model = _spiel()
    theta0 = _base_weights(model)
    randomize_values(model, scale=0.1)
    model.train()
    x = inputs()
    out = model(x).logits
    clone = copy.deepcopy(model)  # copies storage and merge state together
    assert torch.equal(clone(x).logits, out)
    clone.eval()
    for name, w in _base_weights(clone).items():
        assert torch.equal(w, theta0[name])
    model(x)
    model.load_state_dict(model.state_dict())  # releases before the base weights are overwritten
    model.eval()
    for name, w in _base_weights(model).items():
        assert torch.equal(w, theta0[name])


@pytest.mark.parametrize("merged", [False, True])
def test_pickled_model_while_merged_or_not(merged):
    """A whole model pickles (``torch.save``) — fresh, and in training while merged in place — and the copy
    gives the same outputs, finds its own model (not the original) for its merge checks, and holds θ₀
    once it leaves training."""
    import io
    import pickle

    model = _spiel()
    theta0 = _base_weights(model)
    randomize_values(model, scale=0.1)
    x = inputs()
    if merged:
        model.train()
        model(x)
        assert all(layer._training_merge is not None for layer in sparse_layers(model))
    out = model(x).logits
    for clone in (pickle.loads(pickle.dumps(model)), _torch_saved(model, io)):
        assert torch.equal(clone(x).logits, out)
        assert all(layer._model_ref() is clone.base_model.model for layer in sparse_layers(clone))
        clone.eval()
        for name, w in _base_weights(clone).items():
            assert torch.equal(w, theta0[name])


def _torch_saved(model, io):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_a_deep_copy_merges_in_place_after_the_original_is_gone():
    """A deep copy's layers check their own model (not the original) for other users of their base
    weights: once the original is freed, the copy still merges in place for training."""
    import gc

    model = _spiel()
    randomize_values(model, scale=0.1)
    clone = copy.deepcopy(model)
    theta0 = _base_weights(clone)
    del model
    gc.collect()
    clone.train()
    x = inputs()
    clone(x)
    layers = sparse_layers(clone)
    assert all(layer._model_ref() is clone.base_model.model for layer in layers)
    assert all(layer._training_merge is not None for layer in layers)
    for layer in layers:
        assert torch.equal(layer.get_base_layer().weight.detach(), _expected_merged(theta0[layer.module_name], layer))


def test_gradient_checkpointing_recomputes_merged():
    runs = []
    for ckpt in (False, True):
        model = _spiel()
        randomize_values(model, scale=0.1)
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        model.train()
        x = inputs()
        model(x, labels=x).loss.backward()
        runs.append([layer.sparse_values["default"].grad.clone() for layer in sparse_layers(model)])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_tied_weight_is_never_merged_in_place():
    """lm_head tied to the input embeddings: merging in place would change the embeddings too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    base = LlamaForCausalLM(config)
    assert base.lm_head.weight is base.model.embed_tokens.weight
    embeddings = base.model.embed_tokens.weight.detach().clone()
    model = get_peft_model(base, SpIELConfig(target_modules=["lm_head", "q_proj"], density=0.2))
    randomize_values(model, scale=0.1)
    model.train()
    x = inputs()
    out = model(x).logits
    layers = {layer.module_name.split(".")[-1]: layer for layer in sparse_layers(model)}
    assert layers["lm_head"]._training_merge is None
    assert layers["q_proj"]._training_merge is not None
    assert torch.equal(model.base_model.model.model.embed_tokens.weight, embeddings)
    for layer in sparse_layers(model):
        layer.merge_for_training = False
    assert torch.equal(model(x).logits, out)


@pytest.mark.parametrize("between", ["no_grad", "eval", "state_dict", "disabled", "other_adapter"])
def test_pending_backward_after_release_and_remerge(between):
    """Forward A, something that releases θ₀ (or runs the base alone), forward B merged again, one
    backward over both: every gradient equals the transient-copy path's."""
    results = []
    for merge in (True, False):
        model = _spiel()
        randomize_values(model, scale=0.5)
        model.add_adapter("b", SpIELConfig(target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], density=0.2))
        randomize_values(model, adapter_name="b", seed=5, scale=0.5)
        model.base_model.set_adapter("default")
        model.train()
        layer = sparse_layers(model)[0]
        for l in sparse_layers(model):
            l.merge_for_training = merge
        torch.manual_seed(0)
        x1 = torch.randn(2, 5, 32, requires_grad=True)
        x2 = torch.randn(2, 5, 32, requires_grad=True)
        if between == "disabled":
            with model.disable_adapter():
                y1 = layer(x1)
        elif between == "other_adapter":
            model.base_model.set_adapter("b")
            y1 = layer(x1)
            model.base_model.set_adapter("default")
        else:
            y1 = layer(x1)
            if between == "no_grad":
                with torch.no_grad():
                    layer(x2)
            elif between == "eval":
                model.eval()
                model.train()
            else:
                model.state_dict()
        y2 = layer(x2)
        (y1.square().sum() + y2.square().sum()).backward()
        results.append((x1.grad, x2.grad, layer.sparse_values["default"].grad))
    for a, b in zip(*results):
        assert (a is None and b is None) or torch.equal(a, b)


def test_unload_and_data_parallel_replicas_leave_theta0():
    model = _spiel()
    theta0 = _base_weights(model)
    randomize_values(model, scale=0.1)
    model.train()
    x = torch.randn(2, 5, 32)
    layer = sparse_layers(model)[0]
    want = layer(x)
    assert layer._training_merge is not None
    replica = layer._replicate_for_data_parallel()  # what nn.DataParallel does to every module each step
    assert layer._training_merge is None and torch.equal(layer.get_base_layer().weight, theta0[layer.module_name])
    assert replica._is_replica and torch.equal(replica(x), want)
    assert replica._training_merge is None and torch.equal(layer.get_base_layer().weight, theta0[layer.module_name])
    model(inputs())
    base = model.unload()
    checked = 0
    for name, module in base.named_modules():
        if name in theta0:
            assert torch.equal(module.weight, theta0[name]), name
            checked += 1
    assert checked == len(theta0)


def test_weight_tied_after_wrapping_is_not_merged_in_place():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    model = get_peft_model(LlamaForCausalLM(config), SpIELConfig(target_modules=["lm_head"], density=0.2))
    randomize_values(model, scale=0.1)
    model.train()
    head = sparse_layers(model)[0]
    model(inputs())
    assert head._training_merge is not None  # untied: merged in place
    embed = model.base_model.model.model.embed_tokens
    head.get_base_layer().weight = embed.weight  # tie afterwards, as tie_weights() does
    before = embed.weight.detach().clone()
    model(inputs())
    assert head._training_merge is None and torch.equal(embed.weight, before)


def _count_writes(monkeypatch):
    from peft_sparse.core import kernels

    writes = {"single": 0, "many": 0}
    single, many = kernels.scatter_sum_into, kernels.scatter_sum_many
    inside_many = []

    def count_single(*a):  # one layer's write (not the per-tensor fallback of a batched write)
        writes["single"] += not inside_many
        return single(*a)

    def count_many(outs, *a):
        writes["many"] += len(outs)
        inside_many.append(1)
        try:
            return many(outs, *a)
        finally:
            inside_many.pop()

    monkeypatch.setattr(kernels, "scatter_sum_into", count_single)
    monkeypatch.setattr(kernels, "scatter_sum_many", count_many)
    return writes


@pytest.mark.parametrize("optimizer", ["sm3", "adamw", "adamw-fused"])
def test_optimizer_step_rewrites_the_merge_and_the_next_forward_does_not(monkeypatch, optimizer):
    """After each optimizer step the stored weight already holds θ₀ + φ_new (written by the optimizer
    step hook, batched over layers); the next forward passes write nothing and use it."""
    model = _spiel()
    theta0 = _base_weights(model)
    randomize_values(model, scale=0.1)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = {"sm3": lambda: SM3(params, lr=1e-2), "adamw": lambda: torch.optim.AdamW(params, lr=1e-2),
           "adamw-fused": lambda: torch.optim.AdamW(params, lr=1e-2, fused=True)}[optimizer]()  # fmt: skip
    x = inputs()
    model.train()
    model(x, labels=x).loss.backward()  # creates the merges (one write each, in forward)
    writes = _count_writes(monkeypatch)
    opt.step()
    layers = sparse_layers(model)
    assert writes == {"single": 0, "many": len(layers)}
    for layer in layers:
        assert torch.equal(layer.get_base_layer().weight, _expected_merged(theta0[layer.module_name], layer))
    opt.zero_grad()
    loss = model(x, labels=x).loss
    assert writes == {"single": 0, "many": len(layers)}  # nothing rewritten in forward
    for layer in layers:
        layer.merge_for_training = False
    assert torch.equal(loss, model(x, labels=x).loss)  # the transient copies give the same output


def test_values_changed_outside_an_optimizer_step_are_rewritten_in_forward(monkeypatch):
    """A forward pass trusts the stored weight only after the step hook of an optimizer holding the
    values wrote it and nothing moved since; in-place edits, replaced storage and forward-written
    merges are written again; an optimizer that holds none of the values writes nothing."""
    model, theta0, x, layer = _merged_after_one_forward()
    values = layer.sparse_values["default"]
    writes = _count_writes(monkeypatch)
    model(x)
    assert writes["single"] == len(sparse_layers(model))  # written by a forward: not trusted, written again
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()  # no gradients: values stay
    writes["single"] = 0
    model(x)
    model(x)
    assert writes["single"] == 0  # written by the step hook and unchanged: nothing written
    with torch.no_grad():
        values.mul_(2)
    model(x)
    assert writes["single"] == 1
    assert torch.equal(layer.get_base_layer().weight, _expected_merged(theta0[layer.module_name], layer))
    values.data = values.data + 1  # new storage
    model(x)
    assert writes["single"] == 2  # this layer only: the others still hold what the step hook wrote
    assert torch.equal(layer.get_base_layer().weight, _expected_merged(theta0[layer.module_name], layer))
    other = torch.nn.Parameter(torch.zeros(3))
    other.grad = torch.ones(3)
    torch.optim.SGD([other], lr=0.1).step()
    assert writes["many"] == len(sparse_layers(model))  # only the first SGD step wrote


def _same_as_transient(model, x):
    reference = copy.deepcopy(model)
    for layer in sparse_layers(reference):
        layer.merge_for_training = False
    return torch.equal(model(x).logits, reference(x).logits)


def test_values_written_by_a_master_weight_wrapper_are_seen():
    """A wrapper in the style of mixed-precision master weights (an inner optimizer over float32 copies,
    then ``p.data.copy_(master)``: no version bump, and the inner optimizer does not hold φ) — every
    forward pass rewrites, so training equals the transient copy step for step."""

    class MasterWeights:
        def __init__(self, params):
            self.params = list(params)
            self.masters = [p.detach().clone().requires_grad_() for p in self.params]
            self.inner = torch.optim.SGD(self.masters, lr=1.0)

        def step(self):
            for p, m in zip(self.params, self.masters):
                m.grad = p.grad.clone()
            self.inner.step()
            for p, m in zip(self.params, self.masters):
                p.data.copy_(m.data)
                p.grad = None

    model = _spiel(growth="ma")
    randomize_values(model, scale=0.1)
    reference = copy.deepcopy(model)
    for layer in sparse_layers(reference):
        layer.merge_for_training = False
    x = inputs()
    model.train()
    reference.train()
    optimizers = [MasterWeights(p for p in m.parameters() if p.requires_grad) for m in (model, reference)]
    for _ in range(3):
        losses = []
        for m, opt in zip((model, reference), optimizers):
            loss = m(x, labels=x).loss
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1])


def test_replaced_weight_storage_and_reused_value_addresses_are_seen():
    """The base weight's storage replaced through ``.data`` (new θ₀) starts a new merge instead of
    dropping the delta; values replaced twice through ``.data``, so that the allocator could hand the
    first address back, are still seen as changed."""
    model, _, x, layer = _merged_after_one_forward()
    weight = layer.get_base_layer().weight
    layer.release_training_merge()
    theta0 = weight.detach().clone()
    model(x)
    weight.data = theta0.clone()  # a fresh storage holding θ₀
    assert _same_as_transient(model, x)
    values = layer.sparse_values["default"]
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()  # the step hook writes
    written = values.data_ptr()
    for _ in range(20):  # the written storage is held, so no replacement can land at its address
        values.data = values.detach() + 1.0
        values.data = values.detach() + 1.0
        assert values.data_ptr() != written
    assert _same_as_transient(model, x)


def test_values_at_the_address_of_a_freed_written_storage_are_not_trusted():
    """A resize that frees the values' written storage, then new values at the old address with the same
    version counter: the stored weight is no longer trusted (the held storage moved). With fresh memory
    there (when the allocator hands the address to a probe tensor), the training pass computes what the
    evaluation pass does; otherwise a storage that only names the address (never read) stands in."""
    config = SpIELConfig(target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], density=0.2, reselection_steps=3,
                         gradient_estimation_steps=2)  # fmt: skip
    model, _, x = _steady_after_steps(2, get_peft_model(tiny_llama(hidden_size=128, intermediate_size=192), config))
    layer = sparse_layers(model)[0]
    values, merge = layer.sparse_values["default"], layer._training_merge
    assert merge.current(values)
    address, version = values.data_ptr(), values._version
    values.untyped_storage().resize_(0)  # freed, the storage object still held by the last write
    probes, placed, n = [], None, values.numel()
    for i in range(4000):  # fresh memory over the old address: a tensor there, or a view into a larger one
        probe = torch.empty(n * (1 if i < 1000 else 1 + i % 8), dtype=values.dtype)
        offset, size = address - probe.data_ptr(), probe.element_size()
        if 0 <= offset and offset % size == 0 and offset // size + n <= probe.numel():
            placed = probe[offset // size :][:n].view(values.shape)
            break
        probes.append(probe)
    del probes
    if placed is None:  # a storage naming the address without owning it, only compared, then replaced
        named = torch._C._construct_storage_from_data_pointer(address, values.device, n * values.element_size())
        values.data = torch.empty(0, dtype=values.dtype).set_(named, 0, values.shape)
        assert values.data_ptr() == address and values._version == version
        assert not merge.current(values)
        values.data = torch.zeros(values.shape, dtype=values.dtype)
        return
    placed.copy_(torch.randn(values.shape) * 0.5)
    values.data = placed  # (the version counter stays)
    assert values.data_ptr() == address and values._version == version
    assert not merge.current(values)
    trained = model(x).logits.detach()
    model.eval()
    assert torch.allclose(trained, model(x).logits, atol=1e-5)


def test_merge_write_plans_keep_no_tensor_alive():
    """A batched-write plan keeps only addresses and element types: a deleted model's tensors are freed."""
    import gc
    import weakref

    model = _spiel()
    x = inputs()
    model.train()
    model(x)
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()
    weight = weakref.ref(sparse_layers(model)[0].get_base_layer().weight)
    del model
    gc.collect()
    assert weight() is None


def test_backward_after_a_rewrite_since_its_forward_builds_its_own_weight():
    """An optimizer step between forward and backward (here one that changes nothing: no gradients
    yet) rewrites the stored weight; the pending backward notices and builds W + scatter(η, φ) itself."""
    model = _spiel()
    randomize_values(model, scale=0.1)
    x = inputs()
    model.train()
    reference = copy.deepcopy(model)
    for layer in sparse_layers(reference):
        layer.merge_for_training = False
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    loss = model(x, labels=x).loss
    generations = [layer._training_merge.generation for layer in sparse_layers(model)]
    opt.step()  # no gradients yet: the values stay, the step hook rewrites the stored weights
    assert [layer._training_merge.generation for layer in sparse_layers(model)] == [g + 1 for g in generations]
    assert_backward_matches_reference(loss, model, reference, x)


@pytest.mark.parametrize("growth", ["ag", "ma"])
def test_reselection_rewrites_every_merge_in_batches_and_the_next_forward_writes_nothing(monkeypatch, growth):
    """A reselection writes θ₀ back at the old positions of every layer (bit for bit, −0.0 included) and
    θ₀ + φ at the new ones, each in one batched write; the next forward uses them as they are. The
    merges stay the same objects (θ₀ read anew into their own tensors), except where the base weight's
    storage was replaced since the last pass (θ₀ there): that layer's merge is set up again."""
    model = _spiel(growth=growth)
    layers = sparse_layers(model)
    first = layers[0].get_base_layer().weight
    with torch.no_grad():  # a signed zero of θ₀ under an active index must come back as it was
        first.view(-1)[layers[0].sparse_indices["default"][:3].long()] = -0.0
    theta0 = _base_weights(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = SM3(params, lr=1e-2) if growth == "ma" else torch.optim.AdamW(params, lr=1e-2)
    scheduler = SpIELScheduler(model, opt, total_steps=8)
    x = inputs()
    model.train()
    for step in (1, 2):  # the first reselection at t = γ = 2
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        if step == 2:
            before = [layer.sparse_indices["default"].clone() for layer in layers]
            moved = layers[1].get_base_layer().weight
            moved.data = theta0[layers[1].module_name].clone()  # new storage holding θ₀: nothing to write back there
            merges = [layer._training_merge for layer in layers]
            bases = [m.base for m in merges]
            writes = _count_writes(monkeypatch)
        scheduler.step()
    assert writes == {"single": 0, "many": 2 * len(layers) - 1}  # θ₀ back, then θ₀ + φ: one batch each
    for at, (layer, old) in enumerate(zip(layers, before)):
        assert not torch.equal(layer.sparse_indices["default"], old)
        assert layer._training_merge is not None
        if at == 1:
            assert layer._training_merge is not merges[1]
        else:
            assert layer._training_merge is merges[at] and layer._training_merge.base is bases[at]
            assert torch.equal(bases[at], theta0[layer.module_name].view(-1)[layer.sparse_indices["default"].long()])
        stored = layer.get_base_layer().weight.detach()
        assert torch.equal(stored, _expected_merged(theta0[layer.module_name], layer))
    model(x, labels=x)
    assert writes == {"single": 0, "many": 2 * len(layers) - 1}  # nothing written in forward
    model.eval()
    for layer in layers:
        restored = layer.get_base_layer().weight
        assert torch.equal(restored.view(torch.int32) if restored.dtype == torch.float32 else restored,
                           theta0[layer.module_name].view(torch.int32))  # fmt: skip
    assert torch.signbit(first.view(-1)[before[0][:3].long()]).all()


def test_reselection_keeps_in_place_only_the_merges_a_forward_pass_would_keep():
    """A reselection moves a merge in place only where a forward pass would keep it: a layer told to stop
    merging in place (``merge_for_training = False`` since its last pass) gets θ₀ back and no merge; a
    merge not registered for the optimizer step's rewrites is set up anew and registered; the other
    merges stay the same objects. Every merged weight holds θ₀ + φ at the new indices."""
    from peft_sparse.accel import training_merge as merge_module

    model = _spiel()
    theta0 = _base_weights(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    scheduler = SpIELScheduler(model, opt, total_steps=8)
    x = inputs()
    model.train()
    layers = sparse_layers(model)
    for step in (1, 2):  # the reselection at t = γ = 2
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        if step == 2:
            layers[1].merge_for_training = False
            merge_module._MERGED_LAYERS.discard(layers[2])
            merges = [layer._training_merge for layer in layers]
            assert all(m is not None for m in merges)
        scheduler.step()
    stopped, unregistered = layers[1], layers[2]
    assert stopped._training_merge is None and torch.equal(stopped.get_base_layer().weight, theta0[stopped.module_name])
    assert unregistered._training_merge is not merges[2] and unregistered in merge_module._MERGED_LAYERS
    for layer, merge in zip(layers, merges):
        if layer is stopped:
            continue
        assert layer in merge_module._MERGED_LAYERS
        assert (layer._training_merge is merge) is (layer is not unregistered)
        assert torch.equal(layer.get_base_layer().weight.detach(), _expected_merged(theta0[layer.module_name], layer))


def test_steady_forward_skips_the_lookups_but_sees_every_change(monkeypatch):
    """After an optimizer step a training forward reuses the last pass's decisions (no per-pass
    lookups); anything that changes one of them sends the pass through the full path. Outputs always
    equal the transient copy's."""
    model = _spiel()
    randomize_values(model, scale=0.1)
    model.add_adapter("other", SpIELConfig(target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], density=0.1))
    randomize_values(model, adapter_name="other", seed=3, scale=0.1)
    model.base_model.set_adapter("default")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    layers = sparse_layers(model)
    x = inputs()
    model.train()
    full_passes = record_full_passes(monkeypatch)

    def steady_again():  # merged by a forward, rewritten by an optimizer step (no gradients: it still rewrites)
        model(x)
        opt.step()

    def check(steady, expect_full=None):
        full_passes.clear()
        out = model(x).logits
        assert full_passes == (expect_full if expect_full is not None else ([] if steady else layers))
        for layer in layers:  # the same forward through the transient copies
            layer.merge_for_training = False
        want = model(x).logits
        for layer in layers:
            layer.merge_for_training = True
        assert torch.equal(out, want)
        steady_again()

    steady_again()
    check(steady=True)
    full_passes.clear()
    model(x)
    model(x)
    assert not full_passes  # pass after pass
    with torch.no_grad():
        check(steady=False)
    with model.disable_adapter():
        full_passes.clear()
        model(x)
        assert not full_passes  # (the disabled path never reaches the merge)
    check(steady=False)  # released by the disabled pass
    model.base_model.set_adapter("other")
    check(steady=False)
    model.base_model.set_adapter("default")
    check(steady=False)
    check(steady=True)
    with torch.no_grad():  # an in-place edit moves the values' version: rewritten by the next forward
        layers[0].sparse_values["default"].mul_(2)
    check(steady=False, expect_full=[layers[0]])
    layers[1].sparse_indices["default"] = layers[1].sparse_indices["default"].clone()  # a new indices tensor
    check(steady=False, expect_full=[layers[1]])
    held = layers[2].sparse_values["default"]
    layers[2].sparse_values["default"] = torch.nn.Parameter(held.detach() * 2)  # (not the optimizer's: never steady)
    check(steady=False, expect_full=[layers[2]])
    check(steady=False, expect_full=[layers[2]])
    layers[2].sparse_values["default"] = held
    check(steady=False, expect_full=[layers[2]])
    layers[3].merge_for_training = False
    check(steady=False, expect_full=[layers[3]])
    layers[3].merge_for_training = True
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float32 weights, bf16 compute: the transient copy
        check(steady=False)
    model.eval()
    check(steady=False)


def _steady_after_steps(steps: int, model=None, device: str = "cpu"):
    """(model, SGD optimizer, inputs) after ``steps`` training steps of ``model`` (default: ``_spiel()``)
    with randomized values, on ``device``: every layer's pass is steady."""
    model = (_spiel() if model is None else model).to(device)
    randomize_values(model, scale=0.1)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = inputs().to(device)
    model.train()
    for _ in range(steps):
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(layer._steady is not None for layer in sparse_layers(model))
    return model, opt, x


def test_a_steady_layer_is_freed_without_the_cycle_collector():
    """What a steady layer remembers of its last pass holds no reference back to the layer: deleting
    the model frees its layers and their merged base weights at once, not at the next collection."""
    import gc
    import weakref

    model, opt, _ = _steady_after_steps(2)
    layer = sparse_layers(model)[0]
    layer_ref, weight_ref = weakref.ref(layer), weakref.ref(layer.get_base_layer().weight)
    del layer
    gc.collect()
    gc.disable()
    try:
        del model, opt
        assert layer_ref() is None and weight_ref() is None
    finally:
        gc.enable()


def test_training_observer_runs_once_and_before_the_steady_checks():
    """The observer runs once per training pass, steady or not, and what it changes is seen by that
    pass (here it releases the in-place merge: the pass takes the full path and the transient copy)."""
    model, _, x = _steady_after_steps(1)
    layer = sparse_layers(model)[0]
    calls = []
    layer.training_observer = lambda lay: calls.append(lay) or (len(calls) == 2 and setattr(lay, "merge_for_training", False))
    first = model(x).logits  # steady
    second = model(x).logits  # the observer turns the in-place merge off before the checks
    assert len(calls) == 2 and layer._training_merge is None and layer._steady is None
    assert torch.equal(first, second)


@pytest.mark.parametrize("mode", ["all", "products", "none"])
def test_the_lean_forward_keeps_or_rebuilds_each_input_as_the_generic_pass_does(monkeypatch, mode):
    """Layer by layer, the lean forward (MergedDeltaLinear, its own save) keeps X, registers a rebuild or
    keeps nothing (values not trained) exactly where the generic forward does, in each rebuild mode, with
    the same loss and gradients bit for bit."""
    from peft_sparse.accel import steady as steady_module

    merged_apply, sparse_delta_apply = steady_module.merged_apply, steady_module.sparse_delta_apply
    model, _, x = _steady_after_steps(2, _spiel(torch.bfloat16))
    layers = sparse_layers(model)
    for layer in layers:
        layer.rebuild_inputs = mode
    layers[0].sparse_values["default"].requires_grad_(False)  # (its X is needed by nobody)
    taken = []

    def pass_results(apply):
        monkeypatch.setattr(steady_module, "merged_apply", lambda *a: taken.append(1) or apply(*a))
        embeds = model.get_input_embeddings()(x).detach().requires_grad_()
        loss = model(inputs_embeds=embeds, labels=x).loss
        # (seen holds the nodes, not only their ids: a built-in node's Python object lives only while
        # referenced, so a freed one's id can come back for another node)
        saved, stack, seen = [], [loss.grad_fn], {}
        while stack:  # each sparse layer's decision, in the graph's order
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen[id(node)] = node
            if type(node).__name__ in ("MergedDeltaLinearBackward", "SparseDeltaLinearBackward"):
                saved.append((node.x_saved, node.x_rebuild is not None))
            stack.extend(f for f, _ in node.next_functions)
        loss.backward()
        grads = [layer.sparse_values["default"].grad for layer in layers]
        for layer in layers:
            layer.sparse_values["default"].grad = None
        return loss.detach(), embeds.grad, grads, saved

    lean = pass_results(merged_apply)
    assert len(taken) == len(layers)
    generic = pass_results(sparse_delta_apply)
    assert lean[3] == generic[3] and len(lean[3]) == len(layers)
    assert (False, False) in lean[3] and any(kept for kept, _ in lean[3]) == (mode != "all")
    assert any(rebuilt for _, rebuilt in lean[3]) == (mode != "none")
    assert torch.equal(lean[0], generic[0]) and torch.equal(lean[1], generic[1])
    assert lean[2][0] is None and generic[2][0] is None
    assert all(torch.equal(a, b) for a, b in zip(lean[2][1:], generic[2][1:]))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype, mode", [(torch.bfloat16, "all"), (torch.float32, "none")])
@pytest.mark.parametrize("block_shape, method", [((1, 1), "auto"), ((1, 1), "sddmm"), ((1, 1), "dense"), ((16, 16), "auto"),
                                                 ((16, 16), "sddmm"), ((16, 16), "dense")])  # fmt: skip
def test_the_lean_backward_gives_the_generic_backwards_gradients(monkeypatch, block_shape, method, dtype, mode, device):
    """A steady merged pass's backward (MergedDeltaLinear's own) gives the generic backward's input and
    value gradients bit for bit, block or unstructured, for each value-gradient method, X rebuilt (in
    bfloat16: a product's factors read by the block kernel) or kept (``rebuild_inputs="none"``), a layer
    whose values are frozen, with and without an input gradient at the first layers; it does not call
    the generic backward. During an AG window (a dense-gradient consumer) and after the merge was written
    back it hands over to it. On CUDA the kernels are the compiled Triton ones (the block kernel under
    ``sddmm``, reading the product's factors in bfloat16)."""
    from peft_sparse.accel import steady as steady_module
    from peft_sparse.core import functional

    model, _, x = _steady_after_steps(2, _spiel(dtype, block_shape=block_shape), device)
    layers = sparse_layers(model)
    for layer in layers:
        layer.value_grad_method = method
        layer.rebuild_inputs = mode
    layers[2].sparse_values["default"].requires_grad_(False)
    generic_calls = []
    generic = functional.SparseDeltaLinear.backward

    def counted(ctx, g):
        generic_calls.append(1)
        return generic(ctx, g)

    monkeypatch.setattr(functional.SparseDeltaLinear, "backward", staticmethod(counted))

    def pass_results(input_grad: bool):
        generic_calls.clear()
        embeds = model.get_input_embeddings()(x).detach().requires_grad_(input_grad)
        loss = model(inputs_embeds=embeds, labels=x).loss
        assert all(layer._steady is not None for layer in layers)
        loss.backward()
        grads = [layer.sparse_values["default"].grad for layer in layers]
        for layer in layers:
            layer.sparse_values["default"].grad = None
        return embeds.grad, grads, len(generic_calls)

    for input_grad in (True, False):
        lean_x, lean_values, lean_generic = pass_results(input_grad)
        assert lean_generic == 0
        with monkeypatch.context() as m:
            m.setattr(steady_module.MergedDeltaLinear, "backward", staticmethod(counted))
            generic_x, generic_values, generic_generic = pass_results(input_grad)
        assert generic_generic == len(layers)
        assert (lean_x is None) == (generic_x is None) == (not input_grad)
        assert lean_x is None or torch.equal(lean_x, generic_x)
        assert lean_values[2] is None and generic_values[2] is None
        assert all(torch.equal(a, b) for k, (a, b) in enumerate(zip(lean_values, generic_values)) if k != 2)
    seen = []
    layers[0].dense_grad_consumer = lambda layer, dense: seen.append(dense.shape)
    try:
        generic_calls.clear()
        loss = model(x, labels=x).loss
        layers[1].release_weight_merge()  # θ₀ written back after forward: backward must rebuild the weight
        loss.backward()
        assert len(generic_calls) == 2 and len(seen) == 1
    finally:
        layers[0].dense_grad_consumer = None


def test_steady_merged_passes_take_the_lean_forward_with_the_generic_results(monkeypatch):
    """A steady pass of a layer merged in place, input and bias in the weight's dtype and autocast off,
    multiplies by the stored weight through MergedDeltaLinear; its loss, input gradient and value
    gradients are the generic pass's, bit for bit. Under autocast it takes the generic pass."""
    from peft_sparse.accel import steady as steady_module

    merged_apply, sparse_delta_apply = steady_module.merged_apply, steady_module.sparse_delta_apply
    model, _, x = _steady_after_steps(2)
    layers = sparse_layers(model)
    lean = []
    monkeypatch.setattr(steady_module, "merged_apply", lambda *a: lean.append(1) or merged_apply(*a))

    def pass_results():
        lean.clear()
        embeds = model.get_input_embeddings()(x).detach().requires_grad_()
        loss = model(inputs_embeds=embeds, labels=x).loss
        loss.backward()
        grads = [layer.sparse_values["default"].grad.clone() for layer in layers]
        for layer in layers:
            layer.sparse_values["default"].grad = None
        return loss.detach(), embeds.grad, grads, len(lean)

    loss, x_grad, grads, taken = pass_results()
    assert taken == len(layers) and all(layer._steady is not None for layer in layers)
    monkeypatch.setattr(steady_module, "merged_apply", lambda *a: lean.append(1) or sparse_delta_apply(*a))
    loss_b, x_grad_b, grads_b, _ = pass_results()  # (the same decisions, through the generic forward)
    assert torch.equal(loss, loss_b) and torch.equal(x_grad, x_grad_b)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_b))
    # a bfloat16 model under bfloat16 autocast: steady, merged in place, but through the generic forward
    model = _spiel(torch.bfloat16)
    randomize_values(model, scale=0.1)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    monkeypatch.setattr(steady_module, "merged_apply", lambda *a: lean.append(1) or merged_apply(*a))
    for _ in range(2):
        model(x, labels=x).loss.backward()
        opt.step()
    lean.clear()
    model(x)
    assert len(lean) == len(layers)
    lean.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    assert not lean and all(layer._steady is not None for layer in sparse_layers(model))
