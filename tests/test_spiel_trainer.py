"""SpIEL through transformers.Trainer and TRL's SFTTrainer: callback, logging, checkpoints, exact resume."""

import pytest
import torch
from datasets import Dataset
from peft import PeftModel, get_peft_model
from transformers import Trainer, TrainerCallback, TrainingArguments

from peft_sparse import SpIELCallback, SpIELConfig, SparseLayer
from peft_sparse.schedules.reselection import is_reselection_step

from .models import tiny_llama, tiny_tokenizer

S, GAMMA = 5, 2


def _dataset(n=48, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (n, length), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist(), "attention_mask": [[1] * length] * n})


def _model(dropout=0.1):
    base = tiny_llama()
    base.config.attention_dropout = dropout
    for layer in base.model.layers:
        layer.self_attn.attention_dropout = dropout
    config = SpIELConfig(target_modules="all-linear", density=0.1, reselection_steps=S, gradient_estimation_steps=GAMMA)
    return get_peft_model(base, config)


def _args(tmp_path, max_steps, **kwargs):
    kwargs.setdefault("save_strategy", "no")
    return TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=max_steps,
        learning_rate=1e-2, logging_steps=1, report_to="none", use_cpu=True, seed=0, dataloader_num_workers=0, **kwargs,
    )  # fmt: skip


class _StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def _snapshot(trainer):
    model = trainer.model
    layers = [m for m in model.modules() if isinstance(m, SparseLayer)]
    opt = trainer.optimizer
    params = [l.sparse_values["default"] for l in layers]
    return {
        "values": [p.detach().clone() for p in params],
        "indices": [l.sparse_indices["default"].clone() for l in layers],
        "ages": [l.sparse_ages["default"].clone() for l in layers],
        "exp_avg": [opt.state[p]["exp_avg"].clone() for p in params],
        "exp_avg_sq": [opt.state[p]["exp_avg_sq"].clone() for p in params],
        "step": [float(opt.state[p]["step"]) for p in params],
    }


def _spiel_callback(trainer):
    return next(c for c in trainer.callback_handler.callbacks if isinstance(c, SpIELCallback))


def test_trainer_with_accumulation_reselects_on_schedule_and_logs(tmp_path):
    T = 13
    model = _model(dropout=0.0)
    before = [m.sparse_indices["default"].clone() for m in model.modules() if isinstance(m, SparseLayer)]
    trainer = Trainer(model=model, args=_args(tmp_path, T), train_dataset=_dataset(), callbacks=[SpIELCallback()])
    trainer.train()
    logged = [h for h in trainer.state.log_history if "spiel/replaced" in h]
    expected_steps = [s for s in range(1, T + 1) if is_reselection_step(s, S, GAMMA, T)]
    assert [h["step"] for h in logged] == [h["spiel/step"] for h in logged] == expected_steps == [2, 7, 12]
    assert all({"spiel/fraction_changed", "spiel/mean_age_dropped", "spiel/mean_age_kept"} <= set(h) for h in logged)
    assert "loss" in logged[0]
    layers = [m for m in model.modules() if isinstance(m, SparseLayer)]
    assert any(not torch.equal(b, l.sparse_indices["default"]) for b, l in zip(before, layers))
    assert _spiel_callback(trainer).scheduler.t == T
    assert all(l.dense_grad_consumer is None for l in layers)
    ages = torch.cat([l.sparse_ages["default"] for l in layers])
    assert set(ages.unique().tolist()) <= {2, 7, 12}

    model.save_pretrained(tmp_path / "adapter", save_ages=True)
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path / "adapter")
    for a, b in zip(layers, (m for m in loaded.modules() if isinstance(m, SparseLayer))):
        assert torch.equal(a.sparse_indices["default"], b.sparse_indices["default"])
        assert torch.equal(a.sparse_ages["default"], b.sparse_ages["default"])
        assert b.sparse_ages["default"].dtype == torch.int32


@pytest.mark.parametrize("stop", [6, 7], ids=["inside-window", "right-after-reselection"])
def test_resume_is_bit_identical(stop, tmp_path):
    # the window of the reselection at step 7 is steps 6–7: stopping after 6 cuts inside it; stopping after
    # 7 leaves the grown slots' moment seeds waiting for step 8
    T = 14
    assert is_reselection_step(7, S, GAMMA, T)

    full = Trainer(model=_model(), args=_args(tmp_path / "full", T), train_dataset=_dataset(), callbacks=[SpIELCallback()])
    full.train()
    want = _snapshot(full)
    want_t = _spiel_callback(full).scheduler.t

    first = Trainer(
        model=_model(), args=_args(tmp_path / "cut", T, save_strategy="steps", save_steps=stop),
        train_dataset=_dataset(), callbacks=[SpIELCallback(), _StopAt(stop)],
    )  # fmt: skip
    first.train()
    assert first.state.global_step == stop
    saved = tmp_path / "cut" / f"checkpoint-{stop}"
    assert (saved / "spiel_scheduler.json").is_file() and (saved / "spiel_scheduler.safetensors").is_file()
    import json

    saved_state = json.loads((saved / "spiel_scheduler.json").read_text())
    assert saved_state["t"] == stop
    from safetensors.torch import load_file

    saved_tensors = load_file(saved / "spiel_scheduler.safetensors")
    # the ages travel in the scheduler's state, not in the checkpoint's adapter file
    assert not any("sparse_ages" in k for k in load_file(saved / "adapter_model.safetensors"))
    layers = [m for m in first.model.modules() if isinstance(m, SparseLayer)]
    assert all(torch.equal(saved_tensors[f"ages::{l.module_name}::ages"], l.sparse_ages["default"]) for l in layers)
    if stop == 6:
        assert saved_state["armed"] and any(k.startswith("statistics::") for k in saved_tensors)
    else:
        assert not saved_state["armed"] and any(k.startswith("pending_seeds::") for k in saved_tensors)

    resumed = Trainer(model=_model(), args=_args(tmp_path / "cut", T), train_dataset=_dataset(), callbacks=[SpIELCallback()])
    resumed.train(resume_from_checkpoint=True)
    _assert_same(want, _snapshot(resumed))
    assert _spiel_callback(resumed).scheduler.t == want_t == T
    if stop != 6:
        return
    # resumed from that checkpoint's path by a run writing elsewhere, whose output folder already holds a
    # checkpoint of that step from another run (a decoy): the state saved with the resumed checkpoint is found
    import shutil

    decoy = tmp_path / "elsewhere" / f"checkpoint-{stop}"
    other = Trainer(
        model=_model(dropout=0.0), args=_args(tmp_path / "elsewhere", T, save_strategy="steps", save_steps=stop),
        train_dataset=_dataset(), callbacks=[SpIELCallback(), _StopAt(stop)],
    )  # fmt: skip
    other.train()
    assert (decoy / "spiel_scheduler.json").is_file()
    resumed = Trainer(model=_model(), args=_args(tmp_path / "elsewhere", T), train_dataset=_dataset(), callbacks=[SpIELCallback()])
    resumed.train(resume_from_checkpoint=str(saved))
    _assert_same(want, _snapshot(resumed))
    # a checkpoint copied elsewhere without its scheduler state: a clear error, not a decoy's state
    copied = tmp_path / "copied"
    shutil.copytree(saved, copied)
    for name in ("spiel_scheduler.json", "spiel_scheduler.safetensors", "spiel_checkpoint.json"):
        (copied / name).unlink()
    shutil.rmtree(saved)
    resumed = Trainer(model=_model(), args=_args(tmp_path / "elsewhere", T), train_dataset=_dataset(), callbacks=[SpIELCallback()])
    with pytest.raises(FileNotFoundError, match="SpIELCallback: the scheduler state saved with the checkpoint being resumed"):
        resumed.train(resume_from_checkpoint=str(copied))


def _assert_same(want: dict, got: dict) -> None:
    for key in want:
        for a, b in zip(want[key], got[key]):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), key
            else:
                assert a == b, key


def test_trl_sft_trainer_with_accumulation(tmp_path):
    from trl import SFTConfig, SFTTrainer

    T = 8
    base = tiny_llama()
    data = Dataset.from_dict({"input_ids": _dataset()["input_ids"]})
    args = SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=T,
        learning_rate=1e-2, logging_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
        dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False,
    )  # fmt: skip
    config = SpIELConfig(target_modules="all-linear", density=0.1, reselection_steps=S, gradient_estimation_steps=GAMMA)

    def collate(rows):
        ids = torch.tensor([r["input_ids"] for r in rows])
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}

    trainer = SFTTrainer(
        model=base, args=args, train_dataset=data, peft_config=config, callbacks=[SpIELCallback()],
        data_collator=collate, processing_class=tiny_tokenizer(),
    )  # fmt: skip
    trainer.train()
    logged = [h["step"] for h in trainer.state.log_history if "spiel/replaced" in h]
    assert logged == [2, 7]
    layers = [m for m in trainer.model.modules() if isinstance(m, SparseLayer)]
    assert all(l.sparse_values["default"].dtype == torch.float32 for l in layers)
    assert any((l.sparse_ages["default"] == 7).any() for l in layers)


def test_trainer_spiel_ma_with_sm3_selected_through_optimizer_cls_and_kwargs(tmp_path):
    from peft_sparse import SM3

    base = tiny_llama()
    model = get_peft_model(
        base, SpIELConfig(target_modules="all-linear", density=0.1, growth="ma", reselection_steps=S, gradient_estimation_steps=GAMMA)
    )
    trainer = Trainer(
        model=model, args=_args(tmp_path, 8), train_dataset=_dataset(), callbacks=[SpIELCallback()],
        optimizer_cls_and_kwargs=(SM3, {"lr": 0.05, "weight_decay": 0.3}),
    )  # fmt: skip
    trainer.train()
    assert isinstance(_spiel_callback(trainer).scheduler.optimizer, SM3)
    assert [h["step"] for h in trainer.state.log_history if "spiel/replaced" in h] == [2, 7]
    assert all(l.dense_grad_count == 0 for l in model.modules() if isinstance(l, SparseLayer))


@pytest.mark.parametrize("T, full", [(13, False), (23, True)])
def test_trainer_block_ma_defaults_resolve_for_the_trainers_max_steps(T, full, tmp_path):
    """Block SpIEL-MA as configured by default through Trainer: the callback's scheduler ranks growth by the windows'
    input/output sums and resolves first_full_replacement='auto' for max_steps (S = 5, γ = 2: reselections at 2, 7,
    12, 17, 22; four follow the first at T = 23, two at T = 13), so the first logged reselection replaces every block
    only at T = 23; no window's consumer is left on a layer."""
    from peft_sparse import SM3

    config = SpIELConfig(target_modules=["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], density=0.5,
                         growth="ma", block_shape=(16, 16), initial_reselection_rate=0.5, reselection_steps=S,
                         gradient_estimation_steps=GAMMA)  # fmt: skip
    model = get_peft_model(tiny_llama(hidden_size=64, intermediate_size=128), config)
    layers = [m for m in model.modules() if isinstance(m, SparseLayer)]
    d_phi = sum(l.sparse_values["default"].numel() for l in layers)
    trainer = Trainer(
        model=model, args=_args(tmp_path, T), train_dataset=_dataset(), callbacks=[SpIELCallback()],
        optimizer_cls_and_kwargs=(SM3, {"lr": 0.05}),
    )  # fmt: skip
    trainer.train()
    scheduler = _spiel_callback(trainer).scheduler
    assert scheduler.config.ma_signal == "io" and scheduler.first_full == full
    logged = [h for h in trainer.state.log_history if "spiel/replaced" in h]
    assert [h["step"] for h in logged] == [s for s in range(1, T + 1) if is_reselection_step(s, S, GAMMA, T)]
    assert (logged[0]["spiel/replaced"] == d_phi) == full and 0 < logged[0]["spiel/replaced"]
    assert all(l.dense_grad_consumer is None and l.dense_grad_count == 0 for l in layers)
