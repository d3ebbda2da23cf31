"""Sparse deltas on biases (1-D parameters through ``target_parameters``), alone or beside the weight of the same
module: against a dense reference (outputs and value gradients, on every pass of a training step), through saving,
merging and unloading; the weight named twice is refused; LT-SFT's ``reference="authors"`` ranks the targeted
modules' biases with their weights."""

import copy

import pytest
import torch
from peft import PeftModel, get_peft_model

from peft_sparse import LTSFTConfig, LTSFTScheduler, SparseFTConfig, SpIELConfig
from peft_sparse.core.experts import SparseParameter, SparseSlice
from peft_sparse.core.layer import SparseLayer

from .models import inputs, randomize_values, tiny_bert, tiny_gpt2

FAMILIES = {
    "bert": (tiny_bert, ["query", "value", "dense"]),  # (nn.Linear)
    "gpt2": (tiny_gpt2, ["c_attn", "c_fc"]),  # (transformers Conv1D: weights stored (in, out))
}


def bias_targets(model, modules) -> list:
    return sorted(f"{name}.bias" for name, m in model.named_modules()
                  if name.rpartition(".")[2] in modules and getattr(m, "bias", None) is not None)  # fmt: skip


def dense_deltas(model, adapter="default") -> dict:
    """{parameter name in the base model: its dense delta}, built from every sparse layer's (η, φ) directly."""
    out = {}
    for layer in (m for m in model.modules() if isinstance(m, SparseLayer) and adapter in m.sparse_values):
        values = layer.sparse_values[adapter].detach()
        flat = torch.zeros(layer.out_features * layer.in_features).index_add_(0, layer.sparse_indices[adapter].long(), values)
        if isinstance(layer, SparseSlice):
            param = layer.get_base_layer().parameter()
            out[layer.parameter_key] = flat.view(param.shape)
        else:
            logical = flat.view(layer.out_features, layer.in_features)
            out[f"{layer.module_name}.weight"] = logical.t() if layer.fan_in_fan_out else logical
    return out


def value_gradients_of(reference, model, adapter="default") -> list:
    """Each sparse layer's ∂L/∂φ read off the reference's dense gradient at its indices."""
    grads = dict(reference.named_parameters())
    result = []
    for layer in (m for m in model.modules() if isinstance(m, SparseLayer) and adapter in m.sparse_values):
        if isinstance(layer, SparseSlice):
            dense = grads[layer.parameter_key].grad.reshape(-1)
        else:
            g = grads[f"{layer.module_name}.weight"].grad
            dense = (g.t() if layer.fan_in_fan_out else g).reshape(-1)
        result.append(dense[layer.sparse_indices[adapter].long()])
    return result


def reference_with(base, deltas: dict):
    reference = copy.deepcopy(base)
    params = dict(reference.named_parameters())
    for p in reference.parameters():
        p.requires_grad_(False)
    for name, delta in deltas.items():
        params[name].data += delta
        params[name].requires_grad_(True)
    return reference


def build(family, config_cls, **kwargs):
    make, modules = FAMILIES[family]
    base = make()
    config = config_cls(target_modules=modules, target_parameters=bias_targets(base, modules), density=0.2, **kwargs)
    return base, get_peft_model(copy.deepcopy(base), config)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["sft", "spiel-ag"])
def test_bias_and_weight_deltas_equal_a_dense_reference_on_every_pass(family, method):
    config_cls, extra = (SparseFTConfig, {}) if method == "sft" else (SpIELConfig, {})
    base, model = build(family, config_cls, **extra)
    wrappers = [m for m in model.modules() if isinstance(m, SparseParameter)]
    assert wrappers and all(isinstance(w.base_layer, SparseLayer) for w in wrappers)  # (the bias's wrapper over the weight's layer)
    assert {w.parameter_name for w in wrappers} == {"bias"}
    randomize_values(model, scale=0.05)
    reference = reference_with(base, dense_deltas(model))
    model.train(), reference.train()
    torch.manual_seed(0)
    x = inputs()
    for _ in range(3):  # (later passes may repeat a memo of the first: the bias's delta must stay in them)
        model.zero_grad(), reference.zero_grad()
        out = model(x, labels=x) if family == "gpt2" else model(input_ids=x)
        ref = reference(x, labels=x) if family == "gpt2" else reference(input_ids=x)
        loss = out.loss if family == "gpt2" else out.logits.square().mean()
        ref_loss = ref.loss if family == "gpt2" else ref.logits.square().mean()
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-6)
        loss.backward(), ref_loss.backward()
        grads = [m.sparse_values["default"].grad for m in model.modules() if isinstance(m, SparseLayer) and "default" in m.sparse_values]
        for got, want in zip(grads, value_gradients_of(reference, model)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    bias_grads = [m.sparse_values["default"].grad for m in model.modules() if isinstance(m, SparseSlice)]
    assert bias_grads and all(g.abs().sum() > 0 for g in bias_grads)


@pytest.mark.parametrize("family", FAMILIES)
def test_bias_deltas_round_trip_and_merge_and_unload(family, tmp_path):
    base, model = build(family, SparseFTConfig)
    randomize_values(model, scale=0.05)
    model.eval()
    x = inputs()
    with torch.no_grad():
        expected = model(input_ids=x).logits
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
    assert loaded.peft_config["default"].target_parameters == model.peft_config["default"].target_parameters
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, expected)
        with loaded.disable_adapter():
            assert torch.equal(loaded(input_ids=x).logits, base(input_ids=x).logits)
    reference = reference_with(base, dense_deltas(loaded)).eval()
    merged = copy.deepcopy(loaded).merge_and_unload()
    assert not any(isinstance(m, (SparseLayer, SparseParameter)) for m in merged.modules())
    assert [n for n, _ in merged.named_parameters()] == [n for n, _ in base.named_parameters()]
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, expected, rtol=1e-5, atol=1e-6)
        for (name, p), (_, q) in zip(merged.named_parameters(), reference.named_parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-7, msg=name)
    unloaded = copy.deepcopy(loaded).unload()
    for (name, p), (_, q) in zip(unloaded.named_parameters(), base.named_parameters()):
        assert torch.equal(p, q), name


def test_merge_then_unmerge_restores_the_bias():
    base, model = build("bert", SparseFTConfig)
    randomize_values(model, scale=0.05)
    model.eval()
    x = inputs()
    with torch.no_grad():
        expected = model(input_ids=x).logits
        model.merge_adapter()
        torch.testing.assert_close(model(input_ids=x).logits, expected, rtol=1e-5, atol=1e-6)
        model.unmerge_adapter()
        assert torch.equal(model(input_ids=x).logits, expected)
    restored = {n.replace(".base_layer", ""): p for n, p in model.get_base_model().named_parameters() if "sparse_" not in n}
    assert restored.keys() == dict(base.named_parameters()).keys()
    for name, q in base.named_parameters():
        torch.testing.assert_close(restored[name], q, rtol=0, atol=1e-7, msg=name)


def test_a_weight_adapted_twice_is_refused_by_name():
    base = tiny_bert()
    key = next(n for n, _ in base.named_modules() if n.endswith("query"))
    with pytest.raises(ValueError, match=f"{key}.weight"):
        get_peft_model(base, SparseFTConfig(target_modules=["query"], target_parameters=[f"{key}.weight"], density=0.1))


def test_a_second_adapter_reaches_the_weight_under_the_bias_wrapper():
    base, model = build("bert", SparseFTConfig)
    make, modules = FAMILIES["bert"]
    model.add_adapter("other", SparseFTConfig(target_modules=modules, target_parameters=bias_targets(base, modules), density=0.1, seed=3))
    layers = [m for m in model.modules() if isinstance(m, SparseLayer)]
    assert all({"default", "other"} <= set(m.sparse_values) for m in layers)
    assert not any(isinstance(m.base_layer, SparseLayer) for m in layers)  # (one sparse layer per weight, not nested)


def test_lt_sft_authors_ranks_the_targeted_biases_with_the_weights():
    make, modules = FAMILIES["bert"]
    base = make()
    config = LTSFTConfig(target_modules=modules, density=0.05, dense_steps=1, sparse_steps=1, reference="authors")
    model = get_peft_model(copy.deepcopy(base), config)
    assert config.target_parameters == bias_targets(base, modules)
    biases = [m for m in model.modules() if isinstance(m, SparseSlice)]
    assert len(biases) == len(config.target_parameters)
    # with distinct magnitudes the global threshold keeps exactly the K largest, biases among them
    layers = {m.module_name: m for m in model.modules() if isinstance(m, SparseLayer)}
    g = torch.Generator().manual_seed(0)
    scores = {}
    with torch.no_grad():
        for name, m in layers.items():
            v = torch.rand(m.numel, generator=g)
            if isinstance(m, SparseSlice):
                v = v * 4  # (biases move more: they must win places)
            m.sparse_values["default"].copy_(v)
            scores[name] = v
    k = int(0.05 * sum(s.numel() for s in scores.values()))
    kth = torch.cat(list(scores.values())).topk(k).values.min()
    chosen = LTSFTScheduler(model).select_and_rewind()
    expected = {name: int((s >= kth).sum()) for name, s in scores.items()}
    assert chosen == expected and sum(expected[n] for n in layers if isinstance(layers[n], SparseSlice)) > 0
    for name, m in layers.items():
        assert torch.equal(m.sparse_indices["default"].long().sort().values, torch.nonzero(scores[name] >= kth).squeeze(1))


def test_lt_sft_default_mode_leaves_biases_alone():
    make, modules = FAMILIES["bert"]
    config = LTSFTConfig(target_modules=modules, density=0.05, dense_steps=1, sparse_steps=1)
    model = get_peft_model(make(), config)
    assert not config.target_parameters and not any(isinstance(m, SparseParameter) for m in model.modules())


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.gain = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.proj(x) * self.gain


def test_parameters_of_other_ranks_are_refused_by_name():
    with pytest.raises(TypeError, match=r"gain.*shape \(\).*1-D"):
        get_peft_model(torch.nn.Sequential(_Scaled()), SparseFTConfig(target_parameters=["0.gain"], density=0.1))


def test_a_norm_weight_is_one_row():
    base = tiny_bert()
    names = [n for n, _ in base.named_parameters() if n.endswith("attention.output.LayerNorm.weight")]
    model = get_peft_model(copy.deepcopy(base), SparseFTConfig(target_parameters=names, density=0.25))
    layers = [m for m in model.modules() if isinstance(m, SparseSlice)]
    assert [(m.out_features, m.in_features) for m in layers] == [(1, base.config.hidden_size)] * len(names)
    randomize_values(model, scale=0.05)
    reference = reference_with(base, dense_deltas(model)).eval()
    model.eval()
    x = inputs()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x).logits, reference(input_ids=x).logits, rtol=1e-5, atol=1e-6)
