r"""SpIEL: sparse fine-tuning whose indices η move during training (thesis ch. 7, Algorithms 2–3).

Notation (as in §7.4.3, not as in the algorithms' pseudocode): every **S** optimizer steps
(``reselection_steps``) each tensor i *drops* k(i, t) of its d_φ(i) active weights and *grows*
k(i, t) new ones. The first reselection, at t = γ, replaces all of them (Eq. 7.6); k then decays
(linear Eq. 7.6 or cosine Eq. E.1, see :mod:`peft_sparse.schedules.reselection`).

* **DROP** — the k active weights with the smallest |φ| (§7.3.1 text; ties → lowest flat index).
* **GROW, AG** (accumulated gradient, Alg. 2) — over the γ steps ending at a reselection (the
  *gradient-estimation window*) the dense gradient of each targeted matrix is formed transiently.
  On the window's first micro-batch the top-K_i positions by |∂L/∂θ| become *candidates*
  (K_i = ⌈candidate_ratio · d_φ(i)⌉); from then on only their gradients are kept: per optimizer
  step their sum g (the gradient Adam sees), accumulated as Σg and Σg² over the window (Eq. 7.5).
  Grow the k eligible candidates (not active after the drop — a just-dropped index may regrow)
  with the largest |ĝ| = |Σg|/γ. If fewer than k are eligible, drop only as many as can be grown.
* **GROW, MA** (momentum approximation, Alg. 3) — the k inactive positions with the largest
  √⁴(R_i·C_j) (Eq. 7.7) from SM3's row/column accumulators. The scores form a rank-one matrix, so
  a threshold that leaves about d_φ positions above it is found by counting, and only those
  positions are listed and ranked: no (out, in) score matrix exists.

The scheduler reselects all tensors together (:func:`reselect_all`): each tensor's drop and AG grow
is a rank within its segment of one concatenation, so a reselection costs a handful of launches
whatever the number of tensors; :func:`reselect_ag` and :func:`reselect_ma` are the same policy for
one tensor, written plainly (and the reference the batched version is tested against).

Grown weights start at φ = 0 with age t; the optimizer keeps the same Parameter objects and its
state is re-gathered and seeded by :mod:`peft_sparse.optim.surgery`. Persistent memory is O(d_φ):
candidate statistics exist only during windows, the dense gradient only inside a backward pass.
"""

from __future__ import annotations

import json
import math
import os
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Optional

import torch
import torch.distributed as dist
from peft.utils import PeftType
from safetensors.torch import load_file, save_file

from ..core import kernels
from ..core.config import SparseConfig
from ..core.layer import SparseLayer, index_dtype, release_training_merges, reseat_training_merges
from ..core.selection import BlockGrid, module_generator, random_indices, segmented_rank, top_k_set
from ..core.tuner import SparseTuner
from ..optim.sm3 import SM3
from ..optim.surgery import check_supported, reindex_optimizer_states, seed_optimizer_states
from ..schedules.reselection import in_estimation_window, is_reselection_step, replacement_count


@dataclass
class SpIELConfig(SparseConfig):
    """Configuration of SpIEL (PEFT type ``"SPIEL"``); train it with :class:`SpIELCallback` or :class:`SpIELScheduler`.

    The paper's settings (thesis §7.4.3, Table 7.1, Llama-2): S=20, ξ=0.2, γ=5, K_i=d_φ(i); AdamW with
    lr 1e-4 and decoupled weight decay λ=30 for AG (7b and 13b); SM3 with lr 1e-3 and λ=0.3 (7b) or
    lr 4e-4 and λ=0 (13b) for MA. λ is the optimizer's ``weight_decay``.
    """

    growth: str = field(default="ag", metadata={"help": "'ag' (accumulated gradients, Alg. 2) or 'ma' (SM3 momentum approximation, Alg. 3)."})
    reselection_steps: int = field(default=20, metadata={"help": "S: optimizer steps between reselections."})
    initial_reselection_rate: float = field(default=0.2, metadata={"help": "ξ in (0, 1]: fraction of d_φ(i) replaced at t=γ+S, decaying to 0 at T."})
    gradient_estimation_steps: int = field(default=5, metadata={"help": "γ: optimizer steps in an AG gradient-estimation window (0 < γ < S); the first reselection is at t=γ."})
    candidate_ratio: float = field(default=1.0, metadata={"help": "K_i = ceil(candidate_ratio·d_φ(i)) growth candidates per tensor (AG), ≥ 1."})
    schedule: str = field(default="linear", metadata={"help": "'linear' (Eq. 7.6) or 'cosine' (Eq. E.1) decay of k(t)."})
    init: str = field(default="random", metadata={"help": "'random' (the paper's initial η) or 'external' (indices from a saved adapter)."})

    init_choices: ClassVar[tuple[str, ...]] = ("random",)

    def __post_init__(self):
        super().__post_init__()
        self.peft_type = PeftType.SPIEL
        if self.growth not in ("ag", "ma"):
            raise ValueError(f"growth must be 'ag' or 'ma', got growth={self.growth!r}")
        for name in ("reselection_steps", "gradient_estimation_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {name}={value!r}")
        if self.gradient_estimation_steps >= self.reselection_steps:
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

    def trainer_callbacks(self) -> list:
        """Callbacks a Trainer needs to train this adapter."""
        from ..callbacks import SpIELCallback

        return [SpIELCallback()]


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
        super()._create_and_replace(peft_config, adapter_name, target, target_name, parent, current_key, **kwargs)
        if "_guard" not in self.__dict__:
            self.__dict__["_guard"] = _UnscheduledTrainingGuard()
        guard = self.__dict__["_guard"]
        first = peft_config.gradient_estimation_steps
        guard.first_reselection = first if guard.first_reselection is None else min(guard.first_reselection, first)
        self.model.get_submodule(current_key).training_observer = guard


# ------------------------------------------------------------------------------------------- selection
def top_k_positions(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Element numbers of the k largest ``scores``, ordered by (score desc, element number asc).

    Ties go to the lowest element number: callers pass scores in ascending flat-index order, so this
    is the "ties break by lowest flat index" rule. Scores are non-negative (negative values, e.g. a
    −inf mask, rank below all of them). Each score and its element number are packed into one int64
    key — non-negative float32 bit patterns order like the floats — so one ``topk`` resolves ties
    deterministically, with no host synchronisation (it runs inside backward passes).
    """
    n = scores.numel()
    k = min(k, n)
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=scores.device)
    if n >= 2**32:
        return torch.sort(scores.reshape(-1), descending=True, stable=True).indices[:k]
    bits = scores.reshape(-1).float().view(torch.int32).to(torch.int64)
    low = 0xFFFFFFFF - torch.arange(n, device=scores.device, dtype=torch.int64)  # lower element number → larger key
    keys = torch.topk((bits << 32) | low, k, sorted=True).values
    return 0xFFFFFFFF - (keys & 0xFFFFFFFF)


UNSTRUCTURED = BlockGrid(1, 1)  # units are single weights (only unit-size-independent methods are used)


@dataclass
class Reselection:
    """Result of one drop/grow on one tensor (all tensors on the values' device).

    ``source[j]`` is the old slot now at new slot j, or −1 for a grown slot; ``grown_from[j]`` is the
    row of the growth statistics a grown slot came from (−1 for kept slots).
    """

    indices: torch.Tensor
    source: torch.Tensor
    grown_from: torch.Tensor
    dropped: int
    shortfall: int = 0
    units: Optional[torch.Tensor] = None  # the active units (blocks) afterwards, ascending


def _isin_sorted(values: torch.Tensor, sorted_set: torch.Tensor) -> torch.Tensor:
    """Which ``values`` are in ``sorted_set`` (ascending, distinct): a binary search, O(len) memory."""
    if sorted_set.numel() == 0:
        return torch.zeros(values.shape, dtype=torch.bool, device=values.device)
    values = values.long()
    pos = torch.searchsorted(sorted_set.long(), values).clamp_(max=sorted_set.numel() - 1)
    return sorted_set.long()[pos] == values


def _union_positions(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the elements of two ascending, disjoint lists sit in their ascending union: each one's
    rank in its own list plus the number of smaller elements in the other (no sort)."""
    at_a = torch.arange(a.numel(), device=a.device) + torch.searchsorted(b, a)
    at_b = torch.arange(b.numel(), device=a.device) + torch.searchsorted(a, b)
    return at_a, at_b


def _merge(
    indices: torch.Tensor, keep: torch.Tensor, n_kept: int, grown_idx: torch.Tensor, grown_rows: torch.Tensor
) -> Reselection:
    """New sorted indices from the kept old ones and the grown ones (ascending, disjoint from the kept)."""
    kept_slots = torch.nonzero_static(keep, size=n_kept).squeeze(1)  # n_kept is known: no host sync
    kept_idx = indices.long()[kept_slots]
    grown_idx = grown_idx.long()
    at_kept, at_grown = _union_positions(kept_idx, grown_idx)
    new_idx = torch.empty(n_kept + grown_idx.numel(), dtype=torch.long, device=indices.device)
    new_idx[at_kept] = kept_idx
    new_idx[at_grown] = grown_idx
    source = torch.full_like(new_idx, -1)
    source[at_kept] = kept_slots
    grown_from = torch.full_like(new_idx, -1)
    grown_from[at_grown] = grown_rows.long()
    return Reselection(new_idx, source, grown_from, dropped=indices.numel() - n_kept)


def _drop(values: torch.Tensor, indices: torch.Tensor, grid: BlockGrid, units: Optional[torch.Tensor] = None):
    """Active units, their magnitudes Σ|φ|, and each element's unit number (row)."""
    if grid.unit == 1:
        return indices.long(), values.detach().abs().float(), None
    if units is None:
        units = grid.units(indices)
    magnitude = grid.unit_sums(indices, values.detach().abs().float(), units)
    unit_of_element = torch.searchsorted(units, grid.block_of(indices))
    return units, magnitude, unit_of_element


def _kept(units: torch.Tensor, magnitude: torch.Tensor, k: int):
    """Mask of the units kept after dropping the k smallest magnitudes (ties → lowest unit), and the
    kept units in ascending order (a selection, not a sort of all magnitudes)."""
    kept = torch.ones(units.numel(), dtype=torch.bool, device=units.device)
    kept[top_k_set(-magnitude, k)] = False
    return kept, torch.nonzero_static(kept, size=units.numel() - k).squeeze(1)


def _grow_ag(units, magnitude, unit_of_element, indices, k, candidates, cand_units, cand_score, grid):
    """One drop/grow attempt with exactly k units, without a host sync. Returns (result, n_eligible);
    the result is invalid when n_eligible < k."""
    kept, kept_positions = _kept(units, magnitude, k)
    kept_ids = units[kept_positions]  # ascending
    eligible = ~_isin_sorted(cand_units, kept_ids)
    masked = torch.where(eligible, cand_score.float(), -1.0)  # scores are ≥ 0: ineligible rank last
    grown_units = cand_units[top_k_positions(masked, k)].long().sort().values
    grown = grid.expand(grown_units)
    keep = kept if unit_of_element is None else kept[unit_of_element]
    result = _merge(indices, keep, (units.numel() - k) * grid.unit, grown, torch.searchsorted(candidates.long(), grown))
    result.units = _merged_units(kept_ids.long(), grown_units)[0]
    return result, eligible.sum()


def _merged_units(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """(the ascending union of two ascending, disjoint unit lists, where ``a``'s and ``b``'s units sit in it)."""
    at_a, at_b = _union_positions(a, b)
    out = torch.empty(a.numel() + b.numel(), dtype=torch.long, device=a.device)
    out[at_a] = a
    out[at_b] = b
    return out, at_a, at_b


def reselect_ag(
    values: torch.Tensor,
    indices: torch.Tensor,
    k: int,
    candidates: torch.Tensor,
    score: torch.Tensor,
    grid: Optional[BlockGrid] = None,
    units: Optional[torch.Tensor] = None,
    candidate_units: Optional[torch.Tensor] = None,
):
    """DROP the k units (weights or blocks) with the smallest Σ|φ|; GROW the k eligible candidate
    units with the largest Σ ``score`` (score = |ĝ| per candidate weight).

    ``candidates`` are ascending flat indices covering whole units. If fewer than k candidates are
    eligible, drop only as many as can be grown (the largest k' ≤ k with k' eligible) and report
    the shortfall (in units). With at least d_φ candidates (SpIEL's K ≥ d_φ) that cannot happen.
    One host synchronisation (the batched path, :func:`reselect_all`, has none).
    """
    grid = grid or UNSTRUCTURED
    units, magnitude, unit_of_element = _drop(values, indices, grid, units)
    cand_units = candidates.long() if grid.unit == 1 else (candidate_units if candidate_units is not None else grid.units(candidates))
    cand_score = grid.unit_sums(candidates, score, cand_units)
    wanted = k = min(k, units.numel())
    result, n_eligible = _grow_ag(units, magnitude, unit_of_element, indices, k, candidates, cand_units, cand_score, grid)
    n_eligible, finite = torch.stack([n_eligible, torch.isfinite(score).all().long()]).tolist()
    if not finite:
        raise ValueError("growth scores contain NaN or infinite values (a NaN gradient?)")
    while n_eligible < k:  # the largest k' ≤ k with k' eligible candidates after dropping k'
        k = n_eligible
        result, n_eligible = _grow_ag(units, magnitude, unit_of_element, indices, k, candidates, cand_units, cand_score, grid)
        n_eligible = int(n_eligible)
    result.shortfall = wanted - k
    return result


def top_k_row_col_products(
    row_acc: torch.Tensor, col_acc: torch.Tensor, excluded: torch.Tensor, k: int, chunk_elements: int = 1 << 22
) -> torch.Tensor:
    """Ascending flat indices of the k largest R_i·C_j over positions not in ``excluded`` (ascending),
    ranked like :func:`top_k_positions` (scores rounded to float32, ties → lowest index).

    R and C are non-negative, so the scores form a rank-one matrix whose large entries are cheap to
    find without forming it: a threshold τ with at least k + |excluded| scores ≥ τ (and few more) is
    found by counting, row by row, the columns above τ/R_i in the sorted C (rounds of a log-spaced
    grid of thresholds, all rows at once); only the positions above τ — about d_φ of them — are then
    listed and ranked. Memory and time are O(d_φ + rows·grid + cols), never O(rows·cols). When zeros
    or massive ties stop the threshold from separating few enough positions, it falls back to an
    exact scan in row chunks of at most ``chunk_elements``. (One tensor of :func:`_grow_rank_one_all`.)
    """
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=row_acc.device)
    excluded = excluded.long()
    return _grow_rank_one_all([row_acc.double()], [col_acc.double()], excluded, [excluded.numel()], [k], [0], chunk_elements)


_MARGIN = 1e-6  # relative: the threshold is lowered by this much so float32 ties of the k-th score are listed
_COUNT_CHUNK = 1 << 25  # threshold queries per batched count (256 MiB of float64)


def _top_k_row_col_products_chunked(
    row_acc: torch.Tensor, col_acc: torch.Tensor, excluded: torch.Tensor, k: int, chunk_elements: int
) -> torch.Tensor:
    """Exact top-k of R_i·C_j outside ``excluded`` by scanning row chunks (the fallback)."""
    out_features, in_features = row_acc.numel(), col_acc.numel()
    rows_per_chunk = max(1, chunk_elements // in_features)
    best_score = torch.empty(0, dtype=torch.float64, device=row_acc.device)
    best_index = torch.empty(0, dtype=torch.long, device=row_acc.device)
    excluded = excluded.long()
    for r0 in range(0, out_features, rows_per_chunk):
        r1 = min(out_features, r0 + rows_per_chunk)
        scores = (row_acc[r0:r1, None].double() * col_acc[None, :].double()).reshape(-1)  # (chunk,)
        base, size = r0 * in_features, scores.numel()
        here = excluded[(excluded >= base) & (excluded < base + size)] - base
        scores[here] = -math.inf
        top = top_k_positions(scores, k)
        # merge with the best so far: order by (score desc, index asc)
        cand_index = torch.cat([best_index, top + base])
        cand_score = torch.cat([best_score, scores[top]])
        by_index = torch.argsort(cand_index)
        keep = top_k_positions(cand_score[by_index], k)
        best_index, best_score = cand_index[by_index][keep], cand_score[by_index][keep]
    return best_index.sort().values


def reselect_ma(
    values: torch.Tensor,
    indices: torch.Tensor,
    k: int,
    row_acc: torch.Tensor,
    col_acc: torch.Tensor,
    grid: Optional[BlockGrid] = None,
    units: Optional[torch.Tensor] = None,
) -> Reselection:
    """DROP the k units with the smallest Σ|φ|; GROW the k units outside the kept set with the largest
    Σ√⁴(R_i·C_j) (Eq. 7.7) — for a block, (Σ_i R_i^¼)(Σ_j C_j^¼), so blocks rank like weights."""
    grid = grid or BlockGrid(row_acc.numel(), col_acc.numel())
    units, magnitude, unit_of_element = _drop(values, indices, grid, units)
    k = min(k, units.numel())
    kept, kept_positions = _kept(units, magnitude, k)
    kept_ids = units[kept_positions]  # ascending
    row_score = grid.reduce_rows(row_acc.double().pow(0.25))
    col_score = grid.reduce_cols(col_acc.double().pow(0.25))
    grown_units = top_k_row_col_products(row_score, col_score, kept_ids, k)
    grown = grid.expand(grown_units)
    keep = kept if unit_of_element is None else kept[unit_of_element]
    result = _merge(indices, keep, (units.numel() - k) * grid.unit, grown, torch.full_like(grown, -1))
    result.units = _merged_units(kept_ids.long(), grown_units)[0]
    return result


# ------------------------------------------------------------------------------------------- all tensors at once
@dataclass
class TensorReselection:
    """One tensor's inputs to :func:`reselect_all`: k units to replace and its growth statistics —
    AG: ``candidates`` (ascending flat indices of whole units), ``candidate_units``, ``score`` (Σg per
    candidate weight, or its magnitude: |score| ranks growth); MA: SM3's ``row_acc``, ``col_acc``."""

    values: torch.Tensor
    indices: torch.Tensor
    k: int
    grid: BlockGrid
    units: Optional[torch.Tensor] = None  # ascending active units of a block adapter
    candidates: Optional[torch.Tensor] = None
    candidate_units: Optional[torch.Tensor] = None
    score: Optional[torch.Tensor] = None
    row_acc: Optional[torch.Tensor] = None
    col_acc: Optional[torch.Tensor] = None


@dataclass
class AllReselections:
    """Result of :func:`reselect_all`, laid end to end over the tensors (slot j of tensor i is global
    slot ``offsets[i] + j``; every tensor keeps its size).

    ``source[j]``: the global old slot now at global slot j, −1 for a grown slot. ``grown_from[j]``: the
    global row of the concatenated candidates a grown slot came from (AG), else −1. ``units``: the new
    active blocks of block tensors.
    ``ok``: a device flag, False if some AG tensor had fewer than k eligible candidates or non-finite
    scores (then call :func:`reselect_ag` on it for the checked result)."""

    sizes: list
    source: torch.Tensor
    grown_from: torch.Tensor
    new_indices: torch.Tensor  # every tensor's new ascending flat indices (int64), laid end to end
    units: list
    dropped: list  # per tensor, in weights
    ok: torch.Tensor
    changed: torch.Tensor  # how many new indices were not active before (device scalar)
    per_tensor_ok: Optional[torch.Tensor] = None
    block_metadata: Optional[list] = None  # per block tensor: its BlockLayout
    shortfall: int = 0  # weights not replaced for want of eligible candidates (checked path only)

    @property
    def indices(self) -> tuple:
        """Each tensor's new indices (views of ``new_indices``)."""
        return torch.split(self.new_indices, self.sizes)

    @classmethod
    def of_tensors(cls, items: list, results: list) -> "AllReselections":
        """Per-tensor results (:func:`reselect_ag` / :func:`reselect_ma`) laid end to end like
        :func:`reselect_all` lays out its own. Call before the indices are edited."""
        sources, rows = [], []
        d_start = c_start = 0
        for it, r in zip(items, results):
            sources.append(torch.where(r.source >= 0, r.source + d_start, -1))
            rows.append(torch.where(r.grown_from >= 0, r.grown_from + c_start, -1))
            d_start += it.values.numel()
            c_start += it.candidates.numel() if it.candidates is not None else 0
        changed = torch.stack([(~_isin_sorted(r.indices, it.indices)).sum() for it, r in zip(items, results)]).sum()
        return cls(
            sizes=[it.values.numel() for it in items], source=torch.cat(sources), grown_from=torch.cat(rows),
            new_indices=torch.cat([r.indices for r in results]),
            units=[r.units if it.grid.unit > 1 else None for it, r in zip(items, results)],
            dropped=[r.dropped for r in results], ok=torch.ones((), dtype=torch.bool), changed=changed,
            block_metadata=[None] * len(items),
            shortfall=sum(r.shortfall * it.grid.unit for it, r in zip(items, results)),
        )  # fmt: skip


def _segment_sums(flags: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Per segment (laid end to end, each non-empty, starting at ``starts``) the number of True flags:
    differences of a running count (no atomics: a scatter into a few bins would serialise)."""
    running = torch.cumsum(flags, 0)
    ends = torch.cat([starts[1:], starts.new_full((1,), flags.numel())]) - 1  # (a fill: no copy from the host)
    at_end = running[ends]
    return at_end - torch.cat([at_end.new_zeros(1), at_end[:-1]])


def _grow_rank_one_all(
    row_scores: list, col_scores: list, kept_gid: torch.Tensor, n_kept: list, k: list, u_off: list, chunk_elements: int = 1 << 22
) -> torch.Tensor:
    """:func:`top_k_row_col_products` for many tensors at once; returns the grown units in the global
    numbering (unit u of tensor i is ``u_off[i] + u``), ascending.

    The threshold search of :func:`top_k_row_col_products` runs for all tensors together on zero-padded
    (tensors, rows) and (tensors, cols) tables; one host synchronisation gives every tensor's number
    of listed positions; the listed positions of all tensors are ranked by one segmented sort. A
    tensor whose threshold cannot be certified is ranked on its own by the exact chunked scan."""
    dev = kept_gid.device
    n = len(row_scores)
    m = [a.numel() for a in row_scores]
    c = [b.numel() for b in col_scores]
    big_m, big_c = max(m), max(c)

    def padded(xs, width, fill):
        sizes = kernels.table([x.numel() for x in xs], dev)
        seg = torch.repeat_interleave(torch.arange(n, device=dev), sizes, output_size=sum(x.numel() for x in xs))
        starts = torch.cumsum(sizes, 0) - sizes
        table = torch.full((n, width), fill, dtype=torch.float64, device=dev)
        table.view(-1)[seg * width + torch.arange(seg.numel(), device=dev) - starts[seg]] = torch.cat(xs)
        return table

    a = padded(row_scores, big_m, 0.0)  # (n, M): zero rows count nothing
    b = padded(col_scores, big_c, -math.inf)  # (n, C): padding sorts first and is never above a threshold
    b_sorted, b_order = torch.sort(b, dim=1)
    kept_t = kernels.table(n_kept, dev)
    k_t = kernels.table(k, dev)
    need = kept_t + k_t  # per tensor: at least this many scores ≥ τ
    inf = kernels.table(math.inf, dev, torch.float64)
    lo = torch.log(torch.where(a > 0, a, inf).amin(1)) + torch.log(torch.where(b > 0, b, inf).amin(1)) - _MARGIN
    hi = torch.log(a.amax(1)) + torch.log(b.amax(1)) + _MARGIN

    def count_above(tau):  # (n, G) thresholds → (n, G) counts of R_i·C_j ≥ τ
        g = tau.shape[1]
        step = max(1, _COUNT_CHUNK // (big_m * g))  # tensors per chunk: bounded transient memory
        counts = []
        for t0 in range(0, n, step):
            t1 = min(n, t0 + step)
            ratio = (tau[t0:t1, None, :] / a[t0:t1, :, None]).reshape(t1 - t0, -1)  # (chunk, M·G)
            per_row = big_c - torch.searchsorted(b_sorted[t0:t1], ratio)
            counts.append(per_row.view(t1 - t0, big_m, g).sum(1))
        return torch.cat(counts) if len(counts) > 1 else counts[0]

    points = 32
    steps = torch.linspace(0.0, 1.0, points, dtype=torch.float64, device=dev)
    for _ in range(5):
        grid = lo[:, None] + (hi - lo)[:, None] * steps
        at = ((count_above(torch.exp(grid)) >= need[:, None]).sum(1) - 1).clamp(min=0)
        lo, hi = grid.gather(1, at[:, None])[:, 0], grid.gather(1, (at + 1).clamp(max=points - 1)[:, None])[:, 0]
    tau = torch.exp(lo) * (1 - _MARGIN)
    per_row = big_c - torch.searchsorted(b_sorted, (tau[:, None] / a).contiguous())  # (n, M)
    totals = per_row.sum(1)
    lowest = count_above(torch.exp(lo)[:, None])[:, 0]
    size = kernels.table([mi * ci for mi, ci in zip(m, c)], dev)
    valid = (lowest >= need) & torch.isfinite(tau) & (totals <= 2 * need + 4096) & (need <= size)
    valid_list, totals_list = torch.stack([valid.long(), totals]).tolist()

    per_row = torch.where(valid[:, None], per_row, 0).view(-1)
    total = sum(t for t, ok in zip(totals_list, valid_list) if ok)
    row_all = torch.repeat_interleave(torch.arange(n * big_m, device=dev), per_row, output_size=total)
    tensor, row = row_all // big_m, row_all % big_m
    start = torch.cumsum(per_row, 0) - per_row
    col = b_order.view(-1)[tensor * big_c + big_c - per_row[row_all] + torch.arange(total, device=dev) - start[row_all]]
    gid = kernels.table(u_off, dev)[tensor] + row * kernels.table(c, dev)[tensor] + col
    score = a.view(-1)[row_all] * b.view(-1)[tensor * big_c + col]
    gid, order = torch.sort(gid)
    score, tensor = score[order], tensor[order]
    descending = 0x7FFFFFFF - score.float().view(torch.int32).long()
    key = torch.where(_isin_sorted(gid, kept_gid), 0x80000000, descending)  # kept (excluded) rank last
    listed = [t if ok else 0 for t, ok in zip(totals_list, valid_list)]
    starts = kernels.table([sum(listed[:i]) for i in range(n)], dev)
    chosen = segmented_rank(key, tensor, starts) < k_t[tensor]
    grown = [gid[torch.nonzero_static(chosen, size=sum(ki for ki, ok in zip(k, valid_list) if ok)).squeeze(1)]]
    kept_local = torch.split(kept_gid, n_kept)
    for i, ok in enumerate(valid_list):
        if not ok and k[i] > 0:
            local = _top_k_row_col_products_chunked(row_scores[i], col_scores[i], kept_local[i] - u_off[i], k[i], chunk_elements)
            grown.append(local + u_off[i])
    return torch.cat(grown).sort().values if len(grown) > 1 else grown[0]


def _starts(sizes: list) -> list:
    """Where each of segments of ``sizes``, laid end to end, starts."""
    starts = [0]
    for size in sizes[:-1]:
        starts.append(starts[-1] + size)
    return starts


def _segments(sizes: list, dev: torch.device) -> tuple:
    """(segment number per element, each segment's start on the device) of segments of ``sizes`` laid
    end to end, without waiting for the device."""
    seg = torch.repeat_interleave(torch.arange(len(sizes), device=dev), kernels.table(sizes, dev), output_size=sum(sizes))
    return seg, kernels.table(_starts(sizes), dev)


def reselect_all(items: list, growth: str) -> AllReselections:
    """DROP and GROW for many tensors at once, identical to :func:`reselect_ag` / :func:`reselect_ma`
    per tensor. The per-tensor selections are segmented ranks (one sort for all drops, one for all
    growths; MA's threshold search runs on padded per-tensor tables) and the merge is done once over
    the concatenation, so the number of launches hardly grows with the number of tensors. All items
    live on one device and share one block shape (one adapter's config).

    Block tensors work on blocks throughout (:func:`_reselect_blocks`): where each weight of a block
    sits among the values, the candidates and the new values follows from the blocks alone (the
    values are in ascending weight order: :class:`~peft_sparse.core.kernels.BlockLayout`), so no
    weight-sized search or sort runs."""
    dev = items[0].values.device
    n = len(items)
    d = [it.values.numel() for it in items]
    unit = items[0].grid.unit
    k = [min(it.k, d_i // unit) for it, d_i in zip(items, d)]
    e_off, u_off = [0], [0]  # element and unit offsets of each tensor in the global numbering
    for it in items[:-1]:
        e_off.append(e_off[-1] + it.grid.out_features * it.grid.in_features)
        u_off.append(u_off[-1] + it.grid.numel)
    magnitude = torch.cat([it.values.detach() for it in items]).abs().float()
    if unit > 1:
        return _reselect_blocks(items, growth, d, k, u_off, magnitude)
    k_t = kernels.table(k, dev)

    # unstructured: units are weights
    e_off_t = kernels.table(e_off, dev)
    seg_e, d_start_t = _segments(d, dev)
    # (concatenated first, then converted: one launch each, not one per tensor; the same values)
    eid = torch.cat([it.indices for it in items]).long() + e_off_t[seg_e]  # ascending

    # DROP (§7.3.1): the k smallest |φ| weights of each tensor, ties → lowest index
    dropped = segmented_rank(magnitude.view(torch.int32).long(), seg_e, d_start_t) < k_t[seg_e]
    kept_gid = eid[torch.nonzero_static(~dropped, size=sum(d) - sum(k)).squeeze(1)]

    # GROW: k weights per tensor outside the kept ones
    grown_from_rows = None
    ok = torch.ones((), dtype=torch.bool, device=dev)
    per_tensor_ok = None
    if growth == "ag":  # Alg. 2: the k eligible candidates with the largest |ĝ| (Eq. 7.5)
        seg_c, c_start_t = _segments([it.candidates.numel() for it in items], dev)
        cand_gid = torch.cat([it.candidates for it in items]).long() + e_off_t[seg_c]
        score = torch.cat([it.score for it in items]).float().abs()  # |ĝ| (Eq. 7.5)
        grown_gid, ok, per_tensor_ok, grown_from_rows = _grow_ag_all(cand_gid, score, score, seg_c, c_start_t, c_start_t, kept_gid, k_t, sum(k))
    else:  # Alg. 3: the k weights with the largest √⁴(R_i·C_j) (Eq. 7.7)
        grown_gid = _grow_ma_all(items, kept_gid, d, k, u_off)

    # MERGE: kept and grown weights of all tensors at once (each tensor keeps its size and place)
    rows = grown_from_rows if grown_from_rows is not None else torch.full_like(grown_gid, -1)
    merged = _merge(eid, ~dropped, sum(d) - sum(k), grown_gid, rows)
    new_flat = merged.indices - e_off_t[seg_e]
    changed = (~_isin_sorted(grown_gid, eid)).sum()  # (the kept weights were active; a dropped weight grown again is no change)
    return AllReselections(d, merged.source, merged.grown_from, new_flat, [None] * n, k, ok, changed, per_tensor_ok, [None] * n)


def _grow_ag_all(cand_gid, cand_score, score, seg_c, c_start_t, ce_start_t, kept_gid, k_t, k_total: int):
    """AG's growth over all tensors (Alg. 2): per tensor, the k eligible candidate units (not kept) with
    the largest summed |ĝ| (``cand_score``; ``score``: the weights' |ĝ|, checked for non-finite values),
    ties → lowest unit. Returns (grown units ascending, the all-tensors device flag — enough eligible
    candidates, finite scores —, the per-tensor flags, the grown units' places among the candidates).
    ``k_total`` = Σk, known on the host (no synchronisation)."""
    eligible = ~_isin_sorted(cand_gid, kept_gid)
    descending = 0x7FFFFFFF - cand_score.view(torch.int32).long()  # scores ≥ 0: larger score, smaller key
    key = torch.where(eligible, descending, 0x80000000)  # ineligible rank last
    grown_mask = segmented_rank(key, seg_c, c_start_t) < k_t[seg_c]
    n_eligible = _segment_sums(eligible, c_start_t)
    per_tensor_ok = (n_eligible >= k_t) & (_segment_sums(~torch.isfinite(score), ce_start_t) == 0)
    grown_at = torch.nonzero_static(grown_mask, size=k_total).squeeze(1)
    return cand_gid[grown_at], per_tensor_ok.all(), per_tensor_ok, grown_at


def _grow_ma_all(items, kept_gid, n_units, k, u_off):
    """MA's growth over all tensors (Alg. 3): per tensor, the k units outside the kept ones with the
    largest Σ√⁴(R_i·C_j) (Eq. 7.7); ascending, in the global unit numbering."""
    # √⁴ of every accumulator in one pass; summed per block row / column tensor by tensor (the
    # reductions of the per-tensor selection, shape for shape: the same sums to the last bit)
    row_all = torch.cat([it.row_acc for it in items]).double().pow(0.25)
    col_all = torch.cat([it.col_acc for it in items]).double().pow(0.25)
    rows_each = torch.split(row_all, [it.grid.out_features for it in items])
    cols_each = torch.split(col_all, [it.grid.in_features for it in items])
    row_scores = [it.grid.reduce_rows(r) for it, r in zip(items, rows_each)]
    col_scores = [it.grid.reduce_cols(c) for it, c in zip(items, cols_each)]
    return _grow_rank_one_all(row_scores, col_scores, kept_gid, [u - k_i for u, k_i in zip(n_units, k)], k, u_off)


def _reselect_blocks(items: list, growth: str, d: list, k: list, u_off: list, magnitude: torch.Tensor) -> AllReselections:
    """:func:`reselect_all` for block tensors. A tensor's values hold its blocks' weights in ascending
    weight order, so weight (i, j) of its b-th block sits at ``base[b] + i·stride[b] + j``
    (:meth:`~peft_sparse.core.kernels.BlockLayout.positions`, from the ascending blocks alone); the same
    holds for the candidates' sums and for the new values. Every weight-sized tensor is therefore a
    formula over the blocks: the Σ|φ| and Σ|ĝ| of each block are gathered at its slots, and the new
    indices, sources and candidate rows are written at the new blocks' slots."""
    dev = magnitude.device
    grid0 = items[0].grid
    bh, bw, unit = grid0.bh, grid0.bw, grid0.unit

    def table(xs):  # (without waiting for the device)
        return kernels.table(xs, dev)

    u_off_t, k_t = table(u_off), table(k)
    grid_cols = table([it.grid.cols for it in items])
    in_features = table([it.grid.in_features for it in items])
    d_start_t = table(_starts(d))
    row_span = 1 + max(it.grid.rows for it in items)  # (block rows of different tensors never share a key)
    slots = kernels.BlockLayout.element_slots  # (blocks, bh, bw): where each block's weights sit

    def layout(gid, seg, unit_start_t):  # ascending global units → local unit, block row, column, base, stride
        local = gid - u_off_t[seg]
        rows, cols = local // grid_cols[seg], local % grid_cols[seg]
        base, stride = kernels.BlockLayout.positions(seg * row_span + rows, (bh, bw), start=unit_start_t[seg])
        return local, rows, cols, base, stride

    # DROP (§7.3.1): the k smallest Σ|φ| blocks of each tensor, ties → lowest block
    units_local = [it.units if it.units is not None else it.grid.units(it.indices) for it in items]
    u_sizes = [u.numel() for u in units_local]
    seg_u, u_start_t = _segments(u_sizes, dev)
    unit_gid = torch.cat(units_local).long() + u_off_t[seg_u]
    _, _, _, old_base, old_stride = layout(unit_gid, seg_u, u_start_t)
    unit_magnitude = magnitude[slots(d_start_t[seg_u] + old_base, old_stride, (bh, bw)).reshape(-1)].view(-1, unit).sum(1)
    dropped_unit = segmented_rank(unit_magnitude.view(torch.int32).long(), seg_u, u_start_t) < k_t[seg_u]
    kept_at = torch.nonzero_static(~dropped_unit, size=sum(u_sizes) - sum(k)).squeeze(1)
    kept_gid = unit_gid[kept_at]

    # GROW: k blocks per tensor outside its kept blocks
    ok = torch.ones((), dtype=torch.bool, device=dev)
    per_tensor_ok = None
    if growth == "ag":  # Alg. 2: the k eligible candidates with the largest Σ|ĝ| (Eq. 7.5)
        ce_start_t = table(_starts([it.candidates.numel() for it in items]))
        score = torch.cat([it.score for it in items]).float().abs()  # |ĝ| (Eq. 7.5)
        cand_units = [it.candidate_units if it.candidate_units is not None else it.grid.units(it.candidates) for it in items]
        seg_c, c_start_t = _segments([c.numel() for c in cand_units], dev)
        cand_gid = torch.cat(cand_units).long() + u_off_t[seg_c]
        _, _, _, c_base, c_stride = layout(cand_gid, seg_c, c_start_t)
        cand_score = score[slots(ce_start_t[seg_c] + c_base, c_stride, (bh, bw)).reshape(-1)].view(-1, unit).sum(1)
        grown_gid, ok, per_tensor_ok, grown_at = _grow_ag_all(cand_gid, cand_score, score, seg_c, c_start_t, ce_start_t, kept_gid, k_t, sum(k))
    else:  # Alg. 3: the k blocks with the largest Σ√⁴(R_i·C_j) (Eq. 7.7)
        grown_gid = _grow_ma_all(items, kept_gid, u_sizes, k, u_off)

    # MERGE: the new blocks (kept and grown, ascending) and their weights at their slots
    all_units, at_kept, at_grown = _merged_units(kept_gid, grown_gid)
    local, rows, cols, base, stride = layout(all_units, seg_u, u_start_t)  # (every tensor keeps its number of blocks)
    new_slots = slots(d_start_t[seg_u] + base, stride, (bh, bw))
    total = sum(d)
    new_flat = torch.empty(total, dtype=torch.long, device=dev)
    width = in_features[seg_u]
    weights = slots(rows * bh * width + cols * bw, width, (bh, bw))  # (a block's weights in its row-major matrix)
    new_flat[new_slots.reshape(-1)] = weights.reshape(-1)
    del weights
    source = torch.full((total,), -1, dtype=torch.long, device=dev)
    source[new_slots[at_kept].reshape(-1)] = slots(d_start_t[seg_u[kept_at]] + old_base[kept_at], old_stride[kept_at], (bh, bw)).reshape(-1)
    grown_from = torch.full((total,), -1, dtype=torch.long, device=dev)
    if growth == "ag":
        grown_from[new_slots[at_grown].reshape(-1)] = slots(ce_start_t[seg_c[grown_at]] + c_base[grown_at], c_stride[grown_at], (bh, bw)).reshape(-1)
    del new_slots
    changed = (~_isin_sorted(grown_gid, unit_gid)).sum() * unit  # (a dropped block grown again is no change)

    # the new active blocks, and the layers' block metadata for them (see SparseLayer.block_metadata)
    units = list(torch.split(local, u_sizes))
    rows, cols = rows.to(torch.int32), cols.to(torch.int32)
    pieces = zip(*(torch.split(t, u_sizes) for t in (rows, cols, base, stride)))
    metadata = [
        kernels.BlockLayout(r, c, b, st, (bh, bw), it.grid.out_features, it.grid.in_features, u)
        for (r, c, b, st), it, u in zip(pieces, items, units)
    ]  # fmt: skip
    return AllReselections(d, source, grown_from, new_flat, units, [k_i * unit for k_i in k], ok, changed, per_tensor_ok, metadata)


# ------------------------------------------------------------------------------------------- scheduler
class _WindowStatistics:
    """Growth candidates of one tensor and their gradient sums over an estimation window (AG)."""

    def __init__(self, num_candidate_units: int, grid: BlockGrid, dtype: torch.dtype = torch.float32):
        self.num_candidate_units = num_candidate_units
        self.grid = grid
        self.dtype = dtype  # float32, or float64 over float64 values
        self.candidates: Optional[torch.Tensor] = None  # ascending flat indices
        self.candidate_units: Optional[torch.Tensor] = None  # ascending blocks (weights when unstructured)
        self.step_sum: Optional[torch.Tensor] = None  # Σ over this step's micro-batches
        self.grad_sum: Optional[torch.Tensor] = None  # Σ_steps g
        self.grad_sq_sum: Optional[torch.Tensor] = None  # Σ_steps g²
        # block adapters, once the candidates are chosen: their BlockLayout, what the block kernel needs
        # to compute the candidates' gradients without the dense dW (element (i, j) of candidate block b
        # sits at base[b] + i·stride[b] + j in ``candidates``)
        self.candidate_blocks = None

    # whether the window's later micro-batches take the candidate blocks' gradients from the block
    # kernel (off: from the dense dW, as the first micro-batch does)
    block_kernel: ClassVar[bool] = True

    def __call__(self, layer: SparseLayer, dense_grad: torch.Tensor) -> None:
        flat = dense_grad.reshape(-1)
        if self.candidates is None:  # first micro-batch of the window: pick the candidates
            if _distributed():
                flat = flat.clone()
                dist.all_reduce(flat)  # identical candidates on every rank
            g = self.grid
            if g.unstructured:  # units are the weights (one narrow copy of their indices), by |∂L/∂W|
                self.candidates, first = kernels.top_magnitudes(flat, self.num_candidate_units, index_dtype(flat.numel()))
                if _distributed():
                    first = None  # the selection's gradients are all ranks' sum: this rank's are gathered below
            else:  # blocks by Σ|∂L/∂W| (float32), then their layout, elements and first gradients in one pass
                block_shape = (g.bh, g.bw)
                keys = kernels.block_score_keys(flat.view(g.out_features, g.in_features), block_shape)
                self.candidate_units = kernels.top_blocks(keys, self.num_candidate_units)  # ascending
                own = dense_grad.reshape(g.out_features, g.in_features)  # this rank's gradient
                layout, self.candidates, first = kernels.gather_blocks(own, self.candidate_units, block_shape, index_dtype(flat.numel()))
                if self.block_kernel:
                    self.candidate_blocks = layout
            # (Σ g and Σ g² are allocated at the step's end, all tensors' together: see _allocate_sums)
            if first is not None and self.dtype == torch.float32:  # this micro-batch's gradients at the candidates
                self.step_sum = first
                return
            self.step_sum = torch.zeros(self.candidates.numel(), dtype=self.dtype, device=flat.device)
            if _distributed():
                flat = dense_grad.reshape(-1)
        self.step_sum += flat.index_select(0, self.candidates)

    def candidate_layout(self):
        """The :class:`~peft_sparse.core.kernels.BlockLayout` of the ascending ``candidate_units`` (block
        adapters): where each candidate block's elements sit in ``candidates``."""
        g = self.grid
        return kernels.BlockLayout.of_blocks(self.candidate_units, g.out_features, g.in_features, (g.bh, g.bw))

    def index_candidate_blocks(self) -> None:
        """Set ``candidate_blocks`` (see :meth:`candidate_layout`), unless ``block_kernel`` is off."""
        if self.block_kernel:
            self.candidate_blocks = self.candidate_layout()

    def add_candidate_gradients(self, grad_out2d: torch.Tensor, x2d: torch.Tensor, x_factor: Optional[torch.Tensor] = None) -> None:
        """Add one micro-batch's gradient at the candidate blocks (``candidate_blocks``) to ``step_sum``
        from the block kernel, instead of from the dense dW (``x_factor``: the layer input is
        ``x2d ⊙ x_factor``, formed tile by tile; see :func:`~peft_sparse.core.kernels.block_sddmm_into`),
        repeating the launch kept for the call's shape (:func:`~peft_sparse.core.kernels.block_value_gradient`)."""
        kernels.block_value_gradient(grad_out2d, x2d, self.candidate_blocks, x_factor=x_factor, out=self.step_sum)

    def end_step(self) -> None:
        if self.candidates is None:
            return
        _allocate_sums([self])
        self.grad_sum += self.step_sum
        self.grad_sq_sum += self.step_sum * self.step_sum
        self.step_sum.zero_()

    def tensors(self) -> dict:
        if self.candidates is None:
            return {}
        _allocate_sums([self])
        tensors = {"candidates": self.candidates, "step_sum": self.step_sum, "grad_sum": self.grad_sum, "grad_sq_sum": self.grad_sq_sum}
        if self.candidate_units is not None:  # block adapters
            tensors["candidate_units"] = self.candidate_units
        return tensors


def _allocate_sums(statistics: list) -> None:
    """Zero Σ g and Σ g² of the armed statistics that have none yet (a window's first step), one buffer
    per device and dtype for all of them (views of it)."""
    groups: dict = {}
    for stats in statistics:
        if stats.candidates is not None and stats.grad_sum is None:
            groups.setdefault((stats.step_sum.device, stats.step_sum.dtype), []).append(stats)
    for (device, dtype), fresh in groups.items():
        sizes = [m.step_sum.numel() for m in fresh]
        sums = torch.zeros(2, sum(sizes), dtype=dtype, device=device)
        for m, grad_sum, grad_sq_sum in zip(fresh, sums[0].split(sizes), sums[1].split(sizes)):
            m.grad_sum, m.grad_sq_sum = grad_sum, grad_sq_sum


def _end_steps(statistics: list) -> None:
    """:meth:`_WindowStatistics.end_step` of many tensors with a few multi-tensor launches (one group per
    device and dtype) instead of four launches each; the same operations, so the same bits."""
    groups: dict = {}
    for stats in statistics:
        if stats.candidates is not None:
            groups.setdefault((stats.step_sum.device, stats.step_sum.dtype), []).append(stats)
    _allocate_sums(statistics)
    for members in groups.values():
        step = [m.step_sum for m in members]
        torch._foreach_add_([m.grad_sum for m in members], step)
        torch._foreach_add_([m.grad_sq_sum for m in members], torch._foreach_mul(step, step))
        torch._foreach_zero_(step)


class DeferredSeeding:
    """Seeds the optimizer moments of grown slots at the *next* optimizer step, in that step's gradient units.

    The window statistics ĝ, ŝ come from raw backward gradients, but the training loop may rescale
    gradients before the optimizer sees them: the Trainer clips the global norm to ``max_grad_norm``
    and fp16 training removes a loss scale. Right after a reselection the values sit exactly where
    the gradient is largest, so clipping shrinks the next gradients far more than those of the window;
    raw-scale seeds would then outweigh the gradients Adam actually receives for dozens of steps
    and drive the new weights too far. So the seeds are written just before the next optimizer step
    (a step pre-hook), scaled by that step's factor c = ‖g_seen‖/‖g_raw‖ over the adapter's values:
    ‖g_raw‖ is read by post-accumulate hooks after each backward, ‖g_seen‖ when the step starts.
    Without rescaling c is exactly 1 and the seeds are exactly ĝ·(1−β₁ᵗ) and ŝ·(1−β₂ᵗ).
    """

    def __init__(self, optimizer, params: list):
        self.optimizer = optimizer
        self.params = params
        # id(param) → (grown slots, ĝ, ŝ) waiting for the next step
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.raw: dict = {}  # after a backward: the ids of the parameters with gradients and Σ‖g‖²
        self.last_factor = None  # c of the last seeding (a float, or a device scalar)
        self._queued = False
        self._handles = [p.register_post_accumulate_grad_hook(self._after_backward) for p in params]
        self._handles.append(optimizer.register_step_pre_hook(self._before_step))

    def _after_backward(self, param) -> None:
        if not self.pending or param.grad is None or self._queued:
            return
        # Read every gradient norm once the backward pass is over, in one multi-tensor reduction. Under
        # DDP the local gradient is averaged over ranks only when the backward pass finishes (DDP queues
        # that as an end-of-backward callback), so every rank measures the same averaged gradient: a
        # callback queued now runs before DDP's, so it queues a second one, which runs after.
        self._queued = True
        engine = torch.autograd.Variable._execution_engine
        if _distributed():
            engine.queue_callback(lambda: engine.queue_callback(self._read_raw))
        else:
            engine.queue_callback(self._read_raw)

    def _read_raw(self) -> None:
        self._queued = False
        with_grad = [p for p in self.params if p.grad is not None]
        self.raw = {"ids": {id(p) for p in with_grad}, "total": _squared_norm(with_grad)}

    def factor(self):
        """c: 1.0, or a float64 device scalar (computed without waiting for the device)."""
        if not self.raw:
            return 1.0
        seen = [p for p in self.params if id(p) in self.raw["ids"] and p.grad is not None]
        # the same reduction as the raw norms, so that no rescaling gives exactly 1
        raw = self.raw["total"]
        seen = _squared_norm(seen).to(raw.device)
        return torch.where((raw == seen) | (raw == 0.0), 1.0, torch.sqrt(seen / torch.where(raw == 0.0, 1.0, raw)))

    @torch.no_grad()
    def _before_step(self, optimizer, args, kwargs) -> None:
        if not self.pending:
            return
        c = self.factor()
        params = [p for p in self.params if id(p) in self.pending]
        entries = [self.pending[id(p)] for p in params]
        seed_optimizer_states(self.optimizer, params, [e[0] for e in entries], [e[1] for e in entries],
                              [e[2] for e in entries], scale=c)  # fmt: skip
        self.pending, self.raw, self.last_factor = {}, {}, c

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _squared_norm(params: list) -> torch.Tensor:
    """Σ‖grad‖² over ``params`` (float64, on the first one's device) by one multi-tensor norm per device."""
    if not params:
        return torch.zeros((), dtype=torch.float64)
    device = params[0].grad.device
    grads = [p.grad.detach() if p.grad.dtype in (torch.float32, torch.float64) else p.grad.detach().float() for p in params]
    norms = torch._foreach_norm(grads)
    if all(n.device == device for n in norms):  # (stacked, then widened: the same float64 values, two launches)
        return torch.stack(norms).to(torch.float64).square().sum()
    return torch.stack([n.to(device=device, dtype=torch.float64) for n in norms]).square().sum()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


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


class SpIELScheduler:
    """Drives SpIEL's reselections from optimizer steps; works with any training loop.

    Call :meth:`step` once after every optimizer step (t = 1 … ``total_steps``). It arms the dense-
    gradient seam of the adapted layers for the backward passes of estimation-window steps (AG),
    reselects at t = γ, γ+S, … and edits values, indices, ages and optimizer state in place. The
    optimizer must hold the adapter's values: ``torch.optim.AdamW``/``Adam`` (not amsgrad) or
    :class:`peft_sparse.SM3` for AG, :class:`peft_sparse.SM3` for MA.
    """

    def __init__(self, model, optimizer, total_steps: int, adapter_name: Optional[str] = None):
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps <= 0:
            raise ValueError(f"total_steps must be a positive integer, got total_steps={total_steps!r}")
        self.model, tuner, self.adapter_name, self.config = _find_spiel_adapter(model, adapter_name)
        self.total_steps = total_steps
        self.optimizer = check_supported(optimizer)
        if self.config.growth == "ma" and not isinstance(self.optimizer, SM3):
            raise TypeError(
                f"SpIEL-MA (growth='ma') ranks growth by SM3's accumulators and needs peft_sparse.SM3, "
                f"got optimizer {type(self.optimizer).__name__}"
            )
        self.layers = [m for m in self.model.modules() if isinstance(m, SparseLayer) and self.adapter_name in m.sparse_values]
        held = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        missing = [m.module_name for m in self.layers if id(m.sparse_values[self.adapter_name]) not in held]
        if missing:
            raise ValueError(f"the optimizer does not hold the SpIEL values of {missing[:3]}{'…' if len(missing) > 3 else ''}")
        self.t = 0
        self.steps_in_window = 0
        self.statistics: dict[str, _WindowStatistics] = {}
        self.seeding = DeferredSeeding(self.optimizer, [m.sparse_values[self.adapter_name] for m in self.layers]) if self.uses_windows else None
        self.last_statistics: dict = {}
        self._attach_guard(tuner)
        self._arm_if_window(1)

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
        return self.config.growth == "ag"

    def _in_window(self, t: int) -> bool:
        c = self.config
        return self.uses_windows and in_estimation_window(t, c.reselection_steps, c.gradient_estimation_steps, self.total_steps)

    def _arm_if_window(self, next_t: int) -> None:
        if self._in_window(next_t) and not self.statistics:
            for layer in self.layers:
                values = layer.sparse_values[self.adapter_name]
                dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
                grid = SparseTuner.grid(self.config, layer)
                num_units = math.ceil(self.config.candidate_ratio * (values.numel() // grid.unit))  # K = ⌈ratio·d_φ⌉ (in units)
                stats = _WindowStatistics(min(grid.numel, num_units), grid, dtype)
                self.statistics[layer.module_name] = stats
                layer.dense_grad_consumer = stats
            self.steps_in_window = 0

    def _disarm(self) -> None:
        for layer in self.layers:
            layer.dense_grad_consumer = None
        self.statistics = {}
        self.steps_in_window = 0

    def close(self) -> None:
        """Stop feeding statistics and remove the hooks (e.g. at the end of training); training the adapter on
        without a scheduler is watched again (the unscheduled-training warning)."""
        self._disarm()
        if self.seeding is not None:
            self.seeding.pending = {}
            self.seeding.remove()
        if self._guard is not None:
            self._guard.detach(self)

    # -- the loop
    def step(self) -> dict:
        """Advance to the next optimizer step; returns reselection statistics when one happened."""
        self.t += 1
        t, c = self.t, self.config
        if t == self.total_steps + 1:  # (once: the schedule ends at total_steps, training may go on with fixed indices)
            warnings.warn(
                f"SpIELScheduler: step {t} is past total_steps={self.total_steps}; the schedule has ended and the "
                "indices stay as they are from here on (set total_steps to the number of optimizer steps)"
            )
        if self.statistics:
            self._end_window_step()
        self.last_statistics = {}
        if is_reselection_step(t, c.reselection_steps, c.gradient_estimation_steps, self.total_steps):
            self.last_statistics = self._reselect(t)
            self._disarm()
        self._arm_if_window(t + 1)
        return self.last_statistics

    def _end_window_step(self) -> None:
        if _distributed():
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
        by_device: dict = {}  # device → [(layer, TensorReselection, window statistics)]
        for layer in self.layers:
            values, indices = layer.sparse_values[name], layer.sparse_indices[name]
            d = values.numel()
            grid = SparseTuner.grid(c, layer)
            k = replacement_count(  # in units: weights, or blocks
                t, self.total_steps, d // grid.unit, c.initial_reselection_rate, c.schedule, c.gradient_estimation_steps
            )
            if k == 0 or d == 0:
                continue
            item = TensorReselection(values, indices, k, grid, self._active_units(layer, grid))
            stats = None
            if c.growth == "ag":
                stats = self.statistics.get(layer.module_name)
                if stats is None or stats.candidates is None:
                    warnings.warn(f"SpIEL: {layer.module_name} got no gradient in the estimation window; not reselected")
                    continue
                item.candidates, item.score = stats.candidates, stats.grad_sum  # ĝ up to the factor 1/γ: |·| ranks
                item.candidate_units = stats.candidate_units if grid.unit > 1 else None
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
        checked = {at: self._checked(group) for at, (group, _, ok) in enumerate(results) if ok is False}  # (all before any edit)
        edits = [self._apply_all(t, group, checked.get(at, result), None if isinstance(ok, bool) else ok)
                 for at, (group, result, ok) in enumerate(results)]  # fmt: skip
        flags = [(at, ok) for at, (_, _, ok) in enumerate(results) if not isinstance(ok, bool)]
        report, down = self._report(t, edits, flags)
        if down:  # the edits of these groups changed nothing: their layouts back, their seeds dropped, and
            for at in down:  # the checked path (which raises on a non-finite score, the adapter as it was)
                edits[at].undo()
                edits[at] = self._apply_all(t, results[at][0], self._checked(results[at][0]), None)
            report, _ = self._report(t, edits, [])
        return report

    def _checked(self, group: list) -> AllReselections:
        """The group's reselection tensor by tensor, checked: fewer eligible candidates than k shrink k
        (reported as a shortfall); a non-finite score raises, nothing edited."""
        items = [it for _, it, _ in group]
        per_tensor = [reselect_ag(it.values, it.indices, it.k, it.candidates, it.score.abs(), it.grid, it.units, it.candidate_units)
                      for it in items]  # fmt: skip
        return AllReselections.of_tensors(items, per_tensor)

    def _apply_all(self, t: int, group: list, result: AllReselections, condition: Optional[torch.Tensor]) -> "_GroupEdit":
        """Edit values, ages, indices and optimizer state of a group of tensors from one result.
        ``condition`` (a device flag): the edits hold only where it is True; otherwise every slot keeps its
        old weight, and the values, ages, indices, merges and optimizer state keep their contents (the
        returned edit's ``undo`` then puts the old block layouts back, the seeds as they were, and θ₀
        back where a merge was set up anew)."""
        name = self.adapter_name
        layers = [layer for layer, _, _ in group]
        values = [layer.sparse_values[name] for layer in layers]
        ages = [layer.sparse_ages[name] for layer in layers]
        indices = [layer.sparse_indices[name] for layer in layers]
        source = result.source
        new_indices = result.new_indices
        if condition is not None:  # (False: every slot its own source, the old indices)
            source = torch.where(condition, source, torch.arange(source.numel(), device=source.device))
            new_indices = torch.where(condition, new_indices, torch.cat(indices).to(new_indices.dtype))
        grown = source < 0
        gather = source.clamp(min=0)
        all_ages = torch.cat(ages)
        age_before = (t - all_ages.long()).sum()
        new_ages = all_ages[gather]
        kept_age = torch.where(grown, 0, t - new_ages.long()).sum()
        new_ages[grown] = t
        new_values = torch.cat([v.detach() for v in values])[gather]
        new_values[grown] = 0
        torch._foreach_copy_([v.data for v in values], list(torch.split(new_values, result.sizes)))
        torch._foreach_copy_(ages, list(torch.split(new_ages, result.sizes)))

        def change_indices():
            if len({i.dtype for i in indices}) == 1:
                torch._foreach_copy_(indices, list(torch.split(new_indices.to(indices[0].dtype), result.sizes)))
            else:  # int32 and int64 indices (tensors of 2³¹ weights or more) side by side
                for index, new in zip(indices, torch.split(new_indices, result.sizes)):
                    index.copy_(new)

        # θ₀ back at the old positions before they change (SparseLayer docstring), θ₀[η] + φ at the new
        # ones for the next forward pass
        merged_anew = reseat_training_merges(layers, change_indices)
        reindex_optimizer_states(self.optimizer, values, source)
        n_grown = sum(result.dropped)
        waiting: dict = {}
        if group[0][2] is not None:  # AG: seeds for the next optimizer step, from the window's ĝ, ŝ
            n = max(1, self.steps_in_window)
            slots = torch.nonzero_static(grown, size=n_grown).squeeze(1)  # ascending: tensor by tensor
            rows = result.grown_from[slots]
            grad_mean = torch.cat([stats.grad_sum for _, _, stats in group])[rows] / n
            grad_sq_mean = torch.cat([stats.grad_sq_sum for _, _, stats in group])[rows] / n
            starts = _starts(result.sizes)  # each tensor's first slot: the grown slots become slots of their own tensor
            dev = slots.device
            local = slots - torch.repeat_interleave(kernels.table(starts, dev), kernels.table(result.dropped, dev), output_size=n_grown)
            pieces = zip(torch.split(local, result.dropped), torch.split(grad_mean, result.dropped), torch.split(grad_sq_mean, result.dropped))
            for value, (s, g, s2) in zip(values, pieces):
                if id(value) in self.seeding.pending:  # (seeds of an earlier reselection no step has taken yet)
                    waiting[id(value)] = self.seeding.pending[id(value)]
                self.seeding.pending[id(value)] = (s, g, s2)
        olds, layouts, plan_keys = [], [], []
        for layer, (_, item, _), units, meta in zip(layers, group, result.units, result.block_metadata):
            if units is not None and item.grid.unit > 1:
                old = layer.cached_block_metadata(name)
                olds.append((layer, old))
                layouts.append(layer.set_block_metadata(name, units, meta))
                plan_keys.append(list(old.plans) if old is not None else [])
        kernels.prepare_block_plans(layouts, plan_keys)  # the plans the old layouts used, all layers at once
        kernels.carry_launches([old for _, old in olds], layouts)  # and their kept value-gradient launches

        def undo():
            for layer, old in olds:
                if old is not None:
                    layer.set_block_metadata(name, old.block_numbers(), old)
            if self.seeding is not None:
                for value in values:
                    self.seeding.pending.pop(id(value), None)
                self.seeding.pending.update(waiting)
            # merges set up anew (their weight's storage replaced since the last pass, say): θ₀ back, left
            # to the next forward pass as before
            release_training_merges([layer for layer, _ in merged_anew])

        sums = torch.stack([age_before - kept_age, kept_age, result.changed.to(age_before.device)])
        return _GroupEdit(sums, n_grown, result.shortfall, undo)

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

    # -- state
    def state_dict(self) -> dict:
        """Step, window statistics and seeds still waiting for the next optimizer step (tensors by module)."""
        by_layer = {id(m.sparse_values[self.adapter_name]): m.module_name for m in self.layers}
        pending = self.seeding.pending if self.seeding is not None else {}
        return {
            "t": self.t,
            "total_steps": self.total_steps,
            "adapter_name": self.adapter_name,
            "steps_in_window": self.steps_in_window,
            "armed": bool(self.statistics),
            "statistics": {name: s.tensors() for name, s in self.statistics.items()},
            "pending_seeds": {
                by_layer[key]: {"slots": slots, "grad_mean": g, "grad_sq_mean": s2} for key, (slots, g, s2) in pending.items()
            },
        }

    def load_state_dict(self, state: dict) -> None:
        if state["adapter_name"] != self.adapter_name:
            raise ValueError(f"scheduler state is for adapter {state['adapter_name']!r}, not {self.adapter_name!r}")
        if state["total_steps"] != self.total_steps:
            raise ValueError(
                f"scheduler state was made with total_steps={state['total_steps']}, this scheduler has "
                f"total_steps={self.total_steps}; k(t) would differ"
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
                if tensors:
                    stats.candidates = tensors["candidates"].to(device_of(name), copy=True)
                    if "candidate_units" in tensors:
                        stats.candidate_units = tensors["candidate_units"].to(device_of(name), copy=True)
                        stats.index_candidate_blocks()
                    stats.step_sum = tensors["step_sum"].to(device_of(name), copy=True)
                    stats.grad_sum = tensors["grad_sum"].to(device_of(name), copy=True)
                    stats.grad_sq_sum = tensors["grad_sq_sum"].to(device_of(name), copy=True)
            self.steps_in_window = int(state["steps_in_window"])
        if self.seeding is not None:
            self.seeding.pending = {
                id(layers[name].sparse_values[self.adapter_name]): tuple(
                    t[k].to(device_of(name), copy=True) for k in ("slots", "grad_mean", "grad_sq_mean")
                )
                for name, t in state.get("pending_seeds", {}).items()
            }

    _TENSOR_GROUPS = ("statistics", "pending_seeds")

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
        for key, value in load_file(os.path.join(directory, "spiel_scheduler.safetensors")).items():
            group, module, name = key.split("::")
            groups[group].setdefault(module, {})[name] = value
        state.update(groups)
        self.load_state_dict(state)
