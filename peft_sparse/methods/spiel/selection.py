"""DROP and GROW for one tensor, as in thesis Algorithms 2 (AG) and 3 (MA).

One reselection of tensor i at step t replaces k = k(i, t) of its d_φ(i) units (weights, or blocks; Eq. 7.6):

* DROP (Algorithm 2 lines 10–11, Algorithm 3 lines 15–16): the k active units with the smallest Σ|φ| (§7.3.1; the
  caller passes φ − φ₀ instead of φ for the algorithms' |φ − φ₀|); ties go to the lowest unit.
* GROW, AG (lines 12–13): the k eligible candidate units with the largest |ĝ| (Eq. 7.5), eligible meaning not among
  the kept ones, so a unit dropped here may be grown again.
* GROW, MA (Algorithm 3 lines 17–18): the k units outside the kept ones with the largest √⁴(R_i·C_j) (Eq. 7.7).

The thesis does not say what becomes of a unit dropped and grown at the same reselection. By default it is a new
unit (value 0, fresh optimizer state, age t). The authors' released code (``reference="authors"``) decides otherwise:
AG keeps such a unit where it was, with its value and optimizer state (``keep_regrown``), and MA never grows a unit
that was active before the reselection, at a full replacement either (``exclude_active``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...core.selection import BlockGrid, isin_sorted, top_k_positions, top_k_set
from .rank_one import top_k_row_col_products


UNSTRUCTURED = BlockGrid(1, 1)  # units are single weights (only unit-size-independent methods are used)


@dataclass
class Reselection:
    """Result of one drop/grow on one tensor (all tensors on the values' device).

    ``source[j]`` is the old slot now at new slot j, or −1 for a grown slot; ``grown_from[j]`` is the
    row of the growth statistics a grown slot came from (−1 for kept slots). ``dropped``: the units'
    weights that left (a unit dropped and kept again by ``keep_regrown`` did not leave).
    """

    indices: torch.Tensor
    source: torch.Tensor
    grown_from: torch.Tensor
    dropped: int
    shortfall: int = 0
    units: Optional[torch.Tensor] = None  # the active units (blocks) afterwards, ascending


# ------------------------------------------------------------------------------------------- pieces


def _union_positions(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the elements of two ascending, disjoint lists sit in their ascending union: each one's
    rank in its own list plus the number of smaller elements in the other (no sort)."""
    at_a = torch.arange(a.numel(), device=a.device) + torch.searchsorted(b, a)
    at_b = torch.arange(b.numel(), device=a.device) + torch.searchsorted(a, b)
    return at_a, at_b


def _merged_units(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """(the ascending union of two ascending, disjoint unit lists, where ``a``'s and ``b``'s units sit in it)."""
    at_a, at_b = _union_positions(a, b)
    out = torch.empty(a.numel() + b.numel(), dtype=torch.long, device=a.device)
    out[at_a] = a
    out[at_b] = b
    return out, at_a, at_b


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


def _active(values: torch.Tensor, indices: torch.Tensor, grid: BlockGrid, units: Optional[torch.Tensor] = None):
    """Active units, their magnitudes Σ|φ|, and each element's unit number (None when units are weights)."""
    if grid.unit == 1:
        return indices.long(), values.detach().abs().float(), None
    if units is None:
        units = grid.units(indices)
    magnitude = grid.unit_sums(indices, values.detach().abs().float(), units)
    unit_of_element = torch.searchsorted(units, grid.block_of(indices))
    return units, magnitude, unit_of_element


def drop(units: torch.Tensor, magnitude: torch.Tensor, k: int):
    """DROP: the mask of the units kept after dropping the k smallest magnitudes (ties → lowest unit), and
    the kept units in ascending order (a selection, not a sort of all magnitudes)."""
    kept = torch.ones(units.numel(), dtype=torch.bool, device=units.device)
    kept[top_k_set(-magnitude, k)] = False
    return kept, torch.nonzero_static(kept, size=units.numel() - k).squeeze(1)


def _keep_regrown(units: torch.Tensor, kept: torch.Tensor, grown_units: torch.Tensor):
    """``keep_regrown``: units both dropped and grown stay where they were. Returns (kept mask, grown units that
    are new, how many units came back) — one host synchronisation for the count."""
    back = isin_sorted(grown_units, units[~kept].long())
    again = isin_sorted(units.long(), grown_units[back])
    return kept | again, grown_units[~back], int(back.sum())


# ------------------------------------------------------------------------------------------- Algorithm 2


def _grow_ag(units, kept_ids, k, cand_units, cand_score):
    """GROW (AG): the k eligible candidate units with the largest scores (eligible: not kept), ascending, and
    how many were eligible (a device scalar: no host sync)."""
    eligible = ~isin_sorted(cand_units, kept_ids)
    masked = torch.where(eligible, cand_score.float(), -1.0)  # scores are ≥ 0: ineligible rank last
    return cand_units[top_k_positions(masked, k)].long().sort().values, eligible.sum()


def reselect_ag(
    values: torch.Tensor,
    indices: torch.Tensor,
    k: int,
    candidates: torch.Tensor,
    score: torch.Tensor,
    grid: Optional[BlockGrid] = None,
    units: Optional[torch.Tensor] = None,
    candidate_units: Optional[torch.Tensor] = None,
    keep_regrown: bool = False,
) -> Reselection:
    """Algorithm 2's DROP and GROW for one tensor: drop the k units with the smallest Σ|φ|, grow the k eligible
    candidate units with the largest Σ ``score`` (score = |ĝ| per candidate weight, Eq. 7.5).

    ``candidates`` are ascending flat indices covering whole units. If fewer than k candidates are eligible, drop
    only as many as can be grown (the largest k' ≤ k with k' eligible) and report the shortfall (in units); with at
    least d_φ candidates (the paper's K_i = d_φ(i)) that cannot happen. ``keep_regrown`` (``reference='authors'``):
    a unit both dropped and grown stays in its slot. One host synchronisation (more with a shortfall or
    ``keep_regrown``; the batched path, :func:`~.batched.reselect_all`, has none).
    """
    grid = grid or UNSTRUCTURED
    units, magnitude, unit_of_element = _active(values, indices, grid, units)
    cand_units = candidates.long() if grid.unit == 1 else (candidate_units if candidate_units is not None else grid.units(candidates))
    cand_score = grid.unit_sums(candidates, score, cand_units)
    wanted = k = min(k, units.numel())
    while True:  # the largest k' ≤ k with k' eligible candidates after dropping k'
        kept, kept_positions = drop(units, magnitude, k)  # DROP (line 11)
        grown_units, n_eligible = _grow_ag(units, units[kept_positions], k, cand_units, cand_score)  # GROW (line 13)
        if k == wanted:
            n_eligible, finite = torch.stack([n_eligible, torch.isfinite(score).all().long()]).tolist()
            if not finite:
                raise ValueError("growth scores contain NaN or infinite values (a NaN gradient?)")
        if int(n_eligible) >= k:
            break
        k = int(n_eligible)
    kept_ids, came_back = units[kept_positions], 0
    if keep_regrown:
        kept, grown_units, came_back = _keep_regrown(units, kept, grown_units)
        kept_ids = units[torch.nonzero_static(kept, size=units.numel() - k + came_back).squeeze(1)]  # (count known: no sync)
    grown = grid.expand(grown_units)
    keep = kept if unit_of_element is None else kept[unit_of_element]
    n_kept = (units.numel() - k + came_back) * grid.unit
    result = _merge(indices, keep, n_kept, grown, torch.searchsorted(candidates.long(), grown))
    result.units = _merged_units(kept_ids.long(), grown_units)[0]
    result.shortfall = wanted - k
    return result


# ------------------------------------------------------------------------------------------- Algorithm 3


def ma_factor(accumulator: torch.Tensor) -> torch.Tensor:
    """One factor of SpIEL-MA's growth score (Eq. 7.7): √⁴ of SM3's row (or column) accumulator, in float64. A row
    no active weight has sat in keeps SM3's 0, so growth stays within the rows and columns the mask has covered."""
    return accumulator.double().pow(0.25)


def reselect_ma(
    values: torch.Tensor,
    indices: torch.Tensor,
    k: int,
    row_acc: torch.Tensor,
    col_acc: torch.Tensor,
    grid: Optional[BlockGrid] = None,
    units: Optional[torch.Tensor] = None,
    exclude_active: bool = False,
) -> Reselection:
    """Algorithm 3's DROP and GROW for one tensor: drop the k units with the smallest Σ|φ|, grow the k units outside
    the kept ones with the largest Σ√⁴(R_i·C_j) (Eq. 7.7) — for a block, (Σ_i R_i^¼)(Σ_j C_j^¼), so blocks rank
    like weights. ``exclude_active`` (``reference='authors'``): growth ranks only the units that were inactive before
    the reselection (the caller checks there are k of them)."""
    grid = grid or BlockGrid(row_acc.numel(), col_acc.numel())
    units, magnitude, unit_of_element = _active(values, indices, grid, units)
    k = min(k, units.numel())
    kept, kept_positions = drop(units, magnitude, k)  # DROP (line 16)
    kept_ids = units[kept_positions]  # ascending
    row_score = grid.reduce_rows(ma_factor(row_acc))
    col_score = grid.reduce_cols(ma_factor(col_acc))
    excluded = units.long() if exclude_active else kept_ids
    grown_units = top_k_row_col_products(row_score, col_score, excluded, k)  # GROW (line 18)
    grown = grid.expand(grown_units)
    keep = kept if unit_of_element is None else kept[unit_of_element]
    result = _merge(indices, keep, (units.numel() - k) * grid.unit, grown, torch.full_like(grown, -1))
    result.units = _merged_units(kept_ids.long(), grown_units)[0]
    return result
