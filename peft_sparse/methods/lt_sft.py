"""Lottery-Ticket Sparse Fine-Tuning (LT-SFT; thesis ch. 4, §4.3.1, Algorithm 1), PEFT type ``"LT_SFT"``.

Two phases on the sparse core:

1. **Dense phase.** Every weight of the targeted tensors is trainable, as a delta φ over the frozen
   base: the adapter starts with all indices (d_φ = the tensors' size). The base weights are never
   written, so θ₁ − θ₀ is φ itself and no copy of θ₀ is kept.
2. **Selection and rewind.** The K positions with the largest |θ₁ − θ₀| = |φ| are kept — per tensor
   (each tensor's share of K, as the budget split says) or over all tensors at once (``"global"``: a
   streaming threshold search, peak extra memory about one tensor, see
   :func:`peft_sparse.core.selection.global_top_k`). Every weight is rewound to θ₀ (the kept values
   restart at 0) and heads in ``modules_to_save`` go back to their values at the start of the run.
3. **Sparse phase.** Only the K values train. The result is an ordinary sparse adapter.

The L1 pull towards the pre-trained weights, J = λ/N·Σ|θ − θ₀| = λ/N·Σ|φ| (N: the model's parameter
count), applies in both phases: its gradient λ/N·sign(φ) is added to φ's gradient right before each
optimizer step (after any gradient clipping), and the scheduler logs J.

Plain loop::

    model = get_peft_model(base, LTSFTConfig(target_modules="all-linear", density=0.01, dense_steps=D, sparse_steps=S))
    lt = LTSFTScheduler(model)
    optimizer = lt.attach(torch.optim.AdamW(lt.trainable_parameters(), lr=1e-4))
    for step in range(D + S):
        model(**batch).loss.backward(); optimizer.step(); optimizer.zero_grad()
        lt.step()   # after step D: K values selected, rewound; the optimizer now holds them (fresh state)

``reference="authors"`` selects as the authors' released code does (one global threshold at the ⌊density·N⌋-th
largest |φ|, ties at it kept, no L1 term, the targeted modules' biases ranked with their weights; see
``docs/differences.md``).

The optimizer is re-pointed in place at the switch (its param groups take the new values Parameters, the
old ones' state is dropped, ``sparse_learning_rate`` becomes the groups' base rate, under the same
warmup/decay factor as the Trainer's own rate), so one Trainer runs
both phases: ``SFTTrainer(..., peft_config=LTSFTConfig(...), callbacks=[LTSFTCallback()])`` with
``max_steps = dense_steps + sparse_steps``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from peft.utils import PeftType

from ..core import edit
from ..core.budget import split_budget, split_weights, total_budget
from ..core.config import SparseConfig
from ..core.experts import parameter_owner
from ..core.layer import SparseLayer
from ..core.selection import global_top_k, top_indices
from ..core.tuner import SparseTuner
from ..optim.surgery import repoint_parameters, unwrap_optimizer
from ..registry import include_all_linear_layers

PHASES = ("dense", "sparse")
SELECTIONS = ("per_tensor", "global")


@dataclass
class LTSFTConfig(SparseConfig):
    """Lottery-Ticket SFT. ``density`` / ``num_tunable_weights`` set K, the weights kept for the sparse phase."""

    selection: Optional[str] = field(
        default=None,
        metadata={
            "help": (
                "'per_tensor' (the default): each tensor keeps its share of K (budget_split); 'global': the top-K "
                "|θ₁ − θ₀| over all targeted tensors (§4.3.1, Algorithm 1's argmax; the default with reference='authors')."
            )
        },
    )
    l1_reg: float = field(
        default=0.0,
        metadata={"help": "λ of the L1 pull towards the pre-trained weights, λ/N·Σ|θ − θ₀| with N the model's parameter count (thesis: 0.1 for language SFTs)."},
    )
    dense_steps: int = field(default=1000, metadata={"help": "Optimizer steps of the dense phase (> 0)."})
    sparse_steps: int = field(default=1000, metadata={"help": "Optimizer steps of the sparse phase (> 0)."})
    dense_learning_rate: Optional[float] = field(default=None, metadata={"help": "Learning rate of the dense phase (None: the optimizer's / Trainer's); a learning-rate schedule's warmup and decay apply to it."})
    sparse_learning_rate: Optional[float] = field(
        default=None,
        metadata={"help": "Learning rate of the sparse phase (None: the optimizer's / Trainer's); a learning-rate schedule's warmup and decay apply to it. The thesis recommends a higher rate than the dense phase's."},
    )
    freeze_layer_norm: bool = field(
        default=True,
        metadata={
            "help": (
                "True: layer norms stay frozen (§4.4.2). False: every normalisation layer (LayerNorm, RMSNorm, …) trains in "
                "full in both phases, as the heads in modules_to_save do: it is added to modules_to_save, saved with the "
                "adapter and rewound to its pre-trained values at the lottery selection."
            )
        },
    )
    reference: Optional[str] = field(
        default=None,
        metadata={
            "help": (
                "None (default): this project's LT-SFT. 'authors': the selection of the authors' released code "
                "(composable-sft; docs/differences.md): K = ⌊density · the targeted weights⌋ chosen by one global threshold, "
                "keeping every weight whose |θ₁ − θ₀| ties the K-th (so more than K may be kept), and no L1 term: as "
                "released, θ₀ is copied with gradient history, so the penalty's gradient cancels and training runs without "
                "it (l1_reg must stay 0). As the released code ranks every parameter that trains, the bias of every "
                "targeted module is ranked with the weights (added to target_parameters); target the embeddings and the "
                "pooler to include them too."
            )
        },
    )
    phase: str = field(
        default="dense",
        metadata={"help": "Set by the method: 'dense' until the lottery selection, then 'sparse' (the saved config of a finished adapter says 'sparse')."},
    )

    init_choices = ("lottery",)

    def __post_init__(self):
        if self.init == "random":  # (the base class's default: LT-SFT has one policy)
            self.init = "lottery"
        if self.init == "external":  # indices from an adapter file: a selected adapter
            self.phase = "sparse"
        super().__post_init__()
        self.peft_type = PeftType.LT_SFT
        if self.reference is not None and self.reference != "authors":
            raise ValueError(f"reference must be None or 'authors', got reference={self.reference!r}")
        if self.selection is None:
            self.selection = "global" if self.reference == "authors" else "per_tensor"
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {list(SELECTIONS)}, got selection={self.selection!r}")
        if isinstance(self.l1_reg, bool) or not isinstance(self.l1_reg, (int, float)) or not math.isfinite(self.l1_reg) or self.l1_reg < 0:
            raise ValueError(f"l1_reg must be a finite number >= 0, got l1_reg={self.l1_reg!r}")
        for name in ("dense_steps", "sparse_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive number of optimizer steps, got {name}={value!r}")
        for name in ("dense_learning_rate", "sparse_learning_rate"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"{name} must be a positive number or None, got {name}={value!r}")
        if not isinstance(self.freeze_layer_norm, bool):
            raise ValueError(f"freeze_layer_norm must be True or False, got freeze_layer_norm={self.freeze_layer_norm!r}")
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {list(PHASES)}, got phase={self.phase!r}")
        if tuple(self.block_shape) != (1, 1):
            raise ValueError(f"block_shape={self.block_shape!r}: LT-SFT selects single weights; use (1, 1)")
        if self.reference == "authors":
            if self.selection != "global":
                raise ValueError(f"reference='authors' selects with one global threshold, as the released code; got selection={self.selection!r}")
            if self.l1_reg != 0:
                raise ValueError(
                    f"reference='authors' trains without the L1 term, as the released code effectively does (its θ₀ keeps "
                    f"gradient history, so the penalty's gradient is zero); got l1_reg={self.l1_reg!r}: leave it at 0, or use "
                    "reference=None for the L1 pull of §4.3.1"
                )
        if self.phase == "sparse" and self.tunable_weights_per_module is None:
            raise ValueError("phase='sparse' describes a selected adapter and needs tunable_weights_per_module; create LT-SFT in phase 'dense'")


class LTSFTModel(SparseTuner):
    """PEFT tuner of :class:`LTSFTConfig`: in the dense phase every targeted weight is an index."""

    prefix: str = "sparse_"

    def _prepare_model(self, peft_config: LTSFTConfig, model) -> None:
        if peft_config.reference == "authors":
            _target_biases(self, peft_config, model)
        if not peft_config.freeze_layer_norm:
            norms = [name for name, module in model.named_modules() if _is_norm(module)]
            if not norms:
                raise ValueError("freeze_layer_norm=False but the model has no normalisation layer (LayerNorm, RMSNorm, …) to train")
            peft_config.modules_to_save = list(dict.fromkeys([*(peft_config.modules_to_save or []), *norms]))
        if peft_config.phase == "sparse":
            return super()._prepare_model(peft_config, model)
        # the dense phase: check K against the targeted weights, then give every module all its weights
        counts = peft_config.tunable_weights_per_module
        peft_config.tunable_weights_per_module = None
        super()._prepare_model(peft_config, model)  # (fills module_shapes and K's split, which is checked here)
        shapes = peft_config.module_shapes or {}
        full = {k: int(s[0]) * int(s[1]) for k, s in shapes.items()}
        if counts is not None and counts != full:
            raise ValueError("an LT-SFT config in phase 'dense' adapts whole tensors; its tunable_weights_per_module must equal their sizes")
        peft_config.tunable_weights_per_module = full

    def initial_indices(self, config: LTSFTConfig, layer: SparseLayer, module_name: str, count: int) -> torch.Tensor:
        return torch.arange(count, dtype=torch.long)

    @classmethod
    def _remap_adapter_state_dict_for_load(cls, model, config, adapter_name, state_dict):
        try:
            return super()._remap_adapter_state_dict_for_load(model, config, adapter_name, state_dict)
        except ValueError as error:
            if getattr(config, "phase", None) == "dense" and "indices but the config expects" in str(error):
                raise ValueError(
                    f"{error}. The file holds a selected (sparse-phase) LT-SFT adapter, but adapter {adapter_name!r} of "
                    "this model is in the dense phase: build the model from the file instead, "
                    "PeftModel.from_pretrained(base, path, is_trainable=True) (also to resume a Trainer checkpoint)"
                ) from error
            raise


def _target_biases(tuner: "LTSFTModel", config: LTSFTConfig, model) -> None:
    """``reference='authors'``: the bias of every targeted module joins ``target_parameters`` by its full name, so
    the lottery ranks it with the weights (the released code ranks every parameter that trains). Saved with the
    config, so a loaded adapter has the same tensors."""
    include_all_linear_layers(config, model)
    biases = []
    for key, module in tuner._matched_modules(config, model).items():
        bias = parameter_owner(module)._parameters.get("bias")
        if bias is not None and bias.dim() == 1:
            biases.append(f"{key}.bias")
    if biases:
        config.target_parameters = sorted(set(config.target_parameters or []) | set(biases))


def _at_or_above_kth(moved: dict, k: int) -> dict:
    """The released LT-SFT's selection: every weight whose score is at least the k-th largest of all tensors' scores
    (ties at that value kept, so possibly more than k), by tensor."""
    if k <= 0:
        raise ValueError(f"LT-SFT with reference='authors' keeps ⌊density · the targeted weights⌋ = {k} weights; raise density")
    chosen = global_top_k(moved, k)
    kth = min(float(moved[name]()[positions].min()) for name, positions in chosen.items() if positions.numel())
    return {name: torch.nonzero(score() >= kth).squeeze(1).cpu() for name, score in moved.items()}


def _is_norm(module) -> bool:
    """A normalisation layer with its own parameters: torch's LayerNorm/RMSNorm/GroupNorm or a model's ``*Norm``
    class (e.g. ``LlamaRMSNorm``)."""
    norm_types = (torch.nn.LayerNorm, torch.nn.GroupNorm, getattr(torch.nn, "RMSNorm", torch.nn.LayerNorm))
    named_like = type(module).__name__.endswith("Norm") or type(module).__name__.endswith("LayerNorm")
    return (isinstance(module, norm_types) or named_like) and any(True for _ in module.parameters(recurse=False))


def _lt_config(model, adapter_name):
    config = model.peft_config.get(adapter_name) if hasattr(model, "peft_config") else None
    if not isinstance(config, LTSFTConfig):
        raise ValueError(f"LTSFTScheduler needs a model with an active LT-SFT adapter, got {type(config).__name__}")
    return config


class LTSFTScheduler:
    """Drives LT-SFT's phases over a PEFT model: call :meth:`step` after every optimizer step."""

    def __init__(self, model, optimizer=None, adapter_name: Optional[str] = None):
        self.model = model
        if adapter_name is None:  # the active LT-SFT adapter (others may be stacked under it, frozen)
            trainable = {a for m in model.modules() if isinstance(m, SparseLayer) for a, v in m.sparse_values.items() if v.requires_grad}
            found = [a for a in getattr(model, "active_adapters", []) if isinstance(model.peft_config.get(a), LTSFTConfig) and a in trainable]
            if len(found) != 1:
                raise ValueError(f"LTSFTScheduler: pass adapter_name; the active, trainable LT-SFT adapters are {found}")
            adapter_name = found[0]
        self.adapter_name = adapter_name
        self.config = _lt_config(model, self.adapter_name)
        self.layers = {m.module_name: m for m in model.modules() if isinstance(m, SparseLayer) and self.adapter_name in m.sparse_values}
        self.t = 0
        self.last_l1 = 0.0
        # N: the model's parameter count (the base's: every adapter's values excluded)
        values = {id(v) for m in model.modules() if isinstance(m, SparseLayer) for v in m.sparse_values.values()}
        self.num_parameters = sum(p.numel() for p in model.parameters() if id(p) not in values)
        self.head_snapshot = self._heads_state() if self.config.phase == "dense" else None
        self._hook = None
        self.optimizer = self.lr_scheduler = None
        if optimizer is not None:
            self.attach(optimizer)

    # ------------------------------------------------------------------ optimizer and L1
    @property
    def phase(self) -> str:
        return self.config.phase

    def trainable_parameters(self) -> list:
        return [p for p in self.model.parameters() if p.requires_grad]

    def learning_rate(self, default: Optional[float] = None) -> Optional[float]:
        """The configured learning rate of the current phase, or ``default``."""
        lr = self.config.dense_learning_rate if self.phase == "dense" else self.config.sparse_learning_rate
        return default if lr is None else lr

    def attach(self, optimizer, lr_scheduler=None):
        """Train with ``optimizer`` (and its learning-rate scheduler, whose base rates follow the phases' configured
        rates); adds the L1 gradient before its steps. Returns the optimizer."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        wrapped, optimizer = optimizer, unwrap_optimizer(optimizer)
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [n for n, m in self.layers.items() if id(m.sparse_values[self.adapter_name]) not in held]
        if missing:
            raise ValueError(f"the optimizer does not hold the LT-SFT values of {missing[:3]} (phase {self.phase!r}): build it from trainable_parameters()")
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        if self.phase == "dense":
            self._set_learning_rate(self.config.dense_learning_rate)
        if self.config.l1_reg > 0:
            self._hook = optimizer.register_step_pre_hook(lambda *args: self.add_l1_gradient())
        return wrapped

    def l1_penalty(self) -> torch.Tensor:
        """J = λ/N·Σ|φ| (a tensor with autograd history, to add to a loss instead of the gradient hook)."""
        total = sum(m.sparse_values[self.adapter_name].abs().sum() for m in self.layers.values())  # (differentiable)
        return total * (self.config.l1_reg / self.num_parameters)

    @torch.no_grad()
    def add_l1_gradient(self) -> None:
        """φ.grad += λ/N·sign(φ) on every layer (the subgradient of J; 0 at φ = 0), and records J."""
        scale = self.config.l1_reg / self.num_parameters
        total = 0.0
        for m in self.layers.values():
            v = m.sparse_values[self.adapter_name]
            total += float(v.abs().sum(dtype=torch.float64))
            if v.grad is None:
                v.grad = torch.zeros_like(v)
            v.grad.add_(torch.sign(v), alpha=scale)
        self.last_l1 = total * scale

    # ------------------------------------------------------------------ phases
    def step(self) -> bool:
        """One optimizer step done. At the end of the dense phase, select and rewind (returns True); the attached
        optimizer then holds the sparse phase's values, with fresh state."""
        self.t += 1
        if self.phase == "dense" and self.t == self.config.dense_steps:
            self.select_and_rewind()
            return True
        return False

    @torch.no_grad()
    def select_and_rewind(self) -> dict:
        """Keep the K weights that moved most, rewind everything to θ₀; returns {module: kept count}."""
        if self.phase != "dense":
            raise RuntimeError("select_and_rewind: the adapter is already selected (phase 'sparse')")
        config, name = self.config, self.adapter_name
        sizes = {k: m.numel for k, m in self.layers.items()}
        budget = total_budget(sum(sizes.values()), config.density, config.num_tunable_weights)
        moved = {k: (lambda m=m: self._moved(m)) for k, m in self.layers.items()}
        if config.reference == "authors":  # ⌊density·N⌋ and every weight at or above the K-th |φ|, ties included
            if config.num_tunable_weights is None:
                budget = int(config.density * sum(sizes.values()))
            chosen = _at_or_above_kth(moved, budget)
        elif config.selection == "global":
            chosen = global_top_k(moved, budget)
        else:
            shares = split_budget(sizes, budget, 1, split_weights(config.module_shapes, config.budget_split))
            chosen = {k: top_indices(moved[k](), shares[k]) for k in self.layers}
        indices = {k: chosen[k] for k in self.layers}
        zeros = {k: torch.zeros(v.numel()) for k, v in indices.items()}
        old = {k: m.sparse_values[name] for k, m in self.layers.items()}
        edit.set_indices(self.model, indices, values=zeros, adapter_name=name)  # rewind: θ₂ starts at θ₀
        for m in self.layers.values():
            m.sparse_values[name].requires_grad_(True)
        self._restore_heads()
        if self.optimizer is not None:
            self._rebind({id(old[k]): m.sparse_values[name] for k, m in self.layers.items()})
        counts = {k: int(v.numel()) for k, v in indices.items()}
        config.tunable_weights_per_module = counts
        config.num_tunable_weights, config.density = sum(counts.values()), None
        config.phase, config.init = "sparse", "external"
        return counts

    def _rebind(self, replaced: dict) -> None:
        """Point the attached optimizer at the sparse phase's values (fresh state), reset the heads' state, and
        set the sparse phase's learning rate if configured (also as a learning-rate scheduler's base rate)."""
        heads = [p for h in self._heads().values() for p in h.parameters()]
        repoint_parameters(self.optimizer, replaced, reset=heads)
        self._set_learning_rate(self.config.sparse_learning_rate)

    def _set_learning_rate(self, lr: Optional[float]) -> None:
        """The phase's configured rate as every param group's base rate (a learning-rate scheduler's ``base_lrs``
        and the groups' ``initial_lr``); the current rate keeps the schedule's factor (warmup, decay), so the
        phase's rate follows the Trainer's schedule as the Trainer's own rate would. Without a schedule the rate is
        set as it is. A resumed run finds the base rates already set (the checkpointed scheduler and optimizer) and
        keeps the checkpoint's current rate."""
        if lr is None:
            return
        schedule = self.lr_scheduler
        while schedule is not None and hasattr(schedule, "scheduler") and not hasattr(schedule, "base_lrs"):
            schedule = schedule.scheduler  # (accelerate's AcceleratedScheduler wraps the torch one)
        if schedule is None or not hasattr(schedule, "base_lrs"):
            for group in self.optimizer.param_groups:
                group["lr"] = lr
                if "initial_lr" in group:
                    group["initial_lr"] = lr
            return
        for i, group in enumerate(self.optimizer.param_groups):
            base = schedule.base_lrs[i]
            group["lr"] = lr * (group["lr"] / base) if base else lr  # the schedule's current factor, on the new base
            if "initial_lr" in group:
                group["initial_lr"] = lr
        schedule.base_lrs = [lr] * len(schedule.base_lrs)
        if hasattr(schedule, "_last_lr"):  # what get_last_lr() reports (the Trainer logs it): the rate now in use
            schedule._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def _moved(self, layer: SparseLayer) -> torch.Tensor:
        """|θ₁ − θ₀| of one layer, in flat (out, in) order (the dense phase's indices are 0…n−1)."""
        values = layer.sparse_values[self.adapter_name].detach()
        indices = layer.sparse_indices[self.adapter_name]
        if indices.numel() != layer.numel:
            raise RuntimeError(f"{layer.module_name}: the dense phase's adapter no longer covers the whole tensor")
        return values.abs().float()

    # ------------------------------------------------------------------ heads (modules_to_save)
    def _heads(self) -> dict:
        from peft.utils import ModulesToSaveWrapper

        return {n: m.modules_to_save[self.adapter_name] for n, m in self.model.named_modules()
                if isinstance(m, ModulesToSaveWrapper) and self.adapter_name in m.modules_to_save}  # fmt: skip

    def _heads_state(self) -> dict:
        return {n: {k: v.detach().clone() for k, v in h.state_dict().items()} for n, h in self._heads().items()}

    def _restore_heads(self) -> None:
        for n, head in self._heads().items():
            head.load_state_dict(self.head_snapshot[n])

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"t": self.t, "phase": self.phase, "last_l1": self.last_l1}

    def load_state_dict(self, state: dict) -> None:
        if state["phase"] != self.phase:
            raise ValueError(f"scheduler state of phase {state['phase']!r} does not fit an adapter in phase {self.phase!r}")
        self.t, self.last_l1 = int(state["t"]), float(state["last_l1"])
