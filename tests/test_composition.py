"""Composition: weighted union of adapters, merging several into the base, loading across sparse types."""

import pytest
import torch
from peft import PeftModel, get_peft_model

from peft_sparse import SparseFTConfig, load_sparse_adapter, merge_sparse_adapters

from .models import inputs, randomize_values, sparse_layers, tiny_gpt2, tiny_llama

GPT2_TARGETS = ["c_attn", "c_proj", "c_fc"]


def _two_adapters(builder=tiny_llama, targets="all-linear"):
    model = get_peft_model(builder(), SparseFTConfig(target_modules=targets, density=0.2, seed=1), adapter_name="a")
    model.add_adapter("b", SparseFTConfig(target_modules=targets, density=0.2, seed=2))
    randomize_values(model, "a", seed=1)
    randomize_values(model, "b", seed=2)
    return model


def _logits(model, x):
    with torch.no_grad():
        return model(x).logits


def test_weighted_adapter_is_union_with_weighted_sums():
    model = _two_adapters()
    model.add_weighted_adapter(adapters=["a", "b"], weights=[0.5, -2.0], adapter_name="ab")
    for layer in sparse_layers(model):
        dense = 0.5 * layer.get_delta_weight("a").double() - 2.0 * layer.get_delta_weight("b").double()
        union = torch.unique(torch.cat([layer.sparse_indices["a"], layer.sparse_indices["b"]]).long())
        assert torch.equal(layer.sparse_indices["ab"].long(), union)
        assert layer.sparse_indices["ab"].dtype == torch.int32
        torch.testing.assert_close(layer.get_delta_weight("ab").double(), dense, rtol=1e-6, atol=1e-7)
    config = model.peft_config["ab"]
    assert config.init == "external"
    assert sum(config.tunable_weights_per_module.values()) == config.num_tunable_weights


@pytest.mark.parametrize("builder, targets", [(tiny_llama, "all-linear"), (tiny_gpt2, GPT2_TARGETS)])
def test_merging_several_adapters_is_base_plus_weighted_deltas(builder, targets):
    model = _two_adapters(builder, targets)
    x = inputs()
    weights = [0.7, 1.3]
    expected = {layer.module_name: layer.merged_weight([]).clone() for layer in sparse_layers(model)}
    for layer in sparse_layers(model):
        expected[layer.module_name] += weights[0] * layer.logical_delta("a") + weights[1] * layer.logical_delta("b")
    model.add_weighted_adapter(["a", "b"], weights, "ab")
    model.set_adapter("ab")
    composed_out = _logits(model, x)
    merged = model.merge_and_unload(adapter_names=["ab"])
    for name, want in expected.items():
        module = merged.get_submodule(name)
        got = module.weight.t() if type(module).__name__ == "Conv1D" else module.weight
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(_logits(merged, x), composed_out, rtol=1e-5, atol=1e-5)


def test_composing_equals_merging_a_then_applying_b(tmp_path):
    model = _two_adapters()
    x = inputs()
    model.base_model.set_adapter(["a", "b"])
    composed = _logits(model, x)
    model.save_pretrained(tmp_path)  # one subfolder per adapter name

    base = tiny_llama()
    merge_sparse_adapters(base, [tmp_path / "a"])  # θ + δ_a
    with_b = PeftModel.from_pretrained(base, tmp_path / "b", adapter_name="b")
    torch.testing.assert_close(_logits(with_b, x), composed, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(_logits(tiny_llama(), x), composed)


def test_merge_sparse_adapters_from_files_with_weights(tmp_path):
    model = _two_adapters()
    model.save_pretrained(tmp_path)
    model.add_weighted_adapter(["a", "b"], [2.0, -0.5], "ab")
    model.set_adapter("ab")
    x = inputs()
    want = _logits(model, x)
    base = merge_sparse_adapters(tiny_llama(), [tmp_path / "a", tmp_path / "b"], weights=[2.0, -0.5])
    torch.testing.assert_close(_logits(base, x), want, rtol=1e-5, atol=1e-5)


def test_load_sparse_adapter_as_sft_beside_another(tmp_path):
    first = _two_adapters()
    first.save_pretrained(tmp_path)
    x = inputs()
    first.set_adapter("b")
    want_b = _logits(first, x)

    model = load_sparse_adapter(tiny_llama(), tmp_path / "a", adapter_name="a")
    model = load_sparse_adapter(model, tmp_path / "b", adapter_name="b")
    assert isinstance(model, PeftModel) and set(model.peft_config) == {"a", "b"}
    assert not any(p.requires_grad for n, p in model.named_parameters())
    model.set_adapter("b", inference_mode=True)
    assert torch.equal(_logits(model, x), want_b)
    model.add_weighted_adapter(["a", "b"], [1.0, 1.0], "sum")


def test_external_config_without_weights_refuses_to_run():
    config = SparseFTConfig(target_modules=["q_proj"], density=0.1, init="external")
    model = get_peft_model(tiny_llama(), config)
    with pytest.raises(RuntimeError, match="placeholder indices"):
        model(inputs())


def test_bad_composition_requests():
    model = _two_adapters()
    with pytest.raises(ValueError, match="got 2 adapters but 1 weights"):
        model.add_weighted_adapter(["a", "b"], [1.0], "x")
    with pytest.raises(ValueError, match="adapter 'zzz' does not exist"):
        model.add_weighted_adapter(["a", "zzz"], [1.0, 1.0], "x")
    with pytest.raises(ValueError, match="adapter 'a' already exists"):
        model.add_weighted_adapter(["a", "b"], [1.0, 1.0], "a")


def test_adapters_of_different_sparse_methods_load_side_by_side_as_sft(tmp_path):
    from peft_sparse import SpIELConfig

    spiel = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.1, growth="ma"))
    randomize_values(spiel, seed=4)
    for layer in sparse_layers(spiel):
        layer.sparse_ages["default"].fill_(7)
    spiel.save_pretrained(tmp_path / "spiel", save_ages=True)
    sft = get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["q_proj", "v_proj"], density=0.3, seed=9))
    randomize_values(sft, seed=5)
    sft.save_pretrained(tmp_path / "sft")
    x = inputs()
    want_spiel, want_sft = _logits(spiel, x), _logits(sft, x)

    model = load_sparse_adapter(tiny_llama(), tmp_path / "sft", adapter_name="task")
    model = load_sparse_adapter(model, tmp_path / "spiel", adapter_name="lang")
    assert {type(c).__name__ for c in model.peft_config.values()} == {"SparseFTConfig"}
    assert not any("lang" in layer.sparse_ages for layer in sparse_layers(model))
    model.set_adapter("lang", inference_mode=True)
    assert torch.equal(_logits(model, x), want_spiel)
    model.set_adapter("task", inference_mode=True)
    assert torch.equal(_logits(model, x), want_sft)
    # language + task composed by addition equals merging both deltas
    model.add_weighted_adapter(["lang", "task"], [1.0, 1.0], "both")
    model.set_adapter("both", inference_mode=True)
    composed = _logits(model, x)
    merged = merge_sparse_adapters(tiny_llama(), [tmp_path / "spiel", tmp_path / "sft"])
    torch.testing.assert_close(_logits(merged, x), composed, rtol=1e-5, atol=1e-5)

    as_spiel = load_sparse_adapter(tiny_llama(), tmp_path / "spiel", as_type="SPIEL")
    assert all(torch.equal(l.sparse_ages["default"], torch.full_like(l.sparse_ages["default"], 7)) for l in sparse_layers(as_spiel))
