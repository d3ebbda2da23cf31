"""SpIEL's configuration (PEFT type ``"SPIEL"``): thesis §7.3, §7.4.3, Table 7.1."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Optional, Union

from peft.utils import PeftType

from ...core.config import SparseConfig, removed_fields
from .rules import released


# first_full_replacement='auto' with ma_signal='io': the full replacement at t = γ pays only with at least this many
# reselections after it (block MA, BENCHMARKS.md Quality: 60 steps with 2 follow: off is better; 100 with 4: on is)
IO_FULL_REPLACEMENT_MIN_FOLLOWING = 4


REFERENCES = ("authors",)

# what the removed fields' saved values must be to load (their old defaults), and what replaced them
_REMOVED = dict(
    replacement_rounding=(("per_tensor",), "k(t) is floored per tensor (Eq. 7.6); the count apportioned over tensors "
                          "measured no better on average (docs/ablations.md)"),
    grow_init=(("zero",), "grown weights start at 0 (§7.3.1); the first-order start measured lower (docs/ablations.md)"),
    seed_moments=(lambda c: (None, "none" if c.growth == "ma" else "second"),
                  "SpIEL-AG seeds the second Adam moment of grown weights and SpIEL-MA none (docs/ablations.md); the "
                  "thesis's seeding of both moments with a per-index age is reference='authors'"),
    column_cap=((None,), "SpIEL-MA's growth is not capped per column (Eq. 7.7); the cap measured lower (docs/ablations.md)"),
    ma_unseen=(("zero",), "rows and columns SM3 has not seen keep the factor 0 (Eq. 7.7); the mean factor measured no "
                          "better (docs/ablations.md)"),
    ma_regrow_dropped=((True,), "SpIEL-MA may grow a unit dropped at the same reselection; never growing one back is the "
                                "authors' released rule, part of reference='authors' (docs/differences.md)"),
)


@removed_fields(**_REMOVED)
@dataclass
class SpIELConfig(SparseConfig):
    """Configuration of SpIEL (PEFT type ``"SPIEL"``); train it with :class:`SpIELCallback` or :class:`SpIELScheduler`.

    The paper's settings (thesis §7.4.3, Table 7.1, Llama-2): S=20, ξ=0.2, γ=5, K_i=d_φ(i); AdamW with
    lr 1e-4 and decoupled weight decay λ=30 for AG (7b and 13b); SM3 with lr 1e-3 and λ=0.3 (7b) or
    lr 4e-4 and λ=0 (13b) for MA. λ is the optimizer's ``weight_decay``. ``reference="authors"`` runs the
    selection and optimizer-state rules of the authors' released code instead of this project's defaults
    (``docs/differences.md`` lists every difference).
    """

    growth: str = field(default="ag", metadata={"help": "'ag' (accumulated gradients, Algorithm 2) or 'ma' (SM3 momentum approximation, Algorithm 3)."})
    reselection_steps: Union[int, float, str] = field(
        default="auto",
        metadata={
            "help": (
                "S (§7.3.1, §7.4.3): optimizer steps between reselections. 'auto' (default): S = max(20, round(2·T/15)) for a "
                "run of T = total_steps, the paper's S=20 up to T=150 and scaled with T beyond (80 at T=600); with "
                "reference='authors' the paper's 20. An int is a count; a float in (0, 1) a fraction of T, S = max(2, round(S·T))."
            )
        },
    )
    initial_reselection_rate: float = field(default=0.2, metadata={"help": "ξ in (0, 1] (Eq. 7.6, E.1), the peak replacement rate: a reselection at step t after the first replaces ξ·(T − t)/T of d_φ(i) (linear), decaying to 0 at T."})
    gradient_estimation_steps: Union[int, float, str] = field(
        default="auto",
        metadata={
            "help": (
                "γ (§7.3.1, Eq. 7.5): optimizer steps in a gradient-estimation window (AG, and MA with ma_signal='io'; 0 < γ < S); "
                "the first reselection is at t=γ. 'auto' (default): γ = max(5, round(T/30)), the paper's 5 up to T=150 (20 at "
                "T=600), kept below S; with reference='authors' the paper's 5. An int is a count; a float in (0, 1) a fraction "
                "of total_steps, γ = max(1, round(γ·T))."
            )
        },
    )
    candidate_ratio: float = field(default=1.0, metadata={"help": "K_i = ceil(candidate_ratio·d_φ(i)) growth candidates per tensor (AG, §7.3.1; the paper sets K_i = d_φ(i)), ≥ 1."})
    schedule: str = field(default="linear", metadata={"help": "The decay of k(t): 'linear' (Eq. 7.6) or 'cosine' (Eq. E.1)."})
    init: str = field(default="random", metadata={"help": "'random' (the paper's initial η, Algorithm 2 line 4) or 'external' (indices from a saved adapter)."})
    first_full_replacement: Union[bool, str] = field(
        default="auto",
        metadata={
            "help": (
                "Replace every index at the first reselection (t=γ, Eq. 7.6's first case); False: k(γ) follows the schedule "
                "like later ones. 'auto' (default): True, except for SpIEL-MA with ma_signal='io' (block MA's default) in a run "
                "where fewer than 4 reselections follow the first (T ≤ γ + 4S: 60 steps has 2, 100 steps 4): a full replacement "
                "ranked on γ steps of sums needs later reselections to mend it (BENCHMARKS.md, Quality). With "
                "reference='authors' 'auto' is the released code's rule: full with the linear schedule, by Eq. E.1 with the cosine one."
            )
        },
    )
    drop_criterion: str = field(
        default="magnitude",
        metadata={
            "help": (
                "Which active weights are dropped: 'magnitude', the k smallest |φ| (§7.3.1, DROP), or 'change', the k smallest "
                "|φ − φ₀| with φ₀ the values right after the previous reselection (Algorithm 2 line 10, Algorithm 3 line 15)."
            )
        },
    )
    score_normalization: Optional[str] = field(
        default=None,
        metadata={
            "help": (
                "AG, unstructured: 'column' (the default there) divides each candidate's and grown weight's score |∂L/∂W| by "
                "its column's RMS gradient in the window's first micro-batch (like the candidates, so the choice depends on how "
                "that step is split into micro-batches), so that a few outlier input features cannot take most of the mask "
                "(BENCHMARKS.md, Quality); 'none' ranks by |∂L/∂W| itself (§7.3.1, Eq. 7.5). Leave unset for MA, block "
                "selection and reference='authors'."
            )
        },
    )
    ma_signal: Optional[str] = field(
        default=None,
        metadata={
            "help": (
                "MA: the row and column statistics R_i, C_j whose product ranks growth (Eq. 7.7). 'sm3' (Eq. 7.7 as written; the "
                "default for unstructured MA): SM3's accumulators, which only see the rows and columns of active weights. "
                "'io' (the default for block MA, whose blocks cover a third of the rows and columns; BENCHMARKS.md, Quality): over "
                "the γ-step estimation window before each reselection (as AG's), R_i = Σ (∂L/∂Y_i)² over the tokens of the layer's "
                "output gradient and C_j = Σ X_j² over its inputs: every row and column, and (∂L/∂W_ij)² ≤ R_i·C_j per "
                "micro-batch (Cauchy–Schwarz). Still out + in floats per tensor and no dense gradient; the window's steps "
                "take the general backward pass. Leave unset for AG."
            )
        },
    )
    reference: Optional[str] = field(
        default=None,
        metadata={
            "help": (
                "None (default): this project's defaults. 'authors': the selection and optimizer-state rules of the authors' "
                "released SpIEL code (docs/differences.md): the budget as a fraction of all the model's parameters, k(t) in "
                "floating point, windows of γ + 1 steps after the first, |Σg| growth scores, a dropped index grown again keeping "
                "its value and Adam state (AG), no dropped index grown again (MA), the cosine schedule without a full first "
                "replacement, and both Adam moments of grown weights seeded with a per-index age. Needs peft_sparse.AgedAdamW "
                "for AG and peft_sparse.SM3 without momentum for MA; single weights only (block_shape (1, 1))."
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
        if self.reference is not None and self.reference not in REFERENCES:
            raise ValueError(f"reference must be None or 'authors', got reference={self.reference!r}")
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
        if self.drop_criterion not in ("magnitude", "change"):
            raise ValueError(f"drop_criterion must be 'magnitude' or 'change', got drop_criterion={self.drop_criterion!r}")
        if self.budget_split == "adaptive" and (self.growth != "ag" or tuple(self.block_shape) != (1, 1)):
            raise ValueError(
                f"budget_split='adaptive' moves single weights between tensors by AG's window statistics; got "
                f"growth={self.growth!r} and block_shape={tuple(self.block_shape)} (needs growth='ag', block_shape=(1, 1))"
            )
        if self.reference == "authors":
            self._check_authors_reference()
        if self.score_normalization is None:
            unstructured_ag = self.growth == "ag" and tuple(self.block_shape) == (1, 1)
            self.score_normalization = "column" if unstructured_ag and self.reference is None else "none"
        if self.score_normalization not in ("none", "column"):
            raise ValueError(f"score_normalization must be 'none' or 'column', got score_normalization={self.score_normalization!r}")
        if self.score_normalization != "none" and (self.growth != "ag" or tuple(self.block_shape) != (1, 1)):
            raise ValueError(
                f"score_normalization={self.score_normalization!r} applies to unstructured SpIEL-AG; got growth={self.growth!r}, "
                f"block_shape={tuple(self.block_shape)!r}"
            )
        if self.ma_signal is None:  # block MA: 'io', whose sums see the rows and columns its blocks do not cover
            self.ma_signal = "io" if self.growth == "ma" and tuple(self.block_shape) != (1, 1) else "sm3"
        if self.ma_signal not in ("sm3", "io"):
            raise ValueError(f"ma_signal must be 'sm3' or 'io', got ma_signal={self.ma_signal!r}")
        if self.ma_signal != "sm3" and self.growth != "ma":
            raise ValueError(f"ma_signal={self.ma_signal!r} is a setting of SpIEL-MA's growth; got growth={self.growth!r}")

    def _check_authors_reference(self) -> None:
        """reference='authors' fixes what the released code fixes: settings that would contradict it are refused by name."""
        fixed = {  # field: (the released code's value, the value given if it differs)
            "block_shape": ((1, 1), tuple(self.block_shape)),
            "budget_split": ("uniform", self.budget_split),
            "candidate_ratio": (1.0, self.candidate_ratio),
            "drop_criterion": ("magnitude", self.drop_criterion),
            "first_full_replacement": ("auto", self.first_full_replacement),
            "score_normalization": ("none", self.score_normalization if self.score_normalization is not None else "none"),
            "ma_signal": ("sm3", self.ma_signal if self.ma_signal is not None else "sm3"),
        }
        for name, (released, given) in fixed.items():
            if given != released:
                raise ValueError(
                    f"reference='authors' runs the released code, which has {name}={released!r}; got {name}={given!r} "
                    f"(leave {name} unset, or use reference=None for this project's settings)"
                )

    def steps_for(self, total_steps: int) -> tuple[int, int]:
        """(S, γ) in optimizer steps for a run of ``total_steps``: counts as given, fractions of T rounded
        (S ≥ 2, γ ≥ 1), 'auto' as the fields' help says (S = max(20, round(2T/15)), γ = max(5, round(T/30)) < S;
        with ``reference='authors'`` the paper's S = 20, γ = 5)."""
        S, gamma = self.reselection_steps, self.gradient_estimation_steps
        authors = self.reference == "authors"
        if S == "auto":
            S = 20 if authors else max(20, round(2 * total_steps / 15))
        elif not isinstance(S, int):
            S = max(2, round(S * total_steps))
        if gamma == "auto":
            gamma = min(5 if authors else max(5, round(total_steps / 30)), S - 1)  # (below S also where S is set and small)
        elif not isinstance(gamma, int):
            gamma = max(1, round(gamma * total_steps))
        if gamma >= S:
            raise ValueError(
                f"gradient_estimation_steps={self.gradient_estimation_steps!r} and reselection_steps={self.reselection_steps!r} give "
                f"γ={gamma} ≥ S={S} for total_steps={total_steps}; γ must stay below S"
            )
        if released(self, "windows") and gamma == S - 1:  # (the released trainer opens each later window after step kS − 1)
            raise ValueError(
                f"reference='authors' (or the released rule 'windows') with γ={gamma} = S − 1 (S={S}): the released trainer "
                "opens a window after step S − 1 = γ, which empties the first window at its own reselection; use γ ≤ S − 2"
            )
        return S, gamma

    def first_replacement_is_full(self, total_steps: int) -> bool:
        """Whether the first reselection of a run of ``total_steps`` replaces every index: the field as given, or
        for 'auto' True unless MA ranks growth by ``ma_signal='io'`` and fewer than
        :data:`IO_FULL_REPLACEMENT_MIN_FOLLOWING` reselections (at t = γ + kS < T) follow the first. With
        ``reference='authors'``: the released rule, full with the linear schedule (Eq. 7.6), not with the cosine one."""
        if released(self, "cosine_first"):
            return self.schedule == "linear"
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
