"""Cross-lingual transfer: a task adapter trained under a frozen language adapter, multi-source switching,
composition for zero-shot inference."""

import pytest
import torch
from peft import PeftModel, get_peft_model

from peft_sparse import LTSFTConfig, LTSFTScheduler, SparseFTConfig
from peft_sparse.transfer import LanguageSwitch, add_frozen_adapter, compose, stack

from .models import inputs, randomize_values, sparse_layers, tiny_llama


def _language_adapter(path, seed):
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.05, seed=seed))
    randomize_values(model, seed=seed, scale=0.05)
    model.save_pretrained(path)
    return path


def _task_model(**kwargs):
    config = LTSFTConfig(target_modules="all-linear", density=0.1, dense_steps=2, sparse_steps=2, **kwargs)
    return get_peft_model(tiny_llama(), config, adapter_name="task")


def _merged(*dirs):
    model = tiny_llama()
    for d in dirs:
        model = PeftModel.from_pretrained(model, d).merge_and_unload()
    return model


def _task_grads(model):
    return [l.sparse_values["task"].grad.clone() for l in sparse_layers(model) if "task" in l.sparse_values]


def test_task_gradients_under_a_frozen_language_equal_those_with_the_language_merged(tmp_path):
    en = _language_adapter(tmp_path / "en", seed=1)
    model = _task_model()
    add_frozen_adapter(model, en, "en")
    stack(model, ["en"], "task")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".task" in n for n in trainable)
    x = inputs(seed=3)
    model(x, labels=x).loss.backward()
    ours = _task_grads(model)
    reference = get_peft_model(_merged(en), LTSFTConfig(target_modules="all-linear", density=0.1, dense_steps=2, sparse_steps=2), adapter_name="task")
    reference(x, labels=x).loss.backward()
    for a, b in zip(ours, _task_grads(reference)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_lt_sft_under_a_language_and_zero_shot_composition_with_another(tmp_path):
    en, sw = _language_adapter(tmp_path / "en", 1), _language_adapter(tmp_path / "sw", 2)
    model = _task_model()
    add_frozen_adapter(model, en, "en")
    stack(model, ["en"], "task")
    lt = LTSFTScheduler(model)
    assert lt.adapter_name == "task"
    optimizer = lt.attach(torch.optim.AdamW(lt.trainable_parameters(), lr=1e-2))
    for t in range(4):
        x = inputs(seed=t)
        model(x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        lt.step()
    assert model.peft_config["task"].phase == "sparse"
    # φ_task alone is what the task adapter saves: the language is not in it
    model.save_pretrained(tmp_path / "out", selected_adapters=["task"])
    task_dir = tmp_path / "out" / "task"
    x = inputs(seed=9)
    composed = compose(tiny_llama(), [sw, task_dir])
    reference = _merged(sw, task_dir)
    with torch.no_grad():
        torch.testing.assert_close(composed(x).logits, reference(x).logits, rtol=1e-5, atol=1e-6)
        merged = composed.merge_and_unload()
        torch.testing.assert_close(merged(x).logits, reference(x).logits, rtol=1e-5, atol=1e-6)
    # and the trained stack itself equals θ + φ_en + φ_task
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, _merged(en, task_dir)(x).logits, rtol=1e-5, atol=1e-6)


def test_language_switch_applies_each_batchs_language_and_refuses_mixed_batches(tmp_path):
    dirs = {"en": _language_adapter(tmp_path / "en", 1), "de": _language_adapter(tmp_path / "de", 2)}
    model = _task_model()
    for lang, d in dirs.items():
        add_frozen_adapter(model, d, f"lang_{lang}")
    switch = LanguageSwitch(model, {"en": "lang_en", "de": "lang_de"}, task="task")
    x = inputs(seed=4)
    for lang in ("de", "en", "de"):
        model.zero_grad()
        model(input_ids=x, labels=x, language=[lang, lang]).loss.backward()
        assert switch.current == lang
        reference = get_peft_model(_merged(dirs[lang]), LTSFTConfig(target_modules="all-linear", density=0.1, dense_steps=2, sparse_steps=2),
                                   adapter_name="task")  # fmt: skip
        reference(x, labels=x).loss.backward()
        for a, b in zip(_task_grads(model), _task_grads(reference)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        assert all(not l.sparse_values[f"lang_{n}"].requires_grad for l in sparse_layers(model) for n in dirs)
    with pytest.raises(ValueError, match=r"\['de', 'en'\]"):
        model(input_ids=x, labels=x, language=["en", "de"])
    with pytest.raises(KeyError, match="'fr'"):
        model(input_ids=x, labels=x, language=["fr", "fr"])
    with pytest.raises(ValueError, match="'language'"):
        model(input_ids=x, labels=x)
    switch.remove()


def test_bad_stacks_are_refused(tmp_path):
    model = _task_model()
    with pytest.raises(KeyError, match="'xx'"):
        stack(model, ["xx"], "task")
    with pytest.raises(ValueError, match="both frozen"):
        stack(model, ["task"], "task")
    with pytest.raises(ValueError, match="already holds"):
        add_frozen_adapter(model, _language_adapter(tmp_path / "a", 1), "task")


def test_composing_a_non_additive_or_foreign_adapter_is_refused(tmp_path):
    from peft import LoraConfig

    lora = get_peft_model(tiny_llama(), LoraConfig(target_modules=["q_proj"], r=2))
    lora.save_pretrained(tmp_path / "lora")
    with pytest.raises(ValueError, match="LORA"):
        compose(tiny_llama(), [tmp_path / "lora"])
    foreign = get_peft_model(tiny_llama(hidden_size=16, intermediate_size=24), SparseFTConfig(target_modules="all-linear", density=0.1))
    foreign.save_pretrained(tmp_path / "foreign")
    with pytest.raises(ValueError, match=r"the adapter was made for a \(16, 24\) matrix but the model's is \(32, 48\)"):
        compose(tiny_llama(), [tmp_path / "foreign"])


def test_compose_takes_the_task_adapters_head(tmp_path):
    """Language SFT ⊕ task SFT with a classifier head (BERT): the head comes from the task adapter, the deltas add,
    and merge_and_unload agrees; two adapters with heads are refused."""
    from peft import PeftModel

    from .models import randomize_values, tiny_bert

    lang = get_peft_model(tiny_bert(), SparseFTConfig(target_modules=["query", "value", "word_embeddings"], density=0.1, seed=1))
    randomize_values(lang, seed=1, scale=0.05)
    lang.save_pretrained(tmp_path / "lang")
    task = get_peft_model(tiny_bert(), SparseFTConfig(target_modules=["query", "dense"], density=0.1, seed=2, modules_to_save=["classifier"]))
    randomize_values(task, seed=2, scale=0.05)
    with torch.no_grad():
        task.base_model.model.classifier.modules_to_save["default"].weight.add_(1.0)  # a head that differs from the base's
    task.save_pretrained(tmp_path / "task")
    x = inputs(seed=3)
    reference = PeftModel.from_pretrained(tiny_bert(), tmp_path / "lang").merge_and_unload()
    reference = PeftModel.from_pretrained(reference, tmp_path / "task").merge_and_unload().eval()
    composed = compose(tiny_bert(), [tmp_path / "lang", tmp_path / "task"]).eval()
    assert composed.peft_config["composed"].modules_to_save == ["classifier"]
    with torch.no_grad():
        expected = reference(x).logits
        assert not torch.allclose(expected, tiny_bert()(x).logits, atol=1e-3)
        torch.testing.assert_close(composed(x).logits, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(composed.merge_and_unload()(x).logits, expected, rtol=1e-5, atol=1e-6)
    task.save_pretrained(tmp_path / "task2")
    with pytest.raises(ValueError, match="compose at most one adapter with heads"):
        compose(tiny_bert(), [tmp_path / "task", tmp_path / "task2"])


def test_adding_a_frozen_adapter_leaves_the_others_trainability_alone(tmp_path):
    """The cross-lingual order of the docs — a language, the stack, a second language — keeps the first language
    frozen: only the task trains, LTSFTCallback finds the one trainable LT-SFT adapter, and the Trainer's optimizer
    holds the task's values alone (the languages' values end the run unchanged)."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from peft_sparse import LTSFTCallback

    en, de = _language_adapter(tmp_path / "en", 1), _language_adapter(tmp_path / "de", 2)
    model = _task_model()
    add_frozen_adapter(model, en, "en")
    stack(model, under=["en"], trainable="task")
    task_only = {n for n, p in model.named_parameters() if p.requires_grad}
    assert task_only and all(".task" in n for n in task_only)
    add_frozen_adapter(model, de, "de")
    assert {n for n, p in model.named_parameters() if p.requires_grad} == task_only
    assert model.active_adapters == ["en", "task"]
    languages = {(i, n): l.sparse_values[n].detach().clone() for i, l in enumerate(sparse_layers(model)) for n in ("en", "de")}
    # load_sparse_adapter beside a PeftModel keeps the others as they were too
    from peft_sparse import load_sparse_adapter

    load_sparse_adapter(model, de, adapter_name="de_again")
    assert {n for n, p in model.named_parameters() if p.requires_grad} == task_only
    model.delete_adapter("de_again")

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (16, 10), generator=g).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids, "attention_mask": [[1] * 10] * 16})
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-2,
                             report_to="none", use_cpu=True, save_strategy="no", lr_scheduler_type="constant")  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[LTSFTCallback()])
    trainer.train()
    assert model.peft_config["task"].phase == "sparse"
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in in_optimizer}
    assert names and all(".task" in n for n in names)
    for (i, n), before in languages.items():
        assert torch.equal(sparse_layers(model)[i].sparse_values[n], before), (i, n)
