"""Sharded data parallel (FSDP2) for sparse adapters: the frozen base weights sharded, the values replicated.

    dist.init_process_group("nccl")
    model = get_peft_model(base.to(device), SpIELConfig(...))
    shard(model)                                   # fully_shard per transformer block and at the root
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=...)
    scheduler = SpIELScheduler(model, optimizer, total_steps)   # as on one GPU

The base weights — nearly all of the memory — are sharded by ``torch.distributed.fsdp.fully_shard`` (FSDP2)
and gathered block by block for the forward and backward passes. The sparse values (d_φ numbers, a small
fraction of the model) are left out of the sharding (``ignored_params``): every rank holds all of them,
their gradients are averaged over ranks in buckets during and at the end of each backward pass, and so the optimizer, SM3's
accumulators, the reselections and the mask-editing API work on plain tensors exactly as on one GPU. The
selection statistics are all-reduced before selection as under DDP, so the indices are identical on every
rank by construction. Other trainable parameters (``modules_to_save`` heads) are sharded by FSDP as usual.

The training merge writes θ + δ into the base weights, which are shards here: it is refused.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .accel import internals
from .core.blocks import find_blocks
from .core.layer import SparseLayer


BUCKET_MB = 25.0  # the gradient buckets' size (DDP's default)


def _average_gradient(param: torch.Tensor) -> None:
    dist.all_reduce(param.grad)
    param.grad.div_(dist.get_world_size())


class BucketedAverage:
    """Averages replicated values' gradients over the ranks in few collectives: each gradient joins a flat
    bucket (per device and dtype) as the backward pass produces it, a bucket's all-reduce starts
    asynchronously once it holds ``bucket_mb`` MB, and when the backward pass ends the rest start and all
    are awaited, the averages written back into the gradients. The same averages as one all-reduce per
    gradient (the fallback, where the autograd engine offers no end-of-backward callback), in
    ⌈d_φ bytes / bucket⌉ collectives instead of one per tensor. A post-accumulate-grad hook.

    The buckets belong to the backward pass that filled them (its graph task), so a pass that raised (its
    end-of-backward callback never runs: an out-of-memory retry) leaves nothing to the next one; the last
    few such leftovers are kept, older ones dropped."""

    KEEP = 8  # backward passes with buckets at once (nested reentrant ones, and those that raised)

    def __init__(self, bucket_mb: float = BUCKET_MB):
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got bucket_mb={bucket_mb!r}")
        self.bucket_bytes = bucket_mb * 2**20
        self.tasks: dict = {}  # graph task id → {"pending": {(device, dtype): [params, bytes]}, "inflight": [(work, flat, params)]}

    def __call__(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        task = internals.graph_task_id()
        state = self.tasks.get(task)
        if state is None:
            if not internals.queue_after_backward(lambda: self.finish(task)):
                _average_gradient(param)  # (no end-of-backward callback: one all-reduce per gradient)
                return
            state = self.tasks[task] = {"pending": {}, "inflight": []}
            while len(self.tasks) > self.KEEP:
                self.tasks.pop(next(iter(self.tasks)))  # (the oldest: a pass that raised long ago)
        bucket = state["pending"].setdefault((grad.device, grad.dtype), [[], 0])
        bucket[0].append(param)
        bucket[1] += grad.numel() * grad.element_size()
        if bucket[1] >= self.bucket_bytes:
            self._start(state, (grad.device, grad.dtype))

    @staticmethod
    def _start(state: dict, key) -> None:
        params, _ = state["pending"].pop(key)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        state["inflight"].append((dist.all_reduce(flat, async_op=True), flat, params))

    def finish(self, task) -> None:
        state = self.tasks.pop(task, None)
        if state is None:
            return
        for key in list(state["pending"]):
            self._start(state, key)
        world = dist.get_world_size()
        for work, flat, params in state["inflight"]:
            work.wait()
            flat.div_(world)
            for p, part in zip(params, flat.split([p.grad.numel() for p in params])):
                p.grad.copy_(part.view_as(p.grad))


def shard(model: nn.Module, mesh=None, reshard_after_forward: bool = True, mp_policy=None, offload_policy=None, bucket_mb: float = BUCKET_MB) -> nn.Module:
    """Apply FSDP2 to a PEFT model with sparse adapters (module docstring); returns the model, sharded in place.

    Every rank must hold the same model on its device (seeded identically); the values and indices are then
    broadcast from rank 0 so that they agree bit for bit. ``mesh``, ``reshard_after_forward``, ``mp_policy``
    and ``offload_policy`` go to ``fully_shard``; ``bucket_mb`` sizes the buckets of the values' gradient averaging."""
    from torch.distributed.fsdp import fully_shard

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("shard: initialise torch.distributed first (dist.init_process_group)")
    layers = [m for m in model.modules() if isinstance(m, SparseLayer)]
    if not layers:
        raise ValueError("shard: the model holds no sparse adapter layers")
    for config in getattr(model, "peft_config", {}).values():
        if getattr(config, "training_merge", False):
            raise ValueError("shard: training_merge=True writes into the base weights, which FSDP shards; set training_merge=False")
    values = [p for layer in layers for p in layer.sparse_values.values()]
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward, "ignored_params": set(values)}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    prefix, _ = find_blocks(model)
    for block in model.get_submodule(prefix):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    replicate_values(model, bucket_mb)
    return model


def is_fsdp2(model: nn.Module) -> bool:
    """Whether FSDP2's ``fully_shard`` was applied to ``model`` or a module of it (directly, by :func:`shard`, or by
    accelerate / a Trainer with ``fsdp_version: 2``)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def replicate_values(model: nn.Module, bucket_mb: float = BUCKET_MB) -> None:
    """Keep the sparse values replicated under a sharding engine that left them out (``ignored_params``; accelerate:
    ``fsdp_ignored_modules: '.*\\.sparse_values'``): values and indices broadcast from rank 0, and the values'
    gradients averaged over ranks after every backward pass, in buckets of ``bucket_mb`` MB
    (:class:`BucketedAverage`). Idempotent; the Trainer callbacks call it."""
    from torch.distributed.tensor import DTensor

    average = BucketedAverage(bucket_mb)

    for layer in (m for m in model.modules() if isinstance(m, SparseLayer)):
        for name, values in layer.sparse_values.items():
            if isinstance(values, DTensor):
                raise ValueError(
                    f"{layer.module_name}: the sparse values were sharded; leave them out of the sharding — "
                    "peft_sparse.distributed.shard(model), or accelerate's fsdp_ignored_modules: '.*\\.sparse_values'"
                )
            if getattr(values, "_peft_sparse_replicated", False):
                continue
            with torch.no_grad():  # identical adapters on every rank, as DDP makes its parameters at construction
                dist.broadcast(values.data, src=0)
                dist.broadcast(layer.sparse_indices[name], src=0)
            if values.requires_grad:
                values.register_post_accumulate_grad_hook(average)
            values._peft_sparse_replicated = True

