"""YAML recipes: one file says which model, which sparse method, which data and which TRL settings.

::

    model:      {source: smollm2-135m-instruct, dtype: float32}
    method:     {peft_type: SPIEL, target_modules: all-linear, density: 0.01, ...}   # a sparse config, LORA or FULL
    data:       {train: data/skills_train.jsonl, eval: data/skills_test.jsonl}      # relative to the recipe, or hub:NAME
    training:   {output_dir: ..., max_steps: ..., learning_rate: ...}             # trl.SFTConfig fields
    evaluation: {max_new_tokens: 8, batch_size: 16}                               # exact match before/after

:func:`load_recipe` builds every object the recipe names (so a typo fails before any training) and
:func:`run_recipe` wires them: TRL ``SFTTrainer`` + the method's callbacks, evaluation before and
after, adapter saved to ``<output_dir>/adapter``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from .recipe_data import HUB, read_jsonl, read_rows  # noqa: F401 (re-exported)
from .recipe_report import _engine, _score_saved, _scores, _zero3_set_aside, print_comparison, trainable_summary  # noqa: F401 (print_comparison re-exported)

SECTIONS = {"model", "method", "data", "training", "evaluation", "slow_fast"}
MODEL_KEYS = {"source", "gguf_file", "dtype", "quantization"}
DATA_KEYS = {"train", "eval", "train_limit", "subset"}
QUANTIZATIONS = ("nf4",)
EVAL_KEYS = {"max_new_tokens", "batch_size", "show", "reference", "sharded"}
SHARDED_SCORING = ("reload", "skip")  # evaluation.sharded: how a sharded run (FSDP, ZeRO-3) is scored


@dataclass
class Recipe:
    path: Optional[Path]
    model: dict
    peft_config: Any
    data: dict
    training_args: Any
    evaluation: dict = field(default_factory=dict)
    slow_fast: Optional[dict] = None  # slow-fast settings for LoRA / full fine-tuning (sparse configs record their own)
    sm3: bool = False  # training.optim: sm3 (SpIEL-MA trains with peft_sparse.SM3 instead of the Trainer's optimizer)


def _check_keys(section: str, got: dict, allowed: set[str]) -> None:
    unknown = sorted(set(got) - allowed)
    if unknown:
        raise ValueError(f"recipe section {section!r} has unknown keys {unknown}; allowed: {sorted(allowed)}")


def build_peft_config(method: dict):
    """The method's PEFT config from a mapping with ``peft_type`` and that config's fields: any sparse method,
    ``LORA`` (PEFT's ``LoraConfig``), or ``FULL`` (no adapter: full fine-tuning, returns None)."""
    from .core.config import SparseConfig
    from .registry import PEFT_TYPE_TO_CONFIG_MAPPING

    method = dict(method)
    peft_type = str(method.pop("peft_type", "")).upper()
    if peft_type == "FULL":
        if method:
            raise ValueError(f"recipe method.peft_type=FULL (full fine-tuning) takes no other fields, got {sorted(method)}")
        return None
    config_cls = PEFT_TYPE_TO_CONFIG_MAPPING.get(peft_type) if peft_type else None
    if config_cls is None or not (issubclass(config_cls, SparseConfig) or peft_type == "LORA"):
        sparse = sorted(k for k, v in PEFT_TYPE_TO_CONFIG_MAPPING.items() if isinstance(v, type) and issubclass(v, SparseConfig))
        raise ValueError(f"recipe method.peft_type={peft_type or None!r} is not supported; choose one of {sparse}, LORA or FULL")
    names = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(method) - names)
    if unknown:
        raise ValueError(f"recipe method has fields {unknown} that {config_cls.__name__} does not have")
    return config_cls(**method)


def _type_error(value, kind) -> bool:
    """Whether ``value`` cannot be a ``kind`` field (int, float or bool; optional: None allowed; others unchecked)."""
    optional = isinstance(kind, types.UnionType) and type(None) in kind.__args__
    if optional:
        if value is None:
            return False
        rest = [k for k in kind.__args__ if k is not type(None)]
        kind = rest[0] if len(rest) == 1 else None
    if kind is bool:
        return not isinstance(value, bool)
    if kind is int:
        return isinstance(value, bool) or not isinstance(value, int)
    if kind is float:
        return isinstance(value, bool) or not isinstance(value, (int, float))
    return False


def build_training_args(training: dict):
    from trl import SFTConfig

    fields = {f.name: f for f in dataclasses.fields(SFTConfig)}
    unknown = sorted(set(training) - set(fields))
    if unknown:
        raise ValueError(f"recipe training has fields {unknown} that trl.SFTConfig does not have")
    training = dict(training)
    if training.get("weight_decay") == "auto":  # λ = min(3, 1/(lr·T)) / (2m), m the schedule's mean rate: peft_sparse.schedules.weight_decay
        from .schedules.weight_decay import auto_weight_decay

        steps, lr = training.get("max_steps", -1), training.get("learning_rate", fields["learning_rate"].default)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
            raise ValueError(
                f"recipe training.weight_decay='auto' sets λ = min(3, 1/(learning_rate·max_steps)) and needs "
                f"training.max_steps > 0, got training.max_steps={steps!r} (or give training.weight_decay a number)"
            )
        schedule = training.get("lr_scheduler_type", fields["lr_scheduler_type"].default)
        schedule = getattr(schedule, "value", schedule)  # (a SchedulerType, or its name)
        warmup = training.get("warmup_steps", fields["warmup_steps"].default)
        if isinstance(warmup, bool) or not isinstance(warmup, (int, float)):
            warmup = 0  # (not a number: the field's own check below names it)
        warmup = int(warmup) if warmup >= 1 else math.ceil(steps * warmup)  # (as TrainingArguments: below 1, a ratio of the steps)
        try:
            training["weight_decay"] = auto_weight_decay(lr, steps, schedule, warmup)
        except ValueError as exc:
            raise ValueError(f"recipe training.learning_rate={lr!r}, lr_scheduler_type={schedule!r}: {exc}") from None
    elif isinstance(training.get("weight_decay"), str):
        raise ValueError(f"recipe training.weight_decay must be a number or 'auto', got training.weight_decay={training['weight_decay']!r}")
    for key, value in training.items():  # (SFTConfig checks few types itself: a wrong one fails deep in training)
        kind = fields[key].type
        if _type_error(value, kind):
            raise ValueError(f"recipe training.{key}={value!r} must be {getattr(kind, '__name__', kind)}")
    training = dict(training)
    if "activation_checkpointing" in fields:
        # transformers renamed gradient_checkpointing to activation_checkpointing; TRL still sets the old name's
        # default (True), which warns on every run. Pass the value under the current name instead.
        for old, new in (("gradient_checkpointing", "activation_checkpointing"), ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
            if new in fields and training.get(new) is None:
                value = training.pop(old, fields[old].default if old in fields else None)
                if value is not None and value is not dataclasses.MISSING:
                    training[new] = value
    return SFTConfig(**training)


def load_recipe(path_or_mapping, overrides: Optional[dict] = None) -> Recipe:
    """Parse and validate a recipe; ``overrides`` maps 'section.key' to a value (e.g. from the CLI)."""
    if isinstance(path_or_mapping, (str, os.PathLike)):
        path = Path(path_or_mapping)
        try:
            raw = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ValueError(f"recipe {path} is not valid YAML: {exc}") from None
    else:
        path, raw = None, dict(path_or_mapping)
    if not isinstance(raw, dict):
        raise ValueError(f"recipe {path} must be a mapping with sections {sorted(SECTIONS)}")
    _check_keys("top level", raw, SECTIONS)
    for section in SECTIONS:
        if raw.get(section) is not None and not isinstance(raw[section], dict):
            raise ValueError(f"recipe section {section!r} must be a mapping of keys to values, got {section}={raw[section]!r}")
    raw = {k: dict(raw.get(k) or {}) for k in SECTIONS}
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        if section not in SECTIONS or not key:
            raise ValueError(f"override {dotted!r} must look like 'section.key' with section in {sorted(SECTIONS)}")
        raw[section][key] = value
    _check_keys("model", raw["model"], MODEL_KEYS)
    _check_keys("data", raw["data"], DATA_KEYS)
    _check_keys("evaluation", raw["evaluation"], EVAL_KEYS)
    reference = raw["evaluation"].get("reference")
    if reference is not None and (not isinstance(reference, dict) or not all(isinstance(v, str) for v in reference.values())):
        raise ValueError(f"recipe evaluation.reference must map labels to text, got evaluation.reference={reference!r}")
    if raw["evaluation"].get("sharded", "reload") not in SHARDED_SCORING:
        raise ValueError(f"recipe evaluation.sharded must be one of {SHARDED_SCORING}, got evaluation.sharded={raw['evaluation']['sharded']!r}")
    if "source" not in raw["model"]:
        raise ValueError("recipe model.source is required (a built-in model name or a local directory)")
    quantization = raw["model"].get("quantization")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"recipe model.quantization={quantization!r} is not supported; use one of {QUANTIZATIONS} or leave it out")
    base = path.parent if path is not None else Path.cwd()
    data = {}
    for split, rel in raw["data"].items():
        if rel is None:  # (an override may clear an entry: --set data.subset=null)
            continue
        if split == "subset":  # rows whose `dataset` field names this subset (e.g. flan_v2 in the Tulu v2 mixture)
            if not isinstance(rel, str) or not rel:
                raise ValueError(f"recipe data.subset must name a subset, got data.subset={rel!r}")
            data[split] = rel
            continue
        if split == "train_limit":
            if isinstance(rel, bool) or not isinstance(rel, int) or rel <= 0:
                raise ValueError(f"recipe data.train_limit must be a positive integer, got data.train_limit={rel!r}")
            data[split] = rel
            continue
        if str(rel).startswith(HUB):  # a hub dataset by name, read when the recipe runs (online only)
            data[split] = str(rel)
            continue
        p = Path(rel) if os.path.isabs(rel) else base / rel
        if not p.is_file():
            raise ValueError(f"recipe data.{split}={rel!r} does not exist (looked at {p}); a hub dataset is written hub:NAME")
        data[split] = p
    if "train" not in data:
        raise ValueError("recipe data.train is required")
    peft_config = build_peft_config(raw["method"])
    sm3 = raw["training"].get("optim") == SM3_OPTIM
    if sm3:  # (not one of transformers' optimizer names: the recipe runner builds SM3 itself)
        if getattr(peft_config, "growth", None) != "ma":
            raise ValueError(
                f"recipe training.optim={SM3_OPTIM!r} is SpIEL-MA's optimizer (method.peft_type: SPIEL, method.growth: ma); "
                f"this recipe's method is {type(peft_config).__name__ if peft_config is not None else 'FULL'}"
                + (f" with growth={peft_config.growth!r}" if hasattr(peft_config, "growth") else "")
            )
        raw["training"].pop("optim")
    elif raw["training"].get("optim_args") and raw["training"].get("optim") in ADAMW_NAMES:
        raise ValueError(
            f"recipe training.optim_args={raw['training']['optim_args']!r} would be ignored: AdamW (training.optim="
            f"{raw['training'].get('optim')!r}) reads no optim_args; they set SM3's form with training.optim: sm3 "
            "(SpIEL-MA), or the arguments of another of transformers' optimizers"
        )
    training_args = build_training_args(raw["training"])
    slow_fast = None
    if raw["slow_fast"]:  # slow-fast learning rates: recorded in a sparse adapter's config, applied by the callback
        from .core.config import SparseConfig
        from .schedules.slow_fast import SlowFastConfig

        try:
            slow_fast = SlowFastConfig.from_value(raw["slow_fast"]).to_dict()
        except ValueError as exc:
            raise ValueError(f"recipe slow_fast: {exc}") from None
        if isinstance(peft_config, SparseConfig):
            peft_config.slow_fast, slow_fast = slow_fast, None
    if sm3:
        import torch

        from .optim import SM3

        try:  # (SM3's own checks of momentum, beta2 and eps, before anything runs)
            SM3([torch.zeros(1, requires_grad=True)], lr=training_args.learning_rate,
                **ma_sm3_kwargs(training_args.optim_args, training_args.max_steps))
        except ValueError as exc:
            raise ValueError(f"recipe training.optim_args={training_args.optim_args!r} for SpIEL-MA's SM3: {exc}") from None
    phases = getattr(peft_config, "dense_steps", None), getattr(peft_config, "sparse_steps", None)
    if None not in phases and training_args.max_steps != sum(phases):
        raise ValueError(
            f"recipe training.max_steps={training_args.max_steps} must equal method.dense_steps + method.sparse_steps "
            f"= {phases[0]} + {phases[1]} (LT-SFT trains both phases in one run)"
        )
    return Recipe(
        path=path,
        model=raw["model"],
        peft_config=peft_config,
        data=data,
        training_args=training_args,
        evaluation=raw["evaluation"],
        slow_fast=slow_fast,
        sm3=sm3,
    )


def method_callbacks(peft_config) -> list:
    """Trainer callbacks a method needs (dynamic methods drive their scheduler from Trainer events)."""
    from .callbacks import callbacks_for

    return callbacks_for(peft_config)


# SpIEL-MA's optimizer in a recipe: the Trainer's (AdamW unless training.optim names another; the scheduler keeps MA's
# row and column accumulators itself). Over the six dev families of the quality benchmark (150 steps, seeds 0-2, lr
# 1e-3) MA beside AdamW at weight decay 0 scored 59.2 against 52.2 with SM3 (docs/quality-families.md). `training.optim:
# sm3` trains with peft_sparse.SM3, the thesis's pairing (§7.3), in the form below unless training.optim_args names one.
SM3_OPTIM = "sm3"
ADAMW_NAMES = (None, "adamw_torch", "adamw_torch_fused")  # training.optim values whose AdamW reads no optim_args
# SM3's form for SpIEL-MA, by the run's length T = training.max_steps (BENCHMARKS.md, Quality; 5 seeds each on
# skills / skills2):
# * up to MA_SUMS_MAX_STEPS steps, SM3's sums without momentum, whose steps shrink as 1/√t: at 60 steps and lr 3e-3
#   71.0 / 65.0 (AG 71.5 / 64.4), where the moving average with momentum reached at most 69.0 / 61.2 at lr 5e-4 to 4e-3;
# * beyond, or with no max_steps (epochs), the moving-average form with momentum: at 150 steps 75.5 / 71.9 (lr 5e-4;
#   AG 77.0 / 73.1) where the sums were 3 under AG on skills2, at 600 steps 78.8 / 77.0 (lr 1e-3).
# The switch lies between the 60 and 150 steps measured.
MA_SUMS_MAX_STEPS = 100
MA_SM3_SHORT_RUN = {"momentum": 0.0, "beta2": None}
MA_SM3_DEFAULTS = {"momentum": 0.9, "beta2": 0.999}


def ma_sm3_defaults(max_steps: Optional[int]) -> dict:
    """SM3's momentum and β₂ for SpIEL-MA over a run of ``max_steps`` steps (None or ≤ 0: not known beforehand):
    :data:`MA_SM3_SHORT_RUN` up to :data:`MA_SUMS_MAX_STEPS` steps, :data:`MA_SM3_DEFAULTS` otherwise."""
    short = max_steps is not None and 0 < max_steps <= MA_SUMS_MAX_STEPS
    return dict(MA_SM3_SHORT_RUN if short else MA_SM3_DEFAULTS)


def ma_sm3_kwargs(optim_args: Optional[str], max_steps: Optional[int] = None) -> dict:
    """SM3's keyword arguments for SpIEL-MA from a recipe's ``training.optim_args`` ("momentum=0.9,beta2=0.999";
    ``beta2=none`` for the sums of Anil et al.), over :func:`ma_sm3_defaults` for a run of ``max_steps``; unknown
    names and bad values are refused by name."""
    kwargs = ma_sm3_defaults(max_steps)
    for item in (optim_args or "").replace(" ", "").split(","):
        if not item:
            continue
        name, sep, text = item.partition("=")
        if not sep or name not in ("momentum", "beta2", "eps"):
            raise ValueError(f"recipe training.optim_args={optim_args!r}: SpIEL-MA's SM3 takes momentum=, beta2= and eps=, got {item!r}")
        if name == "beta2" and text.lower() == "none":
            kwargs[name] = None
            continue
        try:
            kwargs[name] = float(text)
        except ValueError:
            raise ValueError(f"recipe training.optim_args={optim_args!r}: {name} must be a number{' or none' if name == 'beta2' else ''}, got {text!r}") from None
    return kwargs


def _optimizer(recipe: Recipe):
    """SM3 for a recipe whose ``training.optim`` is ``sm3`` (SpIEL-MA only; its momentum, β₂ and eps from
    :func:`ma_sm3_kwargs`, by the run's length); otherwise None: the Trainer builds its own optimizer (AdamW unless
    ``training.optim`` names another), and a SpIEL-MA scheduler keeps the row and column accumulators itself."""
    if not recipe.sm3:
        return None
    from .optim import SM3

    kwargs = {"lr": recipe.training_args.learning_rate, "weight_decay": recipe.training_args.weight_decay}
    return SM3, {**kwargs, **ma_sm3_kwargs(recipe.training_args.optim_args, recipe.training_args.max_steps)}


def _sm3_settings(optimizer) -> Optional[dict]:
    """SM3's momentum and β₂ (None: the sums) as the run used them, or None when the optimizer is not SM3."""
    from .optim import SM3

    optimizer = getattr(optimizer, "optimizer", optimizer)  # (accelerate's wrapper)
    if not isinstance(optimizer, SM3):
        return None
    group = optimizer.param_groups[0]
    return {"momentum": group["momentum"], "beta2": group["beta2"]}


def _slow_fast_callbacks(recipe: Recipe) -> list:
    if not recipe.slow_fast:
        return []
    from .callbacks import SlowFastCallback
    from .schedules.slow_fast import SlowFastConfig

    return [SlowFastCallback(SlowFastConfig.from_value(recipe.slow_fast))]


def run_recipe(recipe: Recipe) -> dict:
    """Train the recipe's sparse method with TRL's SFTTrainer; evaluate before and after; save the adapter."""
    import torch
    from datasets import Dataset
    from trl import SFTTrainer

    from .assets import load_model_and_tokenizer
    from .evaluation import exact_match

    started = time.time()
    model_kwargs = dict(recipe.model)
    if model_kwargs.pop("quantization", None) == "nf4":  # QLoRA / qSpIEL: NF4 base weights, bfloat16 compute
        from transformers import BitsAndBytesConfig

        model_kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True
        )
    model, tokenizer = load_model_and_tokenizer(**model_kwargs)
    train_rows = read_rows(recipe.data["train"], recipe.data.get("train_limit"), recipe.data.get("subset"))
    eval_rows = read_rows(recipe.data["eval"]) if "eval" in recipe.data else []
    eval_rows = [r for r in eval_rows if "answer" in r]  # (exact match needs reference answers)
    if any("messages" in r for r in train_rows):
        # chats: tokenized here with labels on assistant turns only (TRL keeps given labels), over-long ones counted
        from .data.instructions import check_row, tokenize_chats

        for i, r in enumerate(train_rows):
            check_row(r, f"{recipe.data['train']}[{i}]")
        examples, report = tokenize_chats(tokenizer, train_rows, recipe.training_args.max_length or 1024)
        print(f"training chats: {report['kept']} kept, {report['too_long']} longer than max_length and "
              f"{report['prompt_too_long']} whose prompt alone is, left out")  # fmt: skip
        train = Dataset.from_list([{"input_ids": ids, "labels": labels} for ids, labels in examples])  # (TRL keeps given labels)
    else:
        columns = ("prompt", "completion")
        train = Dataset.from_list([{k: r[k] for k in columns} for r in train_rows])
    ev = recipe.evaluation
    eval_kwargs = {"max_new_tokens": ev.get("max_new_tokens", 8), "batch_size": ev.get("batch_size", 16)}

    # under torchrun / accelerate launch every process trains; the first alone evaluates, saves and reports
    main_process = int(os.environ.get("RANK", "0")) == 0
    trainer = SFTTrainer(
        model=model,
        args=recipe.training_args,
        train_dataset=train,
        processing_class=tokenizer,
        peft_config=recipe.peft_config,
        callbacks=method_callbacks(recipe.peft_config) + _slow_fast_callbacks(recipe),
        optimizer_cls_and_kwargs=_optimizer(recipe),
    )
    # scored before training on the model as the Trainer placed it (its device: a GPU run evaluates on the GPU);
    # the adapter's delta starts at zero, so these are the base model's answers
    # a sharded model (FSDP, DeepSpeed ZeRO-3) generates only with every rank taking part: scored from the saved adapter instead
    sharded = _engine(trainer) in ("fsdp", "deepspeed-zero3")
    before = exact_match(trainer.model, tokenizer, eval_rows, **eval_kwargs) if eval_rows and main_process and not sharded else None
    if before:
        print(f"before training: {before['accuracy']:.1%} exact match on {before['total']} held-out items")
    print(trainable_summary(trainer.model))
    # training.resume_from_checkpoint: a checkpoint folder, or true for the last one in output_dir (the
    # methods' callbacks restore their scheduler state from it, at any world size with the same max_steps)
    train_result = trainer.train(resume_from_checkpoint=recipe.training_args.resume_from_checkpoint or None)
    # full fine-tuning saves the whole model; every other method its adapter (the Trainer gathers a sharded model
    # and writes from the first process only)
    adapter_dir = Path(recipe.training_args.output_dir) / ("model" if recipe.peft_config is None else "adapter")
    trainer.save_model(str(adapter_dir))
    if not trainer.is_world_process_zero():
        return {"adapter_dir": str(adapter_dir), "world_size": trainer.args.world_size}
    if sharded and eval_rows and ev.get("sharded", "reload") == "reload":
        # the first process loads the base model again, unsharded, and scores it before and with the saved file
        with _zero3_set_aside(trainer.args):
            before, after = _score_saved(model_kwargs, adapter_dir, recipe.peft_config is not None, tokenizer, eval_rows,
                                         eval_kwargs, trainer.args.device)  # fmt: skip
        print(f"before training (the base model, loaded again unsharded): {before['accuracy']:.1%} exact match on {before['total']} held-out items")
    elif sharded and eval_rows:
        print(f"the model is sharded ({_engine(trainer)}) and evaluation.sharded is 'skip': load {adapter_dir} on the base model to score it")
        after = None
    else:
        after = exact_match(trainer.model, tokenizer, eval_rows, **eval_kwargs) if eval_rows else None
    if after:
        print_comparison(before, after, ev.get("show", 6))
        for label, text in (ev.get("reference") or {}).items():  # recorded scores of other methods on the same data
            print(f"{label}: {text}")
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    summary = {
        "adapter_dir": str(adapter_dir),
        "train_loss_first": losses[0] if losses else None,
        "train_loss_last": losses[-1] if losses else None,
        "train_runtime_s": train_result.metrics.get("train_runtime"),
        "total_runtime_s": time.time() - started,
        "before": _scores(before),
        "after": _scores(after),
        "torch_threads": torch.get_num_threads(),
        "world_size": trainer.args.world_size,
        "engine": _engine(trainer),
        "reselection_steps": [h["step"] for h in trainer.state.log_history if "spiel/replaced" in h],
        "weight_decay": trainer.args.weight_decay,  # (resolved: training.weight_decay 'auto' is λ = min(3, 1/(lr·T)))
        "sm3": _sm3_settings(trainer.optimizer),  # (SpIEL-MA's SM3 form as it ran: by run length unless optim_args set it)
    }
    with open(Path(recipe.training_args.output_dir) / "summary.json", "w") as f:
        json.dump(summary, f, indent=2)
    print(f"\nadapter saved to {adapter_dir}; total time {summary['total_runtime_s']:.0f} s")
    return summary
