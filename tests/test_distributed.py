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


def _worker(rank: int, world: int, port: int, growth: str, out_dir: str) -> None:
    from peft import get_peft_model
    from torch.nn.parallel import DistributedDataParallel as DDP

    from peft_sparse import SM3, SpIELConfig, SpIELScheduler, SparseLayer
    from tests.models import tiny_llama

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    config = SpIELConfig(target_modules="all-linear", density=0.1, growth=growth, reselection_steps=4, gradient_estimation_steps=2)
    model = get_peft_model(tiny_llama(), config)
    # no buffer broadcast: identical indices must come from identical selections, not from rank 0
    ddp = DDP(model, broadcast_buffers=False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2) if growth == "ag" else SM3(params, lr=0.05)
    scheduler = SpIELScheduler(ddp, opt, total_steps=11)
    g = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    ddp.train()
    for _ in range(11):
        x = torch.randint(0, 97, (4, 12), generator=g)
        ddp(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
    layers = [m for m in model.modules() if isinstance(m, SparseLayer)]
    torch.save(
        {"indices": [l.sparse_indices["default"] for l in layers], "values": [l.sparse_values["default"].detach() for l in layers]},
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    dist.barrier()
    dist.destroy_process_group()
    # leave without running destructors: tearing down DDP's reducer after the process group is gone
    # occasionally blocked a worker at exit (the results are already on disk)
    os._exit(0)


@pytest.mark.parametrize("growth", ["ag", "ma"])
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

    from peft_sparse import SM3, SparseLayer, SpIELConfig, SpIELScheduler
    from peft_sparse.distributed import shard
    from tests.models import tiny_llama

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    config = SpIELConfig(target_modules="all-linear", density=0.1, growth=growth, reselection_steps=4, gradient_estimation_steps=2)
    model = get_peft_model(tiny_llama(), config)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from torch.distributed.tensor import DTensor

        shard(model, mesh=init_device_mesh("cpu", (world,)))
        q = model.get_base_model().model.layers[0].self_attn.q_proj
        assert isinstance(q.base_layer.weight, DTensor) and not isinstance(q.sparse_values["default"], DTensor)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2) if growth == "ag" else SM3(params, lr=0.05)
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
    layers = [m for m in model.modules() if isinstance(m, SparseLayer)]
    torch.save(
        {"indices": [l.sparse_indices["default"] for l in layers], "values": [l.sparse_values["default"].detach() for l in layers]},
        os.path.join(out_dir, f"w{world}-rank{rank}.pt"),
    )
    if rank == 0:
        model.save_pretrained(os.path.join(out_dir, f"adapter-w{world}"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


@pytest.mark.parametrize("growth", ["ag", "ma"])
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
    assert sorted(saved[1]) == sorted(saved[2]) and all(k.endswith(("sparse_indices", "sparse_index_bits", "sparse_values", "sparse_ages")) for k in saved[2])
    for key in saved[1]:
        torch.testing.assert_close(saved[1][key], saved[2][key], rtol=1e-4, atol=1e-6)
