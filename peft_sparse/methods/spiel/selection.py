"""DROP and GROW for one tensor, as in thesis Algorithms 2 (AG) and 3 (MA)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...core.selection import BlockGrid, isin_sorted, top_k_positions, top_k_set
from .rank_one import column_cap_count, top_k_row_col_products, top_k_row_col_products_capped


# ------------------------------------------------------------------------------------------- selection

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
    eligible = ~isin_sorted(cand_units, kept_ids)
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



def ma_factor(accumulator: torch.Tensor, unseen: str = "zero") -> torch.Tensor:
    """One factor of SpIEL-MA's growth score (Eq. 7.7): √⁴ of SM3's row (or column) accumulator, float64.

    SM3 updates a row's accumulator only from the gradients of that row's active weights, so a row no active
    weight has sat in keeps its 0, and Eq. 7.7 would give every weight in it a score of 0: growth could then
    only ever reach the rows and columns already seen. Unstructured masks cover nearly every row; a block mask
    covers few (at 5% density a 576-row matrix of 64×64 blocks holds about 4 of its 9 block rows), and its
    growth would stay in that cross for good. ``unseen='mean'`` gives such a row the mean factor of the
    tensor's seen rows (0 if none is seen), so it ranks like an average row; ``'zero'`` (the default) keeps
    SM3's zeros.
    The same operations per tensor on every path, without a host synchronisation."""
    factor = accumulator.double().pow(0.25)
    if unseen == "zero":
        return factor
    seen = factor > 0
    fill = factor.sum() / seen.sum().clamp(min=1)  # (the unseen rows add exact zeros to the sum)
    return torch.where(seen, factor, fill)


def excludes_every_unit(regrow_dropped: bool, k: int, n_units: int, grid_units: int) -> bool:
    """Whether MA's growth in a tensor of ``n_units`` active units (of ``grid_units``) excludes all of them, not
    only the kept ones (``SpIELConfig.ma_regrow_dropped=False``): at a partial reselection (0 < k < n_units) with
    at least k inactive units. A full replacement keeps nothing, so there growth ranks every unit either way."""
    return not regrow_dropped and 0 < k < n_units and grid_units - n_units >= k


def reselect_ma(
    values: torch.Tensor,
    indices: torch.Tensor,
    k: int,
    row_acc: torch.Tensor,
    col_acc: torch.Tensor,
    grid: Optional[BlockGrid] = None,
    units: Optional[torch.Tensor] = None,
    column_cap: Optional[float] = None,
    unseen: str = "zero",
    regrow_dropped: bool = True,
) -> Reselection:
    """DROP the k units with the smallest Σ|φ|; GROW the k units outside the kept set with the largest
    Σ√⁴(R_i·C_j) (Eq. 7.7) — for a block, (Σ_i R_i^¼)(Σ_j C_j^¼), so blocks rank like weights. ``column_cap``
    (unstructured): no column ends above that many times the mean count (:func:`top_k_row_col_products_capped`).
    ``unseen``: the factor of rows and columns SM3 has not seen (:func:`ma_factor`). ``regrow_dropped=False``:
    growth ranks only the units outside the current ones (:func:`excludes_every_unit` says when)."""
    if not regrow_dropped and column_cap is not None:
        raise ValueError(f"regrow_dropped=False does not combine with column_cap={column_cap!r}")
    grid = grid or BlockGrid(row_acc.numel(), col_acc.numel())
    units, magnitude, unit_of_element = _drop(values, indices, grid, units)
    k = min(k, units.numel())
    kept, kept_positions = _kept(units, magnitude, k)
    kept_ids = units[kept_positions]  # ascending
    row_score = grid.reduce_rows(ma_factor(row_acc, unseen))
    col_score = grid.reduce_cols(ma_factor(col_acc, unseen))
    if column_cap is None:
        excluded = units.long() if excludes_every_unit(regrow_dropped, k, units.numel(), grid.numel) else kept_ids
        grown_units = top_k_row_col_products(row_score, col_score, excluded, k)
    else:
        cap = column_cap_count(column_cap, indices.numel(), col_score.numel())
        grown_units = top_k_row_col_products_capped(row_score, col_score, kept_ids, k, cap)
    grown = grid.expand(grown_units)
    keep = kept if unit_of_element is None else kept[unit_of_element]
    result = _merge(indices, keep, (units.numel() - k) * grid.unit, grown, torch.full_like(grown, -1))
    result.units = _merged_units(kept_ids.long(), grown_units)[0]
    return result
