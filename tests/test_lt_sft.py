"""LT-SFT: the dense phase as a full-size delta, lottery selection (per tensor and global, streaming),
rewind, the L1 pull, heads, the optimizer switch, Trainer/TRL, save/load and composition."""

import pytest
import torch
from datasets import Dataset
from peft import PeftModel, get_peft_model

from peft_sparse import LTSFTCallback, LTSFTConfig, LTSFTScheduler, SparseFTConfig, load_sparse_adapter
from peft_sparse.core.selection import global_top_k

from .models import MODELS, inputs, sparse_layers, tiny_bert, tiny_llama, tiny_tokenizer


def _config(**kwargs):
    base = dict(target_modules="all-linear", density=0.1, dense_steps=3, sparse_steps=3)
    base.update(kwargs)
    return LTSFTConfig(**base)


def _run_dense(model, lt, steps, lr=1e-2, seed=0):
    optimizer = lt.optimizer or lt.attach(torch.optim.AdamW(lt.trainable_parameters(), lr=lr))
    switched = False
    for t in range(steps):
        x = inputs(seed=seed + t)
        model(x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        switched = lt.step()
    return optimizer, switched


def _moved(model):
    return {l.module_name: l.logical_delta("default").reshape(-1).abs().clone() for l in sparse_layers(model)}


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_per_tensor_selection_keeps_each_tensors_top_share_of_the_moved_weights(kind):
    build, targets, _ = MODELS[kind]
    model = get_peft_model(build(), _config(target_modules=targets, dense_steps=2))
    lt = LTSFTScheduler(model)
    _run_dense(model, lt, 1)
    moved = _moved(model)  # |θ₁ − θ₀| = |φ| in logical (out, in) order (Conv1D included)
    shares = dict(model.peft_config["default"].tunable_weights_per_module)
    sizes = {k: v.numel() for k, v in moved.items()}
    budget = round(0.1 * sum(sizes.values()))
    from peft_sparse.core.budget import split_budget

    expected_counts = split_budget(sizes, budget)
    assert shares == sizes  # the dense phase adapts whole tensors
    # the second step ends the dense phase: compare with the moved weights after it
    x = inputs(seed=9)
    model(x, labels=x).loss.backward()
    lt.optimizer.step()
    moved = _moved(model)
    assert lt.step() is True
    for layer in sparse_layers(model):
        scores = moved[layer.module_name]
        k = expected_counts[layer.module_name]
        order = torch.sort(scores, descending=True, stable=True).indices[:k]
        assert torch.equal(layer.sparse_indices["default"].long(), order.sort().values)
        assert bool((layer.sparse_values["default"] == 0).all())


def test_global_selection_equals_the_top_k_of_the_concatenation():
    model = get_peft_model(tiny_llama(), _config(selection="global", dense_steps=1))
    lt = LTSFTScheduler(model)
    optimizer = lt.attach(torch.optim.AdamW(lt.trainable_parameters(), lr=1e-2))
    x = inputs()
    model(x, labels=x).loss.backward()
    optimizer.step()
    moved = _moved(model)
    names = [l.module_name for l in sparse_layers(model)]
    flat = torch.cat([moved[n] for n in names])
    K = round(0.1 * flat.numel())
    chosen = torch.sort(flat, descending=True, stable=True).indices[:K]
    assert lt.step()
    offset = 0
    counts = model.peft_config["default"].tunable_weights_per_module
    for layer, n in zip(sparse_layers(model), names):
        size = moved[n].numel()
        mine = chosen[(chosen >= offset) & (chosen < offset + size)] - offset
        assert torch.equal(layer.sparse_indices["default"].long(), mine.sort().values)
        assert counts[n] == mine.numel()
        offset += size
    assert sum(counts.values()) == K == model.peft_config["default"].num_tunable_weights
    assert len(set(counts.values())) > 1  # global: the shares differ per tensor


def test_global_top_k_breaks_ties_by_name_order_then_position_and_checks_its_input():
    scores = {"a": torch.tensor([1.0, 3.0, 2.0, 3.0]), "b": torch.tensor([3.0, 0.0, 5.0])}
    calls = []
    fns = {n: (lambda s=s, n=n: calls.append(n) or s) for n, s in scores.items()}
    got = global_top_k(fns, 3)  # 5, then two of the three 3s: a[1], a[3] (a before b)
    assert torch.equal(got["a"], torch.tensor([1, 3])) and torch.equal(got["b"], torch.tensor([2]))
    assert global_top_k(fns, 7)["b"].tolist() == [0, 1, 2]
    assert sum(v.numel() for v in global_top_k(fns, 0).values()) == 0
    with pytest.raises(ValueError, match="k=8"):
        global_top_k(fns, 8)
    with pytest.raises(ValueError, match="b: scores"):
        global_top_k({"b": lambda: torch.tensor([float("nan")])}, 1)
    # tiny scores, denormals and exact zeros sort by value too
    tiny = {"t": lambda: torch.tensor([0.0, 1e-40, 1e-30, 0.0])}
    assert global_top_k(tiny, 2)["t"].tolist() == [1, 2]


@pytest.mark.parametrize("selection", ["per_tensor", "global"])
def test_rewind_restores_the_base_exactly_and_base_weights_never_change(selection):
    base = tiny_llama()
    reference = tiny_llama()
    model = get_peft_model(base, _config(selection=selection, dense_steps=2))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "sparse_" not in n}
    lt = LTSFTScheduler(model)
    _, switched = _run_dense(model, lt, 2)
    assert switched and lt.phase == "sparse"
    x = inputs(seed=5)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, reference(x).logits, rtol=0, atol=0)
    _run_dense(model, lt, 2, seed=10)  # the sparse phase trains only the kept values
    for n, p in model.named_parameters():
        if "sparse_" not in n:
            assert torch.equal(p, before[n]), n


def test_the_sparse_phase_trains_only_the_selected_values_with_a_fresh_optimizer_state():
    model = get_peft_model(tiny_llama(), _config(dense_steps=2, sparse_learning_rate=5e-3, dense_learning_rate=1e-2))
    lt = LTSFTScheduler(model)
    optimizer = lt.attach(torch.optim.AdamW(lt.trainable_parameters(), lr=1.0))
    assert {g["lr"] for g in optimizer.param_groups} == {1e-2}
    _run_dense(model, lt, 2)
    values = [l.sparse_values["default"] for l in sparse_layers(model)]
    held = [p for g in optimizer.param_groups for p in g["params"]]
    assert {id(v) for v in values} <= {id(p) for p in held}
    assert all(v.numel() < l.numel for v, l in zip(values, sparse_layers(model)))
    assert all(p not in optimizer.state for p in values)
    assert {g["lr"] for g in optimizer.param_groups} == {5e-3}
    _run_dense(model, lt, 1, seed=3)
    assert any(bool((v != 0).any()) for v in values)
    assert all(optimizer.state[v]["step"] == 1 for v in values)


def test_l1_gradient_equals_autograd_of_the_penalty():
    lam = 50.0
    model = get_peft_model(tiny_llama(), _config(l1_reg=lam, dense_steps=4))
    lt = LTSFTScheduler(model)
    optimizer = lt.attach(torch.optim.SGD(lt.trainable_parameters(), lr=1e-2))
    _run_dense(model, lt, 1)  # non-zero values
    x = inputs(seed=7)
    values = [l.sparse_values["default"] for l in sparse_layers(model)]
    loss = model(x, labels=x).loss + lt.l1_penalty()
    expected = torch.autograd.grad(loss, values)
    expected_penalty = float(lt.l1_penalty().detach())
    optimizer.zero_grad()
    model(x, labels=x).loss.backward()
    seen = {}
    hook = optimizer.register_step_pre_hook(lambda *a: seen.update(g=[v.grad.clone() for v in values]))
    optimizer.step()
    hook.remove()
    for got, want in zip(seen["g"], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
    assert lt.last_l1 == pytest.approx(expected_penalty, rel=1e-6)
    n = sum(p.numel() for p in tiny_llama().parameters())
    assert lt.num_parameters == n


def test_heads_restart_from_their_initial_values_in_the_sparse_phase():
    model = get_peft_model(tiny_bert(), _config(target_modules=["query", "value"], modules_to_save=["classifier"], dense_steps=2))
    head = model.base_model.model.classifier.modules_to_save["default"]
    start = {k: v.clone() for k, v in head.state_dict().items()}
    lt = LTSFTScheduler(model)
    optimizer = lt.attach(torch.optim.AdamW(lt.trainable_parameters(), lr=1e-1))
    labels = torch.tensor([0, 2])
    for t in range(2):
        model(inputs(seed=t), labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if t == 0:
            assert not torch.equal(head.weight, start["weight"])
        lt.step()
    for k, v in head.state_dict().items():
        assert torch.equal(v, start[k]), k
    assert all(p not in optimizer.state for p in head.parameters())


def test_unfrozen_layer_norms_train_rewind_and_save_with_the_adapter(tmp_path):
    model = get_peft_model(tiny_llama(), _config(dense_steps=2, freeze_layer_norm=False))
    saved = model.peft_config["default"].modules_to_save
    assert "model.norm" in saved and "model.layers.0.input_layernorm" in saved
    norm = model.base_model.model.model.norm.modules_to_save["default"]
    start = norm.weight.detach().clone()
    lt = LTSFTScheduler(model)
    assert any(p is norm.weight for p in lt.trainable_parameters())
    optimizer = lt.attach(torch.optim.AdamW(lt.trainable_parameters(), lr=1e-1))
    for t in range(4):
        x = inputs(seed=t)
        model(x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if t == 0:
            assert not torch.equal(norm.weight, start)  # trains in the dense phase
        switched = lt.step()
        if t == 1:
            assert switched and torch.equal(norm.weight, start)  # rewound with everything else
    assert not torch.equal(norm.weight, start)  # and trains again in the sparse phase
    x = inputs(seed=11)
    model.eval()
    with torch.no_grad():
        out = model(x).logits
    model.save_pretrained(tmp_path / "lt")
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path / "lt")
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, out, rtol=0, atol=0)
    with pytest.raises(ValueError, match="no normalisation layer"):
        get_peft_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), _config(target_modules=["0"], freeze_layer_norm=False))


def test_saved_adapter_loads_merges_and_composes(tmp_path):
    model = get_peft_model(tiny_llama(), _config(dense_steps=2))
    lt = LTSFTScheduler(model)
    _run_dense(model, lt, 4)
    x = inputs(seed=11)
    model.eval()
    with torch.no_grad():
        out = model(x).logits
    model.save_pretrained(tmp_path / "lt")
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path / "lt")
    assert loaded.peft_config["default"].phase == "sparse"
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, out, rtol=0, atol=0)
        merged = loaded.merge_and_unload()
        torch.testing.assert_close(merged(x).logits, out, rtol=1e-5, atol=1e-6)
    # beside an SFT adapter: composition by addition
    sft = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.05, seed=3))
    from .models import randomize_values

    randomize_values(sft, scale=0.1)
    sft.save_pretrained(tmp_path / "sft")
    both = load_sparse_adapter(tiny_llama(), tmp_path / "lt", adapter_name="lt")
    both = load_sparse_adapter(both, tmp_path / "sft", adapter_name="sft")
    both.add_weighted_adapter(["lt", "sft"], [1.0, 1.0], "sum")
    both.set_adapter("sum")
    reference = PeftModel.from_pretrained(tiny_llama(), tmp_path / "sft").merge_and_unload()
    reference = PeftModel.from_pretrained(reference, tmp_path / "lt").merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(both(x).logits, reference(x).logits, rtol=1e-5, atol=1e-6)


def test_trainer_runs_both_phases_with_the_callback(tmp_path):
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (32, 10), generator=g).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids, "attention_mask": [[1] * 10] * 32})
    model = get_peft_model(tiny_llama(), _config(dense_steps=3, sparse_steps=2, l1_reg=1.0, sparse_learning_rate=2e-2))
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=5, learning_rate=1e-2,
        logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", lr_scheduler_type="constant",
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[LTSFTCallback()])
    trainer.train()
    assert model.peft_config["default"].phase == "sparse"
    history = trainer.state.log_history
    assert [h["step"] for h in history if "lt_sft/selected" in h] == [3]
    assert all("lt_sft/l1" in h for h in history if "loss" in h)
    assert [h["learning_rate"] for h in history if "loss" in h][-1] == pytest.approx(2e-2)
    assert any(bool((l.sparse_values["default"] != 0).any()) for l in sparse_layers(model))
    bad = Trainer(model=get_peft_model(tiny_llama(), _config()), args=args, train_dataset=data, callbacks=[LTSFTCallback()])
    with pytest.raises(ValueError, match="max_steps=5"):
        bad.train()


def test_trl_sft_trainer_with_peft_config(tmp_path):
    from trl import SFTConfig, SFTTrainer

    g = torch.Generator().manual_seed(0)
    data = Dataset.from_dict({"input_ids": torch.randint(0, 97, (32, 10), generator=g).tolist()})
    args = SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-2, logging_steps=1,
        report_to="none", use_cpu=True, bf16=False, save_strategy="no", dataset_kwargs={"skip_prepare_dataset": True},
        remove_unused_columns=False,
    )  # fmt: skip

    def collate(rows):
        ids = torch.tensor([r["input_ids"] for r in rows])
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}

    trainer = SFTTrainer(model=tiny_llama(), args=args, train_dataset=data, peft_config=_config(dense_steps=2, sparse_steps=2),
                         callbacks=[LTSFTCallback()], data_collator=collate, processing_class=tiny_tokenizer())  # fmt: skip
    trainer.train()
    config = trainer.model.peft_config["default"]
    assert config.phase == "sparse" and sum(config.tunable_weights_per_module.values()) == config.num_tunable_weights


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_tunable_weights=10**9), "exceeds"),
        (dict(dense_steps=0), "dense_steps=0"),
        (dict(sparse_steps=0), "sparse_steps=0"),
        (dict(selection="topk"), "selection='topk'"),
        (dict(l1_reg=-1.0), "l1_reg=-1.0"),
        (dict(block_shape=(2, 2)), "block_shape"),
        (dict(freeze_layer_norm="no"), "freeze_layer_norm='no'"),
        (dict(phase="sparse"), "phase='sparse'"),
    ],
)
def test_bad_settings_are_refused_with_the_field_named(kwargs, match):
    if "num_tunable_weights" in kwargs:
        with pytest.raises(ValueError, match=match):
            get_peft_model(tiny_llama(), _config(density=None, **kwargs))
        return
    with pytest.raises(ValueError, match=match):
        _config(**kwargs)


def test_trainer_resumes_in_either_phase_exactly(tmp_path):
    """A run stopped at a dense-phase or a sparse-phase checkpoint and resumed ends with the values, indices
    and layer norms of the uninterrupted run."""
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (48, 10), generator=g).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids, "attention_mask": [[1] * 10] * 48})

    def config():
        return _config(dense_steps=3, sparse_steps=3, l1_reg=1.0, sparse_learning_rate=2e-2, freeze_layer_norm=False)

    def trainer(model, out, **kw):
        args = TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=4, max_steps=6, learning_rate=1e-2, report_to="none",
            use_cpu=True, save_strategy="steps", save_steps=2, lr_scheduler_type="constant", seed=0, **kw,
        )  # fmt: skip
        return Trainer(model=model, args=args, train_dataset=data, callbacks=[LTSFTCallback()])

    def final(model):
        state = {k: v.detach().clone() for k, v in model.state_dict().items() if "sparse_" in k or "modules_to_save" in k}
        assert state
        return state

    full = get_peft_model(tiny_llama(), config())
    trainer(full, tmp_path / "full").train()
    expected = final(full)
    # dense-phase checkpoint (step 2): the model is built as before
    resumed = get_peft_model(tiny_llama(), config())
    trainer(resumed, tmp_path / "full").train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    got = final(resumed)
    assert got.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=1e-6, msg=k)
    # sparse-phase checkpoint (step 4): the model comes from the checkpoint
    checkpoint = tmp_path / "full" / "checkpoint-4"
    resumed = PeftModel.from_pretrained(tiny_llama(), checkpoint, is_trainable=True)
    trainer(resumed, tmp_path / "full").train(resume_from_checkpoint=str(checkpoint))
    got = final(resumed)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=1e-6, msg=k)
    assert not torch.equal(got[next(k for k in got if "sparse_values" in k)], load_file_values(checkpoint))
    # a sparse-phase checkpoint into a model built for the dense phase: refused with the way out named
    wrong = get_peft_model(tiny_llama(), config())
    with pytest.raises(Exception, match="from_pretrained|phase"):
        trainer(wrong, tmp_path / "full").train(resume_from_checkpoint=str(checkpoint))


def load_file_values(directory):
    from safetensors.torch import load_file

    tensors = load_file(directory / "adapter_model.safetensors")
    return next(v for k, v in tensors.items() if "sparse_values" in k)


def test_mlm_language_sft_recipe_trains_an_encoder_with_its_embeddings(tmp_path):
    """recipes/mlm_language_sft.py on a tiny BERT masked LM: LT-SFT through Trainer with MLM masking, the word
    embeddings adapted (untied from the MLM head, which keeps the base weights), a loadable adapter."""
    import importlib.util
    import json

    from transformers import BertConfig, BertForMaskedLM

    from .test_readme_and_recipes import ROOT

    torch.manual_seed(0)
    config = BertConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    BertForMaskedLM(config).save_pretrained(tmp_path / "bert")
    tokenizer = tiny_tokenizer()
    tokenizer.mask_token = "t3"
    tokenizer.save_pretrained(tmp_path / "bert")
    g = torch.Generator().manual_seed(1)
    (tmp_path / "text.txt").write_text("\n".join(" ".join(f"t{int(i)}" for i in torch.randint(4, 97, (12,), generator=g)) for _ in range(32)))
    spec = importlib.util.spec_from_file_location("mlm_language_sft", ROOT / "recipes" / "mlm_language_sft.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    summary = recipe.main(["--model", str(tmp_path / "bert"), "--text", str(tmp_path / "text.txt"), "--dense-steps", "3",
                           "--sparse-steps", "2", "--batch-size", "4", "--lr", "1e-2", "--output", str(tmp_path / "out")])  # fmt: skip
    saved = json.loads((tmp_path / "out/adapter/adapter_config.json").read_text())
    assert saved["peft_type"] == "LT_SFT" and saved["phase"] == "sparse" and saved["l1_reg"] == 0.1
    assert "bert.embeddings.word_embeddings" in saved["tunable_weights_per_module"]
    assert summary["kept"] == sum(saved["tunable_weights_per_module"].values()) > 0
    loaded = PeftModel.from_pretrained(BertForMaskedLM.from_pretrained(tmp_path / "bert"), tmp_path / "out/adapter").eval()
    head = loaded.base_model.model.cls.predictions.decoder.weight
    torch.testing.assert_close(head, BertForMaskedLM.from_pretrained(tmp_path / "bert").cls.predictions.decoder.weight, rtol=0, atol=0)
    x = torch.randint(4, 97, (2, 9), generator=g)
    with torch.no_grad():
        merged_out = PeftModel.from_pretrained(BertForMaskedLM.from_pretrained(tmp_path / "bert"), tmp_path / "out/adapter").merge_and_unload()(x).logits
        torch.testing.assert_close(loaded(x).logits, merged_out, rtol=1e-5, atol=1e-5)
    with pytest.raises(SystemExit, match="no such file"):
        recipe.main(["--model", str(tmp_path / "bert"), "--text", str(tmp_path / "missing.txt")])


@pytest.mark.parametrize("rates", [dict(), dict(dense_learning_rate=5e-3, sparse_learning_rate=2e-2)], ids=["trainer-rate", "phase-rates"])
def test_resume_under_a_decaying_schedule_repeats_the_uninterrupted_run(tmp_path, rates):
    """Linear decay after warmup: a run resumed from a dense-phase or a sparse-phase checkpoint logs the losses and
    learning rates of the uninterrupted run step for step and ends with its indices and values; the phases'
    configured rates replace the schedule's base rate (warmup and decay apply to them as to the Trainer's)."""
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (32, 10), generator=g).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids, "attention_mask": [[1] * 10] * 32})

    from transformers import TrainerCallback

    class Rates(TrainerCallback):  # the rate each optimizer step actually uses
        def __init__(self):
            self.used = {}

        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            self.used[state.global_step + 1] = [group["lr"] for group in optimizer.param_groups]

    def run(model, out, checkpoint=None):
        args = TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=4, max_steps=8, learning_rate=1e-2, report_to="none",
            use_cpu=True, save_strategy="steps", save_steps=1, lr_scheduler_type="linear", warmup_steps=2, logging_steps=1,
            seed=0,
        )  # fmt: skip
        rates = Rates()
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[LTSFTCallback(), rates])
        trainer.train(resume_from_checkpoint=None if checkpoint is None else str(checkpoint))
        logs = {h["step"]: (h["loss"], h["learning_rate"]) for h in trainer.state.log_history if "loss" in h}
        state = {k: v.detach().clone() for k, v in model.state_dict().items() if "sparse_" in k}
        return logs, rates.used, state

    def config():
        return _config(dense_steps=4, sparse_steps=4, **rates)

    expected_logs, expected_used, expected = run(get_peft_model(tiny_llama(), config()), tmp_path / "full")
    dense_lr, sparse_lr = rates.get("dense_learning_rate", 1e-2), rates.get("sparse_learning_rate", 1e-2)
    factors = [0.0, 0.5, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6]  # step s: warmup over 2 steps, then linear decay to 0 at 8
    schedule = {s: f * (dense_lr if s <= 4 else sparse_lr) for s, f in enumerate(factors, 1)}
    for s in range(1, 9):
        assert expected_used[s] == pytest.approx([schedule[s]] * len(expected_used[s]), rel=1e-9, abs=1e-12), s
        assert expected_logs[s][1] == pytest.approx(schedule[s], rel=1e-9, abs=1e-12), s
    for step, from_pretrained in [(3, False), (5, True)]:  # the dense phase (model as built), the sparse phase (from it)
        checkpoint = tmp_path / "full" / f"checkpoint-{step}"
        model = PeftModel.from_pretrained(tiny_llama(), checkpoint, is_trainable=True) if from_pretrained else get_peft_model(tiny_llama(), config())
        logs, used, state = run(model, tmp_path / f"resumed-{step}", checkpoint)
        for s in range(step + 1, 9):
            assert used[s] == pytest.approx(expected_used[s], rel=1e-9, abs=1e-12), (step, s)
            assert logs[s] == pytest.approx(expected_logs[s], rel=1e-6, abs=1e-9), (step, s)
        assert state.keys() == expected.keys()
        for k in expected:
            assert torch.equal(state[k], expected[k]), (step, k)
