"""Learning quality at equal trainable budget: SpIEL against LoRA, SHiRA, fixed masks and full fine-tuning.

Fine-tunes the real SmolLM2-135M-Instruct on bundled instruction task families (``TASKS``; CPU or ``--device
cuda``, float32), merges the adapter and scores held-out exact match by greedy generation. Every method of a seed
sees the same batches in the same order. Two training paths: ``--trainer plain`` (a plain PyTorch loop, the
SpIEL scheduler stepped after each optimizer step, as the docs' plain-loop example) and ``--trainer hf``
(transformers' ``Trainer`` building its own optimizer and schedule from ``TrainingArguments``, SpIEL through
``SpIELCallback``). ``--schedule`` sets the learning-rate schedule of either path: ``linear`` decay to 0 (the
default, after ``--warmup-steps``), ``constant`` (after the warm-up) or ``wsd`` (constant, then linear decay over the
last ``--cooldown-fraction`` of the run). Every run appends one JSON line to ``--out``; ``table`` prints mean ± sd over
seeds per family, and the mean over the dev and over the test families.

    # choose each method's learning rate on seed 0 of a dev family, then 3 seeds at the chosen rate
    python benchmarks/quality.py sweep --task skills --steps 150 --out results/quality.jsonl
    python benchmarks/quality.py run --tasks test --method spiel-ag --lr 1e-3 --seeds 0 1 2 --out ...
    python benchmarks/quality.py table results/quality.jsonl

Task families (``recipes/data/make_tasks.py`` and ``make_skills.py`` generate them): the **dev** families are the
ones defaults may be chosen on; the **test** families are only ever reported.

Budget: ``--budget-rank r`` gives every method the trainable-parameter count of LoRA at rank r on the
same modules (LoRA r=16 on all 7 projections of SmolLM2-135M: 4,884,480). Ablation flags (``--set``)
pass fields to the SpIEL config, e.g. ``--set drop_criterion=change``. SpIEL's S and γ are the config's default
('auto': 20 and 5 up to 150 steps, scaled beyond) unless set; each row records the resolved pair (``S_gamma``).
Rows recorded before 'auto' became the default ran at S = 20, γ = 5: ``--set reselection_steps=20
gradient_estimation_steps=5`` reproduces those at 600 steps. Rows without ``schedule`` / ``trainer`` fields ran the
plain loop with linear decay after max(1, round(0.03·T)) warm-up steps, the defaults here.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "recipes" / "data"


@dataclass(frozen=True)
class Task:
    """A bundled task family: ``split`` 'dev' (defaults may be chosen on it) or 'test' (only ever reported);
    ``max_new_tokens`` covers its longest answer with room (SmolLM2's tokenizer)."""

    split: str
    kind: str
    max_new_tokens: int = 8


# THE dev/test split of the quality benchmark (docs/quality.md marks it the same way): keep it so.
TASKS = {
    "skills": Task("dev", "short mixed skills (the main job's sample)"),
    "skills2": Task("dev", "short mixed skills, a second set"),
    "instructions": Task("dev", "instruction following on the bundled samples", 16),
    "algorithmic": Task("dev", "list and digit operations"),
    "sequences": Task("test", "sequence manipulation", 24),
    "arithmetic": Task("test", "multi-digit arithmetic"),
    "formats": Task("test", "format following (JSON, CSV, query strings)", 24),
    "strings": Task("test", "string transforms", 16),
    "recall": Task("test", "recall of facts the data defines"),
    "classify": Task("test", "classification with a given label set"),
    "synlang": Task("test", "a synthetic language (peft_sparse.data)"),
    "retrieval": Task("test", "reading a list given in the prompt"),
}
SPLITS = {"dev": [t for t, v in TASKS.items() if v.split == "dev"], "test": [t for t, v in TASKS.items() if v.split == "test"]}
SPLITS["all"] = list(TASKS)

# SpIEL variants: the config fields each sets (budget, target modules and seed are the benchmark's). The faithful
# mode of the authors' algorithm is one more entry here, "spiel-ag-faithful": {...its fields...}, plus its LR_GRID row.
SPIEL_VARIANTS = {
    "spiel-ag": {"growth": "ag"},
    "spiel-ma": {"growth": "ma"},
    "spiel-ag-block": {"growth": "ag", "block_shape": (64, 64)},
    "spiel-ma-block": {"growth": "ma", "block_shape": (64, 64)},
}
METHODS = ("lora", "shira", "sft-random", "sft-magnitude", *SPIEL_VARIANTS, "full")
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
SCHEDULES = ("linear", "constant", "wsd")
# the Trainer's lr_scheduler_type for each schedule (wsd: its decay made linear, as the plain loop's)
HF_SCHEDULES = {"linear": "linear", "constant": "constant_with_warmup", "wsd": "warmup_stable_decay"}


def uses_sm3(method: str) -> bool:
    """SM3 is SpIEL-MA's optimizer (the paper's pairing); every other method trains with AdamW."""
    return SPIEL_VARIANTS.get(method, {}).get("growth") == "ma"


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


def batch_order(n: int, batch_size: int, steps: int, seed: int, shuffle: bool = True) -> list[list[int]]:
    """The examples of each of ``steps`` batches: epochs of a seeded shuffle (the same for every method of a seed)."""
    rng = random.Random(seed)
    order: list[int] = []
    out = []
    for _ in range(steps):
        if len(order) < batch_size:
            fresh = list(range(n))
            if shuffle:
                rng.shuffle(fresh)
            order += fresh
        out.append(order[:batch_size])
        order = order[batch_size:]
    return out


def collate(examples: list, pad_id: int) -> dict:
    """(ids, labels) pairs padded on the right to the longest: input_ids, attention_mask, labels (-100 on padding)."""
    width = max(len(x) for x, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (x, y) in enumerate(examples):
        ids[row, : len(x)] = torch.tensor(x)
        labels[row, : len(y)] = torch.tensor(y)
        mask[row, : len(x)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def batches(encoded: list, batch_size: int, steps: int, seed: int, pad_id: int, shuffle: bool = True):
    """``steps`` padded batches in the order of :func:`batch_order`."""
    for chosen in batch_order(len(encoded), batch_size, steps, seed, shuffle):
        yield collate([encoded[i] for i in chosen], pad_id)


@torch.no_grad()
def heldout_loss(model, tokenizer, rows: list[dict], max_length: int, batch_size: int = 40) -> float:
    """Mean next-token loss on the reference answers of held-out rows (teacher forcing): a smoother
    signal than exact match, from the same items."""
    encoded = [encode(tokenizer, r, max_length) for r in rows]
    total, count = 0.0, 0
    model.eval()
    for start in range(0, len(encoded), batch_size):
        batch = {k: v.to(model.device) for k, v in collate(encoded[start : start + batch_size], tokenizer.pad_token_id).items()}
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
        fields = {**SPIEL_VARIANTS[method], **overrides}
        if "block_shape" in fields:
            unit = fields["block_shape"][0] * fields["block_shape"][1]
            budget = budget // unit * unit  # whole blocks: LoRA r16's 4,884,480 → 4,882,432 (1,192 blocks of 64×64)
        config = peft_sparse.SpIELConfig(target_modules=TARGETS, num_tunable_weights=budget, seed=seed, **fields)
    wrapped = peft.get_peft_model(model, config)
    params = [p for p in wrapped.parameters() if p.requires_grad]
    return wrapped, params, uses_sm3(method)


def warmup_steps(args) -> int:
    """The warm-up: ``--warmup-steps``, or max(1, round(0.03·T)) (every row before the switch)."""
    return max(1, round(0.03 * args.steps)) if args.warmup_steps is None else args.warmup_steps


def decay_steps(args) -> int:
    """wsd: the steps of its final linear decay, max(1, round(cooldown·T))."""
    return max(1, round(args.cooldown_fraction * args.steps))


def rate_multiplier(args):
    """The plain loop's schedule as LambdaLR's multiplier of the rate for optimizer step s + 1 (s counts from 0)."""
    T, warmup = args.steps, warmup_steps(args)
    decay = decay_steps(args) if args.schedule == "wsd" else None

    def multiplier(s: int) -> float:
        up = (s + 1) / warmup if warmup else 1.0
        if args.schedule == "linear":
            return min(up, max(0.0, (T - s) / max(1, T - warmup)))
        if args.schedule == "constant":
            return min(up, 1.0)
        return min(up, 1.0, max(0.0, (T - s) / decay))  # (wsd)

    return multiplier


def resolved_weight_decay(args, lr: float) -> float:
    """``--weight-decay``, or for auto the schedule's λ (peft_sparse.auto_weight_decay: the same total shrink
    λ·Σ lr_t as under linear decay, where λ = min(3, 1/(lr·T)))."""
    if args.weight_decay != "auto":
        return args.weight_decay
    from peft_sparse.schedules.weight_decay import auto_weight_decay

    if args.schedule == "linear":
        return auto_weight_decay(lr, args.steps)
    return auto_weight_decay(lr, args.steps, "constant_with_warmup", warmup_steps(args))  # (constant; wsd refused in main)


def train_plain(args, wrapped, params, optimizer, reselect: bool, train: list, seed: int, pad_id: int) -> dict:
    """The plain loop: forward, backward, clip, optimizer step, LR schedule step, SpIEL scheduler step."""
    import peft_sparse

    lr_schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate_multiplier(args))
    scheduler = peft_sparse.SpIELScheduler(wrapped, optimizer, total_steps=args.steps) if reselect else None
    wrapped.train()
    losses, reselections, step_times = [], [], []
    scheduler_seconds = 0.0  # time inside scheduler.step(): the reselections and the windows' bookkeeping
    start = time.perf_counter()
    for step, batch in enumerate(batches(train, args.batch_size, args.steps, seed, pad_id), start=1):
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
    if scheduler is not None:
        scheduler.close()
    return {"losses": losses, "reselections": reselections, "start": start, "step_times": step_times,
            "scheduler_seconds": round(scheduler_seconds, 2)}  # fmt: skip


def train_hf(args, wrapped, lr: float, decay: float, sm3_kwargs, reselect: bool, train: list, seed: int, pad_id: int) -> dict:
    """transformers' Trainer as a user runs it: its own AdamW (decay on all but biases and norms) or SM3 through
    ``optimizer_cls_and_kwargs``, its schedule from ``lr_scheduler_type``, its clipping, ``SpIELCallback`` for SpIEL;
    the batches are the plain loop's (a dataset in that order, read sequentially)."""
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    import peft_sparse

    examples = [train[i] for chosen in batch_order(len(train), args.batch_size, args.steps, seed) for i in chosen]

    class Ordered(torch.utils.data.Dataset):
        def __len__(self):
            return len(examples)

        def __getitem__(self, i):
            return examples[i]

    step_times: list = []

    class Clock(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            step_times.append(time.perf_counter())

    schedule_kwargs = {"num_decay_steps": decay_steps(args), "decay_type": "linear"} if args.schedule == "wsd" else {}
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch_size, learning_rate=lr,
            lr_scheduler_type=HF_SCHEDULES[args.schedule], lr_scheduler_kwargs=schedule_kwargs, warmup_steps=warmup_steps(args),
            weight_decay=decay, max_grad_norm=args.max_grad_norm or 0.0, optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999,
            adam_epsilon=1e-8, train_sampling_strategy="sequential", logging_steps=1, save_strategy="no", report_to="none",
            seed=seed, use_cpu=args.device == "cpu", bf16=False, fp16=False, disable_tqdm=True, dataloader_num_workers=0,
            remove_unused_columns=False,
        )  # fmt: skip
        trainer = Trainer(
            model=wrapped, args=targs, train_dataset=Ordered(), data_collator=lambda rows: collate(rows, pad_id),
            callbacks=[Clock()] + ([peft_sparse.SpIELCallback()] if reselect else []),
            optimizer_cls_and_kwargs=(peft_sparse.SM3, sm3_kwargs) if sm3_kwargs is not None else None,
        )  # fmt: skip
        trainer.remove_callback(PrinterCallback)
        start = time.perf_counter()
        trainer.train()
    history = trainer.state.log_history
    return {
        "losses": [h["loss"] for h in history if "loss" in h],
        "reselections": [{k: v for k, v in h.items() if k.startswith("spiel/")} for h in history if "spiel/step" in h],
        "start": start, "step_times": step_times, "scheduler_seconds": None,
    }  # fmt: skip


def run_one(args, task: str, method: str, lr: float, seed: int, model_and_tokenizer, data) -> dict:
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
    wrapped, params, sm3 = build(method, model, budget, args.budget_rank, seed, overrides)
    config = getattr(wrapped, "peft_config", {}).get("default")
    S_gamma = list(config.steps_for(args.steps)) if hasattr(config, "steps_for") else None  # (SpIEL: S, γ resolved)
    reselect = method in SPIEL_VARIANTS and not args.no_reselection
    # (SpIEL-MA: the growth signal and the first replacement as resolved, which 'auto' and None defaults leave open)
    ma_setup = {"ma_signal": config.ma_signal, "first_full_replacement": config.first_replacement_is_full(args.steps)} \
        if uses_sm3(method) and reselect else None
    sm3 = args.optimizer == "sm3" if args.optimizer else sm3  # (default: SM3 for SpIEL-MA, AdamW otherwise)
    n_trainable = sum(p.numel() for p in params)
    decay = resolved_weight_decay(args, lr)
    momentum = beta2 = None
    if sm3:  # ('auto': the recipe runner's SpIEL-MA form for this run length, peft_sparse.recipe.ma_sm3_defaults)
        from peft_sparse.recipe import ma_sm3_defaults

        form = ma_sm3_defaults(args.steps)
        momentum = form["momentum"] if args.sm3_momentum == "auto" else args.sm3_momentum
        beta2 = form["beta2"] if args.sm3_beta2 == "auto" else args.sm3_beta2
    train, test = data
    if args.trainer == "plain":
        if sm3:
            optimizer = peft_sparse.SM3(params, lr=lr, weight_decay=decay, momentum=momentum, beta2=beta2)
        else:
            optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=decay, betas=(0.9, 0.999))
        trained = train_plain(args, wrapped, params, optimizer, reselect, train, seed, tokenizer.pad_token_id)
    else:
        sm3_kwargs = {"lr": lr, "momentum": momentum, "beta2": beta2} if sm3 else None
        trained = train_hf(args, wrapped, lr, decay, sm3_kwargs, reselect, train, seed, tokenizer.pad_token_id)
    losses, step_times, start = trained["losses"], trained["step_times"], trained["start"]
    train_seconds = step_times[-1] - start
    if method != "full":
        wrapped = wrapped.merge_and_unload()
    from peft_sparse.evaluation import exact_match

    start_eval = time.perf_counter()
    score = exact_match(wrapped, tokenizer, test, max_new_tokens=TASKS[task].max_new_tokens, batch_size=40)
    loss_heldout = heldout_loss(wrapped, tokenizer, test, args.max_length)
    eval_seconds = time.perf_counter() - start_eval
    return {
        "task": task, "split": TASKS[task].split, "method": method, "lr": lr, "seed": seed, "steps": args.steps,
        "batch_size": args.batch_size, "trainer": args.trainer, "schedule": args.schedule, "warmup_steps": warmup_steps(args),
        "cooldown_fraction": args.cooldown_fraction if args.schedule == "wsd" else None,
        "budget_rank": args.budget_rank, "trainable": n_trainable, "weight_decay": decay, "max_grad_norm": args.max_grad_norm,
        "set": overrides, "optimizer": "sm3" if sm3 else "adamw", "sm3_momentum": momentum, "sm3_beta2": beta2, "no_reselection": args.no_reselection, "tag": args.tag, "exact_match": score["accuracy"], "heldout_loss": loss_heldout, "per_skill": score["per_skill"],
        "max_new_tokens": TASKS[task].max_new_tokens, "S_gamma": S_gamma, "ma_setup": ma_setup,
        "final_loss": sum(losses[-10:]) / min(10, len(losses)), "train_seconds": round(train_seconds, 1),
        "eval_seconds": round(eval_seconds, 1), "scheduler_seconds": trained["scheduler_seconds"],
        "median_step_ms": round(1000 * statistics.median(b - a for a, b in zip([start] + step_times[:-1], step_times)), 1),
        "reselections": trained["reselections"], "threads": torch.get_num_threads(),
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
    """(encoded training examples, held-out rows) of a task family."""
    train = [encode(tokenizer, r, max_length) for r in read_jsonl(DATA / f"{task}_train.jsonl")]
    return train, read_jsonl(DATA / f"{task}_test.jsonl")


PRE_AUTO_MA_SETUP = {"ma_signal": "sm3", "first_full_replacement": True}


def settings_of(r: dict) -> dict:
    """What a row ran with beyond its method, lr, length, schedule and trainer (rows with equal settings pool)."""
    settings = dict(r.get("set", {}))
    for name, value in (r.get("ma_setup") or {}).items():  # (as resolved, where it differs from what rows without
        if value != PRE_AUTO_MA_SETUP[name]:  # it ran with: those predate block MA's 'io' and 'auto' defaults)
            settings[name] = value
    if r.get("weight_decay"):
        settings["weight_decay"] = r["weight_decay"]
    if r.get("optimizer") and (r["optimizer"] == "sm3") != uses_sm3(r["method"]):  # (an optimizer other than the method's default)
        settings["optimizer"] = r.get("optimizer")
    if r.get("sm3_momentum"):
        settings["sm3_momentum"] = r["sm3_momentum"]
    if r.get("sm3_beta2"):
        settings["sm3_beta2"] = r["sm3_beta2"]
    if r.get("no_reselection"):
        settings["reselection"] = "off"
    if r.get("warmup_steps", max(1, round(0.03 * r["steps"]))) != max(1, round(0.03 * r["steps"])):
        settings["warmup_steps"] = r["warmup_steps"]
    if r.get("cooldown_fraction") is not None:
        settings["cooldown_fraction"] = r["cooldown_fraction"]
    if r.get("max_grad_norm", 1.0) != 1.0:
        settings["max_grad_norm"] = r["max_grad_norm"]
    return settings


def summarize(rows: list[dict]) -> list[dict]:
    """Mean ± sd over seeds of each (task, length, method, lr, settings, tag, schedule, trainer, device)."""
    groups: dict = {}
    for r in rows:
        # (rows without schedule / trainer ran the plain loop with linear decay; GPU numerics differ from the CPU
        # tier: never pooled with it)
        key = (r["task"], r["steps"], r["method"], r["lr"], json.dumps(settings_of(r), sort_keys=True), r.get("tag") or "",
               r.get("schedule", "linear"), r.get("trainer", "plain"), r.get("device", "cpu"))  # fmt: skip
        groups.setdefault(key, []).append(r)
    out = []
    for (task, steps, method, lr, sets, tag, schedule, trainer, device), rs in sorted(groups.items()):
        scores = [r["exact_match"] for r in rs]
        by_seed: dict = {}
        for r in rs:
            by_seed.setdefault(r["seed"], []).append(r["exact_match"])
        out.append({
            "task": task, "split": TASKS[task].split if task in TASKS else "?", "steps": steps, "method": method, "lr": lr,
            "set": sets, "tag": tag, "schedule": schedule, "trainer": trainer, "device": device, "n": len(rs),
            "mean": statistics.mean(scores), "sd": statistics.stdev(scores) if len(scores) > 1 else 0.0,
            "seeds": sorted(r["seed"] for r in rs), "by_seed": {k: statistics.mean(v) for k, v in by_seed.items()},
            "loss": statistics.mean(r["final_loss"] for r in rs), "train_seconds": statistics.mean(r["train_seconds"] for r in rs),
            "heldout_loss": statistics.mean(r["heldout_loss"] for r in rs) if all("heldout_loss" in r for r in rs) else float("nan"),
        })  # fmt: skip
    return out


def _label(s: dict) -> str:
    sets = s["set"] if s["set"] != "{}" else ""
    return (sets + " " + s["tag"]).strip()


def print_table(rows: list[dict]) -> None:
    """One line per task and setting: the long form."""
    print("| task | split | steps | trainer | schedule | method | lr | settings | seeds | exact match (%) | held-out loss | final train loss | train s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in summarize(rows):
        sd = f" ± {100 * s['sd']:.1f}" if s["n"] > 1 else ""
        sets = (_label(s) + ("" if s["device"] == "cpu" else f" {s['device']}")).strip()
        print(f"| {s['task']} | {s['split']} | {s['steps']} | {s['trainer']} | {s['schedule']} | {s['method']} | {s['lr']:g} | {sets} | "
              f"{s['n']} | {100 * s['mean']:.1f}{sd} | {s['heldout_loss']:.4f} | {s['loss']:.3f} | {s['train_seconds']:.0f} |")  # fmt: skip


def family_mean(cells: dict, families: list) -> str:
    """Mean over ``families`` of the per-family means, ± the sd over seeds of the per-seed mean over families (the
    seeds every family ran), (that seed count); a setting missing families shows its mean over those it has, [k/n]."""
    have = [f for f in families if f in cells]
    if not have:
        return ""
    mean = 100 * statistics.mean(cells[f]["mean"] for f in have)
    if len(have) < len(families):
        return f"{mean:.1f} [{len(have)}/{len(families)}]"
    common = set.intersection(*(set(cells[f]["by_seed"]) for f in families))
    per_seed = [statistics.mean(cells[f]["by_seed"][seed] for f in families) for seed in sorted(common)]
    sd = f" ± {100 * statistics.stdev(per_seed):.1f}" if len(per_seed) > 1 else ""
    return f"{mean:.1f}{sd} ({len(per_seed)})"


def print_family_tables(rows: list[dict]) -> None:
    """Per run length, trainer, schedule and device: one row per setting, one column per family (dev families
    first, marked), then the mean over the dev and over the test families. Cells: exact match (%) mean ± sd over
    seeds (seed count)."""
    blocks: dict = {}
    for s in summarize(rows):
        blocks.setdefault((s["steps"], s["trainer"], s["schedule"], s["device"]), []).append(s)
    order = {m: i for i, m in enumerate(METHODS)}
    for (steps, trainer, schedule, device), summaries in sorted(blocks.items()):
        families = [t for t in TASKS if any(s["task"] == t for s in summaries)]
        families += sorted({s["task"] for s in summaries} - set(TASKS))
        splits = {name: [f for f in families if f in SPLITS[name]] for name in ("dev", "test")}
        settings: dict = {}
        for s in summaries:
            settings.setdefault((s["method"], s["lr"], _label(s)), {})[s["task"]] = s
        print(f"\n**{steps} steps, {trainer} trainer, {schedule} schedule, {device}**: held-out exact match (%), mean ± sd over seeds (seeds)\n")
        header = [f"{f} ({TASKS[f].split})" if f in TASKS else f for f in families]
        header += [f"mean {name} ({len(fs)})" for name, fs in splits.items() if fs]
        print("| method | lr | settings | " + " | ".join(header) + " |")
        print("|---|---|---|" + "---|" * len(header))
        for (method, lr, label), cells in sorted(settings.items(), key=lambda kv: (order.get(kv[0][0], len(order)), kv[0][0], kv[0][1], kv[0][2])):
            row = []
            for f in families:
                c = cells.get(f)
                row.append("" if c is None else f"{100 * c['mean']:.1f}" + (f" ± {100 * c['sd']:.1f}" if c["n"] > 1 else "") + f" ({c['n']})")
            row += [family_mean(cells, fs) for fs in splits.values() if fs]
            print(f"| {method} | {lr:g} | {label} | " + " | ".join(row) + " |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("run", "sweep", "table"))
    parser.add_argument("results", nargs="*", help="table: the JSONL file(s) to summarise (default: --out)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--task", nargs="+", choices=list(TASKS), help="task families to run (default: skills)")
    which.add_argument("--tasks", choices=sorted(SPLITS), help="every dev family, every test family, or all")
    parser.add_argument("--method", "--methods", dest="methods", nargs="+", default=list(METHODS))
    parser.add_argument("--lr", type=float, nargs="+", help="learning rates (run); default: each method's grid (sweep)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--budget-rank", type=int, default=16, help="trainable weights equal to LoRA at this rank")
    parser.add_argument("--trainer", choices=("plain", "hf"), default="plain",
                        help="plain: a PyTorch loop (SpIELScheduler stepped after each optimizer step); hf: transformers' Trainer "
                             "(its AdamW, schedule and clipping; SpIELCallback)")
    parser.add_argument("--schedule", choices=SCHEDULES, default="linear",
                        help="the learning rate after the warm-up: linear decay to 0, constant, or wsd (constant, then linear "
                             "decay to 0 over the last --cooldown-fraction of the steps)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up steps (default: max(1, round(0.03·steps)))")
    parser.add_argument("--cooldown-fraction", type=float, default=None, help="wsd: the fraction of the steps that decay (default 0.2)")
    parser.add_argument("--weight-decay", type=lambda t: t if t == "auto" else float(t), default=0.0,
                        help="decoupled weight decay λ of the optimizer, or auto: peft_sparse.auto_weight_decay for the schedule "
                             "(linear: λ = min(3, 1/(lr·T)), the main recipe's; constant: the same total shrink λ·Σ lr_t)")
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
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--set", nargs="*", metavar="FIELD=VALUE", help="extra config fields (ablations)")
    parser.add_argument("--tag", default="", help="free label stored with the rows")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu (the reference tier) or cuda; float32 either way")
    parser.add_argument("--out", default=str(HERE / "results" / "quality.jsonl"))
    parser.add_argument("--long", action="store_true", help="table: one line per task and setting instead of the family tables")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_intermixed_args(argv)
    if args.command == "table":
        rows = [r for path in (args.results or [args.out]) for r in read_jsonl(Path(path))]
        print_table(rows) if args.long else print_family_tables(rows)
        return
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown --method {unknown}; choose from {list(METHODS)}")
    if args.steps <= 0:
        parser.error(f"--steps must be positive, got {args.steps}")
    if args.warmup_steps is not None and not 0 <= args.warmup_steps < args.steps:
        parser.error(f"--warmup-steps must be in [0, --steps={args.steps}), got {args.warmup_steps}")
    if args.cooldown_fraction is not None and args.schedule != "wsd":
        parser.error(f"--cooldown-fraction={args.cooldown_fraction} applies to --schedule wsd only, not --schedule {args.schedule}")
    if args.schedule == "wsd":
        args.cooldown_fraction = 0.2 if args.cooldown_fraction is None else args.cooldown_fraction
        if not 0 < args.cooldown_fraction <= 1:
            parser.error(f"--cooldown-fraction must be in (0, 1], got {args.cooldown_fraction}")
        if args.weight_decay == "auto":
            parser.error("--weight-decay auto knows the linear and constant schedules; give --schedule wsd a number")
    tasks = SPLITS[args.tasks] if args.tasks else (args.task or ["skills"])
    args.set = dict(item.split("=", 1) for item in args.set or [])
    args.set = {k: parse_value(v) for k, v in args.set.items()}
    if args.threads:
        torch.set_num_threads(args.threads)
    base = load_base()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        data = load_task(task, base[1], args.max_length)
        for method in args.methods:
            for lr in args.lr or LR_GRID[method]:
                for seed in args.seeds:
                    row = run_one(args, task, method, lr, seed, base, data)
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
                    print(f"{task} {method} lr={lr:g} seed={seed} {args.trainer}/{args.schedule} {row['set'] or ''}: exact match "
                          f"{row['exact_match']:.3f} held-out loss {row['heldout_loss']:.4f} (loss {row['final_loss']:.3f}, "
                          f"{row['train_seconds']:.0f}+{row['eval_seconds']:.0f} s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
