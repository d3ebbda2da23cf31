"""Training throughput and peak memory per GPU of SpIEL-AG, SpIEL-MA and LoRA under DDP, FSDP2 and DeepSpeed ZeRO.
Produces BENCHMARKS.md, "Two and four GPUs": the tokens/s table and the largest shape (run by benchmarks/multi_gpu.sh).

    torchrun --nproc_per_node 1 benchmarks/multi_gpu_throughput.py --method spiel-ag --size tinyllama --out tp.jsonl
    torchrun --nproc_per_node 2 benchmarks/multi_gpu_throughput.py --engine ddp --method spiel-ag --size tinyllama --out tp.jsonl
    python benchmarks/multi_gpu_throughput.py table tp.jsonl

A Llama-shaped model with random bf16 weights (``--size``: TinyLlama-1.1B, Llama-2-7B, Llama-2-13B or CodeLlama-34B
dimensions), all 7 projections adapted at LoRA r=64's trainable budget (LoRA: r=64 itself; ``--rank``), ``--batch`` sequences
of ``--length`` tokens per GPU and step (weak scaling: the global batch grows with the GPUs), AdamW (SM3 for MA),
SpIEL at S = 20, γ = 5. It times ``--steps`` optimizer steps after ``--warmup`` (the defaults span two reselection
cycles) and appends one JSON line per run from rank 0: tokens/s over all GPUs, median step, peak memory per GPU (the
largest over ranks), or ``"oom": true`` when a rank ran out of memory — so a loop over sizes finds the largest shape
that trains. ``table`` prints tokens/s beside the one-GPU run of the same method and size and the scaling efficiency
(tokens/s on N GPUs ÷ N × tokens/s on one). Under ZeRO-3 the model is built partitioned
(``deepspeed.zero.Init``); under FSDP2 it is built whole on each GPU, then sharded per block
(``peft_sparse.distributed.shard``; LoRA: torch's ``fully_shard``).
``--cpu`` runs the same code on CPU processes with gloo (a smoke run of the script; ``--size tiny --rank 2``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.bench_step import SIZES as STEP_SIZES  # noqa: E402
from benchmarks.bench_step import TARGETS, lora_budget  # noqa: E402
from benchmarks.multi_gpu_equivalence import backward_and_step  # noqa: E402

SIZES = {**STEP_SIZES, "llama2-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                          num_attention_heads=64, num_key_value_heads=8, vocab_size=32000),
         "tiny": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=97)}  # fmt: skip


def run(args) -> None:
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import peft_sparse

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if args.cpu:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl")
        device = torch.device("cuda", torch.cuda.current_device())
    zero = int(args.engine[-1]) if args.engine.startswith("zero") else 0
    if zero:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo" if args.cpu else "nccl", verbose=False)
    shape = SIZES[args.size]
    dtype = torch.float32 if args.cpu else torch.bfloat16
    record = {"engine": args.engine if world > 1 else "single", "world": world, "method": args.method, "size": args.size, "rank": args.rank,
              "batch_per_gpu": args.batch, "length": args.length, "steps": args.steps,
              "device": "cpu" if args.cpu else torch.cuda.get_device_name(device)}  # fmt: skip

    began = time.perf_counter()

    def stage(what: str) -> None:  # (progress on rank 0's stderr: where a large shape spends its start)
        if rank == 0:
            print(f"[{time.perf_counter() - began:7.1f} s] {what}", file=sys.stderr, flush=True)

    def train() -> None:  # (its locals — the model, the optimizer — go when it returns or runs out of memory)
        cfg = LlamaConfig(**shape, max_position_embeddings=max(4096, args.length), tie_word_embeddings=False)
        torch.manual_seed(0)
        build = deepspeed.zero.Init(dtype=dtype) if zero == 3 else (torch.device(device) if not args.cpu else nullcontext())
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # (built in its dtype: 34B dimensions in float32 would not fit one GPU)
        try:
            with build:
                model = LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(previous)
        model = model.to(dtype) if zero != 3 else model
        model = model.to(device) if zero != 3 else model
        model.config.use_cache = False
        stage(f"{args.size} built")
        if args.method == "lora":
            model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=16, target_modules=TARGETS))
        else:
            model = get_peft_model(model, peft_sparse.SpIELConfig(
                target_modules=TARGETS, num_tunable_weights=lora_budget(shape, args.rank), growth=args.method.split("-")[1],
                reselection_steps=20, gradient_estimation_steps=5))  # fmt: skip
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = peft_sparse.SM3(params, lr=1e-3) if args.method == "spiel-ma" else torch.optim.AdamW(params, lr=1e-4)
        engine = None
        if zero:
            engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config={
                "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": zero}, "zero_allow_untested_optimizer": True,
                "bf16": {"enabled": not args.cpu}})  # fmt: skip
            wrapped = engine
        elif args.engine == "fsdp2" and world > 1 and args.method == "lora":  # (LoRA: torch's FSDP2 per block and root)
            from torch.distributed.fsdp import fully_shard

            for block in [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]:
                fully_shard(block)
            wrapped = fully_shard(model)
        elif args.engine == "fsdp2" and world > 1:
            from peft_sparse.distributed import shard

            wrapped = shard(model)
        elif world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            wrapped = DDP(model, device_ids=None if args.cpu else [device.index], broadcast_buffers=False)
        else:
            wrapped = model
        stage("adapter added, engine ready")
        total = args.warmup + args.steps
        scheduler = peft_sparse.SpIELScheduler(model, optimizer, total_steps=total) if args.method.startswith("spiel") else None
        wrapped.train()
        g = torch.Generator().manual_seed(rank)
        times = []
        for step in range(total):
            x = torch.randint(0, shape["vocab_size"], (args.batch, args.length), generator=g).to(device)
            start = time.perf_counter()
            loss = wrapped(input_ids=x, labels=x).loss
            backward_and_step(loss, engine, optimizer)
            if scheduler is not None:
                scheduler.step()
            if not args.cpu:
                torch.cuda.synchronize(device)
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
            if step < 3 or step == total - 1:
                stage(f"step {step} took {time.perf_counter() - start:.2f} s")
        mean = sum(times) / len(times)
        record.update(oom=False, tokens_per_s=args.batch * args.length * world / mean, mean_step_ms=1000 * mean,
                      median_step_ms=1000 * statistics.median(times), last_loss=float(loss))  # fmt: skip

    try:
        train()
    except torch.OutOfMemoryError:
        record.update(oom=True)
    if not args.cpu:  # (what a run out of memory held is freed before the collectives below need memory)
        gc.collect()
        torch.cuda.empty_cache()
    peak = torch.tensor([0.0 if args.cpu else torch.cuda.max_memory_allocated(device) / 2**30], device=device)
    oom = torch.tensor([1.0 if record["oom"] else 0.0], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    dist.all_reduce(oom, op=dist.ReduceOp.MAX)
    record.update(peak_gib_per_gpu=None if args.cpu else round(float(peak), 2), oom=bool(oom.item()))
    if record["oom"]:
        for key in ("tokens_per_s", "mean_step_ms", "median_step_ms", "last_loss"):
            record.pop(key, None)
    if rank == 0:
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def table(path: str) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    one = {(r["method"], r["size"], r["batch_per_gpu"], r["length"]): r for r in rows if r["world"] == 1 and not r["oom"]}
    print("| size | method | engine | GPUs | tokens/s | × one GPU | scaling efficiency | median step | peak GiB per GPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["size"], r["method"], r["world"], r["engine"])):
        if r["oom"]:
            print(f"| {r['size']} | {r['method']} | {r['engine']} | {r['world']} | out of memory | | | | |")
            continue
        base = one.get((r["method"], r["size"], r["batch_per_gpu"], r["length"]))
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        eff = f"{100 * ratio / r['world']:.0f}%" if ratio else ""
        print(f"| {r['size']} | {r['method']} | {r['engine']} | {r['world']} | {r['tokens_per_s']:,.0f} | "
              f"{'' if ratio is None else f'{ratio:.2f}'} | {eff} | {r['median_step_ms']:.0f} ms | {r['peak_gib_per_gpu']} |")  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "table":
        table(sys.argv[2])
        sys.exit()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["ddp", "fsdp2", "zero2", "zero3"], default="ddp", help="on 2 or more GPUs")
    parser.add_argument("--method", choices=["spiel-ag", "spiel-ma", "lora"], default="spiel-ag")
    parser.add_argument("--size", choices=sorted(SIZES), default="tinyllama")
    parser.add_argument("--batch", type=int, default=8, help="sequences per GPU and step")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rank", type=int, default=64, help="LoRA's rank, and the sparse methods' budget as LoRA's at it")
    parser.add_argument("--out", default="multi_gpu_throughput.jsonl")
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU processes (a smoke run; use --size tiny)")
    run(parser.parse_args())
