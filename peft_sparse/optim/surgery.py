"""Optimizer-state surgery after a reselection: the one place that edits optimizer state.

The mask-editing API (:mod:`peft_sparse.core.edit`) announces every edit of an adapter's slots through the
core's listeners (:mod:`peft_sparse.core.dispatch`); this module listens (:class:`OptimizerStateKeeper`,
registered when ``peft_sparse`` is imported) and follows with the optimizer's per-slot state.

After drop/grow, slot j of a values tensor holds a new index. :func:`reindex_optimizer_state`
re-gathers every per-slot optimizer tensor with the same ``source`` map (new slot → old slot, −1
for a grown slot) *in place*, so the optimizer keeps the same Parameter objects and state tensors;
grown slots start fresh (zero moments; age 1). :func:`seed_optimizer_state` then seeds grown slots:

* ``torch.optim.AdamW`` / ``Adam`` (stock): from the estimation window's mean gradient ĝ and mean
  squared gradient ŝ, as exp_avg = ĝ·(1−β₁ᵗ) and exp_avg_sq = ŝ·(1−β₂ᵗ) with t = ``state["step"]``,
  so Adam's own bias correction (÷(1−βᵗ)) recovers exactly ĝ and ŝ at the next step. This stands in
  for the per-index age correction of the thesis (§7.3.1), which stock AdamW cannot express (AgedAdamW, below, does).
  ``amsgrad=True`` is refused: its running maximum has no meaningful value for a new slot.
* :class:`peft_sparse.AgedAdamW` (``SpIELConfig(reference="authors")``): each slot keeps its own age in the bias
  correction (thesis §7.3.1), so a grown slot is seeded as exp_avg = ĝ·(1−β₁ᵃ), exp_avg_sq = ŝ·(1−β₂ᵃ) with its age
  a set to the window's length, the authors' released rule; re-gathered, a grown slot starts at age 1 (a fresh one).
* :class:`peft_sparse.SM3` and ``torch.optim.SGD``: nothing to seed (SM3's row and column
  accumulators cover the whole matrix; momentum buffers start at zero).

Any other optimizer is refused with the list above.
"""

from __future__ import annotations

import itertools

import torch

from ..core import dispatch, kernels
from .aged_adamw import AgedAdamW
from .sm3 import SM3


def unwrap_optimizer(optimizer):
    """The torch optimizer inside wrappers such as accelerate's AcceleratedOptimizer."""
    for _ in range(8):  # AcceleratedOptimizer subclasses Optimizer but only wraps the real one
        if type(optimizer).__module__.split(".")[0] == "deepspeed":
            raise NotImplementedError(
                f"{type(optimizer).__name__} is a DeepSpeed optimizer: ZeRO keeps the optimizer state in flattened "
                "partitions that this method cannot edit slot by slot; under DeepSpeed run SpIEL-AG (SpIELScheduler "
                "gathers the state it edits: peft_sparse.optim.zero) or fixed masks, or use DDP / FSDP2 (integrations/README.md)"
            )
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer (or a wrapper of one), got {type(optimizer).__name__}")
    return optimizer


SUPPORTED = (torch.optim.AdamW, torch.optim.Adam, AgedAdamW, SM3, torch.optim.SGD)


def check_supported(optimizer) -> torch.optim.Optimizer:
    opt = unwrap_optimizer(optimizer)
    if not isinstance(opt, SUPPORTED):
        names = ", ".join(f"{c.__module__}.{c.__name__}" for c in SUPPORTED)
        raise TypeError(f"optimizer {type(opt).__name__} cannot follow a reselection; supported: {names}")
    for group in opt.param_groups:
        if group.get("amsgrad"):
            raise ValueError("optimizer has amsgrad=True: its running maximum has no value for a newly grown slot")
    return opt


def _regather(tensor: torch.Tensor, source: torch.Tensor, grown: torch.Tensor, fresh: float = 0.0) -> None:
    new = tensor[source.clamp(min=0)]
    new[grown] = fresh
    tensor.copy_(new)


PER_SLOT_STATE = ("exp_avg", "exp_avg_sq", "momentum_buffer", "age")
FRESH = {"age": 1.0}  # what a grown slot's state starts at, where not 0 (AgedAdamW: age 1, as at its first step)


def reindex_optimizer_state(optimizer, param: torch.Tensor, source: torch.Tensor) -> None:
    """Re-gather ``param``'s per-slot state by ``source``; grown slots (``source == -1``) start fresh (zero; age 1)."""
    reindex_optimizer_states(optimizer, [param], source)


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
            new[grown] = FRESH.get(key, 0.0)
            torch._foreach_copy_(tensors, list(torch.split(new, sizes)))
            continue
        start = 0  # some parameters have no state of this kind (yet): one at a time
        for t, p, size in zip(tensors, params, sizes):
            local = source[start : start + size]
            if isinstance(t, torch.Tensor) and t.shape == p.shape:
                _regather(t, torch.where(local >= 0, local - start, -1), local < 0, FRESH.get(key, 0.0))
            start += size


def resize_optimizer_state(optimizer, param: torch.Tensor, source: torch.Tensor) -> None:
    """``param`` was resized in place to ``source.numel()`` slots, new slot j holding old slot ``source[j]``
    (−1: new): its per-slot state follows (new slots at zero); per-parameter state (steps, SM3's row and
    column accumulators) stays as it is."""
    opt = check_supported(optimizer)
    state = opt.state.get(param)
    if not state:
        return
    grown = source < 0
    for key in PER_SLOT_STATE:
        old = state.get(key)
        if isinstance(old, torch.Tensor) and old.dim() == 1:
            new = old[source.clamp(min=0)] if old.numel() else torch.zeros(source.numel(), dtype=old.dtype, device=old.device)
            state[key] = new.masked_fill_(grown, FRESH.get(key, 0.0))


def seed_optimizer_state(
    optimizer, param: torch.Tensor, slots: torch.Tensor, grad_mean: torch.Tensor, grad_sq_mean: torch.Tensor
) -> None:
    """Seed Adam's moments of ``slots`` so its bias correction yields ĝ (``grad_mean``) and ŝ (``grad_sq_mean``)."""
    seed_optimizer_states(optimizer, [param], [slots], [grad_mean], [grad_sq_mean])


def seed_optimizer_states(optimizer, params: list, slots: list, grad_means: list, grad_sq_means: list, scale=1.0, first: bool = True,
                          ages=None) -> None:
    """:func:`seed_optimizer_state` for many parameters at once: one scatter per moment for all those
    whose state lives on one device in one dtype. Parameters without state yet have nothing to seed.
    ``scale`` (c: a float or a device scalar) multiplies the ĝ seeds, c² the ŝ seeds (a clip factor).
    ``first=False`` seeds only the second moment (exp_avg stays zero). ``ages`` (one int per parameter: the
    steps the seeds stand for): an :class:`AgedAdamW` corrects each seed by its slot's age, set to that age;
    stock Adam(W) by its one step count. No host synchronisation."""
    opt = check_supported(optimizer)
    if isinstance(opt, AgedAdamW):
        _seed_aged(opt, params, slots, grad_means, grad_sq_means, scale, first, ages)
        return
    if not isinstance(opt, (torch.optim.AdamW, torch.optim.Adam)):
        return
    groups: dict = {}
    for entry in zip(params, slots, grad_means, grad_sq_means):
        state = opt.state.get(entry[0])
        if state:
            groups.setdefault((state["exp_avg"].dtype, state["exp_avg"].device), []).append((*entry, state))
    betas_of = {id(p): g["betas"] for g in opt.param_groups for p in g["params"]}
    for (_, device), entries in groups.items():
        params, slots, grad_means, grad_sq_means, states = zip(*entries)
        betas = kernels.table([betas_of[id(p)] for p in params], device, torch.float64)  # (n, 2)
        steps = [s["step"] for s in states]  # device tensors for fused/capturable Adam: no host sync
        if all(isinstance(t, torch.Tensor) and t.device == device for t in steps):
            t = torch.stack([t.reshape(()) for t in steps]).to(torch.float64)
        elif all(isinstance(t, torch.Tensor) for t in steps):
            t = torch.stack([t.to(device=device, dtype=torch.float64).reshape(()) for t in steps])
        else:
            t = kernels.table([float(x) for x in steps], device, torch.float64)
        sizes = [p.numel() for p in params]
        counts = [sl.numel() for sl in slots]
        total = sum(counts)
        counts_t = kernels.table(counts, device)
        bias1 = (1 - torch.pow(betas[:, 0], t)).repeat_interleave(counts_t, output_size=total)  # 1 − β₁ᵗ per seeded slot
        bias2 = (1 - torch.pow(betas[:, 1], t)).repeat_interleave(counts_t, output_size=total)
        offsets = kernels.table([0, *itertools.accumulate(sizes[:-1])], device)
        where = torch.cat([sl.to(device) for sl in slots]).long() + offsets.repeat_interleave(counts_t, output_size=total)
        factor = scale.to(device) if isinstance(scale, torch.Tensor) else scale  # (the states may span devices)
        scales = (factor, factor * factor)
        for (key, values, bias), c in zip((("exp_avg", grad_means, bias1), ("exp_avg_sq", grad_sq_means, bias2)), scales):
            if key == "exp_avg" and not first:
                continue  # (the first moment stays zero: the grown weight's steps ramp up as a fresh weight's do)
            tensors = [s[key] for s in states]
            flat = torch.cat(tensors)
            seeds = torch.cat([v.to(device) for v in values])
            if not (isinstance(c, float) and c == 1.0):
                seeds = seeds * c  # in the seeds' dtype, as ĝ·c per tensor
            flat[where] = (seeds.double() * bias).to(flat.dtype)
            torch._foreach_copy_(tensors, list(torch.split(flat, sizes)))


def _seed_aged(opt: AgedAdamW, params, slots, grad_means, grad_sq_means, scale, first: bool, ages) -> None:
    """:func:`seed_optimizer_states` for :class:`AgedAdamW`: the seeds counter-corrected by their own age a, so that
    the next step's bias correction (÷(1 − βᵃ)) reads ĝ and ŝ back, and the slots' ages set to a."""
    if ages is None:
        raise ValueError("AgedAdamW's seeds need the age they stand for (the estimation window's length): pass ages")
    betas_of = {id(p): g["betas"] for g in opt.param_groups for p in g["params"]}
    for param, where, g, s2, age in zip(params, slots, grad_means, grad_sq_means, ages):
        state = opt.state.get(param)
        if not state:
            continue
        beta1, beta2 = betas_of[id(param)]
        where = where.to(state["age"].device).long()
        c = scale.to(where.device) if isinstance(scale, torch.Tensor) else scale
        if first:
            state["exp_avg"][where] = (g.to(where.device) * c * (1.0 - beta1 ** float(age))).to(state["exp_avg"].dtype)
        state["exp_avg_sq"][where] = (s2.to(where.device) * (c * c) * (1.0 - beta2 ** float(age))).to(state["exp_avg_sq"].dtype)
        state["age"][where] = float(age)


def repoint_parameters(optimizer, replaced: dict, reset=()) -> None:
    """Let ``optimizer`` train new Parameter objects in place of old ones (``replaced``: id(old) → new), with
    fresh state for them and for the parameters in ``reset`` (their state is dropped); groups and their
    hyperparameters stay (LT-SFT's switch from the dense to the sparse phase)."""
    optimizer = unwrap_optimizer(optimizer)
    fresh = {id(p) for p in reset}
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            if id(p) in replaced or id(p) in fresh:
                optimizer.state.pop(p, None)
            params.append(replaced.get(id(p), p))
        group["params"] = params


@torch.no_grad()
def hold_slots(optimizer, params: list, held: list) -> list:
    """Zero the gradients of the ``held`` slots (bool masks) of ``params`` and keep their values and per-slot
    optimizer state; :func:`release_slots` after the step puts them back bit for bit (S⁴: a batch of one
    language leaves the other languages' weights untouched, momentum and weight decay included)."""
    optimizer = unwrap_optimizer(optimizer)
    kept = []
    for values, mask in zip(params, held):
        if values.grad is not None:
            values.grad[mask] = 0
        state = {k: v[mask].clone() for k, v in optimizer.state.get(values, {}).items()
                 if isinstance(v, torch.Tensor) and v.shape == values.shape}  # fmt: skip
        kept.append((values, mask, values.detach()[mask].clone(), state))
    return kept


@torch.no_grad()
def release_slots(optimizer, kept: list) -> None:
    """Put back what :func:`hold_slots` kept."""
    optimizer = unwrap_optimizer(optimizer)
    for values, mask, saved, state in kept:
        values.data[mask] = saved
        for k, v in state.items():
            optimizer.state[values][k][mask] = v


class OptimizerStateKeeper(dispatch.Listener):
    """Follows the core's edits with the per-slot state of the optimizer an edit names: rewritten slots re-gathered
    (:func:`reindex_optimizer_states`), resized values' state resized (:func:`resize_optimizer_state`; then an
    optimizer with launch plans over the old sizes, SM3, forgets them)."""

    def slots_changed(self, optimizer, values: list, source: torch.Tensor) -> bool:
        reindex_optimizer_states(optimizer, values, source)
        return True

    def slots_resized(self, optimizer, values: list, sources: list) -> bool:
        for param, source in zip(values, sources):
            resize_optimizer_state(optimizer, param, source)
        if hasattr(optimizer, "forget_layouts"):
            optimizer.forget_layouts()  # (SM3: launch plans and memos built over the old sizes)
        return True


dispatch.listen(OptimizerStateKeeper())
