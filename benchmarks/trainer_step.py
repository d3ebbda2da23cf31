"""Optimizer-step time through ``transformers.Trainer`` and TRL's ``SFTTrainer``: SpIEL-AG, SpIEL-MA, their block
variants and LoRA r=16 at LoRA r=16's trainable budget, the same data, the same Trainer settings.
Produces BENCHMARKS.md, "Through the Trainer" (and the CPU host-time rows of docs/perf-log.md).

    python benchmarks/trainer_step.py --size smollm2-135m --steps 60 --out $OUT/trainer.jsonl           # GPU
    python benchmarks/trainer_step.py --size tiny --steps 40 --threads 1 --syncs                        # CPU host time
    python benchmarks/trainer_step.py --size tiny --variants spiel-ag --trainers trainer --profile 25   # cProfile

Each (trainer, variant) runs in this process, one after another, in ``--rounds`` interleaved rounds (every other round
in reverse order, so that no variant always runs late in the process); a callback
stamps every ``on_step_end`` (after a device synchronisation, so each step's time is its own) and the step time is
the gap between consecutive stamps — data loading, forward, backward, clipping, the optimizer, the learning-rate
schedule, the callbacks (SpIEL's reselections and windows) and logging, everything the Trainer does per step. The
median and the mean over the timed steps (after ``--warmup``) are reported; the mean holds the reselections. The time
Python's garbage collector took in each step is recorded beside it (``gc_s_all``): on a host-bound step its pauses
are part of the step.

Model: ``--size smollm2-135m`` loads the real SmolLM2-135M from the folder in ``PEFT_SPARSE_SMOLLM2_DIR`` when it is
set, else random weights at its configuration; ``tinyllama`` is random at TinyLlama-1.1B's shapes; ``tiny`` a
4-block Llama of hidden size 64 for CPU host-time measurements. bf16 on a GPU, float32 on the CPU. SpIEL: S = 20,
γ = 5 (the paper's), ``total_steps`` = the run's steps; SpIEL-MA beside the Trainer's AdamW (the scheduler keeps the
accumulators) unless ``--sm3``.

``--syncs`` counts, per timed step, the host reads of tensors (``.item()``, ``.tolist()``, ``bool()``, ``float()``,
``int()``; ``.cpu()``, ``.numpy()``, ``.to("cpu")`` of a tensor on a device) through a ``TorchFunctionMode``: on a
GPU each waits for the device queue (on the CPU the scalar reads are counted all the same: the GPU's would be).
``--profile N`` prints cProfile's N most expensive functions (by own time) over the timed steps of each run.
Each run appends one JSON line to ``--out`` as soon as it ends.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

try:  # (imported from the benchmarks package by other benchmarks; run as a script otherwise)
    from .host_probe import host_probe_us
except ImportError:
    from host_probe import host_probe_us

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152),
    "tinyllama": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                      vocab_size=32000),
}  # fmt: skip
VARIANTS = ["lora", "spiel-ag", "spiel-ma", "spiel-ag-block", "spiel-ma-block"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")


def build_model(size: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    folder = os.environ.get("PEFT_SPARSE_SMOLLM2_DIR")
    if size == "smollm2-135m" and folder:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device), "SmolLM2-135M weights"
    tie = size in ("smollm2-135m", "tiny")
    config = LlamaConfig(**SIZES[size], max_position_embeddings=2048, tie_word_embeddings=tie)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model, "random weights"


def lora_r16_budget(model) -> int:
    from peft import LoraConfig, get_peft_model

    probe = get_peft_model(_meta_copy(model), LoraConfig(r=16, target_modules=TARGETS))
    n = sum(p.numel() for p in probe.parameters() if p.requires_grad)
    return n


def _meta_copy(model):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model.config)


def peft_model(model, variant: str, budget: int, block: int):
    from peft import LoraConfig, get_peft_model

    import peft_sparse

    if variant == "lora":
        return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS))
    growth = "ma" if "-ma" in variant else "ag"
    block_shape = (block, block) if variant.endswith("-block") else (1, 1)
    budget -= budget % (block_shape[0] * block_shape[1])  # (a whole number of blocks: LoRA's count rounded down)
    config = peft_sparse.SpIELConfig(target_modules=TARGETS, num_tunable_weights=budget, growth=growth, reselection_steps=20,
                                     gradient_estimation_steps=5, block_shape=block_shape)  # fmt: skip
    return get_peft_model(model, config)


def step_callback(on_step_end):
    """A TrainerCallback calling ``on_step_end(state)`` at each optimizer step's end."""
    from transformers import TrainerCallback

    class Callback(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            on_step_end(state)

    return Callback()


def sync_counter():
    """A TorchFunctionMode counting host reads of tensors by method name (see the module docstring)."""
    import torch
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.counts: dict = {}

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in ("to", "cpu", "numpy"):  # (a copy to the host: a read when the tensor is on a device)
                tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
                to_host = name != "to" or any(a == "cpu" or (isinstance(a, torch.device) and a.type == "cpu")
                                              for a in [*args[1:], *(kwargs or {}).values()] if isinstance(a, (str, torch.device)))  # fmt: skip
                if tensor is not None and tensor.device.type != "cpu" and to_host:
                    self.counts[name] = self.counts.get(name, 0) + 1
            elif name in SYNC_METHODS:
                self.counts[name] = self.counts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    return Count()


def sync_site_counter():
    """CUDA's synchronisation warnings (``torch.cuda.set_sync_debug_mode``) between ``start()`` and ``stop()``,
    counted by the last frames of the calling stack that lie in peft_sparse, transformers, trl or accelerate."""
    import collections
    import traceback
    import warnings

    import torch

    class Sites:
        def __init__(self):
            self.sites: collections.Counter = collections.Counter()
            self._show = None

        def start(self):
            self._show = warnings.showwarning
            warnings.simplefilter("always")
            warnings.showwarning = self.show
            torch.cuda.set_sync_debug_mode("warn")

        def stop(self):
            torch.cuda.set_sync_debug_mode("default")
            if self._show is not None:
                warnings.showwarning = self._show

        def show(self, message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return self._show(message, category, filename, lineno, file, line)
            frames = [f for f in traceback.extract_stack()[:-1] if any(k in f.filename for k in ("peft_sparse", "transformers", "trl", "accelerate"))]
            self.sites[" < ".join(f"{Path(f.filename).name}:{f.lineno}({f.name})" for f in reversed(frames[-3:]))] += 1

    return Sites()


def run_one(args, trainer_kind: str, variant: str, device: str) -> dict:
    import torch
    from transformers import Trainer, TrainingArguments

    import peft_sparse

    base, weights = build_model(args.size, device)
    base.config.use_cache = False
    budget = lora_r16_budget(base)
    model = peft_model(base, variant, budget, args.block)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    vocab = SIZES[args.size]["vocab_size"]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, ((args.warmup + args.steps) * args.bs, args.seq), generator=g)
    ends: list = []
    cpu_ends: list = []  # (this process's CPU time: on a shared host less disturbed by the others than the wall clock)
    gc_ends: list = []  # (the time Python's garbage collector has taken so far, at each stamp)
    gc_clock = {"total": 0.0}

    def on_gc(phase, info):
        if phase == "start":
            gc_clock["start"] = time.perf_counter()
        else:
            gc_clock["total"] += time.perf_counter() - gc_clock.pop("start", time.perf_counter())

    def stamp(state):
        if device == "cuda":
            torch.cuda.synchronize()
        ends.append(time.perf_counter())
        cpu_ends.append(time.process_time())
        gc_ends.append(gc_clock["total"])

    callbacks = [step_callback(stamp)] + ([peft_sparse.SpIELCallback()] if variant != "lora" else [])
    total = args.warmup + args.steps
    with tempfile.TemporaryDirectory() as out:
        common = dict(per_device_train_batch_size=args.bs, max_steps=total, learning_rate=1e-4, report_to=[], save_strategy="no",
                      logging_steps=args.logging_steps, bf16=device == "cuda", use_cpu=device == "cpu", dataloader_num_workers=0,
                      disable_tqdm=True, seed=0)  # fmt: skip
        optimizers = (None, None)
        if args.sm3 and variant.startswith("spiel-ma"):
            optimizers = (peft_sparse.SM3([p for p in model.parameters() if p.requires_grad], lr=1e-3), None)
        if trainer_kind == "sft":
            from datasets import Dataset
            from trl import SFTConfig, SFTTrainer

            from tests.models import tiny_tokenizer

            def collate(rows):
                x = torch.tensor([r["input_ids"] for r in rows])
                return {"input_ids": x, "labels": x.clone(), "attention_mask": torch.ones_like(x)}

            targs = SFTConfig(out, dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False, gradient_checkpointing=False,
                              **common)  # fmt: skip
            trainer = SFTTrainer(model=model, args=targs, train_dataset=Dataset.from_dict({"input_ids": ids.tolist()}), callbacks=callbacks,
                                 data_collator=collate, processing_class=tiny_tokenizer(), optimizers=optimizers)  # fmt: skip
        else:
            rows = [{"input_ids": x, "labels": x} for x in ids]
            trainer = Trainer(model=model, args=TrainingArguments(out, **common), train_dataset=rows, callbacks=callbacks, optimizers=optimizers)
        counter = sync_counter() if args.syncs else None
        profiler = None
        if args.profile:  # (over the timed steps only)
            import cProfile

            profiler = cProfile.Profile()
            trainer.add_callback(step_callback(lambda state: profiler.enable() if state.global_step == args.warmup else None))
        sync_sites = sync_site_counter() if args.sync_debug and device == "cuda" else None
        if sync_sites is not None:
            trainer.add_callback(step_callback(lambda state: sync_sites.start() if state.global_step == args.warmup else None))
        sync_steps: list = []
        if counter is not None:
            trainer.add_callback(step_callback(lambda state: (sync_steps.append(dict(counter.counts)), counter.counts.clear())))
        probe = [host_probe_us()]  # (the host's speed for this run, at its start and its end)
        start = time.perf_counter()
        gc.callbacks.append(on_gc)
        try:
            if counter is not None:
                with counter:
                    trainer.train()
            else:
                trainer.train()
        finally:
            gc.callbacks.remove(on_gc)
        wall = time.perf_counter() - start
        probe.append(host_probe_us())
        if profiler is not None:
            profiler.disable()
        if sync_sites is not None:
            sync_sites.stop()
    first = max(args.warmup - 1, 0)
    steps = [b - a for a, b in zip(ends[first:], ends[first + 1 :])]
    cpu_steps = [b - a for a, b in zip(cpu_ends[first:], cpu_ends[first + 1 :])]
    gc_steps = [b - a for a, b in zip(gc_ends[first:], gc_ends[first + 1 :])]
    record = {
        "trainer": trainer_kind, "variant": variant, "size": args.size, "weights": weights, "device": device,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "threads": torch.get_num_threads(),
        "step_s_median": statistics.median(steps), "step_s_mean": statistics.fmean(steps), "step_s_all": [round(s, 5) for s in steps],
        "cpu_s_median": statistics.median(cpu_steps), "cpu_s_mean": statistics.fmean(cpu_steps),
        "gc_s_mean": statistics.fmean(gc_steps), "gc_s_max": max(gc_steps), "gc_s_all": [round(s, 5) for s in gc_steps],
        "train_wall_s": wall, "trainable": trainable, "budget": budget, "bs": args.bs, "seq": args.seq, "warmup": args.warmup,
        "steps": args.steps, "logging_steps": args.logging_steps, "block": args.block if variant.endswith("-block") else None,
        "optimizer": type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer).__name__,
        "fast_paths": peft_sparse.accel.enabled(),
        "loadavg_1min": os.getloadavg()[0], "host_probe_us": probe, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
    }  # fmt: skip
    if sync_steps:
        timed = sync_steps[args.warmup :]
        record["host_reads_per_step"] = {k: statistics.median(s.get(k, 0) for s in timed) for k in sorted(set().union(*timed))}
        record["host_reads_max_step"] = max((sum(s.values()) for s in timed), default=0)
    if sync_sites is not None:
        record["device_syncs_per_step"] = {site: n / args.steps for site, n in sync_sites.sites.most_common(20)}
        for site, n in sync_sites.sites.most_common(20):
            print(f"{n / args.steps:8.2f} syncs/step  {site}")
    if profiler is not None:
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.profile)
        print(text.getvalue())
        if args.profile_out:
            profiler.dump_stats(f"{args.profile_out}-{trainer_kind}-{variant}-{args.size}.prof")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--trainers", default="trainer,sft", help="comma-separated: trainer (transformers.Trainer), sft (TRL's SFTTrainer)")
    parser.add_argument("--steps", type=int, default=40, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps first")
    parser.add_argument("--bs", type=int, default=None, help="sequences per step (default: 8 on a GPU, 4 on the CPU)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: 512 on a GPU, 32 on the CPU)")
    parser.add_argument("--block", type=int, default=None, help="block variants' square block side (default 64; 16 for --size tiny)")
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds of every (trainer, variant)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--sm3", action="store_true", help="SpIEL-MA with peft_sparse.SM3 instead of the Trainer's AdamW")
    parser.add_argument("--syncs", action="store_true", help="count host reads of tensors per step (TorchFunctionMode)")
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's N most expensive functions per run")
    parser.add_argument("--sync-debug", action="store_true",
                        help="on a GPU: count CUDA's synchronising operations per timed step by call site (set_sync_debug_mode)")
    parser.add_argument("--profile-out", default=None, metavar="PREFIX",
                        help="--profile: also write each run's whole cProfile table to PREFIX-<trainer>-<variant>-<size>.prof")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--out", default=None, help="JSONL file each run's record is appended to")
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    args.bs = args.bs or (8 if device == "cuda" else 4)
    args.seq = args.seq or (512 if device == "cuda" else 32)
    args.block = args.block or (16 if args.size == "tiny" else 64)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    trainers = [t.strip() for t in args.trainers.split(",") if t.strip()]
    bad = sorted(set(variants) - set(VARIANTS)) + sorted(set(trainers) - {"trainer", "sft"})
    if bad:
        parser.error(f"unknown variants or trainers {bad}; variants: {VARIANTS}; trainers: trainer, sft")
    records = []
    for round_ in range(args.rounds):
        order = 1 if round_ % 2 == 0 else -1  # (every other round in reverse order: no variant always runs late in the process)
        for trainer_kind in trainers[::order]:
            for variant in variants[::order]:
                record = run_one(args, trainer_kind, variant, device)
                gc.collect()  # (the run's model and Trainer gone before the next is built)
                if device == "cuda":
                    torch.cuda.empty_cache()
                record["round"] = round_
                records.append(record)
                if args.out:
                    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                    with open(args.out, "a") as f:
                        f.write(json.dumps(record) + "\n")
                reads = f" host reads/step {record['host_reads_per_step']}" if "host_reads_per_step" in record else ""
                print(f"{trainer_kind:<8}{variant:<16}median {record['step_s_median'] * 1e3:8.2f} ms  mean {record['step_s_mean'] * 1e3:8.2f} ms"
                      f"  CPU median {record['cpu_s_median'] * 1e3:8.2f} ms  gc {record['gc_s_mean'] * 1e3:6.2f} ms/step  trainable {record['trainable']:,}{reads}",
                      flush=True)  # fmt: skip
    print(f"\n{args.size}, {device}, {args.bs}×{args.seq} tokens per step; median over rounds of each run's median and mean"
          "; paired: the median over rounds of each run's median ÷ that round's LoRA median")
    print(f"{'trainer':<8}{'variant':<16}{'median ms':>10}{'× LoRA':>8}{'mean ms':>10}{'× LoRA':>8}{'CPU med ms':>11}{'× LoRA':>8}{'paired':>8}")
    for trainer_kind in trainers:
        rows = {v: [r for r in records if r["trainer"] == trainer_kind and r["variant"] == v] for v in variants}
        stat = {key: {v: statistics.median(r[key] for r in rs) for v, rs in rows.items()} for key in ("step_s_median", "step_s_mean", "cpu_s_median")}
        line = f"{trainer_kind:<8}{{v:<16}}"
        for v in variants:
            cells = []
            for key in stat:
                ratio = f"{stat[key][v] / stat[key]['lora']:.2f}" if "lora" in stat[key] else "-"
                cells.append(f"{stat[key][v] * 1e3:>{11 if key == 'cpu_s_median' else 10}.2f}{ratio:>8}")
            lora = {r["round"]: r["step_s_median"] for r in rows.get("lora", [])}
            paired = [r["step_s_median"] / lora[r["round"]] for r in rows[v] if r["round"] in lora]
            cells.append(f"{statistics.median(paired):>8.2f}" if paired else f"{'-':>8}")
            print(line.format(v=v) + "".join(cells))


if __name__ == "__main__":
    main()
