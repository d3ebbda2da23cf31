"""SpIEL's PEFT tuner: random initial indices, per-index ages, and a guard against training unscheduled."""

from __future__ import annotations

import warnings
import weakref

import torch

from ...core.layer import SparseLayer
from ...core.selection import module_generator, random_indices
from ...core.tuner import SparseTuner
from .config import SpIELConfig


class _UnscheduledTrainingGuard:
    """Warns once when a SpIEL adapter trains past its first reselection step with no scheduler.

    Without a scheduler nothing ever reselects, and SpIEL silently degrades to a random fixed mask.
    Counts training forward passes of one layer (≥ optimizer steps, so the warning is never late).
    ``idle`` while the attached scheduler lives: a steady layer pass then skips the call and its checks
    (see ``SparseLayer.forward``). A copy of the model (deepcopy, pickling) gets a guard of its own,
    attached to no scheduler: the copy has none.
    """

    def __init__(self):
        self.scheduler = None  # weakref to the attached SpIELScheduler
        self.idle = False
        self.first_reselection = None
        self._counted_layer = None
        self.forwards = 0
        self.warned = False

    def attach(self, scheduler) -> None:
        self.scheduler = weakref.ref(scheduler)
        self.idle = True
        weakref.finalize(scheduler, self._scheduler_gone)

    def _scheduler_gone(self) -> None:
        if self.scheduler is None or self.scheduler() is None:  # (not while a newer scheduler lives)
            self.idle = False

    def detach(self, scheduler) -> None:
        """``scheduler`` stopped driving the adapter (closed, e.g. at the end of a Trainer run): training on
        from here counts again, from zero."""
        if self.scheduler is not None and self.scheduler() is scheduler:
            self.scheduler, self.idle, self.forwards, self._counted_layer = None, False, 0, None

    def __getstate__(self):
        return {**self.__dict__, "scheduler": None, "idle": False, "_counted_layer": None}

    def __call__(self, layer) -> None:
        if self.warned or self.idle:  # (idle: an attached scheduler lives)
            return
        if self._counted_layer is None or self._counted_layer() is None:
            self._counted_layer = weakref.ref(layer)
        if self._counted_layer() is not layer:
            return
        self.forwards += 1
        if self.first_reselection is not None and self.forwards > self.first_reselection:
            self.warned = True
            warnings.warn(
                f"SpIEL adapter trained for {self.forwards} forward passes, past its first reselection step "
                f"({self.first_reselection}), with no SpIELScheduler attached: its indices never change and it is "
                "silently a random fixed mask. Pass callbacks=[peft_sparse.SpIELCallback()] to the Trainer, or call "
                "SpIELScheduler(model, optimizer, total_steps).step() after each optimizer step.",
                RuntimeWarning,
                stacklevel=3,
            )


class SpIELModel(SparseTuner):
    """PEFT tuner of :class:`SpIELConfig`: random initial indices, per-index ages, and a guard that
    warns when the adapter trains with nobody reselecting its indices."""

    prefix: str = "sparse_"
    dynamic: bool = True

    def initial_indices(self, config: SpIELConfig, layer: SparseLayer, module_name: str, count: int) -> torch.Tensor:
        grid = self.grid(config, layer)
        return grid.expand(random_indices(grid.numel, count // grid.unit, module_generator(config.seed, module_name)))

    def _create_and_replace(self, peft_config, adapter_name, target, target_name, parent, current_key, **kwargs):
        layers = super()._create_and_replace(peft_config, adapter_name, target, target_name, parent, current_key, **kwargs)
        if "_guard" not in self.__dict__:
            self.__dict__["_guard"] = _UnscheduledTrainingGuard()
        guard = self.__dict__["_guard"]
        first = peft_config.earliest_first_reselection()
        guard.first_reselection = first if guard.first_reselection is None else min(guard.first_reselection, first)
        for layer in layers:
            layer.training_observer = guard
        return layers
