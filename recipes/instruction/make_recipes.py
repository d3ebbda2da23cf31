"""Writes the instruction-tuning recipes: every method × dataset, at thesis ch. 7's settings (§7.4.3, Table 7.1).

    python recipes/instruction/make_recipes.py            # rewrites recipes/instruction/*.yaml

Llama-2-7B by hub name (``--size 13b`` for Llama-2-13B's Table 7.1 column). Two epochs, linear decay after 3%
warmup, effective batch 128 (4 × 32 accumulation on one GPU), sequences up to 2,048 tokens, bfloat16 base
weights; LoRA r = 64, α = 16, dropout 0.1 on all linear block layers and SpIEL at the same trainable count
(S = 20, ξ = 0.2, γ = 5); AG with AdamW, MA with SM3; full fine-tuning at 2e-5 with activation checkpointing and
a paged optimiser. The quantized variants (qSpIEL, QLoRA) load NF4 base weights and keep the trainable values in
bfloat16, as the thesis does.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent

MODELS = {
    "7b": {"source": "meta-llama/Llama-2-7b-hf", "budget": 159_907_840},  # LoRA r64 on all 7 projections × 32 blocks
    "13b": {"source": "meta-llama/Llama-2-13b-hf", "budget": 250_347_520},  # × 40 blocks, hidden 5120
}
# Table 7.1: (learning rate, weight decay λ) per method and size
TABLE = {
    "spiel_ag": {"7b": (1e-4, 30.0), "13b": (1e-5, 30.0)},
    "spiel_ma": {"7b": (1e-3, 0.3), "13b": (4e-4, 0.0)},
    "lora": {"7b": (1e-4, 0.0), "13b": (3e-5, 0.0)},
    "full": {"7b": (2e-5, 0.0), "13b": (2e-5, 0.0)},
}
# the data: the Tulu v2 mixture names each row's source in its `dataset` column
DATASETS = {
    "flan_v2": {"train": "hub:allenai/tulu-v2-sft-mixture", "subset": "flan_v2"},
    "gpt4_alpaca": {"train": "hub:allenai/tulu-v2-sft-mixture", "subset": "gpt4_alpaca"},
    "tulu_v2": {"train": "hub:allenai/tulu-v2-sft-mixture"},
}
METHODS = ("spiel_ag", "spiel_ma", "qspiel_ag", "qspiel_ma", "lora", "qlora", "full")


def method_section(method: str, budget: int) -> dict:
    base = method.removeprefix("q") if method.startswith("qspiel") or method == "qlora" else method
    if base.startswith("spiel"):
        section = {"peft_type": "SPIEL", "growth": base[-2:], "target_modules": "all-linear", "num_tunable_weights": budget,
                   "reselection_steps": 20, "gradient_estimation_steps": 5, "initial_reselection_rate": 0.2, "schedule": "linear"}  # fmt: skip
        if method.startswith("q"):
            section["values_dtype"] = "bfloat16"
        return section
    if base == "lora":
        return {"peft_type": "LORA", "r": 64, "lora_alpha": 16, "lora_dropout": 0.1, "target_modules": "all-linear"}
    return {"peft_type": "FULL"}


def recipe(method: str, dataset: str, size: str) -> dict:
    table = TABLE[method.removeprefix("q") if method != "qlora" else "lora"][size]
    lr, weight_decay = table
    model = {"source": MODELS[size]["source"], "dtype": "bfloat16"}
    if method.startswith("q"):
        model["quantization"] = "nf4"
    training = {
        "output_dir": f"outputs/llama2-{size}-{method}-{dataset}",
        "num_train_epochs": 2, "learning_rate": lr, "weight_decay": weight_decay, "lr_scheduler_type": "linear",
        "warmup_steps": 0.03, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 32, "max_length": 2048,
        "bf16": True, "logging_steps": 10, "save_strategy": "steps", "save_steps": 500, "report_to": "none", "seed": 0,
    }  # fmt: skip
    if method == "full":
        training.update({"gradient_checkpointing": True, "optim": "paged_adamw_32bit"})
    if method.endswith("spiel_ma"):
        training["optim"] = "sm3"  # (the thesis's pairing; the recipe runner's default for MA is AdamW)
    return {"model": model, "method": method_section(method, MODELS[size]["budget"]), "data": dict(DATASETS[dataset]), "training": training}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(MODELS), default="7b")
    parser.add_argument("--out", default=str(HERE))
    args = parser.parse_args(argv)
    for method in METHODS:
        for dataset in DATASETS:
            path = Path(args.out) / f"{method}-{dataset}.yaml"
            header = (
                f"# {method} on {dataset}, Llama-2-{args.size} (thesis §7.4.3, Table 7.1); written by make_recipes.py.\n"
                "# Smoke run offline (SmolLM2, the bundled chats, 2 steps on CPU):\n"
                "#   peft-sparse train THIS --set model.source=smollm2-135m-instruct --set model.quantization=null\n"
                "#     --set data.train=../data/skills_train.jsonl --set data.subset=null --set training.max_steps=2\n"
                "#     --set training.use_cpu=true --set training.bf16=false\n"
                + ("#     --set method.num_tunable_weights=4884480   (LoRA r16's count on SmolLM2)\n" if "spiel" in method else "")
                + ("#     --set training.gradient_checkpointing=false --set training.optim=adamw_torch\n" if method == "full" else "")
            )
            path.write_text(header + yaml.safe_dump(recipe(method, dataset, args.size), sort_keys=False))


if __name__ == "__main__":
    main()
