"""Training-step speed and peak memory of SpIEL against PEFT baselines, one fresh process per variant.
Produces BENCHMARKS.md, "NVIDIA H200 (141 GB)": the TinyLlama and Llama-2-7B step tables and the training-merge line.

    python benchmarks/bench_step.py --variants floor,lora,spiel-ag,spiel-ma      # a batch, table at the end
    python benchmarks/bench_step.py --variant spiel-ag                         # one variant (what the batch runs)
    python benchmarks/bench_step.py --variants qfloor,qspiel-ma --rounds 3     # interleaved rounds of a batch
    python benchmarks/bench_step.py --variants floor,spiel-ma-block --block 32  # 32×32 blocks (default 64×64)
    python benchmarks/bench_step.py --variants floor,spiel-ag,spiel-ag-merge --rounds 3  # default and opt-in merge
    python benchmarks/bench_step.py --size llama2-7b --variants floor,floor-dw,spiel-ag  # against the dense-dW bound
    python benchmarks/bench_step.py --variant spiel-ag-block --kernel-profile 3  # GPU busy time and host CUDA calls per phase

Rounds run the floor first, then the other variants, in reverse order in every second round (a process's
place in a round can move its host's speed; each record's ``host_probe_us`` times a fixed loop of plain
Python at the start and the end of its timed steps, so runs can be compared by the host they had).
With ``--rounds 3`` or more, it also prints each variant's full-cycle mean taken over each step position's
median over the rounds: host stalls that hit one round at one step (they hit the floor's runs too) are out,
while the SpIEL cycle's windows and reselections, at the same positions in every round, stay in.
``--settle 180`` runs the floor untimed for that long first: a fresh machine's host got 2.3 times faster
over its first minutes in round s18 (docs/perf-log.md), which moved the host-bound SpIEL steps with it.

Setup: Llama architecture with TinyLlama-1.1B shapes (or ``--size llama2-7b``), random
init, bf16, 8×1024 tokens per step, all 7 linear projection types targeted, trainable budget = LoRA
r=64 (50.46M for TinyLlama), AdamW (SM3 for SpIEL-MA), median and mean of 40 timed steps after 6
warm-up steps. Peak memory is ``torch.cuda.max_memory_allocated()`` over the timed steps. Only
``lora-ckpt`` uses gradient checkpointing. SpIEL runs the paper's S=20, γ=5 over T=46 steps:
reselections at steps 5, 25 and 45. The timed steps 7–46 hold every step kind of two full cycles
once (windows 21–25 and 41–45, reselections at 25 and 45, the steps right after a reselection at 26
and 46); their mean is the mean over full cycles. Step 6 stays in the warm-up because it is the
first step outside a window: block variants compile their Triton kernel there.

Each record is appended as a JSON line to ``benchmarks/results/<date>-<gpu>.jsonl``. Besides the step
times it holds, per timed step and phase, when the host finished issuing it and when the GPU finished
it (a step that waited for the host shows which pass did), and the host's CPU model, clock and load.
For SpIEL variants it also counts, per timed step, the calls that leave the steady path
(``slow_calls_per_step``, see :func:`count_slow_calls`): a slow run with none of them waited on its host,
not on a path the code took.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import itertools
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional

try:  # (imported from the benchmarks package by other benchmarks; run as a script otherwise)
    from .host_probe import host_probe_us
except ImportError:
    from host_probe import host_probe_us

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

SIZES = {
    "tinyllama": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                      num_key_value_heads=4, vocab_size=32000),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152),
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000),
    "llama2-13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                       num_key_value_heads=40, vocab_size=32000),
    "codellama-34b": dict(hidden_size=8192, intermediate_size=22016, num_hidden_layers=48, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=32000),
}  # fmt: skip
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VARIANTS = [
    "floor", "floor-dw", "qfloor", "lora", "lora-ckpt", "qlora", "shira", "supertuning", "full",
    "spiel-ag", "spiel-ma", "spiel-ag-block", "spiel-ma-block", "qspiel-ag", "qspiel-ma",
    "spiel-ag-merge", "spiel-ma-merge", "spiel-ag-block-merge", "spiel-ma-block-merge",
]  # fmt: skip
# (a "-merge" variant is its SpIEL variant with the opt-in training merge, training_merge=True: default and opt-in
# side by side in one interleaved batch)
BLOCK = 64  # block variants' square block side (--block): 64×64 gave the fastest block steps on an H200 (docs/perf-log.md, rounds s20 and s21)
S, GAMMA = 20, 5  # the paper's reselection interval and estimation window (thesis Table 7.1)


def lora_budget(cfg: dict, r: int = 64) -> int:
    h, i, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    per_layer = r * ((h + h) * 2 + (h + kv) * 2 + (h + i) * 3)
    return per_layer * cfg["num_hidden_layers"]


def build_model(size: str, quantized: bool):
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SIZES[size], max_position_embeddings=4096, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    if not quantized:
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        return model
    cache = Path(tempfile.gettempdir()) / f"peft-sparse-bench-{size}"
    if not (cache / "config.json").is_file():
        torch.manual_seed(0)
        with torch.device("cuda"):
            LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(cache)
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip
    return AutoModelForCausalLM.from_pretrained(cache, quantization_config=q, dtype=torch.bfloat16, device_map={"": 0})


def prepare(variant: str, size: str, total_steps: int, block: int = BLOCK, training_merge: bool = False,
            ma_signal: Optional[str] = None):
    """(model, optimizer or None, per-step hook or None, block_shape) for a variant (``block``: the block
    variants' square block side; ``training_merge``: SpIEL keeps θ + δ in the base weights while training,
    the opt-in fast path; ``ma_signal``: SpIEL-MA's growth signal, None for the config's default)."""
    import torch
    from peft import LoraConfig, ShiraConfig, SupertuningConfig, get_peft_model

    import peft_sparse

    quantized = variant.startswith("q")
    model = build_model(size, quantized)
    model.config.use_cache = False
    budget = lora_budget(SIZES[size])
    block_shape = None
    for p in model.parameters():
        p.requires_grad_(False)
    if variant in ("floor", "qfloor"):
        model.enable_input_require_grads()
        return model, None, None, None, 0
    if variant == "floor-dw":  # the floor plus each targeted weight's dense gradient (dropped after the step): the
        # dense-dW bound an unstructured SpIEL step is compared with (its value gradient gathered from that dW)
        model.enable_input_require_grads()
        targeted = [m.weight for n, m in model.named_modules() if n.split(".")[-1] in TARGETS]
        for w in targeted:
            w.requires_grad_(True)
        return model, None, lambda: model.zero_grad(set_to_none=True), None, sum(w.numel() for w in targeted)
    if variant == "full":
        for p in model.parameters():
            p.requires_grad_(True)
    elif variant in ("lora", "lora-ckpt", "qlora"):
        model = get_peft_model(model, LoraConfig(r=64, lora_alpha=16, lora_dropout=0.1, target_modules=TARGETS))
        if variant == "lora-ckpt":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    elif variant == "shira":
        model = get_peft_model(model, ShiraConfig(r=64, target_modules=TARGETS))
    elif variant == "supertuning":
        targeted = sum(m.weight.numel() for n, m in model.named_modules() if n.split(".")[-1] in TARGETS)
        model = get_peft_model(model, SupertuningConfig(sparsity=1 - budget / targeted, target_modules=TARGETS))
    elif "spiel" in variant:
        training_merge = training_merge or variant.endswith("-merge")
        name = variant.removesuffix("-merge")
        growth = "ma" if name.endswith("-ma") or "-ma-" in name else "ag"
        block_shape = (block, block) if name.endswith("-block") else (1, 1)
        config = peft_sparse.SpIELConfig(
            target_modules=TARGETS, num_tunable_weights=budget, growth=growth, reselection_steps=S,
            gradient_estimation_steps=GAMMA, block_shape=block_shape, training_merge=training_merge,
            **({"ma_signal": ma_signal} if ma_signal and growth == "ma" else {}),
        )  # fmt: skip
        model = get_peft_model(model, config)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    params = [p for p in model.parameters() if p.requires_grad]
    trainable = sum(p.numel() for p in params)
    if variant.removesuffix("-merge").endswith(("-ma", "-ma-block")):
        # --sm3-ema: the moving-average form with momentum, SM3's form beyond 100 steps (ma_sm3_defaults)
        sm3_form = {"momentum": 0.9, "beta2": 0.999} if os.environ.get("BENCH_SM3_EMA") == "1" else {}
        optimizer = peft_sparse.SM3(params, lr=1e-3, **sm3_form)
    else:
        optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    hook = None
    if "spiel" in variant:
        scheduler = peft_sparse.SpIELScheduler(model, optimizer, total_steps=total_steps)
        hook = scheduler.step
    return model, optimizer, hook, block_shape, trainable


def train_step(model, optimizer, hook, ids, phase_events=None) -> list:
    """One training step as every variant runs it: forward, backward, optimizer, SpIEL scheduler.
    Returns the host time of each of the four phases, in seconds (no synchronisation);
    ``phase_events`` (four CUDA events) are recorded at the end of each phase."""
    ends = []

    def end_of_phase():
        ends.append(time.perf_counter())
        if phase_events:
            phase_events[len(ends) - 2].record()

    ends.append(time.perf_counter())
    loss = model(input_ids=ids, labels=ids).loss
    end_of_phase()
    loss.backward()
    end_of_phase()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    end_of_phase()
    if hook is not None:
        hook()
    end_of_phase()
    return [b - a for a, b in zip(ends, ends[1:])]


# speed only: the steps run at a constant rate on purpose, which SpIEL's check of a non-decaying rate would flag
warnings.filterwarnings("ignore", message="SpIEL: the learning rate has not decayed")

PHASES = ("forward", "backward", "optimizer", "hook")


def phase_ends(issued: list, events: list) -> tuple[list, list]:
    """When the host finished issuing each phase and when the GPU finished it, in seconds from the step's
    start: ``issued`` is :func:`train_step`'s return, ``events`` a CUDA event recorded at the step's start
    followed by its ``phase_events`` (read after a synchronisation). A GPU finishing a phase right after
    the host issued it waited for the host."""
    return list(itertools.accumulate(issued)), [events[0].elapsed_time(e) / 1e3 for e in events[1:]]


def host_description() -> dict:
    """The host's CPU model, logical CPU count and the median current clock of its CPUs (Linux), to tell
    machines apart when their host times differ."""
    info = {"cpus": os.cpu_count()}
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return info
    models = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    mhz = [float(line.split(":", 1)[1]) for line in lines if line.startswith("cpu MHz")]
    if models:
        info["cpu"] = models[0]
    if mhz:
        info["cpu_mhz_median"] = round(statistics.median(mhz))
    return info


# What a steady SpIEL step never calls (docs/perf-log.md): each is counted per step, so that a slow step shows
# whether the code left its steady path (a layer's full forward, a generic backward, a Triton launch through
# Triton's own path or a new launch plan) or the host was slow. (module, owner attribute path, label)
SLOW_CALLS = (
    ("peft_sparse.core.passes", "sparse_delta_linear", "layer forward, full path"),  # (the reference pass)
    ("peft_sparse.accel.training_merge", "sparse_delta_linear", "layer forward, full path"),  # (a merged pass, not steady)
    ("peft_sparse.accel.transient_merge", "_remember", "layer forward, full path"),  # (a default training pass, not steady)
    ("peft_sparse.core.layer", "SparseLayer._check_ready", "adapter checks"),
    ("peft_sparse.core.functional", "SparseDeltaLinear.backward", "generic backward"),
    ("peft_sparse.accel.triton_kernels", "block_sddmm_into", "block launch planned anew"),
    ("peft_sparse.accel.triton_kernels", "launch_plan", "Triton launch planned anew"),
    ("triton.runtime.jit", "JITFunction.run", "Triton's own launch path"),
)


def count_slow_calls(counts: dict, skip: tuple = ()) -> None:
    """Wrap each of :data:`SLOW_CALLS` but the labels in ``skip`` so that its calls add to ``counts[label]``
    (a wrapper only around calls a steady step does not make: steady steps run as they do unwrapped). The
    kernel registries of ``peft_sparse.core.kernels`` that hold a wrapped function get the wrapper too."""
    import functools
    import importlib

    from peft_sparse.core import kernels

    registries = [table for name, table in vars(kernels).items() if name.endswith("_KERNELS") and isinstance(table, dict)]
    for module_name, path, label in SLOW_CALLS:
        if label in skip:
            continue
        owner = importlib.import_module(module_name)
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        raw = owner.__dict__[name]
        static = isinstance(raw, staticmethod)
        function = raw.__func__ if static else raw

        def wrapper(*args, _function=function, _label=label, **kwargs):
            counts[_label] = counts.get(_label, 0) + 1
            return _function(*args, **kwargs)

        wrapper = functools.wraps(function)(wrapper)
        setattr(owner, name, staticmethod(wrapper) if static else wrapper)
        for table in registries:
            for key, value in list(table.items()):
                if value is function:
                    table[key] = wrapper


def run_one(args) -> dict:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    from peft_sparse.accel import transient_merge

    # (--no-transient-cuda: the fast paths' composed pass instead of W + δ written for each product;
    # --no-write-lane: each single-adapter write and write-back through the generic calls)
    transient_merge.ON_CUDA, transient_merge.WRITE_LANE = not args.no_transient_cuda, not args.no_write_lane
    model, optimizer, hook, block_shape, trainable = prepare(args.variant, args.size, args.warmup + args.steps, args.block, args.training_merge, args.ma_signal)
    model.train()
    slow: dict = {}  # label → calls in the current step
    slow_steps: list = []  # per timed step: {label: calls}
    if "spiel" in args.variant:
        # (a 4-bit layer's steady backward is the generic one: GivenWeightLinear hands over to it)
        count_slow_calls(slow, skip=("generic backward",) if args.variant.startswith("q") else ())
    g = torch.Generator(device="cuda").manual_seed(0)
    vocab = SIZES[args.size]["vocab_size"]
    batches = [torch.randint(0, vocab, (args.bs, args.seq), device="cuda", generator=g) for _ in range(4)]
    times, gc_times = [], []
    host_done, gpu_done = [], []  # per step: phase_ends
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(PHASES) + 1)]
    gc_clock = {"total": 0.0}

    def on_gc(phase, info):  # time spent in Python's garbage collector, per step
        if phase == "start":
            gc_clock["start"] = time.perf_counter()
        else:
            gc_clock["total"] += time.perf_counter() - gc_clock.pop("start", time.perf_counter())

    gc.callbacks.append(on_gc)
    load = []  # the host's 1-minute load average at the start and the end of the timed steps
    probe = []  # host_probe_us() at the start and the end of the timed steps
    profiler = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            load.append(os.getloadavg()[0])
            probe.append(host_probe_us())
            if args.gc_freeze:
                gc.freeze()
            if args.host_profile:  # (its own cost slows every Python call: the step times of such a run are not comparable)
                profiler = cProfile.Profile()
                profiler.enable()
        ids = batches[step % len(batches)]
        torch.cuda.synchronize()
        gc_clock["total"] = 0.0
        slow.clear()
        events[0].record()
        start = time.perf_counter()
        issued = train_step(model, optimizer, hook, ids, phase_events=events[1:])
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            gc_times.append(gc_clock["total"])
            host, gpu = phase_ends(issued, events)
            host_done.append(host)
            gpu_done.append(gpu)
            slow_steps.append(dict(slow))
    gc.callbacks.remove(on_gc)
    kernel_rows = kernel_profile(model, optimizer, hook, batches, args.kernel_profile) if args.kernel_profile else None
    load.append(os.getloadavg()[0])
    if profiler is not None:
        profiler.disable()
    probe.append(host_probe_us())
    if profiler is not None and args.profile_out:
        profiler.dump_stats(args.profile_out)
    return {
        "variant": args.variant,
        "step_s_median": statistics.median(times),
        "step_s_mean": statistics.fmean(times),
        "step_s_all": times,
        "gc_s_all": gc_times,
        "phase_ends_ms_median": {
            phase: [round(statistics.median(d[i] for d in done) * 1e3, 2) for done in (host_done, gpu_done)]
            for i, phase in enumerate(PHASES)
        },  # phase → [host issued, GPU done]
        # per timed step, per phase: [host issued, GPU done] in ms (which pass of a slow step waited for the host)
        "phase_ends_ms_all": [[[round(h * 1e3, 1), round(g * 1e3, 1)] for h, g in zip(*done)] for done in zip(host_done, gpu_done)],
        # label → calls in each timed step, for the labels called in any (SpIEL variants; see SLOW_CALLS)
        "slow_calls_per_step": {label: [s.get(label, 0) for s in slow_steps] for label in sorted(set().union(*slow_steps))}
        if "spiel" in args.variant else None,
        "host": host_description(),
        "loadavg_1min": load,
        "host_probe_us": probe,
        "gc_freeze": args.gc_freeze,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "gpu": torch.cuda.get_device_name(),
        "size": args.size,
        "training_merge": args.training_merge or args.variant.endswith("-merge"),
        "transient_cuda": not args.no_transient_cuda,
        "write_lane": not args.no_write_lane,
        "ma_signal": model.peft_config["default"].ma_signal if "spiel-ma" in args.variant else None,
        "sm3_ema": os.environ.get("BENCH_SM3_EMA") == "1",
        "seq": args.seq,
        "bs": args.bs,
        "trainable": trainable,
        "block_shape": list(block_shape) if block_shape else None,
        "reselection_steps": S if "spiel" in args.variant else None,
        "gradient_estimation_steps": GAMMA if "spiel" in args.variant else None,
        "warmup": args.warmup,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "batch_id": args.batch_id,
        "host_profile": host_profile_rows(profiler, args.host_profile, args.steps) if profiler is not None else None,
        "kernel_profile": kernel_rows,
    }


def kernel_profile(model, optimizer, hook, batches, steps: int) -> dict:
    """``steps`` more steps (after the timed ones, not timed) under torch.profiler's CUDA activity: per step and
    phase, the GPU's busy time (the union of its kernels' intervals), the span from its first to its last kernel,
    the host's time and the host's CUDA calls, and per kernel name its launches and GPU time per step (the 40
    largest), to tell the GPU time a variant adds from the host time it waits for."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for step in range(steps):
            ids = batches[step % len(batches)]
            torch.cuda.synchronize()
            with record_function("phase:forward"):
                loss = model(input_ids=ids, labels=ids).loss
            with record_function("phase:backward"):
                loss.backward()
            with record_function("phase:optimizer"):
                if optimizer is not None:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                if hook is not None:
                    hook()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:  # (the trace links each kernel to the host call that launched it)
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    return summarize_trace(events, steps)


def summarize_trace(events: list, steps: int) -> dict:
    """:func:`kernel_profile`'s record from a Chrome trace's events (``phase:<name>`` ranges of ``steps`` steps)."""
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}  # fmt: skip
    kernels = [e for e in events if e.get("cat") == "kernel"]
    phases = [e for e in events if e.get("cat") == "user_annotation" and e.get("name", "").startswith("phase:")]
    calls = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    table, busy = {}, {}
    for k in kernels:
        row = table.setdefault(k["name"][:90], [0, 0.0])
        row[0] += 1
        row[1] += k["dur"]
    for name in ("forward", "backward", "optimizer"):
        own = []
        for p in (p for p in phases if p["name"] == "phase:" + name):
            # kernels the host launched while the phase's range ran (their GPU time may run past it)
            ks = sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels
                        if p["ts"] <= launches.get(k.get("args", {}).get("correlation"), -1) <= p["ts"] + p["dur"])  # fmt: skip
            if not ks:
                continue
            union, end = 0.0, None
            for start, stop in ks:
                if end is None or start > end:
                    union, end = union + stop - start, stop
                elif stop > end:
                    union, end = union + stop - end, stop
            # the host's CUDA calls in the phase (a long launch or a synchronising call: the host waited for the GPU)
            runtime = {}
            for c in calls:
                if p["ts"] <= c["ts"] <= p["ts"] + p["dur"]:
                    row = runtime.setdefault(c["name"], [0, 0.0, 0.0])
                    row[0], row[1], row[2] = row[0] + 1, row[1] + c["dur"], max(row[2], c["dur"])
            own.append((union, ks[-1][1] - ks[0][0], len(ks), p["dur"], runtime))
        if own:
            busy[name] = {"gpu_busy_ms": round(statistics.median(o[0] for o in own) / 1e3, 3),
                          "gpu_span_ms": round(statistics.median(o[1] for o in own) / 1e3, 3),
                          "host_ms": round(statistics.median(o[3] for o in own) / 1e3, 3),
                          "kernels": statistics.median(o[2] for o in own),
                          # per CUDA call of the host: [calls, total ms, longest µs] in the phase's last profiled step
                          "host_cuda_calls": {n: [c, round(t / 1e3, 3), round(m, 1)] for n, (c, t, m) in
                                              sorted(own[-1][4].items(), key=lambda kv: -kv[1][1])[:8]}}  # fmt: skip
    top = sorted(table.items(), key=lambda kv: -kv[1][1])[:40]
    return {"steps": steps, "phases": busy, "kernels": [[n, c / steps, round(t / steps / 1e3, 3)] for n, (c, t) in top]}


def host_profile_rows(profiler, rows: int, steps: int) -> list:
    """cProfile's ``rows`` functions with the most own time over the timed steps: [function, calls per step,
    own ms per step, cumulative ms per step], most own time first."""
    stats = pstats.Stats(profiler).stats
    table = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.items():
        where = f"{Path(path).name}:{line}({name})" if path != "~" else name
        table.append([where, round(calls / steps, 2), round(own / steps * 1e3, 3), round(cumulative / steps * 1e3, 3)])
    table.sort(key=lambda row: -row[2])
    return table[:rows]


def results_path(gpu: str) -> Path:
    name = gpu.lower().replace("nvidia", "").strip().replace(" ", "-")
    return HERE / "results" / f"{datetime.date.today().isoformat()}-{name}.jsonl"


def print_table(records: list[dict]) -> None:
    by = {r["variant"]: r for r in records}
    floor = by.get("floor")
    qfloor = by.get("qfloor")
    lora = by.get("lora")
    print(f"\n{records[0]['gpu']}, {records[0]['size']}, {records[0]['bs']}×{records[0]['seq']} tokens")
    print(f"{'variant':<16}{'step s':>9}{'× floor':>9}{'× LoRA':>8}{'mean s':>9}{'mean ×fl':>9}{'peak GiB':>10}{'× floor mem':>12}{'trainable':>13}")
    for r in records:
        base = qfloor if r["variant"].startswith("q") and qfloor else floor
        xf = f"{r['step_s_median'] / base['step_s_median']:.2f}" if base else "-"
        xm = f"{r['peak_mem_gib'] / base['peak_mem_gib']:.2f}" if base else "-"
        xl = f"{r['step_s_median'] / lora['step_s_median']:.2f}" if lora else "-"
        xmean = f"{r['step_s_mean'] / base['step_s_mean']:.2f}" if base else "-"
        print(f"{r['variant']:<16}{r['step_s_median']:>9.3f}{xf:>9}{xl:>8}{r['step_s_mean']:>9.3f}{xmean:>9}{r['peak_mem_gib']:>10.1f}{xm:>12}{r['trainable']:>13,}")
    print("(q* variants are compared with qfloor)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--variants", help="comma-separated variants, each run in a fresh process")
    parser.add_argument("--size", choices=sorted(SIZES), default="tinyllama")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--bs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--block", type=int, default=BLOCK, help="square block side of the -block variants")
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--training-merge", action="store_true", help="SpIEL variants: the opt-in training merge (training_merge=True)")
    parser.add_argument("--no-transient-cuda", action="store_true",
                        help="SpIEL variants without the training merge: the fast paths' composed pass on CUDA instead of "
                             "the default transient merge (W + δ written into the base weight for each product)")
    parser.add_argument("--no-write-lane", action="store_true",
                        help="the default pass's single-adapter writes and write-backs through the generic calls, not "
                             "the layer's kept lane (for a comparison in one lease)")
    parser.add_argument("--ma-signal", choices=("sm3", "io"), default=None,
                        help="SpIEL-MA variants: growth ranked by SM3's accumulators or the windows' input/output sums "
                             "(default: the config's, 'io' for blocks and 'sm3' otherwise)")  # fmt: skip
    parser.add_argument("--sm3-ema", action="store_true",
                        help="SpIEL-MA variants: SM3 with momentum 0.9 and beta2 0.999 (SM3's form beyond 100 steps, ma_sm3_defaults) instead of the sums")
    parser.add_argument("--batch-id", default=None)
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after warm-up (diagnosis of collector pauses)")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="--variant: cProfile over the timed steps, the N functions with the most own time per step "
                             "printed and recorded (host_profile); the profiler slows the host, so the step times are not comparable")
    parser.add_argument("--profile-out", default=None, metavar="FILE",
                        help="--host-profile: also write cProfile's whole table to FILE (pstats' format)")
    parser.add_argument("--kernel-profile", type=int, default=0, metavar="N",
                        help="--variant: N more steps after the timed ones under torch.profiler, recorded as kernel_profile "
                             "(per phase the GPU's busy time and span; per kernel its launches and GPU ms per step)")
    parser.add_argument("--out", default=None, help="JSONL file (default benchmarks/results/<date>-<gpu>.jsonl)")
    parser.add_argument("--rounds", type=int, default=1, help="run the batch this many times, interleaved (one record per run)")
    parser.add_argument("--full-record", action="store_true", help=argparse.SUPPRESS)  # (a batch's child: step times included)
    parser.add_argument("--settle", type=float, default=0.0,
                        help="before the batch, run the floor untimed for at least this many seconds (a fresh machine's host "
                             "speeds up over its first minutes: docs/perf-log.md, round s18)")  # fmt: skip
    args = parser.parse_args()
    if args.sm3_ema:  # (read by every variant process it starts: they inherit the environment)
        os.environ["BENCH_SM3_EMA"] = "1"
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    chosen = [args.variant] if args.variant else [v.strip() for v in (args.variants or ",".join(VARIANTS)).split(",") if v.strip()]
    if args.ma_signal and not any("spiel-ma" in v for v in chosen):
        parser.error(f"--ma-signal={args.ma_signal} sets SpIEL-MA's growth signal, but no SpIEL-MA variant is chosen ({chosen})")
    if args.variant:
        record = run_one(args)
        path = Path(args.out) if args.out else results_path(record["gpu"])
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record if args.full_record else {k: v for k, v in record.items() if k not in ("step_s_all", "host_profile", "kernel_profile")}))
        if record["kernel_profile"]:
            print(json.dumps(record["kernel_profile"]["phases"]))
            for name, calls, ms in record["kernel_profile"]["kernels"]:
                print(f"{ms:>9.3f} ms {calls:>7.1f}  {name}")
        if record["host_profile"]:
            print(f"{'own ms/step':>12}{'cum ms/step':>12}{'calls/step':>11}  function")
            for where, calls, own, cumulative in record["host_profile"]:
                print(f"{own:>12.3f}{cumulative:>12.3f}{calls:>11.2f}  {where}")
        return
    variants = chosen
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {VARIANTS}")
    batch_id = args.batch_id or datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
    if args.settle < 0:
        parser.error(f"--settle must be at least 0 seconds, got {args.settle}")
    settle(args)
    records = []
    for round_ in range(args.rounds):
        if args.rounds > 1:
            print(f"round {round_ + 1} of {args.rounds}", flush=True)
        records += run_batch(args, round_order(variants, round_), batch_id)
    if not records:
        return
    if args.rounds == 1:
        print_table(records)
        return
    # the host's speed drifts over minutes: compare variants by their median over interleaved rounds
    by = {}
    for r in records:
        by.setdefault(r["variant"], []).append(r)
    merged = []
    for v, runs in by.items():
        print(f"{v:<16} run medians " + " ".join(f"{r['step_s_median'] * 1e3:.1f}" for r in runs) + " ms")
        merged.append({**runs[0], "step_s_median": statistics.median(r["step_s_median"] for r in runs),
                       "step_s_mean": statistics.median(r["step_s_mean"] for r in runs),
                       "peak_mem_gib": max(r["peak_mem_gib"] for r in runs)})  # fmt: skip
    print(f"(below: the median over {args.rounds} rounds of each run's median and mean; the largest peak memory)")
    print_table(merged)
    if args.rounds >= 3:
        print_stepwise(by)


def stepwise_median_mean(runs: list[list[float]]) -> float:
    """The mean over step positions of each position's median over runs (``runs``: each run's
    ``step_s_all``, same length): with 3 or more interleaved rounds, a step stalled in one round by the
    host is out, while the windows and reselections, at the same positions in every round, stay."""
    if len({len(r) for r in runs}) != 1:
        raise ValueError(f"runs of different lengths: {[len(r) for r in runs]}")
    return statistics.fmean(statistics.median(steps) for steps in zip(*runs))


def print_stepwise(by: dict) -> None:
    """Per variant, the full-cycle mean with each step position's median over rounds (stepwise_median_mean),
    beside the plain statistics, and its ratio to the floor's (qfloor's for q* variants) same statistic."""
    stat = {v: stepwise_median_mean([r["step_s_all"] for r in runs]) for v, runs in by.items()}
    print(f"\nmean over step positions of the median over {len(next(iter(by.values())))} rounds (a step stalled in one round is out):")
    for v, value in stat.items():
        base = stat.get("qfloor") if v.startswith("q") and "qfloor" in stat else stat.get("floor")
        ratio = f"{value / base:.3f}" if base else "-"
        print(f"  {v:<16} {value * 1e3:8.1f} ms   × floor {ratio}")


def run_child(args, variant: str, batch_id: str, out: Optional[str]):
    """One variant in a fresh process (``out``: its JSONL file, default the results file): (its full record,
    or None when it failed; the process's stderr)."""
    cmd = [sys.executable, __file__, "--variant", variant, "--size", args.size, "--seq", str(args.seq), "--bs", str(args.bs),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-id", batch_id, "--block", str(args.block),
           "--full-record"]  # fmt: skip
    if args.gc_freeze:
        cmd.append("--gc-freeze")
    if args.training_merge:
        cmd.append("--training-merge")
    if args.no_transient_cuda:
        cmd.append("--no-transient-cuda")
    if args.no_write_lane:
        cmd.append("--no-write-lane")
    if args.ma_signal:
        cmd += ["--ma-signal", args.ma_signal]
    if out:
        cmd += ["--out", out]
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if result.returncode != 0:
        return None, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def settle(args) -> None:
    """Runs of the floor, untimed and not recorded, until ``args.settle`` seconds have passed; each prints
    its forward pass's host time, which shows when the host has stopped speeding up."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        while time.perf_counter() - start < args.settle:
            record, stderr = run_child(args, "floor", "settle", str(Path(scratch) / "settle.jsonl"))
            if record is None:
                raise SystemExit(f"--settle: the floor failed\n{stderr[-3000:]}")
            print(f"settle: floor {record['step_s_median'] * 1e3:.1f} ms per step, forward host "
                  f"{record['phase_ends_ms_median']['forward'][0]:.1f} ms", flush=True)  # fmt: skip


def round_order(variants: list, round_: int) -> list:
    """The order of round ``round_`` (from 0): the given one, the variants after the floors reversed in every
    second round. A variant's place in a round can move its host time (a process started right after another
    may run on a slower host: docs/perf-log.md, 2026-12-07 (seventh)); alternating the order spreads that over
    the variants instead of charging it to the same ones in every round. The floors stay first: each round's
    ratios are taken to its own floor."""
    floors = [v for v in variants if v in ("floor", "qfloor")]
    rest = [v for v in variants if v not in floors]
    return floors + (rest[::-1] if round_ % 2 else rest)


def run_batch(args, variants: list, batch_id: str) -> list:
    """Each variant once, in a fresh process; their records."""
    records = []
    for v in variants:
        record, stderr = run_child(args, v, batch_id, args.out)
        if record is None:
            print(f"{v}: FAILED\n{stderr[-3000:]}", flush=True)
            continue
        records.append(record)
        probe = record.get("host_probe_us") or []
        probe_text = f", host probe {' / '.join(f'{x:.3f}' for x in probe)} µs" if probe else ""
        print(f"{v}: {record['step_s_median']:.3f} s, {record['peak_mem_gib']:.1f} GiB{probe_text}", flush=True)
    return records


if __name__ == "__main__":
    main()
