"""A sparse adapter as a LoRA (peft_sparse.convert_to_lora / save_as_lora, on PEFT's convert_to_lora): the delta is
exact, only the SVD's truncation is lossy — Eckart–Young's error at each rank, exact at full rank, for every layer
type (Linear, GPT-2 Conv1D, Embedding, bitsandbytes 4-bit) and the adapters of every method."""

import warnings

import peft
import pytest
import torch
from peft import PeftModel, get_peft_model, set_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer

import peft_sparse
from peft_sparse import LTSFTConfig, LTSFTScheduler, S4Config, SparseFTConfig, SpIELConfig, SpIELScheduler, build_s4_model, detect_language_masks

from .models import inputs, randomize_values, sparse_layers, tiny_gpt2, tiny_llama


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (tiny tensors)
    yield
    torch.set_num_threads(threads)


KINDS = {  # layer kind → (builder, targets)
    "linear": (tiny_llama, ["q_proj", "down_proj"]),
    "conv1d": (tiny_gpt2, ["c_attn", "c_fc"]),
    "embedding": (tiny_llama, ["embed_tokens"]),
    "embedding-tied": (tiny_gpt2, ["wte"]),  # (GPT-2 ties wte to lm_head; LoRA, like the sparse layer, adapts the lookup)
}


def _sparse(build, targets, **kwargs):
    config = SparseFTConfig(target_modules=targets, density=0.1, init_weights=False, task_type="CAUSAL_LM", **kwargs)
    return get_peft_model(build(), config).eval()


def _as_lora(model, build, rank):
    lora_config, state = peft_sparse.convert_to_lora(model, rank=rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (PEFT's notes on Conv1D's fan_in_fan_out and on tied embeddings)
        lora = get_peft_model(build(), lora_config).eval()
    result = set_peft_model_state_dict(lora, state)
    assert not result.unexpected_keys and not [k for k in result.missing_keys if "lora_" in k]
    return lora, lora_config


def _lora_layers(lora):
    return {m.get_base_layer(): m for m in lora.modules() if isinstance(m, BaseTunerLayer)}


def _pairs(model, lora):
    """(sparse layer, LoRA layer) over the same module path."""
    names = {n.removeprefix("base_model.model."): m for n, m in lora.named_modules() if isinstance(m, BaseTunerLayer)}
    return [(layer, names[n.removeprefix("base_model.model.")]) for n, layer in model.named_modules() if layer in sparse_layers(model)]


def _relative(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_full_rank_lora_has_the_sparse_delta_and_outputs(kind):
    build, targets = KINDS[kind]
    model = _sparse(build, targets)
    x = inputs()
    lora, lora_config = _as_lora(model, build, rank=1.0)  # (all the singular values)
    assert lora_config.task_type == "CAUSAL_LM" and type(lora).__name__ == "PeftModelForCausalLM"
    pairs = _pairs(model, lora)
    assert len(pairs) == len(sparse_layers(model)) > 0
    for layer, lora_layer in pairs:
        # PEFT's get_delta_weight is in the base weight's layout: (out, in), Conv1D's (in, out), an embedding's (V, H)
        delta = layer.get_delta_weight("default")
        assert delta.shape == layer.get_base_layer().weight.shape
        torch.testing.assert_close(lora_layer.get_delta_weight("default"), delta, rtol=0, atol=2e-6)
    with torch.no_grad():
        torch.testing.assert_close(lora(x).logits, model(x).logits, rtol=1e-5, atol=1e-5)


def test_error_at_each_rank_is_the_tail_of_the_singular_values_and_falls_with_rank():
    """Eckart–Young: at rank r each layer's relative error is √(Σ_{i>r} σᵢ² / Σ σᵢ²), which falls with r to 0 at
    the delta's rank; so does the error of the outputs."""
    build, targets = tiny_llama, ["embed_tokens", "q_proj", "down_proj"]
    model = _sparse(build, targets)
    x = inputs()
    with torch.no_grad():
        adapted, base = model(x).logits, build()(x).logits
    errors, output_errors = [], []
    for rank in (1, 2, 4, 8, 16, 32):
        lora, _ = _as_lora(model, build, rank)
        per_layer = []
        for layer, lora_layer in _pairs(model, lora):
            delta = layer.get_delta_weight("default")
            sigma = torch.linalg.svdvals(delta.double())
            expected = float((sigma[rank:].pow(2).sum() / sigma.pow(2).sum()).sqrt())
            got = _relative(lora_layer.get_delta_weight("default").double(), delta.double())
            assert got == pytest.approx(expected, abs=1e-5), (layer.module_name, rank)
            per_layer.append(got)
        errors.append(per_layer)
        with torch.no_grad():
            output_errors.append(_relative(lora(x).logits - base, adapted - base))
    for before, after in zip(errors, errors[1:]):
        assert all(b > a for b, a in zip(before, after) if b > 1e-5)  # strictly falling until exact
    assert all(e < 1e-5 for e in errors[-1])  # rank 32 = min(out, in) of every layer here (32×32, 32×48, 97×32)
    assert output_errors == sorted(output_errors, reverse=True) and output_errors[0] > 0.5 and output_errors[-1] < 1e-4


def test_a_float_rank_keeps_that_share_of_each_layers_energy():
    model = _sparse(tiny_llama, ["q_proj", "down_proj", "embed_tokens"])
    lora, lora_config = _as_lora(model, tiny_llama, rank=0.9)
    ranks = set()
    for layer, lora_layer in _pairs(model, lora):
        delta = layer.get_delta_weight("default")
        sigma = torch.linalg.svdvals(delta)
        r = lora_layer.r["default"]
        ranks.add(r)
        kept = float(sigma[:r].pow(2).sum() / sigma.pow(2).sum())
        assert kept >= 0.9 > float(sigma[: r - 1].pow(2).sum() / sigma.pow(2).sum())  # the smallest such rank
        assert _relative(lora_layer.get_delta_weight("default"), delta) <= (1 - 0.9) ** 0.5 + 1e-6
    assert len(lora_config.rank_pattern) == len(sparse_layers(model)) == 5 and len(ranks) > 1  # (a rank per layer)


# ------------------------------------------------------------------------------------------------ every method
def _train_spiel(model, steps=6):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = SpIELScheduler(model, optimizer, total_steps=steps)
    model.train()
    reselected = 0
    for step in range(steps):
        x = inputs(seed=step)
        model(x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reselected += bool(scheduler.step())
    assert reselected > 0
    return model.eval()


def _lt_sft():
    model = get_peft_model(tiny_llama(), LTSFTConfig(target_modules="all-linear", density=0.1, dense_steps=2, sparse_steps=2))
    lt = LTSFTScheduler(model)
    optimizer = lt.attach(torch.optim.AdamW(lt.trainable_parameters(), lr=1e-2))
    for step in range(3):  # two dense steps (then the lottery selection), one sparse step
        x = inputs(seed=step)
        model(x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        lt.step()
    assert lt.phase == "sparse"
    return model.eval()


def _s4():
    config = S4Config(target_modules="all-linear", density=0.2, languages=["a", "b"], importance_batches=1, init_weights=False)
    batches = {lang: [{"input_ids": inputs(seed=s), "labels": inputs(seed=s)}] for lang, s in (("a", 3), ("b", 4))}
    return build_s4_model(tiny_llama(), config, detect_language_masks(tiny_llama(), batches, config)).eval()


ADAPTERS = {
    "sft": lambda: _sparse(tiny_llama, "all-linear"),
    "spiel-ag": lambda: _train_spiel(get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.1))),
    "spiel-ma": lambda: _train_spiel(get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.1, growth="ma"))),
    "spiel-block": lambda: _train_spiel(get_peft_model(tiny_llama(), SpIELConfig(target_modules=["q_proj", "o_proj"], density=0.125, block_shape=(8, 8)))),
    "lt-sft": _lt_sft,
    "s4": _s4,
}


@pytest.mark.parametrize("method", sorted(ADAPTERS))
def test_adapters_of_every_method_convert_exactly_at_full_rank(method, tmp_path):
    model = ADAPTERS[method]()
    x = inputs(seed=11)
    with torch.no_grad():
        adapted, base = model(x).logits, tiny_llama()(x).logits
    assert _relative(adapted, base) > 1e-4  # (the adapter acts)
    peft_sparse.save_as_lora(tmp_path, model, rank=1.0)
    lora = PeftModel.from_pretrained(tiny_llama(), tmp_path).eval()
    assert {n for n, m in lora.named_modules() if isinstance(m, BaseTunerLayer)} == {n for n, m in model.named_modules() if m in sparse_layers(model)}
    with torch.no_grad():
        assert _relative(lora(x).logits - base, adapted - base) < 1e-4
        lora4, _ = _as_lora(model, tiny_llama, rank=4)
        assert 0 < _relative(lora4(x).logits - base, adapted - base) < 1.0


def test_modules_to_save_and_a_merged_adapter_convert_too():
    model = _sparse(tiny_llama, ["q_proj"], modules_to_save=["lm_head"])
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
        x = inputs()
        adapted = model(x).logits
        lora, lora_config = _as_lora(model, tiny_llama, rank=1.0)
        assert lora_config.modules_to_save == ["lm_head"]
        torch.testing.assert_close(lora(x).logits, adapted, rtol=1e-5, atol=1e-5)
        model.merge_adapter()  # the delta, not the merged weight, is converted
        merged_lora, _ = _as_lora(model, tiny_llama, rank=1.0)
        torch.testing.assert_close(merged_lora(x).logits, adapted, rtol=1e-5, atol=1e-5)


def test_over_4bit_weights_the_lora_serves_the_same_quantized_base(tmp_path):
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_llama(hidden_size=64, intermediate_size=128).save_pretrained(tmp_path / "base")  # (CPU 4-bit: 64-element blocks)

    def quantized():
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
        return AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=config, device_map="cpu").eval()

    model = get_peft_model(quantized(), SparseFTConfig(target_modules=["q_proj", "down_proj"], density=0.1)).eval()
    randomize_values(model, scale=0.1)
    assert isinstance(sparse_layers(model)[0].get_base_layer(), bnb.nn.Linear4bit)
    peft_sparse.save_as_lora(tmp_path / "lora", model, rank=1.0)
    lora = PeftModel.from_pretrained(quantized(), tmp_path / "lora").eval()
    pairs = _pairs(model, lora)
    assert len(pairs) == 4 and all(isinstance(lora_layer.get_base_layer(), bnb.nn.Linear4bit) for _, lora_layer in pairs)
    for layer, lora_layer in pairs:  # the delta is exact over the quantized weight too
        torch.testing.assert_close(lora_layer.get_delta_weight("default"), layer.get_delta_weight("default"), rtol=0, atol=2e-6)
    x = inputs()
    with torch.no_grad():
        adapted, base = model(x).logits, quantized()(x).logits
        # the outputs differ only as bitsandbytes' own CPU 4-bit matmul (LoRA's base pass) differs from the sparse
        # layer's dequantize-then-matmul (~0.2% of the logits), far below what the adapter moves
        assert _relative(lora(x).logits, adapted) < 1e-2 < 0.1 < _relative(adapted, base)


# ------------------------------------------------------------------------------------------------ refusals
def test_refusals_name_what_cannot_be_converted():
    model = _sparse(tiny_llama, ["q_proj", "embed_tokens"])
    with pytest.raises(ValueError, match=r"adapter_name='other' is not an adapter of this model; it holds \['default'\]"):
        peft_sparse.convert_to_lora(model, rank=4, adapter_name="other")
    with pytest.raises(ValueError, match="larger than the weight shape"):  # (PEFT's own check)
        peft_sparse.convert_to_lora(model, rank=64)
    # PEFT's own function would write an embedding's factors under names LoRA's embedding layer does not load: it refuses
    with pytest.raises(TypeError, match="do not support LoRA conversion: .*SparseEmbedding"):
        peft.convert_to_lora(model, rank=4)
    lora_config, state = peft.convert_to_lora(_sparse(tiny_llama, ["q_proj"]), rank=4)  # without an embedding it works
    assert len(state) == 4 and lora_config.r == 4


def test_bottleneck_adapters_are_refused_naming_why():
    from peft_sparse import BottleneckConfig

    model = get_peft_model(tiny_llama(), BottleneckConfig(bottleneck_size=4))
    with pytest.raises(TypeError, match=r"hold no additive weight delta .*BottleneckLayer.*non-linear function of the hidden state"):
        peft_sparse.convert_to_lora(model, rank=4)
