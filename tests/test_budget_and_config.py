"""Budget split and every bad-input error of the config and the injection."""

import pytest
import torch
from peft import PeftModel, get_peft_model
from torch import nn

from peft_sparse import SparseFTConfig
from peft_sparse.core.budget import split_budget, total_budget

from .models import tiny_llama


def test_split_is_proportional_and_exact():
    sizes = {"a": 100, "b": 300, "c": 50, "d": 50}
    counts = split_budget(sizes, 51)
    assert sum(counts.values()) == 51
    # quotas 10.2, 30.6, 5.1, 5.1 → floors 10, 30, 5, 5 (=50); largest remainder is b's 0.6
    assert counts == {"a": 10, "b": 31, "c": 5, "d": 5}


def test_split_remainder_ties_go_to_earlier_tensor():
    counts = split_budget({"x": 10, "y": 10, "z": 10}, 4)
    assert counts == {"x": 2, "y": 1, "z": 1}


def test_split_in_blocks():
    counts = split_budget({"a": 256, "b": 768}, 64, unit=16)
    assert counts == {"a": 16, "b": 48}


def test_density_rounds_to_nearest_weight():
    assert total_budget(1000, 0.0125, None) == 13
    assert total_budget(1000, None, 7) == 7


@pytest.mark.parametrize("density", [0.0, -0.1, 1.5, float("nan")])
def test_density_outside_unit_interval(density):
    with pytest.raises(ValueError, match=r"density"):
        SparseFTConfig(target_modules=["q_proj"], density=density)


@pytest.mark.parametrize("num", [0, -5])
def test_num_tunable_weights_not_positive(num):
    with pytest.raises(ValueError, match=rf"num_tunable_weights={num}"):
        SparseFTConfig(target_modules=["q_proj"], num_tunable_weights=num)


def test_num_tunable_weights_more_than_targeted():
    model = tiny_llama()
    total = sum(m.weight.numel() for n, m in model.named_modules() if n.endswith("q_proj"))
    with pytest.raises(ValueError, match=rf"num_tunable_weights={total + 1} exceeds the {total} weights"):
        get_peft_model(model, SparseFTConfig(target_modules=["q_proj"], num_tunable_weights=total + 1))
    get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["q_proj"], num_tunable_weights=total))


def test_both_or_neither_budget_field():
    with pytest.raises(ValueError, match="exactly one of density and num_tunable_weights"):
        SparseFTConfig(target_modules=["q_proj"], density=0.1, num_tunable_weights=10)
    with pytest.raises(ValueError, match="exactly one of density and num_tunable_weights"):
        SparseFTConfig(target_modules=["q_proj"])


def test_density_too_small_for_any_weight():
    with pytest.raises(ValueError, match="density=1e-09"):
        get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["q_proj"], density=1e-9))


def test_target_modules_matching_nothing():
    with pytest.raises(ValueError, match="not_a_module"):
        get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["not_a_module"], density=0.1))


def test_unsupported_layer_type():
    scaled = tiny_llama()
    scaled.model.embed_tokens.__class__ = type("ScaledEmbedding", (nn.Embedding,), {"forward": lambda self, x: 2 * nn.Embedding.forward(self, x)})
    with pytest.raises(TypeError, match="'model.embed_tokens' is an embedding .*ScaledEmbedding changes nn.Embedding's forward"):
        get_peft_model(scaled, SparseFTConfig(target_modules=["embed_tokens", "q_proj"], density=0.1))

    class WithConv(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3)

    with pytest.raises(TypeError, match="'conv' is a Conv2d"):
        get_peft_model(WithConv(), SparseFTConfig(target_modules=["conv"], density=0.1))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"values_dtype": "int8"}, "values_dtype='int8'"),
        ({"init": "fisher"}, "init='fisher'"),
        ({"seed": 1.5}, "seed=1.5"),
        ({"layers_pattern": "layers"}, "layers_pattern='layers'"),
        ({"tunable_weights_per_module": {"q": -1}}, r"tunable_weights_per_module\['q'\]=-1"),
    ],
)
def test_other_bad_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SparseFTConfig(target_modules=["q_proj"], density=0.1, **kwargs)


def test_values_dtype_accepts_torch_dtype_and_survives_autocast_adapter_dtype():
    config = SparseFTConfig(target_modules=["q_proj"], density=0.1, values_dtype=torch.bfloat16)
    assert config.values_dtype == "bfloat16"
    model = get_peft_model(tiny_llama(), config, autocast_adapter_dtype=True)
    dtypes = {p.dtype for n, p in model.named_parameters() if "sparse_values" in n}
    assert dtypes == {torch.bfloat16}


@pytest.mark.parametrize("base_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("autocast", [True, False])
def test_autocast_adapter_dtype_false_keeps_the_base_dtype_and_the_config_records_it(tmp_path, base_dtype, autocast):
    """PEFT's meaning: autocast_adapter_dtype=False leaves the adapter in the base model's dtype; True upcasts it to
    float32. An explicit values_dtype wins either way; the saved config reproduces the dtype on reload."""
    model = get_peft_model(tiny_llama(dtype=base_dtype), SparseFTConfig(target_modules="all-linear", density=0.1), autocast_adapter_dtype=autocast)
    expected = torch.float32 if autocast else base_dtype
    assert {p.dtype for n, p in model.named_parameters() if "sparse_values" in n} == {expected}
    assert model.peft_config["default"].values_dtype == str(expected).removeprefix("torch.")
    x = torch.randint(0, 97, (2, 5))
    model(x, labels=x).loss.backward()
    assert {p.grad.dtype for n, p in model.named_parameters() if "sparse_values" in n} == {expected}
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(tiny_llama(dtype=base_dtype), tmp_path)  # (default autocast: the file decides)
    assert {p.dtype for n, p in reloaded.named_parameters() if "sparse_values" in n} == {expected}
    explicit = get_peft_model(tiny_llama(dtype=base_dtype), SparseFTConfig(target_modules="all-linear", density=0.1, values_dtype="float64"),
                              autocast_adapter_dtype=autocast)  # fmt: skip
    assert {p.dtype for n, p in explicit.named_parameters() if "sparse_values" in n} == {torch.float64}


def test_values_stay_float32_over_bfloat16_base():
    model = get_peft_model(tiny_llama(dtype=torch.bfloat16), SparseFTConfig(target_modules="all-linear", density=0.1))
    dtypes = {p.dtype for n, p in model.named_parameters() if "sparse_values" in n}
    assert dtypes == {torch.float32}
    x = torch.randint(0, 97, (2, 5))
    model(x, labels=x).loss.backward()
    grads = {p.grad.dtype for n, p in model.named_parameters() if "sparse_values" in n}
    assert grads == {torch.float32}


def test_external_cast_of_values_is_restored_or_refused():
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["q_proj"], density=0.1))
    x = torch.randint(0, 97, (1, 5))
    # what TRL does to the trainable parameters of a quantized model
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    with pytest.warns(UserWarning, match="restored the configured values_dtype"):
        model(x)
    assert {p.dtype for n, p in model.named_parameters() if p.requires_grad} == {torch.float32}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.fill_(0.25)
                p.data = p.data.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="were cast to torch.bfloat16 outside peft_sparse"):
        model(x)


def test_random_init_is_seeded_per_module_and_magnitude_takes_largest():
    a = get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["q_proj", "v_proj"], density=0.1, seed=3))
    b = get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["v_proj", "q_proj"], density=0.1, seed=3))
    c = get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["q_proj", "v_proj"], density=0.1, seed=4))
    ia = [m.sparse_indices["default"] for m in a.modules() if hasattr(m, "sparse_indices")]
    ib = [m.sparse_indices["default"] for m in b.modules() if hasattr(m, "sparse_indices")]
    ic = [m.sparse_indices["default"] for m in c.modules() if hasattr(m, "sparse_indices")]
    assert all(torch.equal(x, y) for x, y in zip(ia, ib))
    assert not all(torch.equal(x, y) for x, y in zip(ia, ic))

    m = get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["q_proj"], density=0.25, init="magnitude"))
    for layer in (l for l in m.modules() if hasattr(l, "sparse_indices")):
        w = layer.logical_weight().abs().reshape(-1)
        chosen = layer.sparse_indices["default"].long()
        mask = torch.zeros_like(w, dtype=torch.bool)
        mask[chosen] = True
        assert w[mask].min() >= w[~mask].max()


def test_callable_init_is_used_and_saved_as_external(tmp_path):
    def importance(name, weight):
        scores = torch.zeros_like(weight)
        scores[0] = 1.0  # the whole first row
        return scores

    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["q_proj"], num_tunable_weights=64, init=importance))
    for layer in (l for l in model.modules() if hasattr(l, "sparse_indices")):
        assert torch.equal(layer.sparse_indices["default"].long(), torch.arange(32))
    model.save_pretrained(tmp_path)
    assert '"init": "external"' in (tmp_path / "adapter_config.json").read_text()


def test_importance_function_with_wrong_shape():
    with pytest.raises(ValueError, match=r"expected a tensor of shape \(32, 32\)"):
        get_peft_model(
            tiny_llama(),
            SparseFTConfig(target_modules=["q_proj"], density=0.1, init=lambda name, w: torch.zeros(3)),
        )


def test_layers_to_transform_and_exclude_modules():
    model = get_peft_model(
        tiny_llama(),
        SparseFTConfig(target_modules="all-linear", exclude_modules=["o_proj"], layers_to_transform=[1], density=0.1),
    )
    names = set(model.peft_config["default"].tunable_weights_per_module)
    assert names and all(".layers.1." in n and "o_proj" not in n for n in names)


def test_int64_indices_for_huge_matrices():
    from peft_sparse.core.layer import SparseLinear

    base = nn.Linear(2**16, 2**15 + 1, device="meta")
    layer = SparseLinear(base, "huge")
    layer.update_layer("default", torch.tensor([0, 2**31 + 5]), torch.float32)
    assert layer.sparse_indices["default"].dtype == torch.int64


def test_density_budget_rounds_to_whole_blocks():
    assert total_budget(10_000, 0.1, None, unit=256) == 1024  # 1000 weights → 3.9 blocks → 4 blocks
    with pytest.raises(ValueError, match="num_tunable_weights=1000 is not a multiple of the block size 256"):
        total_budget(10_000, None, 1000, unit=256)
    with pytest.raises(ValueError, match="leaves no whole block of 256 weights"):
        total_budget(10_000, 0.01, None, unit=256)
