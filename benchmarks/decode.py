"""Greedy decoding speed with an unmerged adapter, relative to the base model (batch 1).
Produces BENCHMARKS.md, "Decoding with an unmerged adapter".

    python benchmarks/decode.py                          # CPU: the real SmolLM2-135M-Instruct
    python benchmarks/decode.py --device cuda --size tinyllama   # GPU: TinyLlama shapes, random weights, bf16

Variants: ``base`` (no adapter); ``sparse`` (a SparseFTConfig adapter with random non-zero values, unmerged, in a
causal-LM PeftModel: its ``generate`` merges the adapter in place for the call and restores θ₀ after, timed with
it); ``sparse-untyped`` (the same adapter in a PeftModel without a task type, whose ``generate`` goes to the base
model directly: every layer adds its delta unmerged); ``sparse-merged`` (the same, merged); ``sparse-in-block``
(the untyped model, each generate call inside ``peft_sparse.merged_for_inference``); ``lora`` (PEFT LoRA,
unmerged). Every variant generates the same number of new tokens from the same prompt; tokens per second is the
median over rounds, rounds interleaved across variants, the order rotated by one each round (``--order fixed``
keeps it) so that every variant runs in every position: on a host-bound GPU the position in a round has moved
rows doing equal work by 25%. Prints speed relative to ``base`` with each row's spread over the rounds, and
checks that the unmerged sparse adapters' greedy tokens equal the merged model's. "× base, paired" is the median over
rounds of each round's ratio to that round's base run, which a slow spell of the host shared by both does not move.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.device == "cpu" and args.size == "smollm2-135m":
        from peft_sparse.assets import load_model_and_tokenizer

        model, _ = load_model_and_tokenizer("smollm2-135m-instruct")
        return model
    from bench_step import SIZES

    torch.manual_seed(0)
    config = LlamaConfig(**SIZES[args.size], max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device(args.device):
        return LlamaForCausalLM(config).to(torch.bfloat16 if args.device == "cuda" else torch.float32)


def variant(name: str, base, args):
    import copy

    from peft import LoraConfig, get_peft_model

    from peft_sparse import SparseFTConfig, SparseLayer

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    if name == "base":
        return base
    model = copy.deepcopy(base)
    if name == "lora":
        config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets, init_lora_weights=False, task_type="CAUSAL_LM")
        return get_peft_model(model, config).eval()
    task_type = "CAUSAL_LM" if name == "sparse" else None  # (sparse-untyped, -in-block, -merged: a PeftModel)
    peft_model = get_peft_model(model, SparseFTConfig(target_modules=targets, density=args.density, task_type=task_type))
    g = torch.Generator().manual_seed(0)
    for layer in peft_model.modules():
        if isinstance(layer, SparseLayer):
            v = layer.sparse_values["default"]
            with torch.no_grad():
                v.copy_((torch.randn(v.shape, generator=g) * 1e-3).to(v.device))
    if name == "sparse-merged":
        return peft_model.merge_and_unload().eval()
    return peft_model.eval()


@torch.no_grad()
def decode(model, prompt, new_tokens: int, in_block: bool = False):
    from contextlib import nullcontext

    from peft_sparse import merged_for_inference

    start = time.perf_counter()
    with merged_for_inference(model) if in_block else nullcontext():
        out = model.generate(input_ids=prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if prompt.is_cuda:
        torch.cuda.synchronize()
    return new_tokens / (time.perf_counter() - start), out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--size", default="smollm2-135m")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variants", default="base,sparse,sparse-untyped,sparse-merged,sparse-in-block,lora")
    parser.add_argument("--order", choices=("rotate", "fixed"), default="rotate",
                        help="rotate: round r starts at variant r (mod the count); fixed: the --variants order every round")
    parser.add_argument("--profile", default="",
                        help="comma-separated variants: after the rounds, one generate of each under torch.profiler, "
                             "host time per token and the operators taking the most of it")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    names = args.variants.split(",")
    for n in filter(None, args.profile.split(",")):  # (checked before any model is built)
        if n not in names:
            parser.error(f"--profile names {n!r}, which is not among --variants {args.variants!r}")
    base = build(args).eval()
    models = {n: variant(n, base, args) for n in names}
    prompt = torch.randint(10, 1000, (1, 16), generator=torch.Generator().manual_seed(0)).to(args.device)
    speeds = {n: [] for n in names}
    outputs = {}
    for n in names:  # warm-up
        decode(models[n], prompt, 4, n == "sparse-in-block")
    for r in range(args.rounds):
        shift = r % len(names) if args.order == "rotate" else 0
        for n in names[shift:] + names[:shift]:
            tps, out = decode(models[n], prompt, args.new_tokens, n == "sparse-in-block")
            speeds[n].append(tps)
            outputs[n] = out
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{device}; {args.size}; batch 1, greedy, {args.new_tokens} new tokens, median of {args.rounds} rounds, order {args.order}")
    print("| variant | tokens/s | × base | × base, paired | min–max tokens/s |")
    print("|---|---|---|---|---|")
    for n in names:
        tps = statistics.median(speeds[n])
        rel = paired = ""
        if "base" in speeds:
            rel = f"{tps / statistics.median(speeds['base']):.3f}"
            # the median over rounds of the ratio within each round: a slow spell of the host moves both sides
            paired = f"{statistics.median(v / b for v, b in zip(speeds[n], speeds['base'])):.3f}"
        print(f"| {n} | {tps:.1f} | {rel} | {paired} | {min(speeds[n]):.1f}–{max(speeds[n]):.1f} |")
    for n in ("sparse", "sparse-untyped", "sparse-in-block"):
        if n in outputs and "sparse-merged" in outputs:
            print(f"{n} tokens equal the merged model's:", torch.equal(outputs[n], outputs["sparse-merged"]))
    for n in filter(None, args.profile.split(",")):
        profile(models[n], n, prompt, args)


def profile(model, name, prompt, args):
    """One generate under torch.profiler: host (self CPU) time per new token, and the operators taking most of it."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        decode(model, prompt, args.new_tokens, name == "sparse-in-block")
        wall = time.perf_counter() - start
    events = prof.key_averages()
    host_us = sum(e.self_cpu_time_total for e in events)
    print(f"profile {name}: {wall / args.new_tokens * 1e3:.2f} ms per token (profiled), operators' host time "
          f"{host_us / args.new_tokens / 1e3:.2f} ms per token, {sum(e.count for e in events) / args.new_tokens:.0f} operator calls per token")
    for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]:
        print(f"  {e.key[:60]:60s} {e.count / args.new_tokens:7.1f} calls/token {e.self_cpu_time_total / args.new_tokens:9.1f} us/token")


if __name__ == "__main__":
    main()
