"""The peft-sparse command's subcommands: train a recipe, merge adapters into a model, evaluate a model, inspect an
adapter. The command line is parsed by ``peft_sparse_cli`` (the installed entry point), before this module and the
library are imported; ``python -m peft_sparse.cli`` runs the same command."""

from __future__ import annotations

import json
import sys

from peft_sparse_cli import build_parser  # noqa: F401  (the command's parser, re-exported)


def cmd_train(args) -> int:
    from .recipe import load_recipe, run_recipe

    overrides = dict(args.set or [])
    if args.model_file:
        overrides["model.source"] = args.model_file
    recipe = load_recipe(args.recipe, overrides=overrides)
    run_recipe(recipe)
    _finish_processes()
    return 0


def _finish_processes() -> None:
    """Under torchrun / accelerate launch: every process waits until the first one has written the adapter and
    summary, then the process group is taken down in order (a process leaving while its peers' communication
    threads still run can abort at exit: seen with DeepSpeed on CPU processes)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def cmd_merge(args) -> int:
    from .assets import load_model_and_tokenizer
    from .core.compose import merge_sparse_adapters

    if args.output is None:
        from pathlib import Path

        args.output = str(Path("outputs") / f"merged-{Path(args.adapter[0]).resolve().name}")
    model, tokenizer = load_model_and_tokenizer(args.base, gguf_file=args.gguf_file, dtype=args.dtype)
    merge_sparse_adapters(model, args.adapter, args.weights)
    model.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    print(f"merged {len(args.adapter)} adapter(s) into {args.base}; saved to {args.output}")
    return 0


def _inspect_madg(args) -> int:
    from .methods.madg.generator import describe_generator

    info = describe_generator(args.adapter_dir)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"method: {info['variant']} (PEFT type MADG), {len(info['languages'])} training languages: {', '.join(info['languages'])}")
    print(f"base model: {info['base_model']}")
    print("parameters: " + ", ".join(f"{k} {v:,}" for k, v in info["parameters"].items()) + f"; bottleneck size {info['bottleneck_size']}")
    order = sorted(range(len(info["importance"])), key=lambda j: -info["importance"][j])
    print(f"\n{'typological feature':<44}{'‖(W·V)[:, j]‖':>16}")
    for j in order[: args.top_features]:
        print(f"{info['feature_names'][j]:<44}{info['importance'][j]:>16.4f}")
    if args.feature_plot:
        from .plots import feature_importance_bars

        path = feature_importance_bars(info["feature_names"], info["importance"], args.feature_plot, top=args.top_features)
        print(f"\nfeature plot written to {path}")
    return 0


def _inspect_bottleneck(args) -> int:
    import os

    from safetensors import safe_open

    from .core.config import read_adapter_config
    from .core.storage import reading, weights_path

    raw = read_adapter_config(args.adapter_dir)
    path = weights_path(args.adapter_dir)
    modules: dict = {}
    with reading(path), safe_open(path, "pt") as f:
        for key in f.keys():
            name = key.removeprefix("base_model.model.").split(".bottleneck_")[0]
            shape = f.get_slice(key).get_shape()
            modules.setdefault(name, 0)
            modules[name] += int(shape[0]) * (int(shape[1]) if len(shape) > 1 else 1)
    info = {"peft_type": "BOTTLENECK", "base_model": raw.get("base_model_name_or_path"), "bottleneck_size": raw.get("bottleneck_size"),
            "bias": raw.get("use_bias"), "parameters": sum(modules.values()), "modules": modules, "file_bytes": os.path.getsize(path)}  # fmt: skip
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"method: bottleneck adapters (PEFT type BOTTLENECK), bottleneck size {info['bottleneck_size']}, biases {info['bias']}")
    print(f"base model: {info['base_model']}")
    print(f"parameters: {info['parameters']:,} in {len(modules)} modules; file {info['file_bytes']:,} bytes")
    print(f"\n{'module':<56}{'parameters':>12}")
    for name, n in modules.items():
        print(f"{name:<56}{n:>12,}")
    return 0


def cmd_inspect(args) -> int:
    from .core.compose import adapter_file_summary
    from .core.config import read_adapter_config

    peft_type = read_adapter_config(args.adapter_dir).get("peft_type")
    if peft_type == "MADG":
        return _inspect_madg(args)
    if args.feature_plot:
        raise ValueError(f"--feature-plot needs a MAD-G generator; {args.adapter_dir} holds {peft_type}")
    if peft_type == "BOTTLENECK":
        return _inspect_bottleneck(args)
    summary = adapter_file_summary(args.adapter_dir)
    tensors = summary.pop("tensors")
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        n = summary["num_tunable_weights"]
        total = sum(m["shape"][0] * m["shape"][1] for m in summary["modules"].values() if m["shape"])
        print(f"method: {summary['peft_type']}")
        print(f"base model: {summary['base_model']}")
        print(f"tunable weights: {n:,} in {len(summary['modules'])} modules = {n / total:.4%} of the targeted modules' {total:,} weights (the density)")
        size = summary["file_bytes"]
        print(f"file: adapter_model.safetensors, {size:,} bytes ({size / max(1, n):.2f} bytes per tunable weight)")
        print(f"\n{'module':<56}{'count':>10}{'density':>10}")
        for name, m in summary["modules"].items():
            density = f"{m['density']:.4%}" if m["density"] is not None else "?"
            print(f"{name:<56}{m['count']:>10,}{density:>10}")
    if summary["peft_type"] == "S4":
        from .methods.s4 import file_overlaps, overlap_table

        languages, overlaps = file_overlaps(args.adapter_dir)
        print("\nJaccard overlap of the language masks")
        print(overlap_table(languages, overlaps))
        if args.overlap_heatmap:
            from .plots import overlap_heatmap

            print(f"\noverlap heatmap written to {overlap_heatmap(languages, overlaps, args.overlap_heatmap)}")
    elif args.overlap_heatmap:
        raise ValueError(f"--overlap-heatmap needs an S4 adapter; {args.adapter_dir} holds {summary['peft_type']}")
    if args.age_histogram:
        from .plots import age_histogram

        ages = {k: t for k, t in tensors.items() if k.endswith(".sparse_ages")}
        if not ages:  # a Trainer checkpoint folder: the ages are in the SpIEL scheduler's state beside the adapter
            from .methods.spiel.state import saved_ages

            ages = {f"{module}.sparse_ages": t for module, t in saved_ages(args.adapter_dir).items()}
        path = age_histogram(ages, args.age_histogram)
        print(f"\nage histogram written to {path}")
    return 0


def cmd_evaluate(args) -> int:
    from .assets import load_model_and_tokenizer
    from .evaluation import suite

    if args.task == "humaneval":  # (before the model is loaded)
        suite.check_code_execution_allowed(args.allow_code_execution)
    model, tokenizer = load_model_and_tokenizer(args.base, gguf_file=args.gguf_file, dtype=args.dtype)
    if args.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter)
    runner = suite.HFModel(model, tokenizer, batch_size=args.batch_size, chat=args.chat)
    rows = suite.load_task(args.task, args.data)
    shots = suite.load_task(args.task, args.shots_data, split=suite.SHOT_SPLITS.get(args.task)) if args.task in suite.SHOT_SPLITS else None
    rows = rows[: args.limit] if args.limit else rows
    result = suite.run_task(args.task, runner, rows, shots, allow_code_execution=args.allow_code_execution)
    print(json.dumps({"task": args.task, "base": args.base, "adapter": args.adapter, **result}, indent=2))
    return 0


COMMANDS = {"train": cmd_train, "merge": cmd_merge, "evaluate": cmd_evaluate, "inspect": cmd_inspect}


def run(args) -> int:
    """Run the parsed command; a bad input or a missing optional extra is one line on stderr, not a traceback."""
    import peft_sparse  # noqa: F401  (registers the sparse PEFT types)

    try:
        return COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"peft-sparse {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # a missing optional extra: one line naming it
        print(f"peft-sparse {args.command}: error: {exc}", file=sys.stderr)
        return 3


def main(argv=None) -> int:
    from peft_sparse_cli import main as entry

    return entry(argv)


if __name__ == "__main__":
    sys.exit(main())
