"""SpIEL under torch.distributed (DDP, two CPU processes, gloo): the same indices on every rank."""

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
