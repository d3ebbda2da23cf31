"""One SpIEL reselection: every tensor's k(t), its drop and grow (:mod:`.selection`, or :mod:`.batched` for all
tensors at once), and the edits of values, ages, indices and optimizer state through the core's edit API."""

from __future__ import annotations

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
from ...optim.surgery import seed_optimizer_states
from ...schedules.reselection import released_replacement_count, replacement_count
from .adaptive import reselect_adaptive
from .batched import AllReselections, TensorReselection, _starts, reselect_all
from .rules import released
from .selection import reselect_ag, reselect_ma
from .statistics import distributed


def _candidate_units(item: TensorReselection) -> int:
    """How many candidate units (weights, or blocks) an AG tensor's window chose."""
    if item.grid.unit > 1 and item.candidate_units is not None:
        return item.candidate_units.numel()
    return item.candidates.numel() // item.grid.unit


@dataclass
class _GroupEdit:
    """What :meth:`Reselections._apply_all` did to a group of tensors: its report sums (device: age of the
    dropped, age of the kept, indices not active before), counts, and how to undo what a failed condition left
    (block layouts, seeds, merges set up anew)."""

    sums: torch.Tensor
    replaced: int
    shortfall: int
    undo: Callable[[], None]


class Reselections:
    """The reselection of :class:`~peft_sparse.methods.spiel.scheduler.SpIELScheduler` (a mixin)."""

    def replacement_counts(self, t: int, units: list) -> list:
        """k(i, t) of every tensor at reselection step t, in units (weights, or blocks): Eq. 7.6 (or E.1) per tensor,
        or the released code's floating-point count with ``reference='authors'``."""
        c = self.config
        if released(c, "count"):
            return [released_replacement_count(t, self.total_steps, u, c.initial_reselection_rate, c.schedule, self.gamma) for u in units]
        return [replacement_count(t, self.total_steps, u, c.initial_reselection_rate, c.schedule, self.gamma, self.first_full) for u in units]

    @torch.no_grad()
    def _reselect(self, t: int) -> dict:
        if self._zero is None:
            return self._reselect_here(t)
        with self._zero.editing():  # (gathers the values' optimizer state, writes it back after the edit)
            report = self._reselect_here(t)
            if self.seeding is not None:
                self.seeding.apply_now()  # (ZeRO frees gradients as it reduces them: seeds at scale 1, now)
        return report

    def _active_units(self, layer: SparseLayer, grid: BlockGrid) -> Optional[torch.Tensor]:
        """The ascending active blocks of a block adapter, from the layer's cached metadata."""
        if grid.unit == 1:
            return None
        return layer.block_metadata(self.adapter_name).block_numbers()

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
        and nothing is edited before every group is checked. ``reference='authors'`` takes the checked
        per-tensor path (:mod:`.selection`) throughout."""
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
        for layer, grid, k in zip(self.layers, grids, self.replacement_counts(t, units)):
            values, indices = layer.sparse_values[name], layer.sparse_indices[name]
            if k == 0 or values.numel() == 0 or layer.module_name in idle:
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
        released_selection = released(c, "keep_regrown") or released(c, "no_regrowth")  # (rules of the per-tensor selection)
        for group in by_device.values():
            items = [item for _, item, _ in group]
            if not accel.ON or released_selection:  # Algorithms 2–3 tensor by tensor (the batched selection is a fast path)
                results.append((group, self._per_tensor(group), True))
                continue
            result = reselect_all(items, c.growth)
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
        if self.seeding is not None and released(c, "seeds"):
            self.seeding.apply_now()  # (the released code seeds when it reselects, from the raw window statistics)
        return report

    def _per_tensor(self, group: list) -> AllReselections:
        """The group's reselection tensor by tensor (:mod:`.selection`), checked: fewer eligible AG candidates
        than k shrink k (reported as a shortfall); a non-finite score raises, nothing edited."""
        items = [it for _, it, _ in group]
        keep_regrown, exclude_active = released(self.config, "keep_regrown"), released(self.config, "no_regrowth")
        per_tensor = []
        for it in items:
            ranked = it.values if it.drop_values is None else it.drop_values  # (what DROP ranks by magnitude)
            if self.config.growth == "ag":
                per_tensor.append(reselect_ag(ranked, it.indices, it.k, it.candidates, it.score.abs(), it.grid, it.units, it.candidate_units,
                                              keep_regrown=keep_regrown))  # fmt: skip
            else:
                per_tensor.append(reselect_ma(ranked, it.indices, it.k, it.row_acc, it.col_acc, it.grid, it.units,
                                              exclude_active=exclude_active))  # fmt: skip
        return AllReselections.of_tensors(items, per_tensor)

    def _apply_all(self, t: int, group: list, result: AllReselections, condition: Optional[torch.Tensor]) -> _GroupEdit:
        """Edit a group of tensors from one result through the core's mask-editing API (values, ages,
        indices, merges, block layouts, optimizer state), then queue the AG seeds of the grown slots.
        ``condition`` (a device flag): the edits hold only where it is True; the returned edit's ``undo``
        then puts back the old block layouts, the seeds as they were, and θ₀ where a merge was set up anew."""
        layers = [layer for layer, _, _ in group]
        values = [layer.sparse_values[self.adapter_name] for layer in layers]
        n_grown = sum(result.dropped)
        ag = group[0][2] is not None
        if ag:  # the window's mean gradient ĝ and mean squared gradient ŝ of every grown slot
            slots = torch.nonzero_static(result.source < 0, size=n_grown).squeeze(1)  # ascending: tensor by tensor
            rows = result.grown_from[slots]
            n = [max(1, stats.samples if stats.micro_batches else self.steps_in_window) for _, _, stats in group]
            grad_mean = torch.cat([stats.grad_sum / m for (_, _, stats), m in zip(group, n)])[rows]
            grad_sq_mean = torch.cat([stats.grad_sq_sum / m for (_, _, stats), m in zip(group, n)])[rows]
        done = edit.edit_slots(
            layers, self.adapter_name, result.source, result.new_indices, optimizer=self.optimizer, step=t,
            block_units=result.units, block_layouts=result.block_metadata, condition=condition,
        )  # fmt: skip
        if not ag and self._ma_seeds_on():
            self._seed_ma(t, group, result, values)
        grown, old_ages = done.new, done.old_ages
        age_before = (t - old_ages.long()).sum()
        kept_age = torch.where(grown, 0, t - old_ages[done.source.clamp(min=0)].long()).sum()
        waiting: dict = {}
        if ag and self.seeding is not None:  # AG: seeds for the next optimizer step
            dev = slots.device
            starts = _starts(result.sizes)  # each tensor's first slot: the grown slots become slots of their own tensor
            local = slots - torch.repeat_interleave(kernels.table(starts, dev), kernels.table(result.dropped, dev), output_size=n_grown)
            pieces = zip(torch.split(local, result.dropped), torch.split(grad_mean, result.dropped), torch.split(grad_sq_mean, result.dropped))
            for value, (s, g, s2) in zip(values, pieces):
                if id(value) in self.seeding.pending:  # (seeds of an earlier reselection no step has taken yet)
                    waiting[id(value)] = self.seeding.pending[id(value)]
                self.seeding.pending[id(value)] = (s, g, s2, self.steps_in_window)

        def undo():
            done.undo()
            if self.seeding is not None:
                for value in values:
                    self.seeding.pending.pop(id(value), None)
                self.seeding.pending.update(waiting)

        sums = torch.stack([age_before - kept_age, kept_age, result.changed.to(age_before.device)])
        return _GroupEdit(sums, n_grown, result.shortfall, undo)

    # SpIEL-MA beside Adam: the second moment its grown slots start from. "neighbours" (the kept weights of the slot's
    # row and column) passed the dev families' rule and is the behaviour; None (zero moments, Adam's own start) and
    # "cover" (SM3's cover of the weight, which failed the rule) stay as the quality benchmark's ablations
    # (``--ma-seeds none|cover``; docs/quality-families.md).
    _ma_seeds: Optional[str] = "neighbours"

    def _ma_seeds_on(self) -> bool:
        return self._ma_seeds is not None and not isinstance(self.optimizer, SM3) and self.config.reference is None

    def _seed_ma(self, t: int, group: list, result: AllReselections, values: list) -> None:
        """Adam's second moment ŝ of SpIEL-MA's grown slots (i, j), where Adam would start them from zero moments
        and its bias correction by the global step then lets their first steps run to about 1.4 times the learning
        rate (a weight with a steady gradient takes one). ``"cover"``: SM3's cover, min(R_i, C_j) / t, where R and C sum t steps' squared gradients as the
        optimizer saw them (:class:`.statistics.RowColumnAccumulators`; SM3 itself gives a new weight exactly that
        cover). ``"neighbours"``: √(r_i · c_j) of the mean bias-corrected second moments of the kept weights in row i
        and in column j (the one that exists where the other has no kept weight; the tensor's mean where neither
        has; nothing where no weight was kept)."""
        n_grown = sum(result.dropped)
        if n_grown == 0 or t <= 0:
            return
        slots = torch.nonzero_static(result.source < 0, size=n_grown).squeeze(1)
        starts = _starts(result.sizes)
        dev = slots.device
        local = slots - torch.repeat_interleave(kernels.table(starts, dev), kernels.table(result.dropped, dev), output_size=n_grown)
        flat = result.new_indices[slots]
        seeded, where_seeded, seeds = [], [], []
        for (layer, _, _), value, idx, where in zip(group, values, torch.split(flat, result.dropped), torch.split(local, result.dropped)):
            if where.numel() == 0:
                continue
            rows, cols = kernels.rows_cols(idx, layer.in_features)
            if self._ma_seeds == "cover":
                row_acc, col_acc = self.ma_accumulators.views[layer.module_name]  # (also under ma_signal='io')
                seed = torch.minimum(row_acc[rows], col_acc[cols]) / t
            else:
                seed = self._neighbour_seeds(layer, value, where, rows, cols)
            if seed is not None:  # (None: no kept weight to seed from; the slots keep their zero moments and age)
                seeded.append(value)
                where_seeded.append(where)
                seeds.append(seed)
        if seeded:
            seed_optimizer_states(self.optimizer, seeded, where_seeded, seeds, seeds, first=False, ages=[t] * len(seeded))

    def _neighbour_seeds(self, layer, value, grown: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> Optional[torch.Tensor]:
        """``"neighbours"`` seeds of one tensor's grown slots (see :meth:`_seed_ma`), in the dtype of its Adam state;
        None where the tensor has no state yet or kept no weight."""
        state = self.optimizer.state.get(value)
        if not state or "exp_avg_sq" not in state:
            return None
        kept = torch.ones(state["exp_avg_sq"].numel(), dtype=torch.bool, device=grown.device)
        kept[grown] = False
        if grown.numel() == kept.numel():
            return None
        beta2 = next(g["betas"][1] for g in self.optimizer.param_groups if any(p is value for p in g["params"]))
        v = state["exp_avg_sq"].double()
        if "age" in state:  # AgedAdamW: a weight of age a has taken a − 1 steps
            steps = (state["age"].double() - 1.0).clamp(min=1.0)
        else:
            steps = torch.as_tensor(state["step"], dtype=torch.float64).to(v.device)
        s_hat = (v / (1.0 - beta2**steps))[kept]
        all_rows, all_cols = kernels.rows_cols(layer.sparse_indices[self.adapter_name], layer.in_features)
        means = []
        for at, size, ours in ((all_rows[kept], layer.out_features, rows), (all_cols[kept], layer.in_features, cols)):
            total = torch.zeros(size, dtype=torch.float64, device=v.device).index_add_(0, at, s_hat)
            count = torch.zeros(size, dtype=torch.float64, device=v.device).index_add_(0, at, torch.ones_like(s_hat))
            means += [(total / count.clamp(min=1))[ours], count[ours] > 0]
        r, has_r, c, has_c = means
        seed = torch.where(has_r & has_c, (r * c).sqrt(), torch.where(has_r, r, torch.where(has_c, c, s_hat.mean())))
        return seed.to(state["exp_avg_sq"].dtype)

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
