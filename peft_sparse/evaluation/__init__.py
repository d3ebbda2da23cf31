"""Evaluation: exact match of short-answer instruction items (below) and the instruction-tuning benchmark suite
(:mod:`.suite`: MMLU, GSM, BBH, TyDiQA, HumanEval as in thesis App. E.1)."""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch

from ..core.merging import merged_for_inference


def normalize(text: str) -> str:
    """First line of the reply, stripped of surrounding whitespace, quotes and a final period."""
    line = text.strip().split("\n")[0].strip()
    return line.strip("'\"` ").rstrip(".").strip()


@torch.no_grad()
def generate_answers(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int = 8, batch_size: int = 16) -> list[str]:
    """Greedy replies to chat prompts (lists of messages), batched with left padding."""
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    was_training = model.training
    model.eval()
    replies = []
    merged = contextlib.ExitStack()
    try:
        merged.enter_context(merged_for_inference(model))  # (the adapters merged in place while generating, θ₀ restored after)
        from tqdm.auto import tqdm

        # (a bar on a terminal; none when the output is a file or a test)
        for start in tqdm(range(0, len(prompts), batch_size), desc="evaluating", unit="batch", disable=None, leave=False):
            texts = [
                tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                for p in prompts[start : start + batch_size]
            ]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            out = model.generate(
                **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
            replies += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        merged.close()
        tokenizer.padding_side = side
        model.train(was_training)
    return replies


def exact_match(model, tokenizer, rows: list[dict], max_new_tokens: int = 8, batch_size: int = 16) -> dict:
    """Accuracy overall and per skill on rows with ``prompt`` (messages), ``answer`` and ``skill``."""
    replies = generate_answers(model, tokenizer, [r["prompt"] for r in rows], max_new_tokens, batch_size)
    per_skill = defaultdict(lambda: [0, 0])
    results = []
    for row, reply in zip(rows, replies):
        ok = normalize(reply) == row["answer"]
        per_skill[row.get("skill", "all")][0] += ok
        per_skill[row.get("skill", "all")][1] += 1
        results.append({"prompt": row["prompt"][-1]["content"], "answer": row["answer"], "reply": reply, "correct": ok})
    correct = sum(r["correct"] for r in results)
    return {
        "accuracy": correct / max(1, len(results)),
        "correct": correct,
        "total": len(results),
        "per_skill": {k: v[0] / v[1] for k, v in sorted(per_skill.items())},
        "items": results,
    }
