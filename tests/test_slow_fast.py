"""Slow-fast learning rates: sets by relative depth, phase and φ, effective rates, SpIEL, resume, bad input."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from peft_sparse import SlowFastConfig, SlowFastScheduler, SparseFTConfig, SpIELConfig, SpIELScheduler
from peft_sparse.schedules.slow_fast import PhaseTracker, assign_sets, default_layers

from .models import inputs, sparse_layers, tiny_llama


def _llama(n):
    return LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=16, intermediate_size=24, num_hidden_layers=n, num_attention_heads=2,
                                        num_key_value_heads=1, max_position_embeddings=32))  # fmt: skip


def _gpt2(n):
    return GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=16, n_layer=n, n_head=2, n_positions=32))


def _bert(n):
    return BertModel(BertConfig(vocab_size=97, hidden_size=16, intermediate_size=24, num_hidden_layers=n, num_attention_heads=2, max_position_embeddings=32))


@pytest.mark.parametrize("n,expected", [
    (1, {"S1": [], "S2": [0], "V1": [0], "V2": [0]}),
    (2, {"S1": [0], "S2": [0], "V1": [1], "V2": [1]}),
    (6, {"S1": [0, 1, 2, 3, 4], "S2": [0, 1], "V1": [5], "V2": [5]}),
    (12, {"S1": list(range(10)), "S2": [0, 1, 2, 3], "V1": [10, 11], "V2": [10, 11]}),
    (24, {"S1": list(range(20)), "S2": list(range(8)), "V1": [20, 21, 22, 23], "V2": [20, 21, 22, 23]}),
])  # fmt: skip
def test_sets_scale_with_depth(n, expected):
    assert default_layers(n) == expected


@pytest.mark.parametrize("build", [_llama, _gpt2, _bert])
@pytest.mark.parametrize("n", [2, 6, 12, 24])
def test_set_membership_from_the_model(build, n):
    model = build(n)
    sets = assign_sets(model, SlowFastConfig())
    layers = default_layers(n)
    attention = [k for k in sets if ("attn" in k or "attention" in k)]
    assert attention
    for name, s in sets.items():
        block = next((int(p) for p in name.split(".") if p.isdigit()), None)
        if block is None:
            assert s == frozenset(), name  # embeddings, final norm, head
            continue
        assert ("S1" in s) == (block in layers["S1"]), name
        assert ("V1" in s) == (block in layers["V1"]), name
        is_attention = name in attention
        is_norm = any(t in name for t in ("norm", "ln_", "LayerNorm"))
        assert ("V2" in s) == (is_attention and block in layers["V2"]), name
        assert ("S2" in s) == (not is_attention and not is_norm and block in layers["S2"]), name


def test_phase_and_phi_on_known_loss_curves():
    tracker = PhaseTracker(window=2, threshold=0.1)
    for loss in (4.0, 3.0):
        tracker.update(loss)
        assert tracker.in_p1 and tracker.phi is None  # not enough history: P₁
    tracker.update(2.0)
    tracker.update(1.0)  # previous 3.5, last 1.5: drop 2 > 0.1, φ = 1.5/3.5
    assert tracker.in_p1 and tracker.phi == pytest.approx(1.5 / 3.5)
    tracker.update(0.98)
    tracker.update(0.97)  # previous 1.5, last 0.975: still P₁
    assert tracker.in_p1
    tracker.update(0.96)
    tracker.update(0.95)  # previous 0.975, last 0.955: drop 0.02 ≤ 0.1 → P₂
    assert not tracker.in_p1 and tracker.phi == pytest.approx(0.955 / 0.975)
    for loss in (5.0, 5.0, 1.0, 1.0):  # a later fast drop does not bring P₁ back
        tracker.update(loss)
    assert not tracker.in_p1


def test_effective_rate_is_base_times_k_every_step_and_across_reselections():
    model = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.1, reselection_steps=3, gradient_estimation_steps=1))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    config = SlowFastConfig(window=1, threshold=0.0, c1=0.1, c2=5.0, r=2.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    slow_fast = SlowFastScheduler(model, optimizer, config, lr_scheduler=schedule)
    spiel = SpIELScheduler(model, optimizer, total_steps=8)
    names = {id(p): n for n, p in model.named_parameters()}
    sets = assign_sets(model, config)
    from peft_sparse.schedules.slow_fast import multiplier

    for t in range(8):
        x = inputs(seed=t)
        loss = model(x, labels=x).loss
        loss.backward()
        rates = {names[id(p)]: g["lr"] for g in optimizer.param_groups for p in g["params"]}
        base = 1e-2 / (1 + t)
        for name, rate in rates.items():
            k = multiplier(sets[name], slow_fast.tracker.in_p1, slow_fast.tracker.phi, config)
            assert rate == pytest.approx(base * k, rel=1e-12), (t, name)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        spiel.step()
        slow_fast.step(loss.item())
    values = {id(l.sparse_values["default"]) for l in sparse_layers(model)}
    grouped = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert values <= grouped  # reselections edit the values in place: each stays in its set's group
    assert len({g["slow_fast_sets"] for g in optimizer.param_groups}) >= 4


def test_works_with_lora_and_the_trainer_scheduler_split(tmp_path):
    from transformers import get_linear_schedule_with_warmup

    model = get_peft_model(tiny_llama(), LoraConfig(target_modules=["q_proj", "down_proj"], r=2))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    schedule = get_linear_schedule_with_warmup(optimizer, 0, 10)
    slow_fast = SlowFastScheduler(model, optimizer, SlowFastConfig(window=1, c1=0.5), lr_scheduler=schedule)
    for t in range(3):
        x = inputs(seed=t)
        loss = model(x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        slow_fast.step(loss.item())
    base = 1e-2 * (10 - 3) / 10
    for g in optimizer.param_groups:
        k = slow_fast.multipliers()[g["slow_fast_sets"]]
        assert g["lr"] == pytest.approx(base * k)


def test_resume_reproduces_the_rates():
    def run(steps, state=None):
        torch.manual_seed(0)
        model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.1))
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-1)
        sf = SlowFastScheduler(model, optimizer, SlowFastConfig(window=2, threshold=0.0))
        if state is not None:
            sf.load_state_dict(state)
            sf.apply()
        for t in range(steps):
            sf.step(3.0 - 0.1 * (sf.t + 1) ** 0.5)
        return sf, [g["lr"] for g in optimizer.param_groups]

    full, rates = run(6)
    half, _ = run(3)
    resumed, resumed_rates = run(3, half.state_dict())
    assert resumed.state_dict() == full.state_dict() and resumed_rates == rates


def test_sparse_configs_record_it_and_bad_settings_are_refused():
    config = SparseFTConfig(target_modules="all-linear", density=0.1, slow_fast=SlowFastConfig(c2=4.0))
    assert config.slow_fast["c2"] == 4.0 and isinstance(config.to_dict()["slow_fast"], dict)
    for field, value in [("c1", 0), ("c2", -1.0), ("r", 0), ("window", 0)]:
        with pytest.raises(ValueError, match=f"{field}={value!r}"):
            SlowFastConfig(**{field: value})
    with pytest.raises(ValueError, match="unknown fields"):
        SparseFTConfig(target_modules="all-linear", density=0.1, slow_fast={"c3": 1})
    with pytest.raises(ValueError, match="matches no trainable parameter"):
        assign_sets(tiny_llama(), SlowFastConfig(v2="nothing_like_this"))
    with pytest.raises(ValueError, match="blocks were not found"):
        assign_sets(torch.nn.Sequential(torch.nn.Linear(2, 2)), SlowFastConfig())
    with pytest.raises(ValueError, match="has 2 blocks"):
        assign_sets(tiny_llama(), SlowFastConfig(s1=[5]))


def test_overrides_by_indices_and_patterns():
    sets = assign_sets(tiny_llama(), SlowFastConfig(s1=[1], v2=r"layers\.0\.mlp\.up_proj"))
    assert "S1" in sets["model.layers.1.mlp.up_proj.weight"] and "S1" not in sets["model.layers.0.mlp.up_proj.weight"]
    assert "V2" in sets["model.layers.0.mlp.up_proj.weight"] and "V2" not in sets["model.layers.1.self_attn.q_proj.weight"]


def test_trainer_callback_from_the_sparse_config_logs_phase_and_multipliers(tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from peft_sparse.callbacks import callbacks_for

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (32, 10), generator=g).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids, "attention_mask": [[1] * 10] * 32})
    config = SparseFTConfig(target_modules="all-linear", density=0.1, slow_fast={"window": 2, "c1": 0.25})
    model = get_peft_model(tiny_llama(), config)
    callbacks = callbacks_for(config)
    assert [type(c).__name__ for c in callbacks] == ["SlowFastCallback"]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3,
                             learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1, report_to="none", use_cpu=True,
                             save_strategy="no")  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "slow_fast/phase" in h]
    assert len(logged) == 3 and all(h["slow_fast/phase"] == 1 for h in logged)  # 3 steps < 2w: P₁
    assert logged[-1]["slow_fast/K[S1]"] == 0.25
    rates = {g["slow_fast_sets"]: g["lr"] for g in trainer.optimizer.param_groups}
    assert rates[("S1", "S2")] == pytest.approx(0.25e-2) and rates[("V1",)] == pytest.approx(1e-2)


def test_the_slow_fast_recipe_compares_plain_and_slow_fast_and_plots(tmp_path):
    """recipes/slow_fast.py end to end on a tiny model (the mechanism; the README holds the SmolLM2 numbers)."""
    import importlib.util
    from argparse import Namespace

    from .test_cross_lingual_recipe import _rows, _tokenizer
    from .test_readme_and_recipes import ROOT

    spec = importlib.util.spec_from_file_location("slow_fast_recipe", ROOT / "recipes" / "slow_fast.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    args = Namespace(steps=8, window=2, lr=1e-2, budget=500, fraction=0.5, batch_size=2, max_length=32, seed=0)
    result = recipe.run(tiny_llama(), _tokenizer(), _rows(16, 1), _rows(4, 3), args, tmp_path)
    assert set(result["exact_match"]) == {"plain", "slow-fast"}
    plain, fast = result["history"]["plain"], result["history"]["slow-fast"]
    assert len(plain) == len(fast) == 8 and "slow_fast/phase" in fast[0] and "slow_fast/phase" not in plain[0]
    assert any("slow_fast/phi" in h for h in fast)  # two full windows of losses exist from step 4
    assert (tmp_path / "slow-fast.png").stat().st_size > 0
