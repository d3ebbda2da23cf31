"""Loading and merging sparse adapters of any sparse method, side by side.

Every sparse method saves the same tensors per module — ``sparse_indices`` and ``sparse_values``
(SpIEL adds ``sparse_ages``) — so an adapter trained by one method can be loaded as another sparse
type. PEFT holds adapters of one PEFT type per model; :func:`load_sparse_adapter` re-expresses the
saved config as the model's type (``"SFT"`` by default), which lets adapters trained by different
sparse methods be composed, switched and merged in one model.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from typing import Optional, Union

from peft import PeftModel, get_peft_model
from ..registry import PEFT_TYPE_TO_CONFIG_MAPPING
import torch
from peft.utils import load_peft_weights, set_peft_model_state_dict
from torch import nn

from . import storage
from .config import SparseConfig, read_adapter_config
from .base import add_delta_to_base, index_dtype, logical_shape, supported_base_layer
from .experts import ParameterSlice, SparseSlice, logical_name, parameter_slice
from .layer import SparseLayer
from .selection import check_sparse_tensors

PathLike = Union[str, os.PathLike]


def _sparse_config_class(peft_type: str, where: str):
    config_cls = PEFT_TYPE_TO_CONFIG_MAPPING.get(peft_type)
    if config_cls is None or not issubclass(config_cls, SparseConfig):
        raise ValueError(f"{where}: peft_type={peft_type!r} is not a sparse adapter (did you import peft_sparse?)")
    return config_cls


def convert_config(config: SparseConfig, peft_type: str) -> SparseConfig:
    """The same sparse adapter (targets, exact per-module counts, dtype) as a config of ``peft_type``.

    The indices are not reproducible from the converted config, so it carries ``init='external'``:
    the adapter weights must be loaded into it.
    """
    config_cls = _sparse_config_class(str(peft_type), "convert_config")
    if config.tunable_weights_per_module is None:
        raise ValueError("convert_config needs a config of a created or saved adapter (tunable_weights_per_module is None)")
    return config_cls(**config.sparse_fields(), init="external")


def load_sparse_adapter(
    model: nn.Module,
    adapter_dir: PathLike,
    adapter_name: str = "default",
    is_trainable: bool = False,
    as_type: Optional[str] = None,
) -> PeftModel:
    """Load a saved sparse adapter of any sparse method into ``model``.

    ``model`` is a base model (a ``PeftModel`` is created) or a ``PeftModel`` holding sparse adapters
    (the adapter is added beside them, their trainability left as it was). The adapter is loaded as
    ``as_type`` — by default the existing ``PeftModel``'s type, else ``"SFT"`` — whatever method trained
    it. Per-index ages of dynamic methods are dropped when the target type keeps none.
    """
    raw = read_adapter_config(adapter_dir)
    saved_cls = _sparse_config_class(raw.get("peft_type"), str(adapter_dir))
    saved = saved_cls.from_pretrained(str(adapter_dir))
    if as_type is None:
        as_type = str(model.peft_type.value if hasattr(model.peft_type, "value") else model.peft_type) if isinstance(model, PeftModel) else "SFT"
    config = convert_config(saved, as_type)
    config.inference_mode = not is_trainable
    if isinstance(model, PeftModel):
        model.add_adapter(adapter_name, config)
    else:
        model = get_peft_model(model, config, adapter_name=adapter_name)
    with storage.reading(os.path.join(adapter_dir, storage.WEIGHTS_FILE)):
        state_dict = load_peft_weights(str(adapter_dir))
    keeps_ages = any(adapter_name in getattr(m, "sparse_ages", {}) for m in model.modules())
    if not keeps_ages:
        state_dict = {k: v for k, v in state_dict.items() if ".sparse_ages" not in k}
    result = set_peft_model_state_dict(model, state_dict, adapter_name=adapter_name)
    unexpected = [k for k in result.unexpected_keys if adapter_name in k.split(".")]
    if unexpected:
        raise ValueError(f"{adapter_dir}: entries that fit no module of the model: {unexpected[:5]}")
    if not is_trainable:
        model.base_model.set_requires_grad(adapter_name, False)
    return model


def merge_sparse_adapters(model: nn.Module, adapter_dirs: Sequence[PathLike], weights: Optional[Sequence[float]] = None) -> nn.Module:
    """θ ← θ + Σ wᵢ·δᵢ straight from saved adapter files, for a plain (non-PEFT) model, in place.

    Works for adapters of any sparse method and mixes them freely; no adapter modules are created.
    """
    weights = [1.0] * len(adapter_dirs) if weights is None else list(weights)
    if len(weights) != len(adapter_dirs):
        raise ValueError(f"got {len(adapter_dirs)} adapters but {len(weights)} weights")
    if isinstance(model, PeftModel):
        raise TypeError("merge_sparse_adapters merges into a plain model; for a PeftModel use merge_and_unload")
    for adapter_dir, weight in zip(adapter_dirs, weights):
        raw = read_adapter_config(adapter_dir)
        config = _sparse_config_class(raw.get("peft_type"), str(adapter_dir)).from_pretrained(str(adapter_dir))
        if config.modules_to_save:
            raise ValueError(
                f"{adapter_dir}: modules_to_save={config.modules_to_save} are dense; load the adapter with "
                "PeftModel.from_pretrained and merge_and_unload instead"
            )
        tensors = storage.decode(storage.read_tensors(adapter_dir))
        counts = config.tunable_weights_per_module or {}
        suffix = ".sparse_indices"
        seen = set()
        from tqdm.auto import tqdm

        for key, indices in tqdm(tensors.items(), desc=f"merging {os.path.basename(str(adapter_dir))}", unit="tensor", disable=None, leave=False):
            if not key.endswith(suffix):
                continue
            module_name = logical_name(key.removeprefix("base_model.model.")[: -len(suffix)])
            values = tensors.get(key[: -len(suffix)] + ".sparse_values")
            where = f"{adapter_dir}: {module_name}"
            if values is None:
                raise ValueError(f"{where}: indices without values")
            module = parameter_slice(model, module_name)  # (a parameter, or an expert of one: target_parameters)
            try:
                module = module if module is not None else model.get_submodule(module_name)
            except AttributeError:
                raise ValueError(f"{where}: the model has no such module") from None
            if not supported_base_layer(module) and not isinstance(module, ParameterSlice):
                raise TypeError(f"{where}: cannot merge into a {type(module).__name__}")
            out_features, in_features = logical_shape(module)
            numel = out_features * in_features
            check_sparse_tensors(
                where, indices, values, numel, expected_count=counts.get(module_name), index_dtype=index_dtype(numel)
            )
            device = module.weight.device
            add_delta_to_base(module, indices.to(device), values.to(device), float(weight), safe=True, what=where)
            seen.add(module_name)
        missing = sorted(set(counts) - seen)
        if missing:
            raise ValueError(f"{adapter_dir}: the config lists modules with no tensors in the file: {missing[:5]}")
    return model


def adapter_file_summary(adapter_dir: PathLike) -> dict:
    """Method, per-module counts and densities, and file size of a saved sparse adapter."""
    raw = read_adapter_config(adapter_dir)
    _sparse_config_class(raw.get("peft_type"), str(adapter_dir))
    path = storage.weights_path(adapter_dir)
    raw_tensors = storage.read_tensors(adapter_dir)
    tensors = storage.decode(raw_tensors)
    shapes = raw.get("module_shapes") or {}
    modules = {}
    for key, indices in tensors.items():
        if key.endswith(".sparse_indices"):
            name = logical_name(key.removeprefix("base_model.model.")[: -len(".sparse_indices")])
            shape = shapes.get(name)
            modules[name] = {
                "count": int(indices.numel()),
                "shape": shape,
                "density": indices.numel() / (shape[0] * shape[1]) if shape else None,
                "index_dtype": str(indices.dtype).removeprefix("torch."),
                "index_storage": storage.storage_form(raw_tensors, key),
            }
    return {
        "peft_type": raw["peft_type"],
        "base_model": raw.get("base_model_name_or_path"),
        "num_tunable_weights": sum(m["count"] for m in modules.values()),
        "modules": modules,
        "file_bytes": os.path.getsize(path),
        "tensors": tensors,
    }


def add_weighted_adapter(tuner, adapters: list[str], weights: list[float], adapter_name: str) -> None:
    """``tuner.add_weighted_adapter``: a new adapter δ = Σ wᵢ·δᵢ, on each sparse layer the union of the indices
    with the weighted values summed.

    Its config is the first adapter's, with ``init='external'``, exactly the layers the adapters hold (their modules
    as ``target_modules``, their parameters as ``target_parameters``) and the union's exact counts; it is saved and
    loaded like any other adapter. Merging it (``merge_and_unload(adapter_names=[name])``) gives θ + Σ wᵢ·δᵢ.
    """
    if not adapters:
        raise ValueError("adapters must name at least one adapter")
    if len(weights) != len(adapters):
        raise ValueError(f"got {len(adapters)} adapters but {len(weights)} weights")
    for name in adapters:
        if name not in tuner.peft_config:
            raise ValueError(f"adapter {name!r} does not exist; existing adapters: {sorted(tuner.peft_config)}")
        if tuner.peft_config[name].modules_to_save:
            raise ValueError(
                f"adapter {name!r} has modules_to_save={tuner.peft_config[name].modules_to_save}; dense modules "
                "cannot be combined into a sparse adapter"
            )
    if adapter_name in tuner.peft_config:
        raise ValueError(f"adapter {adapter_name!r} already exists")

    composed: dict[str, tuple[SparseLayer, torch.Tensor, torch.Tensor]] = {}
    for layer in tuner.model.modules():
        if not isinstance(layer, SparseLayer):
            continue
        present = [(a, w) for a, w in zip(adapters, weights) if a in layer.sparse_values]
        if not present:
            continue
        idx = torch.cat([layer.sparse_indices[a].long() for a, _ in present])
        val = torch.cat([float(w) * layer.sparse_values[a].detach().double() for a, w in present])
        union, inverse = torch.unique(idx, sorted=True, return_inverse=True)
        summed = torch.zeros(union.numel(), dtype=torch.float64, device=val.device).index_add_(0, inverse, val)
        composed[layer.module_name] = (layer, union, summed)

    first = tuner.peft_config[adapters[0]]
    counts = {name: int(union.numel()) for name, (_, union, _) in composed.items()}
    modules = [n for n, (layer, _, _) in composed.items() if not isinstance(layer, SparseSlice)]
    parameters = sorted({layer.parameter_key for layer, _, _ in composed.values() if isinstance(layer, SparseSlice)})
    config = dataclasses.replace(
        first,
        init="external",
        target_modules="|".join(re.escape(n) for n in modules) if modules else None,  # exactly these modules
        target_parameters=parameters or None,  # and these parameters
        exclude_modules=None,
        layers_to_transform=None,
        layers_pattern=None,
        modules_to_save=None,
        density=None,
        num_tunable_weights=sum(counts.values()),
        tunable_weights_per_module=counts,
        inference_mode=True,
    )
    tuner.peft_config[adapter_name] = config
    tuner.inject_adapter(tuner.model, adapter_name)
    for layer, union, summed in composed.values():
        layer.sparse_indices[adapter_name] = union.to(index_dtype(layer.numel))
        values = layer.sparse_values[adapter_name]
        values.data = summed.to(device=values.device, dtype=values.dtype)
        layer._indices_pending.discard(adapter_name)
    tuner.set_adapter(tuner.active_adapters, inference_mode=True)
