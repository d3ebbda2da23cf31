"""Saving and restoring a ``SpIELScheduler`` exactly: step, open window statistics (AG's, or MA's input/output sums), AG seeds still waiting for
the next optimizer step, φ₀ for ``drop_criterion='change'``, every index's age (the step it was last grown at, which
a saved adapter holds only when asked: :mod:`peft_sparse.core.storage`) and the tokens routed to each expert — JSON
plus safetensors, no pickle."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from ...core.storage import reading
from ...optim.sm3 import SM3
from .statistics import InputOutputStatistics


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class SchedulerState:
    """The state methods of :class:`~peft_sparse.methods.spiel.scheduler.SpIELScheduler` (a mixin)."""

    def state_dict(self) -> dict:
        """Step, window statistics and seeds still waiting for the next optimizer step (tensors by module)."""
        by_layer = {id(m.sparse_values[self.adapter_name]): m.module_name for m in self.layers}
        pending = self.seeding.pending if self.seeding is not None else {}
        return {
            "t": self.t,
            "total_steps": self.total_steps,
            "world_size": _world_size(),
            "adapter_name": self.adapter_name,
            "steps_in_window": self.steps_in_window,
            "armed": bool(self.statistics),
            "statistics": {name: s.tensors() for name, s in self.statistics.items()},
            "pending_seeds": {
                by_layer[key]: {"slots": slots, "grad_mean": g, "grad_sq_mean": s2, "age": torch.tensor(age)}
                for key, (slots, g, s2, age) in pending.items()
            },
            "drop_reference": {name: {"values": v} for name, v in self.drop_reference.items()},
            "ma_accumulators": self.ma_accumulators.tensors() if self.ma_accumulators is not None else {},
            "ages": {m.module_name: {"ages": m.sparse_ages[self.adapter_name].clone()} for m in self.layers if self.adapter_name in m.sparse_ages},
            "routed_tokens": self.routing.tensors(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["adapter_name"] != self.adapter_name:
            raise ValueError(f"scheduler state is for adapter {state['adapter_name']!r}, not {self.adapter_name!r}")
        if state["total_steps"] != self.total_steps:
            saved_world, world = state.get("world_size", 1), _world_size()
            moved = (
                f" The checkpoint was written by {saved_world} process(es) and this run has {world}: with the same "
                "global batch, set max_steps to the original run's so the schedule carries over (the scheduler's state "
                "is the same on every rank, so it resumes at any world size)."
                if saved_world != world else ""
            )
            raise ValueError(
                f"scheduler state was made with total_steps={state['total_steps']}, this scheduler has "
                f"total_steps={self.total_steps}; k(t) would differ.{moved}"
            )
        self._disarm()
        self.t = int(state["t"])
        layers = {m.module_name: m for m in self.layers}
        for name in list(state["statistics"]) + list(state.get("pending_seeds", {})):
            if name not in layers:
                raise ValueError(f"scheduler state refers to module {name!r}, which holds no {self.adapter_name!r} adapter")

        def device_of(name):
            return layers[name].sparse_values[self.adapter_name].device

        if state["armed"]:
            self._arm_if_window(self.t + 1)
            if not self.statistics:
                raise ValueError(f"scheduler state says a window is open after step {self.t}, but none is scheduled there")
            for name, tensors in state["statistics"].items():
                stats = self.statistics[name]
                if isinstance(stats, InputOutputStatistics):  # (MA, ma_signal='io')
                    if set(tensors) != {"row_sum", "col_sum", "seen"}:
                        raise ValueError(f"scheduler state holds no input/output statistics of {name!r} (it was saved with another ma_signal)")
                    stats.load(tensors)
                elif "row_sum" in tensors:
                    raise ValueError(f"scheduler state holds SpIEL-MA input/output statistics of {name!r}, which this scheduler's growth does not use")
                elif tensors:
                    stats.candidates = tensors["candidates"].to(device_of(name), copy=True)
                    if "candidate_units" in tensors:
                        stats.candidate_units = tensors["candidate_units"].to(device_of(name), copy=True)
                        stats.index_candidate_blocks()
                    stats.step_sum = tensors["step_sum"].to(device_of(name), copy=True)
                    stats.grad_sum = tensors["grad_sum"].to(device_of(name), copy=True)
                    stats.grad_sq_sum = tensors["grad_sq_sum"].to(device_of(name), copy=True)
                    if "col_scale" in tensors:
                        stats.col_scale = tensors["col_scale"].to(device_of(name), copy=True)
                    if "step_sq" in tensors:  # (reference='authors': Σg² over micro-batches)
                        stats.step_sq = tensors["step_sq"].to(device_of(name), copy=True)
                    stats.samples = int(tensors["samples"]) if "samples" in tensors else 0
            self.steps_in_window = int(state["steps_in_window"])
        elif self._in_window(self.t + 1):
            raise ValueError(
                f"scheduler state has no estimation window open after step {self.t}, but this scheduler opens one there: "
                f"the state was saved with another growth or ma_signal than growth={self.config.growth!r}, ma_signal={self.config.ma_signal!r}"
            )
        if self.config.drop_criterion == "change":
            reference = state.get("drop_reference") or {}
            if set(reference) != set(layers):
                raise ValueError("scheduler state holds no φ₀ of every tensor (drop_criterion='change'); it was saved with another drop criterion")
            self.drop_reference = {name: t["values"].to(device_of(name), copy=True) for name, t in reference.items()}
        self.routing.load(state.get("routed_tokens") or {})
        saved_accumulators = state.get("ma_accumulators") or {}
        if self.ma_accumulators is not None:
            self.ma_accumulators.load(saved_accumulators)
        elif saved_accumulators and isinstance(self.optimizer, SM3):  # (beside another optimizer with ma_signal='io' they rank nothing)
            raise ValueError(
                "scheduler state holds SpIEL-MA accumulators kept beside a non-SM3 optimizer, but this scheduler's "
                "optimizer is SM3 (its own accumulators rank the growth): resume with the optimizer the run was saved with"
            )
        for name, entry in (state.get("ages") or {}).items():  # (a state saved before ages were kept here has none)
            if name not in layers:
                raise ValueError(f"scheduler state holds ages of module {name!r}, which holds no {self.adapter_name!r} adapter")
            layer, ages = layers[name], entry["ages"]
            count = layer.sparse_indices[self.adapter_name].numel()
            if ages.dtype != torch.int32 or ages.shape != (count,):
                raise ValueError(
                    f"scheduler state holds {tuple(ages.shape)} {ages.dtype} ages of {name!r}, whose adapter has {count} indices: "
                    "load the adapter saved with the same checkpoint first"
                )
            if self.adapter_name in layer.sparse_ages:
                layer.sparse_ages[self.adapter_name].copy_(ages)
        if self.seeding is not None:
            self.seeding.pending = {
                id(layers[name].sparse_values[self.adapter_name]): (
                    *(t[k].to(device_of(name), copy=True) for k in ("slots", "grad_mean", "grad_sq_mean")),
                    int(t["age"]) if "age" in t else self.gamma,  # (states saved before ages were recorded: γ steps)
                )
                for name, t in state.get("pending_seeds", {}).items()
            }

    _TENSOR_GROUPS = ("statistics", "pending_seeds", "drop_reference", "ma_accumulators", "ages", "routed_tokens")

    def save(self, directory: str) -> None:
        """Write the state as ``spiel_scheduler.json`` + ``spiel_scheduler.safetensors`` (no pickle)."""
        state = self.state_dict()
        tensors = {  # (window sums are views of one buffer for all tensors: safetensors wants their own storage)
            f"{group}::{module}::{key}": value.contiguous() if value.untyped_storage().nbytes() == value.nbytes else value.clone()
            for group in self._TENSOR_GROUPS
            for module, entries in state.pop(group).items()
            for key, value in entries.items()
        }
        state["modules_with_statistics"] = sorted(self.statistics)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "spiel_scheduler.json"), "w") as f:
            json.dump(state, f)
        save_file(tensors, os.path.join(directory, "spiel_scheduler.safetensors"))

    def load(self, directory: str) -> None:
        path = os.path.join(directory, "spiel_scheduler.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{directory} holds no spiel_scheduler.json; cannot resume SpIEL exactly")
        with open(path) as f:
            state = json.load(f)
        groups: dict = {g: {} for g in self._TENSOR_GROUPS}
        for module in state.pop("modules_with_statistics", []):
            groups["statistics"][module] = {}
        tensors_path = os.path.join(directory, "spiel_scheduler.safetensors")
        with reading(tensors_path):
            tensors = load_file(tensors_path)
        for key, value in tensors.items():
            group, module, name = key.split("::")
            groups[group].setdefault(module, {})[name] = value
        state.update(groups)
        self.load_state_dict(state)


def saved_ages(directory: str) -> dict:
    """The per-index ages a SpIEL scheduler state in ``directory`` holds (a Trainer checkpoint folder), by module;
    empty when there is none, or when it was saved before ages were kept there."""
    path = os.path.join(directory, "spiel_scheduler.safetensors")
    if not os.path.isfile(path):
        return {}
    return {key.split("::")[1]: value for key, value in load_file(path).items() if key.startswith("ages::")}
