"""SpIEL-AG under DeepSpeed ZeRO stages 2 and 3 (two CPU processes, gloo): the optimizer state a reselection edits
is partitioned over the ranks (stage 3: the values and the base weights too); 2 processes × batch 2 must choose the
same indices as 1 process × batch 4 without DeepSpeed, with the same values up to the order of the gradient sums."""

import contextlib
import os
import socket
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

deepspeed = pytest.importorskip("deepspeed")

STEPS, BATCH, LENGTH = 10, 2, 12  # reselections at t = 2 and 6 (S = 4, γ = 2; none in the last S steps)
VALUES_TOLERANCE = 1e-6  # the averaged gradient is summed in another order (reduce-scatter vs one backward)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(**fields):
    from peft_sparse import SpIELConfig

    base = dict(target_modules="all-linear", density=0.1, reselection_steps=4, gradient_estimation_steps=2)
    base.update(fields)
    return SpIELConfig(**base)


def _batch(step: int, rows: slice):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 97, (2 * BATCH, LENGTH), generator=g)[rows]


def _snapshot(model) -> dict:
    from peft_sparse import SparseLayer

    layers = [m for m in model.modules() if isinstance(m, SparseLayer)]
    return {
        "indices": [m.sparse_indices["default"].clone() for m in layers],
        "values": [m.sparse_values["default"].detach().clone() for m in layers],
    }


def _ds_config(stage: int, clip: float = 0.0) -> dict:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        # (persistence threshold 0: every values tensor partitioned under stage 3, as in a real model)
        "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if clip else {})},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": clip,
    }


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def _zero_worker(rank: int, world: int, port: int, out_dir: str, stage: int, merge: bool, growth: str = "ag", clip: float = 0.0) -> None:
    from peft import get_peft_model

    from peft_sparse import SpIELScheduler
    from tests.models import tiny_llama

    _init(rank, world, port)
    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(), _config(training_merge=merge, growth=growth))
    params = [p for p in model.parameters() if p.requires_grad]
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=1e-2), config=_ds_config(stage, clip))
    scheduler = SpIELScheduler(model, optimizer, total_steps=STEPS)
    engine.train()
    reports = []
    for step in range(1, STEPS + 1):
        x = _batch(step, slice(rank * BATCH, (rank + 1) * BATCH))  # this rank's half of the global batch
        engine.backward(engine(x, labels=x).loss)
        engine.step()
        reports.append(scheduler.step())
    if stage == 3:  # (the values are partitioned: whole for the snapshot)
        with deepspeed.zero.GatheredParameters([m.sparse_values["default"] for m in scheduler.layers]):
            snapshot = _snapshot(model)
    else:
        snapshot = _snapshot(model)
    torch.save({**snapshot, "reports": reports}, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()
    os._exit(0)


def _one_process_reference(growth: str = "ag", clip: float = 0.0) -> dict:
    from peft import get_peft_model

    from peft_sparse import SpIELScheduler
    from tests.models import tiny_llama

    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(), _config(growth=growth))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    scheduler = SpIELScheduler(model, optimizer, total_steps=STEPS)
    model.train()
    reports = []
    for step in range(1, STEPS + 1):
        x = _batch(step, slice(0, 2 * BATCH))
        model(x, labels=x).loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        optimizer.zero_grad()
        reports.append(scheduler.step())
    return {**_snapshot(model), "reports": reports}


@pytest.mark.parametrize("stage, merge, growth", [(2, False, "ag"), (3, False, "ag"), (2, True, "ag"), (3, True, "ag"),
                                                  (2, False, "ma"), (3, False, "ma"), (3, "clip", "ma")],
                         ids=["zero2", "zero3", "zero2-training-merge", "zero3-training-merge", "zero2-ma-adamw", "zero3-ma-adamw",
                              "zero3-ma-adamw-clipped"])  # fmt: skip
def test_zero_two_processes_select_the_indices_of_one_process_at_twice_the_batch(stage, merge, growth):
    """(training_merge=True: off under ZeRO — it writes the values by collectives that leave their version counter
    unchanged, and under stage 3 shards the base — so the results are those of the default path. growth='ma' beside
    AdamW: the scheduler's row and column accumulators from the gradients ZeRO reduced, at the start of its step;
    "clip": with gradient clipping that binds, every values tensor partitioned — clipped as ZeRO's step clips.)"""
    clip = 0.05 if merge == "clip" else 0.0
    merge = merge is True
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_zero_worker, args=(2, _free_port(), out_dir, stage, merge, growth, clip), nprocs=2, join=True)
        r0 = torch.load(os.path.join(out_dir, "rank0.pt"))
        r1 = torch.load(os.path.join(out_dir, "rank1.pt"))
    ref = _one_process_reference(growth, clip)
    assert [t for t, r in enumerate(ref["reports"], 1) if r] == [2, 6]  # the first a full replacement
    assert [bool(r) for r in r0["reports"]] == [bool(r) for r in ref["reports"]]
    for a, b, c in zip(r0["indices"], r1["indices"], ref["indices"]):
        assert torch.equal(a, b) and torch.equal(a, c)
    for a, b, c in zip(r0["values"], r1["values"], ref["values"]):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, atol=VALUES_TOLERANCE, rtol=0)
    assert any(bool((v != 0).any()) for v in ref["values"])



def _bf16_worker(rank: int, world: int, port: int, out_dir: str, stage: int) -> None:
    from deepspeed.utils import safe_get_full_fp32_param
    from peft import get_peft_model

    from peft_sparse import SpIELScheduler
    from tests.models import tiny_llama

    _init(rank, world, port)
    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(), _config())  # (values_dtype float32: the engine casts them to bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    config = {**_ds_config(stage), "bf16": {"enabled": True}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=1e-2), config=config)
    scheduler = SpIELScheduler(model, optimizer, total_steps=STEPS)
    reports = []
    for step in range(1, STEPS + 1):
        x = _batch(step, slice(rank * BATCH, (rank + 1) * BATCH))
        engine.backward(engine(x, labels=x).loss)
        engine.step()
        reports.append(scheduler.step())
    values = [m.sparse_values["default"] for m in scheduler.layers]
    masters = [safe_get_full_fp32_param(v).detach().cpu() for v in values]  # (a collective: every rank)
    gathered = deepspeed.zero.GatheredParameters(values) if stage == 3 else contextlib.nullcontext()
    with gathered:
        snapshot = _snapshot(model)
    torch.save({**snapshot, "masters": masters, "reports": reports}, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()
    os._exit(0)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_bf16_casts_the_values_and_keeps_their_float32_masters(stage):
    """DeepSpeed's bf16 mode casts every trainable parameter, values included, and keeps their float32 masters in
    its optimizer: training runs (the cast loses nothing, so it is not refused), reselects on schedule, both ranks
    hold the same indices and values, each value is its master rounded to bfloat16 after the reselections, and the
    masters of kept weights keep their full precision (the reselection writes masters only where slots changed)."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_bf16_worker, args=(2, _free_port(), out_dir, stage), nprocs=2, join=True)
        r0 = torch.load(os.path.join(out_dir, "rank0.pt"))
        r1 = torch.load(os.path.join(out_dir, "rank1.pt"))
    assert [t for t, r in enumerate(r0["reports"], 1) if r] == [2, 6]
    for a, b in zip(r0["indices"], r1["indices"]):
        assert torch.equal(a, b)
    for a, b, master in zip(r0["values"], r1["values"], r0["masters"]):
        assert a.dtype == torch.bfloat16 and master.dtype == torch.float32
        assert torch.equal(a, b) and torch.equal(a, master.to(torch.bfloat16))
    masters = torch.cat(r0["masters"])
    assert bool((masters != masters.to(torch.bfloat16).float()).any())  # (finer than bfloat16: not overwritten by it)


def _refusal_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from peft import get_peft_model

    from peft_sparse import SM3, AgedAdamW, SpIELScheduler
    from tests.models import tiny_llama

    _init(rank, world, port)
    outcomes = {}
    cases = (("ma", dict(growth="ma")), ("adaptive", dict(budget_split="adaptive")), ("authors", dict(reference="authors")), ("aged", {}))
    for name, fields in cases:
        torch.manual_seed(0)
        model = get_peft_model(tiny_llama(), _config(**fields))
        params = [p for p in model.parameters() if p.requires_grad]
        opt = {"ma": SM3, "authors": AgedAdamW, "aged": AgedAdamW}.get(name, torch.optim.AdamW)(params, lr=1e-2)
        _, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=_ds_config(2))
        try:
            SpIELScheduler(model, optimizer, total_steps=STEPS)
            outcomes[name] = "created"
        except (ValueError, NotImplementedError, TypeError) as error:
            outcomes[name] = f"{type(error).__name__}: {error}"
    torch.manual_seed(0)  # a scheduler made before deepspeed.initialize holds the optimizer's old parameters
    model = get_peft_model(tiny_llama(), _config())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    early = SpIELScheduler(model, opt, total_steps=STEPS)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=_ds_config(2))
    try:
        for step in (1, 2):
            x = _batch(step, slice(0, BATCH))
            engine.backward(engine(x, labels=x).loss)
            engine.step()
            early.step()
        outcomes["early"] = "ran"
    except ValueError as error:
        outcomes["early"] = str(error)
    torch.save(outcomes, os.path.join(out_dir, "refusals.pt"))
    os._exit(0)


def test_what_zero_cannot_follow_is_refused_by_name():
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_refusal_worker, args=(1, _free_port(), out_dir), nprocs=1, join=True)
        outcomes = torch.load(os.path.join(out_dir, "refusals.pt"))
    assert "growth='ma'" in outcomes["ma"] and "SM3" in outcomes["ma"]
    assert "budget_split='adaptive'" in outcomes["adaptive"]
    assert "reference='authors' does not run under DeepSpeed ZeRO" in outcomes["authors"]
    assert "AgedAdamW does not run under DeepSpeed ZeRO" in outcomes["aged"]
    assert "at step 2 the optimizer no longer holds" in outcomes["early"] and "after accelerator.prepare" in outcomes["early"]



def _recipe_deepspeed(stage: int) -> str:
    """A recipe's `training.deepspeed` entry (TRL's SFTConfig field) for ZeRO ``stage``."""
    return (f"deepspeed: {{zero_optimization: {{stage: {stage}, stage3_gather_16bit_weights_on_model_save: true}}, "
            "train_micro_batch_size_per_gpu: auto, gradient_accumulation_steps: auto, zero_allow_untested_optimizer: true, "
            "gradient_clipping: auto}")  # fmt: skip


def _assert_same_adapter(a_dir, b_dir) -> None:
    """Two runs' adapter files: the same keys and indices, values within VALUES_TOLERANCE."""
    from safetensors.torch import load_file

    a, b = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (a_dir, b_dir))
    assert a.keys() == b.keys() and any(k.endswith("sparse_values") for k in a)
    for key in a:
        if key.endswith("sparse_values"):
            torch.testing.assert_close(a[key], b[key], atol=VALUES_TOLERANCE, rtol=0)
        else:
            assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("stage, growth", [(2, "ag"), (3, "ag"), (2, "ma")], ids=["zero2", "zero3", "zero2-ma-adamw"])
def test_peft_sparse_train_under_zero_writes_the_adapter_of_one_process(stage, growth, tmp_path):
    """`peft-sparse train` with `training.deepspeed` (ZeRO-2 or -3) under torchrun: SFTTrainer + SpIELCallback
    reselect on schedule, and the first process writes the adapter of a one-process run at the same global batch
    (indices equal, values within VALUES_TOLERANCE) — under ZeRO-3 from the partitioned values. SpIEL-MA beside
    AdamW with gradient clipping that binds (max_grad_norm 0.05, which ZeRO applies inside its step): the
    accumulators see the clipped gradients, as in one process."""
    import json

    from peft import PeftModel

    from tests.models import tiny_llama
    from tests.test_distributed import _tiny_recipe, _train_cli

    ds = _recipe_deepspeed(stage)
    method = ", growth: ma" if growth == "ma" else ""
    optim = ", optim: adamw_torch, max_grad_norm: 0.05" if growth == "ma" else ""
    recipe = _tiny_recipe(tmp_path, "zero", f"max_steps: 8, per_device_train_batch_size: 4, save_strategy: 'no'{optim}, {ds}", method)
    run = _train_cli(recipe, processes=2)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "zero" / "summary.json").read_text())
    assert summary["engine"] == f"deepspeed-zero{stage}" and summary["world_size"] == 2
    assert summary["reselection_steps"] == [2, 6]
    # (a ZeRO-3 model generates only with every rank taking part: the first process scores the saved adapter on the
    # base model loaded again; its replies are those of the adapter loaded here)
    from peft_sparse.assets import load_model_and_tokenizer
    from peft_sparse.evaluation import exact_match
    from peft_sparse.recipe import read_rows

    base, tokenizer = load_model_and_tokenizer(str(tmp_path / "model"))
    rows = read_rows(str(tmp_path / "test.jsonl"))
    assert summary["before"]["replies"] == [r["reply"] for r in exact_match(base, tokenizer, rows, max_new_tokens=2, batch_size=8)["items"]]
    reloaded = PeftModel.from_pretrained(base, tmp_path / "zero" / "adapter")
    assert summary["after"]["replies"] == [r["reply"] for r in exact_match(reloaded, tokenizer, rows, max_new_tokens=2, batch_size=8)["items"]]
    assert summary["after"]["replies"] != summary["before"]["replies"]
    one = _tiny_recipe(tmp_path, "one", f"max_steps: 8, per_device_train_batch_size: 8, save_strategy: 'no'{optim}", method)
    run = _train_cli(one)
    assert run.returncode == 0, run.stderr[-3000:]
    _assert_same_adapter(tmp_path / "zero", tmp_path / "one")
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path / "zero" / "adapter")
    assert loaded.peft_config["default"].peft_type == "SPIEL"


@pytest.mark.parametrize("stage", [2, 3])
def test_a_zero_checkpoint_resumes_the_scheduler_exactly(stage, tmp_path):
    """`peft-sparse train` under ZeRO with 2 processes saves a sharded checkpoint at step 4 (DeepSpeed's partitions
    plus the scheduler's state); a second run resumes from it and reselects at step 6 as scheduled, ending with the
    adapter of an uninterrupted run."""
    import json

    from tests.test_distributed import _tiny_recipe, _train_cli

    ds = _recipe_deepspeed(stage)
    whole = _tiny_recipe(tmp_path, "whole", f"max_steps: 8, per_device_train_batch_size: 4, save_strategy: steps, save_steps: 4, {ds}")
    run = _train_cli(whole, processes=2)
    assert run.returncode == 0, run.stderr[-3000:]
    checkpoint = tmp_path / "whole" / "checkpoint-4"
    assert any(p.name.startswith("global_step") for p in checkpoint.iterdir())  # (DeepSpeed's sharded state)
    resumed = _tiny_recipe(tmp_path, "resumed", f"max_steps: 8, per_device_train_batch_size: 4, save_strategy: 'no', resume_from_checkpoint: {checkpoint}, {ds}")
    run = _train_cli(resumed, processes=2)
    assert run.returncode == 0, "\n".join(l for l in run.stderr.splitlines() if "rror" in l)[-3000:]
    assert json.loads((tmp_path / "resumed" / "summary.json").read_text())["reselection_steps"] == [2, 6]  # (2: from the checkpoint)
    _assert_same_adapter(tmp_path / "whole", tmp_path / "resumed")


@pytest.mark.parametrize("stage", [2, 3])
def test_peft_sparse_train_under_zero_bf16_accepts_deepspeeds_cast(stage, tmp_path):
    """`peft-sparse train` with `bf16: true` under ZeRO-2 and -3: DeepSpeed's bf16 engine casts the float32 values to
    bfloat16 and keeps their float32 masters; training runs and reselects on schedule (this once failed on two GPUs:
    the layers refused the cast), and the adapter file it writes (ZeRO-3: from its consolidated state dict) is in the
    config's values_dtype and loads."""
    import json

    from peft import PeftModel

    from tests.models import tiny_llama
    from tests.test_distributed import _tiny_recipe, _train_cli

    recipe = _tiny_recipe(tmp_path, "zero", f"max_steps: 8, per_device_train_batch_size: 4, save_strategy: 'no', {_recipe_deepspeed(stage)}")
    text = recipe.read_text()
    assert "bf16: false" in text
    recipe.write_text(text.replace("bf16: false", "bf16: true"))
    run = _train_cli(recipe, processes=2)
    assert run.returncode == 0, "\n".join(l for l in run.stderr.splitlines() if "rror" in l)[-3000:]
    summary = json.loads((tmp_path / "zero" / "summary.json").read_text())
    assert summary["engine"] == f"deepspeed-zero{stage}" and summary["reselection_steps"] == [2, 6]
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path / "zero" / "adapter")
    assert any(bool((p != 0).any()) for n, p in loaded.named_parameters() if n.endswith("sparse_values.default"))
