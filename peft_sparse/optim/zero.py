"""DeepSpeed ZeRO (stages 1–3): a reselection's optimizer-state surgery on partitioned state.

ZeRO keeps each trainable parameter's Adam moments and fp32 master copy in flat partitions spread over the
ranks (stage 3 the parameters too), so the slot-by-slot surgery of :mod:`peft_sparse.optim.surgery` cannot reach
them. :class:`ZeroStateBridge` gives a reselection a plain ``torch.optim.AdamW`` over the sparse values (the
*shadow*) that holds their full state for the duration of the edit:

* :meth:`ZeroStateBridge.editing` gathers every values tensor's ``exp_avg`` and ``exp_avg_sq`` (and its fp32
  master) through DeepSpeed's public tensor-fragment API (``deepspeed.utils.safe_get_full_*``: one collective per
  tensor and kind, so every rank must reselect at the same step, as SpIEL's ranks do) — under stage 3 also the
  values themselves (``deepspeed.zero.GatheredParameters``) — lets the reselection edit the shadow and the
  model's values in place as in one process, then writes each rank's partition back (``safe_set_full_*``) — the
  moments from the shadow, the master from the edited values (values of lower precision than the master: a weight
  that kept its slot keeps its master's full precision).
* The gathered state is d_φ-sized (the values, not the weights): 3 × 4 bytes per active weight while a
  reselection runs, then released.

Only Adam-family base optimizers (``exp_avg`` / ``exp_avg_sq``) are supported: SM3's accumulators over a weight's
rows and columns have no place in flat partitions. SpIEL-MA beside Adam keeps its own row and column accumulators
from the averaged gradients that :meth:`ZeroStateBridge.full_gradients` assembles at the start of each ZeRO step
(:meth:`ZeroStateBridge.before_step`). Under stage 3
the sparse layers gather their partitioned base weights themselves (:func:`peft_sparse.core.base.gather_partitioned_base`).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable, Optional

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


def find_zero_optimizer(optimizer):
    """The DeepSpeed ZeRO optimizer inside ``optimizer``'s wrappers (accelerate's), or None."""
    for _ in range(8):
        module = type(optimizer).__module__
        if module.split(".")[0] == "deepspeed" and hasattr(optimizer, "optimizer") and any(
            hasattr(optimizer, a) for a in ("bit16_groups", "fp16_groups")
        ):
            return optimizer
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            return None
        optimizer = inner
    return None


class ZeroStateBridge:
    """Full per-tensor optimizer state of sparse values under DeepSpeed ZeRO, for one reselection at a time."""

    def __init__(self, zero_optimizer, layers: list, adapter_name: str, what: str = "SpIEL"):
        self.zero = zero_optimizer
        self.layers, self.adapter_name = layers, adapter_name
        self.params = [m.sparse_values[adapter_name] for m in layers]
        group_of = {}
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

        self.stage3 = isinstance(zero_optimizer, DeepSpeedZeroOptimizer_Stage3)
        for at, group in enumerate(zero_optimizer.fp16_groups if self.stage3 else zero_optimizer.bit16_groups):
            for p in group:
                group_of[id(p)] = at
        missing = [m.module_name for m, p in zip(layers, self.params) if id(p) not in group_of]
        if missing:
            raise ValueError(
                f"the DeepSpeed optimizer does not hold the {what} values of {missing[:3]}{'…' if len(missing) > 3 else ''}: "
                "create the scheduler after deepspeed.initialize / accelerator.prepare, with the prepared optimizer"
            )
        base = zero_optimizer.optimizer
        for at in sorted(set(group_of.values())):
            group = base.param_groups[at]
            if "betas" not in group:
                raise TypeError(
                    f"{what} under DeepSpeed needs an Adam-family optimizer (exp_avg / exp_avg_sq), got "
                    f"{type(base).__name__} with param group keys {sorted(k for k in group if k != 'params')}"
                )
        self._group_of = group_of
        # whether ZeRO trains the values alone (then the gradient norm it clips by is theirs: full_gradients)
        groups = zero_optimizer.fp16_groups if self.stage3 else zero_optimizer.bit16_groups
        held = sum(getattr(p, "ds_numel", p.numel()) for group in groups for p in group)  # (stage 3: partitioned, numel 0)
        self.values_alone = held == sum(getattr(p, "ds_numel", p.numel()) for p in self.params)
        if self.stage3:  # the layers' partitioned base weights, gathered with them from the first step on
            from ..core.base import register_partitioned_base

            for m in layers:
                register_partitioned_base(m, m.get_base_layer())
        # the shadow: a torch AdamW over the values, with each ZeRO group's hyperparameters (refreshed per edit)
        groups = {}
        for p in self.params:
            groups.setdefault(group_of[id(p)], []).append(p)
        self._shadow_groups = sorted(groups)
        self.shadow = torch.optim.AdamW([{"params": groups[at]} for at in self._shadow_groups])

    def _step_of(self, at: int) -> float:
        """The optimizer steps taken by ZeRO group ``at`` (its base optimizer's counter: per group or per flat tensor)."""
        base = self.zero.optimizer
        group = base.param_groups[at]
        if "step" in group:  # (DeepSpeed's FusedAdam counts per group)
            return float(group["step"])
        flat = getattr(self.zero, "fp32_partitioned_groups_flat" if self.stage3 else "single_partition_of_fp32_groups", [])
        # (stage 3 hands its base optimizer each flat partition only while it steps: the state is keyed by it)
        for p in list(group["params"]) + ([flat[at]] if at < len(flat) else []):
            step = base.state.get(p, {}).get("step")
            if step is not None:
                return float(step)
        if not base.state:
            return 0.0  # (no step taken yet: no state to edit)
        raise RuntimeError(
            f"DeepSpeed {type(self.zero).__name__}: no step count found for parameter group {at} in its "
            f"{type(base).__name__}'s state, so the moments a reselection edits cannot be located"
        )

    def _gather(self) -> dict:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        base = self.zero.optimizer
        for shadow_group, at in zip(self.shadow.param_groups, self._shadow_groups):
            for key in ("lr", "betas", "eps", "weight_decay"):
                if key in base.param_groups[at]:
                    shadow_group[key] = base.param_groups[at][key]
        steps = {at: self._step_of(at) for at in self._shadow_groups}
        masters = {}
        for m, p in zip(self.layers, self.params):
            state = {}
            if steps[self._group_of[id(p)]] > 0:
                for key in MOMENTS:
                    full = safe_get_full_optimizer_state(p, key)
                    if full is None:
                        raise RuntimeError(f"{m.module_name}: DeepSpeed holds no {key!r} for the values (not an Adam-family optimizer?)")
                    state[key] = full.reshape(p.shape).to(p.device)
                state["step"] = torch.tensor(steps[self._group_of[id(p)]], dtype=torch.float32)
            self.shadow.state[p] = state
            master = safe_get_full_fp32_param(p)  # (stage 3: a collective too)
            masters[id(p)] = (m.sparse_indices[self.adapter_name].clone(), None if master is None else master.reshape(-1).to(p.device))
        return masters

    def _scatter(self, masters: dict) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        for m, p in zip(self.layers, self.params):
            state = self.shadow.state.get(p, {})
            for key in MOMENTS:
                if key in state:
                    self._set_full(p, state[key].reshape(p.shape), key, safe_set_full_optimizer_state)
            old_indices, old_master = masters[id(p)]
            master = p.detach().float().reshape(-1).clone()
            if p.dtype not in (torch.float32, torch.float64) and old_master is not None and old_indices.numel():
                # values of lower precision than the master: a weight that kept its slot keeps its master's full
                # precision (an index active before and after whose value still rounds to the master's; one that
                # was dropped and grown again starts from its new value, as the values do)
                new_indices = m.sparse_indices[self.adapter_name].long()
                old_indices = old_indices.long()
                at = torch.searchsorted(old_indices, new_indices).clamp(max=old_indices.numel() - 1)
                kept = (old_indices[at] == new_indices) & (old_master[at].to(p.dtype) == p.detach().reshape(-1))
                master = torch.where(kept, old_master[at], master)
            self._set_full(p, master.reshape(p.shape), None, lambda p, v, _: safe_set_full_fp32_param(p, v))

    def _set_full(self, p, value, key, public) -> None:
        """Write this rank's partition of ``p``'s state ``key`` (None: the fp32 master) from its full ``value``.
        Stage 3 pads each parameter to a multiple of the ranks, and DeepSpeed's own setter (0.19) reads the last
        rank's partition past the end of an unpadded value: where the size does not divide, the partition is
        written here from the padded value (DeepSpeed's stage-3 partition accessors, in this one place)."""
        if not self.stage3:
            public(p, value, key)
            return
        partition, _ = self.zero._get_fp32_opt_state_partition(p, release_swap_buffers=False, optim_state_key=key)
        size, rank = partition.numel(), self.zero._get_param_partition_rank(p)
        if size * torch.distributed.get_world_size(self.zero.dp_process_group) == value.numel():
            public(p, value, key)
            return
        padded = torch.zeros(size * (rank + 1), dtype=value.dtype, device=value.device)
        flat = value.reshape(-1)[: padded.numel()]
        padded[: flat.numel()] = flat
        partition.data.copy_(padded[size * rank :])

    def full_gradients(self) -> Optional[dict]:
        """{id(values): flat gradient} of every values tensor, whole and averaged over the ranks, as ZeRO holds them
        between the backward pass and its step (DeepSpeed's public ``safe_get_full_grad``: collectives, every rank
        asks for the same tensors in the same order), divided by the loss scale (fp16) and clipped as ZeRO's step
        will clip them (``gradient_clipping``: by their global norm, where ZeRO trains the values alone; otherwise
        unclipped, since the norm over the other parameters is not at hand); None under fp16 loss scaling when one
        is not finite (ZeRO skips that step). A values tensor ZeRO holds no gradient for is left out."""
        from deepspeed.utils import safe_get_full_grad

        scale = float(getattr(self.zero, "loss_scale", 1.0) or 1.0)
        scaled = scale != 1.0 or bool(getattr(self.zero, "dynamic_loss_scale", False))  # (fp16: ZeRO skips overflows)
        grads, finite = {}, []
        for p in self.params:
            if p.grad is not None:  # (ZeRO frees each gradient it reduces: one still here was never averaged)
                raise RuntimeError("a sparse values tensor still holds a local gradient at DeepSpeed's optimizer step; "
                                   "expected ZeRO to have reduced it into its partitions")  # fmt: skip
            grad = safe_get_full_grad(p)
            if grad is not None:
                grad = grad.reshape(-1).float()
                grads[id(p)] = grad / scale if scale != 1.0 else grad
                if scaled:
                    finite.append(torch.isfinite(grad).all())
        if finite and not bool(torch.stack(finite).all()):  # (a read of the device, under fp16 loss scaling only)
            return None
        max_norm = float(getattr(self.zero, "clip_grad", 0.0) or 0.0)
        if grads and max_norm > 0 and self.values_alone:  # (torch's clip_grad_norm_ and ZeRO's: max_norm / (norm + 1e-6))
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
            factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            grads = {k: g * factor for k, g in grads.items()}
        return grads

    def before_step(self, hook: Callable[[], None]):
        """Run ``hook`` at the start of every step of the ZeRO optimizer (while it still holds the reduced
        gradients), whoever calls that step: DeepSpeed's engine, or accelerate's inside ``backward``. Returns a
        handle whose ``remove()`` restores the optimizer's own ``step``."""
        zero, own = self.zero, self.zero.step

        def step(*args, **kwargs):
            hook()
            return own(*args, **kwargs)

        zero.step = step

        class _Handle:
            @staticmethod
            def remove() -> None:
                if zero.__dict__.get("step") is step:
                    del zero.step

        return _Handle()

    @contextmanager
    def editing(self):
        """Yield the shadow optimizer holding the values' full state; write it (and the masters) back if the body
        finishes. Collective: every rank enters it at the same step."""
        available = []
        if self.stage3:  # the values themselves are partitioned: whole on every rank while edited, then
            from deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus  # partitioned again from rank 0's (all ranks edit alike)

            gathered = GatheredParameters(self.params, modifier_rank=0)
            # values ZeRO-3 keeps whole between passes (below its persistence threshold) must be whole again after
            # the edit: its record of the fetch order treats them as never fetched
            available = [p for p in self.params if p.ds_status == ZeroParamStatus.AVAILABLE]
        else:
            gathered = nullcontext()
        with gathered:
            masters = self._gather()
            try:
                yield self.shadow
                self._scatter(masters)
            finally:
                self.shadow.state.clear()
        if available:
            available[0].all_gather(param_list=available)

