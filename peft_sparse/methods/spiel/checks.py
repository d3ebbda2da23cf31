"""What a :class:`~peft_sparse.methods.spiel.scheduler.SpIELScheduler` checks before it drives a run: the adapter it
drives, an optimizer that can follow a reselection, identical inputs on every rank, and what DeepSpeed ZeRO or
``reference='authors'`` cannot run — each refused by name."""

from __future__ import annotations

import json
from typing import Optional

import torch.distributed as dist

from ...core.layer import SparseLayer
from ...optim.aged_adamw import AgedAdamW
from ...optim.sm3 import SM3
from ...schedules.reselection import is_reselection_step
from .config import SpIELConfig
from .rules import released


def find_spiel_adapter(model, adapter_name: Optional[str]):
    """(the PEFT model, its tuner, the SpIEL adapter's name, its config): ``adapter_name``, or the one active SpIEL adapter."""
    inner = model
    while not hasattr(inner, "peft_config") and hasattr(inner, "module"):
        inner = inner.module  # DDP and similar wrappers
    configs = getattr(inner, "peft_config", {}) or {}
    spiel = {name: c for name, c in configs.items() if isinstance(c, SpIELConfig)}
    if not spiel:
        raise ValueError("SpIELScheduler needs a model with a SpIEL adapter (get_peft_model(model, SpIELConfig(...))); found none")
    if adapter_name is None:
        active = getattr(inner, "active_adapters", None) or list(spiel)
        active = [a for a in active if a in spiel]
        if len(active) != 1:
            raise ValueError(f"SpIELScheduler: pass adapter_name; active SpIEL adapters are {active or sorted(spiel)}")
        adapter_name = active[0]
    if adapter_name not in spiel:
        raise ValueError(f"SpIELScheduler: adapter_name={adapter_name!r} is not a SpIEL adapter; SpIEL adapters: {sorted(spiel)}")
    tuner = getattr(inner, "base_model", inner)
    return inner, tuner, adapter_name, spiel[adapter_name]


class SchedulerChecks:
    """The checks of :class:`~peft_sparse.methods.spiel.scheduler.SpIELScheduler` (a mixin)."""

    config: SpIELConfig
    layers: list

    def _refuse_under_zero(self, zero) -> None:
        """What DeepSpeed ZeRO's flat partitions cannot follow, refused by name."""
        if self.config.reference == "authors":
            raise ValueError("SpIEL with reference='authors' does not run under DeepSpeed ZeRO: its optimizer keeps a per-slot "
                             "age (peft_sparse.AgedAdamW, or SM3's accumulators for MA) that ZeRO's flat partitions do not "
                             "hold; use DDP or FSDP2")  # fmt: skip
        if isinstance(zero.optimizer, AgedAdamW):
            raise ValueError("peft_sparse.AgedAdamW does not run under DeepSpeed ZeRO with SpIEL: the per-slot ages a reselection "
                             "edits are not kept in ZeRO's flat partitions; use torch.optim.AdamW there, or DDP / FSDP2")  # fmt: skip
        if self.config.budget_split == "adaptive":
            raise ValueError("SpIEL with budget_split='adaptive' does not run under DeepSpeed ZeRO: resized values cannot "
                             "follow ZeRO's flat buffers; use budget_split 'uniform' or 'lora', or DDP / FSDP2")  # fmt: skip
        if self.config.growth == "ma" and isinstance(zero.optimizer, SM3):
            raise ValueError("SpIEL with growth='ma' and the SM3 optimizer does not run under DeepSpeed ZeRO: SM3's row and "
                             "column accumulators are not kept in ZeRO's flat partitions; train MA beside AdamW there "
                             "(the scheduler keeps the accumulators), or use DDP / FSDP2")  # fmt: skip

    def _check_reference_optimizer(self) -> None:
        """``reference='authors'`` (or the released rules ``seeds`` and ``no_regrowth`` alone): the released code's
        optimizer, and room for MA's growth outside the active units."""
        opt = self.optimizer
        if self.config.growth == "ag" and released(self.config, "seeds") and not isinstance(opt, AgedAdamW):
            raise TypeError(
                f"SpIEL-AG with reference='authors' (or the released rule 'seeds') seeds grown weights with a per-index age "
                f"in Adam's bias correction, which {type(opt).__name__} cannot hold: train with peft_sparse.AgedAdamW (Trainer: "
                "optimizer_cls_and_kwargs=(peft_sparse.AgedAdamW, {'lr': ...}))"
            )
        if self.config.growth == "ma" and self.config.reference == "authors":
            if not isinstance(opt, SM3):
                raise TypeError(f"SpIEL-MA with reference='authors' ranks growth by SM3's own accumulators, as the released code "
                                f"does: train with peft_sparse.SM3, not {type(opt).__name__}")  # fmt: skip
            for group in opt.param_groups:
                if group.get("momentum", 0.0) or group.get("beta2") is not None:
                    raise ValueError(
                        f"SpIEL-MA with reference='authors' runs the released SM3-II (accumulated sums, no momentum); got "
                        f"momentum={group.get('momentum')!r}, beta2={group.get('beta2')!r} (the released selector moves values "
                        "without their momentum, so no faithful run with momentum exists): use SM3(momentum=0, beta2=None)"
                    )
        if self.config.growth == "ma" and released(self.config, "no_regrowth"):
            self._check_room_to_grow()

    def _check_room_to_grow(self) -> None:
        """The released MA never grows a unit that was active before the reselection, so every tensor needs k(t)
        inactive units at each reselection (at a full replacement: d_φ of them, a density of at most 1/2)."""
        steps = [t for t in range(1, self.total_steps) if is_reselection_step(t, self.S, self.gamma, self.total_steps)]
        for layer in self.layers:
            d = layer.sparse_values[self.adapter_name].numel()
            most = max((self.replacement_counts(t, [d])[0] for t in steps), default=0)
            if layer.numel - d < most:
                raise ValueError(
                    f"SpIEL-MA with reference='authors' (or the released rule 'no_regrowth') grows only weights that were "
                    f"inactive before a reselection: {layer.module_name} holds {d} of {layer.numel} weights, too few inactive ones "
                    f"for the {most} it replaces (the released code fails there); lower density"
                )

    def _check_optimizer_holds_values(self, created: bool = False) -> None:
        """At creation the optimizer must hold every layer's values Parameter itself: its state is what a
        reselection edits. Later, holding none of them means something re-grouped or replaced the optimizer's
        parameters since (DeepSpeed and FSDP with flattened parameters do, in ``accelerator.prepare``); a layer
        whose values were replaced by the user (an assign-load) keeps being reselected, its new values untrained."""
        held = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        missing = [m.module_name for m in self.layers if id(m.sparse_values[self.adapter_name]) not in held]
        if not missing or (not created and len(missing) < len(self.layers)):
            return
        some = f"{missing[:3]}{'…' if len(missing) > 3 else ''}"
        if created:
            raise ValueError(f"the optimizer does not hold the SpIEL values of {some}")
        raise ValueError(
            f"SpIELScheduler: at step {self.t} the optimizer no longer holds the SpIEL values of {some}: its "
            "parameters were replaced or flattened after the scheduler was created (accelerator.prepare does this "
            "under DeepSpeed or FSDP with flattened parameters). Create the scheduler after accelerator.prepare, "
            "with the prepared model and optimizer"
        )

    def _check_ranks_agree(self) -> None:
        """Identical selections on every rank need identical inputs: the same config, total_steps and initial indices.
        Compared once, at creation (one small all-gather); a difference is an error naming it and the ranks."""

        def plain(value):
            return sorted(value) if isinstance(value, (set, frozenset)) else str(value)

        config = {k: v for k, v in self.config.to_dict().items() if k not in ("base_model_name_or_path", "revision", "peft_version")}
        mine = {f"config.{k}": json.dumps(v, sort_keys=True, default=plain) for k, v in config.items()}
        mine["total_steps"] = str(self.total_steps)
        for m in self.layers:  # (a checksum of each layer's indices: their count, sum and sum of squares)
            idx = m.sparse_indices[self.adapter_name].long()
            mine[f"indices of {m.module_name}"] = f"{idx.numel()}:{int(idx.sum())}:{int((idx.double() ** 2).sum())}"
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        for rank, other in enumerate(everyone):
            differs = sorted(k for k in set(other) | set(everyone[0]) if other.get(k) != everyone[0].get(k))
            if differs:
                key = differs[0]
                raise ValueError(
                    f"ranks disagree on the SpIEL setup, so their reselections would differ: rank {rank} has {key}="
                    f"{other.get(key)} but rank 0 has {everyone[0].get(key)} ({len(differs)} difference(s); e.g. a different "
                    "seed, config or total_steps per rank — build the same adapter and scheduler on every rank)"
                )


def spiel_layers(model, adapter_name: str) -> list:
    """The layers of ``model`` that hold ``adapter_name``'s sparse values, in model order."""
    return [m for m in model.modules() if isinstance(m, SparseLayer) and adapter_name in m.sparse_values]
