"""SpIEL on 2 GPUs × batch b against 1 GPU × batch 2b, same data order: identical indices, close values.
Produces BENCHMARKS.md, "Two and four GPUs": same indices as one GPU (run by benchmarks/multi_gpu.sh).

    torchrun --nproc_per_node 1 benchmarks/multi_gpu_equivalence.py run --out /tmp/eq/one
    torchrun --nproc_per_node 2 benchmarks/multi_gpu_equivalence.py run --out /tmp/eq/two   # --engine fsdp2|zero2|zero3
    python benchmarks/multi_gpu_equivalence.py compare /tmp/eq/one /tmp/eq/two

A random Llama-shaped model (4 blocks, hidden 256) in float32, all 7 projections, 50 optimizer steps with
reselections every 20 (γ = 5), so the run spans two reselections after the first. Every step draws a global
batch of ``2b`` sequences from a generator seeded by the step; rank r of n takes its contiguous share, and DDP
averages the gradients, so both runs see the same global gradient. AG (AdamW) and MA (SM3) run one after the
other; ``ma-adamw`` is MA beside AdamW (the scheduler's accumulators), the one MA that runs under DeepSpeed ZeRO
(``--engine zero2 --growth ag ma-adamw``). ``compare`` prints, per growth rule, the share of identical indices and the largest value difference,
and checks that every rank of the 2-GPU run holds the same indices.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def backward_and_step(loss, engine, optimizer) -> None:
    """One optimizer step from ``loss``: through DeepSpeed's engine (which averages, steps and clears the gradients
    itself) when there is one, else backward, step and cleared gradients."""
    if engine is not None:
        engine.backward(loss)
        engine.step()
        return
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run(args) -> None:
    import torch.distributed as dist
    from peft import get_peft_model
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import LlamaConfig, LlamaForCausalLM

    from peft_sparse import SM3, SparseLayer, SpIELConfig, SpIELScheduler

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.cpu:  # (a smoke run of the script itself: gloo on CPU processes)
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl")
        device = torch.device("cuda", rank)
    zero = int(args.engine[-1]) if args.engine.startswith("zero") else 0
    if zero:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo" if args.cpu else "nccl", verbose=False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    report = {}
    for growth in args.growth:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.intermediate,
                             num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                             max_position_embeddings=128, tie_word_embeddings=False)  # fmt: skip
        base = LlamaForCausalLM(config).to(device)
        spiel = SpIELConfig(
            target_modules="all-linear", density=0.02, growth=growth.split("-")[0], reselection_steps=20, gradient_estimation_steps=5
        )
        model = get_peft_model(base, spiel)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = SM3(params, lr=1e-2) if growth == "ma" else torch.optim.AdamW(params, lr=1e-3)
        engine = None
        if zero and world > 1:  # DeepSpeed ZeRO: its engine averages the gradients and partitions the state
            engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config={
                "train_micro_batch_size_per_gpu": args.global_batch // world, "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": zero}, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0})  # fmt: skip
            wrapped = engine
        elif args.engine == "fsdp2" and world > 1:
            from peft_sparse.distributed import shard

            wrapped = shard(model)
        else:
            wrapped = DDP(model, device_ids=None if args.cpu else [rank], broadcast_buffers=False) if world > 1 else model
        scheduler = SpIELScheduler(model if engine is not None else wrapped, optimizer, total_steps=args.steps)
        share = args.global_batch // world
        losses = []
        wrapped.train()
        for step in range(args.steps):
            g = torch.Generator().manual_seed(1000 + step)
            x = torch.randint(0, 1024, (args.global_batch, args.length), generator=g)[rank * share : (rank + 1) * share].to(
                device
            )
            loss = wrapped(input_ids=x, labels=x).loss
            backward_and_step(loss, engine, optimizer)
            scheduler.step()
            losses.append(loss.item())
        layers = [m for m in model.modules() if isinstance(m, SparseLayer)]
        if zero == 3 and world > 1:  # (partitioned values: whole on every rank for the record)
            gathered = deepspeed.zero.GatheredParameters([m.sparse_values["default"] for m in layers])
            gathered.__enter__()
        torch.save(
            {
                "indices": [l.sparse_indices["default"].cpu() for l in layers],
                "values": [l.sparse_values["default"].detach().cpu() for l in layers],
            },
            out / f"{growth}-rank{rank}.pt",
        )
        if zero == 3 and world > 1:
            gathered.__exit__(None, None, None)
        report[growth] = {"steps": scheduler.t, "first_loss": losses[0], "last_loss": losses[-1],
                          "peak_memory_mib": None if args.cpu else torch.cuda.max_memory_allocated(device) / 2**20}  # fmt: skip
        del wrapped, model, base, optimizer, scheduler, engine
        if not args.cpu:
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.empty_cache()
    if rank == 0:
        (out / "run.json").write_text(
            json.dumps({"world": world, "engine": args.engine, "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
                        "report": report}, default=str)  # fmt: skip
        )
    dist.barrier()
    dist.destroy_process_group()


def compare(args) -> None:
    one, two = Path(args.one), Path(args.two)
    result = {}
    for growth in ("ag", "ma", "ma-adamw"):
        if not (one / f"{growth}-rank0.pt").exists() or not (two / f"{growth}-rank0.pt").exists():  # (--growth ag)
            continue
        a = torch.load(one / f"{growth}-rank0.pt")
        ranks = sorted(two.glob(f"{growth}-rank*.pt"))
        b = [torch.load(p) for p in ranks]
        same_ranks = all(torch.equal(x, y) for other in b[1:] for x, y in zip(b[0]["indices"], other["indices"]))
        total = sum(i.numel() for i in a["indices"])
        equal = sum(int(torch.isin(i, j).sum()) for i, j in zip(a["indices"], b[0]["indices"]))
        identical = all(torch.equal(i, j) for i, j in zip(a["indices"], b[0]["indices"]))
        diff = max(
            float((u - v).abs().max())
            for u, v, i, j in zip(a["values"], b[0]["values"], a["indices"], b[0]["indices"])
            if torch.equal(i, j)
        )
        scale = max(float(u.abs().max()) for u in a["values"])
        result[growth] = {"ranks_identical": same_ranks, "indices_identical": identical, "shared_fraction": equal / total,
                          "max_value_diff": diff, "max_value": scale}  # fmt: skip
        print(f"{growth}: ranks identical {same_ranks}; indices identical to 1 GPU {identical} ({equal / total:.6f} shared); "
              f"max |Δvalue| {diff:.3g} (max |value| {scale:.3g})")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--steps", type=int, default=50)
    r.add_argument("--global-batch", type=int, default=8)
    r.add_argument("--length", type=int, default=64)
    r.add_argument("--hidden", type=int, default=256)
    r.add_argument("--intermediate", type=int, default=688)
    r.add_argument("--layers", type=int, default=4)
    r.add_argument("--growth", nargs="+", choices=["ag", "ma", "ma-adamw"], default=["ag", "ma"])
    r.add_argument("--engine", choices=["ddp", "fsdp2", "zero2", "zero3"], default="ddp",
                   help="how 2 or more GPUs share the work (DeepSpeed ZeRO: ag, ma-adamw)")
    r.add_argument("--cpu", action="store_true", help="gloo on CPU processes: a smoke run of this script")
    c = sub.add_parser("compare")
    c.add_argument("one")
    c.add_argument("two")
    args = parser.parse_args()
    run(args) if args.command == "run" else compare(args)
