"""Host-side (Python + dispatcher) cost of a training step, measured on CPU with tiny tensors.

    python benchmarks/host_overhead.py [--variants floor,lora,spiel-ma,spiel-ag] [--steps 30]

With hidden size 64 the arithmetic is negligible, so the step time is what every step must spend
issuing work, per layer and in total — what bounds a GPU step once kernels get short. Same layer
count and targets as the GPU benchmark (TinyLlama's 22 layers, 7 projections). ``qfloor``,
``qspiel-ma`` and ``qspiel-ag``: the same model with bitsandbytes' 4-bit layers (nf4, double
quantization, float32 compute: its CPU path), so what they measure is Python and dispatch around
bitsandbytes' CPU dequantization, not the GPU path's fused launch.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/ and the repository

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(variant: str, density: float = 0.05):
    """(model, optimizer or None, scheduler or None) of a variant: ``floor``, ``lora``, ``spiel-ma``,
    ``spiel-ag`` (``-block``: 16×16 blocks), each with a ``q`` prefix for the 4-bit model; the SpIEL
    variants at ``density``, their scheduler past its windows (steady steps)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import peft_sparse

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=22, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    if variant.startswith("q"):
        import tempfile

        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                          bnb_4bit_compute_dtype=torch.float32)  # fmt: skip
        with tempfile.TemporaryDirectory() as path:
            model.save_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, device_map="cpu")
        variant = variant[1:]
    for p in model.parameters():
        p.requires_grad_(False)
    if variant == "floor":
        model.enable_input_require_grads()
        return model, None, None
    if variant == "lora":
        model = get_peft_model(model, LoraConfig(r=8, target_modules=TARGETS))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        return model, optimizer, None
    growth = variant.split("-")[1]
    block_shape = (16, 16) if variant.endswith("-block") else (1, 1)
    config = peft_sparse.SpIELConfig(target_modules=TARGETS, density=density, growth=growth, block_shape=block_shape)
    model = get_peft_model(model, config)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = peft_sparse.SM3(params, lr=1e-3) if growth == "ma" else torch.optim.AdamW(params, lr=1e-4)
    scheduler = peft_sparse.SpIELScheduler(model, optimizer, total_steps=10_000)
    scheduler.t = 100  # a steady step: no window, no reselection
    scheduler._disarm()
    return model, optimizer, scheduler  # kept alive: a SpIEL model trained with no scheduler warns


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="floor,lora,spiel-ma,spiel-ag")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ids = torch.randint(0, 128, (2, 16))
    for variant in args.variants.split(","):
        model, optimizer, scheduler = build(variant)
        model.train()
        times = []
        for step in range(args.steps + 5):
            start = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if step >= 5:
                times.append(time.perf_counter() - start)
        print(f"{variant:10s} {1e3 * statistics.median(times):7.1f} ms per step (median of {args.steps})", flush=True)


if __name__ == "__main__":
    main()
