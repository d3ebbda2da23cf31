"""``SpIELScheduler``: when SpIEL reselects (the loop, its estimation windows); what one reselection does is
:mod:`.reselect`, what is checked before a run :mod:`.checks`, saving and resuming :mod:`.state`."""

from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from ...core import kernels
from ...core.tuner import SparseTuner
from ...optim.sm3 import SM3
from ...optim.surgery import check_supported
from ...optim.zero import ZeroStateBridge, find_zero_optimizer
from ...schedules.learning_rate import warn_if_rate_not_decayed
from ...schedules.reselection import in_estimation_window, is_reselection_step, released_in_estimation_window
from .adaptive import uniform_quotas
from .checks import SchedulerChecks, find_spiel_adapter, spiel_layers
from .model import SpIELModel
from .reselect import Reselections
from .routing import RoutedTokens
from .rules import released
from .seeding import DeferredSeeding
from .state import SchedulerState
from .statistics import InputOutputStatistics, RowColumnAccumulators, _WindowStatistics, _end_steps, distributed

_find_spiel_adapter = find_spiel_adapter  # (the name other modules imported)


class SpIELScheduler(SchedulerChecks, Reselections, SchedulerState):
    """Drives SpIEL's reselections from optimizer steps; works with any training loop.

    Call :meth:`step` once after every optimizer step (t = 1 … ``total_steps``). It arms the dense-
    gradient seam of the adapted layers for the backward passes of estimation-window steps (AG),
    reselects at t = γ, γ+S, … and edits values, indices, ages and optimizer state in place. The
    optimizer must hold the adapter's values: ``torch.optim.AdamW``/``Adam`` (not amsgrad),
    :class:`peft_sparse.AgedAdamW` or :class:`peft_sparse.SM3` for AG and MA (MA ranks growth by SM3's row and column accumulators: SM3's own,
    or under any other of these optimizers the same accumulators, kept by the scheduler from each step's gradients;
    with ``ma_signal='io'`` by the estimation window's output-gradient and input sums instead, under any of them).
    """

    def __init__(self, model, optimizer, total_steps: int, adapter_name: Optional[str] = None):
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps <= 0:
            raise ValueError(f"total_steps must be a positive integer, got total_steps={total_steps!r}")
        self.model, tuner, self.adapter_name, self.config = find_spiel_adapter(model, adapter_name)
        self.total_steps = total_steps
        self.S, self.gamma = self.config.steps_for(total_steps)  # (fractions of total_steps resolved)
        self.first_full = self.config.first_replacement_is_full(total_steps)  # (first_full_replacement='auto' resolved)
        self.layers = spiel_layers(self.model, self.adapter_name)
        # DeepSpeed ZeRO: reselections edit a shadow AdamW holding the values' gathered state (optim.zero)
        zero = find_zero_optimizer(optimizer)
        if zero is not None:
            self._refuse_under_zero(zero)
        what = "SpIEL-MA" if self.config.growth == "ma" else "SpIEL-AG"
        self._zero = ZeroStateBridge(zero, self.layers, self.adapter_name, what=what) if zero is not None else None
        self.optimizer = self._zero.shadow if self._zero is not None else check_supported(optimizer)
        self._check_optimizer_holds_values(created=True)
        self._check_reference_optimizer()
        # SpIEL-MA ranks growth by SM3's row and column accumulators: SM3's own, or (any other optimizer) the
        # same accumulators kept here from the gradients each optimizer step sees (under ZeRO: the reduced
        # gradients it holds when its step starts); with ma_signal='io' nothing reads them (the window's sums
        # rank the growth), unless the grown weights' seeds are SM3's cover
        self.ma_accumulators: Optional[RowColumnAccumulators] = None
        self._ma_hook = None
        read = self.config.ma_signal == "sm3" or self._ma_seeds == "cover"
        if self.config.growth == "ma" and not isinstance(self.optimizer, SM3) and read:
            self.ma_accumulators = RowColumnAccumulators(self.layers, self.adapter_name)
            if self._zero is not None:
                self._ma_hook = self._zero.before_step(self._accumulate_under_zero)
            else:
                self._ma_hook = self.optimizer.register_step_pre_hook(self.ma_accumulators.update)
        self.t = 0
        self.steps_in_window = 0
        self.statistics: dict[str, _WindowStatistics] = {}
        self.seeding = None
        if self.config.growth == "ag":  # Adam's second moment of grown weights (reference='authors': both, with ages)
            self.seeding = DeferredSeeding(self.optimizer, [m.sparse_values[self.adapter_name] for m in self.layers],
                                           first_moment=released(self.config, "seeds"))  # fmt: skip
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

    def _attach_guard(self, tuner) -> None:
        guard = self._guard = tuner.__dict__.get("_guard") if isinstance(tuner, SpIELModel) else None
        if guard is not None:
            guard.attach(self)

    def __setstate__(self, state: dict) -> None:
        # a copy (deepcopy, pickling) drives its copy of the model: its guard is this scheduler's
        self.__dict__.update(state)
        self._attach_guard(find_spiel_adapter(self.model, self.adapter_name)[1])

    # -- windows
    @property
    def uses_windows(self) -> bool:
        """Whether reselections rank growth by an estimation window's statistics: AG's candidates, or MA's
        input/output statistics (``ma_signal='io'``)."""
        return self.config.growth == "ag" or self.config.ma_signal == "io"

    def _in_window(self, t: int) -> bool:
        """Whether the backward passes of step t feed a window: the γ steps before each reselection, or with
        ``reference='authors'`` the released trainer's windows (γ + 1 steps after the first)."""
        window = released_in_estimation_window if released(self.config, "windows") else in_estimation_window
        return self.uses_windows and window(t, self.S, self.gamma, self.total_steps)

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
                stats = _WindowStatistics(min(grid.numel, num_units), grid, dtype, self.config.score_normalization,
                                          micro_batches=released(self.config, "seeds"))  # fmt: skip
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
        warn_if_rate_not_decayed(self._zero.zero if self._zero is not None else self.optimizer, t, self.total_steps)
        if self.statistics:
            self._end_window_step()
        self.last_statistics = {}
        if is_reselection_step(t, self.S, self.gamma, self.total_steps):
            self.last_statistics = self._reselect(t)
            self._disarm()
            self.routing.start()
            if self.config.drop_criterion == "change":
                self._snapshot_drop_reference()
        self._arm_if_window(t + 1)
        return self.last_statistics

    def _end_window_step(self) -> None:
        if self.config.growth == "ma":  # (the io statistics add up in the backward passes themselves)
            self.steps_in_window += 1
            return
        if distributed():
            # every rank's step sums averaged, one reduction (reference='authors' averaged each micro-batch already)
            sums = [s.step_sum for s in self.statistics.values() if s.candidates is not None and not s.micro_batches]
            if sums:
                flat = torch.cat(sums)
                dist.all_reduce(flat)
                flat /= dist.get_world_size()
                for t, part in zip(sums, flat.split([t.numel() for t in sums])):
                    t.copy_(part)
        if self.steps_in_window == 0:  # candidates chosen: their block kernel's plans, all layers at once —
            # and the values' plans for the later steps, where both kernels may form X from two factors
            layouts = [s.candidate_blocks for s in self.statistics.values()]
            layouts += [layer.cached_block_metadata(self.adapter_name) for layer in self.layers]
            kernels.prepare_block_plans(layouts, x_reads=(1, 2))
        _end_steps(list(self.statistics.values()))
        self.steps_in_window += 1
