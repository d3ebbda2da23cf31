"""Instruction data: formats, assistant-only labels, reported lengths, clear errors."""

import json

import pytest

from peft_sparse.data.instructions import TULU_TEMPLATE, as_messages, load_instruction_data, tokenize_chat, tokenize_chats

from .models import tiny_tokenizer


def _tok(template=True):
    tok = tiny_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ 't3 ' if m['role'] == 'user' else 't4 ' }}{{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}t4 {% endif %}"
    ) if template else None  # fmt: skip
    return tok


def test_labels_cover_the_assistant_turns_only():
    tok = _tok()
    chat = [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t7"},
            {"role": "user", "content": "t5"}, {"role": "assistant", "content": "t8 t9"}]  # fmt: skip
    ids, labels = tokenize_chat(tok, chat)
    words = tok.convert_ids_to_tokens(ids)
    assert words == ["t3", "t5", "t6", "t4", "t7", "t3", "t5", "t4", "t8", "t9"]
    trained = [w for w, label in zip(words, labels) if label != -100]
    assert trained == ["t7", "t8", "t9"]


def test_tulu_format_without_a_chat_template():
    from transformers import PreTrainedTokenizerFast

    tok = _tok(template=False)
    assert not tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tokenize=False,
                                   chat_template=TULU_TEMPLATE)  # fmt: skip
    assert text == "<|user|>\nhi\n<|assistant|>\nyo" + tok.eos_token + "\n"
    assert isinstance(tok, PreTrainedTokenizerFast)


def test_prompt_completion_rows_become_chats_and_long_examples_are_counted():
    tok = _tok()
    rows = [{"prompt": "t5", "completion": "t7"}, {"prompt": "t5 " * 20, "completion": "t7"}, {"prompt": "t5", "completion": "t7 " * 20}]
    assert as_messages(rows[0]) == [{"role": "user", "content": "t5"}, {"role": "assistant", "content": "t7"}]
    examples, report = tokenize_chats(tok, rows, max_length=8)
    assert report == {"kept": 1, "too_long": 1, "prompt_too_long": 1}
    assert len(examples) == 1


def test_local_files_and_bad_rows(tmp_path, monkeypatch):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]))
    assert len(load_instruction_data(path)) == 1
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "completion": "b"}]), tmp_path / "d.parquet")
    assert load_instruction_data(tmp_path / "d.parquet")[0]["completion"] == "b"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"instruction": "a", "output": "b"}))
    with pytest.raises(ValueError, match=r"bad.jsonl\[0\]: expected field 'messages'.*got fields \['instruction', 'output'\]"):
        load_instruction_data(bad)
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}]}))
    with pytest.raises(ValueError, match="has no assistant turn"):
        load_instruction_data(bad)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="hub is switched off"):
        load_instruction_data("allenai/tulu-v2-sft-mixture")


def test_a_recipe_trains_on_chats_with_assistant_only_loss(tmp_path, capsys):
    from peft_sparse.recipe import load_recipe, run_recipe

    from .models import tiny_llama

    model_dir = tmp_path / "model"
    tiny_llama().save_pretrained(model_dir)
    _tok().save_pretrained(model_dir)
    chats = [{"messages": [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": f"t{7 + i % 3}"}]} for i in range(16)]
    chats.append({"messages": [{"role": "user", "content": "t5 " * 40}, {"role": "assistant", "content": "t7"}]})
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps(c) for c in chats))
    recipe = load_recipe({
        "model": {"source": str(model_dir)},
        "method": {"peft_type": "SFT", "target_modules": "all-linear", "density": 0.1},
        "data": {"train": str(data)},
        "training": {"output_dir": str(tmp_path / "out"), "max_steps": 2, "per_device_train_batch_size": 4, "max_length": 16,
                     "use_cpu": True, "bf16": False, "report_to": "none", "save_strategy": "no", "gradient_checkpointing": False, "logging_steps": 1},
    })  # fmt: skip
    summary = run_recipe(recipe)
    out = capsys.readouterr().out
    assert "training chats: 16 kept, 0 longer than max_length and 1 whose prompt alone is, left out" in out
    assert summary["train_loss_first"] is not None and (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()


def test_trl_keeps_the_assistant_only_labels(tmp_path):
    from datasets import Dataset
    from peft import get_peft_model
    from trl import SFTConfig, SFTTrainer

    from peft_sparse import SparseFTConfig

    from .models import tiny_llama

    tok = _tok()
    ids, labels = tokenize_chat(tok, [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t7"}])
    data = Dataset.from_list([{"input_ids": ids, "labels": labels}] * 4)
    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, use_cpu=True, bf16=False, report_to="none", save_strategy="no")
    trainer = SFTTrainer(model=get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.1)), args=args,
                         train_dataset=data, processing_class=tok)  # fmt: skip
    batch = trainer.data_collator([trainer.train_dataset[0]])
    assert batch["labels"][0].tolist() == labels == [-100, -100, -100, -100, tok.convert_tokens_to_ids("t7")]  # t3 t5 t6 t4 | t7


def test_composition_recipe_scores_each_adapter_and_their_sum(tmp_path, capsys):
    """recipes/instruction/compose.py with trained adapters given: base, A, B and A ⊕ B scored on each eval set;
    A ⊕ B is θ + φ_a + φ_b (equal to merging both)."""
    import importlib.util
    import json

    from peft import PeftModel, get_peft_model

    from peft_sparse import SparseFTConfig

    from .models import randomize_values, tiny_llama, tiny_tokenizer
    from .test_readme_and_recipes import ROOT

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tiny_llama().save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    for seed, name in ((1, "a"), (2, "b")):
        model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.1, seed=seed))
        randomize_values(model, seed=seed, scale=0.5)
        model.save_pretrained(tmp_path / name)
        (tmp_path / f"{name}.yaml").write_text(
            f"model: {{source: {tmp_path / 'base'}}}\nmethod: {{peft_type: SFT, density: 0.1, target_modules: all-linear}}\n"
            f"data: {{train: {ROOT / 'recipes/data/skills_train.jsonl'}}}\ntraining: {{output_dir: {tmp_path / name}, use_cpu: true, bf16: false}}\n"
        )
    # reference answers: what θ + φ_a + φ_b (both merged, one after the other) says greedily
    from peft_sparse.evaluation import generate_answers, normalize

    merged = PeftModel.from_pretrained(tiny_llama(), tmp_path / "a").merge_and_unload()
    merged = PeftModel.from_pretrained(merged, tmp_path / "b").merge_and_unload()
    prompts = [[{"role": "user", "content": f"t{i} t{i + 1}"}] for i in range(5, 25)]
    replies = generate_answers(merged, tokenizer, prompts, 8, 16)
    rows = [{"prompt": p, "answer": normalize(r)} for p, r in zip(prompts, replies)]
    (tmp_path / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    spec = importlib.util.spec_from_file_location("compose_recipe", ROOT / "recipes/instruction/compose.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    results = recipe.main([str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml"), "--adapters", str(tmp_path / "a"), str(tmp_path / "b"),
                           "--eval", f"toy={tmp_path / 'eval.jsonl'}", "--output", str(tmp_path / "out")])  # fmt: skip
    assert list(results) == ["base model", "A (a)", "B (b)", "A ⊕ B"] and all("toy" in r for r in results.values())
    assert "| A ⊕ B |" in capsys.readouterr().out
    saved = json.loads((tmp_path / "out/results.json").read_text())
    assert saved["scores"] == results
    assert results["A ⊕ B"]["toy"] == 1.0  # the composed model answers as the merged one
    assert results["base model"]["toy"] < 1.0 and results["A (a)"]["toy"] < 1.0
    with pytest.raises(SystemExit, match="two recipes"):
        recipe.main([str(tmp_path / "a.yaml"), "--eval", f"toy={tmp_path / 'eval.jsonl'}"])
    with pytest.raises(SystemExit, match="nothing to score"):
        recipe.main([str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml"), "--adapters", "x", "y"])


def test_a_recipe_evaluates_before_training_on_the_model_as_the_trainer_placed_it(tmp_path, monkeypatch):
    """The evaluation before training scores the Trainer's model (placed on the training device by the Trainer:
    a GPU run evaluates on the GPU, not on the CPU the model was loaded to), whose delta is still zero."""
    from peft import PeftModel

    from peft_sparse import recipe as recipe_module

    from .models import tiny_llama

    model = tiny_llama()
    monkeypatch.setattr("peft_sparse.assets.load_model_and_tokenizer", lambda **k: (model, _tok()))

    class Reached(Exception):
        pass

    def evaluated(m, *a, **k):
        raise Reached(m)

    monkeypatch.setattr("peft_sparse.evaluation.exact_match", evaluated)
    rows = [{"prompt": [{"role": "user", "content": "t5"}], "completion": [{"role": "assistant", "content": "t7"}], "answer": "t7"}]
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    recipe = recipe_module.load_recipe({
        "model": {"source": "unused"},
        "method": {"peft_type": "SFT", "target_modules": "all-linear", "density": 0.1},
        "data": {"train": str(data), "eval": str(data)},
        "training": {"output_dir": str(tmp_path / "out"), "max_steps": 1, "use_cpu": True, "bf16": False, "report_to": "none"},
    })  # fmt: skip
    with pytest.raises(Reached) as reached:
        recipe_module.run_recipe(recipe)
    scored = reached.value.args[0]
    assert isinstance(scored, PeftModel) and scored.get_base_model() is model
    assert all(float(v.abs().max()) == 0 for n, v in scored.named_parameters() if "sparse_values" in n)


@pytest.mark.parametrize("optim, optim_args", [(None, None), ("sm3", None), ("sm3", "momentum=0.5, beta2=0.99"), ("adamw_torch", None)])
def test_a_spiel_ma_recipe_trains_with_adamw_unless_it_names_sm3(tmp_path, optim, optim_args):
    """SpIEL-MA's recipe default is the Trainer's optimizer (AdamW; or the one `training.optim` names), beside which
    the scheduler keeps MA's row and column accumulators itself and reselects by them. `training.optim: sm3` trains
    with peft_sparse.SM3 instead (the thesis's pairing), over this 6-step run in its sums form without momentum
    (ma_sm3_defaults: runs up to 100 steps); `training.optim_args` sets SM3's momentum and β₂ (here the moving
    average). The summary records the SM3 form that ran, None without SM3."""
    import torch

    from peft_sparse import SM3
    from peft_sparse.callbacks import SpIELCallback
    from peft_sparse.recipe import load_recipe, run_recipe

    from .models import tiny_llama

    model_dir = tmp_path / "model"
    tiny_llama().save_pretrained(model_dir)
    _tok().save_pretrained(model_dir)
    chats = [{"messages": [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": f"t{7 + i % 3}"}]} for i in range(16)]
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps(c) for c in chats))
    training = {"output_dir": str(tmp_path / "out"), "max_steps": 6, "per_device_train_batch_size": 4, "max_length": 16,
                "use_cpu": True, "bf16": False, "report_to": "none", "save_strategy": "no", "gradient_checkpointing": False}  # fmt: skip
    if optim:
        training["optim"] = optim
    if optim_args:
        training["optim_args"] = optim_args
    training["weight_decay"] = "auto"  # (6 steps: λ = 3, which reaches SM3 and the summary)
    recipe = load_recipe({
        "model": {"source": str(model_dir)},
        "method": {"peft_type": "SPIEL", "growth": "ma", "target_modules": "all-linear", "density": 0.1,
                   "reselection_steps": 3, "gradient_estimation_steps": 1},
        "data": {"train": str(data)},
        "training": training,
    })  # fmt: skip
    seen = {}
    original = SpIELCallback.on_train_begin

    def spy(self, args, state, control, **kwargs):
        out = original(self, args, state, control, **kwargs)
        seen["scheduler"] = self.scheduler
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SpIELCallback, "on_train_begin", spy)
        summary = run_recipe(recipe)
    assert recipe.training_args.weight_decay == 3.0 and summary["weight_decay"] == 3.0
    scheduler = seen["scheduler"]
    inner = getattr(scheduler.optimizer, "optimizer", scheduler.optimizer)
    assert isinstance(inner, SM3) == (optim == "sm3")
    if optim != "sm3":
        assert isinstance(inner, torch.optim.AdamW) and inner.param_groups[0]["weight_decay"] == 3.0
    if optim == "sm3":
        group = scheduler.optimizer.param_groups[0]
        assert (group["momentum"], group["beta2"], group["weight_decay"]) == ((0.5, 0.99, 3.0) if optim_args else (0.0, None, 3.0))
        assert summary["sm3"] == {"momentum": group["momentum"], "beta2": group["beta2"]}
        assert all(s["row_accumulator"].max() > 0 for s in scheduler.optimizer.state.values())
    else:
        assert summary["sm3"] is None
    assert (scheduler.ma_accumulators is not None) == (optim != "sm3")
    assert scheduler.t == 6
    if optim != "sm3":
        assert any(bool((r > 0).any()) for r, _ in scheduler.ma_accumulators.views.values())


@pytest.mark.parametrize("max_steps, expected", [(1, (0.0, None)), (100, (0.0, None)), (101, (0.9, 0.999)), (600, (0.9, 0.999)), (-1, (0.9, 0.999))])
def test_spiel_ma_recipe_sm3_form_follows_the_run_length(tmp_path, max_steps, expected):
    """The recipe runner's SM3 for SpIEL-MA: the sums without momentum up to MA_SUMS_MAX_STEPS = 100 steps, the moving
    average (β₂ 0.999) with momentum 0.9 beyond and when the length is not given in steps (max_steps -1: epochs);
    optim_args overrides either, one field at a time."""
    from peft_sparse.recipe import MA_SUMS_MAX_STEPS, _optimizer, load_recipe, ma_sm3_kwargs

    assert MA_SUMS_MAX_STEPS == 100
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}))
    raw = {"model": {"source": "unused"}, "method": {"peft_type": "SPIEL", "growth": "ma", "target_modules": "all-linear", "density": 0.1},
           "data": {"train": str(data)},
           "training": {"output_dir": str(tmp_path), "max_steps": max_steps, "use_cpu": True, "bf16": False, "learning_rate": 3e-3,
                        "optim": "sm3"}}  # fmt: skip
    _, kwargs = _optimizer(load_recipe(raw))
    assert (kwargs["momentum"], kwargs["beta2"], kwargs["lr"]) == (*expected, 3e-3)
    assert ma_sm3_kwargs("beta2=0.99", max_steps) == {"momentum": expected[0], "beta2": 0.99}


def test_recipe_sm3_is_refused_by_name_for_a_method_other_than_spiel_ma(tmp_path):
    """`training.optim: sm3` names SpIEL-MA's optimizer; on another method the error names the field, the value and
    the recipe's method instead of passing an unknown optimizer name to the Trainer. Without it, a SpIEL-MA recipe
    leaves the optimizer to the Trainer (no SM3 built)."""
    from peft_sparse.recipe import _optimizer, load_recipe

    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}))

    def raw(method, **training):
        return {"model": {"source": "unused"}, "method": method, "data": {"train": str(data)},
                "training": {"output_dir": str(tmp_path), "max_steps": 10, "use_cpu": True, "bf16": False, **training}}  # fmt: skip

    ag = {"peft_type": "SPIEL", "growth": "ag", "target_modules": "all-linear", "density": 0.1}
    with pytest.raises(ValueError, match=r"training.optim='sm3' is SpIEL-MA's optimizer .*SpIELConfig with growth='ag'"):
        load_recipe(raw(ag, optim="sm3"))
    with pytest.raises(ValueError, match=r"training.optim='sm3' .*this recipe's method is FULL"):
        load_recipe(raw({"peft_type": "FULL"}, optim="sm3"))
    ma = load_recipe(raw({**ag, "growth": "ma"}))
    assert not ma.sm3 and _optimizer(ma) is None and ma.training_args.optim.value.startswith("adamw")


def test_a_subset_that_matches_nothing_names_the_subsets_there_are(tmp_path):
    """Rows without a `dataset` field are counted, not listed as a subset called 'None'."""
    from peft_sparse.recipe import read_rows

    def write(name, rows):
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    mixed = write("mixed.jsonl", [{"dataset": "flan_v2", "messages": chat}, {"dataset": "oasst1", "messages": chat}, {"messages": chat}])
    assert [r["dataset"] for r in read_rows(mixed, subset="oasst1")] == ["oasst1"]
    with pytest.raises(ValueError) as info:
        read_rows(mixed, subset="cot")
    assert str(info.value).endswith("its rows name the subsets ['flan_v2', 'oasst1']; 1 rows have no 'dataset' field")
    plain = write("plain.jsonl", [{"prompt": "p", "answer": "a"}] * 2)
    with pytest.raises(ValueError, match=r"subset='cot' matches no row of .*plain.jsonl: none of its 2 rows has a 'dataset' field") as info:
        read_rows(plain, subset="cot")
    assert "None" not in str(info.value)


def test_the_trainable_count_names_its_denominators(tmp_path, capsys):
    """The recipe prints the trainable share of all parameters and, for a sparse adapter, its density over the
    targeted modules' weights, each named (the same density peft-sparse inspect prints)."""
    from peft import LoraConfig, get_peft_model

    from peft_sparse import LTSFTConfig, SparseFTConfig
    from peft_sparse.recipe import load_recipe, run_recipe, trainable_summary

    from .models import tiny_llama

    sft = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.1))
    trainable, total = sft.get_nb_trainable_parameters()
    targeted = sum(a * b for a, b in sft.peft_config["default"].module_shapes.values())
    line = trainable_summary(sft)
    assert line == (f"trainable parameters: {trainable:,} = {trainable / total:.2%} of all {total:,} parameters (the adapter's own included); "
                    f"sparse delta 'default': {trainable:,} values = {trainable / targeted:.2%} of the {targeted:,} weights of the targeted modules (the density)")  # fmt: skip
    lt = trainable_summary(get_peft_model(tiny_llama(), LTSFTConfig(target_modules="all-linear", density=0.1, dense_steps=2, sparse_steps=2)))
    assert lt.endswith(f"LT-SFT's dense phase trains all {targeted:,} weights of the targeted modules and keeps 1,536 = 10.00% of them (the density)")
    lora = get_peft_model(tiny_llama(), LoraConfig(target_modules=["q_proj"], r=2))
    trainable, total = lora.get_nb_trainable_parameters()
    assert trainable_summary(lora) == f"trainable parameters: {trainable:,} = {trainable / total:.2%} of all {total:,} parameters (the adapter's own included)"
    full = tiny_llama()  # full fine-tuning: a transformers model, whose active_adapters is a method
    n = sum(p.numel() for p in full.parameters())
    assert trainable_summary(full) == f"trainable parameters: {n:,} = 100.00% of all {n:,} parameters (the adapter's own included)"
    # the recipe prints it (not PEFT's unlabelled trainable%)
    model_dir = tmp_path / "model"
    tiny_llama().save_pretrained(model_dir)
    _tok().save_pretrained(model_dir)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": "t5 t6", "completion": f" t{7 + i % 3}"}) + "\n" for i in range(8)))
    recipe = load_recipe({
        "model": {"source": str(model_dir)},
        "method": {"peft_type": "SFT", "target_modules": "all-linear", "density": 0.1},
        "data": {"train": str(data)},
        "training": {"output_dir": str(tmp_path / "out"), "max_steps": 1, "per_device_train_batch_size": 4, "max_length": 16,
                     "use_cpu": True, "bf16": False, "report_to": "none", "save_strategy": "no", "gradient_checkpointing": False},
    })  # fmt: skip
    run_recipe(recipe)
    out = capsys.readouterr().out
    assert "trainable%" not in out and f"of the {targeted:,} weights of the targeted modules (the density)" in out
