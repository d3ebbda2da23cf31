"""What SpIEL-MA knows and chooses at its first (full) reselection, per projection type.

Trains SmolLM2-135M-Instruct on a bundled task with SM3 up to the first reselection (at γ steps of a
run of --steps, as benchmarks/quality.py does), then reports, averaged over the layers of each projection: the fraction of
(block) rows and columns whose SM3 accumulator is nonzero before the reselection (what the rank-one growth
score can see), and the fraction of (block) rows and columns the mask covers before and after it. One JSON
line per run to --out.

    python benchmarks/dev/ma_coverage.py --block 64 64 --lr 1e-2 --out /tmp/cov.jsonl
    python benchmarks/dev/ma_coverage.py --block 1 1 --lr 3e-3 --out /tmp/cov.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import quality  # noqa: E402  (benchmarks/quality.py: model, data, budget)


def coverage(indices: torch.Tensor, shape: tuple, block: tuple) -> tuple[float, float]:
    """Fractions of the (block) rows and (block) columns that hold an active weight."""
    out_f, in_f = shape
    idx = indices.long()
    rows, cols = (idx // in_f) // block[0], (idx % in_f) // block[1]
    return rows.unique().numel() / (out_f // block[0]), cols.unique().numel() / (in_f // block[1])


def seen(acc: torch.Tensor, unit: int) -> float:
    """Fraction of the (block) rows or columns whose accumulator has any nonzero entry."""
    return (acc.reshape(-1, unit).abs().sum(1) > 0).float().mean().item()


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--task", default="skills2")
    p.add_argument("--block", type=int, nargs=2, default=(64, 64))
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=60, help="the run length S is resolved for")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    import peft

    import peft_sparse
    from transformers import AutoModelForCausalLM

    state, tokenizer = quality.load_base()
    model = AutoModelForCausalLM.from_config(state["config"], dtype=torch.float32)
    model.load_state_dict(state["weights"])
    torch.manual_seed(args.seed)
    budget = quality.lora_budget(model, 16)
    block = tuple(args.block)
    unit = block[0] * block[1]
    config = peft_sparse.SpIELConfig(target_modules=quality.TARGETS, num_tunable_weights=budget // unit * unit, seed=args.seed,
                                     growth="ma", block_shape=block)  # fmt: skip
    wrapped = peft.get_peft_model(model, config)
    params = [q for q in wrapped.parameters() if q.requires_grad]
    from peft_sparse.recipe import ma_sm3_defaults

    form = ma_sm3_defaults(args.steps)
    optimizer = peft_sparse.SM3(params, lr=args.lr, momentum=form["momentum"], beta2=form["beta2"])
    scheduler = peft_sparse.SpIELScheduler(wrapped, optimizer, total_steps=args.steps)
    train, _ = quality.load_task(args.task, tokenizer, 128)
    layers = scheduler.layers
    before, first = {}, None
    for step, batch in enumerate(quality.batches(train, 8, args.steps, args.seed, tokenizer.pad_token_id), start=1):
        wrapped(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for layer in layers:  # (what the next reselection sees; kept once one has run)
            values = layer.sparse_values["default"]
            if scheduler.ma_accumulators is not None:
                r, c = scheduler.ma_accumulators.views[layer.module_name]
            else:
                st = optimizer.state[values]
                r, c = st["row_accumulator"], st["col_accumulator"]
            before[layer.module_name] = (layer.sparse_indices["default"].clone(), r.clone(), c.clone())
        report = scheduler.step()
        if report:
            first = step
            print(step, {k: v for k, v in report.items() if "fraction" in k}, flush=True)
            break
    scheduler.close()
    per_type = defaultdict(lambda: defaultdict(list))
    for layer in layers:
        name = layer.module_name
        kind = name.rsplit(".", 1)[-1]
        w = layer.get_base_layer().weight
        shape = tuple(w.shape)
        old, r, c = before[name]
        new = layer.sparse_indices["default"]
        stats = per_type[kind]
        stats["row_seen"].append(seen(r, block[0]))
        stats["col_seen"].append(seen(c, block[1]))
        for tag, idx in (("before", old), ("after", new)):
            rc, cc = coverage(idx, shape, block)
            stats[f"rows_{tag}"].append(rc)
            stats[f"cols_{tag}"].append(cc)
        stats["units"].append(old.numel() // unit)
        stats["grid"].append((shape[0] // block[0]) * (shape[1] // block[1]))
    row = {"task": args.task, "block": block, "lr": args.lr, "seed": args.seed, "first_reselection": first,
           "per_type": {k: {m: round(sum(v) / len(v), 3) for m, v in s.items()} for k, s in per_type.items()}}  # fmt: skip
    for k, s in row["per_type"].items():
        print(k, s)
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
