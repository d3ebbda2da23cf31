"""Writes the adapter files in this folder, in the file format of the code that runs it.

The committed files were written by the format that stored each tensor's positions as an int32 index list
(``sparse_indices``) or a bitmap (``sparse_index_bits``) and the SpIEL ages as int32 (``sparse_ages``). Each
folder holds the adapter (``adapter_config.json``, ``adapter_model.safetensors``) and ``expected.safetensors``:
the adapter's tensors as the model held them when it was saved (``<module>::indices``, ``::values``, ``::ages``,
``::masks``), which a load must reproduce bit for bit. Rerunning this script writes the current format instead,
so it is kept only to say how the files were made (base model: ``tests.models.tiny_llama()``).

    PYTHONPATH=. python tests/data/adapter_files/make_fixtures.py
"""

from __future__ import annotations

import os
import shutil

import torch
from peft import get_peft_model
from safetensors.torch import save_file

from peft_sparse import S4Config, SparseFTConfig, SparseLayer, SpIELConfig, build_s4_model
from tests.models import randomize_values, tiny_llama

HERE = os.path.dirname(os.path.abspath(__file__))


def _expected(model, adapter_name: str = "default") -> dict:
    out = {}
    for layer in model.modules():
        if isinstance(layer, SparseLayer) and adapter_name in layer.sparse_values:
            name = layer.module_name
            out[f"{name}::indices"] = layer.sparse_indices[adapter_name].clone()
            out[f"{name}::values"] = layer.sparse_values[adapter_name].detach().clone()
            if adapter_name in layer.sparse_ages:
                out[f"{name}::ages"] = layer.sparse_ages[adapter_name].clone()
            if adapter_name in layer.sparse_masks:
                out[f"{name}::masks"] = layer.sparse_masks[adapter_name].clone()
    return out


def _write(name: str, model) -> None:
    directory = os.path.join(HERE, name)
    shutil.rmtree(directory, ignore_errors=True)
    model.save_pretrained(directory)
    save_file(_expected(model), os.path.join(directory, "expected.safetensors"))
    os.remove(os.path.join(directory, "README.md"))  # (PEFT's model card: nothing a test reads)


def main() -> None:
    # SFT, index lists (density 0.02 < 1/32: 'auto' picks lists)
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.02, seed=3))
    randomize_values(model, seed=1)
    _write("sft_list", model)

    # SFT, bitmaps, bfloat16 values
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.3, index_storage="bitmap", values_dtype="bfloat16", seed=4))
    randomize_values(model, seed=2)
    _write("sft_bitmap_bf16", model)

    # SpIEL with per-index ages (auto: bitmaps at density 0.1), uneven counts (budget_split='lora')
    model = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.1, budget_split="lora", seed=5))
    randomize_values(model, seed=3)
    g = torch.Generator().manual_seed(7)
    for layer in model.modules():
        if isinstance(layer, SparseLayer):
            ages = layer.sparse_ages["default"]
            ages.copy_(torch.randint(0, 1000, ages.shape, generator=g, dtype=torch.int32))
    _write("spiel_ages", model)

    # SFT with (16, 16) blocks, index lists forced
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.25, block_shape=(16, 16), index_storage="list", seed=6))
    randomize_values(model, seed=4)
    _write("sft_blocks_list", model)

    # S⁴ masks of two languages (union of the masks; packed per-language rows)
    config = S4Config(target_modules="all-linear", density=0.05, languages=["a", "b"], importance_batches=1)
    masks = {}
    g = torch.Generator().manual_seed(11)
    base = tiny_llama()
    for lang in ("a", "b"):
        masks[lang] = {}
        for name, module in base.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                n = module.weight.numel()
                masks[lang][name] = torch.randperm(n, generator=g)[: max(1, n // 20)].sort().values
    model = build_s4_model(tiny_llama(), config, masks)
    randomize_values(model, seed=5)
    _write("s4_masks", model)


if __name__ == "__main__":
    main()
