"""PEFT's habits: ``target_modules=None`` targets what LoRA targets on each architecture, for every sparse config."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from peft_sparse import LTSFTConfig, S4Config, SparseFTConfig, SparseLayer, SpIELConfig, build_s4_model, detect_language_masks

from .models import MODELS, inputs, sparse_layers

CONFIGS = {
    "sft": lambda: SparseFTConfig(density=0.1),
    "spiel-ag": lambda: SpIELConfig(density=0.1),
    "spiel-ma": lambda: SpIELConfig(density=0.1, growth="ma"),
    "lt-sft": lambda: LTSFTConfig(density=0.1),
}


def _lora_targets(build) -> set:
    model = get_peft_model(build(), LoraConfig(r=2))
    return {name.removeprefix("base_model.model.") for name, m in model.named_modules() if hasattr(m, "lora_A") and not isinstance(m, torch.nn.ModuleDict)}


@pytest.mark.parametrize("kind", ["llama", "gpt2", "bert"])
@pytest.mark.parametrize("method", list(CONFIGS))
def test_target_modules_none_targets_what_lora_targets(kind, method):
    build = MODELS[kind][0]
    config = CONFIGS[method]()
    assert config.target_modules is None
    model = get_peft_model(build(), config)
    adapted = {layer.module_name for layer in sparse_layers(model)}
    assert adapted and adapted == _lora_targets(build)
    # the resolved targets are recorded in the config, so a saved adapter rebuilds the same modules
    lora = get_peft_model(build(), LoraConfig(r=2)).peft_config["default"].target_modules
    assert model.peft_config["default"].target_modules == lora
    with torch.no_grad():
        model(inputs())


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_s4_with_target_modules_none_targets_what_lora_targets(kind):
    build = MODELS[kind][0]
    config = S4Config(density=0.2, languages=["a", "b"], importance_batches=1)
    loaders = {lang: [{"input_ids": inputs(seed=s), "labels": inputs(seed=s)}] for s, lang in enumerate(["a", "b"])}
    masks = detect_language_masks(build(), loaders, config)
    model = build_s4_model(build(), config, masks)
    assert {layer.module_name for layer in sparse_layers(model)} == _lora_targets(build)


@pytest.mark.parametrize("method", list(CONFIGS))
def test_target_modules_none_on_an_architecture_without_defaults_says_what_to_pass(method):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"target_modules=None.*model_type='custom'.*target_modules='all-linear'"):
        get_peft_model(model, CONFIGS[method]())
    assert not any(isinstance(m, SparseLayer) for m in model.modules())
