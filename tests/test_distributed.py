"""SpIEL under torch.distributed (DDP and FSDP2, two CPU processes, gloo): the same indices on every rank."""

import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _save_adapter_and_exit(model, path: str) -> None:
    """A worker's end: its layers' indices and values to ``path``, then every rank leaves together, without running
    destructors (tearing down DDP's reducer after the process group is gone occasionally blocked a worker at exit;
    the results are already on disk)."""
    from peft_sparse import SparseLayer

    layers = [m for m in model.modules() if isinstance(m, SparseLayer)]
    torch.save(
        {"indices": [l.sparse_indices["default"] for l in layers], "values": [l.sparse_values["default"].detach() for l in layers]},
        path,
    )
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _worker(rank: int, world: int, port: int, growth: str, out_dir: str) -> None:
    from peft import get_peft_model
    from torch.nn.parallel import DistributedDataParallel as DDP

    from peft_sparse import SM3, AgedAdamW, SpIELConfig, SpIELScheduler
    from tests.models import tiny_llama

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    reference = "authors" if growth.endswith("-authors") else None
    config = SpIELConfig(target_modules="all-linear", density=0.1, growth=growth[:2], reselection_steps=4, gradient_estimation_steps=2,
                         reference=reference)  # fmt: skip
    model = get_peft_model(tiny_llama(), config)
    # no buffer broadcast: identical indices must come from identical selections, not from rank 0
    ddp = DDP(model, broadcast_buffers=False)
    params = [p for p in model.parameters() if p.requires_grad]
    if growth == "ag-authors":  # (its seeds, from micro-batch squares, must agree across ranks too)
        opt = AgedAdamW(params, lr=1e-2)
    else:
        opt = torch.optim.AdamW(params, lr=1e-2) if growth in ("ag", "ma-adamw") else SM3(params, lr=0.05)
    scheduler = SpIELScheduler(ddp, opt, total_steps=11)
    g = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    ddp.train()
    for _ in range(11):
        x = torch.randint(0, 97, (4, 12), generator=g)
        ddp(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
    _save_adapter_and_exit(model, os.path.join(out_dir, f"rank{rank}.pt"))


# (ma-adamw: MA's accumulators kept by the scheduler; *-authors: reference='authors')
@pytest.mark.parametrize("growth", ["ag", "ma", "ma-adamw", "ag-authors", "ma-authors"])
def test_indices_identical_on_every_rank(growth):
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(2, _free_port(), growth, out_dir), nprocs=2, join=True)
        r0 = torch.load(os.path.join(out_dir, "rank0.pt"))
        r1 = torch.load(os.path.join(out_dir, "rank1.pt"))
    initial = [i.clone() for i in r0["indices"]]
    assert all(torch.equal(a, b) for a, b in zip(r0["indices"], r1["indices"]))
    assert all(torch.equal(a, b) for a, b in zip(r0["values"], r1["values"]))
    assert any(i.numel() for i in initial)


def _fsdp_worker(rank: int, world: int, port: int, growth: str, out_dir: str) -> None:
    from peft import get_peft_model

    from peft_sparse import SM3, SpIELConfig, SpIELScheduler
    from peft_sparse.distributed import shard
    from tests.models import tiny_llama

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    reference = "authors" if growth.endswith("-authors") else None
    config = SpIELConfig(target_modules="all-linear", density=0.1, growth=growth[:2], reselection_steps=4, gradient_estimation_steps=2,
                         reference=reference)  # fmt: skip
    model = get_peft_model(tiny_llama(), config)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from torch.distributed.tensor import DTensor

        shard(model, mesh=init_device_mesh("cpu", (world,)))
        q = model.get_base_model().model.layers[0].self_attn.q_proj
        assert isinstance(q.base_layer.weight, DTensor) and not isinstance(q.sparse_values["default"], DTensor)
    params = [p for p in model.parameters() if p.requires_grad]
    if growth == "ag-authors":  # (its seeds' micro-batch squares: of the global batch's gradient, as one process sees it)
        from peft_sparse import AgedAdamW

        opt = AgedAdamW(params, lr=1e-2)
    else:
        opt = torch.optim.AdamW(params, lr=1e-2) if growth in ("ag", "ma-adamw") else SM3(params, lr=0.05)
    scheduler = SpIELScheduler(model, opt, total_steps=11)
    model.train()
    share = 4 // world
    for step in range(11):
        g = torch.Generator().manual_seed(100 + step)  # one global batch per step; each rank its share
        x = torch.randint(0, 97, (4, 12), generator=g)[rank * share : (rank + 1) * share]
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
    if rank == 0:
        model.save_pretrained(os.path.join(out_dir, f"adapter-w{world}"))
    _save_adapter_and_exit(model, os.path.join(out_dir, f"w{world}-rank{rank}.pt"))


@pytest.mark.parametrize("growth", ["ag", "ma", "ma-adamw", "ag-authors", "ma-authors"])
def test_fsdp2_shards_the_base_and_matches_one_process(growth):
    """FSDP2 (peft_sparse.distributed.shard) over two CPU processes against one process with the whole batch:
    the same indices on every rank and as the single process, values equal up to float32 reduction order."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_fsdp_worker, args=(1, _free_port(), growth, out_dir), nprocs=1, join=True)
        mp.spawn(_fsdp_worker, args=(2, _free_port(), growth, out_dir), nprocs=2, join=True)
        one = torch.load(os.path.join(out_dir, "w1-rank0.pt"))
        r0, r1 = (torch.load(os.path.join(out_dir, f"w2-rank{r}.pt")) for r in (0, 1))
        from safetensors.torch import load_file

        saved = {w: load_file(os.path.join(out_dir, f"adapter-w{w}", "adapter_model.safetensors")) for w in (1, 2)}
    assert all(torch.equal(a, b) for a, b in zip(r0["indices"], r1["indices"]))
    assert all(torch.equal(a, b) for a, b in zip(r0["values"], r1["values"]))
    assert all(torch.equal(a, b) for a, b in zip(one["indices"], r0["indices"]))
    for a, b in zip(one["values"], r0["values"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # save_pretrained on the sharded model writes the same adapter as one process (the values are not shards)
    assert sorted(saved[1]) == sorted(saved[2]) and all(k.endswith(("sparse_indices", "sparse_index_bits", "sparse_index_upper", "sparse_index_lower", "sparse_index_header", "sparse_values")) for k in saved[2])
    for key in saved[1]:
        torch.testing.assert_close(saved[1][key], saved[2][key], rtol=1e-4, atol=1e-6)


def _fsdp_resume_worker(rank: int, world: int, port: int, mode: str, out_dir: str) -> None:
    """FSDP2 over ``world`` CPU processes, 11 steps (reselections at t = 2, 6, 10). ``whole``: uninterrupted, writing a
    checkpoint at t = 5, inside the window of the reselection at 6 (adapter from rank 0, optimizer and scheduler
    state); ``resume``: fresh processes load that checkpoint, shard again and run the remaining steps."""
    from peft import PeftModel, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh

    from peft_sparse import SpIELConfig, SpIELScheduler
    from peft_sparse.distributed import shard
    from tests.models import tiny_llama

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    checkpoint = os.path.join(out_dir, "checkpoint")
    if mode == "resume":
        model = PeftModel.from_pretrained(tiny_llama(), os.path.join(checkpoint, "adapter"), is_trainable=True)
    else:
        config = SpIELConfig(target_modules="all-linear", density=0.1, reselection_steps=4, gradient_estimation_steps=2)
        model = get_peft_model(tiny_llama(), config)
    shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = SpIELScheduler(model, opt, total_steps=11)
    if mode == "resume":
        opt.load_state_dict(torch.load(os.path.join(checkpoint, "optimizer.pt")))
        scheduler.load(checkpoint)
    model.train()
    share = 4 // world
    for step in range(scheduler.t, 11):
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randint(0, 97, (4, 12), generator=g)[rank * share : (rank + 1) * share]
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
        if mode == "whole" and scheduler.t == 5:
            assert scheduler.statistics  # (the window of the reselection at t = 6 is open)
            if rank == 0:
                model.save_pretrained(os.path.join(checkpoint, "adapter"))
                torch.save(opt.state_dict(), os.path.join(checkpoint, "optimizer.pt"))
                scheduler.save(checkpoint)
            dist.barrier()
    _save_adapter_and_exit(model, os.path.join(out_dir, f"{mode}-rank{rank}.pt"))


def test_an_fsdp2_checkpoint_resumes_to_the_uninterrupted_run():
    """A plain FSDP2 loop (two CPU processes) checkpointed inside an estimation window — the adapter written by rank
    0, the optimizer's state (the values are replicated, so it is whole on every rank) and the scheduler's — resumes
    in fresh processes to the uninterrupted run's indices and values, bit for bit, on both ranks."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_fsdp_resume_worker, args=(2, _free_port(), "whole", out_dir), nprocs=2, join=True)
        mp.spawn(_fsdp_resume_worker, args=(2, _free_port(), "resume", out_dir), nprocs=2, join=True)
        runs = {(m, r): torch.load(os.path.join(out_dir, f"{m}-rank{r}.pt")) for m in ("whole", "resume") for r in (0, 1)}
    whole = runs["whole", 0]
    for key, run in runs.items():
        assert all(torch.equal(a, b) for a, b in zip(whole["indices"], run["indices"])), key
        assert all(torch.equal(a, b) for a, b in zip(whole["values"], run["values"])), key


def test_peft_sparse_train_runs_under_a_multi_process_launch(tmp_path):
    """`peft-sparse train` under torchrun (what `accelerate launch --multi_gpu` runs): two processes train on
    their shares of the data, the first alone evaluates and writes the adapter and summary, and the adapter loads."""
    import json

    from peft import PeftModel

    from tests.models import tiny_llama

    recipe = _tiny_recipe(tmp_path, "out", "max_steps: 6, per_device_train_batch_size: 4, save_strategy: 'no'")
    run = _train_cli(recipe, processes=2)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("adapter saved to") == 1 and run.stdout.count("=== held-out exact match ===") == 1
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["after"] is not None
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path / "out" / "adapter")
    assert loaded.peft_config["default"].peft_type == "SPIEL"


def _accelerate_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    from accelerate import Accelerator
    from peft import get_peft_model

    from peft_sparse import SpIELConfig, SpIELScheduler
    from tests.models import tiny_llama

    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == world
    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.1, reselection_steps=4, gradient_estimation_steps=2))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = SpIELScheduler(model, optimizer, total_steps=11)  # the prepared (wrapped) model and optimizer
    g = torch.Generator().manual_seed(100 + rank)
    model.train()
    for _ in range(11):
        x = torch.randint(0, 97, (4, 12), generator=g)
        accelerator.backward(model(input_ids=x, labels=x).loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    _save_adapter_and_exit(accelerator.unwrap_model(model), os.path.join(out_dir, f"acc-rank{rank}.pt"))


def test_a_plain_accelerate_loop_selects_the_same_indices_on_every_rank():
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_accelerate_worker, args=(2, _free_port(), out_dir), nprocs=2, join=True)
        r0 = torch.load(os.path.join(out_dir, "acc-rank0.pt"))
        r1 = torch.load(os.path.join(out_dir, "acc-rank1.pt"))
    initial = get_initial_indices()
    assert all(torch.equal(a, b) for a, b in zip(r0["indices"], r1["indices"]))
    assert all(torch.equal(a, b) for a, b in zip(r0["values"], r1["values"]))
    assert any(not torch.equal(a, b) for a, b in zip(r0["indices"], initial))  # reselections happened


def get_initial_indices():
    from peft import get_peft_model

    from peft_sparse import SparseLayer, SpIELConfig
    from tests.models import tiny_llama

    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.1, reselection_steps=4, gradient_estimation_steps=2))
    return [m.sparse_indices["default"] for m in model.modules() if isinstance(m, SparseLayer)]


def _disagree_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from peft import get_peft_model

    from peft_sparse import SpIELConfig, SpIELScheduler
    from tests.models import tiny_llama

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.1, seed=rank))  # a seed per rank
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    try:
        SpIELScheduler(model, optimizer, total_steps=10)
        message = "no error"
    except ValueError as error:
        message = str(error)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(message)
    dist.destroy_process_group()
    os._exit(0)


def test_ranks_that_disagree_are_refused():
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_disagree_worker, args=(2, _free_port(), out_dir), nprocs=2, join=True)
        messages = [open(os.path.join(out_dir, f"rank{r}.txt")).read() for r in range(2)]
    for message in messages:  # every rank stops, naming the first difference
        assert "ranks disagree on the SpIEL setup" in message and "rank 1 has config.seed=1 but rank 0 has 0" in message


def _bucket_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from peft import get_peft_model

    from peft_sparse import SparseFTConfig, SparseLayer
    from peft_sparse.accel import internals
    from peft_sparse.distributed import replicate_values
    from tests.models import tiny_llama

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.1))
    values = [l.sparse_values["default"] for l in model.modules() if isinstance(l, SparseLayer)]
    with torch.no_grad():
        for v in values:
            v.normal_(0, 0.01)  # (the same on every rank: same seed)
    x = torch.randint(0, 97, (4, 12), generator=torch.Generator().manual_seed(100 + rank))  # different data per rank
    model(x, labels=x).loss.backward()
    local = torch.cat([v.grad.reshape(-1) for v in values])
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    expected = torch.stack(gathered).mean(0)
    model.zero_grad(set_to_none=True)
    calls = []
    reduce = dist.all_reduce
    dist.all_reduce = lambda tensor, *a, **k: (calls.append(tensor.numel()), reduce(tensor, *a, **k))[1]
    total_bytes = local.numel() * 4
    replicate_values(model, bucket_mb=total_bytes / 3.5 / 2**20)  # → 4 buckets
    results = {}
    queue = internals.queue_after_backward
    for label, fallback in (("buckets", False), ("per_gradient", True)):
        if fallback:
            internals.queue_after_backward = lambda callback: False
        calls.clear()
        for micro_batch in range(2):  # (accumulated: each backward averages its own contribution)
            model(x, labels=x).loss.backward()
        results[label] = {"grad": torch.cat([v.grad.reshape(-1) for v in values]), "calls": list(calls)}
        model.zero_grad(set_to_none=True)
    internals.queue_after_backward = queue

    class Boom(torch.autograd.Function):  # raises last in the backward pass, after every value's hook ran
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("boom")

    embeds = model.get_input_embeddings()(x).detach().requires_grad_()
    try:
        model(inputs_embeds=Boom.apply(embeds), labels=x).loss.backward()
    except RuntimeError:
        pass
    model.zero_grad(set_to_none=True)
    model(x, labels=x).loss.backward()  # after a backward pass that raised: averaged as usual
    results["after_failure"] = {"grad": torch.cat([v.grad.reshape(-1) for v in values])}
    dist.all_reduce = reduce
    torch.save({"expected": expected, "tensors": len(values), **results}, os.path.join(out_dir, f"bucket{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def test_replicated_gradients_are_averaged_in_buckets():
    """replicate_values averages the values' gradients over ranks in a few flat buckets (one all-reduce each,
    started as they fill, awaited at the end of the backward pass): the same averages as one all-reduce per
    gradient (the fallback without the engine's end-of-backward callback), with gradient accumulation, and again
    after a backward pass that raised (its buckets never finished)."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_bucket_worker, args=(2, _free_port(), out_dir), nprocs=2, join=True)
        r0, r1 = (torch.load(os.path.join(out_dir, f"bucket{r}.pt")) for r in (0, 1))
    for r in (r0, r1):
        torch.testing.assert_close(r["buckets"]["grad"], 2 * r["expected"], rtol=1e-5, atol=1e-8)  # (two micro-batches)
        torch.testing.assert_close(r["per_gradient"]["grad"], r["buckets"]["grad"], rtol=1e-6, atol=1e-9)
        assert len(r["buckets"]["calls"]) == 2 * 4 and sum(r["buckets"]["calls"]) == 2 * r["expected"].numel()
        assert len(r["per_gradient"]["calls"]) == 2 * r["tensors"] > 2 * 4
        torch.testing.assert_close(r["after_failure"]["grad"], r["expected"], rtol=1e-5, atol=1e-8)
    assert torch.equal(r0["buckets"]["grad"], r1["buckets"]["grad"])


def _train_cli(recipe, processes: int = 1):
    """`peft-sparse train RECIPE` in a subprocess: alone, or under torchrun with ``processes`` processes."""
    import subprocess
    import sys

    launch = ["-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port", str(_free_port())] if processes > 1 else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    return subprocess.run([sys.executable, *launch, "-m", "peft_sparse.cli", "train", str(recipe)], capture_output=True, text=True, env=env, timeout=600)


def _tiny_recipe(tmp_path, name: str, training: str, method: str = "") -> "os.PathLike":
    """A tiny Llama, its tokenizer, successor data and a SpIEL recipe over them (S = 4, γ = 2) with ``training`` added."""
    import json
    import random

    from tests.models import tiny_llama, tiny_tokenizer

    if not (tmp_path / "model").exists():
        model, tokenizer = tiny_llama(), tiny_tokenizer()
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        model.save_pretrained(tmp_path / "model")
        tokenizer.save_pretrained(tmp_path / "model")
        r = random.Random(0)
        for split, n in (("train", 64), ("test", 8)):
            with open(tmp_path / f"{split}.jsonl", "w") as f:
                for _ in range(n):
                    a = r.randint(10, 90)
                    row = {"prompt": [{"role": "user", "content": f"t4 t{a}"}], "completion": [{"role": "assistant", "content": f"t{a + 1}"}], "answer": f"t{a + 1}"}
                    f.write(json.dumps(row) + "\n")
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""
model: {{source: {tmp_path / "model"}, dtype: float32}}
method: {{peft_type: SPIEL, target_modules: all-linear, density: 0.1, reselection_steps: 4, gradient_estimation_steps: 2{method}}}
data: {{train: {tmp_path / "train.jsonl"}, eval: {tmp_path / "test.jsonl"}}}
training: {{output_dir: {tmp_path / name}, learning_rate: 0.01, max_length: 32, report_to: none, seed: 0, use_cpu: true,
           bf16: false, dataloader_num_workers: 0, logging_steps: 1, {training}}}
evaluation: {{max_new_tokens: 2, batch_size: 8}}
""")
    return path


def test_a_two_process_checkpoint_resumes_in_one_process(tmp_path):
    """`peft-sparse train` under torchrun with 2 processes saves a checkpoint at step 4; one process with the same
    global batch and max_steps resumes from it (training.resume_from_checkpoint): the scheduler continues at step 4
    with the saved indices and reselects at step 6 as scheduled. With another max_steps it is refused, naming both
    world sizes."""
    import json

    from safetensors.torch import load_file

    two = _tiny_recipe(tmp_path, "two", "max_steps: 8, per_device_train_batch_size: 4, save_strategy: steps, save_steps: 4")
    run = _train_cli(two, processes=2)
    assert run.returncode == 0, run.stderr[-3000:]
    checkpoint = tmp_path / "two" / "checkpoint-4"
    saved = load_file(checkpoint / "spiel_scheduler.safetensors")  # (the ages: in the scheduler's state)

    one = _tiny_recipe(tmp_path, "one", f"max_steps: 8, per_device_train_batch_size: 8, save_strategy: steps, save_steps: 8, resume_from_checkpoint: {checkpoint}")
    run = _train_cli(one)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((tmp_path / "one" / "summary.json").read_text())["world_size"] == 1
    history = json.loads((tmp_path / "one" / "checkpoint-8" / "trainer_state.json").read_text())["log_history"]
    assert [h["step"] for h in history if "spiel/replaced" in h] == [2, 6]  # (2: the first run's; 6: after the resume)
    final = load_file(tmp_path / "one" / "checkpoint-8" / "spiel_scheduler.safetensors")
    ages = [k for k in saved if k.startswith("ages::")]
    assert ages and all(int(saved[k].max()) <= 2 for k in ages) and any(int(final[k].max()) == 6 for k in ages)

    other = _tiny_recipe(tmp_path, "other", f"max_steps: 12, per_device_train_batch_size: 8, save_strategy: 'no', resume_from_checkpoint: {checkpoint}")
    run = _train_cli(other)
    assert run.returncode != 0
    assert "total_steps=8" in run.stderr and "total_steps=12" in run.stderr and "written by 2 process(es) and this run has 1" in run.stderr
