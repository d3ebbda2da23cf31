"""Sparse deltas over input embeddings (nn.Embedding) in the core: forward and value gradient against a dense
delta, padding rows, tied output embeddings (untied or refused), merging, saving without the base table,
mixed batches, SpIEL's dense-gradient window and LT-SFT's phases on an embedding."""

import warnings

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from torch import nn

from peft_sparse import LTSFTConfig, LTSFTScheduler, SparseFTConfig, SpIELConfig, SpIELScheduler
from peft_sparse.core.embedding import SparseEmbedding

from .models import inputs, randomize_values, tiny_bert, tiny_gpt2, tiny_llama

# name → (builder, embedding module path, target_modules)
EMBEDDINGS = {
    "llama": (tiny_llama, "model.embed_tokens", ["embed_tokens", "up_proj"]),
    "gpt2": (tiny_gpt2, "transformer.wte", ["wte", "c_fc"]),
    "bert": (tiny_bert, "bert.embeddings.word_embeddings", ["word_embeddings", "query"]),
}


def _embedding(model, path):
    return model.base_model.model.get_submodule(path)


def _dense_delta(layer):
    return layer.logical_delta("default").detach()


@pytest.mark.parametrize("kind", sorted(EMBEDDINGS))
def test_lookup_and_value_gradient_equal_a_dense_delta(kind):
    build, path, targets = EMBEDDINGS[kind]
    model = get_peft_model(build(), SparseFTConfig(target_modules=targets, density=0.3))
    randomize_values(model)
    layer = _embedding(model, path)
    assert isinstance(layer, SparseEmbedding)
    ids = inputs(batch=3, length=9)
    ids[0, :3] = 0  # repeated tokens (and BERT's padding row 0)
    base = layer.get_base_layer()
    delta = _dense_delta(layer).requires_grad_(True)  # autograd reference: E + δ as a dense table
    ref = nn.functional.embedding(ids, base.weight.detach() + delta, padding_idx=base.padding_idx)
    upstream = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3))
    (ref * upstream).sum().backward()
    got = layer(ids)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    (got * upstream).sum().backward()
    expected = delta.grad.reshape(-1)[layer.sparse_indices["default"].long()]
    torch.testing.assert_close(layer.sparse_values["default"].grad, expected, rtol=1e-6, atol=1e-6)
    if base.padding_idx is not None:  # nn.Embedding gives its padding row no gradient; neither do the values there
        rows = layer.sparse_indices["default"].long() // base.embedding_dim
        assert (rows == base.padding_idx).any()
        assert layer.sparse_values["default"].grad[rows == base.padding_idx].abs().max() == 0


def test_value_gradient_never_builds_a_table_sized_tensor(monkeypatch):
    """Outside a gradient-estimation window the backward pass allocates O(tokens·H + d_φ), not (V, H)."""
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["embed_tokens"], density=0.05))
    layer = _embedding(model, "model.embed_tokens")
    table = layer.get_base_layer().weight.numel()
    sizes = []
    original = torch.Tensor.new_zeros

    def recording(self, *size, **kwargs):
        out = original(self, *size, **kwargs)
        sizes.append(out.numel())
        return out

    monkeypatch.setattr(torch.Tensor, "new_zeros", recording)
    ids = inputs(length=5)
    layer(ids).sum().backward()
    assert sizes and max(sizes) < table


def test_tied_output_embedding_is_untied_and_keeps_the_base_weights():
    model = tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    original = model.lm_head.weight.detach().clone()
    peft_model = get_peft_model(model, SparseFTConfig(target_modules=["wte"], density=0.2))
    randomize_values(peft_model)
    inner = peft_model.base_model.model
    assert inner.lm_head.weight is not inner.transformer.wte.base_layer.weight
    assert not inner.lm_head.weight.requires_grad
    assert inner.config.tie_word_embeddings is False
    ids = inputs()
    with torch.no_grad():
        before = peft_model(ids).logits
        merged = peft_model.merge_and_unload()
        after = merged(ids).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)  # the delta reaches the lookup only, merged or not
    torch.testing.assert_close(merged.lm_head.weight, original, rtol=0, atol=0)
    assert not torch.equal(merged.transformer.wte.weight, original)


def test_tied_embedding_is_refused_when_untying_is_off():
    with pytest.raises(ValueError, match="untie_output_embeddings=True"):
        get_peft_model(tiny_gpt2(), SparseFTConfig(target_modules=["wte"], density=0.2, untie_output_embeddings=False))
    with pytest.raises(ValueError, match="untie_output_embeddings must be True or False"):
        SparseFTConfig(target_modules=["wte"], density=0.2, untie_output_embeddings="yes")


def test_unsupported_embeddings_are_refused_with_the_reason():
    model = tiny_llama()
    model.model.embed_tokens.max_norm = 1.0
    with pytest.raises(TypeError, match="max_norm=1.0"):
        get_peft_model(model, SparseFTConfig(target_modules=["embed_tokens"], density=0.1))


def test_saving_keeps_only_the_delta_and_reloads_exactly(tmp_path):
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["embed_tokens", "up_proj"], density=0.1))
    randomize_values(model)
    assert model.peft_config["default"].base_vocab_size == 97
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "Setting save_embedding_layers to True", no hub lookup
        model.save_pretrained(tmp_path / "a")
    tensors = load_file(tmp_path / "a" / "adapter_model.safetensors")
    assert not [k for k in tensors if "base_layer" in k]
    assert any("embed_tokens.sparse_values" in k for k in tensors)
    ids = inputs()
    model.eval()
    with torch.no_grad():
        expected = model(ids).logits
        loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path / "a").eval()
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)
    # an untargeted, resized vocabulary is saved with the adapter, with a warning, as PEFT does (decided offline)
    other = get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["up_proj"], density=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        other.save_pretrained(tmp_path / "b")
    assert not [k for k in load_file(tmp_path / "b" / "adapter_model.safetensors") if "embed" in k]
    other.base_model.model.resize_token_embeddings(101)
    with pytest.warns(UserWarning, match="has 101 rows but had 97"):
        other.save_pretrained(tmp_path / "c")
    assert any("embed_tokens" in k for k in load_file(tmp_path / "c" / "adapter_model.safetensors"))


def test_mixed_batch_gives_each_row_its_adapter():
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["embed_tokens"], density=0.3))
    model.add_adapter("other", SparseFTConfig(target_modules=["embed_tokens"], density=0.3, seed=5))
    randomize_values(model, "default", seed=1)
    randomize_values(model, "other", seed=2)
    model.eval()
    ids = inputs(batch=3)
    with torch.no_grad():
        mixed = model(ids, adapter_names=["default", "__base__", "other"]).logits
        model.set_adapter("default")
        first = model(ids[:1]).logits
        model.set_adapter("other")
        third = model(ids[2:]).logits
        with model.disable_adapter():
            second = model(ids[1:2]).logits
    torch.testing.assert_close(mixed, torch.cat([first, second, third]), rtol=1e-5, atol=1e-5)


def test_spiel_reselects_over_an_embedding_from_its_dense_gradient_window():
    model = get_peft_model(
        tiny_llama(),
        SpIELConfig(target_modules=["embed_tokens", "up_proj"], density=0.05, reselection_steps=4, gradient_estimation_steps=2),
    )
    layer = _embedding(model, "model.embed_tokens")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = SpIELScheduler(model, optimizer, total_steps=12)
    before = layer.sparse_indices["default"].clone()
    model.train()
    for t in range(8):
        x = inputs(seed=t)
        model(x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    assert layer.dense_grad_count > 0
    after = layer.sparse_indices["default"]
    assert after.numel() == before.numel() and not torch.equal(after, before)
    rows = after.long() // layer.in_features
    assert torch.isin(rows, inputs(seed=0).unique()).any()  # grown where tokens were seen


def test_lt_sft_selects_embedding_weights_and_trains_them_sparsely():
    config = LTSFTConfig(target_modules=["embed_tokens", "up_proj"], density=0.05, dense_steps=2, sparse_steps=2)
    model = get_peft_model(tiny_llama(), config)
    layer = _embedding(model, "model.embed_tokens")
    assert layer.sparse_values["default"].numel() == 97 * 32  # the dense phase adapts the whole table
    lt = LTSFTScheduler(model)
    optimizer = lt.attach(torch.optim.AdamW(lt.trainable_parameters(), lr=1e-2))
    model.train()
    seen = set()
    for t in range(2):
        x = inputs(seed=t)
        seen |= set(x.unique().tolist())
        model(x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        lt.step()
    kept = layer.sparse_indices["default"].long()
    assert 0 < kept.numel() < 97 * 32
    assert set((kept // 32).unique().tolist()) <= seen  # only looked-up rows moved (AdamW, no weight decay on them)


def test_saving_never_looks_up_the_base_model_config(tmp_path, monkeypatch):
    """PEFT's "auto" rule reloads the base model's config (from the hub for a hub name) to tell whether the
    vocabulary was resized, and warns "Could not find a config file … vocabulary was not modified" offline;
    sparse adapters decide from the vocabulary size their config recorded."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["up_proj"], density=0.1))
    model.peft_config["default"].base_model_name_or_path = "no-such-org/no-such-model"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.save_pretrained(tmp_path)
    assert not [k for k in load_file(tmp_path / "adapter_model.safetensors") if "embed" in k]
