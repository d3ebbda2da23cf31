"""SpIEL through transformers.Trainer + SpIELCallback under an accelerate engine (DDP, FSDP2, ZeRO-2/3): every rank
ends with the same indices and values. ``--sft``: TRL's SFTTrainer(peft_config=SpIELConfig(...)) instead, the model
wrapped by the trainer itself. Produces BENCHMARKS.md, "Two and four GPUs": the line "Trainer, SFTTrainer and
peft-sparse train through accelerate launch: ranks identical" (run by benchmarks/multi_gpu.sh; compare_ranks.py reads
the result).

    accelerate launch --config_file integrations/accelerate_fsdp2.yaml benchmarks/trainer_engines.py --out /tmp/e/fsdp2
    accelerate launch --config_file integrations/accelerate_ddp.yaml benchmarks/trainer_engines.py --out /tmp/e/ddp
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from peft_sparse import SparseLayer, SpIELCallback, SpIELConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sft", action="store_true", help="TRL's SFTTrainer with peft_config= (it wraps the model)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=False)  # fmt: skip
    peft_config = SpIELConfig(target_modules="all-linear", density=0.02, growth="ag", reselection_steps=10, gradient_estimation_steps=3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1024, (512, 64), generator=g)
    common = dict(per_device_train_batch_size=4, max_steps=30, learning_rate=1e-3, report_to=[], save_strategy="no",
                  logging_steps=10, bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available())  # fmt: skip
    if args.sft:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        from tests.models import tiny_tokenizer

        def collate(rows):
            x = torch.tensor([r["input_ids"] for r in rows])
            return {"input_ids": x, "labels": x.clone(), "attention_mask": torch.ones_like(x)}

        targs = SFTConfig(str(out / "run"), dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False, **common)
        trainer = SFTTrainer(model=LlamaForCausalLM(config), args=targs, train_dataset=Dataset.from_dict({"input_ids": ids.tolist()}),
                             peft_config=peft_config, callbacks=[SpIELCallback()], data_collator=collate,
                             processing_class=tiny_tokenizer())  # fmt: skip
        model = trainer.model
    else:
        model = get_peft_model(LlamaForCausalLM(config), peft_config)
        rows = [{"input_ids": x, "labels": x} for x in ids]
        trainer = Trainer(model=model, args=TrainingArguments(str(out / "run"), **common), train_dataset=rows, callbacks=[SpIELCallback()])
    result = trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    layers = [m for m in model.modules() if isinstance(m, SparseLayer)]
    torch.save({"indices": [l.sparse_indices["default"].cpu() for l in layers],
                "values": [l.sparse_values["default"].detach().float().cpu() for l in layers]}, out / f"rank{rank}.pt")  # fmt: skip
    trainer.accelerator.wait_for_everyone()
    if rank == 0:
        logs = [h for h in trainer.state.log_history if "loss" in h]
        from peft_sparse.distributed import is_fsdp2

        (out / "run.json").write_text(json.dumps({"world": int(os.environ.get("WORLD_SIZE", "1")), "fsdp2": is_fsdp2(model),
                                                  "train_loss": result.training_loss,
                                                  "losses": [h["loss"] for h in logs],
                                                  "reselections": [h for h in trainer.state.log_history if "spiel/replaced" in h]}))  # fmt: skip


if __name__ == "__main__":
    main()
