"""Composition of instruction adapters by addition (thesis Table 7.2: Tülu v2 ⊕ GPT4-Alpaca).

Trains two sparse adapters with their recipes (``peft-sparse train``, the same runner), adds them,
θ + φ_a + φ_b (``peft_sparse.transfer.compose``; ``merge_and_unload`` gives the same model), and scores
the base model, each adapter and the sum on every evaluation set given, in one table.

    # the thesis's pair, on a GPU (evaluation data: local JSONL files of the suite's tasks)
    python recipes/instruction/compose.py spiel_ag-tulu_v2.yaml spiel_ag-gpt4_alpaca.yaml \\
        --suite mmlu=mmlu.jsonl --suite gsm=gsm.jsonl
    # already trained adapters: only compose and score
    python recipes/instruction/compose.py A.yaml B.yaml --adapters outputs/a/adapter outputs/b/adapter --eval skills=../data/skills_test.jsonl
    # offline, on CPU: SmolLM2, one bundled task per adapter, scored on both tasks
    python recipes/instruction/compose.py --smoke

``--eval NAME=FILE`` scores exact match on rows with ``prompt`` (chat messages) and ``answer``;
``--suite TASK=FILE`` runs an evaluation-suite task (mmlu, gsm, bbh, tydiqa, humaneval) on local items.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

SMOKE = {  # offline: the bundled skills tasks stand in for the two instruction datasets
    "recipes": [str(HERE / "spiel_ag-tulu_v2.yaml"), str(HERE / "spiel_ag-gpt4_alpaca.yaml")],
    "common": {
        "model.source": "smollm2-135m-instruct", "model.dtype": "float32", "model.quantization": None, "data.subset": None,
        "method.num_tunable_weights": 4884480, "training.max_steps": 60, "training.num_train_epochs": 1,
        "training.per_device_train_batch_size": 8, "training.gradient_accumulation_steps": 1, "training.learning_rate": 0.001,
        "training.weight_decay": 0.0, "training.max_length": 128, "training.use_cpu": True, "training.bf16": False,
        "training.save_strategy": "no",
    },
    "per_recipe": [
        {"data.train": "../data/skills_train.jsonl", "training.output_dir": "outputs/compose-smoke/a"},
        {"data.train": "../data/skills2_train.jsonl", "training.output_dir": "outputs/compose-smoke/b"},
    ],
    "eval": {"skills": str(HERE.parent / "data" / "skills_test.jsonl"), "skills2": str(HERE.parent / "data" / "skills2_test.jsonl")},
}  # fmt: skip


def _pairs(items, flag: str) -> dict:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"{flag} expects NAME=FILE, got {item!r}")
        name, path = item.split("=", 1)
        if not Path(path).is_file():
            raise SystemExit(f"{flag} {item}: no such file {path}")
        out[name] = path
    return out


def score(model, tokenizer, evals: dict, suites: dict, shots: dict, batch_size: int, allow_code_execution: bool = False) -> dict:
    from peft_sparse.evaluation import exact_match
    from peft_sparse.evaluation import suite as suite_tasks

    out = {}
    for name, path in evals.items():
        rows = [json.loads(line) for line in open(path) if line.strip()]
        out[name] = exact_match(model, tokenizer, rows, max_new_tokens=8, batch_size=batch_size)["accuracy"]
    for task, path in suites.items():
        if task not in suite_tasks.TASKS:
            raise SystemExit(f"--suite {task}: unknown task; choose from {sorted(suite_tasks.TASKS)}")
        runner = suite_tasks.HFModel(model, tokenizer, batch_size=batch_size)
        examples = suite_tasks.load_task(task, shots[task]) if task in shots else None
        rows = suite_tasks.load_task(task, path)
        out[task] = suite_tasks.run_task(task, runner, rows, examples, allow_code_execution=allow_code_execution)["score"]
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipes", nargs="*", help="the two adapters' YAML recipes")
    parser.add_argument("--adapters", nargs=2, default=None, metavar=("A", "B"), help="trained adapter folders: skip training")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override for both recipes")
    parser.add_argument("--eval", action="append", default=[], metavar="NAME=FILE", help="exact match on a JSONL of prompt/answer rows")
    parser.add_argument("--suite", action="append", default=[], metavar="TASK=FILE", help="an evaluation-suite task on local items")
    parser.add_argument("--shots", action="append", default=[], metavar="TASK=FILE", help="mmlu / gsm: the few-shot items")
    parser.add_argument("--allow-code-execution", action="store_true", help="humaneval: run the programs the model writes (HF_ALLOW_CODE_EVAL=1 does the same)")
    parser.add_argument("--weights", type=float, nargs=2, default=[1.0, 1.0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="offline: SmolLM2 and the two bundled tasks on CPU")
    parser.add_argument("--output", default="outputs/compose")
    args = parser.parse_args(argv)

    from peft_sparse.assets import load_model_and_tokenizer
    from peft_sparse.recipe import load_recipe, run_recipe
    from peft_sparse.transfer import compose

    common = {}
    for item in args.set:
        if "=" not in item:
            raise SystemExit(f"--set expects section.key=value, got {item!r}")
        key, value = item.split("=", 1)
        common[key] = json.loads(value) if value[:1] in "[{0123456789-" or value in ("true", "false", "null") else value
    per_recipe = [{}, {}]
    recipes_paths, evals = args.recipes, _pairs(args.eval, "--eval")
    if args.smoke:
        recipes_paths = recipes_paths or SMOKE["recipes"]
        common = {**SMOKE["common"], **common}
        per_recipe = SMOKE["per_recipe"]
        evals = evals or SMOKE["eval"]
    if len(recipes_paths) != 2:
        raise SystemExit(f"compose needs two recipes (the adapters' recipes), got {len(recipes_paths)}")
    suites, shots = _pairs(args.suite, "--suite"), _pairs(args.shots, "--shots")
    if not evals and not suites:
        raise SystemExit("nothing to score: pass --eval NAME=FILE and/or --suite TASK=FILE (or --smoke)")
    if "humaneval" in suites:  # (refused before anything is trained)
        from peft_sparse.evaluation.suite import check_code_execution_allowed

        try:
            check_code_execution_allowed(args.allow_code_execution)
        except ValueError as exc:
            raise SystemExit(f"--suite humaneval: {exc}") from None
    recipes = [load_recipe(path, overrides={**common, **extra}) for path, extra in zip(recipes_paths, per_recipe)]
    if recipes[0].model != recipes[1].model:
        raise SystemExit(f"the two recipes train different base models: {recipes[0].model} vs {recipes[1].model}")
    adapters = args.adapters or [run_recipe(recipe)["adapter_dir"] for recipe in recipes]

    results = {}
    labels = ["base model", f"A ({Path(recipes_paths[0]).stem})", f"B ({Path(recipes_paths[1]).stem})", "A ⊕ B"]
    for label, parts in zip(labels, ([], [adapters[0]], [adapters[1]], adapters)):
        model, tokenizer = load_model_and_tokenizer(**{k: v for k, v in recipes[0].model.items() if k != "quantization"})
        if parts:
            weights = args.weights if len(parts) == 2 else [args.weights[adapters.index(parts[0])]]
            model = compose(model, parts, weights=weights)
        results[label] = score(model, tokenizer, evals, suites, shots, args.batch_size, args.allow_code_execution)
        print(f"{label}: " + ", ".join(f"{k} {100 * v:.1f}" for k, v in results[label].items()), flush=True)
    columns = list(next(iter(results.values())))
    print("\n| model | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns))
    for label, row in results.items():
        print(f"| {label} | " + " | ".join(f"{100 * row[c]:.1f}" for c in columns) + " |")
    Path(args.output).mkdir(parents=True, exist_ok=True)
    (Path(args.output) / "results.json").write_text(json.dumps({"adapters": adapters, "weights": args.weights, "scores": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
