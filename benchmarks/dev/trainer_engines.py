"""SpIEL through transformers.Trainer + SpIELCallback under an accelerate engine (DDP or FSDP2): every rank ends
with the same indices and values, and rank 0 saves a loadable adapter.

    accelerate launch --config_file integrations/accelerate_fsdp2.yaml benchmarks/dev/trainer_engines.py --out /tmp/e/fsdp2
    accelerate launch --config_file integrations/accelerate_ddp.yaml benchmarks/dev/trainer_engines.py --out /tmp/e/ddp
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from peft_sparse import SparseLayer, SpIELCallback, SpIELConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=False)  # fmt: skip
    model = get_peft_model(LlamaForCausalLM(config), SpIELConfig(target_modules="all-linear", density=0.02, growth="ag",
                                                                 reselection_steps=10, gradient_estimation_steps=3))  # fmt: skip
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": x, "labels": x} for x in torch.randint(0, 1024, (512, 64), generator=g)]
    targs = TrainingArguments(str(out / "run"), per_device_train_batch_size=4, max_steps=30, learning_rate=1e-3, report_to=[],
                              save_strategy="no", logging_steps=10, bf16=True)  # fmt: skip
    trainer = Trainer(model=model, args=targs, train_dataset=rows, callbacks=[SpIELCallback()])
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
