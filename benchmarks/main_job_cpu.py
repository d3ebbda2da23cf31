"""The main job's training time on CPU with the value gradient chosen by the cost model against the dense path
forced everywhere (the dense dW + gather in every layer at every step, what every CPU step paid before the cost
model took the SDDMM where it wins).
Produces BENCHMARKS.md, "The main job on CPU" (under "Decoding with an unmerged adapter").

    python benchmarks/main_job_cpu.py            # both settings, one after the other; prints a table

Runs ``recipes/smollm2_spiel.yaml`` through the package's own runner (TRL's SFTTrainer) with its output in a
temporary folder; reports the Trainer's ``train_runtime`` (evaluation excluded) and the exact match after.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]


def run(setting: str, recipe_path: Path) -> dict:
    from peft_sparse.core import kernels
    from peft_sparse.recipe import load_recipe, run_recipe

    saved = dict(kernels.COST_MODEL.sddmm_relative_rate)
    if setting == "dense":
        kernels.COST_MODEL.sddmm_relative_rate["cpu"] = 0.0  # (the SDDMM never chosen)
    try:
        with tempfile.TemporaryDirectory() as out:
            summary = run_recipe(load_recipe(recipe_path, overrides={"training.output_dir": out}))
    finally:
        kernels.COST_MODEL.sddmm_relative_rate.clear()
        kernels.COST_MODEL.sddmm_relative_rate.update(saved)
    return {"setting": setting, "recipe": recipe_path.name, "train_runtime_s": summary["train_runtime_s"], "after": summary["after"]["accuracy"],
            "train_loss_last": summary["train_loss_last"], "threads": summary["torch_threads"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=HERE.parent / "recipes" / "smollm2_spiel.yaml")
    parser.add_argument("--settings", nargs="+", default=["dense", "auto"], choices=["dense", "auto"])
    parser.add_argument("--out", type=Path, help="append the rows to this JSONL file")
    args = parser.parse_args()
    rows = [run(setting, args.recipe) for setting in args.settings]
    print("\n| value gradient | training time | exact match after | last logged loss |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['train_runtime_s']:.0f} s | {100 * r['after']:.1f} | {r['train_loss_last']:.3f} |")
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
