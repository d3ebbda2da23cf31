"""Tables of the quality benchmark from its JSONL rows (benchmarks/quality.py): the quality page's tables.

    python benchmarks/quality_summary.py rows.jsonl [more.jsonl ...]          # family tables and the paths overview
    python benchmarks/quality_summary.py rows.jsonl --long                    # one line per family and setting
    python benchmarks/quality_summary.py rows.jsonl --steps 150 --device "NVIDIA H100 80GB HBM3"

Rows pool over seeds where everything but the seed is equal: family, run length, method and its reference mode,
learning rate, settings (config fields, weight decay, optimizer form, warm-up, clipping), tag, training path
(trainer, schedule) and device (GPU numerics differ from CPU ones: never pooled). Cells are held-out exact match (%)
as mean ± sd over seeds (seed count). A mean over families is the mean of the per-family means ± the sd over seeds
of the per-seed mean over families (over the seeds every family ran), with [k/n] where a setting has k of n families.
Families are marked (dev) or (test) as ``quality.TASKS`` splits them.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quality  # noqa: E402
from quality import HF_SCHEDULES, LEGACY_TRAINERS, METHODS, RECOMMENDED, SPLITS, TASKS, read_jsonl  # noqa: E402

PRE_AUTO_MA_SETUP = {"ma_signal": "sm3", "first_full_replacement": True, "seeds": None}


def trainer_of(r: dict) -> str:
    """The training path's trainer: 'loop' or 'trainer' (rows without the field ran the plain loop)."""
    t = r.get("trainer", "loop")
    return LEGACY_TRAINERS.get(t, t)


def method_of(r: dict) -> str:
    """The method with its reference mode: 'spiel-ag' or 'spiel-ag (authors)'."""
    ref = r.get("reference") or (r.get("set") or {}).get("reference")
    if r.get("released_rules"):
        return f"{r['method']} (released {'+'.join(r['released_rules'])})"
    return f"{r['method']} ({ref})" if ref else r["method"]


def default_optimizer(r: dict) -> str:
    """The optimizer the row's method trains with by default today (rows that ran another show it as a setting)."""
    return quality.default_optimizer(r["method"], r.get("reference") or (r.get("set") or {}).get("reference"), r.get("released_rules") or ())


def recommended_decay(r: dict) -> float | None:
    """The weight decay the method's recommended settings give this row's schedule, rate and length (None: unknown),
    so that rows at it show no λ and pool across schedules in the paths table."""
    recipe = RECOMMENDED.get(r["method"])
    if recipe is None:
        return None
    if recipe.weight_decay != "auto":
        return float(recipe.weight_decay)
    schedule = HF_SCHEDULES.get(r.get("schedule", "linear"))
    if schedule not in ("linear", "cosine", "constant_with_warmup"):
        return None
    from peft_sparse.schedules.weight_decay import auto_weight_decay

    warmup = r.get("warmup_steps", max(1, round(0.03 * r["steps"])))
    return auto_weight_decay(r["lr"], r["steps"], schedule, warmup)


def settings_of(r: dict) -> dict:
    """What a row ran with beyond its method, lr, length, schedule and trainer (rows with equal settings pool)."""
    settings = {k: v for k, v in (r.get("set") or {}).items() if k != "reference"}
    if r["method"] in quality.SPIEL_VARIANTS:  # (the split as run: SpIEL-AG's rows under the earlier adaptive preset show it)
        settings.pop("budget_split", None)
        split = quality.budget_split_of(r)
        if split != "uniform":
            settings["budget_split"] = split
    setup = dict(r.get("ma_setup") or {})
    if setup:  # (MA's seeds as run: the cover for the flag before it took a form; none recorded or "none": without)
        seeds = quality.ma_seeds_of(r)
        setup["seeds"] = None if seeds == "none" else seeds
    for name, value in setup.items():  # (as resolved, where it differs from what rows without it ran with: those
        if value != PRE_AUTO_MA_SETUP[name]:  # predate block MA's 'io' and 'auto' defaults and MA's seeds ablation)
            settings[name] = value
    decay, recommended = r.get("weight_decay") or 0.0, recommended_decay(r)
    if (decay != 0.0) if recommended is None else not math.isclose(decay, recommended, rel_tol=1e-9, abs_tol=1e-12):
        settings["λ"] = round(decay, 3)
    optimizer = r.get("optimizer")
    if optimizer and optimizer != default_optimizer(r):
        settings["optimizer"] = optimizer
    if r.get("sm3_momentum"):
        settings["sm3_momentum"] = r["sm3_momentum"]
    if r.get("sm3_beta2"):
        settings["sm3_beta2"] = r["sm3_beta2"]
    if r.get("no_reselection"):
        settings["reselection"] = "off"
    if r.get("warmup_steps", max(1, round(0.03 * r["steps"]))) != max(1, round(0.03 * r["steps"])):
        settings["warmup_steps"] = r["warmup_steps"]
    if r.get("cooldown_fraction") is not None:
        settings["cooldown"] = r["cooldown_fraction"]
    if r.get("eval_limit"):
        settings["eval_limit"] = r["eval_limit"]
    if r.get("max_grad_norm", 1.0) != 1.0:
        settings["max_grad_norm"] = r["max_grad_norm"]
    return settings


def label(settings: dict, tag: str = "") -> str:
    text = ", ".join(f"{k} {v}" for k, v in settings.items())
    return (text + " " + tag).strip()


def summarize(rows: list[dict]) -> list[dict]:
    """Mean ± sd over seeds of each (family, length, method, lr, settings, tag, trainer, schedule, device)."""
    groups: dict = {}
    for r in rows:
        key = (r["task"], r["steps"], method_of(r), r["lr"], label(settings_of(r), r.get("tag") or ""),
               trainer_of(r), r.get("schedule", "linear"), r.get("device", "cpu"))  # fmt: skip
        groups.setdefault(key, []).append(r)
    out = []
    for (task, steps, method, lr, settings, trainer, schedule, device), rs in sorted(groups.items()):
        by_seed: dict = {}
        for r in rs:
            by_seed.setdefault(r["seed"], []).append(r["exact_match"])
        seed_means = [statistics.mean(v) for v in by_seed.values()]  # (a seed run twice counts once, as its mean)
        out.append({
            "task": task, "split": TASKS[task].split if task in TASKS else "?", "steps": steps, "method": method, "lr": lr,
            "settings": settings, "trainer": trainer, "schedule": schedule, "device": device, "n": len(seed_means),
            "mean": statistics.mean(seed_means), "sd": statistics.stdev(seed_means) if len(seed_means) > 1 else 0.0,
            "by_seed": {k: statistics.mean(v) for k, v in by_seed.items()},
            "loss": statistics.mean(r["final_loss"] for r in rs), "train_seconds": statistics.mean(r["train_seconds"] for r in rs),
            "heldout_loss": statistics.mean(r["heldout_loss"] for r in rs) if all("heldout_loss" in r for r in rs) else float("nan"),
        })  # fmt: skip
    return out


def cell(c: dict | None) -> str:
    if c is None:
        return ""
    return f"{100 * c['mean']:.1f}" + (f" ± {100 * c['sd']:.1f}" if c["n"] > 1 else "") + f" ({c['n']})"


def family_mean(cells: dict, families: list) -> str:
    """Mean over ``families`` of the per-family means ± the sd over seeds of the per-seed mean over families (the
    seeds every family ran) (that seed count); a setting missing families shows its mean over those it has, [k/n]."""
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


def method_order(method: str) -> tuple:
    base, _, ref = method.partition(" ")
    order = {m: i for i, m in enumerate(METHODS)}
    return (order.get(base, len(order)), base, ref)


def print_long(rows: list[dict]) -> None:
    """One line per family and setting."""
    print("| family | split | steps | trainer | schedule | method | lr | settings | seeds | exact match (%) | held-out loss | final train loss | train s | device |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in summarize(rows):
        sd = f" ± {100 * s['sd']:.1f}" if s["n"] > 1 else ""
        print(f"| {s['task']} | {s['split']} | {s['steps']} | {s['trainer']} | {s['schedule']} | {s['method']} | {s['lr']:g} | "
              f"{s['settings']} | {s['n']} | {100 * s['mean']:.1f}{sd} | {s['heldout_loss']:.4f} | {s['loss']:.3f} | "
              f"{s['train_seconds']:.0f} | {s['device']} |")  # fmt: skip


def family_tables(rows: list[dict]) -> list[str]:
    """Per run length, training path and device: one row per setting, one column per family (dev families first,
    each marked), then the mean over the dev and over the test families."""
    out = []
    blocks: dict = {}
    for s in summarize(rows):
        blocks.setdefault((s["steps"], s["trainer"], s["schedule"], s["device"]), []).append(s)
    for (steps, trainer, schedule, device), summaries in sorted(blocks.items()):
        families = [t for t in TASKS if any(s["task"] == t for s in summaries)]
        families += sorted({s["task"] for s in summaries} - set(TASKS))
        splits = {name: [f for f in families if f in SPLITS[name]] for name in ("dev", "test")}
        settings: dict = {}
        for s in summaries:
            settings.setdefault((s["method"], s["lr"], s["settings"]), {})[s["task"]] = s
        out.append(f"\n**{steps} steps, {trainer}, {schedule} schedule, {device}**: held-out exact match (%), mean ± sd over seeds (seeds)\n")
        header = [f"{f} ({TASKS[f].split})" if f in TASKS else f for f in families]
        header += [f"mean {name} ({len(fs)})" for name, fs in splits.items() if fs]
        out.append("| method | lr | settings | " + " | ".join(header) + " |")
        out.append("|---|---|---|" + "---|" * len(header))
        for (method, lr, settings_label), cells in sorted(settings.items(), key=lambda kv: (method_order(kv[0][0]), kv[0][1], kv[0][2])):
            row = [cell(cells.get(f)) for f in families] + [family_mean(cells, fs) for fs in splits.values() if fs]
            out.append(f"| {method} | {lr:g} | {settings_label} | " + " | ".join(row) + " |")
    return out


def paths_tables(rows: list[dict], split: str = "test") -> list[str]:
    """Per run length and device: one row per setting (method, lr, settings), one column per training path, each
    cell the mean over the ``split`` families ± sd over seeds (seed count)."""
    out = []
    blocks: dict = {}
    for s in summarize(rows):
        if s["split"] == split:
            blocks.setdefault((s["steps"], s["device"]), []).append(s)
    for (steps, device), summaries in sorted(blocks.items()):
        paths = sorted({(s["trainer"], s["schedule"]) for s in summaries})
        settings: dict = {}
        for s in summaries:
            settings.setdefault((s["method"], s["lr"], s["settings"]), {}).setdefault((s["trainer"], s["schedule"]), {})[s["task"]] = s
        families = [f for f in SPLITS[split] if any(s["task"] == f for s in summaries)]
        out.append(f"\n**{steps} steps, {device}, mean over the {len(families)} {split} families** ({', '.join(families)}): "
                   "held-out exact match (%), mean ± sd over seeds (seeds)\n")  # fmt: skip
        out.append("| method | lr | settings | " + " | ".join(f"{t} + {sch}" for t, sch in paths) + " |")
        out.append("|---|---|---|" + "---|" * len(paths))
        for (method, lr, settings_label), by_path in sorted(settings.items(), key=lambda kv: (method_order(kv[0][0]), kv[0][1], kv[0][2])):
            row = [family_mean(by_path[p], families) if p in by_path else "" for p in paths]
            out.append(f"| {method} | {lr:g} | {settings_label} | " + " | ".join(row) + " |")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="JSONL files of benchmarks/quality.py rows")
    parser.add_argument("--long", action="store_true", help="one line per family and setting")
    parser.add_argument("--steps", type=int, nargs="*", help="only these run lengths")
    parser.add_argument("--device", nargs="*", help="only rows of these devices (as recorded, e.g. cpu)")
    args = parser.parse_args(argv)
    rows = [r for path in args.results for r in read_jsonl(Path(path))]
    rows = [r for r in rows if (not args.steps or r["steps"] in args.steps) and (not args.device or r.get("device", "cpu") in args.device)]
    if not rows:
        raise SystemExit(f"no rows in {args.results} (after --steps / --device)")
    if args.long:
        print_long(rows)
        return
    print("\n".join(paths_tables(rows, "test") + paths_tables(rows, "dev") + family_tables(rows)))


if __name__ == "__main__":
    main()
