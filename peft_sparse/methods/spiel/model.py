"""SpIEL's PEFT tuner: random initial indices, per-index ages, and a guard against training unscheduled."""

from __future__ import annotations

import math
import warnings
import weakref

import torch

from ...core.layer import SparseLayer
from ...core.selection import module_generator, random_indices
from ...core.tuner import SparseTuner
from .config import SpIELConfig
from .rules import released


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


def model_parameter_count(model) -> int:
    """Every parameter of ``model`` but sparse adapters' values, 4-bit weights at their unpacked size."""
    total = 0
    for name, p in model.named_parameters():
        if ".sparse_values." in f".{name}.":
            continue
        shape = getattr(getattr(p, "quant_state", None), "shape", None)  # (bitsandbytes packs two 4-bit weights per byte)
        total += math.prod(shape) if shape is not None else p.numel()
    return total


def released_budget(config: SpIELConfig, model) -> dict:
    """The authors' released budget rule (``reference='authors'``): N = ⌊density · the model's parameter count⌋ (or
    ``num_tunable_weights``), split over the targeted tensors by size with a floor per tensor, ⌊N·n_i/Σn⌋, in the
    released code's floating point."""
    sizes = {name: int(s[0]) * int(s[1]) for name, s in config.module_shapes.items()}
    targeted = sum(sizes.values())
    budget = config.num_tunable_weights
    if budget is None:
        budget = int(model_parameter_count(model) * config.density)
    if not 0 < budget <= targeted:
        raise ValueError(
            f"reference='authors' takes density={config.density} of all the model's parameters: {budget} weights, which the "
            f"{targeted} targeted weights cannot hold (at least 1, at most all of them); lower density or target more modules"
        )
    return {name: int(budget * size / targeted) for name, size in sizes.items()}


class SpIELModel(SparseTuner):
    """PEFT tuner of :class:`SpIELConfig`: random initial indices, per-index ages, and a guard that
    warns when the adapter trains with nobody reselecting its indices."""

    prefix: str = "sparse_"
    dynamic: bool = True

    def _prepare_model(self, peft_config: SpIELConfig, model) -> None:
        fresh = peft_config.tunable_weights_per_module is None
        super()._prepare_model(peft_config, model)
        if fresh and released(peft_config, "budget") and peft_config.module_shapes:
            counts = released_budget(peft_config, model)
            peft_config.tunable_weights_per_module = counts
            if peft_config.num_tunable_weights is not None:  # (the per-tensor floors may leave a few weights unused)
                peft_config.num_tunable_weights = sum(counts.values())

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
