"""How a saved adapter stores each tensor's indices: an index list or a bitmap, whichever is smaller.

The values are always stored compactly (one number per active weight, in index order). The positions are
either the sorted index list (``<module>.sparse_indices``, 4 bytes per active weight as int32) or a bitmap of
the whole tensor (``<module>.sparse_index_bits``, ⌈N/8⌉ bytes for an N-weight tensor, bit i of byte j is
position 8j + i). ``index_storage="auto"`` picks the bitmap when it is smaller, that is above density 1/32
with int32 indices (1/64 with int64): per million weights of a tensor at density p, the list costs
8p MB with float32 values and the bitmap 0.125 + 4p MB (p = 0.5: 4 MB against 2.125 MB; p = 0.01: 0.08 MB
against 0.165 MB). A dense delta tensor (4 MB per million) is never smaller than the bitmap with compact
values, so it is not offered.

Loading accepts both forms; everything that reads adapter files (PEFT loading, ``merge_sparse_adapters``,
``peft-sparse inspect``) goes through :func:`decode`, and reads the file through :func:`read_tensors` or
:func:`reading`, which name a damaged file instead of passing on safetensors' bare header error.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager

import torch

WEIGHTS_FILE = "adapter_model.safetensors"


@contextmanager
def reading(path):
    """Turn safetensors' errors while reading ``path`` (e.g. "Error while deserializing header: invalid JSON in
    header") into a ValueError that names the file and says what is wrong with it."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as exc:
        raise ValueError(
            f"{os.fspath(path)} is damaged or incomplete: it is not a readable safetensors file ({exc}); "
            "save the adapter again or copy it again from where it was saved"
        ) from None


def weights_path(adapter_dir) -> str:
    """The adapter directory's ``adapter_model.safetensors``; a clear error when it is missing."""
    path = os.path.join(adapter_dir, WEIGHTS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{os.fspath(adapter_dir)} holds no {WEIGHTS_FILE}")
    return path


def read_tensors(adapter_dir, device: str = "cpu") -> dict:
    """Every tensor of the adapter directory's ``adapter_model.safetensors``, as stored (see :func:`decode`)."""
    from safetensors.torch import load_file

    path = weights_path(adapter_dir)
    with reading(path):
        return load_file(path, device=device)

LIST, BITS = ".sparse_indices", ".sparse_index_bits"
CHOICES = ("auto", "list", "bitmap")


def pack(indices: torch.Tensor, numel: int) -> torch.Tensor:
    """Sorted flat indices of an ``numel``-weight tensor → its bitmap, (⌈numel/8⌉,) uint8."""
    bits = torch.zeros(math.ceil(numel / 8) * 8, dtype=torch.bool, device=indices.device)
    bits[indices.long()] = True
    weights = (2 ** torch.arange(8, device=indices.device)).to(torch.uint8)
    return (bits.view(-1, 8).to(torch.uint8) * weights).sum(-1).to(torch.uint8)


def unpack(bitmap: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bitmap → ascending flat indices of ``dtype``."""
    bits = (bitmap.unsqueeze(-1) >> torch.arange(8, device=bitmap.device, dtype=torch.uint8)) & 1
    return bits.reshape(-1).nonzero().flatten().to(dtype)


def use_bitmap(count: int, numel: int, index_bytes: int, storage: str) -> bool:
    if storage == "auto":
        return math.ceil(numel / 8) < count * index_bytes
    return storage == "bitmap"


def encode(state_dict: dict, numel_of, storage: str) -> dict:
    """Replace each ``…sparse_indices…`` entry of a state dict by a bitmap where ``storage`` says so. ``numel_of(key)``
    gives the weight count of the tensor an index entry belongs to."""
    if storage not in CHOICES:
        raise ValueError(f"index_storage must be one of {CHOICES}, got index_storage={storage!r}")
    out = {}
    for key, value in state_dict.items():
        if LIST + "." in key or key.endswith(LIST):
            numel = numel_of(key)
            if use_bitmap(value.numel(), numel, value.element_size(), storage):
                out[key.replace(LIST, BITS, 1)] = pack(value, numel)
                continue
        out[key] = value
    return out


def decode(state_dict: dict) -> dict:
    """Every ``…sparse_index_bits…`` entry back into its ``…sparse_indices…`` list (int32 below 2³¹ positions)."""
    out = {}
    for key, value in state_dict.items():
        if BITS in key:
            dtype = torch.int32 if value.numel() * 8 <= 2**31 else torch.int64
            out[key.replace(BITS, LIST, 1)] = unpack(value, dtype)
        else:
            out[key] = value
    return out
