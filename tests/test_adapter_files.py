"""Adapter files: older files keep loading to identical models."""

import os

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from peft_sparse import SparseLayer

from .models import tiny_llama

FIXTURES = os.path.join(os.path.dirname(__file__), "data", "adapter_files")
OLD_FILES = ["sft_list", "sft_bitmap_bf16", "spiel_ages", "sft_blocks_list", "s4_masks"]


def _held(model, adapter_name: str = "default") -> dict:
    out = {}
    for layer in model.modules():
        if isinstance(layer, SparseLayer) and adapter_name in layer.sparse_values:
            name = layer.module_name
            out[f"{name}::indices"] = layer.sparse_indices[adapter_name]
            out[f"{name}::values"] = layer.sparse_values[adapter_name].detach()
            if adapter_name in layer.sparse_ages:
                out[f"{name}::ages"] = layer.sparse_ages[adapter_name]
            if adapter_name in layer.sparse_masks:
                out[f"{name}::masks"] = layer.sparse_masks[adapter_name]
    return out


def _assert_identical(expected: dict, held: dict) -> None:
    assert sorted(expected) == sorted(held)
    for key, tensor in expected.items():
        assert held[key].dtype == tensor.dtype and torch.equal(held[key], tensor), key


@pytest.mark.parametrize("name", OLD_FILES)
def test_files_of_the_list_and_bitmap_format_load_to_identical_models(name):
    """Files written by the format that stored positions as int32 lists or bitmaps and ages as int32 (committed in
    tests/data/adapter_files, with the tensors the model held when it saved them)."""
    directory = os.path.join(FIXTURES, name)
    expected = load_file(os.path.join(directory, "expected.safetensors"))
    model = PeftModel.from_pretrained(tiny_llama(), directory)
    _assert_identical(expected, _held(model))
