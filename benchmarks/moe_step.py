"""Training-step time and peak memory at real mixture-of-experts layer shapes: the frozen floor, LoRA on the fused
expert tensors (PEFT's ``target_parameters``, r = 16), and SpIEL-AG and SFT on the same tensors at LoRA's trainable
count. Produces docs/moe.md, "Step time and memory" (one table per GPU).

Shapes (random weights, bf16, the real vocabulary and attention, a few decoder layers):

* ``mixtral-8x7b``: E = 8 experts of which 2 per token, hidden 4096, expert intermediate 14336; 2 layers;
* ``qwen3-30b-a3b``: E = 128 experts of which 8 per token, hidden 2048, expert intermediate 768; 4 layers.

Every variant trains only the expert tensors (attention and router frozen), with AdamW, on 4×1024 random tokens per
step; 3 warm-up steps, then ``--steps`` timed steps (median and mean; SpIEL reselects every 5 steps after a 2-step
estimation window, so the timed steps hold windows and reselections). Peak memory is
``torch.cuda.max_memory_allocated()`` over the timed steps. The experts run transformers' default
``grouped_mm`` implementation.

    python benchmarks/moe_step.py --out $OUT/moe.jsonl                 # GPU: both shapes, every variant (≤ 5 min on an H100)
    python benchmarks/moe_step.py --quick --out /tmp/moe-quick.jsonl   # CPU smoke test at toy shapes
    python benchmarks/moe_step.py --table results.jsonl                # the markdown table of a results file
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
SHAPES = {
    "mixtral-8x7b": dict(family="mixtral", layers=2, hidden_size=4096, intermediate_size=14336, experts=8, top_k=2,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000),
    "qwen3-30b-a3b": dict(family="qwen3_moe", layers=4, hidden_size=2048, intermediate_size=768, experts=128, top_k=8,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936),
    # --quick (CPU): the same code at toy shapes
    "toy-mixtral": dict(family="mixtral", layers=2, hidden_size=64, intermediate_size=96, experts=4, top_k=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
    "toy-qwen3": dict(family="qwen3_moe", layers=2, hidden_size=64, intermediate_size=32, experts=8, top_k=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256),
}  # fmt: skip
VARIANTS = ("floor", "lora", "spiel-ag", "sft")
RANK = 16
S, GAMMA = 5, 2


def build(shape: str, device: str, dtype):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    s = dict(SHAPES[shape])
    common = dict(hidden_size=s["hidden_size"], num_hidden_layers=s["layers"], num_attention_heads=s["num_attention_heads"],
                  num_key_value_heads=s["num_key_value_heads"], vocab_size=s["vocab_size"], max_position_embeddings=4096,
                  tie_word_embeddings=False, use_cache=False)  # fmt: skip
    if s["family"] == "mixtral":
        config = MixtralConfig(**common, intermediate_size=s["intermediate_size"], num_local_experts=s["experts"], num_experts_per_tok=s["top_k"])
        cls = MixtralForCausalLM
    else:
        config = Qwen3MoeConfig(**common, head_dim=s["head_dim"], moe_intermediate_size=s["intermediate_size"], num_experts=s["experts"],
                                num_experts_per_tok=s["top_k"], decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
        cls = Qwen3MoeForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = cls._from_config(config, torch_dtype=dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def lora_budget(model) -> int:
    """LoRA r=16's trainable count on the expert tensors: r·E·(rows + cols) per tensor."""
    total = 0
    for name, p in model.named_parameters():
        if any(name.endswith(t) for t in EXPERTS):
            total += RANK * p.shape[0] * (p.shape[1] + p.shape[2])
    return total


def prepare(variant: str, model, budget: int):
    import torch
    from peft import LoraConfig, get_peft_model

    from peft_sparse import SparseFTConfig, SpIELConfig, SpIELScheduler

    if variant == "floor":
        model.enable_input_require_grads()
        return model, None, None
    if variant == "lora":
        model = get_peft_model(model, LoraConfig(target_modules=[], target_parameters=EXPERTS, r=RANK, lora_alpha=2 * RANK))
    elif variant == "spiel-ag":
        model = get_peft_model(model, SpIELConfig(target_parameters=EXPERTS, num_tunable_weights=budget, reselection_steps=S,
                                                  gradient_estimation_steps=GAMMA))  # fmt: skip
    elif variant == "sft":
        model = get_peft_model(model, SparseFTConfig(target_parameters=EXPERTS, num_tunable_weights=budget))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    return model, optimizer, trainable


def run(shape: str, variant: str, args, device: str, dtype) -> dict:
    import torch

    from peft_sparse import SpIELScheduler

    cuda = device == "cuda"
    model = build(shape, device, dtype)
    budget = lora_budget(model)
    model, optimizer, trainable = prepare(variant, model, budget)
    total = args.warmup + args.steps
    scheduler = SpIELScheduler(model, optimizer, total_steps=total) if variant == "spiel-ag" else None
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, SHAPES[shape]["vocab_size"], (args.batch, args.length), generator=g).to(device)
    model.train()
    times = []
    for step in range(total):
        if step == args.warmup and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    row = {
        "shape": shape, "variant": variant, **{k: v for k, v in SHAPES[shape].items() if k != "family"},
        "tokens_per_step": args.batch * args.length, "trainable": sum(p.numel() for p in trainable) if trainable else 0,
        "lora_r16_budget": budget, "step_s_median": statistics.median(times), "step_s_mean": statistics.mean(times),
        "timed_steps": len(times), "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
        "experts_implementation": model.config._experts_implementation if hasattr(model, "config") else None,
    }  # fmt: skip
    del model, optimizer, trainable, scheduler, loss
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def table(rows: list) -> str:
    out = ["| shape | variant | trainable | step (ms, median) | × floor | mean × floor | peak GiB | × floor mem |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mine = {r["variant"]: r for r in rows if r["shape"] == shape}
        floor = mine.get("floor")
        for variant in VARIANTS:
            r = mine.get(variant)
            if r is None:
                continue
            speed = f"{r['step_s_median'] / floor['step_s_median']:.2f}" if floor else "–"
            mean = f"{r['step_s_mean'] / floor['step_s_mean']:.2f}" if floor else "–"
            peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "–"
            mem = f"{r['peak_gib'] / floor['peak_gib']:.2f}" if floor and r["peak_gib"] and floor["peak_gib"] else "–"
            out.append(f"| {shape} | {variant} | {r['trainable']:,} | {1e3 * r['step_s_median']:.1f} | {speed} | {mean} | {peak} | {mem} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="append one JSON line per (shape, variant)")
    parser.add_argument("--quick", action="store_true", help="CPU smoke test at toy shapes, float32")
    parser.add_argument("--shapes", nargs="+", default=None, choices=list(SHAPES))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--table", type=Path, help="print the markdown table of a results file and exit")
    args = parser.parse_args()
    if args.table:
        print(table([json.loads(line) for line in args.table.read_text().splitlines() if line.strip()]))
        return
    import torch

    if args.quick:
        device, dtype = "cpu", torch.float32
        shapes = args.shapes or ["toy-mixtral", "toy-qwen3"]
        args.length, args.steps, args.warmup = min(args.length, 32), min(args.steps, 6), min(args.warmup, 1)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("moe_step.py needs a CUDA device (or --quick for the CPU smoke test)")
        device, dtype = "cuda", torch.bfloat16
        shapes = args.shapes or ["mixtral-8x7b", "qwen3-30b-a3b"]
    rows = []
    for shape in shapes:
        for variant in args.variants:
            row = run(shape, variant, args, device, dtype)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
