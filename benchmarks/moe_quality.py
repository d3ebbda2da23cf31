"""Fine-tuning a mixture-of-experts model at equal trainable budget, on CPU and offline: SpIEL on the fused expert
tensors against LoRA on them (``target_parameters``) and SpIEL on attention only; and how SpIEL splits its budget
across experts. Produces docs/moe.md, "Quality on a tiny MoE" (both tables).

The model is a tiny Mixtral built from a config (character-level, 4 layers, 8 experts per layer of which 2 per
token, hidden 64). It is first trained densely on the bundled ``skills2`` task (every parameter, with the
load-balancing loss; once, kept in ``--cache``): the "pre-trained" model. Each arm then fine-tunes it on the bundled
``skills`` task — different skills — in a plain PyTorch loop with the same data order, and is scored on the held-out
``skills`` test set: mean cross-entropy per answer character (teacher-forced) and exact match of greedy answers.

Arms (every adapter has the trainable count of LoRA at ``--rank`` on both expert tensors of every layer):

* ``lora-experts``: PEFT's LoRA with ``target_parameters`` = gate_up_proj, down_proj (rank r per expert);
* ``spiel-experts``: SpIEL-AG on the same tensors, the budget split uniformly (the same count in every expert);
* ``spiel-experts-tokens``: the same, each expert's count in proportion to the tokens routed to it on the training
  set by the pre-trained router (a calibration pass; passed as exact counts, ``tunable_weights_per_module``);
* ``spiel-experts-adaptive``: ``budget_split='adaptive'``: reselections move budget between experts;
* ``spiel-attention``: SpIEL-AG on q/k/v/o_proj only.

    python benchmarks/moe_quality.py run --out benchmarks/results/moe-quality-cpu.jsonl      # 3 seeds, every arm
    python benchmarks/moe_quality.py table benchmarks/results/moe-quality-cpu.jsonl

Every run appends one JSON line (arm, seed, lr, trainable count, eval loss, exact match, seconds, and for SpIEL
arms how often a reselection found an expert no token had reached: the no-token rule's share).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "recipes" / "data"
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ARMS = ("lora-experts", "spiel-experts", "spiel-experts-tokens", "spiel-experts-adaptive", "spiel-attention")
PAD, BOS, EOS = 0, 1, 2  # then the bytes, shifted by 3


# ------------------------------------------------------------------------------------------ data
def read(name: str) -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]
    return [(r["prompt"][0]["content"], r["answer"]) for r in rows]


def encode(prompt: str, answer: str | None) -> tuple[list[int], int]:
    """Character ids of "Q: prompt\\nA: answer" + EOS, and where the answer starts."""
    head = [BOS] + [b + 3 for b in f"Q: {prompt}\nA: ".encode()]
    if answer is None:
        return head, len(head)
    return head + [b + 3 for b in answer.encode()] + [EOS], len(head)


def batch(pairs: list, answer_only: bool) -> dict:
    """Right-padded ids, attention mask and labels (the answer and EOS only, or every token)."""
    encoded = [encode(p, a) for p, a in pairs]
    length = max(len(ids) for ids, _ in encoded)
    ids = torch.full((len(encoded), length), PAD)
    labels = torch.full((len(encoded), length), -100)
    for i, (row, start) in enumerate(encoded):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, start if answer_only else 1 : len(row)] = torch.tensor(row[start if answer_only else 1 :])
    return {"input_ids": ids, "attention_mask": (ids != PAD).long(), "labels": labels}


# ------------------------------------------------------------------------------------------ the base model
def tiny_moe(seed: int = 0):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=259, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
        tie_word_embeddings=False, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, router_aux_loss_coef=0.02,
    )  # fmt: skip
    return MixtralForCausalLM(config)


def pretrained(cache: Path, steps: int = 1000) -> Path:
    """Train the tiny MoE densely on skills2 (train and test items) once; returns its folder."""
    folder = cache / f"tiny-moe-skills2-{steps}"
    if (folder / "config.json").is_file():
        return folder
    model = tiny_moe()
    model.config.output_router_logits = True  # (load balancing: keeps every expert in use)
    data = read("skills2_train.jsonl") + read("skills2_test.jsonl")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    g = torch.Generator().manual_seed(0)
    model.train()
    for step in range(steps):
        rows = [data[i] for i in torch.randint(len(data), (16,), generator=g).tolist()]
        loss = model(**batch(rows, answer_only=False)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        if step % 200 == 0 or step == steps - 1:
            print(f"pre-training step {step}: loss {loss.item():.3f}", flush=True)
    model.config.output_router_logits = False
    model.save_pretrained(folder)
    return folder


def routed_share(model, data: list) -> dict:
    """{(layer, expert): share of the layer's routed tokens} of the (unadapted) model over ``data``."""
    counts = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        def count(module, args, kwargs, i=i):
            ids = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
            counts[i] = counts.get(i, 0) + torch.bincount(ids.reshape(-1), minlength=module.num_experts)

        hooks.append(layer.mlp.experts.register_forward_pre_hook(count, with_kwargs=True))
    with torch.no_grad():
        for start in range(0, len(data), 64):
            model(**batch(data[start : start + 64], answer_only=True))
    for h in hooks:
        h.remove()
    return {(i, e): float(c[e] / c.sum()) for i, c in counts.items() for e in range(c.numel())}


# ------------------------------------------------------------------------------------------ arms
def adapter(arm: str, base, budget: int, rank: int, seed: int, train: list):
    from peft import LoraConfig, get_peft_model

    from peft_sparse import SpIELConfig
    from peft_sparse.core.budget import split_budget

    if arm == "lora-experts":
        return get_peft_model(base, LoraConfig(target_modules=[], target_parameters=EXPERTS, r=rank, lora_alpha=2 * rank))
    if arm == "spiel-attention":
        return get_peft_model(base, SpIELConfig(target_modules=ATTENTION, num_tunable_weights=budget, seed=seed))
    if arm == "spiel-experts-tokens":  # each expert's count ∝ its share of routed tokens (exact counts)
        share = routed_share(base, train)
        layers = len(base.model.layers)
        sizes, weights = {}, {}
        for i in range(layers):
            for name in EXPERTS:
                param = base.get_parameter(f"model.layers.{i}.{name}")
                for e in range(param.shape[0]):
                    key = f"model.layers.{i}.{name}.{e}"
                    sizes[key] = param[e].numel()
                    weights[key] = max(1, round(1e6 * share[(i, e)]))  # (an expert without tokens keeps one weight)
        counts = split_budget(sizes, budget, 1, weights)
        return get_peft_model(base, SpIELConfig(target_parameters=EXPERTS, num_tunable_weights=budget, tunable_weights_per_module=counts, seed=seed))
    split = "adaptive" if arm == "spiel-experts-adaptive" else "uniform"
    return get_peft_model(base, SpIELConfig(target_parameters=EXPERTS, num_tunable_weights=budget, budget_split=split, seed=seed))


def evaluate(model, test: list) -> tuple[float, float]:
    """(mean cross-entropy per answer character, exact match of greedy answers) on ``test``."""
    model.eval()
    with torch.no_grad():
        b = batch(test, answer_only=True)
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten(), ignore_index=-100).item()
        prompts = [encode(prompt, None)[0] for prompt, _ in test]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), PAD)
        for i, p in enumerate(prompts):  # (left-padded: generation continues every row at its end)
            ids[i, width - len(p) :] = torch.tensor(p)
        longest = max(len(answer.encode()) for _, answer in test)
        out = model.generate(input_ids=ids, attention_mask=(ids != PAD).long(), max_new_tokens=longest + 2, do_sample=False,
                             eos_token_id=EOS, pad_token_id=PAD)[:, width:]  # fmt: skip
        correct = 0
        for row, (_, answer) in zip(out.tolist(), test):
            row = row[: row.index(EOS)] if EOS in row else row
            text = bytes(t - 3 for t in row if 3 <= t < 259).decode(errors="replace")
            correct += text == answer
    return loss, correct / len(test)


def run_one(arm: str, seed: int, lr: float, args, folder: Path) -> dict:
    from transformers import MixtralForCausalLM

    from peft_sparse import SpIELScheduler

    train, test = read("skills_train.jsonl"), read("skills_test.jsonl")
    base = MixtralForCausalLM.from_pretrained(folder)
    lora = adapter("lora-experts", MixtralForCausalLM.from_pretrained(folder), 0, args.rank, seed, train)
    budget = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    torch.manual_seed(seed)
    model = adapter(arm, base, budget, args.rank, seed, train)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    scheduler = SpIELScheduler(model, optimizer, total_steps=args.steps) if arm.startswith("spiel") else None
    g = torch.Generator().manual_seed(seed)
    start = time.time()
    idle_reselections = reselections = 0
    model.train()
    for step in range(args.steps):
        rows = [train[i] for i in torch.randint(len(train), (args.batch,), generator=g).tolist()]
        model(**batch(rows, answer_only=True)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            idle = scheduler.routing.idle()  # (read before the step: it restarts the count at a reselection)
            if scheduler.step():
                reselections += 1
                idle_reselections += bool(idle)
    seconds = time.time() - start
    from peft_sparse.core.experts import SparseSlice

    counts = [m.sparse_values["default"].numel() for m in model.modules() if isinstance(m, SparseSlice)]
    share = routed_share(MixtralForCausalLM.from_pretrained(folder), train).values()
    eval_loss, exact = evaluate(model.merge_and_unload(), test)
    return {
        "arm": arm, "seed": seed, "lr": lr, "steps": args.steps, "batch": args.batch, "rank": args.rank,
        "trainable": sum(p.numel() for p in trainable), "eval_loss": eval_loss, "exact_match": exact,
        "reselections": reselections, "reselections_with_idle_expert": idle_reselections, "seconds": round(seconds, 1),
        "expert_count_min": min(counts, default=None), "expert_count_max": max(counts, default=None),
        "routed_share_min": min(share), "routed_share_max": max(share),
        "machine": platform.machine(), "torch": torch.__version__,
    }  # fmt: skip


def table(path: Path) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("phase", "run") == "run"]
    out = ["| arm | trainable | lr | eval loss per answer char (mean ± sd) | exact match (mean ± sd) | seeds |", "|---|---:|---:|---:|---:|---:|"]
    for arm in ("pre-trained", *ARMS):
        mine = [r for r in rows if r["arm"] == arm]
        if not mine:
            continue
        loss, em = [r["eval_loss"] for r in mine], [100 * r["exact_match"] for r in mine]
        sd = (lambda v: statistics.stdev(v) if len(v) > 1 else 0.0)
        lr = "–" if mine[0]["lr"] is None else f"{mine[0]['lr']:g}"
        out.append(f"| {arm} | {mine[0]['trainable']:,} | {lr} | {statistics.mean(loss):.3f} ± {sd(loss):.3f} | "
                   f"{statistics.mean(em):.1f} ± {sd(em):.1f} % | {len([r for r in mine if r['seed'] is not None])} |")  # fmt: skip
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    run.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    run.add_argument("--steps", type=int, default=300)
    run.add_argument("--batch", type=int, default=16)
    run.add_argument("--rank", type=int, default=4)
    run.add_argument("--lr", type=float, nargs="+", default=None, help="one rate for every arm, or one per arm (default: the chosen rates)")
    run.add_argument("--phase", default="run", help="recorded with each row ('sweep' rows are left out of the table)")
    run.add_argument("--threads", type=int, default=1)
    run.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "peft_sparse")
    tab = sub.add_parser("table")
    tab.add_argument("path", type=Path)
    args = parser.parse_args()
    if args.command == "table":
        print(table(args.path))
        return
    torch.set_num_threads(args.threads)  # (one thread: on a shared CPU more only wait for each other)
    folder = pretrained(args.cache)
    rates = args.lr or [LEARNING_RATES[a] for a in args.arms]
    rates = rates * len(args.arms) if len(rates) == 1 else rates
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.phase == "run":  # the pre-trained model itself, for reference
        from transformers import MixtralForCausalLM

        loss, exact = evaluate(MixtralForCausalLM.from_pretrained(folder), read("skills_test.jsonl"))
        row = {"arm": "pre-trained", "seed": None, "lr": None, "trainable": 0, "eval_loss": loss, "exact_match": exact, "phase": "run"}
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    for seed in args.seeds:
        for arm, lr in zip(args.arms, rates):
            row = run_one(arm, seed, lr, args, folder)
            row["phase"] = args.phase
            print(json.dumps(row), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


# chosen on seed 0 from {1e-3, 3e-3, 1e-2} by eval loss, LoRA and SpIEL on the experts (the results file's "sweep" rows):
# 1e-3 for both; the other SpIEL arms use SpIEL's rate
LEARNING_RATES = {arm: 1e-3 for arm in ARMS}

if __name__ == "__main__":
    main()
