"""Mixture-of-experts models: sparse deltas on the fused expert tensors (``target_parameters``) of a tiny Mixtral
and a tiny Qwen3-MoE — against a dense reference, through saving, merging and composition, through the Trainer and
TRL, with the budget split per expert and SpIEL's no-token rule under a forced router."""

import copy

import pytest
import torch
from datasets import Dataset
from peft import PeftModel, get_peft_model
from transformers import Trainer, TrainingArguments

from peft_sparse import LTSFTConfig, LTSFTScheduler, SM3, SparseFTConfig, SpIELCallback, SpIELConfig, SpIELScheduler
from peft_sparse.core.experts import SparseParameter, SparseSlice

from .models import EXPERT_PARAMETERS, inputs, randomize_values, tiny_mixtral, tiny_qwen3_moe, tiny_tokenizer

FAMILIES = {"mixtral": tiny_mixtral, "qwen3_moe": tiny_qwen3_moe}
IMPLEMENTATIONS = ["eager", "batched_mm", "grouped_mm"]


def slices(model, adapter="default"):
    return [m for m in model.modules() if isinstance(m, SparseSlice) and adapter in m.sparse_values]


def dense_deltas(model, adapter="default") -> dict:
    """{parameter name: the dense delta stack_e scatter(η_e, φ_e)} of every adapted parameter."""
    out = {}
    for layer in slices(model, adapter):
        view = layer.get_base_layer()
        param = view.parameter()
        delta = out.setdefault(layer.parameter_key, torch.zeros_like(param))
        part = delta if view.index is None else delta[view.index]
        part.view(-1).index_add_(0, layer.sparse_indices[adapter].long(), layer.sparse_values[adapter].detach().to(part.dtype))
    return out


def reference_with(base, deltas: dict):
    """A copy of ``base`` whose adapted parameters are θ + δ, trainable (their gradient is ∂L/∂δ)."""
    reference = copy.deepcopy(base)
    params = dict(reference.named_parameters())
    for name, delta in deltas.items():
        params[name].data += delta
    for p in reference.parameters():
        p.requires_grad_(False)
    for name in deltas:
        params[name].requires_grad_(True)
    return reference


# ------------------------------------------------------------------------------------------ equivalence
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_forward_and_value_gradients_equal_a_dense_delta(family, implementation):
    base = FAMILIES[family](experts_implementation=implementation)
    model = get_peft_model(copy.deepcopy(base), SparseFTConfig(target_parameters=EXPERT_PARAMETERS, density=0.1))
    randomize_values(model, scale=0.05)
    reference = reference_with(base, dense_deltas(model))
    x = inputs()
    loss = model(x, labels=x).loss
    loss.backward()
    ref_loss = reference(x, labels=x).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    grads = dict(reference.named_parameters())
    for layer in slices(model):
        view = layer.get_base_layer()
        dense = grads[layer.parameter_key].grad
        dense = dense if view.index is None else dense[view.index]
        expected = dense.reshape(-1)[layer.sparse_indices["default"].long()]
        torch.testing.assert_close(layer.sparse_values["default"].grad, expected, rtol=1e-5, atol=1e-7)
    assert any(layer.sparse_values["default"].grad.abs().sum() > 0 for layer in slices(model))


def test_one_sparse_layer_per_expert_and_a_2d_parameter_as_one():
    model = get_peft_model(tiny_mixtral(), SparseFTConfig(target_parameters=[*EXPERT_PARAMETERS, "mlp.gate.weight"], density=0.1))
    counts = model.peft_config["default"].tunable_weights_per_module
    names = [f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("experts.gate_up_proj", "experts.down_proj", "gate.weight")]
    expected = {f"{n}.{e}" for n in names if "experts" in n for e in range(4)} | {n for n in names if "gate.weight" in n}
    assert set(counts) == expected
    assert model.peft_config["default"].module_shapes["model.layers.0.mlp.experts.gate_up_proj.3"] == [48, 32]
    assert model.peft_config["default"].module_shapes["model.layers.0.mlp.gate.weight"] == [4, 32]
    # uniform split: every expert of a tensor gets the same count, up to the rounding of the total
    for n in names:
        if "experts" in n:
            per_expert = [counts[f"{n}.{e}"] for e in range(4)]
            assert max(per_expert) - min(per_expert) <= 1
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".sparse_values." in n for n in trainable)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_the_wrapped_parameter_is_saved_as_a_recipe_and_rebuilt_once(implementation, monkeypatch):
    """What the experts' operations save of P' (P' itself, its transpose, one expert's slice) is saved as a recipe —
    never as a tensor that holds P''s storage — and backward rebuilds each P' it needs once (layer 0's gate_up_proj
    is not needed: nothing before it trains, so no input gradient is formed there). ``batched_mm`` gathers a copy of
    each token's expert weights and saves that: nothing of P' itself is saved there."""
    from peft_sparse.core import experts

    produced, kept, packed, rebuilt = [], [], set(), []
    original_pack, original_get = experts._pack, experts._Rebuild.get

    def pack(t):
        out = original_pack(t)
        if isinstance(out, experts._Saved):
            packed.add(out.recipe)
        else:
            kept.append(t.untyped_storage().data_ptr())
        return out

    def get(recipe):
        if recipe.kept is None:
            rebuilt.append(recipe)
        return original_get(recipe)

    monkeypatch.setattr(experts, "_pack", pack)
    monkeypatch.setattr(experts._Rebuild, "get", get)
    original_apply = experts.ParameterDelta.apply
    monkeypatch.setattr(experts.ParameterDelta, "apply", lambda *a: produced.append(original_apply(*a)) or produced[-1])
    model = get_peft_model(tiny_mixtral(experts_implementation=implementation), SparseFTConfig(target_parameters=EXPERT_PARAMETERS, density=0.1))
    x = inputs()
    loss = model(x, labels=x).loss
    storages = {p.untyped_storage().data_ptr() for p in produced}
    assert len(produced) == 4 and not storages & set(kept)
    produced.clear()
    loss.backward()
    expected = 0 if implementation == "batched_mm" else 3
    assert len(packed) == expected and len(rebuilt) == expected and set(rebuilt) == packed
    assert all(recipe.kept is None for recipe in rebuilt)  # (dropped once backward is done)
    assert all(layer.sparse_values["default"].grad is not None for layer in slices(model))


def test_gradients_under_activation_checkpointing_equal_without():
    x = inputs()
    grads = []
    for checkpointing in (False, True):
        model = get_peft_model(tiny_mixtral(), SparseFTConfig(target_parameters=EXPERT_PARAMETERS, density=0.1))
        randomize_values(model, scale=0.05)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        model(x, labels=x).loss.backward()
        grads.append([layer.sparse_values["default"].grad for layer in slices(model)])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------ lifecycle
@pytest.mark.parametrize("family", FAMILIES)
def test_save_load_round_trip_is_exact(family, tmp_path):
    model = get_peft_model(FAMILIES[family](), SpIELConfig(target_parameters=EXPERT_PARAMETERS, density=0.1, seed=3))
    randomize_values(model)
    x = inputs()
    with torch.no_grad():
        expected = model(x).logits
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(FAMILIES[family](), tmp_path)
    for a, b in zip(slices(model), slices(loaded)):
        assert a.module_name == b.module_name
        assert torch.equal(a.sparse_indices["default"], b.sparse_indices["default"])
        assert torch.equal(a.sparse_values["default"], b.sparse_values["default"])
        assert torch.equal(a.sparse_ages["default"], b.sparse_ages["default"])
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, expected)


def test_merge_and_unload_equals_the_adapted_forward_and_unload_restores_the_base():
    base = tiny_qwen3_moe()
    x = inputs()
    with torch.no_grad():
        plain = base(x).logits
    model = get_peft_model(copy.deepcopy(base), SparseFTConfig(target_parameters=EXPERT_PARAMETERS, density=0.2))
    randomize_values(model, scale=0.1)
    with torch.no_grad():
        adapted = model(x).logits
        assert not torch.allclose(adapted, plain)
        merged = copy.deepcopy(model).merge_and_unload()
        assert not any(isinstance(m, SparseParameter) for m in merged.modules())
        assert {n for n, _ in merged.named_parameters()} == {n for n, _ in base.named_parameters()}
        torch.testing.assert_close(merged(x).logits, adapted, rtol=1e-5, atol=1e-6)
        assert torch.equal(model.unload()(x).logits, plain)


def test_two_adapters_compose_into_their_sum(tmp_path):
    base = tiny_mixtral()
    model = get_peft_model(copy.deepcopy(base), SparseFTConfig(target_parameters=EXPERT_PARAMETERS, density=0.1, seed=1), adapter_name="one")
    model.add_adapter("two", SparseFTConfig(target_parameters=EXPERT_PARAMETERS, target_modules=["q_proj"], density=0.1, seed=2))
    randomize_values(model, "one", seed=1, scale=0.1)
    randomize_values(model, "two", seed=2, scale=0.1)
    model.add_weighted_adapter(["one", "two"], [1.0, 0.5], "both")
    config = model.peft_config["both"]
    assert config.target_parameters == sorted({layer.parameter_key for layer in slices(model, "both")})
    assert config.target_modules == "|".join(f"model\\.layers\\.{i}\\.self_attn\\.q_proj" for i in range(2))
    model.set_adapter("both")
    x = inputs()
    with torch.no_grad():
        composed = model(x).logits
    # the reference: θ + δ_a + 0.5·δ_b, dense
    one, two = dense_deltas(model, "one"), dense_deltas(model, "two")
    reference = reference_with(base, {k: one[k] + 0.5 * two[k] for k in one})
    for layer in [m for m in model.modules() if hasattr(m, "sparse_values") and "two" in m.sparse_values and not isinstance(m, SparseSlice)]:
        weight = reference.get_submodule(layer.module_name).weight  # (q_proj: adapter "two" only)
        weight.data.view(-1).index_add_(0, layer.sparse_indices["two"].long(), 0.5 * layer.sparse_values["two"].detach())
    with torch.no_grad():
        torch.testing.assert_close(composed, reference(x).logits, rtol=1e-5, atol=1e-6)
    model.save_pretrained(tmp_path, selected_adapters=["both"])
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "both")
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, composed, rtol=0, atol=0)


def test_mixed_adapter_batches_are_refused_as_for_lora():
    model = get_peft_model(tiny_mixtral(), SparseFTConfig(target_parameters=EXPERT_PARAMETERS, density=0.1)).eval()
    with pytest.raises(ValueError, match="mixed adapter batches.*target_parameters"):
        model(inputs(), adapter_names=["default", "__base__"])


def test_bad_targets_are_refused_by_name():
    with pytest.raises(ValueError, match="target_parameters must be a list"):
        SparseFTConfig(target_parameters="mlp.experts.gate_up_proj", density=0.1)
    with pytest.raises(ValueError, match=r"block_shape=\(5, 5\) does not tile target parameter"):
        get_peft_model(tiny_mixtral(), SparseFTConfig(target_parameters=EXPERT_PARAMETERS, density=0.1, block_shape=(5, 5)))


def test_layers_to_transform_selects_the_experts_of_those_layers():
    model = get_peft_model(tiny_mixtral(), SparseFTConfig(target_parameters=EXPERT_PARAMETERS, density=0.1, layers_to_transform=[1]))
    assert {layer.module_name.split(".")[2] for layer in slices(model)} == {"1"}
    assert not isinstance(model.base_model.model.model.layers[0].mlp.experts, SparseParameter)


# ------------------------------------------------------------------------------------------ training
def _dataset(n=32, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (n, length), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist(), "attention_mask": [[1] * length] * n})


def _state(model):
    return [(l.sparse_indices["default"].clone(), l.sparse_values["default"].detach().clone()) for l in slices(model)]


CONFIGS = {
    "spiel-ag": lambda: SpIELConfig(target_parameters=EXPERT_PARAMETERS, density=0.1, reselection_steps=3, gradient_estimation_steps=2),
    "spiel-ma": lambda: SpIELConfig(target_parameters=EXPERT_PARAMETERS, density=0.1, growth="ma", reselection_steps=3),
    "sft": lambda: SparseFTConfig(target_parameters=EXPERT_PARAMETERS, density=0.1),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", CONFIGS)
def test_trainer_trains_the_experts(family, method, tmp_path):
    model = get_peft_model(FAMILIES[family](), CONFIGS[method]())
    before = _state(model)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=7, learning_rate=1e-2,
                             logging_steps=1, report_to="none", use_cpu=True, seed=0, save_strategy="no")  # fmt: skip
    callbacks = [SpIELCallback()] if method.startswith("spiel") else []
    trainer = Trainer(model=model, args=args, train_dataset=_dataset(), callbacks=callbacks)
    trainer.train()
    after = _state(model)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 7 and all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(b[1], a[1]) for b, a in zip(before, after))  # values trained
    changed = sum(not torch.equal(b[0], a[0]) for b, a in zip(before, after))
    if method.startswith("spiel"):
        assert [h["step"] for h in trainer.state.log_history if "spiel/replaced" in h]
        assert changed > 0  # indices reselected
    else:
        assert changed == 0


@pytest.mark.parametrize("method", ["spiel-ag", "spiel-ma", "sft"])
def test_trl_sft_trainer_trains_the_experts(method, tmp_path):
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_dict({"input_ids": _dataset()["input_ids"]})
    args = SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=7, learning_rate=1e-2, logging_steps=1,
        report_to="none", use_cpu=True, bf16=False, save_strategy="no", dataset_kwargs={"skip_prepare_dataset": True},
        remove_unused_columns=False,
    )  # fmt: skip

    def collate(rows):
        ids = torch.tensor([r["input_ids"] for r in rows])
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}

    callbacks = [SpIELCallback()] if method.startswith("spiel") else []
    trainer = SFTTrainer(model=tiny_qwen3_moe(), args=args, train_dataset=data, peft_config=CONFIGS[method](), callbacks=callbacks,
                         data_collator=collate, processing_class=tiny_tokenizer())  # fmt: skip
    before = _state(trainer.model)
    trainer.train()
    after = _state(trainer.model)
    assert any(not torch.equal(b[1], a[1]) for b, a in zip(before, after))
    if method.startswith("spiel"):
        assert any(not torch.equal(b[0], a[0]) for b, a in zip(before, after))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert min(losses[-3:]) < losses[0]


def test_plain_loop_loss_goes_down_with_spiel_ma_under_sm3():
    model = get_peft_model(tiny_mixtral(), CONFIGS["spiel-ma"]())
    optimizer = SM3([p for p in model.parameters() if p.requires_grad], lr=0.1)
    scheduler = SpIELScheduler(model, optimizer, total_steps=9)
    x = inputs(batch=4, length=10)
    model.train()
    losses = []
    for _ in range(9):
        loss = model(x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    # SM3's row and column accumulators are per expert slice: (rows,) and (cols,) of its (rows, cols) matrix
    state = optimizer.state[slices(model)[0].sparse_values["default"]]
    assert state["row_accumulator"].shape == (48,) and state["col_accumulator"].shape == (32,)


def test_lt_sft_selects_within_each_expert():
    model = get_peft_model(tiny_mixtral(), LTSFTConfig(target_parameters=EXPERT_PARAMETERS, density=0.1, dense_steps=2, sparse_steps=2))
    scheduler = LTSFTScheduler(model)
    optimizer = scheduler.attach(torch.optim.AdamW(scheduler.trainable_parameters(), lr=1e-2))
    x = inputs()
    model.train()
    assert all(l.sparse_values["default"].numel() == l.numel for l in slices(model))  # the dense phase
    for _ in range(4):
        model(x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    counts = model.peft_config["default"].tunable_weights_per_module
    assert all(l.sparse_values["default"].numel() == counts[l.module_name] < l.numel for l in slices(model))


# ------------------------------------------------------------------------------------------ routing
def force_router(model, experts=(0, 1)):
    """Route every token of every MoE layer to ``experts``, with equal weights."""
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):

            def forward(hidden, module=module):
                hidden = hidden.reshape(-1, module.hidden_dim)
                chosen = torch.tensor(experts).expand(hidden.shape[0], -1)
                return torch.nn.functional.linear(hidden, module.weight), torch.full(chosen.shape, 1 / len(experts)), chosen

            module.forward = forward


def _train_forced(config, steps, optimizer_cls=torch.optim.AdamW, rule=True, monkeypatch=None):
    """``steps`` SpIEL steps with every token routed to experts 0 and 1; returns the model and its slices'
    (indices, values) before and after."""
    from peft_sparse.methods.spiel import routing

    if not rule:
        monkeypatch.setattr(routing.RoutedTokens, "idle", lambda self: set())
    model = get_peft_model(tiny_mixtral(), config)
    randomize_values(model, scale=0.05)
    force_router(model)
    optimizer = optimizer_cls([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    scheduler = SpIELScheduler(model, optimizer, total_steps=steps)
    before = _state(model)
    x = inputs(batch=4, length=10)
    model.train()
    reports = []
    for _ in range(steps):
        model(x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reports.append(scheduler.step())
    assert any(reports)
    return model, before, _state(model)


def _idle(layer) -> bool:
    return layer.module_name.rsplit(".", 1)[-1] in ("2", "3")


RULE_CONFIGS = {
    "ag": lambda: SpIELConfig(target_parameters=EXPERT_PARAMETERS, density=0.1, reselection_steps=2, gradient_estimation_steps=1),
    "ma": lambda: SpIELConfig(target_parameters=EXPERT_PARAMETERS, density=0.1, growth="ma", reselection_steps=2),
    "ag-adaptive": lambda: SpIELConfig(target_parameters=EXPERT_PARAMETERS, density=0.1, reselection_steps=2, gradient_estimation_steps=1,
                                       budget_split="adaptive"),  # fmt: skip
}


@pytest.mark.parametrize("growth", RULE_CONFIGS)
def test_an_expert_no_token_reached_keeps_its_indices_and_values(growth, monkeypatch):
    model, before, after = _train_forced(RULE_CONFIGS[growth](), steps=5)
    for layer, (idx0, val0), (idx1, val1) in zip(slices(model), before, after):
        if _idle(layer):
            assert torch.equal(idx0, idx1) and torch.equal(val0, val1), layer.module_name
    routed = [(b, a) for layer, b, a in zip(slices(model), before, after) if not _idle(layer)]
    assert any(b[0].numel() != a[0].numel() or not torch.equal(b[0], a[0]) for b, a in routed)  # the others are reselected
    # without the rule the idle experts' indices are replaced on ties of zero scores (AG) or stale ones (MA)
    model, before, after = _train_forced(RULE_CONFIGS[growth](), steps=5, rule=False, monkeypatch=monkeypatch)
    idle = [(b, a) for layer, b, a in zip(slices(model), before, after) if _idle(layer)]
    assert any(b[0].numel() != a[0].numel() or not torch.equal(b[0], a[0]) for b, a in idle)


def test_routed_tokens_are_counted_per_expert_and_saved_with_the_scheduler(tmp_path):
    model = get_peft_model(tiny_mixtral(), RULE_CONFIGS["ag"]())
    force_router(model, experts=(1, 3))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = SpIELScheduler(model, optimizer, total_steps=6)
    x = inputs(batch=2, length=5)
    model.train()
    model(x, labels=x).loss.backward()
    wrappers = scheduler.routing.wrappers
    assert len(wrappers) == 4 and all(w.routed_tokens.tolist() == [0, 10, 0, 10] for w in wrappers)
    assert scheduler.routing.idle() == {l.module_name for l in slices(model) if l.module_name[-1] in "02"}
    scheduler.save(tmp_path)
    again = SpIELScheduler(model, optimizer, total_steps=6)
    again.load(tmp_path)
    assert all(w.routed_tokens.tolist() == [0, 10, 0, 10] for w in again.routing.wrappers)


def test_s4_masks_per_expert_and_routed_updates(tmp_path):
    from peft_sparse import S4Config, S4Router, build_s4_model, detect_language_masks
    from peft_sparse.methods.s4 import language_masks

    loaders = {lang: [{"input_ids": inputs(seed=10 * j + i), "labels": inputs(seed=10 * j + i)} for i in range(2)] for j, lang in enumerate("ab")}
    config = S4Config(target_parameters=EXPERT_PARAMETERS, density=0.2, languages=["a", "b"], importance_batches=2)
    base = tiny_qwen3_moe()
    masks = detect_language_masks(base, loaders, config)
    # each expert's top 20% by |∂L/∂h·h|, from the gradient of the fused tensor: the reference, computed here
    base.zero_grad()
    gate_up = base.model.layers[1].mlp.experts.gate_up_proj
    gate_up.requires_grad_(True)
    for batch in loaders["b"]:
        base(**batch).loss.backward()
    score = (gate_up.grad[2] * gate_up.detach()[2]).abs().reshape(-1)
    expected = torch.topk(score, round(0.2 * score.numel())).indices.sort().values
    assert torch.equal(torch.as_tensor(masks["b"]["model.layers.1.mlp.experts.gate_up_proj.2"]).long(), expected)
    gate_up.requires_grad_(False)
    model = build_s4_model(tiny_qwen3_moe(), config, masks)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    router = S4Router(model, optimizer)
    layers, per_language = slices(model), list(language_masks(model).values())
    before = [l.sparse_values["default"].detach().clone() for l in layers]
    x = inputs(seed=5)
    model(input_ids=x, labels=x, language=["a", "a"]).loss.backward()
    optimizer.step()
    moved = 0
    for layer, mask, old in zip(layers, per_language, before):
        new = layer.sparse_values["default"].detach()
        assert torch.equal(new[~mask[0]], old[~mask[0]]), layer.module_name
        moved += int((new != old).sum())
    assert moved > 0
    router.remove()
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(tiny_qwen3_moe(), tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_peft_alone_loads_an_expert_adapter_without_the_import(tmp_path):
    """The ``peft_sparse_autoload.pth`` hook registers the sparse types when PEFT loads an adapter of one of them."""
    from .test_autoload import INSTALLED, _run

    if not INSTALLED:
        pytest.skip("the package was installed without its .pth file (pip install -e . installs it)")
    tiny_mixtral().save_pretrained(tmp_path / "base")
    model = get_peft_model(tiny_mixtral(), SpIELConfig(target_parameters=EXPERT_PARAMETERS, target_modules=["q_proj"], density=0.1))
    randomize_values(model)
    model.peft_config["default"].base_model_name_or_path = str(tmp_path / "base")
    model.save_pretrained(tmp_path / "adapter")
    torch.save(inputs(), tmp_path / "x.pt")
    with torch.no_grad():
        expected = model(inputs()).logits
    done = _run(f"""
        import sys, torch
        from peft import AutoPeftModelForCausalLM
        model = AutoPeftModelForCausalLM.from_pretrained({str(tmp_path / "adapter")!r})
        assert "peft_sparse" in sys.modules  # (imported by the hook, not by this script)
        with torch.no_grad():
            torch.save(model(torch.load({str(tmp_path / "x.pt")!r})).logits, {str(tmp_path / "y.pt")!r})
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert torch.equal(torch.load(tmp_path / "y.pt"), expected)


def test_generate_merges_for_the_call_and_matches_the_merged_model():
    model = get_peft_model(tiny_mixtral(), SparseFTConfig(target_parameters=EXPERT_PARAMETERS, density=0.2)).eval()
    randomize_values(model, scale=0.2)
    x = inputs(batch=1)
    kept = [p.detach().clone() for n, p in model.named_parameters() if "experts" in n and "deltas" not in n]
    tokens = model.generate(input_ids=x, max_new_tokens=6, do_sample=False)
    assert all(torch.equal(a, p) for a, p in zip(kept, (p for n, p in model.named_parameters() if "experts" in n and "deltas" not in n)))
    merged = copy.deepcopy(model).merge_and_unload()
    assert torch.equal(tokens, merged.generate(input_ids=x, max_new_tokens=6, do_sample=False))


def test_merge_sparse_adapters_and_inspect_read_expert_files(tmp_path):
    from peft_sparse import merge_sparse_adapters
    from peft_sparse.core.compose import adapter_file_summary

    model = get_peft_model(tiny_mixtral(), SpIELConfig(target_parameters=EXPERT_PARAMETERS, density=0.1)).eval()
    randomize_values(model, scale=0.1)
    model.save_pretrained(tmp_path)
    summary = adapter_file_summary(tmp_path)
    assert set(summary["modules"]) == set(model.peft_config["default"].tunable_weights_per_module)
    assert summary["modules"]["model.layers.1.mlp.experts.down_proj.2"]["shape"] == [32, 24]
    x = inputs()
    with torch.no_grad():
        expected = copy.deepcopy(model).merge_and_unload()(x).logits
        merged = merge_sparse_adapters(tiny_mixtral(), [tmp_path])
        torch.testing.assert_close(merged(x).logits, expected, rtol=0, atol=0)


def test_block_masks_select_whole_blocks_of_each_expert():
    config = SpIELConfig(target_parameters=EXPERT_PARAMETERS, density=0.25, block_shape=(8, 8), reselection_steps=2, gradient_estimation_steps=1)
    model, before, after = _train_forced(config, steps=4)
    from peft_sparse.core.selection import BlockGrid

    for layer, (idx, _) in zip(slices(model), after):
        grid = BlockGrid(layer.out_features, layer.in_features, (8, 8))
        assert grid.units(idx).numel() * 64 == idx.numel()  # whole blocks
    assert any(not torch.equal(b[0], a[0]) for b, a in zip(before, after))


class _Stacked(torch.nn.Module):
    """A module that reads a 3-D parameter itself and receives no routing indices."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stack = torch.nn.Parameter(torch.randn(3, 6, 5))

    def forward(self, x):
        return torch.einsum("bc,erc->ber", x, self.stack).sum()


class _Holder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Stacked()

    def forward(self, x):
        return self.inner(x)


def test_a_3d_parameter_outside_moe_trains_and_the_no_token_rule_steps_aside_with_a_warning():
    model = get_peft_model(_Holder(), SpIELConfig(target_parameters=["inner.stack"], density=0.5, reselection_steps=2, gradient_estimation_steps=1))
    assert len(slices(model)) == 3
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = SpIELScheduler(model, optimizer, total_steps=4)
    model.train()
    with pytest.warns(UserWarning, match="receives no routing indices"):
        model(torch.randn(4, 5)).backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    assert scheduler.routing.idle() == set()  # (nothing counted: the rule does not apply)
    for _ in range(3):
        model(torch.randn(4, 5)).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    assert all(layer.sparse_values["default"].abs().sum() > 0 for layer in slices(model))


def test_expert_adapters_refuse_lora_conversion_by_name():
    """PEFT's conversion writes modules only: an adapter on expert tensors says so (PEFT's own function refuses it as it
    refuses LoRA on parameters) instead of failing inside PEFT with no target found."""
    import peft_sparse

    model = get_peft_model(tiny_mixtral(), SparseFTConfig(target_parameters=EXPERT_PARAMETERS, target_modules=["q_proj"], density=0.1))
    assert not model.supports_lora_conversion()
    with pytest.raises(TypeError, match="target_parameters"):
        peft_sparse.convert_to_lora(model, rank=2)
