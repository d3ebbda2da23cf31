"""PEFT lifecycle parity on tiny Llama, GPT-2 (Conv1D) and BERT: one table, generic tests.

Every test first makes the adapter non-identity (random non-zero values) and asserts that the
output differs from the base model's, so merge/load/disable checks test something.
"""

import contextlib
import io
import json
import os

import pytest
import torch
from peft import PeftConfig, PeftModel, get_peft_model
from safetensors.torch import load_file

from peft_sparse import SparseFTConfig, SpIELConfig
from peft_sparse.core import storage

from .models import MODELS, inputs, randomize_values, sparse_layers, tiny_llama

# (row id, model, config class, config kwargs, tolerance for merged-vs-unmerged outputs)
CASES = [
    ("llama-random", "llama", SparseFTConfig, {"density": 0.1}, 1e-5),
    ("llama-magnitude-exact", "llama", SparseFTConfig, {"num_tunable_weights": 777, "init": "magnitude"}, 1e-5),
    ("llama-bf16-values", "llama", SparseFTConfig, {"density": 0.05, "values_dtype": "bfloat16"}, 1e-5),
    ("gpt2-conv1d", "gpt2", SparseFTConfig, {"density": 0.1}, 1e-5),
    ("bert-seqcls", "bert", SparseFTConfig, {"density": 0.1, "modules_to_save": ["classifier"]}, 1e-5),
    ("llama-spiel-ag", "llama", SpIELConfig, {"density": 0.1}, 1e-5),
    ("gpt2-spiel-ma", "gpt2", SpIELConfig, {"density": 0.1, "growth": "ma"}, 1e-5),
]
IDS = [c[0] for c in CASES]


def _make(case, adapter_name="default", seed=0):
    _, model_name, config_cls, kwargs, tol = case
    builder, targets, logits = MODELS[model_name]
    base = builder()
    config = config_cls(target_modules=targets, **kwargs)
    model = get_peft_model(base, config, adapter_name=adapter_name)
    randomize_values(model, adapter_name, seed=seed)
    return model, builder, logits, tol


def _out(model, logits, x):
    with torch.no_grad():
        return logits(model(x))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_save_load_roundtrip_is_bit_exact(case, tmp_path):
    model, builder, logits, _ = _make(case)
    x = inputs()
    base_out = _out(builder(), logits, x)
    out = _out(model, logits, x)
    assert not torch.allclose(out, base_out), "adapter is an identity: the test would pass vacuously"
    model.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    for low_cpu_mem_usage in (False, True):
        # torch_device: on a machine with a GPU, PEFT would otherwise load the file onto CUDA whatever the base
        # model's device (huggingface/peft#3793); sparse layers follow their base layer, but a modules_to_save
        # copy (the BERT classifier) would stay on CUDA — tests/test_gpu.py covers the sparse layers' part
        loaded = PeftModel.from_pretrained(builder(), tmp_path, low_cpu_mem_usage=low_cpu_mem_usage, torch_device="cpu")
        assert torch.equal(_out(loaded, logits, x), out)
        for a, b in zip(sparse_layers(model), sparse_layers(loaded)):
            assert torch.equal(a.sparse_indices["default"], b.sparse_indices["default"])
            assert a.sparse_values["default"].dtype == b.sparse_values["default"].dtype
    config = PeftConfig.from_pretrained(tmp_path)
    assert type(config) is case[2]
    assert config.tunable_weights_per_module == model.peft_config["default"].tunable_weights_per_module


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_saved_config_rebuilds_the_same_model(case, tmp_path):
    model, builder, logits, _ = _make(case)
    model.save_pretrained(tmp_path)
    rebuilt = get_peft_model(builder(), PeftConfig.from_pretrained(tmp_path))
    for a, b in zip(sparse_layers(model), sparse_layers(rebuilt)):
        assert torch.equal(a.sparse_indices["default"], b.sparse_indices["default"])
        assert a.sparse_values["default"].shape == b.sparse_values["default"].shape


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_indices_layout_and_dtypes(case):
    model, *_ = _make(case)
    dtype = torch.bfloat16 if case[3].get("values_dtype") == "bfloat16" else torch.float32
    for layer in sparse_layers(model):
        idx = layer.sparse_indices["default"]
        assert idx.dtype == torch.int32
        assert torch.all(idx[1:] > idx[:-1])
        assert int(idx.max()) < layer.out_features * layer.in_features
        assert layer.sparse_values["default"].dtype == dtype
        assert layer.sparse_values["default"].requires_grad


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_merge_unmerge_and_merge_and_unload(case):
    model, builder, logits, tol = _make(case)
    x = inputs()
    base_out = _out(builder(), logits, x)
    out = _out(model, logits, x)
    assert not torch.allclose(out, base_out)
    before = {n: p.clone() for n, p in model.get_base_model().named_parameters() if "base_layer" in n}
    model.merge_adapter()
    torch.testing.assert_close(_out(model, logits, x), out, rtol=tol, atol=tol)
    model.unmerge_adapter()
    for n, p in model.get_base_model().named_parameters():
        if n in before:
            assert torch.equal(p, before[n]), f"unmerge did not restore {n} exactly"
    assert torch.equal(_out(model, logits, x), out)
    merged = model.merge_and_unload()
    assert not sparse_layers(merged)
    torch.testing.assert_close(_out(merged, logits, x), out, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_safe_merge_raises_on_nan(case):
    model, *_ = _make(case)
    layer = sparse_layers(model)[0]
    with torch.no_grad():
        layer.sparse_values["default"][0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        model.merge_adapter(safe_merge=True)
    with pytest.raises(ValueError, match="NaN"):
        model.merge_and_unload(safe_merge=True)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_disable_set_and_delete_adapters(case):
    model, builder, logits, _ = _make(case)
    x = inputs()
    base_out = _out(builder(), logits, x)
    out_a = _out(model, logits, x)
    with model.disable_adapter():
        torch.testing.assert_close(_out(model, logits, x), base_out)
    assert torch.equal(_out(model, logits, x), out_a)

    _, model_name, config_cls, kwargs, _ = case
    model.add_adapter("other", config_cls(target_modules=MODELS[model_name][1], **{**kwargs, "seed": 7}))
    randomize_values(model, "other", seed=3)
    model.set_adapter("other")
    out_b = _out(model, logits, x)
    assert not torch.allclose(out_b, out_a)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".other" in n for n in trainable)
    model.set_adapter("default")
    assert torch.equal(_out(model, logits, x), out_a)
    model.delete_adapter("other")
    assert "other" not in model.peft_config
    assert all("other" not in layer.sparse_values for layer in sparse_layers(model))
    assert torch.equal(_out(model, logits, x), out_a)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_print_trainable_parameters_counts_the_budget(case):
    model, *_ = _make(case)
    config = model.peft_config["default"]
    budget = sum(config.tunable_weights_per_module.values())
    if config.num_tunable_weights is not None:
        assert budget == config.num_tunable_weights
    trainable, total = model.get_nb_trainable_parameters()
    dense = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "sparse_values" not in n)
    assert trainable == budget + dense
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        model.print_trainable_parameters()
    assert f"trainable params: {trainable:,}" in buffer.getvalue()


@pytest.mark.parametrize("case, peft_type", [(CASES[0], "SFT"), (CASES[5], "SPIEL")], ids=["sft", "spiel"])
def test_files_are_safetensors_and_json_only(case, peft_type, tmp_path):
    model, *_ = _make(case)
    model.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "adapter_config.json").read_text())
    assert raw["peft_type"] == peft_type
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    count = sum(raw["tunable_weights_per_module"].values())
    assert sum(t.numel() for k, t in tensors.items() if k.endswith("sparse_values")) == count
    payload = sum(t.numel() * t.element_size() for t in tensors.values())
    # a 4-byte float32 value per tunable weight (SpIEL's ages only when asked: save_ages=True), and per tensor its
    # positions as 4-byte int32 indices, a ⌈N/8⌉-byte bitmap or the Elias–Fano code, whichever is smallest
    # (index_storage="auto"; Elias–Fano's bytes include its 24-byte header)
    positions = sum(
        min(storage.storage_bytes(c, raw["module_shapes"][m][0] * raw["module_shapes"][m][1], 4).values())
        for m, c in raw["tunable_weights_per_module"].items()
    )
    assert payload == 4 * count + positions
    assert not any(name.endswith((".bin", ".pt", ".pkl")) for name in os.listdir(tmp_path))


def test_multiple_adapters_active_at_once():
    model, builder, logits, _ = _make(CASES[0])
    model.add_adapter("b", SparseFTConfig(target_modules="all-linear", density=0.1, seed=5))
    randomize_values(model, "b", seed=9)
    x = inputs()
    model.base_model.set_adapter(["default", "b"])
    both = _out(model, logits, x)
    # equals merging both deltas into the base weights
    merged = model.merge_and_unload(adapter_names=["default", "b"])
    torch.testing.assert_close(_out(merged, logits, x), both, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config_cls", [SparseFTConfig, SpIELConfig])
def test_training_leaves_every_base_weight_untouched_by_default(config_cls):
    """PEFT's invariant: after optimizer steps in train mode, every non-adapter parameter, read through
    named_parameters() (as an EMA or a parameter snapshot reads it), still holds the pre-trained value."""
    model = get_peft_model(tiny_llama(), config_cls(target_modules="all-linear", density=0.2))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for step in range(3):
        x = inputs(seed=step)
        model(x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for n, p in model.named_parameters():
        if n in before:
            assert torch.equal(p.detach(), before[n]), n
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in model.named_parameters() if p.requires_grad)
