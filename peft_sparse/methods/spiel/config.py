"""SpIEL's configuration (PEFT type ``"SPIEL"``): thesis §7.3, §7.4.3, Table 7.1."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Optional, Union

from peft.utils import PeftType

from ...core.config import SparseConfig


# first_full_replacement='auto' with ma_signal='io': the full replacement at t = γ pays only with at least this many
# reselections after it (block MA, BENCHMARKS.md Quality: 60 steps with 2 follow: off is better; 100 with 4: on is)
IO_FULL_REPLACEMENT_MIN_FOLLOWING = 4


@dataclass
class SpIELConfig(SparseConfig):
    """Configuration of SpIEL (PEFT type ``"SPIEL"``); train it with :class:`SpIELCallback` or :class:`SpIELScheduler`.

    The paper's settings (thesis §7.4.3, Table 7.1, Llama-2): S=20, ξ=0.2, γ=5, K_i=d_φ(i); AdamW with
    lr 1e-4 and decoupled weight decay λ=30 for AG (7b and 13b); SM3 with lr 1e-3 and λ=0.3 (7b) or
    lr 4e-4 and λ=0 (13b) for MA. λ is the optimizer's ``weight_decay``.
    """

    growth: str = field(default="ag", metadata={"help": "'ag' (accumulated gradients, Alg. 2) or 'ma' (SM3 momentum approximation, Alg. 3)."})
    reselection_steps: Union[int, float, str] = field(
        default="auto",
        metadata={
            "help": (
                "S: optimizer steps between reselections. 'auto' (default): S = max(20, round(2·T/15)) for a run of "
                "T = total_steps, the paper's S=20 up to T=150 and scaled with T beyond (80 at T=600), the setting that "
                "met LoRA at every run length of the quality benchmark where S=20 fell behind at 600 steps "
                "(docs: quality). An int is a count; a float in (0, 1) a fraction of T, S = max(2, round(S·T))."
            )
        },
    )
    initial_reselection_rate: float = field(default=0.2, metadata={"help": "ξ in (0, 1]: fraction of d_φ(i) replaced at t=γ+S, decaying to 0 at T."})
    gradient_estimation_steps: Union[int, float, str] = field(
        default="auto",
        metadata={
            "help": (
                "γ: optimizer steps in a gradient-estimation window (AG, and MA with ma_signal='io'; 0 < γ < S); the first reselection is at t=γ. "
                "'auto' (default): γ = max(5, round(T/30)), the paper's 5 up to T=150 (20 at T=600), kept below S. An int "
                "is a count; a float in (0, 1) a fraction of total_steps, γ = max(1, round(γ·T))."
            )
        },
    )
    candidate_ratio: float = field(default=1.0, metadata={"help": "K_i = ceil(candidate_ratio·d_φ(i)) growth candidates per tensor (AG), ≥ 1."})
    schedule: str = field(default="linear", metadata={"help": "'linear' (Eq. 7.6) or 'cosine' (Eq. E.1) decay of k(t)."})
    replacement_rounding: str = field(
        default="per_tensor",
        metadata={
            "help": (
                "How k(t) becomes whole units (weights, or blocks) per tensor. 'per_tensor' (default; Eq. 7.6 as written): "
                "⌊ξ(t)·d_φ(i)⌋ for each tensor. With blocks a tensor holds few units (SmolLM2-135M at LoRA r=16's budget in "
                "64×64 blocks: about 10 per MLP tensor, 1 per k/v), so this floor replaces under half of ξ(t)·d_φ and stops "
                "reselecting after about 55% of the run. 'apportioned': the step's total ⌊ξ(t)·Σ d_φ(i)⌋ split over the "
                "tensors by largest remainder, ties taking turns between reselections. Measured in BENCHMARKS.md (Quality). "
                "Not with budget_split='adaptive', which pools the count itself."
            )
        },
    )
    init: str = field(default="random", metadata={"help": "'random' (the paper's initial η) or 'external' (indices from a saved adapter)."})
    first_full_replacement: Union[bool, str] = field(
        default="auto",
        metadata={
            "help": (
                "Replace every index at the first reselection (t=γ, Eq. 7.6's first case); False: k(γ) follows the schedule "
                "like later ones. 'auto' (default): True (the thesis), except for SpIEL-MA with ma_signal='io' (block MA's "
                "default) in a run where fewer than 4 reselections follow the first (T ≤ γ + 4S: 60 steps has 2, 100 steps 4): "
                "a full replacement ranked on γ steps of sums needs later reselections to mend it (BENCHMARKS.md, Quality)."
            )
        },
    )
    drop_criterion: str = field(
        default="magnitude",
        metadata={
            "help": (
                "Which active weights are dropped: 'magnitude', the k smallest |φ| (§7.3.1), or 'change', the k smallest "
                "|φ − φ₀| with φ₀ the values right after the previous reselection (Algorithm 2, line 10)."
            )
        },
    )
    seed_moments: Optional[str] = field(
        default=None,
        metadata={
            "help": (
                "AG: which Adam moments of grown weights are seeded from the window (§7.3.1): 'second' (the default for AG: "
                "only exp_avg_sq, from the mean squared gradient ŝ, so the first steps ramp up as a fresh weight's at a "
                "well-scaled step size), 'both' (also exp_avg from the mean gradient ĝ, the thesis) or 'none' (both start "
                "at zero). Seeding exp_avg made the loss jump after each reselection in BENCHMARKS.md's quality runs. "
                "MA beside Adam/AdamW: 'none' (the default for MA: grown weights start with zero moments) or 'second' "
                "(exp_avg_sq from SM3's estimate of the mean squared gradient, min(R_i, C_j)/t: no better on average in "
                "BENCHMARKS.md's quality runs); 'both' is refused (SM3 keeps no mean gradient). Under SM3 there are no "
                "moments to seed."
            )
        },
    )
    grow_init: str = field(
        default="zero",
        metadata={
            "help": (
                "AG: the value a grown weight starts at: 'zero' (the thesis) or 'gradient', the first-order estimate "
                "−lr·γ·ĝ/(√ŝ + ε): the γ Adam steps the window's mean gradient ĝ and squared gradient ŝ would have taken."
            )
        },
    )

    score_normalization: Optional[str] = field(
        default=None,
        metadata={
            "help": (
                "AG, unstructured: 'column' (the default there) divides each candidate's and grown weight's score |∂L/∂W| by "
                "its column's RMS gradient in the window's first micro-batch (like the candidates, so the choice depends on how "
                "that step is split into micro-batches), so that a few outlier input features cannot take most of the mask; "
                "'none' ranks by |∂L/∂W| itself (the thesis). Leave unset for MA and block selection."
            )
        },
    )

    column_cap: Optional[float] = field(
        default=None,
        metadata={
            "help": (
                "MA, unstructured: growth may fill a column of a tensor only up to ⌈column_cap · d_φ / in_features⌉ active "
                "weights (column_cap times the mean count; ≥ 1), so that the rank-one score R_i·C_j cannot pile the mask "
                "into the few columns with the largest gradients; None (the thesis): no cap."
            )
        },
    )

    ma_unseen: str = field(
        default="zero",
        metadata={
            "help": (
                "MA: the growth factor √⁴R_i (√⁴C_j) of a row (column) whose SM3 accumulator is still 0, where no active "
                "weight has had a gradient. 'zero' (the default, the thesis): SM3's zeros as they are, so growth stays "
                "inside the rows and columns the mask has covered (a block mask covers only a few block rows); 'mean' "
                "gives such a row the mean factor of the tensor's seen rows (columns), so growth can reach beyond them "
                "(no better for 64×64 block MA at 60 steps: BENCHMARKS.md, Quality)."
            )
        },
    )

    ma_regrow_dropped: bool = field(
        default=True,
        metadata={
            "help": (
                "MA: whether a unit (weight or block) dropped at a reselection may be grown again at the same one. True "
                "(the default, the thesis): growth ranks every unit outside the kept ones. False: at a partial reselection "
                "growth ranks only the units that were inactive before it, so each replaced unit is a new one (block MA "
                "otherwise grows back the blocks it drops: their rows and columns carry the largest SM3 accumulators; "
                "replacing them scores no better at 600 steps: BENCHMARKS.md, Quality); a full replacement, which keeps "
                "nothing, and a tensor with fewer inactive units than k rank every unit as with True. Not with column_cap."
            )
        },
    )

    ma_signal: Optional[str] = field(
        default=None,
        metadata={
            "help": (
                "MA: the row and column statistics R_i, C_j whose product ranks growth (Eq. 7.7). 'sm3' (the thesis; the "
                "default for unstructured MA): SM3's accumulators, which only see the rows and columns of active weights. "
                "'io' (the default for block MA, whose blocks cover a third of the rows and columns): over the γ-step "
                "estimation window before each reselection (as AG's), R_i = Σ (∂L/∂Y_i)² over the tokens of the layer's "
                "output gradient and C_j = Σ X_j² over its inputs: every row and column, and (∂L/∂W_ij)² ≤ R_i·C_j per "
                "micro-batch (Cauchy–Schwarz). Still out + in floats per tensor and no dense gradient; the window's steps "
                "take the general backward pass. Leave unset for AG."
            )
        },
    )

    init_choices: ClassVar[tuple[str, ...]] = ("random",)
    moves_budget: ClassVar[bool] = True  # budget_split='adaptive' (AG, unstructured): see the scheduler

    def __post_init__(self):
        super().__post_init__()
        self.peft_type = PeftType.SPIEL
        if self.growth not in ("ag", "ma"):
            raise ValueError(f"growth must be 'ag' or 'ma', got growth={self.growth!r}")
        for name in ("reselection_steps", "gradient_estimation_steps"):
            value = getattr(self, name)
            if value == "auto" or (isinstance(value, float) and 0.0 < value < 1.0):
                continue  # scaled with total_steps, or a fraction of it
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"{name} must be 'auto', a positive integer or a fraction in (0, 1) of total_steps, got {name}={value!r}"
                )
        S, gamma = self.reselection_steps, self.gradient_estimation_steps
        if gamma == "auto" and S == 1:
            raise ValueError("reselection_steps=1 leaves no γ below it for gradient_estimation_steps='auto'; use reselection_steps ≥ 2")
        if "auto" not in (S, gamma) and isinstance(S, int) == isinstance(gamma, int) and gamma >= S:  # (else: steps_for checks)
            raise ValueError(
                f"gradient_estimation_steps must be smaller than reselection_steps, got "
                f"gradient_estimation_steps={self.gradient_estimation_steps} and reselection_steps={self.reselection_steps}"
            )
        for name in ("initial_reselection_rate", "candidate_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {name}={value!r}")
        if not 0.0 < self.initial_reselection_rate <= 1.0:
            raise ValueError(f"initial_reselection_rate must be in (0, 1], got initial_reselection_rate={self.initial_reselection_rate!r}")
        if not self.candidate_ratio >= 1.0:
            raise ValueError(f"candidate_ratio must be >= 1, got candidate_ratio={self.candidate_ratio!r}")
        if self.schedule not in ("linear", "cosine"):
            raise ValueError(f"schedule must be 'linear' or 'cosine', got schedule={self.schedule!r}")
        if not (isinstance(self.first_full_replacement, bool) or self.first_full_replacement == "auto"):
            raise ValueError(
                f"first_full_replacement must be True, False or 'auto', got first_full_replacement={self.first_full_replacement!r}"
            )
        if self.seed_moments is None and self.growth in ("ag", "ma"):
            self.seed_moments = "second" if self.growth == "ag" else "none"
        if self.growth == "ma" and self.seed_moments not in ("second", "none"):
            raise ValueError(
                f"seed_moments={self.seed_moments!r}: SpIEL-MA (growth='ma') can seed only the second moment of grown weights "
                "(SM3's accumulators estimate squared gradients, not the mean gradient of AG's window): use 'second' or 'none'"
            )
        if self.growth == "ag" and self.seed_moments not in ("both", "second", "none"):
            raise ValueError(f"seed_moments must be 'both', 'second' or 'none', got seed_moments={self.seed_moments!r}")
        if self.replacement_rounding not in ("per_tensor", "apportioned"):
            raise ValueError(
                f"replacement_rounding must be 'per_tensor' or 'apportioned', got replacement_rounding={self.replacement_rounding!r}"
            )
        if self.replacement_rounding == "apportioned" and self.budget_split == "adaptive":
            raise ValueError(
                "replacement_rounding='apportioned' splits k(t) over tensors by their d_φ; budget_split='adaptive' ranks all "
                "tensors' weights together and pools the count itself: use replacement_rounding='per_tensor' with it"
            )
        if self.drop_criterion not in ("magnitude", "change"):
            raise ValueError(f"drop_criterion must be 'magnitude' or 'change', got drop_criterion={self.drop_criterion!r}")
        if self.budget_split == "adaptive" and (self.growth != "ag" or tuple(self.block_shape) != (1, 1)):
            raise ValueError(
                f"budget_split='adaptive' moves single weights between tensors by AG's window statistics; got "
                f"growth={self.growth!r} and block_shape={tuple(self.block_shape)} (needs growth='ag', block_shape=(1, 1))"
            )
        if self.grow_init not in ("zero", "gradient"):
            raise ValueError(f"grow_init must be 'zero' or 'gradient', got grow_init={self.grow_init!r}")
        if self.score_normalization is None:
            self.score_normalization = "column" if self.growth == "ag" and tuple(self.block_shape) == (1, 1) else "none"
        if self.score_normalization not in ("none", "column"):
            raise ValueError(f"score_normalization must be 'none' or 'column', got score_normalization={self.score_normalization!r}")
        if self.score_normalization != "none" and (self.growth != "ag" or tuple(self.block_shape) != (1, 1)):
            raise ValueError(
                f"score_normalization={self.score_normalization!r} applies to unstructured SpIEL-AG; got growth={self.growth!r}, "
                f"block_shape={tuple(self.block_shape)!r}"
            )
        if self.column_cap is not None:
            if isinstance(self.column_cap, bool) or not isinstance(self.column_cap, (int, float)) or not self.column_cap >= 1.0:
                raise ValueError(f"column_cap must be a number >= 1 (times the mean column count) or None, got column_cap={self.column_cap!r}")
            if self.growth != "ma" or tuple(self.block_shape) != (1, 1):
                raise ValueError(
                    f"column_cap={self.column_cap!r} caps SpIEL-MA's unstructured growth; got growth={self.growth!r}, "
                    f"block_shape={tuple(self.block_shape)!r}"
                )
        if self.ma_unseen not in ("mean", "zero"):
            raise ValueError(f"ma_unseen must be 'mean' or 'zero', got ma_unseen={self.ma_unseen!r}")
        if self.ma_unseen != "zero" and self.growth != "ma":
            raise ValueError(f"ma_unseen={self.ma_unseen!r} is a setting of SpIEL-MA's growth; got growth={self.growth!r}")
        if not isinstance(self.ma_regrow_dropped, bool):
            raise ValueError(f"ma_regrow_dropped must be True or False, got ma_regrow_dropped={self.ma_regrow_dropped!r}")
        if not self.ma_regrow_dropped and self.growth != "ma":
            raise ValueError(f"ma_regrow_dropped=False is a setting of SpIEL-MA's growth; got growth={self.growth!r}")
        if not self.ma_regrow_dropped and self.column_cap is not None:
            raise ValueError(f"ma_regrow_dropped=False does not combine with column_cap={self.column_cap!r} (the capped growth ranks outside the kept weights)")
        if self.ma_signal is None:  # block MA: 'io', whose sums see the rows and columns its blocks do not cover
            self.ma_signal = "io" if self.growth == "ma" and tuple(self.block_shape) != (1, 1) else "sm3"
        if self.ma_signal not in ("sm3", "io"):
            raise ValueError(f"ma_signal must be 'sm3' or 'io', got ma_signal={self.ma_signal!r}")
        if self.ma_signal != "sm3" and self.growth != "ma":
            raise ValueError(f"ma_signal={self.ma_signal!r} is a setting of SpIEL-MA's growth; got growth={self.growth!r}")
        if self.growth == "ma" and self.grow_init != "zero":
            raise ValueError(
                f"grow_init={self.grow_init!r} is a setting of AG's estimation window; SpIEL-MA (growth='ma') has none: leave it at 'zero'"
            )

    def steps_for(self, total_steps: int) -> tuple[int, int]:
        """(S, γ) in optimizer steps for a run of ``total_steps``: counts as given, fractions of T rounded
        (S ≥ 2, γ ≥ 1), 'auto' as the fields' help says (S = max(20, round(2T/15)), γ = max(5, round(T/30)) < S)."""
        S, gamma = self.reselection_steps, self.gradient_estimation_steps
        if S == "auto":
            S = max(20, round(2 * total_steps / 15))
        elif not isinstance(S, int):
            S = max(2, round(S * total_steps))
        if gamma == "auto":
            gamma = min(max(5, round(total_steps / 30)), S - 1)  # (below S also where S is set and small)
        elif not isinstance(gamma, int):
            gamma = max(1, round(gamma * total_steps))
        if gamma >= S:
            raise ValueError(
                f"gradient_estimation_steps={self.gradient_estimation_steps!r} and reselection_steps={self.reselection_steps!r} give "
                f"γ={gamma} ≥ S={S} for total_steps={total_steps}; γ must stay below S"
            )
        return S, gamma

    def first_replacement_is_full(self, total_steps: int) -> bool:
        """Whether the first reselection of a run of ``total_steps`` replaces every index: the field as given, or
        for 'auto' True unless MA ranks growth by ``ma_signal='io'`` and fewer than
        :data:`IO_FULL_REPLACEMENT_MIN_FOLLOWING` reselections (at t = γ + kS < T) follow the first."""
        if self.first_full_replacement != "auto":
            return bool(self.first_full_replacement)
        if self.growth != "ma" or self.ma_signal != "io":
            return True
        S, gamma = self.steps_for(total_steps)
        following = max(0, math.ceil((total_steps - gamma) / S) - 1)  # k ≥ 1 with γ + kS < T
        return following >= IO_FULL_REPLACEMENT_MIN_FOLLOWING

    def earliest_first_reselection(self) -> int:
        """The smallest t = γ at which the first reselection can fall, before ``total_steps`` is known."""
        gamma, S = self.gradient_estimation_steps, self.reselection_steps
        if isinstance(gamma, int):
            return gamma
        if gamma == "auto":
            return min(5, S - 1) if isinstance(S, int) else 5 if S == "auto" else 1
        return 1  # (a fraction of a run length not known yet)
