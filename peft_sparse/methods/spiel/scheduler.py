"""``SpIELScheduler``: when SpIEL reselects, and the edits of one reselection."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ... import accel
from ...core import edit, kernels
from ...core.layer import SparseLayer
from ...core.selection import BlockGrid
from ...core.tuner import SparseTuner
from ...optim.sm3 import SM3
from ...optim.surgery import check_supported
from ...optim.zero import ZeroStateBridge, find_zero_optimizer
from ...schedules.reselection import apportioned_replacement_counts, in_estimation_window, is_reselection_step, replacement_count
from .adaptive import reselect_adaptive, uniform_quotas
from .batched import AllReselections, TensorReselection, _starts, reselect_all
from .config import SpIELConfig
from .model import SpIELModel
from .routing import RoutedTokens
from .seeding import DeferredSeeding
from .selection import reselect_ag, reselect_ma
from .state import SchedulerState
from .statistics import InputOutputStatistics, RowColumnAccumulators, _WindowStatistics, _end_steps, distributed



def _find_spiel_adapter(model, adapter_name: Optional[str]):
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


def _candidate_units(item: TensorReselection) -> int:
    """How many candidate units (weights, or blocks) an AG tensor's window chose."""
    if item.grid.unit > 1 and item.candidate_units is not None:
        return item.candidate_units.numel()
    return item.candidates.numel() // item.grid.unit


@dataclass
class _GroupEdit:
    """What :meth:`SpIELScheduler._apply_all` did to a group of tensors: its report sums (device: age of
    the dropped, age of the kept, indices not active before), counts, and how to undo what a failed
    condition left (block layouts, seeds, merges set up anew)."""

    sums: torch.Tensor
    replaced: int
    shortfall: int
    undo: Callable[[], None]


class SpIELScheduler(SchedulerState):
    """Drives SpIEL's reselections from optimizer steps; works with any training loop.

    Call :meth:`step` once after every optimizer step (t = 1 … ``total_steps``). It arms the dense-
    gradient seam of the adapted layers for the backward passes of estimation-window steps (AG),
    reselects at t = γ, γ+S, … and edits values, indices, ages and optimizer state in place. The
    optimizer must hold the adapter's values: ``torch.optim.AdamW``/``Adam`` (not amsgrad) or
    :class:`peft_sparse.SM3` for AG and MA (MA ranks growth by SM3's row and column accumulators: SM3's own,
    or under any other of these optimizers the same accumulators, kept by the scheduler from each step's gradients;
    with ``ma_signal='io'`` by the estimation window's output-gradient and input sums instead, under any of them).
    """

    def __init__(self, model, optimizer, total_steps: int, adapter_name: Optional[str] = None):
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps <= 0:
            raise ValueError(f"total_steps must be a positive integer, got total_steps={total_steps!r}")
        self.model, tuner, self.adapter_name, self.config = _find_spiel_adapter(model, adapter_name)
        self.total_steps = total_steps
        self.S, self.gamma = self.config.steps_for(total_steps)  # (fractions of total_steps resolved)
        self.first_full = self.config.first_replacement_is_full(total_steps)  # (first_full_replacement='auto' resolved)
        self.layers = [m for m in self.model.modules() if isinstance(m, SparseLayer) and self.adapter_name in m.sparse_values]
        # DeepSpeed ZeRO: reselections edit a shadow AdamW holding the values' gathered state (optim.zero)
        zero = find_zero_optimizer(optimizer)
        if zero is not None:
            self._refuse_under_zero(zero)
        what = "SpIEL-MA" if self.config.growth == "ma" else "SpIEL-AG"
        self._zero = ZeroStateBridge(zero, self.layers, self.adapter_name, what=what) if zero is not None else None
        self.optimizer = self._zero.shadow if self._zero is not None else check_supported(optimizer)
        self._check_optimizer_holds_values(created=True)
        # SpIEL-MA ranks growth by SM3's row and column accumulators: SM3's own, or (any other optimizer) the
        # same accumulators kept here from the gradients each optimizer step sees (under ZeRO: the reduced
        # gradients it holds when its step starts)
        self.ma_accumulators: Optional[RowColumnAccumulators] = None
        self._ma_hook = None
        if self.config.growth == "ma" and not isinstance(self.optimizer, SM3):
            self.ma_accumulators = RowColumnAccumulators(self.layers, self.adapter_name)
            if self._zero is not None:
                self._ma_hook = self._zero.before_step(self._accumulate_under_zero)
            else:
                self._ma_hook = self.optimizer.register_step_pre_hook(self.ma_accumulators.update)
        self.t = 0
        self.steps_in_window = 0
        self.statistics: dict[str, _WindowStatistics] = {}
        self.seeding = None
        if self.config.growth == "ag":
            self.seeding = DeferredSeeding(self.optimizer, [m.sparse_values[self.adapter_name] for m in self.layers],
                                           first_moment=self.config.seed_moments == "both")  # fmt: skip
        self.last_statistics: dict = {}
        # φ₀ of each tensor (drop_criterion="change"): its values right after the last reselection
        self.drop_reference: dict[str, torch.Tensor] = {}
        if self.config.drop_criterion == "change":
            self._snapshot_drop_reference()
        if distributed():
            if self.config.budget_split == "adaptive":
                raise ValueError("budget_split='adaptive' resizes the values, which DDP and FSDP buckets cannot follow; use 'uniform' or 'lora' on several processes")
            self._check_ranks_agree()
        self._attach_guard(tuner)
        self.routing = RoutedTokens(self.model, self.layers)  # experts of fused MoE tensors: the no-token rule (.routing)
        self.routing.start()
        self._arm_if_window(1)

    def _accumulate_under_zero(self) -> None:
        """SpIEL-MA beside Adam under ZeRO: the accumulators from the gradients ZeRO reduced, at the start of its
        step, clipped as that step will clip them (as a step pre-hook sees them without ZeRO); a step it skips (fp16
        overflow) adds nothing."""
        grads = self._zero.full_gradients()
        if grads is not None:
            self.ma_accumulators.update(gradient=lambda values: grads.get(id(values)))

    def _refuse_under_zero(self, zero) -> None:
        """What DeepSpeed ZeRO's flat partitions cannot follow, refused by name."""
        if self.config.budget_split == "adaptive":
            raise ValueError("SpIEL with budget_split='adaptive' does not run under DeepSpeed ZeRO: resized values cannot "
                             "follow ZeRO's flat buffers; use budget_split 'uniform' or 'lora', or DDP / FSDP2")  # fmt: skip
        if self.config.growth == "ma" and isinstance(zero.optimizer, SM3):
            raise ValueError("SpIEL with growth='ma' and the SM3 optimizer does not run under DeepSpeed ZeRO: SM3's row and "
                             "column accumulators are not kept in ZeRO's flat partitions; train MA beside AdamW there "
                             "(the scheduler keeps the accumulators), or use DDP / FSDP2")  # fmt: skip
        if self.config.growth == "ma" and self.config.seed_moments == "second":
            raise ValueError("seed_moments='second' for SpIEL-MA does not run under DeepSpeed ZeRO (the moments are "
                             "partitioned between reselections); leave seed_moments at 'none'")  # fmt: skip

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

    def _attach_guard(self, tuner) -> None:
        guard = self._guard = tuner.__dict__.get("_guard") if isinstance(tuner, SpIELModel) else None
        if guard is not None:
            guard.attach(self)

    def __setstate__(self, state: dict) -> None:
        # a copy (deepcopy, pickling) drives its copy of the model: its guard is this scheduler's
        self.__dict__.update(state)
        self._attach_guard(_find_spiel_adapter(self.model, self.adapter_name)[1])

    # -- windows
    @property
    def uses_windows(self) -> bool:
        """Whether reselections rank growth by an estimation window's statistics: AG's candidates, or MA's
        input/output statistics (``ma_signal='io'``)."""
        return self.config.growth == "ag" or self.config.ma_signal == "io"

    def _in_window(self, t: int) -> bool:
        return self.uses_windows and in_estimation_window(t, self.S, self.gamma, self.total_steps)

    def _arm_if_window(self, next_t: int) -> None:
        if self._in_window(next_t) and not self.statistics:
            self.steps_in_window = 0
            self.routing.start()
            if self.config.growth == "ma":  # ma_signal='io': Σ (∂L/∂Y)² per row and Σ X² per column, per tensor
                for layer in self.layers:
                    values = layer.sparse_values[self.adapter_name]
                    dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
                    stats = InputOutputStatistics(layer.out_features, layer.in_features, values.device, dtype)
                    self.statistics[layer.module_name] = layer.dense_grad_consumer = stats
                return
            quotas = uniform_quotas(self.layers, self.adapter_name) if self.config.budget_split == "adaptive" else None
            for layer in self.layers:
                values = layer.sparse_values[self.adapter_name]
                dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
                grid = SparseTuner.grid(self.config, layer)
                d = quotas[layer.module_name] if quotas else layer.sparse_indices[self.adapter_name].numel()  # (adaptive: the uniform quota; indices: never partitioned)
                num_units = math.ceil(self.config.candidate_ratio * (d // grid.unit))  # K = ⌈ratio·d_φ⌉ (in units)
                stats = _WindowStatistics(min(grid.numel, num_units), grid, dtype, self.config.score_normalization)
                self.statistics[layer.module_name] = stats
                layer.dense_grad_consumer = stats

    @torch.no_grad()
    def _snapshot_drop_reference(self) -> None:
        self.drop_reference = {m.module_name: m.sparse_values[self.adapter_name].detach().clone() for m in self.layers}

    def _disarm(self) -> None:
        for layer in self.layers:
            layer.dense_grad_consumer = None
        self.statistics = {}
        self.steps_in_window = 0

    def close(self) -> None:
        """Stop feeding statistics and remove the hooks (e.g. at the end of training); training the adapter on
        without a scheduler is watched again (the unscheduled-training warning)."""
        self._disarm()
        self.routing.stop()
        if self.seeding is not None:
            self.seeding.pending = {}
            self.seeding.remove()
        if self._guard is not None:
            self._guard.detach(self)
        if self._ma_hook is not None:
            self._ma_hook.remove()
            self._ma_hook = None

    # -- the loop
    def step(self) -> dict:
        """Advance to the next optimizer step; returns reselection statistics when one happened."""
        self.t += 1
        t = self.t
        if t == self.total_steps + 1:  # (once: the schedule ends at total_steps, training may go on with fixed indices)
            warnings.warn(
                f"SpIELScheduler: step {t} is past total_steps={self.total_steps}; the schedule has ended and the "
                "indices stay as they are from here on (set total_steps to the number of optimizer steps)"
            )
        if self.statistics:
            self._end_window_step()
        self.last_statistics = {}
        if is_reselection_step(t, self.S, self.gamma, self.total_steps):
            self.last_statistics = self._reselect(t)
            self._disarm()
            self.routing.start()
            if self.ma_accumulators is not None and self.last_statistics and self.config.seed_moments == "second":
                self.ma_accumulators.seed_second_moments(self.optimizer, t)
            if self.config.drop_criterion == "change":
                self._snapshot_drop_reference()
        self._arm_if_window(t + 1)
        return self.last_statistics

    def _end_window_step(self) -> None:
        if self.config.growth == "ma":  # (the io statistics add up in the backward passes themselves)
            self.steps_in_window += 1
            return
        if distributed():
            live = [s for s in self.statistics.values() if s.candidates is not None]
            if live:
                flat = torch.cat([s.step_sum for s in live])
                dist.all_reduce(flat)
                flat /= dist.get_world_size()
                for s, part in zip(live, flat.split([s.step_sum.numel() for s in live])):
                    s.step_sum.copy_(part)
        if self.steps_in_window == 0:  # candidates chosen: their block kernel's plans, all layers at once —
            # and the values' plans for the later steps, where both kernels may form X from two factors
            layouts = [s.candidate_blocks for s in self.statistics.values()]
            layouts += [layer.cached_block_metadata(self.adapter_name) for layer in self.layers]
            kernels.prepare_block_plans(layouts, x_reads=(1, 2))
        _end_steps(list(self.statistics.values()))
        self.steps_in_window += 1

    def _active_units(self, layer: SparseLayer, grid: BlockGrid) -> Optional[torch.Tensor]:
        """The ascending active blocks of a block adapter, from the layer's cached metadata."""
        if grid.unit == 1:
            return None
        return layer.block_metadata(self.adapter_name).block_numbers()

    @torch.no_grad()
    def _reselect(self, t: int) -> dict:
        if self._zero is None:
            return self._reselect_here(t)
        with self._zero.editing():  # (gathers the values' optimizer state, writes it back after the edit)
            report = self._reselect_here(t)
            if self.seeding is not None:
                self.seeding.apply_now()  # (ZeRO frees gradients as it reduces them: seeds at scale 1, now)
        return report

    @torch.no_grad()
    def _reselect_here(self, t: int) -> dict:
        """Drop/grow every tensor, then edit values, ages, indices and optimizer state in place.

        All tensors of a device are reselected together (:func:`reselect_all`: a handful of launches
        for all of them, no host synchronisation for AG), and the edits are gathered once over the
        concatenation. AG's result carries a device flag (enough eligible candidates, finite scores);
        where no shortfall is possible its edits are conditioned on the flag on the device and one host
        synchronisation, with the report's, reads it — a fallen flag means the edits changed nothing,
        and the checked path then runs (a NaN score raises with the adapter's contents untouched).
        Otherwise (several devices, or fewer candidates than active units) every flag is read first
        and nothing is edited before every group is checked."""
        c, name = self.config, self.adapter_name
        self._check_optimizer_holds_values()
        if c.budget_split == "adaptive":  # one drop/grow over all tensors: budget moves between them (.adaptive)
            return reselect_adaptive(self, t)
        by_device: dict = {}  # device → [(layer, TensorReselection, AG's window statistics)]
        io = self.statistics if c.growth == "ma" and c.ma_signal == "io" else None
        if io and distributed():  # every rank's sums, one reduction for all tensors
            live = list(io.values())
            both = torch.cat([torch.cat([s.row_sum, s.col_sum]) for s in live])
            dist.all_reduce(both)
            for s, part in zip(live, both.split([s.row_sum.numel() + s.col_sum.numel() for s in live])):
                s.row_sum.copy_(part[: s.row_sum.numel()])
                s.col_sum.copy_(part[s.row_sum.numel() :])
        idle = self.routing.idle()  # experts no token reached in the window keep their indices (.routing)
        grids = [SparseTuner.grid(c, layer) for layer in self.layers]
        units = [layer.sparse_values[name].numel() // grid.unit for layer, grid in zip(self.layers, grids)]
        if c.replacement_rounding == "apportioned":  # the step's ⌊ξ(t)·Σ d_φ⌋ split by largest remainder (.reselection)
            counts = apportioned_replacement_counts(t, self.total_steps, units, c.initial_reselection_rate, c.schedule, self.gamma,
                                                    self.first_full, turn=(t - self.gamma) // self.S)  # fmt: skip
        else:  # Eq. 7.6 per tensor, in units: weights, or blocks
            counts = [replacement_count(t, self.total_steps, u, c.initial_reselection_rate, c.schedule, self.gamma, self.first_full)
                      for u in units]  # fmt: skip
        for layer, grid, k in zip(self.layers, grids, counts):
            values, indices = layer.sparse_values[name], layer.sparse_indices[name]
            d = values.numel()
            if k == 0 or d == 0 or layer.module_name in idle:
                continue
            item = TensorReselection(values, indices, k, grid, self._active_units(layer, grid))
            if c.drop_criterion == "change":  # Algorithm 2, line 10: |φ − φ₀|, the change since the last reselection
                item.drop_values = values.detach() - self.drop_reference[layer.module_name]
            stats = None
            if c.growth == "ag":
                stats = self.statistics.get(layer.module_name)
                if stats is None or stats.candidates is None:
                    warnings.warn(f"SpIEL: {layer.module_name} got no gradient in the estimation window; not reselected")
                    continue
                item.candidates, item.score = stats.candidates, stats.growth_score()  # ĝ up to 1/γ (|·| ranks)
                item.candidate_units = stats.candidate_units if grid.unit > 1 else None
            elif io is not None:
                signal = io.get(layer.module_name)
                if signal is None or signal.seen == 0:
                    warnings.warn(f"SpIEL: {layer.module_name} got no gradient in the estimation window; not reselected")
                    continue
                item.row_acc, item.col_acc = signal.row_sum, signal.col_sum
            elif self.ma_accumulators is not None:
                item.row_acc, item.col_acc = self.ma_accumulators.views[layer.module_name]
            else:
                state = self.optimizer.state.get(values)
                if not state:
                    warnings.warn(f"SpIEL-MA: {layer.module_name} has no SM3 state yet; not reselected")
                    continue
                item.row_acc, item.col_acc = state["row_accumulator"], state["col_accumulator"]
            by_device.setdefault(values.device, []).append((layer, item, stats))
        results = []  # (group, result, ok: a bool, or the device flag its edits are conditioned on)
        for group in by_device.values():
            items = [item for _, item, _ in group]
            if not accel.ON:  # the reference: Algorithms 2–3 tensor by tensor (the batched selection is a fast path)
                results.append((group, self._per_tensor(group), True))
                continue
            result = reselect_all(items, c.growth, c.column_cap, c.ma_unseen, c.ma_regrow_dropped)
            if c.growth == "ma":  # (MA's selection has no flag: it always succeeds)
                results.append((group, result, True))
            elif len(by_device) == 1 and all(_candidate_units(it) >= it.values.numel() // it.grid.unit for it in items):
                # no shortfall possible (SpIEL's K ≥ d_φ): the flag only falls for a non-finite score. The
                # edits go ahead conditioned on it on the device and the report's one host synchronisation
                # checks it, so the host issues them while the device still finishes the step
                results.append((group, result, result.ok))
            else:
                results.append((group, result, bool(result.ok)))
        checked = {at: self._per_tensor(group) for at, (group, _, ok) in enumerate(results) if ok is False}  # (all before any edit)
        edits = [self._apply_all(t, group, checked.get(at, result), None if isinstance(ok, bool) else ok)
                 for at, (group, result, ok) in enumerate(results)]  # fmt: skip
        flags = [(at, ok) for at, (_, _, ok) in enumerate(results) if not isinstance(ok, bool)]
        report, down = self._report(t, edits, flags)
        if down:  # the edits of these groups changed nothing: their layouts back, their seeds dropped, and
            for at in down:  # the checked path (which raises on a non-finite score, the adapter as it was)
                edits[at].undo()
                edits[at] = self._apply_all(t, results[at][0], self._per_tensor(results[at][0]), None)
            report, _ = self._report(t, edits, [])
        return report

    def _per_tensor(self, group: list) -> AllReselections:
        """The group's reselection tensor by tensor (:mod:`.selection`), checked: fewer eligible AG candidates
        than k shrink k (reported as a shortfall); a non-finite score raises, nothing edited."""
        items = [it for _, it, _ in group]
        per_tensor = []
        for it in items:
            ranked = it.values if it.drop_values is None else it.drop_values  # (what DROP ranks by magnitude)
            if self.config.growth == "ag":
                per_tensor.append(reselect_ag(ranked, it.indices, it.k, it.candidates, it.score.abs(), it.grid, it.units, it.candidate_units))
            else:
                per_tensor.append(reselect_ma(ranked, it.indices, it.k, it.row_acc, it.col_acc, it.grid, it.units, self.config.column_cap,
                                              self.config.ma_unseen, self.config.ma_regrow_dropped))
        return AllReselections.of_tensors(items, per_tensor)

    def _apply_all(self, t: int, group: list, result: AllReselections, condition: Optional[torch.Tensor]) -> "_GroupEdit":
        """Edit a group of tensors from one result through the core's mask-editing API (values, ages,
        indices, merges, block layouts, optimizer state), then queue the AG seeds of the grown slots.
        ``condition`` (a device flag): the edits hold only where it is True; the returned edit's ``undo``
        then puts back the old block layouts, the seeds as they were, and θ₀ where a merge was set up anew."""
        c = self.config
        layers = [layer for layer, _, _ in group]
        values = [layer.sparse_values[self.adapter_name] for layer in layers]
        n_grown = sum(result.dropped)
        ag = group[0][2] is not None
        new_values = None
        if ag:  # the window's mean gradient ĝ and mean squared gradient ŝ of every grown slot
            n = max(1, self.steps_in_window)
            slots = torch.nonzero_static(result.source < 0, size=n_grown).squeeze(1)  # ascending: tensor by tensor
            rows = result.grown_from[slots]
            grad_mean = torch.cat([stats.grad_sum for _, _, stats in group])[rows] / n
            grad_sq_mean = torch.cat([stats.grad_sq_sum for _, _, stats in group])[rows] / n
            dev = slots.device
            if c.grow_init == "gradient":  # −lr·γ·ĝ/(√ŝ + ε): the window's γ Adam steps, free of any gradient scale
                lr, eps = self._step_settings(values, result.dropped, dev)
                new_values = torch.zeros(result.source.numel(), dtype=grad_mean.dtype, device=dev)
                new_values[slots] = -lr * n * grad_mean / (grad_sq_mean.sqrt() + eps)
        done = edit.edit_slots(
            layers, self.adapter_name, result.source, result.new_indices, optimizer=self.optimizer, step=t, new_values=new_values,
            block_units=result.units, block_layouts=result.block_metadata, condition=condition,
        )  # fmt: skip
        grown, old_ages = done.new, done.old_ages
        age_before = (t - old_ages.long()).sum()
        kept_age = torch.where(grown, 0, t - old_ages[done.source.clamp(min=0)].long()).sum()
        waiting: dict = {}
        if ag and c.seed_moments != "none":  # AG: seeds for the next optimizer step
            starts = _starts(result.sizes)  # each tensor's first slot: the grown slots become slots of their own tensor
            local = slots - torch.repeat_interleave(kernels.table(starts, dev), kernels.table(result.dropped, dev), output_size=n_grown)
            pieces = zip(torch.split(local, result.dropped), torch.split(grad_mean, result.dropped), torch.split(grad_sq_mean, result.dropped))
            for value, (s, g, s2) in zip(values, pieces):
                if id(value) in self.seeding.pending:  # (seeds of an earlier reselection no step has taken yet)
                    waiting[id(value)] = self.seeding.pending[id(value)]
                self.seeding.pending[id(value)] = (s, g, s2)

        def undo():
            done.undo()
            if self.seeding is not None:
                for value in values:
                    self.seeding.pending.pop(id(value), None)
                self.seeding.pending.update(waiting)

        sums = torch.stack([age_before - kept_age, kept_age, result.changed.to(age_before.device)])
        return _GroupEdit(sums, n_grown, result.shortfall, undo)

    def _step_settings(self, values: list, counts: list, device) -> tuple[torch.Tensor, float]:
        """(the learning rate of each grown slot's tensor, repeated per slot; the optimizer's ε)."""
        group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        lrs = [float(group_of[id(v)]["lr"]) for v in values]
        eps = float(group_of[id(values[0])].get("eps", 1e-8))
        return torch.repeat_interleave(kernels.table(lrs, device, torch.float64), kernels.table(counts, device)).float(), eps

    def _report(self, t: int, edits: list, flags: list) -> tuple[dict, list]:
        """The reselection's statistics and the positions of the groups whose flag (``flags``: (position,
        device flag) pairs) is down, read in one host synchronisation."""
        total = sum(layer.sparse_values[self.adapter_name].numel() for layer in self.layers)
        replaced, shortfall = sum(e.replaced for e in edits), sum(e.shortfall for e in edits)
        numbers = [e.sums.double() for e in edits] + [ok.reshape(1).double().to(edits[0].sums.device) for _, ok in flags]
        read = torch.cat([torch.stack(numbers[: len(edits)]).sum(0), *numbers[len(edits) :]]).tolist() if edits else [0, 0, 0]
        dropped_age, kept_age, changed = read[:3]
        down = [at for (at, _), ok in zip(flags, read[3:]) if not ok]
        out = {
            "spiel/step": t,
            "spiel/replaced": replaced,
            "spiel/fraction_changed": changed / max(1, total),
            "spiel/mean_age_dropped": dropped_age / max(1, replaced),
            "spiel/mean_age_kept": kept_age / max(1, total - replaced),
        }
        if shortfall:
            out["spiel/shortfall"] = shortfall
            if not down:
                warnings.warn(f"SpIEL step {t}: {shortfall} fewer weights replaced than scheduled (not enough eligible candidates)")
        return out, down
