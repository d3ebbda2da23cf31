"""Adapter file sizes and load times: the table "The main job's adapter" in docs/adapter-files.md.

    python benchmarks/adapter_files.py                 # SmolLM2-135M-Instruct, offline; a few minutes on CPU
    python benchmarks/adapter_files.py --loads 9 --out outputs/adapter-files

The adapter is the main job's (``recipes/smollm2_spiel.yaml``): SpIEL-AG over all 7 projections of every layer,
4,884,480 tunable weights (LoRA r16's count, 4.6% of the 106M targeted weights), built with that recipe's method
fields and the seeded random initial mask, values drawn at random (a file's size depends on counts and shapes, not
on the values; a trained mask's positions code to the same size as a random mask of the same per-tensor counts),
ages drawn from the recipe's reselection steps {0, 5, 25, 45}. Files written:

* ``lists/bitmaps + int32 ages``: the earlier format — each tensor's positions as the smaller of an int32 list and a
  bitmap (a bitmap everywhere at this density), float32 values, int32 ages always;
* ``default``: ``save_pretrained(dir)`` now — Elias–Fano positions where smallest (``index_storage="auto"``),
  float32 values, no ages;
* ``save_ages=True``: the same with the ages (uint8 for these steps);
* ``values_dtype="bfloat16"``: ``save_pretrained(dir, values_dtype="bfloat16", allow_lossy_cast=True)``;
* LoRA r16 (PEFT, the same modules: ``target_modules="all-linear"``), float32 and bfloat16.

Sizes are the files' bytes (MB = 10⁶ bytes); each sparse file's bytes are split into values, positions, ages and
the safetensors header. Load times: the median over ``--loads`` runs, interleaved across files, of (a) reading the
file and decoding every tensor's positions (``safetensors.load_file`` + ``peft_sparse.core.storage.decode``) and
(b) ``PeftModel.from_pretrained`` onto a fresh copy of the base model (the copy is made outside the timing).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]

COUNT = 4_884_480
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RESELECTION_STEPS = (0, 5, 25, 45)


def build_sparse(base):
    from peft import get_peft_model

    from peft_sparse import SparseLayer, SpIELConfig

    config = SpIELConfig(
        target_modules="all-linear", num_tunable_weights=COUNT, growth="ag", reselection_steps=20, gradient_estimation_steps=5,
        initial_reselection_rate=0.2, candidate_ratio=1.0, schedule="linear", budget_split="adaptive", seed=0,
    )  # fmt: skip
    model = get_peft_model(copy.deepcopy(base), config)
    g = torch.Generator().manual_seed(0)
    steps = torch.tensor(RESELECTION_STEPS, dtype=torch.int32)
    for layer in model.modules():
        if isinstance(layer, SparseLayer):
            values = layer.sparse_values["default"]
            with torch.no_grad():
                values.copy_(torch.randn(values.shape, generator=g) * 0.01)
            ages = layer.sparse_ages["default"]
            ages.copy_(steps[torch.randint(0, len(steps), ages.shape, generator=g)])
    assert sum(m.sparse_values["default"].numel() for m in model.modules() if isinstance(m, SparseLayer)) == COUNT
    return model


def build_lora(base, dtype):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False))
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(dtype)
    return model, count


def write_earlier_format(model, directory: Path) -> None:
    """The earlier format, byte for byte: bitmaps/lists and values as saved then, ages as int32."""
    from safetensors.torch import load_file, save_file

    model.peft_config["default"].index_storage = "bitmap"  # (what the earlier 'auto' chose at this density: checked in main)
    model.save_pretrained(directory, save_ages=True)
    model.peft_config["default"].index_storage = "auto"
    path = directory / "adapter_model.safetensors"
    tensors = load_file(path)
    for key in [k for k in tensors if k.endswith(".sparse_ages")]:
        tensors[key] = tensors[key].to(torch.int32)
    save_file(tensors, path, metadata={"format": "pt"})


def breakdown(directory: Path) -> dict:
    from safetensors import safe_open

    path = directory / "adapter_model.safetensors"
    parts = {"values": 0, "positions": 0, "ages": 0}
    with safe_open(path, "pt") as f:
        for key in f.keys():
            tensor = f.get_tensor(key)
            nbytes = tensor.numel() * tensor.element_size()
            part = "ages" if "sparse_ages" in key else "positions" if "sparse_index" in key else "values"
            parts[part] += nbytes
    total = os.path.getsize(path)
    parts["header"] = total - sum(parts.values())
    parts["total"] = total
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loads", type=int, default=7, help="timed loads per file (median reported)")
    parser.add_argument("--out", default="outputs/adapter-files", help="folder for the files and results.json")
    args = parser.parse_args()

    from peft import PeftModel
    from safetensors.torch import load_file

    from peft_sparse.assets import load_model_and_tokenizer
    from peft_sparse.core import storage

    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base, _ = load_model_and_tokenizer("smollm2-135m-instruct")
    base.eval()

    sparse = build_sparse(base)
    config = sparse.peft_config["default"]
    shapes = {n: s[0] * s[1] for n, s in config.module_shapes.items()}
    # the earlier 'auto' took the bitmap where it is smaller than the int32 list: at this density, everywhere
    if not all(-(-shapes[n] // 8) < 4 * c for n, c in config.tunable_weights_per_module.items()):
        raise RuntimeError("the earlier format would have stored some of these tensors as index lists")
    files = {
        "lists/bitmaps + int32 ages (earlier format)": out / "earlier",
        "default: Elias–Fano, float32, no ages": out / "default",
        "save_ages=True": out / "with-ages",
        "values_dtype='bfloat16'": out / "bf16",
    }
    write_earlier_format(sparse, files["lists/bitmaps + int32 ages (earlier format)"])
    sparse.save_pretrained(files["default: Elias–Fano, float32, no ages"])
    sparse.save_pretrained(files["save_ages=True"], save_ages=True)
    sparse.save_pretrained(files["values_dtype='bfloat16'"], values_dtype="bfloat16", allow_lossy_cast=True)
    del sparse
    lora_counts = {}
    for label, dtype in (("LoRA r16, float32", torch.float32), ("LoRA r16, bfloat16", torch.bfloat16)):
        lora, lora_counts[label] = build_lora(base, dtype)
        files[label] = out / label.replace(" ", "").replace(",", "-")
        lora.save_pretrained(files[label])
        del lora

    sizes = {label: breakdown(d) for label, d in files.items()}
    timed = [label for label in files if not label.startswith("LoRA")] + ["LoRA r16, float32"]
    read_times = {label: [] for label in timed}
    load_times = {label: [] for label in timed}
    for _ in range(args.loads):
        for label in timed:
            directory = files[label]
            start = time.perf_counter()
            tensors = load_file(directory / "adapter_model.safetensors")
            storage.decode(tensors)
            read_times[label].append(time.perf_counter() - start)
            fresh = copy.deepcopy(base)
            start = time.perf_counter()
            PeftModel.from_pretrained(fresh, str(directory))
            load_times[label].append(time.perf_counter() - start)
            del fresh

    lora_bytes = sizes["LoRA r16, float32"]["total"]
    rows = []
    for label in files:
        s = sizes[label]
        row = {"file": label, **{k: s[k] for k in ("values", "positions", "ages", "header", "total")}, "x_lora_fp32": s["total"] / lora_bytes}
        if label in read_times:
            row["read_decode_s"] = statistics.median(read_times[label])
            row["from_pretrained_s"] = statistics.median(load_times[label])
        rows.append(row)
    result = {
        "count": COUNT, "lora_counts": lora_counts, "loads": args.loads,
        "torch_threads": torch.get_num_threads(), "rows": rows,
        "entropy_bound_mb": sum(storage.entropy_bits(c, shapes[n]) for n, c in config.tunable_weights_per_module.items()) / 8e6,
    }  # fmt: skip
    (out / "results.json").write_text(json.dumps(result, indent=2))

    mb = lambda b: f"{b / 1e6:.2f}"  # noqa: E731
    print(f"trainable values: sparse {COUNT:,}; " + "; ".join(f"{k} {v:,}" for k, v in lora_counts.items()))
    print(f"information in the masks (log2 C(N, n) per tensor): {result['entropy_bound_mb']:.2f} MB\n")
    print("| file | values MB | positions MB | ages MB | header MB | total MB | × LoRA r16 fp32 | read + decode s | from_pretrained s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        times = f"{r['read_decode_s']:.3f} | {r['from_pretrained_s']:.2f}" if "read_decode_s" in r else "– | –"
        print(f"| {r['file']} | {mb(r['values'])} | {mb(r['positions'])} | {mb(r['ages'])} | {mb(r['header'])} | {mb(r['total'])} | {r['x_lora_fp32']:.2f} | {times} |")


if __name__ == "__main__":
    main()
