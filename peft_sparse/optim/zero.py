"""DeepSpeed ZeRO (stages 1 and 2): a reselection's optimizer-state surgery on partitioned state.

ZeRO keeps each trainable parameter's Adam moments and fp32 master copy in flat partitions spread over the
ranks, so the slot-by-slot surgery of :mod:`peft_sparse.optim.surgery` cannot reach them. :class:`ZeroStateBridge`
gives a reselection a plain ``torch.optim.AdamW`` over the sparse values (the *shadow*) that holds their full
state for the duration of the edit:

* :meth:`ZeroStateBridge.editing` gathers every values tensor's ``exp_avg`` and ``exp_avg_sq`` (and its fp32
  master) through DeepSpeed's public tensor-fragment API (``deepspeed.utils.safe_get_full_*``: one collective per
  tensor and kind, so every rank must reselect at the same step, as SpIEL's ranks do), lets the reselection edit
  the shadow and the model's values in place as in one process, then writes each rank's partition back
  (``safe_set_full_*``) — the moments from the shadow, the master from the edited values (values of lower precision
  than the master: a weight that kept its slot keeps its master's full precision).
* The gathered state is d_φ-sized (the values, not the weights): 3 × 4 bytes per active weight while a
  reselection runs, then released.

Stage 3 also partitions the parameters themselves (the base weights that a sparse layer reads in its own
forward pass), which the layers do not gather: refused with an error naming it. Only Adam-family base optimizers
(``exp_avg`` / ``exp_avg_sq``) are supported; SpIEL-MA's SM3 ranks growth by accumulators over the weight's rows
and columns, which flat partitions do not keep, and is refused.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

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
    """Full per-tensor optimizer state of sparse values under DeepSpeed ZeRO 1/2, for one reselection at a time."""

    def __init__(self, zero_optimizer, layers: list, adapter_name: str, what: str = "SpIEL"):
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        if not isinstance(zero_optimizer, DeepSpeedZeroOptimizer):
            raise NotImplementedError(
                f"{what} under DeepSpeed: {type(zero_optimizer).__name__} (ZeRO stage 3) partitions the base weights, "
                "which sparse layers read in their own forward pass without gathering them; use ZeRO stage 1 or 2, "
                "or FSDP2 to shard the base (integrations/README.md)"
            )
        self.zero = zero_optimizer
        self.layers, self.adapter_name = layers, adapter_name
        self.params = [m.sparse_values[adapter_name] for m in layers]
        group_of = {}
        for at, group in enumerate(zero_optimizer.bit16_groups):
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
        for p in group["params"]:
            step = base.state.get(p, {}).get("step")
            if step is not None:
                return float(step)
        return 0.0

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
            master = safe_get_full_fp32_param(p)
            masters[id(p)] = (m.sparse_indices[self.adapter_name].clone(), None if master is None else master.reshape(-1).to(p.device))
        return masters

    def _scatter(self, masters: dict) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        for m, p in zip(self.layers, self.params):
            state = self.shadow.state.get(p, {})
            for key in MOMENTS:
                if key in state:
                    safe_set_full_optimizer_state(p, state[key].reshape(p.shape), key)
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
            safe_set_full_fp32_param(p, master.reshape(p.shape))

    @contextmanager
    def editing(self):
        """Yield the shadow optimizer holding the values' full state; write it (and the masters) back if the body
        finishes. Collective: every rank enters it at the same step."""
        masters = self._gather()
        try:
            yield self.shadow
            self._scatter(masters)
        finally:
            self.shadow.state.clear()


def zero_bridge(optimizer, layers: list, adapter_name: str, what: str = "SpIEL") -> Optional[ZeroStateBridge]:
    """A :class:`ZeroStateBridge` when ``optimizer`` is (or wraps) a DeepSpeed ZeRO optimizer, else None."""
    zero = find_zero_optimizer(optimizer)
    return None if zero is None else ZeroStateBridge(zero, layers, adapter_name, what)
