"""Learning quality at equal trainable budget: SpIEL against LoRA, SHiRA, fixed masks and full fine-tuning.
Produces BENCHMARKS.md, "Quality": every table of that section but the 1,000-step one (CPU tier directly; GPU tier
through benchmarks/quality_gpu.sh).

Fine-tunes the real SmolLM2-135M-Instruct on CPU on a bundled instruction task (a plain PyTorch loop,
the same data order for every method), merges the adapter and scores held-out exact match by greedy
generation. Every run appends one JSON line to ``--out``; ``--table`` prints mean ± sd per method.

    # choose each method's learning rate on seed 0, then 3 seeds at the chosen rate
    python benchmarks/quality.py sweep --task skills --steps 150 --out results/quality.jsonl
    python benchmarks/quality.py run --task skills --method spiel-ag --lr 1e-3 --seeds 0 1 2 --out ...
    python benchmarks/quality.py table results/quality.jsonl

Budget: ``--budget-rank r`` gives every method the trainable-parameter count of LoRA at rank r on the
same modules (LoRA r=16 on all 7 projections of SmolLM2-135M: 4,884,480). Ablation flags (``--set``)
pass fields to the SpIEL config, e.g. ``--set drop_criterion=change``. SpIEL's S and γ are the config's default
('auto': 20 and 5 up to 150 steps, scaled beyond) unless set; each row records the resolved pair (``S_gamma``).
Rows recorded before 'auto' became the default ran at S = 20, γ = 5: ``--set reselection_steps=20
gradient_estimation_steps=5`` reproduces those at 600 steps.

``--reference authors`` runs SpIEL (and LT-SFT) with ``reference="authors"``, the authors' released selection and
optimizer-state rules (docs/differences.md), beside the defaults: SpIEL-AG then trains with ``peft_sparse.AgedAdamW``
(AdamW's betas and the same weight decay), SpIEL-MA with SM3's sums without momentum (the released SM3-II), whatever
the run length. The rows record it in their settings, so ``table`` shows the two apart.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "recipes" / "data"
TASKS = {"skills": ("skills_train.jsonl", "skills_test.jsonl"), "skills2": ("skills2_train.jsonl", "skills2_test.jsonl")}
METHODS = ("lora", "shira", "sft-random", "sft-magnitude", "spiel-ag", "spiel-ma", "spiel-ag-block", "spiel-ma-block", "full")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# learning rates tried per method on one seed (AdamW unless noted; SpIEL-MA: SM3)
LR_GRID = {
    "lora": (3e-4, 1e-3, 3e-3),
    "shira": (3e-4, 1e-3, 3e-3),
    "sft-random": (3e-4, 1e-3, 3e-3),
    "sft-magnitude": (3e-4, 1e-3, 3e-3),
    "spiel-ag": (3e-4, 1e-3, 3e-3),
    "spiel-ag-block": (3e-4, 1e-3, 3e-3),
    "spiel-ma": (3e-3, 1e-2, 3e-2),
    "spiel-ma-block": (3e-3, 1e-2, 3e-2),
    "full": (1e-5, 3e-5, 1e-4),
}


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def encode(tokenizer, row: dict, max_length: int) -> tuple[list[int], list[int]]:
    """Token ids of prompt + completion and labels that score the completion only."""
    prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    if ids[: len(p_ids)] != p_ids:
        raise ValueError(f"chat template does not extend the prompt for item {row['prompt'][-1]['content']!r}")
    if len(ids) > max_length:
        raise ValueError(f"item of {len(ids)} tokens exceeds max_length={max_length}: {row['prompt'][-1]['content']!r}")
    return ids, [-100] * len(p_ids) + ids[len(p_ids) :]


def batches(encoded: list, batch_size: int, steps: int, seed: int, pad_id: int, shuffle: bool = True):
    """``steps`` batches in epochs of a seeded shuffle (the same order for every method of a seed)."""
    rng = random.Random(seed)
    order: list[int] = []
    for _ in range(steps):
        if len(order) < batch_size:
            fresh = list(range(len(encoded)))
            if shuffle:
                rng.shuffle(fresh)
            order += fresh
        chosen, order = order[:batch_size], order[batch_size:]
        width = max(len(encoded[i][0]) for i in chosen)
        ids = torch.full((batch_size, width), pad_id, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        for row, i in enumerate(chosen):
            x, y = encoded[i]
            ids[row, : len(x)] = torch.tensor(x)
            labels[row, : len(y)] = torch.tensor(y)
            mask[row, : len(x)] = 1
        yield {"input_ids": ids, "attention_mask": mask, "labels": labels}


@torch.no_grad()
def heldout_loss(model, tokenizer, rows: list[dict], max_length: int, batch_size: int = 40) -> float:
    """Mean next-token loss on the reference answers of held-out rows (teacher forcing): a smoother
    signal than exact match, from the same items."""
    encoded = [encode(tokenizer, r, max_length) for r in rows]
    total, count = 0.0, 0
    model.eval()
    for start in range(0, len(encoded), batch_size):
        batch = next(batches(encoded[start : start + batch_size], len(encoded[start : start + batch_size]), 1, 0, tokenizer.pad_token_id, shuffle=False))
        batch = {k: v.to(model.device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
        labels = batch["labels"][:, 1:]
        total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum").item()
        count += int((labels != -100).sum())
    return total / max(1, count)


def lora_budget(model, rank: int) -> int:
    """Trainable parameters of LoRA at ``rank`` on the targeted linear layers: Σ r·(in + out)."""
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in TARGETS:
            total += rank * (module.in_features + module.out_features)
    return total


def parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if text in ("true", "false"):
        return text == "true"
    if text.startswith("[") or text.startswith("("):
        return json.loads(text.replace("(", "[").replace(")", "]"))
    return text


def build(method: str, model, budget: int, rank: int, seed: int, overrides: dict):
    """(peft or plain model, trainable parameters, uses SM3) for ``method`` at ``budget`` trainable weights."""
    import peft

    import peft_sparse

    if method == "full":
        return model, [p for p in model.parameters()], False
    if method == "lora":
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=TARGETS, **overrides)
    elif method == "shira":
        config = peft.ShiraConfig(r=rank, target_modules=TARGETS, random_seed=seed, **overrides)
    elif method.startswith("sft-"):
        config = peft_sparse.SparseFTConfig(target_modules=TARGETS, num_tunable_weights=budget, init=method[4:], seed=seed, **overrides)
    else:
        fields = {"growth": "ma" if "-ma" in method else "ag", **overrides}
        if method.endswith("-block"):
            fields.setdefault("block_shape", (64, 64))
            unit = fields["block_shape"][0] * fields["block_shape"][1]
            budget = budget // unit * unit  # whole blocks: LoRA r16's 4,884,480 → 4,882,432 (1,192 blocks of 64×64)
        config = peft_sparse.SpIELConfig(target_modules=TARGETS, num_tunable_weights=budget, seed=seed, **fields)
    wrapped = peft.get_peft_model(model, config)
    params = [p for p in wrapped.parameters() if p.requires_grad]
    return wrapped, params, method in ("spiel-ma", "spiel-ma-block")


def run_one(args, method: str, lr: float, seed: int, model_and_tokenizer, data) -> dict:
    import peft_sparse

    base_state, tokenizer = model_and_tokenizer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(base_state["config"], dtype=torch.float32)
    model.load_state_dict(base_state["weights"])
    model.generation_config = base_state["generation_config"]
    model.to(args.device)
    torch.manual_seed(seed)
    budget = lora_budget(model, args.budget_rank)
    overrides = dict(args.set or {})
    reference = args.reference if method.startswith("spiel") else None
    if reference:
        overrides["reference"] = reference
    wrapped, params, uses_sm3 = build(method, model, budget, args.budget_rank, seed, overrides)
    config = getattr(wrapped, "peft_config", {}).get("default")
    S_gamma = list(config.steps_for(args.steps)) if hasattr(config, "steps_for") else None  # (SpIEL: S, γ resolved)
    # (SpIEL-MA: the growth signal and the first replacement as resolved, which 'auto' and None defaults leave open)
    ma_setup = {"ma_signal": config.ma_signal, "first_full_replacement": config.first_replacement_is_full(args.steps)} \
        if method.startswith("spiel-ma") and not args.no_reselection else None
    uses_sm3 = args.optimizer == "sm3" if args.optimizer else uses_sm3  # (default: SM3 for SpIEL-MA, AdamW otherwise)
    n_trainable = sum(p.numel() for p in params)
    decay = args.weight_decay
    if decay == "auto":  # λ = min(3, 1/(lr·T)), as a recipe's weight_decay: auto
        from peft_sparse.schedules.weight_decay import auto_weight_decay

        decay = auto_weight_decay(lr, args.steps)
    if uses_sm3:  # ('auto': the recipe runner's SpIEL-MA form for this run length, peft_sparse.recipe.ma_sm3_defaults)
        from peft_sparse.recipe import ma_sm3_defaults

        form = {"momentum": 0.0, "beta2": None} if reference else ma_sm3_defaults(args.steps)  # (the released SM3-II)
        momentum = form["momentum"] if args.sm3_momentum == "auto" else args.sm3_momentum
        beta2 = form["beta2"] if args.sm3_beta2 == "auto" else args.sm3_beta2
        optimizer = peft_sparse.SM3(params, lr=lr, weight_decay=decay, momentum=momentum, beta2=beta2)
    elif reference:  # SpIEL-AG's released optimizer: a per-index age in Adam's bias correction
        optimizer = peft_sparse.AgedAdamW(params, lr=lr, weight_decay=decay, betas=(0.9, 0.999))
    else:
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=decay, betas=(0.9, 0.999))
    warmup = max(1, round(0.03 * args.steps))
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.0, (args.steps - s) / max(1, args.steps - warmup)))
    )
    scheduler = None
    if method.startswith("spiel") and not args.no_reselection:
        scheduler = peft_sparse.SpIELScheduler(wrapped, optimizer, total_steps=args.steps)
    train, test = data
    wrapped.train()
    losses, reselections, step_times = [], [], []
    scheduler_seconds = 0.0  # time inside scheduler.step(): the reselections and the windows' bookkeeping
    start = time.perf_counter()
    for step, batch in enumerate(batches(train, args.batch_size, args.steps, seed, tokenizer.pad_token_id), start=1):
        loss = wrapped(**{k: v.to(args.device) for k, v in batch.items()}).loss
        loss.backward()
        if args.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lr_schedule.step()
        losses.append(loss.item())  # (a read of the device each step: the step times below are complete)
        if scheduler is not None:
            at = time.perf_counter()
            report = scheduler.step()
            if report:
                torch.cuda.synchronize() if args.device.startswith("cuda") else None
                reselections.append(report)
            scheduler_seconds += time.perf_counter() - at
        step_times.append(time.perf_counter())
        if args.verbose and step % 10 == 0:
            print(f"  step {step}: loss {sum(losses[-10:]) / 10:.4f}", flush=True)
    train_seconds = time.perf_counter() - start
    if scheduler is not None:
        scheduler.close()
    if method != "full":
        wrapped = wrapped.merge_and_unload()
    from peft_sparse.evaluation import exact_match

    start = time.perf_counter()
    score = exact_match(wrapped, tokenizer, test, max_new_tokens=8, batch_size=40)
    loss_heldout = heldout_loss(wrapped, tokenizer, test, args.max_length)
    eval_seconds = time.perf_counter() - start
    return {
        "task": args.task, "method": method, "lr": lr, "seed": seed, "steps": args.steps, "batch_size": args.batch_size,
        "budget_rank": args.budget_rank, "trainable": n_trainable, "weight_decay": decay, "max_grad_norm": args.max_grad_norm,
        "set": overrides, "optimizer": "sm3" if uses_sm3 else "aged_adamw" if reference else "adamw", "sm3_momentum": momentum if uses_sm3 else None, "sm3_beta2": beta2 if uses_sm3 else None, "no_reselection": args.no_reselection, "tag": args.tag, "exact_match": score["accuracy"], "heldout_loss": loss_heldout, "per_skill": score["per_skill"],
        "S_gamma": S_gamma, "ma_setup": ma_setup,
        "final_loss": sum(losses[-10:]) / min(10, len(losses)), "train_seconds": round(train_seconds, 1),
        "eval_seconds": round(eval_seconds, 1), "scheduler_seconds": round(scheduler_seconds, 2),
        "median_step_ms": round(1000 * statistics.median(b - a for a, b in zip([start] + step_times[:-1], step_times)), 1),
        "reselections": reselections, "threads": torch.get_num_threads(),
        "host": platform.node(), "device": device_name(args.device), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }  # fmt: skip


def device_name(device: str) -> str:
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def load_base():
    from peft_sparse.assets import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("smollm2-135m-instruct")
    state = {
        "config": model.config, "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "generation_config": model.generation_config,
    }  # fmt: skip
    return state, tokenizer


def load_task(task: str, tokenizer, max_length: int):
    train_file, test_file = TASKS[task]
    train = [encode(tokenizer, r, max_length) for r in read_jsonl(DATA / train_file)]
    return train, read_jsonl(DATA / test_file)


PRE_AUTO_MA_SETUP = {"ma_signal": "sm3", "first_full_replacement": True}


def summarize(rows: list[dict]) -> list[dict]:
    groups: dict = {}
    for r in rows:
        settings = dict(r.get("set", {}))
        for name, value in (r.get("ma_setup") or {}).items():  # (as resolved, where it differs from what rows without
            if value != PRE_AUTO_MA_SETUP[name]:  # it ran with: those predate block MA's 'io' and 'auto' defaults)
                settings[name] = value
        if r.get("weight_decay"):
            settings["weight_decay"] = r["weight_decay"]
        if r.get("optimizer") and (r["optimizer"] == "sm3") != r["method"].startswith("spiel-ma"):  # (an optimizer other than the method's default)
            settings["optimizer"] = r.get("optimizer")
        if r.get("sm3_momentum"):
            settings["sm3_momentum"] = r["sm3_momentum"]
        if r.get("sm3_beta2"):
            settings["sm3_beta2"] = r["sm3_beta2"]
        if r.get("no_reselection"):
            settings["reselection"] = "off"
        if r.get("device", "cpu") != "cpu":
            settings["device"] = r["device"]  # GPU numerics differ from the CPU tier: never pooled with it
        key = (r["task"], r["steps"], r["method"], r["lr"], json.dumps(settings, sort_keys=True), r.get("tag") or "")
        groups.setdefault(key, []).append(r)
    out = []
    for (task, steps, method, lr, sets, tag), rs in sorted(groups.items()):
        scores = [r["exact_match"] for r in rs]
        out.append({
            "task": task, "steps": steps, "method": method, "lr": lr, "set": sets, "tag": tag, "n": len(rs),
            "mean": statistics.mean(scores), "sd": statistics.stdev(scores) if len(scores) > 1 else 0.0,
            "seeds": sorted(r["seed"] for r in rs), "loss": statistics.mean(r["final_loss"] for r in rs),
            "train_seconds": statistics.mean(r["train_seconds"] for r in rs),
            "heldout_loss": statistics.mean(r["heldout_loss"] for r in rs) if all("heldout_loss" in r for r in rs) else float("nan"),
        })  # fmt: skip
    return out


def print_table(rows: list[dict]) -> None:
    print("| task | steps | method | lr | settings | seeds | exact match (%) | held-out loss | final train loss | train s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in summarize(rows):
        sd = f" ± {100 * s['sd']:.1f}" if s["n"] > 1 else ""
        sets = s["set"] if s["set"] != "{}" else ""
        sets = (sets + " " + s["tag"]).strip()
        print(f"| {s['task']} | {s['steps']} | {s['method']} | {s['lr']:g} | {sets} | {s['n']} | "
              f"{100 * s['mean']:.1f}{sd} | {s['heldout_loss']:.4f} | {s['loss']:.3f} | {s['train_seconds']:.0f} |")  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("run", "sweep", "table"))
    parser.add_argument("results", nargs="?", help="table: the JSONL file(s) to summarise")
    parser.add_argument("--task", choices=sorted(TASKS), default="skills")
    parser.add_argument("--method", "--methods", dest="methods", nargs="+", default=list(METHODS))
    parser.add_argument("--lr", type=float, nargs="+", help="learning rates (run); default: each method's grid (sweep)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--budget-rank", type=int, default=16, help="trainable weights equal to LoRA at this rank")
    parser.add_argument("--weight-decay", type=lambda t: t if t == "auto" else float(t), default=0.0,
                        help="decoupled weight decay λ of the optimizer, or auto: λ = min(3, 1/(lr·T)) (the main recipe's)")
    parser.add_argument("--optimizer", choices=("adamw", "sm3"), default=None,
                        help="default: SM3 for SpIEL-MA (the paper's pairing), AdamW for every other method")
    parser.add_argument("--sm3-momentum", type=lambda t: t if t == "auto" else float(t), default="auto",
                        help="SM3's momentum (heavy-ball β over the preconditioned step), or auto: the recipe runner's for SpIEL-MA "
                             "at this run length (0 up to 100 steps, 0.9 beyond; rows before 2026-12 ran at 0)")
    parser.add_argument("--sm3-beta2", type=lambda t: t if t == "auto" else None if t.lower() == "none" else float(t), default="auto",
                        help="SM3's moving-average form with this β₂ (bias-corrected), none: the sums of squared gradients "
                             "(Anil et al.; every row before 2026-12), or auto: the recipe runner's for SpIEL-MA at this run "
                             "length (the sums up to 100 steps, 0.999 beyond)")
    parser.add_argument("--no-reselection", action="store_true", help="SpIEL without a scheduler: the initial mask kept")
    parser.add_argument("--reference", choices=("authors",), default=None,
                        help="SpIEL with reference='authors': the authors' released selection and optimizer-state rules "
                             "(AgedAdamW for AG, SM3's sums without momentum for MA)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--set", nargs="*", metavar="FIELD=VALUE", help="extra config fields (ablations)")
    parser.add_argument("--tag", default="", help="free label stored with the rows")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu (the reference tier) or cuda; float32 either way")
    parser.add_argument("--out", default=str(HERE / "results" / "quality.jsonl"))
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "table":
        print_table(read_jsonl(Path(args.results or args.out)))
        return
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown --method {unknown}; choose from {list(METHODS)}")
    args.set = dict(item.split("=", 1) for item in args.set or [])
    args.set = {k: parse_value(v) for k, v in args.set.items()}
    if args.threads:
        torch.set_num_threads(args.threads)
    base = load_base()
    data = load_task(args.task, base[1], args.max_length)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for method in args.methods:
        lrs = args.lr or LR_GRID[method]
        for lr in lrs:
            for seed in args.seeds:
                row = run_one(args, method, lr, seed, base, data)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{args.task} {method} lr={lr:g} seed={seed} {row['set'] or ''}: exact match {row['exact_match']:.3f} "
                      f"held-out loss {row['heldout_loss']:.4f} (loss {row['final_loss']:.3f}, {row['train_seconds']:.0f}+{row['eval_seconds']:.0f} s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
