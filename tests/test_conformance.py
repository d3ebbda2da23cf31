"""What PEFT users expect of any adapter: a readable module tree, mixed-adapter batches, init_weights=False."""

import pytest
import torch
from peft import PeftModel, get_peft_model

from peft_sparse import SparseFTConfig, SpIELConfig

from .models import MODELS, inputs, sparse_layers, tiny_llama


def _two_adapters(build, targets, task_type=None):
    model = get_peft_model(build(), SparseFTConfig(target_modules=targets, density=0.1, init_weights=False, seed=1, task_type=task_type))
    model.add_adapter("b", SparseFTConfig(target_modules=targets, density=0.05, init_weights=False, seed=2, task_type=task_type))
    return model.eval()


def test_print_shows_the_module_tree():
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["q_proj"], density=0.1))
    text = repr(model)
    assert "object at 0x" not in text and "sparse.SparseLinear(" in text and "(base_layer): Linear(" in text
    assert model.get_layer_status()[0].module_type == "sparse.SparseLinear"


@pytest.mark.parametrize("kind", ["llama", "gpt2", "bert"])
def test_mixed_adapter_batches_give_each_row_its_adapters_output(kind):
    build, targets, logits = MODELS[kind]
    model = _two_adapters(build, targets)
    x = inputs(batch=3, seed=5)
    names = ["b", "__base__", "default"]
    with torch.no_grad():
        mixed = logits(model(x, adapter_names=names))
        expected = []
        for i, name in enumerate(names):
            if name == "__base__":
                with model.disable_adapter():
                    expected.append(logits(model(x[i : i + 1])))
            else:
                model.set_adapter(name)
                expected.append(logits(model(x[i : i + 1])))
    torch.testing.assert_close(mixed, torch.cat(expected), rtol=1e-5, atol=1e-5)
    with torch.no_grad(), model.disable_adapter():
        base = logits(model(x))
    assert not torch.allclose(mixed[0], base[0]) and not torch.allclose(mixed[2], base[2])  # the adapters act
    torch.testing.assert_close(mixed[1], base[1], rtol=1e-5, atol=1e-5)


def test_mixed_adapter_batches_refuse_training_unknown_names_and_wrong_lengths():
    build, targets, _ = MODELS["llama"]
    model = _two_adapters(build, targets)
    x = inputs(batch=2)
    with pytest.raises(ValueError, match="non-existing adapter.*nope"):
        model(x, adapter_names=["nope", "b"])
    with pytest.raises(ValueError, match="3 adapter_names for a batch of 2"):
        model(x, adapter_names=["b", "b", "b"])
    model.train()
    with pytest.raises(ValueError, match="training mode"):
        model(x, adapter_names=["b", "b"])


@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])
def test_mixed_batches_in_generate(task_type):
    """Each row generates with its own adapter (a causal-LM PeftModel's generate, which otherwise merges the active
    adapter for the call, keeps them unmerged for a mixed batch), and nothing is left merged."""
    build, targets, _ = MODELS["llama"]
    model = _two_adapters(build, targets, task_type)
    x = inputs(batch=2, seed=2)
    with torch.no_grad():
        mixed = model.generate(input_ids=x, adapter_names=["b", "default"], max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert not any(getattr(m, "merged", False) for m in model.modules())
        model.set_adapter("b")
        first = model.generate(input_ids=x[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
        model.set_adapter("default")
        second = model.generate(input_ids=x[1:], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(mixed[:1], first) and torch.equal(mixed[1:], second)


def _indices_and_values(model, adapter="default"):
    layers = sparse_layers(model)
    return [l.sparse_indices[adapter].clone() for l in layers], [l.sparse_values[adapter].detach().clone() for l in layers]


@pytest.mark.parametrize("config_cls", [SparseFTConfig, SpIELConfig])
def test_init_weights_false_values_follow_torch_manual_seed_and_indices_follow_config_seed(config_cls):
    """As LoRA's init_lora_weights=False: torch.manual_seed decides the values, so two adapters from one config differ;
    the indices come from config.seed and the module name alone (the same on every rank, whatever the global seed)."""

    def make(global_seed, **kw):
        base = tiny_llama()  # (builds under its own torch.manual_seed)
        torch.manual_seed(global_seed)
        return get_peft_model(base, config_cls(target_modules="all-linear", density=0.1, init_weights=False, **kw)).eval()

    model = make(1)
    model.add_adapter("second", model.peft_config["default"])
    first_idx, first_val = _indices_and_values(model)
    second_idx, second_val = _indices_and_values(model, "second")
    assert all(torch.equal(a, b) for a, b in zip(first_idx, second_idx))
    assert all(not torch.equal(a, b) for a, b in zip(first_val, second_val))
    x = inputs()
    with torch.no_grad():
        out_first = model(x).logits
        model.set_adapter("second")
        assert not torch.allclose(model(x).logits, out_first, rtol=1e-3, atol=1e-3)
    again_idx, again_val = _indices_and_values(make(1))
    assert all(torch.equal(a, b) for a, b in zip(first_idx + first_val, again_idx + again_val))
    other_idx, other_val = _indices_and_values(make(2))
    assert all(torch.equal(a, b) for a, b in zip(first_idx, other_idx))
    assert all(not torch.equal(a, b) for a, b in zip(first_val, other_val))
    moved_idx, _ = _indices_and_values(make(1, seed=3))
    assert all(not torch.equal(a, b) for a, b in zip(first_idx, moved_idx))


@pytest.mark.parametrize("config_cls", [SparseFTConfig, SpIELConfig])
def test_init_weights_false_gives_non_zero_values_that_merge_and_round_trip(config_cls, tmp_path):
    config = config_cls(target_modules="all-linear", density=0.1, init_weights=False)
    model = get_peft_model(tiny_llama(), config).eval()
    values = [l.sparse_values["default"] for l in sparse_layers(model)]
    assert all(bool((v != 0).all()) for v in values)
    x = inputs()
    with torch.no_grad():
        out = model(x).logits
        with model.disable_adapter():
            assert not torch.allclose(model(x).logits, out)
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path).eval()
    assert loaded.peft_config["default"].init_weights is False
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, out, rtol=0, atol=0)
        torch.testing.assert_close(loaded.merge_and_unload()(x).logits, out, rtol=1e-5, atol=1e-6)
    assert all(bool((l.sparse_values["default"] == 0).all()) for l in sparse_layers(get_peft_model(tiny_llama(), config_cls(target_modules="all-linear", density=0.1))))
    with pytest.raises(ValueError, match="init_weights=1"):
        config_cls(target_modules="all-linear", density=0.1, init_weights=1)


@pytest.mark.parametrize("cast", ["half", "to_bfloat16", "double"])
def test_a_cast_asked_for_through_the_module_is_followed(cast):
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.1, init_weights=False)).eval()
    dtype = {"half": torch.float16, "to_bfloat16": torch.bfloat16, "double": torch.float64}[cast]
    model = model.half() if cast == "half" else model.to(torch.bfloat16) if cast == "to_bfloat16" else model.double()
    assert all(l.sparse_values["default"].dtype == dtype for l in sparse_layers(model))
    x = inputs()
    with torch.no_grad():
        out = model(x).logits
        assert out.dtype == dtype
        merged = model.merge_and_unload()(x).logits
    tol = {torch.float16: 2e-2, torch.bfloat16: 1e-1, torch.float64: 1e-6}[dtype]  # (rotary embeddings stay float32)
    torch.testing.assert_close(merged, out, rtol=tol, atol=tol)


def test_a_foreign_cast_of_the_values_storage_is_still_refused():
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.1, init_weights=False))
    layer = sparse_layers(model)[0]
    layer.sparse_values["default"].data = layer.sparse_values["default"].data.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="cast to torch.bfloat16 outside peft_sparse"):
        model(inputs())
