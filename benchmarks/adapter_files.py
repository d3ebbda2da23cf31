"""Adapter file sizes, load times and decoding throughput: the tables of docs/adapter-files.md.

    python benchmarks/adapter_files.py --before 325440a     # SmolLM2-135M-Instruct, offline, CPU
    python benchmarks/adapter_files.py --adapter outputs/smollm2-spiel/checkpoint-60 --before 325440a

The adapter is the main job's (``recipes/smollm2_spiel.yaml``): SpIEL-AG over all 7 projections of every layer,
4,884,480 tunable weights (LoRA r16's count, 4.6% of the 106M targeted weights). By default it is built with that
recipe's method fields and seeded random initial mask, values drawn at random and ages drawn from the recipe's
reselection steps {0, 5, 25, 45} (a file's size depends on each tensor's count and shape, not on the values or on
where the positions lie). ``--adapter DIR`` takes a trained one instead: a Trainer checkpoint folder of the main job
(its ages come from the SpIEL scheduler state saved there). Files written under ``--out``:

* ``lists/bitmaps + int32 ages``: the earlier format — each tensor's positions as the smaller of an int32 list and a
  bitmap (a bitmap everywhere at this density), float32 values, int32 ages always;
* ``default``: ``save_pretrained(dir)`` now — Elias–Fano positions where smallest (``index_storage="auto"``),
  float32 values, no ages;
* ``save_ages=True``: the same with the ages (uint8 for these steps);
* ``values_dtype='bfloat16'``: ``save_pretrained(dir, values_dtype="bfloat16", allow_lossy_cast=True)``;
* LoRA r16 (PEFT, the same modules: ``target_modules="all-linear"``), float32 and bfloat16.

Sizes are the files' bytes (MB = 10⁶ bytes), split into values, positions, ages and the safetensors header.

Timings run in fresh processes, ``--rounds`` of them per code version, alternating: the current code on every
sparse file and LoRA's, and with ``--before REF`` the code of git revision REF (its ``peft_sparse`` exported with
``git archive``) on the earlier-format file — what loading cost before this format. Each process runs on
``--threads`` torch threads (default 1) and records the process's CPU time (``time.process_time``: on a host shared
with other work it counts this process's work alone) beside the wall time, of

* read + decode: ``safetensors.load_file`` + ``peft_sparse.core.storage.decode``, ``--loads`` times per round;
* decode alone, the file's tensors in memory, ``--loads`` times per round, against a memcpy of the same bytes: a
  ``clone()`` of every decoded index tensor as int64. Throughput is the bytes of the decoded indices as int64
  (8 per index) per second;
* ``PeftModel.from_pretrained`` onto a fresh copy of the base model (the copy made outside the timing), once per
  round;
* a sweep: 30 tensors of 1536 × 576 weights (the model's MLP shape) at densities 0.1%, 1%, 4.6% and 20%, each form
  the code offers, decode against memcpy as above.

Reported: medians over all rounds. Everything goes into one JSONL file (``--results``; one row per file, per sweep
cell and one for the run) and the tables are printed in Markdown.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

COUNT = 4_884_480
RESELECTION_STEPS = (0, 5, 25, 45)
SWEEP_DENSITIES = (0.001, 0.01, 0.046, 0.2)
SWEEP_SHAPE, SWEEP_TENSORS = (1536, 576), 30
EARLIER = "lists/bitmaps + int32 ages (earlier format)"
DEFAULT = "default: Elias–Fano, float32, no ages"
LORA = "LoRA r16, float32"


# ------------------------------------------------------------------------------------------------ the files
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
    return model


def load_trained(base, directory: Path):
    """A trained SpIEL adapter (a Trainer checkpoint folder), with the ages its scheduler state holds."""
    from peft import PeftModel

    from peft_sparse import SparseLayer
    from peft_sparse.methods.spiel.state import saved_ages

    model = PeftModel.from_pretrained(copy.deepcopy(base), str(directory), is_trainable=True)
    ages = saved_ages(str(directory))
    if not ages:
        raise SystemExit(f"--adapter {directory}: no SpIEL scheduler state with ages there (a Trainer checkpoint folder holds one)")
    for layer in model.modules():
        if isinstance(layer, SparseLayer):
            layer.sparse_ages["default"].copy_(ages[layer.module_name])
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
    """The earlier format: bitmaps (what its 'auto' chose at this density: checked in main), values as saved then,
    ages as int32."""
    from safetensors.torch import load_file, save_file

    config = model.peft_config["default"]
    config.index_storage = "bitmap"
    model.save_pretrained(directory, save_ages=True)
    config.index_storage = "auto"
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
            part = "ages" if "sparse_ages" in key else "positions" if "sparse_index" in key else "values"
            parts[part] += tensor.numel() * tensor.element_size()
    total = os.path.getsize(path)
    return {**parts, "header": total - sum(parts.values()), "total": total}


# ------------------------------------------------------------------------------------------------ timing (a fresh process)
def _clocks(action) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    action()
    return time.process_time() - cpu, time.perf_counter() - wall


def _decode_and_copy(storage, tensors: dict, loads: int) -> dict:
    """Decode ``tensors`` ``loads`` times, and clone their decoded indices as int64 as often (interleaved)."""
    decoded = storage.decode(tensors)
    indices = [v.to(torch.int64) for k, v in decoded.items() if ".sparse_indices" in k]
    decode, memcpy = [], []
    for _ in range(loads):
        decode.append(_clocks(lambda: storage.decode(tensors)))
        memcpy.append(_clocks(lambda: [t.clone() for t in indices]))
    return {"index_bytes_int64": 8 * sum(t.numel() for t in indices), "decode": decode, "memcpy": memcpy}


def worker(spec: dict) -> dict:
    """Timings of the code first on sys.path (see the module docstring); returns lists of (cpu, wall) seconds."""
    from peft import PeftModel
    from safetensors.torch import load_file

    import peft_sparse
    from peft_sparse.assets import load_model_and_tokenizer
    from peft_sparse.core import storage

    torch.set_num_threads(spec["threads"])
    files = {label: Path(d) for label, d in spec["files"].items()}
    out = {"code": str(Path(peft_sparse.__file__).parent.parent), "files": {}, "sweep": []}
    for label in files:
        out["files"][label] = {"read_decode": [], "from_pretrained": []}
    for _ in range(spec["loads"]):
        for label, d in files.items():
            out["files"][label]["read_decode"].append(_clocks(lambda: storage.decode(load_file(d / "adapter_model.safetensors"))))
    for label, d in files.items():
        if not label.startswith("LoRA"):
            out["files"][label].update(_decode_and_copy(storage, load_file(d / "adapter_model.safetensors"), spec["loads"]))
    base, _ = load_model_and_tokenizer("smollm2-135m-instruct")
    base.eval()
    for _ in range(spec["model_loads"]):
        for label, d in files.items():
            fresh = copy.deepcopy(base)
            out["files"][label]["from_pretrained"].append(_clocks(lambda: PeftModel.from_pretrained(fresh, str(d))))
            del fresh
    if spec["sweep"]:
        numel = SWEEP_SHAPE[0] * SWEEP_SHAPE[1]
        for density in SWEEP_DENSITIES:
            g = torch.Generator().manual_seed(0)
            lists = {
                f"base_model.model.t{i}.sparse_indices": torch.randperm(numel, generator=g)[: round(numel * density)].sort().values.to(torch.int32)
                for i in range(SWEEP_TENSORS)
            }  # fmt: skip
            for form in [f for f in storage.CHOICES if f not in ("auto", "list")]:
                tensors = storage.encode(lists, lambda key: numel, form)
                row = _decode_and_copy(storage, tensors, spec["loads"])
                row.update(density=density, form=form, stored_bytes=sum(t.numel() * t.element_size() for t in tensors.values()))
                out["sweep"].append(row)
    return out


def run_worker(code_root: Path, spec: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "PYTHONPATH": str(code_root)}
        subprocess.run([sys.executable, __file__, "--worker", str(spec_path), str(result_path)], env=env, check=True)
        return json.loads(result_path.read_text())


def export_code(ref: str, directory: Path) -> Path:
    """``peft_sparse`` at git revision ``ref`` of this repository, exported into ``directory``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "peft_sparse"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive, check=True)
    return directory


# ------------------------------------------------------------------------------------------------ main
def _median(samples, which: int) -> float:
    return statistics.median(s[which] for s in samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--adapter", type=Path, help="a trained main-job adapter: a Trainer checkpoint folder (default: built, see above)")
    parser.add_argument("--before", metavar="REF", help="also time the earlier-format file with peft_sparse at this git revision")
    parser.add_argument("--rounds", type=int, default=3, help="timing processes per code version, alternating")
    parser.add_argument("--loads", type=int, default=5, help="reads + decodes (and decodes alone) per file per round")
    parser.add_argument("--model-loads", type=int, default=1, help="PeftModel.from_pretrained per file per round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads while timing")
    parser.add_argument("--out", type=Path, default=Path("outputs/adapter-files"), help="folder for the files")
    parser.add_argument("--results", type=Path, help="the JSONL file (default benchmarks/results/<date>-cpu-adapter-files.jsonl)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec_path, result_path = args.worker
        Path(result_path).write_text(json.dumps(worker(json.loads(Path(spec_path).read_text()))))
        return
    sys.path[:0] = [str(ROOT)]

    from peft_sparse import SparseLayer
    from peft_sparse.assets import load_model_and_tokenizer
    from peft_sparse.core import storage

    torch.manual_seed(0)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    base, _ = load_model_and_tokenizer("smollm2-135m-instruct")
    base.eval()

    sparse = load_trained(base, args.adapter) if args.adapter else build_sparse(base)
    config = sparse.peft_config["default"]
    counts = config.tunable_weights_per_module
    if sum(counts.values()) != COUNT:
        raise SystemExit(f"the adapter holds {sum(counts.values()):,} tunable weights, the main job's holds {COUNT:,}")
    shapes = {n: s[0] * s[1] for n, s in config.module_shapes.items()}
    # the earlier 'auto' took the bitmap where it is smaller than the int32 list: at this density, everywhere
    if not all(-(-shapes[n] // 8) < 4 * c for n, c in counts.items()):
        raise SystemExit("the earlier format would have stored some of these tensors as index lists")
    files = {
        EARLIER: out / "earlier",
        DEFAULT: out / "default",
        "save_ages=True": out / "with-ages",
        "values_dtype='bfloat16'": out / "bf16",
    }
    write_earlier_format(sparse, files[EARLIER])
    sparse.save_pretrained(files[DEFAULT])
    sparse.save_pretrained(files["save_ages=True"], save_ages=True)
    sparse.save_pretrained(files["values_dtype='bfloat16'"], values_dtype="bfloat16", allow_lossy_cast=True)
    largest_age = max(int(m.sparse_ages["default"].max()) for m in sparse.modules() if isinstance(m, SparseLayer) and m.sparse_ages["default"].numel())
    del sparse
    lora_counts = {}
    for label, dtype in ((LORA, torch.float32), ("LoRA r16, bfloat16", torch.bfloat16)):
        lora, lora_counts[label] = build_lora(base, dtype)
        files[label] = out / label.replace(" ", "").replace(",", "-")
        lora.save_pretrained(files[label])
        del lora
    del base
    sizes = {label: breakdown(d) for label, d in files.items()}

    timed = {label: str(files[label]) for label in (EARLIER, DEFAULT, "save_ages=True", "values_dtype='bfloat16'", LORA)}
    spec = {"loads": args.loads, "model_loads": args.model_loads, "threads": args.threads}
    versions = {"current": (ROOT, {**spec, "files": timed, "sweep": True})}
    with tempfile.TemporaryDirectory() as tmp:
        if args.before:
            versions[f"before ({args.before})"] = (export_code(args.before, Path(tmp)), {**spec, "files": {EARLIER: timed[EARLIER]}, "sweep": True})
        runs = {name: [] for name in versions}
        for r in range(args.rounds):
            for name, (code, version_spec) in versions.items():
                print(f"timing round {r + 1}/{args.rounds}: {name} code", flush=True)
                runs[name].append(run_worker(code, version_spec))

    def merged(name, label, key):
        return [s for run in runs[name] for s in run["files"][label][key]]

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows = [{
        "kind": "run", "date": datetime.date.today().isoformat(), "commit": commit, "adapter": str(args.adapter) if args.adapter else "built",
        "count": COUNT, "lora_counts": lora_counts, "largest_age": largest_age, "rounds": args.rounds, "loads": args.loads,
        "model_loads": args.model_loads, "torch_threads": args.threads, "cpu": _cpu_name(), "code": {"current": f"this tree at {commit}", **({f"before ({args.before})": f"peft_sparse at git {args.before}"} if args.before else {})},
        "entropy_bound_mb": sum(storage.entropy_bits(c, shapes[n]) for n, c in counts.items()) / 8e6,
        "tensors": len(counts), "density_min": min(c / shapes[n] for n, c in counts.items()), "density_max": max(c / shapes[n] for n, c in counts.items()),
    }]  # fmt: skip
    lora_bytes = sizes[LORA]["total"]
    for label in files:
        row = {"kind": "file", "file": label, **sizes[label], "x_lora_fp32": sizes[label]["total"] / lora_bytes}
        rows.append(row)
        for name in versions:
            if label not in runs[name][0]["files"]:
                continue
            timing = {"kind": "load", "file": label, "code": name}
            for key in ("read_decode", "from_pretrained", "decode", "memcpy"):
                samples = merged(name, label, key) if key in runs[name][0]["files"][label] else None
                if samples:
                    timing[f"{key}_cpu_s"], timing[f"{key}_wall_s"] = _median(samples, 0), _median(samples, 1)
            if "decode_cpu_s" in timing:
                nbytes = runs[name][0]["files"][label]["index_bytes_int64"]
                timing.update(index_bytes_int64=nbytes, decode_gb_s=nbytes / timing["decode_cpu_s"] / 1e9, memcpy_gb_s=nbytes / timing["memcpy_cpu_s"] / 1e9)
            rows.append(timing)
    for name in versions:
        for i, cell in enumerate(runs[name][0]["sweep"]):
            decode = [s for run in runs[name] for s in run["sweep"][i]["decode"]]
            memcpy = [s for run in runs[name] for s in run["sweep"][i]["memcpy"]]
            nbytes = cell["index_bytes_int64"]
            rows.append({
                "kind": "sweep", "code": name, "form": cell["form"], "density": cell["density"], "tensors": SWEEP_TENSORS, "shape": SWEEP_SHAPE,
                "stored_bytes": cell["stored_bytes"], "index_bytes_int64": nbytes, "decode_cpu_s": _median(decode, 0), "memcpy_cpu_s": _median(memcpy, 0),
                "decode_gb_s": nbytes / _median(decode, 0) / 1e9, "memcpy_gb_s": nbytes / _median(memcpy, 0) / 1e9,
            })  # fmt: skip
    results = args.results or HERE / "results" / f"{rows[0]['date']}-cpu-adapter-files.jsonl"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print_tables(rows)
    print(f"\nwritten: {results}")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def print_tables(rows: list) -> None:
    run = rows[0]
    mb = lambda b: f"{b / 1e6:.2f}"  # noqa: E731
    print(f"trainable values: sparse {run['count']:,}; " + "; ".join(f"{k} {v:,}" for k, v in run["lora_counts"].items()))
    print(f"information in the masks (Σ log2 C(N, n) over {run['tensors']} tensors, densities {run['density_min']:.2%}–{run['density_max']:.2%}): {run['entropy_bound_mb']:.2f} MB\n")
    print("| file | values MB | positions MB | ages MB | header MB | total MB | × LoRA r16 fp32 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in (r for r in rows if r["kind"] == "file"):
        print(f"| {r['file']} | {mb(r['values'])} | {mb(r['positions'])} | {mb(r['ages'])} | {mb(r['header'])} | {mb(r['total'])} | {r['x_lora_fp32']:.2f} |")
    print("\n| file | code | read + decode, ms | decode, ms | decode GB/s | memcpy GB/s | from_pretrained, s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in (r for r in rows if r["kind"] == "load"):
        dec = f"{1e3 * r['decode_cpu_s']:.1f} | {r['decode_gb_s']:.2f} | {r['memcpy_gb_s']:.2f}" if "decode_cpu_s" in r else "– | – | –"
        print(f"| {r['file']} | {r['code']} | {1e3 * r['read_decode_cpu_s']:.1f} | {dec} | {r['from_pretrained_cpu_s']:.2f} |")
    print("\n| density | form | code | stored MB | decode ms | decode GB/s | memcpy GB/s | memcpy ÷ decode |")
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for r in (r for r in rows if r["kind"] == "sweep"):
        print(f"| {r['density']:.1%} | {r['form']} | {r['code']} | {mb(r['stored_bytes'])} | {1e3 * r['decode_cpu_s']:.2f} | {r['decode_gb_s']:.2f} | {r['memcpy_gb_s']:.2f} | {r['decode_cpu_s'] / r['memcpy_cpu_s']:.1f} |")
    print("\n(times: medians of the process's CPU time; GB/s: bytes of the decoded indices as int64 per second)")


if __name__ == "__main__":
    main()
