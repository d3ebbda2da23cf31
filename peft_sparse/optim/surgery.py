"""Optimizer-state surgery after a reselection: the one place that edits optimizer state.

After drop/grow, slot j of a values tensor holds a new index. :func:`reindex_optimizer_state`
re-gathers every per-slot optimizer tensor with the same ``source`` map (new slot → old slot, −1
for a grown slot) *in place*, so the optimizer keeps the same Parameter objects and state tensors;
grown slots start at zero. :func:`seed_optimizer_state` then seeds grown slots:

* ``torch.optim.AdamW`` / ``Adam`` (stock): from the estimation window's mean gradient ĝ and mean
  squared gradient ŝ, as exp_avg = ĝ·(1−β₁ᵗ) and exp_avg_sq = ŝ·(1−β₂ᵗ) with t = ``state["step"]``,
  so Adam's own bias correction (÷(1−βᵗ)) recovers exactly ĝ and ŝ at the next step. This stands in
  for the per-index age correction of the thesis (§7.3.1), which stock AdamW cannot express.
  ``amsgrad=True`` is refused: its running maximum has no meaningful value for a new slot.
* :class:`peft_sparse.SM3` and ``torch.optim.SGD``: nothing to seed (SM3's row and column
  accumulators cover the whole matrix; momentum buffers start at zero).

Any other optimizer is refused with the list above.
"""

from __future__ import annotations

import torch

from .sm3 import SM3


def unwrap_optimizer(optimizer):
    """The torch optimizer inside wrappers such as accelerate's AcceleratedOptimizer."""
    for _ in range(8):  # AcceleratedOptimizer subclasses Optimizer but only wraps the real one
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer (or a wrapper of one), got {type(optimizer).__name__}")
    return optimizer


SUPPORTED = (torch.optim.AdamW, torch.optim.Adam, SM3, torch.optim.SGD)


def check_supported(optimizer) -> torch.optim.Optimizer:
    opt = unwrap_optimizer(optimizer)
    if not isinstance(opt, SUPPORTED):
        names = ", ".join(f"{c.__module__}.{c.__name__}" for c in SUPPORTED)
        raise TypeError(f"optimizer {type(opt).__name__} cannot follow a reselection; supported: {names}")
    for group in opt.param_groups:
        if group.get("amsgrad"):
            raise ValueError("optimizer has amsgrad=True: its running maximum has no value for a newly grown slot")
    return opt


def _regather(tensor: torch.Tensor, source: torch.Tensor, grown: torch.Tensor) -> None:
    new = tensor[source.clamp(min=0)]
    new[grown] = 0
    tensor.copy_(new)


PER_SLOT_STATE = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def reindex_optimizer_state(optimizer, param: torch.Tensor, source: torch.Tensor) -> None:
    """Re-gather ``param``'s per-slot state by ``source``; grown slots (``source == -1``) start at zero."""
    opt = check_supported(optimizer)
    state = opt.state.get(param)
    if not state:
        return
    grown = source < 0
    for key in PER_SLOT_STATE:
        tensor = state.get(key)
        if isinstance(tensor, torch.Tensor) and tensor.shape == param.shape:
            _regather(tensor, source, grown)


def reindex_optimizer_states(optimizer, params: list, source: torch.Tensor) -> None:
    """:func:`reindex_optimizer_state` for many parameters at once. ``source`` maps the slots of the
    parameters laid end to end (each keeps its size) to old slots in the same numbering, −1 for grown.
    One gather per kind of state for all parameters instead of one per parameter."""
    opt = check_supported(optimizer)
    sizes = [p.numel() for p in params]
    grown = source < 0
    gather = source.clamp(min=0)
    for key in PER_SLOT_STATE:
        tensors = [opt.state.get(p, {}).get(key) for p in params]
        if all(t is None for t in tensors):
            continue
        if all(isinstance(t, torch.Tensor) and t.shape == p.shape for t, p in zip(tensors, params)):
            new = torch.cat(tensors)[gather]
            new[grown] = 0
            torch._foreach_copy_(tensors, list(torch.split(new, sizes)))
            continue
        start = 0  # some parameters have no state of this kind (yet): one at a time
        for t, p, size in zip(tensors, params, sizes):
            local = source[start : start + size]
            if isinstance(t, torch.Tensor) and t.shape == p.shape:
                _regather(t, torch.where(local >= 0, local - start, -1), local < 0)
            start += size


def seed_optimizer_state(
    optimizer, param: torch.Tensor, slots: torch.Tensor, grad_mean: torch.Tensor, grad_sq_mean: torch.Tensor
) -> None:
    """Seed Adam's moments of ``slots`` so its bias correction yields ĝ (``grad_mean``) and ŝ (``grad_sq_mean``)."""
    opt = check_supported(optimizer)
    state = opt.state.get(param)
    if not state or not isinstance(opt, (torch.optim.AdamW, torch.optim.Adam)):
        return
    group = next(g for g in opt.param_groups if any(p is param for p in g["params"]))
    beta1, beta2 = group["betas"]
    t = state["step"]  # a device tensor for fused/capturable Adam: stay on the device (no host sync)
    if isinstance(t, torch.Tensor):
        t = t.to(device=grad_mean.device, dtype=torch.float64)
        c1, c2 = 1 - torch.pow(beta1, t), 1 - torch.pow(beta2, t)
    else:
        c1, c2 = 1 - beta1 ** float(t), 1 - beta2 ** float(t)
    state["exp_avg"][slots] = (grad_mean * c1).to(state["exp_avg"].dtype)
    state["exp_avg_sq"][slots] = (grad_sq_mean * c2).to(state["exp_avg_sq"].dtype)


def seed_optimizer_states(optimizer, params: list, slots: list, grad_means: list, grad_sq_means: list) -> None:
    """:func:`seed_optimizer_state` for many parameters at once (one scatter per moment for all of them)."""
    opt = check_supported(optimizer)
    if not isinstance(opt, (torch.optim.AdamW, torch.optim.Adam)) or not params:
        return
    states = [opt.state.get(p) for p in params]
    if not all(states) or len({(s["exp_avg"].dtype, s["exp_avg"].device) for s in states}) != 1:
        for p, sl, g, s2 in zip(params, slots, grad_means, grad_sq_means):
            seed_optimizer_state(opt, p, sl, g, s2)
        return
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    betas = torch.tensor([group_of[id(p)]["betas"] for p in params], dtype=torch.float64)  # (n, 2), host
    device = states[0]["exp_avg"].device
    steps = [s["step"] for s in states]
    if all(isinstance(t, torch.Tensor) for t in steps):
        t = torch.stack([t.to(device=device, dtype=torch.float64).reshape(()) for t in steps])
    else:
        t = torch.tensor([float(x) for x in steps], dtype=torch.float64, device=device)
    counts = torch.tensor([sl.numel() for sl in slots], device=device)
    bias1 = (1 - torch.pow(betas[:, 0].to(device), t)).repeat_interleave(counts, output_size=sum(sl.numel() for sl in slots))
    bias2 = (1 - torch.pow(betas[:, 1].to(device), t)).repeat_interleave(counts, output_size=bias1.numel())
    sizes = [p.numel() for p in params]
    offsets, start = [], 0
    for size in sizes:
        offsets.append(start)
        start += size
    where = torch.cat([sl.long() + off for sl, off in zip(slots, offsets)])
    for key, values, bias in (("exp_avg", grad_means, bias1), ("exp_avg_sq", grad_sq_means, bias2)):
        tensors = [s[key] for s in states]
        flat = torch.cat(tensors)
        flat[where] = (torch.cat(values).double() * bias).to(flat.dtype)
        torch._foreach_copy_(tensors, list(torch.split(flat, sizes)))
