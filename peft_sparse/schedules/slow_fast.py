"""Fine-tuning slow and fast (Guo et al., §3, Eq. 1–3, §4.1): layer-wise learning-rate multipliers switched
by the phase of the loss curve, for any trainable parameters (full fine-tuning, LoRA, sparse values).

Weight sets, by relative depth for a model of L transformer blocks (the paper's are for L = 12):

* V^I — every weight of the last n_V = max(1, round(L/6)) blocks (12 → 2);
* V^II — the attention weights of those blocks;
* S^I — every weight of the blocks before them, the first L − n_V (12 → 10; none when L = 1);
* S^II — the feed-forward weights of the first n_S = max(1, round(L/3)) blocks (12 → 4), but never of a
  block in V^I when L > 1.

Multipliers K of the base learning rate (Eq. 2): c₁ for S^I in phase P₁; c₂ for V^II and R(φ) = max(1 − φ^r, 0)
for S^II in phase P₂; 1 for everything else. Phase (§4.1): with windows of w steps, φ_t = mean(last w losses) /
mean(the w before); step t is in P₁ while mean(previous w) − mean(last w) > ``threshold`` (0.1), and before 2w
losses exist. **Once the curve has left P₁ it stays in P₂** (the paper's P₁ is the initial fast drop, its
first ~20% of iterations; a later bump of the loss does not restart it).

Blocks are found from the model: the longest ``nn.ModuleList`` of identical modules (``model.layers``,
``transformer.h``, ``encoder.layer``). Inside a block, a parameter whose path has a component containing
"attn" or "attention" is attention; one containing "norm" or "ln_" is a norm (in S^I/V^I only); the rest
is feed-forward.
"""

from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Optional, Union

from torch import nn

from ..core.blocks import find_blocks
from ..core.config import FIELD_CHECKS

SETS = ("S1", "S2", "V1", "V2")
Override = Optional[Union[list, str]]


@dataclass
class SlowFastConfig:
    """Settings of slow-fast fine-tuning (saved in an adapter's config as ``slow_fast``)."""

    c1: float = field(default=0.01, metadata={"help": "K of S^I in phase P₁ (slow)."})
    c2: float = field(default=10.0, metadata={"help": "K of V^II in phase P₂ (fast)."})
    r: float = field(default=3.0, metadata={"help": "Exponent of R(φ) = max(1 − φ^r, 0), K of S^II in P₂."})
    window: int = field(default=100, metadata={"help": "w: steps per loss window."})
    threshold: float = field(default=0.1, metadata={"help": "P₁ while mean(previous w) − mean(last w) exceeds this."})
    # overrides of each set: a list of block indices (the set's rule applied to those blocks), or a regex on
    # parameter names (the set is exactly the matching trainable parameters)
    s1: Override = None
    s2: Override = None
    v1: Override = None
    v2: Override = None

    def __post_init__(self):
        for name in ("c1", "c2", "r"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {name}={value!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an integer >= 1, got window={self.window!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not math.isfinite(self.threshold):
            raise ValueError(f"threshold must be a finite number, got threshold={self.threshold!r}")
        for name in ("s1", "s2", "v1", "v2"):
            value = getattr(self, name)
            if value is None or isinstance(value, str):
                if isinstance(value, str):
                    re.compile(value)
                continue
            if not isinstance(value, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
                raise ValueError(f"{name} must be a list of block indices or a regex string, got {name}={value!r}")
            setattr(self, name, list(value))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_value(cls, value) -> Optional["SlowFastConfig"]:
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise ValueError(f"slow_fast has unknown fields {unknown}")
            return cls(**value)
        raise ValueError(f"slow_fast must be a SlowFastConfig or a mapping of its fields, got slow_fast={value!r}")



# a sparse config's ``slow_fast`` field: checked here, kept as a plain mapping (JSON in adapter_config.json)
FIELD_CHECKS["slow_fast"] = lambda value: SlowFastConfig.from_value(value).to_dict()


# ---------------------------------------------------------------------------------------------- sets
def _part(path: list) -> str:
    lowered = [p.lower() for p in path]
    if any("attn" in p or "attention" in p for p in lowered):
        return "attention"
    if any("norm" in p or p.startswith("ln_") or p == "ln" for p in lowered):
        return "norm"
    return "ffn"


def default_layers(n: int) -> dict:
    """Block indices of each set by relative depth (module docstring)."""
    n_v = max(1, round(n / 6))
    n_s = max(1, round(n / 3))
    first = list(range(max(0, n - n_v))) if n > 1 else []
    last = list(range(n - n_v, n))
    s2 = [i for i in range(min(n_s, n)) if n == 1 or i not in last]
    return {"S1": first, "S2": s2, "V1": last, "V2": last}


def assign_sets(model: nn.Module, config: SlowFastConfig, params: Optional[list] = None) -> dict:
    """{parameter name: frozenset of the sets it is in} over the trainable parameters (or ``params``' names)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad] if params is None else params
    try:
        prefix, count = find_blocks(model)
    except ValueError as exc:
        raise ValueError(f"slow-fast: {exc}; name the sets with SlowFastConfig(s1=..., s2=..., v1=..., v2=...) as regexes on parameter names") from None
    layers = default_layers(count)
    pattern = re.compile(rf"(?:^|\.){re.escape(prefix)}\.(\d+)\.(.*)$") if prefix else re.compile(r"^(\d+)\.(.*)$")
    overrides = {"S1": config.s1, "S2": config.s2, "V1": config.v1, "V2": config.v2}
    for key, value in overrides.items():
        if isinstance(value, list):
            bad = [i for i in value if not 0 <= i < count]
            if bad:
                raise ValueError(f"slow_fast {key.lower()}={value!r}: the model has {count} blocks (0…{count - 1})")
            layers[key] = value
    out = {}
    for name in names:
        sets = set()
        match = pattern.search(name)
        if match:
            block, part = int(match[1]), _part(match[2].split("."))
            for key in ("S1", "V1"):
                if not isinstance(overrides[key], str) and block in layers[key]:
                    sets.add(key)
            if part == "ffn" and not isinstance(overrides["S2"], str) and block in layers["S2"]:
                sets.add("S2")
            if part == "attention" and not isinstance(overrides["V2"], str) and block in layers["V2"]:
                sets.add("V2")
        out[name] = sets
    for key, value in overrides.items():
        if isinstance(value, str):
            regex = re.compile(value)
            hits = [n for n in names if regex.search(n)]
            if not hits:
                raise ValueError(f"slow_fast {key.lower()}={value!r} matches no trainable parameter (e.g. {names[:2]})")
            for n in hits:
                out[n].add(key)
    return {n: frozenset(s) for n, s in out.items()}


# ---------------------------------------------------------------------------------------------- phase
class PhaseTracker:
    """φ and the phase from the loss curve (§4.1), one loss per optimizer step."""

    def __init__(self, window: int, threshold: float):
        self.window, self.threshold = window, threshold
        self.losses: deque = deque(maxlen=2 * window)
        self.in_p1 = True
        self.phi: Optional[float] = None

    def update(self, loss: float) -> None:
        if not math.isfinite(loss):
            raise ValueError(f"slow-fast: a non-finite training loss ({loss}) cannot place the step in a phase")
        self.losses.append(float(loss))
        if len(self.losses) < 2 * self.window:
            return  # not enough history: P₁ (and φ undefined)
        w = self.window
        previous = sum(list(self.losses)[:w]) / w
        last = sum(list(self.losses)[w:]) / w
        self.phi = last / previous if previous != 0 else 1.0
        if self.in_p1 and not previous - last > self.threshold:
            self.in_p1 = False  # left P₁: stays in P₂

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "in_p1": self.in_p1, "phi": self.phi}

    def load_state_dict(self, state: dict) -> None:
        self.losses = deque(state["losses"], maxlen=2 * self.window)
        self.in_p1, self.phi = bool(state["in_p1"]), state["phi"]


def multiplier(sets: frozenset, in_p1: bool, phi: Optional[float], config: SlowFastConfig) -> float:
    """K of Eq. 2 for a parameter in ``sets``."""
    if in_p1:
        return config.c1 if "S1" in sets else 1.0
    if "V2" in sets:
        return config.c2
    if "S2" in sets:
        return max(1.0 - (phi if phi is not None else 1.0) ** config.r, 0.0)
    return 1.0


# ---------------------------------------------------------------------------------------------- scheduler
class SlowFastScheduler:
    """Splits the optimizer's parameter groups once by set membership, then after every optimizer step (and
    after any learning-rate scheduler's step) sets each group's rate to the base schedule's rate × K.

    Call :meth:`step` with the step's training loss. Build it *after* a learning-rate scheduler and pass that
    (``lr_scheduler``), as the Trainer callback does: the scheduler's per-group lists follow the split. The base rate is whatever the group holds when the
    scheduler looks (a Trainer/LambdaLR schedule writes it each step); a schedule that multiplies the current
    rate in place (``ExponentialLR``) would compound K: use ``LambdaLR`` forms."""

    def __init__(self, model: nn.Module, optimizer, config: SlowFastConfig, lr_scheduler=None):
        self.config, self.optimizer = config, optimizer
        from ..optim.surgery import unwrap_optimizer

        self.inner = inner = unwrap_optimizer(optimizer)
        names = {id(p): n for n, p in model.named_parameters()}
        held = [names[id(p)] for g in inner.param_groups for p in g["params"] if id(p) in names]
        self.sets = assign_sets(model, config, held)
        groups, origin, before = [], [], len(inner.param_groups)
        for index, group in enumerate(inner.param_groups):
            by_key: dict = {}
            for p in group["params"]:
                by_key.setdefault(self.sets.get(names.get(id(p)), frozenset()), []).append(p)
            for key, params in by_key.items():
                new = {k: v for k, v in group.items() if k != "params"}
                new["params"], new["slow_fast_sets"] = params, tuple(sorted(key))
                groups.append(new)
                origin.append(index)
        inner.param_groups[:] = groups
        while lr_scheduler is not None and hasattr(lr_scheduler, "scheduler") and not hasattr(lr_scheduler, "base_lrs"):
            lr_scheduler = lr_scheduler.scheduler  # (accelerate's AcceleratedScheduler wraps the torch one)
        if lr_scheduler is not None:  # (built over the groups before the split: give it one entry per new group)
            for attr in ("base_lrs", "lr_lambdas", "_last_lr"):
                values = getattr(lr_scheduler, attr, None)
                if isinstance(values, list) and len(values) == before:
                    setattr(lr_scheduler, attr, [values[i] for i in origin])
        self.tracker = PhaseTracker(config.window, config.threshold)
        self.t = 0
        self._base = [g["lr"] for g in groups]
        self._set = list(self._base)
        self.apply()

    @property
    def phase(self) -> str:
        return "P1" if self.tracker.in_p1 else "P2"

    def multipliers(self) -> dict:
        """{set combination: K} now."""
        return {g["slow_fast_sets"]: multiplier(frozenset(g["slow_fast_sets"]), self.tracker.in_p1, self.tracker.phi, self.config)
                for g in self.inner.param_groups}  # fmt: skip

    def apply(self) -> None:
        for i, g in enumerate(self.inner.param_groups):
            if g["lr"] != self._set[i]:  # a schedule wrote a new base rate since our last write
                self._base[i] = g["lr"]
            k = multiplier(frozenset(g["slow_fast_sets"]), self.tracker.in_p1, self.tracker.phi, self.config)
            g["lr"] = self._base[i] * k
            self._set[i] = g["lr"]

    def step(self, loss: float) -> dict:
        """One optimizer step done with training loss ``loss``: update the phase, set the next step's rates."""
        self.t += 1
        self.tracker.update(float(loss))
        self.apply()
        logs = {"slow_fast/phase": 1 if self.tracker.in_p1 else 2}
        if self.tracker.phi is not None:
            logs["slow_fast/phi"] = self.tracker.phi
        for key, k in self.multipliers().items():
            logs[f"slow_fast/K[{'+'.join(key) or 'rest'}]"] = k
        return logs

    def state_dict(self) -> dict:
        return {"t": self.t, "tracker": self.tracker.state_dict(), "base": list(self._base), "set": list(self._set)}

    def load_state_dict(self, state: dict) -> None:
        self.t = int(state["t"])
        self.tracker.load_state_dict(state["tracker"])
        self._base, self._set = list(state["base"]), list(state["set"])
