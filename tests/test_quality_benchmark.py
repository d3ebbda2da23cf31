"""The quality benchmark's machinery (benchmarks/quality.py, quality_summary.py) on a tiny model: both training paths
train identically where they should, the schedules are the ones named, the dev/test split and the GPU plan hold,
a shared plan is claimed once per line, the reference switch fails clearly, and the tables compute what they say."""

import argparse
import dataclasses
import json
import math
import shlex
import statistics
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import quality  # noqa: E402
import quality_summary  # noqa: E402

from .models import tiny_llama  # noqa: E402


def _args(**fields):
    base = dict(steps=8, batch_size=4, device="cpu", max_grad_norm=1.0, verbose=False, schedule="linear", warmup_steps=2,
                weight_decay="method", lr=None, seed=0, cooldown_fraction=0.25)  # fmt: skip
    base.update(fields)
    return argparse.Namespace(**base)


def _data(n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 5 + i % 4
        ids = torch.randint(1, 97, (length,), generator=g).tolist()
        out.append((ids, [-100, -100] + ids[2:]))
    return out


def _lora():
    import peft

    model = tiny_llama()
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=quality.TARGETS, init_lora_weights=False)
    torch.manual_seed(0)
    wrapped = peft.get_peft_model(model, config)
    return wrapped, [p for p in wrapped.parameters() if p.requires_grad]


@pytest.mark.parametrize("schedule", quality.SCHEDULES)
def test_loop_and_trainer_train_identically(schedule):
    """LoRA without weight decay: the plain loop and transformers' Trainer see the same batches in the same order at the
    same rates, so every step's loss agrees; the rate follows the named schedule (warm-up, then decay or not)."""
    args = _args(schedule=schedule)
    train = _data()
    wrapped, params = _lora()
    optimizer = quality.make_optimizer("adamw", params, 1e-2, 0.0, None)
    loop = quality.train_loop(args, wrapped, params, optimizer, False, train, seed=3, pad_id=0)
    wrapped2, _ = _lora()
    trainer = quality.train_trainer(args, wrapped2, 1e-2, 0.0, "adamw", None, False, train, seed=3, pad_id=0)
    assert len(loop["losses"]) == len(trainer["losses"]) == args.steps
    assert loop["losses"] == pytest.approx(trainer["losses"], rel=1e-4)
    assert loop["rates"] == pytest.approx(trainer["rates"], rel=1e-9, abs=1e-12)
    rates = loop["rates"]
    assert rates[0] == 0.0 and rates[1] == pytest.approx(5e-3) and rates[2] == pytest.approx(1e-2)  # warm-up of 2
    if schedule == "constant":
        assert rates[2:] == pytest.approx([1e-2] * 6)
    elif schedule == "wsd":  # (constant, then the last 2 of 8 steps decay linearly)
        assert rates[2:] == pytest.approx([1e-2] * 4 + [1e-2 * 2 / 2, 1e-2 * 1 / 2])
    elif schedule == "linear":
        assert rates[2:] == pytest.approx([1e-2 * (8 - s) / 6 for s in range(2, 8)])
    else:
        assert rates[2:] == pytest.approx([1e-2 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 6)) for s in range(2, 8)])


def test_batches_are_seeded_epochs():
    order = quality.batch_order(10, 4, 6, seed=1)
    assert order == quality.batch_order(10, 4, 6, seed=1) and order != quality.batch_order(10, 4, 6, seed=2)
    flat = [i for batch in order for i in batch]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))  # (whole epochs)


def test_recommended_weight_decay_follows_the_schedule():
    from peft_sparse.schedules.weight_decay import auto_weight_decay

    linear, constant = _args(steps=150, warmup_steps=None), _args(steps=150, warmup_steps=None, schedule="constant")
    assert quality.resolved_weight_decay(linear, "spiel-ag", 1e-3) == auto_weight_decay(1e-3, 150) == 3.0
    assert quality.resolved_weight_decay(constant, "spiel-ag", 1e-3) == auto_weight_decay(1e-3, 150, "constant_with_warmup", 4)
    assert quality.resolved_weight_decay(constant, "spiel-ag", 1e-3) < 1.6
    assert quality.resolved_weight_decay(linear, "lora", 1e-3) == 0.0
    assert quality.resolved_weight_decay(_args(weight_decay=0.5), "spiel-ag", 1e-3) == 0.5
    assert quality.resolved_lr(_args(steps=150), "spiel-ma") == 1e-3 and quality.resolved_lr(_args(steps=60), "spiel-ma") == 1e-3
    assert quality.resolved_lr(_args(lr=2e-3), "spiel-ma") == 2e-3


def test_default_optimizers_follow_the_recommendations():
    """SpIEL-MA trains beside AdamW by default (chosen on the dev families); block SpIEL-MA and MA's reference mode with
    SM3 (the released optimizer); SpIEL-AG's reference mode and its released 'seeds' rule with AgedAdamW. The summary
    labels a row by the optimizer it ran only where that differs from its method's default."""
    assert [quality.default_optimizer(m) for m in ("lora", "spiel-ag", "spiel-ma", "spiel-ma-block", "spiel-ag-block")] == [
        "adamw", "adamw", "adamw", "sm3", "adamw"]
    assert quality.default_optimizer("spiel-ma", "authors") == "sm3" and quality.default_optimizer("spiel-ag", "authors") == "aged_adamw"
    assert quality.default_optimizer("spiel-ag", None, ("seeds",)) == "aged_adamw"
    fam = quality.SPLITS["test"][0]
    sm3, adamw = _row(fam, "spiel-ma", 0, 0.5, optimizer="sm3"), _row(fam, "spiel-ma", 0, 0.6, optimizer="adamw")
    assert quality_summary.settings_of(sm3)["optimizer"] == "sm3" and "optimizer" not in quality_summary.settings_of(adamw)
    assert "optimizer" not in quality_summary.settings_of(_row(fam, "spiel-ma", 0, 0.5, optimizer="sm3", reference="authors"))


def test_summary_labels_spiel_ma_rows_by_their_seeds():
    """SpIEL-MA rows pool by the seeds they ran with: rows beside AdamW from before the seeds (none recorded) with the
    ``--ma-seeds none`` ablation, apart from the cover (recorded as True by the first rows, then its only form) and
    from the neighbours (MA's behaviour since), which the quality page labels as such."""
    fam = quality.SPLITS["dev"][0]
    setup = {"ma_signal": "sm3", "first_full_replacement": True}
    plain = _row(fam, "spiel-ma", 0, 0.5, optimizer="adamw", ma_setup=dict(setup))
    none = _row(fam, "spiel-ma", 0, 0.5, optimizer="adamw", ma_setup={**setup, "seeds": "none"})
    first = _row(fam, "spiel-ma", 0, 0.5, optimizer="adamw", ma_setup={**setup, "seeds": True})
    cover = _row(fam, "spiel-ma", 0, 0.5, optimizer="adamw", ma_setup={**setup, "seeds": "cover"})
    neighbours = _row(fam, "spiel-ma", 0, 0.5, optimizer="adamw", ma_setup={**setup, "seeds": "neighbours"})
    assert quality.ma_seeds_of(plain) == quality.ma_seeds_of(none) == "none"
    assert quality_summary.settings_of(plain) == quality_summary.settings_of(none) and "seeds" not in quality_summary.settings_of(none)
    assert quality_summary.settings_of(first)["seeds"] == quality_summary.settings_of(cover)["seeds"] == "cover"
    assert quality_summary.settings_of(neighbours)["seeds"] == "neighbours"
    assert quality.ma_seeds_of(_row(fam, "spiel-ma", 0, 0.5, optimizer="sm3", ma_setup=dict(setup))) is None


def test_dev_and_test_families_are_disjoint_and_bundled():
    dev, test = set(quality.SPLITS["dev"]), set(quality.SPLITS["test"])
    assert dev and test and not dev & test and dev | test == set(quality.TASKS)
    assert {"skills", "skills2"} <= dev
    for task in quality.TASKS:
        assert (quality.DATA / f"{task}_train.jsonl").exists() and (quality.DATA / f"{task}_test.jsonl").exists()


def test_gpu_plan_puts_every_path_of_seed_0_first_on_test_families():
    parser = quality.build_parser()
    lines = quality.gpu_plan()
    assert len(lines) == len(set(lines))
    per_seed = len(quality.PLAN_PATHS) * len(quality.SPLITS["test"]) * len(quality.PLAN_METHODS)
    first = [parser.parse_intermixed_args(["run", *line.split()]) for line in lines[:per_seed]]
    assert {a.seeds[0] for a in first} == {0} and {a.steps for a in first} == {150}
    assert {(a.trainer, a.schedule) for a in first} == set(quality.PLAN_PATHS)
    assert {a.task[0] for a in first} == set(quality.SPLITS["test"])
    assert {(a.methods[0], a.reference) for a in first} == set(quality.PLAN_METHODS)
    every = [parser.parse_intermixed_args(["run", *line.split()]) for line in lines]
    assert not {a.task[0] for a in every} & set(quality.SPLITS["dev"])  # (the plan reports test families only)
    assert all(len(a.task) == 1 and len(a.methods) == 1 and len(a.seeds) == 1 and a.lr is not None for a in every)
    assert [a.seeds[0] for a in every[: 3 * per_seed]] == sorted(a.seeds[0] for a in every[: 3 * per_seed])


@pytest.mark.parametrize("name", ["reference_queue.txt", "quality_constant_lr.txt", "ma_dev_queue.txt", "quality_queue_seeds.txt"])
def test_bundled_queue_files_hold_single_runs_that_the_queue_accepts(name):
    """Every line of a bundled plan is one task, one method, one seed whose settings check out (a bad line would
    otherwise surface only as a FAILED run on the GPU); the MA defaults' queue never touches a test family."""
    import shlex

    parser = quality.build_parser()
    path = quality.HERE / name
    lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines and len(lines) == len(set(lines))
    for line in lines:
        run = parser.parse_intermixed_args(["run", *shlex.split(line)])
        run.set = quality.parse_sets(parser, run.set)
        tasks, methods, seeds = quality.resolve_selection(parser, run)
        assert len(tasks) * len(methods) * len(seeds) == 1, line
        quality.check_run_args(parser, run)
        quality.check_reference_supported(run.reference, methods)
        if name == "ma_dev_queue.txt" or "--tag ma-dev" in line:  # (the runs that chose MA's defaults)
            assert quality.TASKS[tasks[0]].split == "dev", line


def test_a_shared_plan_is_claimed_once_per_line(tmp_path):
    lines = [f"line {i}" for i in range(5)]
    counter = tmp_path / "plan.claims"
    got = [quality.claim(counter, lines, lambda line: True) for _ in range(3)]
    assert got == [0, 1, 2]
    assert quality.claim(counter, lines, lambda line: line != "line 3") is None  # (does not fit: left unclaimed)
    assert quality.claim(counter, lines, lambda line: True) == 3
    assert quality.claim(counter, lines, lambda line: True) == 4
    assert quality.claim(counter, lines, lambda line: True) is None


def test_queue_skips_lines_done_in_earlier_results(tmp_path, monkeypatch):
    """A line is done when an earlier row has its text and ran with the optimizer, budget split and MA seeds the line
    resolves to today: a SpIEL-MA line run with SM3 (the earlier default) runs again beside AdamW, one run beside
    AdamW without seeds runs again with them, and a SpIEL-AG line run under the earlier adaptive preset runs again with
    the uniform split."""
    parser = quality.build_parser()
    lines = quality.gpu_plan(seeds=(0,), families=["classify"])[:4]
    assert [quality.line_optimizer(parser, line) for line in lines] == ["adamw"] * 4 and "spiel-ma" in lines[3]
    methods = [parser.parse_intermixed_args(["run", *shlex.split(line)]).methods[0] for line in lines]
    assert methods == ["lora", "sft-random", "spiel-ag", "spiel-ma"]
    assert [quality.line_budget_split(parser, line) for line in lines] == [None, None, "uniform", "uniform"]
    assert quality.line_budget_split(parser, lines[2] + " --set budget_split=adaptive") == "adaptive"
    assert quality.line_optimizer(parser, lines[3] + " --optimizer sm3") == "sm3"
    assert quality.line_optimizer(parser, lines[3] + " --reference authors") == "sm3"
    assert [quality.line_ma_seeds(parser, line) for line in lines] == [None, None, None, "neighbours"]
    assert quality.line_ma_seeds(parser, lines[3] + " --ma-seeds none") == "none"
    assert quality.line_ma_seeds(parser, lines[3] + " --ma-seeds") == "cover"
    assert quality.line_ma_seeds(parser, lines[3] + " --optimizer sm3") is None
    assert quality.line_ma_seeds(parser, lines[3] + " --reference authors") is None
    plan = tmp_path / "plan.txt"
    plan.write_text("\n".join(lines) + "\n")

    class Loaded(BaseException):
        pass

    def load_base():
        raise Loaded

    monkeypatch.setattr(quality, "load_base", load_base)
    done = tmp_path / "done.jsonl"
    cases = (("adamw", "uniform", "neighbours", False), ("sm3", "uniform", None, True), ("adamw", None, "neighbours", True),
             ("adamw", "uniform", None, True))  # fmt: skip
    for ma_optimizer, ag_split, seeds, runs in cases:
        rows = [{"job": line, "method": m, "trainer": "loop", "optimizer": ma_optimizer if m == "spiel-ma" else "adamw",
                 "budget_split": (ag_split if m == "spiel-ag" else "uniform") if m.startswith("spiel") else None}
                for line, m in zip(lines, methods)]  # fmt: skip
        rows[3]["ma_setup"] = {"ma_signal": "sm3", "first_full_replacement": True, **({"seeds": seeds} if seeds else {})}
        assert quality.budget_split_of(rows[2]) == (ag_split or "adaptive")  # (no field: the earlier preset)
        assert quality.ma_seeds_of(rows[3]) == (seeds or ("none" if ma_optimizer == "adamw" else None))  # (none recorded)
        done.write_text("".join(json.dumps(row) + "\n" for row in rows))
        Path(str(plan) + ".claims").unlink(missing_ok=True)
        args = parser.parse_intermixed_args(["queue", str(plan), "--skip-done", str(done), "--out", str(tmp_path / "rows.jsonl")])
        if runs:
            with pytest.raises(Loaded):  # (the SpIEL-MA or SpIEL-AG line is left to run: the model is loaded for it)
                quality.run_queue(parser, args)
        else:
            quality.run_queue(parser, args)
    assert not (tmp_path / "rows.jsonl").exists()


def test_reference_switch_needs_the_config_field(monkeypatch):
    import peft_sparse

    has_field = "reference" in {f.name for f in dataclasses.fields(peft_sparse.SpIELConfig)}
    if not has_field:
        with pytest.raises(SystemExit, match="no SpIELConfig.reference field"):
            quality.check_reference_supported("authors", ["spiel-ag"])

    @dataclasses.dataclass
    class WithReference(peft_sparse.SpIELConfig):
        reference: str = None

    monkeypatch.setattr(peft_sparse, "SpIELConfig", WithReference)
    monkeypatch.setattr(peft_sparse, "AgedAdamW", torch.optim.AdamW, raising=False)
    quality.check_reference_supported("authors", ["spiel-ag", "spiel-ma"])
    with pytest.raises(SystemExit, match=r"--methods \['lora'\]"):
        quality.check_reference_supported("authors", ["spiel-ag", "lora"])
    quality.check_reference_supported(None, ["lora"])


def test_reference_mode_passes_reference_and_spiel_ag_takes_the_configs_split(monkeypatch):
    import peft
    import peft_sparse

    seen = []

    class Recorder:
        def __init__(self, **fields):
            seen.append(fields)

    monkeypatch.setattr(peft_sparse, "SpIELConfig", Recorder)
    monkeypatch.setattr(peft, "get_peft_model", lambda model, config: torch.nn.Linear(1, 1))
    quality.build("spiel-ag", None, 1000, 16, 0, {}, reference="authors")
    quality.build("spiel-ag", None, 1000, 16, 0, {})
    quality.build("spiel-ma", None, 1000, 16, 0, {"ma_regrow_dropped": False}, reference="authors")
    assert seen[0]["reference"] == "authors" and seen[0]["growth"] == "ag" and "budget_split" not in seen[0]
    assert "reference" not in seen[1] and "budget_split" not in seen[1]  # (the uniform split, chosen on the dev families)
    assert seen[2]["reference"] == "authors" and seen[2]["growth"] == "ma" and seen[2]["ma_regrow_dropped"] is False


def _row(task, method, seed, score, **fields):
    row = {"task": task, "method": method, "seed": seed, "exact_match": score, "steps": 150, "lr": 1e-3, "final_loss": 1.0,
           "train_seconds": 1.0, "heldout_loss": 0.5, "trainer": "loop", "schedule": "linear", "device": "cpu",
           "budget_split": "uniform" if method in quality.SPIEL_VARIANTS else None}  # fmt: skip  (as rows record it)
    row.update(fields)
    return row


def test_summary_means_and_sds_over_seeds_and_families(capsys):
    test = quality.SPLITS["test"][:2]
    rows = [
        _row(test[0], "lora", 0, 0.5), _row(test[0], "lora", 1, 0.7),
        _row(test[1], "lora", 0, 0.9), _row(test[1], "lora", 1, 0.8, trainer="plain"),  # (a legacy name: the loop)
        _row(test[0], "spiel-ag", 0, 0.6, reference="authors"),
        _row(test[0], "spiel-ag", 0, 0.7, released_rules=["seeds"], optimizer="aged_adamw"),
    ]  # fmt: skip
    cells = {s["task"]: s for s in quality_summary.summarize(rows) if s["method"] == "lora"}
    assert cells[test[0]]["mean"] == pytest.approx(0.6) and cells[test[0]]["sd"] == pytest.approx(statistics.stdev([0.5, 0.7]))
    assert cells[test[1]]["n"] == 2  # ('plain' pooled with 'loop')
    per_seed = [(0.5 + 0.9) / 2, (0.7 + 0.8) / 2]
    assert quality_summary.family_mean(cells, test) == f"{100 * statistics.mean(per_seed):.1f} ± {100 * statistics.stdev(per_seed):.1f} (2)"
    assert quality_summary.family_mean(cells, test + ["x"]) == "72.5 [2/3]"  # ((60 + 85) / 2)
    text = "\n".join(quality_summary.family_tables(rows) + quality_summary.paths_tables(rows))
    assert f"{test[0]} (test)" in text and "spiel-ag (authors)" in text and "loop + linear" in text
    assert "spiel-ag (released seeds)" in text and "optimizer aged_adamw" not in text  # (the rule's own optimizer)


def test_summary_labels_spiel_ag_rows_by_the_split_they_ran_with():
    """SpIEL-AG rows of the earlier adaptive preset (a training path, no split recorded) show their split; rows of the
    uniform split pool, whether the line named it (``--set budget_split=uniform``) or took the default."""
    family = quality.SPLITS["test"][0]
    rows = [
        _row(family, "spiel-ag", 0, 0.6, budget_split=None),  # (the adaptive preset: no split recorded)
        _row(family, "spiel-ag", 0, 0.7, set={"budget_split": "uniform"}, budget_split="uniform"),
        _row(family, "spiel-ag", 1, 0.9, budget_split="uniform"),
        _row(family, "sft-random", 0, 0.5, set={"budget_split": "lora"}),
    ]  # fmt: skip
    for row in rows:  # (each at its method's recommended weight decay: no λ in the label)
        row["weight_decay"] = quality_summary.recommended_decay(row) or 0.0
    labels = {(s["method"], s["settings"]): s for s in quality_summary.summarize(rows)}
    assert labels[("spiel-ag", "budget_split adaptive")]["n"] == 1
    assert labels[("spiel-ag", "")]["n"] == 2 and labels[("spiel-ag", "")]["mean"] == pytest.approx(0.8)
    assert ("sft-random", "budget_split lora") in labels
    old = {k: v for k, v in _row(family, "spiel-ag", 0, 0.6, budget_split=None).items() if k != "trainer"}  # (before the preset: the default)
    assert quality.budget_split_of(old) == "uniform" and quality.budget_split_of(_row(family, "lora", 0, 0.5)) is None


@pytest.mark.parametrize("method,rules,kind,split", [("spiel-ag", (), "adamw", None), ("spiel-ag", (), "adamw", "adaptive"),
                                                     ("spiel-ma", (), "adamw", None), ("spiel-ma", (), "sm3", None),
                                                     ("spiel-ag", ("windows",), "adamw", None), ("spiel-ma", ("no_regrowth",), "sm3", None)])
def test_spiel_reselects_identically_in_the_loop_and_under_the_trainer(method, rules, kind, split):
    """SpIEL with reselections (every 3 steps) and weight decay: SpIELScheduler stepped after each optimizer step in the
    loop and SpIELCallback under the Trainer give the same losses and the same reselections (AdamW with decay on the
    values in both, MA's accumulators then the scheduler's; MA also beside SM3), also with a released rule switched on
    (``--released-rule``), which the wrapped model's config carries to the callback."""
    from peft_sparse.methods.spiel.rules import released

    args = _args(steps=9, warmup_steps=1)
    train = _data(12)
    fields = {"reselection_steps": 3, "gradient_estimation_steps": 1}
    if split:
        fields["budget_split"] = split
    runs = []
    for path in ("loop", "trainer"):
        wrapped, params = quality.build(method, tiny_llama(), 600, 4, 0, dict(fields), rules=rules)
        assert [r for r in ("windows", "no_regrowth") if released(wrapped.peft_config["default"], r)] == list(rules)
        form = {"momentum": 0.0, "beta2": None} if kind == "sm3" else None
        if path == "loop":
            runs.append(quality.train_loop(args, wrapped, params, quality.make_optimizer(kind, params, 1e-2, 0.1, form), True, train, 1, 0))
        else:
            runs.append(quality.train_trainer(args, wrapped, 1e-2, 0.1, kind, form, True, train, 1, 0))
    loop, trainer = runs
    assert len(loop["reselections"]) == len(trainer["reselections"]) >= 2
    assert loop["losses"] == pytest.approx(trainer["losses"], rel=1e-4)


def test_summary_pools_spiel_ag_at_its_recommended_decay_across_schedules():
    """SpIEL-AG at the recommended λ of each schedule (3 under linear decay, about 1.5 at a constant rate) is one
    setting of the paths table; a λ set by hand is a setting of its own."""
    from peft_sparse.schedules.weight_decay import auto_weight_decay

    fam = quality.SPLITS["test"][0]
    rows = [
        _row(fam, "spiel-ag", 0, 0.8, weight_decay=auto_weight_decay(1e-3, 150), warmup_steps=4),
        _row(fam, "spiel-ag", 0, 0.6, schedule="constant", warmup_steps=4,
             weight_decay=auto_weight_decay(1e-3, 150, "constant_with_warmup", 4)),
        _row(fam, "spiel-ag", 0, 0.7, schedule="constant", warmup_steps=4, weight_decay=0.0),
    ]  # fmt: skip
    labels = [quality_summary.label(quality_summary.settings_of(r)) for r in rows]
    assert labels[0] == labels[1] == "" and labels[2] != ""
    table = quality_summary.paths_tables(rows)
    assert sum(line.startswith("| spiel-ag |") for line in table) == 2


@pytest.mark.parametrize("fields", [{}, {"reference": "authors"}])
def test_lt_sft_runs_its_phases_identically_in_the_loop_and_under_the_trainer(fields):
    """LT-SFT in the benchmark: the first half of the run dense at full fine-tuning's rate, the second sparse at the
    method's rate on the K weights that moved most; the plain loop (LTSFTScheduler attached to the schedule) and the
    Trainer (LTSFTCallback) give the same losses and the same rates, and the selected adapter holds K values."""
    args = _args(steps=8, warmup_steps=1)
    train = _data(12)
    runs, kept = [], []
    for path in ("loop", "trainer"):
        reference = fields.get("reference")
        wrapped, params = quality.build("lt-sft", tiny_llama(), 300, 4, 0, {}, reference=reference, steps=8, lr=1e-2)
        if path == "loop":
            runs.append(quality.train_loop(args, wrapped, params, quality.make_optimizer("adamw", params, 1e-2, 0.0, None), False, train,
                                           1, 0, lt_sft=True))  # fmt: skip
        else:
            runs.append(quality.train_trainer(args, wrapped, 1e-2, 0.0, "adamw", None, False, train, 1, 0, lt_sft=True))
        kept.append(sum(p.numel() for p in wrapped.parameters() if p.requires_grad))
        assert wrapped.peft_config["default"].phase == "sparse"
    loop, trainer = runs
    assert loop["losses"] == pytest.approx(trainer["losses"], rel=1e-4)
    assert loop["rates"] == pytest.approx(trainer["rates"], rel=1e-6)
    factor = [1.0 - max(0, s - 1) / 7 if s >= 1 else 0.0 for s in range(8)]  # (linear: warm-up of 1, decay to 0 at 8)
    assert loop["rates"][:4] == pytest.approx([quality.LT_SFT_DENSE_LR * f for f in factor[:4]], rel=1e-6)
    assert loop["rates"][4:] == pytest.approx([1e-2 * f for f in factor[4:]], rel=1e-6)
    assert kept[0] == kept[1] >= 300 and (kept[0] == 300 or fields)


def test_bundled_task_files_are_what_the_generator_writes():
    """Every family the generator builds without a tokenizer is bundled exactly as its fixed seed writes it (a family
    added later, like the dev family ``facts``, leaves the others' files as they were), with no held-out prompt in
    its training file."""
    sys.path.insert(0, str(quality.DATA))
    import make_tasks

    for family in sorted(set(make_tasks.FAMILIES) - make_tasks.NEEDS_TOKENIZER):
        train, test = make_tasks.generate(family)
        assert (quality.DATA / f"{family}_train.jsonl").read_text() == make_tasks.lines(train), family
        assert (quality.DATA / f"{family}_test.jsonl").read_text() == make_tasks.lines(test), family
        assert family in quality.TASKS
