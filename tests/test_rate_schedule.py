"""The learning-rate schedule of a SpIEL run: the warning when the rate has not decayed by the middle of the run
(plain loop and Trainer), and weight_decay 'auto' for each schedule."""

import warnings

import pytest
import torch
from datasets import Dataset
from peft import get_peft_model
from transformers import Trainer, TrainingArguments, get_scheduler

from peft_sparse import SpIELCallback, SpIELConfig, SpIELScheduler
from peft_sparse.schedules.weight_decay import auto_weight_decay, schedule_mean_rate

from .models import inputs, tiny_llama

MESSAGE = "has not decayed by the middle of the run"


def _spiel():
    config = SpIELConfig(target_modules="all-linear", density=0.05, reselection_steps=6, gradient_estimation_steps=2)
    return get_peft_model(tiny_llama(), config)


def _train(model, optimizer, scheduler, steps, lr_schedule=None, after_step=None) -> list:
    """``steps`` plain-loop steps (optimizer, LR schedule, SpIEL scheduler); the step numbers at which the warning came."""
    model.train()
    fired = []
    for step in range(1, steps + 1):
        x = inputs(seed=step, batch=4, length=8)
        model(x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if lr_schedule is not None:
            lr_schedule.step()
        if after_step is not None:
            after_step(step)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scheduler.step()
        fired += [step for w in caught if MESSAGE in str(w.message)]
    return fired


def test_a_constant_rate_warns_once_at_the_middle_of_the_run():
    model = _spiel()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    assert _train(model, opt, SpIELScheduler(model, opt, total_steps=20), 20) == [10]
    # warm-up then constant: the rate has not decayed either
    model = _spiel()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    warm = get_scheduler("constant_with_warmup", opt, num_warmup_steps=3, num_training_steps=21)
    assert _train(model, opt, SpIELScheduler(model, opt, total_steps=21), 21, warm) == [11]


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_a_decaying_rate_never_warns(kind):
    model = _spiel()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    schedule = get_scheduler(kind, opt, num_warmup_steps=2, num_training_steps=20)
    assert _train(model, opt, SpIELScheduler(model, opt, total_steps=20), 20, schedule) == []


def test_a_rate_decayed_by_hand_never_warns_and_short_or_resumed_runs_are_not_checked():
    model = _spiel()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    def by_hand(step):  # (no torch LR scheduler: the loop sets the rate itself)
        for group in opt.param_groups:
            group["lr"] = 1e-2 * (1 - step / 20)

    assert _train(model, opt, SpIELScheduler(model, opt, total_steps=20), 20, after_step=by_hand) == []
    model = _spiel()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    assert _train(model, opt, SpIELScheduler(model, opt, total_steps=9), 9) == []  # (a smoke run)
    # resumed past the middle at a constant rate: the peak before the resume is unknown, nothing said
    model = _spiel()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    first = SpIELScheduler(model, opt, total_steps=20)
    _train(model, opt, first, 12)
    state = first.state_dict()
    first.close()
    opt2 = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    resumed = SpIELScheduler(model, opt2, total_steps=20)
    resumed.load_state_dict(state)
    assert _train(model, opt2, resumed, 8) == []


def _dataset(n=96, length=10):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (n, length), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist(), "attention_mask": [[1] * length] * n})


@pytest.mark.parametrize("kind, expected", [("constant", 1), ("constant_with_warmup", 1), ("linear", 0), ("cosine", 0)])
def test_the_trainer_callback_warns_once_at_a_constant_rate(tmp_path, kind, expected):
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=16, learning_rate=1e-2, lr_scheduler_type=kind,
        warmup_steps=2, logging_steps=4, report_to="none", use_cpu=True, seed=0, save_strategy="no", dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(model=_spiel(), args=args, train_dataset=_dataset(), callbacks=[SpIELCallback()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    hits = [w for w in caught if MESSAGE in str(w.message)]
    assert len(hits) == expected
    if hits:
        assert "step 8 of 16" in str(hits[0].message) and "lr_scheduler_type='linear'" in str(hits[0].message)


# ------------------------------------------------------------------------------------------- weight_decay 'auto'
def test_auto_weight_decay_keeps_linear_values_and_halves_for_a_constant_rate():
    for lr in (2e-4, 5e-4, 1e-3, 3e-3):
        for steps in (60, 150, 333, 334, 600, 1000):
            linear = min(3.0, 1.0 / (lr * steps))
            assert auto_weight_decay(lr, steps) == linear == auto_weight_decay(lr, steps, "linear", warmup_steps=5)
            assert auto_weight_decay(lr, steps, "cosine", 5) == linear
            assert auto_weight_decay(lr, steps, "constant") == pytest.approx(linear / 2)
            assert auto_weight_decay(lr, steps, "constant_with_warmup", 10) == pytest.approx(linear / (2 - 10 / steps))
    assert auto_weight_decay(1e-3, 150, "constant") == pytest.approx(1.5)
    with pytest.raises(ValueError, match="schedule='inverse_sqrt'"):
        auto_weight_decay(1e-3, 150, "inverse_sqrt")
    for bad in (-1, 151, 2.5, True):
        with pytest.raises(ValueError, match="warmup_steps"):
            auto_weight_decay(1e-3, 150, "constant_with_warmup", bad)


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant", "constant_with_warmup"])
def test_auto_weight_decay_gives_every_schedule_the_total_shrink_of_linear_decay(kind):
    """λ·Σ lr_t, the exponent of the values' shrink e^(−λ·Σ lr_t), is the same for each schedule as for linear decay
    (transformers' own schedules, summed over the run's steps); the mean rates m are those of the schedules."""
    lr, steps, warmup = 1e-3, 150, 5

    def rate_sum(name):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        schedule = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=steps)
        total = 0.0
        for _ in range(steps):
            total += opt.param_groups[0]["lr"]
            opt.step()
            schedule.step()
        return total

    assert rate_sum(kind) == pytest.approx(schedule_mean_rate(kind, steps, warmup if kind != "constant" else 0) * lr * steps, rel=0.01)
    shrink = auto_weight_decay(lr, steps, kind, warmup if kind != "constant" else 0) * rate_sum(kind)
    assert shrink == pytest.approx(auto_weight_decay(lr, steps) * rate_sum("linear"), rel=0.01)


def test_a_recipe_s_auto_weight_decay_follows_its_schedule():
    from peft_sparse.recipe import build_training_args

    base = {"output_dir": "/tmp/x", "max_steps": 150, "learning_rate": 1e-3, "weight_decay": "auto", "use_cpu": True}
    assert build_training_args(base).weight_decay == 3.0
    assert build_training_args({**base, "lr_scheduler_type": "constant"}).weight_decay == pytest.approx(1.5)
    ratio = build_training_args({**base, "lr_scheduler_type": "constant_with_warmup", "warmup_steps": 0.1}).weight_decay
    assert ratio == pytest.approx(3.0 / (2 - 15 / 150))
    with pytest.raises(ValueError, match="lr_scheduler_type='inverse_sqrt'.*give the weight decay as a number"):
        build_training_args({**base, "lr_scheduler_type": "inverse_sqrt"})
