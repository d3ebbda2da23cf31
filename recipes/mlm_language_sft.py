"""A language SFT for an encoder, trained with masked language modelling (thesis §4.4.2, Algorithm 1 step 1).

LT-SFT over every linear layer and the input word embeddings of a BERT-type masked LM, through
``transformers.Trainer`` with ``DataCollatorForLanguageModeling`` (15% of tokens masked) and
``LTSFTCallback``: ``--dense-steps`` of dense training, the K weights that moved most kept, rewind,
``--sparse-steps`` of sparse training. The adapter is saved as an ordinary sparse adapter, ready to
compose under a task SFT (``peft_sparse.transfer``).

    python recipes/mlm_language_sft.py --model xlm-roberta-base --text sw.txt --output outputs/sft-sw
    python recipes/mlm_language_sft.py --model DIR --hub-dataset NAME --hub-config CONFIG   # needs the hub

``--text`` is a local file: one text per line (``.txt``) or JSON lines with a ``text`` field (``.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def read_texts(path: str) -> list[str]:
    source = Path(path)
    if not source.is_file():
        raise SystemExit(f"--text {path}: no such file")
    if source.suffix == ".jsonl":
        texts = []
        with open(source) as f:
            for i, line in enumerate(f):
                if line.strip():
                    row = json.loads(line)
                    if not isinstance(row.get("text"), str):
                        raise SystemExit(f"--text {path}: line {i + 1} has no string field 'text'")
                    texts.append(row["text"])
    else:
        texts = [line.rstrip("\n") for line in open(source) if line.strip()]
    if not texts:
        raise SystemExit(f"--text {path}: no text in it")
    return texts


def hub_texts(name: str, config: str | None, column: str, limit: int | None) -> list[str]:
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise SystemExit(f"--hub-dataset {name}: the hub is switched off here (HF_HUB_OFFLINE); pass --text with a local file")
    from datasets import load_dataset

    try:
        data = load_dataset(name, config, split="train" if limit is None else f"train[:{limit}]")
    except Exception as error:  # noqa: BLE001  (any failure to reach the hub ends here, named)
        raise SystemExit(f"--hub-dataset {name}: cannot load it from the hub ({type(error).__name__}: {error})") from None
    if column not in data.column_names:
        raise SystemExit(f"--hub-dataset {name}: no column {column!r} (columns: {data.column_names}); pass --text-column")
    return list(data[column])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a masked-LM encoder: local directory or hub name")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="local .txt (one text per line) or .jsonl (a 'text' field)")
    source.add_argument("--hub-dataset", help="a dataset by hub name (needs the hub)")
    parser.add_argument("--hub-config", default=None)
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--limit", type=int, default=None, help="use only this many texts")
    parser.add_argument("--density", type=float, default=0.05, help="K as a fraction of the adapted weights")
    parser.add_argument("--dense-steps", type=int, default=1000)
    parser.add_argument("--sparse-steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=5e-5, help="dense-phase learning rate")
    parser.add_argument("--sparse-lr", type=float, default=None, help="sparse-phase learning rate (default: --lr)")
    parser.add_argument("--l1-reg", type=float, default=0.1, help="λ of the L1 pull towards the pre-trained weights (thesis: 0.1)")
    parser.add_argument("--no-embeddings", dest="embeddings", action="store_false", help="leave the word embeddings out")
    parser.add_argument("--mlm-probability", type=float, default=0.15)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="outputs/mlm-language-sft")
    args = parser.parse_args(argv)

    import torch
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import AutoModelForMaskedLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from peft_sparse import LTSFTCallback, LTSFTConfig

    texts = read_texts(args.text) if args.text else hub_texts(args.hub_dataset, args.hub_config, args.text_column, args.limit)
    texts = texts[: args.limit] if args.limit else texts
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.mask_token is None:
        raise SystemExit(f"--model {args.model}: its tokenizer has no mask token, so it cannot be trained with MLM")
    model = AutoModelForMaskedLM.from_pretrained(args.model)
    targets = sorted({name.split(".")[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                      and m is not model.get_output_embeddings()})  # fmt: skip
    if args.embeddings:
        targets.append(next(name for name, m in model.named_modules() if m is model.get_input_embeddings()))
    config = LTSFTConfig(
        target_modules=targets, density=args.density, selection="global", l1_reg=args.l1_reg, dense_steps=args.dense_steps,
        sparse_steps=args.sparse_steps, dense_learning_rate=args.lr, sparse_learning_rate=args.sparse_lr or args.lr,
    )  # fmt: skip
    model = get_peft_model(model, config)
    model.print_trainable_parameters()
    encoded = tokenizer(texts, truncation=True, max_length=args.max_length)
    data = Dataset.from_dict({"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]})
    training = TrainingArguments(
        output_dir=args.output, max_steps=args.dense_steps + args.sparse_steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, lr_scheduler_type="constant", logging_steps=max(1, (args.dense_steps + args.sparse_steps) // 20),
        save_strategy="no", report_to="none", seed=args.seed, use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
    )  # fmt: skip
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=args.mlm_probability, seed=args.seed)
    trainer = Trainer(model=model, args=training, train_dataset=data, data_collator=collator, callbacks=[LTSFTCallback()])
    result = trainer.train()
    adapter_dir = Path(args.output) / "adapter"
    trainer.save_model(str(adapter_dir))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    summary = {
        "adapter_dir": str(adapter_dir), "texts": len(texts), "kept": model.peft_config["default"].num_tunable_weights,
        "train_loss_first": losses[0] if losses else None, "train_loss_last": losses[-1] if losses else None,
        "train_runtime_s": result.metrics.get("train_runtime"),
    }  # fmt: skip
    (Path(args.output) / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"language SFT ({summary['kept']} weights) saved to {adapter_dir}")
    return summary


if __name__ == "__main__":
    main()
