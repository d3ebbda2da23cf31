"""Which modules an adapter targets: PEFT's matching, its default target modules per architecture, and the
model configs that may tie word embeddings."""

from __future__ import annotations

import re
from typing import Iterator, Optional

from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from torch import nn

from ..registry import ExcludedModule
from .config import SparseConfig


def _display_name(key: str) -> str:
    return key.removeprefix("base_model.model.")


def _layer_index(config: SparseConfig, key: str) -> Optional[int]:
    """Index of the transformer layer ``key`` lies in (PEFT's rule: the first numbered segment)."""
    patterns = config.layers_pattern
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        match = None
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
            if match:
                break
    return int(match["idx"]) if match else None


def target_matches(config: SparseConfig, key: str):
    """PEFT's matching, plus ``layers_to_transform`` applied to exact-name matches too.

    PEFT checks the layer index only for suffix matches, so after ``'all-linear'`` expands into full
    module names it would silently ignore ``layers_to_transform``.
    """
    result = check_target_module_exists(config, key)
    if result and not isinstance(result, ExcludedModule) and config.layers_to_transform is not None:
        wanted = config.layers_to_transform
        wanted = [wanted] if isinstance(wanted, int) else wanted
        if _layer_index(config, key) not in wanted:
            return False
    return result


def resolve_default_targets(config: SparseConfig, model_type: Optional[str]) -> SparseConfig:
    """``target_modules=None``: PEFT's default target modules for the architecture, the same as LoRA's
    (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``); a clear error where PEFT has none. With
    ``target_parameters`` set, None means no module (as for LoRA)."""
    if config.target_modules is None and not config.target_parameters:
        defaults = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
        if defaults is None:
            raise ValueError(
                f"{type(config).__name__}: target_modules=None, and PEFT has no default target modules for "
                f"model_type={model_type!r}. Pass target_modules='all-linear' (recommended: every linear layer "
                "but the output head) or the names of the modules to adapt, e.g. target_modules=['q_proj', 'v_proj']"
            )
        config.target_modules = defaults if isinstance(defaults, str) else set(defaults)
    return config


def _without_base_layers(name: str) -> str:
    """A module name as the model had it before any adapter wrapped it (PEFT's rule: every ".base_layer" removed)."""
    while ".base_layer" in name:
        prefix, _, suffix = name.rpartition(".base_layer")
        name = prefix + suffix
    return name


def parameter_targets(config: SparseConfig, model: nn.Module, skip: tuple = ()) -> Iterator[tuple[str, nn.Module, str]]:
    """(key, owning module, parameter name) of every parameter ``config.target_parameters`` names, in model order:
    the key is the parameter's name in the unwrapped model, matched exactly or as a suffix as PEFT matches it;
    ``layers_to_transform`` applies to it as to module names. Modules under the names in ``skip`` (sparse layers)
    are not searched but for the module each wraps, whose parameters other than the adapted weight (its bias) may
    be targeted."""
    targets = config.target_parameters or []
    for module_name, module in model.named_modules():
        inside = [s for s in skip if module_name == s or module_name.startswith(s + ".")]
        if inside and not all(_is_base_chain(module_name, s) for s in inside):
            continue  # (an adapter layer's own tensors)
        unwrapped = _without_base_layers(module_name)
        for name, _ in module.named_parameters(recurse=False):
            key = f"{unwrapped}.{name}" if unwrapped else name
            if not (key in targets or any(key.endswith(f".{t}") for t in targets)):
                continue
            if inside and name == "weight":
                raise ValueError(
                    f"target_parameters names {key!r}, the weight of a module that target_modules adapts already: "
                    "adapt it one way, e.g. leave it out of target_parameters (a bias may be named beside it)"
                )
            if config.layers_to_transform is not None:
                wanted = config.layers_to_transform
                if _layer_index(config, key) not in ([wanted] if isinstance(wanted, int) else wanted):
                    continue
            yield key, module, name


def _is_base_chain(module_name: str, layer_name: str) -> bool:
    """Whether ``module_name`` is the module ``layer_name``'s sparse layer wraps (``<layer>.base_layer``, repeated)."""
    rest = module_name[len(layer_name):]
    return rest != "" and rest.replace(".base_layer", "") == ""


def _model_configs(model: nn.Module) -> list:
    """The transformers configs of ``model`` that may say ``tie_word_embeddings`` (the model's and its text config)."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    configs = [config]
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    if text is not None and text is not config:
        configs.append(text)
    return configs
