"""Scoring and reporting a recipe's run: exact match before and after training, also for a run that trained
sharded (FSDP, ZeRO-3: the first process scores the saved model, loaded again unsharded), and the summary's
records of it."""

from __future__ import annotations

import contextlib
from typing import Optional


def _scores(result: dict | None) -> dict | None:
    """The summary's record of one exact-match pass: accuracy, per skill, and every reply."""
    if result is None:
        return None
    return {"accuracy": result["accuracy"], "per_skill": result["per_skill"], "replies": [r["reply"] for r in result["items"]]}


@contextlib.contextmanager
def _zero3_set_aside(training_args):
    """While the first process alone loads and generates: transformers' ZeRO-3 switch off. Under it from_pretrained
    partitions the new model across the ranks and generate waits for them (synced_gpus): both need every rank,
    and the others are already waiting at the end of the run."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled, set_hf_deepspeed_config, unset_hf_deepspeed_config

    config = getattr(training_args, "hf_deepspeed_config", None)
    if config is None or not is_deepspeed_zero3_enabled():
        yield
        return
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(config)


def _score_saved(model_kwargs: dict, saved_dir, is_adapter: bool, tokenizer, eval_rows, eval_kwargs, device):
    """Exact match of the base model and of the model saved in ``saved_dir`` (an adapter, or a whole model for full
    fine-tuning), both loaded again unsharded on ``device``: how the first process scores a run that trained sharded
    (FSDP, ZeRO-3), whose model generates only with every rank taking part. Memory: one unsharded copy of the
    model, as when it was loaded for training; ``evaluation.sharded: skip`` leaves it out."""
    from .assets import load_model_and_tokenizer
    from .evaluation import exact_match

    def placed(model):
        return model if getattr(model, "hf_quantizer", None) is not None else model.to(device)  # (4-bit: placed by its loader)

    base = placed(load_model_and_tokenizer(**model_kwargs)[0])
    before = exact_match(base, tokenizer, eval_rows, **eval_kwargs)
    if is_adapter:
        from peft import PeftModel

        trained = PeftModel.from_pretrained(base, str(saved_dir))
    else:
        del base  # (the whole fine-tuned model was saved: loaded from its folder with the same dtype)
        kwargs = {k: v for k, v in model_kwargs.items() if k not in ("source", "gguf_file")}
        trained = placed(load_model_and_tokenizer(str(saved_dir), **kwargs)[0])
    return before, exact_match(trained, tokenizer, eval_rows, **eval_kwargs)


def _engine(trainer) -> str:
    """How the Trainer ran the model: "deepspeed-zero<stage>", "fsdp", "ddp" or "single"."""
    if getattr(trainer, "is_deepspeed_enabled", False):
        stage = (trainer.accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization") or {}).get("stage", 0)
        return f"deepspeed-zero{stage}"
    if getattr(trainer, "is_fsdp_enabled", False):
        return "fsdp"
    return "ddp" if trainer.args.world_size > 1 else "single"


def _first_line(text: str) -> str:
    return text.strip().split("\n")[0][:40]


def print_comparison(before: Optional[dict], after: dict, show: int = 6) -> None:
    """Per-skill exact match before and after training, and a few held-out replies."""
    print("\n=== held-out exact match ===")
    print(f"{'skill':<14}{'before':>8}{'after':>8}")
    for skill, acc in after["per_skill"].items():
        old = f"{before['per_skill'][skill]:.0%}" if before else "-"
        print(f"{skill:<14}{old:>8}{acc:>8.0%}")
    old = f"{before['accuracy']:.0%}" if before else "-"
    print(f"{'overall':<14}{old:>8}{after['accuracy']:>8.0%}   ({after['correct']}/{after['total']} items)")
    items = after["items"]
    picks = range(0, len(items), max(1, len(items) // max(1, show)))
    if show:
        print("\nexamples: prompt / before → after (expected)")
    for i in list(picks)[:show]:
        was = _first_line(before["items"][i]["reply"]) if before else ""
        print(f"  {items[i]['prompt']}\n    {was!r} → {_first_line(items[i]['reply'])!r}  ({items[i]['answer']!r})")


def trainable_summary(model) -> str:
    """The trainable count with each denominator named: all of the model's parameters (the adapter's own included, as
    PEFT's ``trainable%``), and for a sparse adapter its values against the weights of the modules it targets (the
    density the config and ``peft-sparse inspect`` give)."""
    from .core.budget import total_budget
    from .core.config import SparseConfig

    if hasattr(model, "get_nb_trainable_parameters"):  # (PEFT's count: 4-bit and sharded parameters at full size)
        trainable, total = model.get_nb_trainable_parameters()
    else:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
    parts = [f"trainable parameters: {trainable:,} = {trainable / max(1, total):.2%} of all {total:,} parameters (the adapter's own included)"]
    configs = getattr(model, "peft_config", None)
    if not configs:  # (no adapter: full fine-tuning; transformers' models have an active_adapters method of their own)
        return "; ".join(parts)
    names = model.active_adapters
    for name in names() if callable(names) else names:
        config = configs.get(name)
        if not isinstance(config, SparseConfig) or not config.module_shapes or not config.tunable_weights_per_module:
            continue
        targeted = sum(int(o) * int(i) for o, i in config.module_shapes.values())
        values = sum(config.tunable_weights_per_module.values())
        if getattr(config, "phase", None) == "dense":  # (LT-SFT: every targeted weight trains, then K are kept)
            kept = total_budget(targeted, config.density, config.num_tunable_weights)
            parts.append(f"LT-SFT's dense phase trains all {targeted:,} weights of the targeted modules and keeps "
                         f"{kept:,} = {kept / targeted:.2%} of them (the density)")  # fmt: skip
        else:
            parts.append(f"sparse delta {name!r}: {values:,} values = {values / targeted:.2%} of the {targeted:,} weights of the targeted modules (the density)")
    return "; ".join(parts)
