"""The table of docs/serving.md ("The main job's adapter as a LoRA"): the main job's SpIEL adapter
(``peft-sparse train recipes/smollm2_spiel.yaml``: SmolLM2-135M-Instruct, 60 steps, CPU) converted to LoRA by
``peft_sparse.convert_to_lora`` at several ranks, each scored beside the sparse adapter and the merged model.

    OMP_NUM_THREADS=1 python benchmarks/lora_conversion.py --out benchmarks/results/DATE-cpu-lora-conversion.jsonl
    python benchmarks/lora_conversion.py --adapter outputs/smollm2-spiel/adapter      # a saved main-job adapter

(one intra-op thread when the CPU is shared: oversubscribed threads slow the training steps many times over.)
For every row: the relative error of the delta over all adapted tensors, √(Σ‖ΔW − BA‖² / Σ‖ΔW‖²) (0 for the sparse
adapter and the merged model), the worst single tensor's, the adapter's parameter count, exact match on the
recipe's held-out set (all of its items, greedy, as the main job scores), the share of answers identical to the
sparse adapter's, and the mean loss of the reference answers' tokens given their prompts (teacher-forced, the
chat template as in training) — finer than exact match on few items. Writes one JSONL line per row (the first:
the run's settings).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]

DEFAULT_RANKS = ["1", "2", "4", "8", "16", "64", "192", "0.9", "1.0"]  # (192: the smaller side of SmolLM2-135M's k/v projections)


def _rank(text: str):
    return float(text) if "." in text else int(text)


def answer_loss(model, tokenizer, rows) -> float:
    """Mean cross-entropy of the reference answers' tokens (end-of-turn included) given their prompts."""
    import torch

    total, count = 0.0, 0
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"]
        full = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=True)["input_ids"]
        assert full[: len(prompt)] == prompt, "the chat template does not extend the prompt"
        ids = torch.tensor([full], device=model.device)
        labels = ids.clone()
        labels[:, : len(prompt)] = -100
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, :-1].float()
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:], reduction="none", ignore_index=-100)
        total, count = total + float(losses.sum()), count + int((labels[:, 1:] != -100).sum())
    return total / count


def delta_errors(model, state_dict) -> dict:
    """The converted LoRA's B·A against each sparse layer's exact delta: overall and worst relative error."""
    from peft_sparse import SparseLayer

    num = den = 0.0
    worst = 0.0
    for name, layer in model.named_modules():
        if not isinstance(layer, SparseLayer):
            continue
        delta = layer.logical_delta("default").double()  # (out, in)
        if f"{name}.lora_A.weight" in state_dict:
            # (out, in), Conv1D's too: PEFT orients a Conv1D's factors as LoRA's fan_in_fan_out layer takes them
            approx = state_dict[f"{name}.lora_B.weight"].double() @ state_dict[f"{name}.lora_A.weight"].double()
        else:  # an embedding: (B_e A_e)ᵀ
            approx = (state_dict[f"{name}.lora_embedding_B"].double() @ state_dict[f"{name}.lora_embedding_A"].double()).t()
        err, norm = float((delta - approx).pow(2).sum()), float(delta.pow(2).sum())
        num, den = num + err, den + norm
        worst = max(worst, (err / norm) ** 0.5 if norm else 0.0)
    return {"delta_rel_error": (num / den) ** 0.5, "delta_rel_error_worst_tensor": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=HERE.parent / "recipes" / "smollm2_spiel.yaml")
    parser.add_argument("--adapter", type=Path, help="a saved adapter of the recipe (default: train the recipe first)")
    parser.add_argument("--train-dir", type=Path, help="train into this folder and keep it (default: a temporary one)")
    parser.add_argument("--ranks", nargs="+", default=DEFAULT_RANKS, help="int ranks, or floats in (0, 1]: the energy kept per tensor")
    parser.add_argument("--out", type=Path, help="write the rows to this JSONL file")
    args = parser.parse_args()

    import torch
    from peft import PeftModel, get_peft_model, set_peft_model_state_dict

    from peft_sparse import convert_to_lora
    from peft_sparse.assets import load_model_and_tokenizer
    from peft_sparse.evaluation import exact_match
    from peft_sparse.recipe import load_recipe, read_rows, run_recipe

    started = time.time()
    tmp = tempfile.TemporaryDirectory()
    recipe = load_recipe(args.recipe, overrides={"training.output_dir": str(args.train_dir or tmp.name)})
    header = {"recipe": str(args.recipe.relative_to(HERE.parent)) if args.recipe.is_relative_to(HERE.parent) else str(args.recipe),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    if args.adapter is None:
        summary = run_recipe(recipe)
        adapter_dir = Path(summary["adapter_dir"])
        header.update(trained_here=True, train_runtime_s=summary["train_runtime_s"], main_job_exact_match=summary["after"]["accuracy"])
    else:
        adapter_dir = args.adapter
        header.update(trained_here=False, adapter=str(adapter_dir))

    rows_eval = [r for r in read_rows(recipe.data["eval"]) if "answer" in r]
    ev = recipe.evaluation
    eval_kwargs = {"max_new_tokens": ev.get("max_new_tokens", 8), "batch_size": ev.get("batch_size", 16)}
    base, tokenizer = load_model_and_tokenizer(**recipe.model)
    base.eval()
    pristine = copy.deepcopy(base)
    header.update(held_out_items=len(rows_eval), **eval_kwargs)
    rows = [header]

    def score(model, variant, reference=None, **extra):
        t = time.time()
        with torch.no_grad():
            result = exact_match(model, tokenizer, rows_eval, **eval_kwargs)
        replies = [item["reply"] for item in result["items"]]
        loss = answer_loss(model, tokenizer, rows_eval)
        row = {"variant": variant, **extra, "exact_match": result["accuracy"], "correct": result["correct"], "total": result["total"],
               "answer_loss": loss,
               "same_answers_as_sparse": None if reference is None else sum(a == b for a, b in zip(replies, reference)) / len(replies),
               "eval_s": round(time.time() - t, 1)}  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
        return replies

    score(copy.deepcopy(pristine), "base model")
    sparse = PeftModel.from_pretrained(copy.deepcopy(pristine), str(adapter_dir)).eval()
    d_phi = sum(p.numel() for n, p in sparse.named_parameters() if "sparse_values" in n)
    reference = score(sparse, "sparse adapter", params=d_phi, delta_rel_error=0.0, delta_rel_error_worst_tensor=0.0)
    for text in args.ranks:
        rank = _rank(text)
        t = time.time()
        lora_config, state_dict = convert_to_lora(sparse, rank=rank)
        convert_s = time.time() - t
        errors = delta_errors(sparse, state_dict)
        lora = get_peft_model(copy.deepcopy(pristine), lora_config).eval()
        loaded = set_peft_model_state_dict(lora, state_dict)
        assert not loaded.unexpected_keys, loaded.unexpected_keys
        params = sum(v.numel() for k, v in state_dict.items() if "lora_" in k)
        ranks = sorted(set(lora_config.rank_pattern.values()) or {lora_config.r})
        score(lora, f"LoRA rank {text}", reference, rank=rank, rank_range=[ranks[0], ranks[-1]], params=params,
              convert_s=round(convert_s, 1), **errors)  # fmt: skip
        del lora, state_dict
    merged = sparse.merge_and_unload()
    score(merged, "merged model", reference, delta_rel_error=0.0, delta_rel_error_worst_tensor=0.0)
    rows[0]["total_s"] = round(time.time() - started)

    print("\n| adapter | parameters | relative error of the delta (worst tensor) | exact match | answers as the sparse adapter's | answer loss |\n|---|---|---|---|---|---|")
    for r in rows[1:]:
        params = f"{r['params'] / 1e6:.1f} M" if r.get("params") else "–"
        error = "–" if r.get("delta_rel_error") is None else f"{r['delta_rel_error']:.3f} ({r['delta_rel_error_worst_tensor']:.3f})"
        same = "–" if r["same_answers_as_sparse"] is None else f"{100 * r['same_answers_as_sparse']:.0f}%"
        print(f"| {r['variant']} | {params} | {error} | {100 * r['exact_match']:.1f}% ({r['correct']}/{r['total']}) | {same} | {r['answer_loss']:.3f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
