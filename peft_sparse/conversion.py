r"""A sparse adapter as a LoRA, for engines that serve LoRA adapters (vLLM, TGI, SGLang) and not sparse deltas.

Each adapted weight's delta ΔW = scatter(η, φ) is exact; PEFT's ``convert_to_lora`` factors it by a truncated SVD,

.. math::
    \Delta W = U \Sigma V^\top \approx B A, \qquad B = U_{:, :r}\,\Sigma_{:r},\quad A = V^\top_{:r, :},

so only the truncation is lossy: the relative error of one weight is
:math:`\sqrt{\sum_{i>r}\sigma_i^2 / \sum_i \sigma_i^2}`, zero once r reaches the rank of ΔW. A sparse delta is
usually of high rank (its d_φ entries are scattered over the whole matrix), so a LoRA of small r keeps only the
largest directions of it; merging (``merge_and_unload``) remains the exact route to a dense model.

:func:`convert_to_lora` is PEFT's ``convert_to_lora`` (same arguments, same rank semantics: an ``int`` rank for every
layer, or a ``float`` in (0, 1] as the share of each layer's squared singular values to keep), plus:

* sparse embeddings (``nn.Embedding``) are converted too, their factors written in LoRA's embedding layout
  (``lora_embedding_A`` (r, num_embeddings), ``lora_embedding_B`` (embedding_dim, r)), which LoRA loads;
* the LoRA config keeps the adapter's ``task_type``;
* an adapter name the model does not hold, and layers that hold no additive weight delta (MAD-G's and bottleneck
  adapters: a non-linear function of the hidden state), are refused with an error naming them.

PEFT's own ``peft.convert_to_lora`` works on the same models when no embedding is adapted; with one it refuses
(``SparseEmbedding`` does not support LoRA conversion), as it does for LoRA's own embeddings.
"""

from __future__ import annotations

import os
import pathlib
from typing import Union

import torch
from peft import LoraConfig
from peft.tuners.lora.conversion import convert_to_lora as _peft_convert_to_lora
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import SAFETENSORS_WEIGHTS_NAME

from .core.embedding import SparseEmbedding, lora_embedding_factors
from .core.layer import SparseLayer

__all__ = ["convert_to_lora", "save_as_lora"]


def _check(model: torch.nn.Module, adapter_name: str) -> None:
    configs = getattr(model, "peft_config", None)
    held = sorted({a for m in model.modules() if isinstance(m, SparseLayer) for a in m.sparse_values})
    if configs is not None and adapter_name not in configs:
        raise ValueError(f"convert_to_lora: adapter_name={adapter_name!r} is not an adapter of this model; it holds {sorted(configs)}")
    if configs is None and adapter_name not in held:
        raise ValueError(f"convert_to_lora: no sparse layer holds adapter_name={adapter_name!r}; the sparse layers hold {held}")
    from .core.experts import SparseParameter

    experts = [n for n, m in model.named_modules() if isinstance(m, SparseParameter)]
    if experts:
        raise TypeError(
            f"convert_to_lora: the adapter reaches parameters through target_parameters (e.g. {experts[0]!r}), and PEFT's "
            "LoRA conversion writes modules only (its own LoRA on parameters cannot be converted either); merge the adapter "
            "instead (merge_and_unload), the exact route"
        )
    other = [(n, type(m).__name__) for n, m in model.named_modules() if isinstance(m, BaseTunerLayer) and not isinstance(m, SparseLayer)]
    other = [(n, t) for n, t in other if not model.get_submodule(n).supports_lora_conversion(adapter_name)]
    if other:
        kinds = sorted({t for _, t in other})
        raise TypeError(
            f"convert_to_lora: {len(other)} adapted modules hold no additive weight delta W' = W + ΔW, so no LoRA equals "
            f"them (types {kinds}, e.g. {other[0][0]!r}); MAD-G's and bottleneck adapters compute a non-linear function "
            "of the hidden state"
        )


@torch.no_grad()
def convert_to_lora(
    model: torch.nn.Module, rank: Union[int, float], adapter_name: str = "default", progressbar: bool = False, compile_kwargs=None
) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """The adapter ``adapter_name`` of ``model`` as a LoRA: ``(LoraConfig, state_dict)``, loadable with
    ``set_peft_model_state_dict(get_peft_model(base, lora_config), state_dict)`` (module docstring: what is exact and
    what is not). ``rank``: an ``int`` for every layer, or a ``float`` in (0, 1] — the share of each layer's squared
    singular values to keep (PEFT's semantics; per-layer ranks go into ``rank_pattern``)."""
    _check(model, adapter_name)
    with lora_embedding_factors():
        lora_config, state_dict = _peft_convert_to_lora(
            model, rank=rank, adapter_name=adapter_name, progressbar=progressbar, compile_kwargs=compile_kwargs
        )
    for name, module in model.named_modules():
        if isinstance(module, SparseEmbedding) and f"{name}.lora_A.weight" in state_dict:
            # PEFT writes ΔE ≈ lora_B @ lora_A, (V, r) @ (r, H); LoRA's embedding adds (B_e @ A_e)ᵀ with A_e (r, V), B_e (H, r)
            lora_a, lora_b = state_dict.pop(f"{name}.lora_A.weight"), state_dict.pop(f"{name}.lora_B.weight")
            state_dict[f"{name}.lora_embedding_A"] = lora_b.t().contiguous()
            state_dict[f"{name}.lora_embedding_B"] = lora_a.t().contiguous()
    config = getattr(model, "peft_config", {}).get(adapter_name)
    if config is not None:
        lora_config.task_type = config.task_type
    return lora_config, state_dict


def save_as_lora(
    path: Union[str, os.PathLike], model: torch.nn.Module, rank: Union[int, float], adapter_name: str = "default",
    progressbar: bool = False, compile_kwargs=None,
) -> None:  # fmt: skip
    """:func:`convert_to_lora`, written as a LoRA adapter directory (``adapter_config.json`` and
    ``adapter_model.safetensors``) that ``PeftModel.from_pretrained`` and LoRA-serving engines load."""
    from safetensors.torch import save_file

    lora_config, state_dict = convert_to_lora(model, rank, adapter_name=adapter_name, progressbar=progressbar, compile_kwargs=compile_kwargs)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state_dict, str(path / SAFETENSORS_WEIGHTS_NAME))
    lora_config.save_pretrained(str(path))
