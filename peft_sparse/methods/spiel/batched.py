"""DROP and GROW of every tensor of an adapter at once: the same policy as :mod:`.selection`, in a handful of launches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...core import kernels
from ...core.selection import BlockGrid, isin_sorted, segmented_rank
from .rank_one import _grow_rank_one_all
from .selection import _merge, _merged_units


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
    drop_values: Optional[torch.Tensor] = None  # what DROP ranks by magnitude, if not the values (φ − φ₀)


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
        changed = torch.stack([(~isin_sorted(r.indices, it.indices)).sum() for it, r in zip(items, results)]).sum()
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
    magnitude = torch.cat([(it.values if it.drop_values is None else it.drop_values).detach() for it in items]).abs().float()
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
    else:  # Alg. 3: the k weights outside the kept ones with the largest √⁴(R_i·C_j) (Eq. 7.7)
        grown_gid = _grow_ma_all(items, kept_gid, [d_i - k_i for d_i, k_i in zip(d, k)], k, u_off)

    # MERGE: kept and grown weights of all tensors at once (each tensor keeps its size and place)
    rows = grown_from_rows if grown_from_rows is not None else torch.full_like(grown_gid, -1)
    merged = _merge(eid, ~dropped, sum(d) - sum(k), grown_gid, rows)
    new_flat = merged.indices - e_off_t[seg_e]
    changed = (~isin_sorted(grown_gid, eid)).sum()  # (the kept weights were active; a dropped weight grown again is no change)
    return AllReselections(d, merged.source, merged.grown_from, new_flat, [None] * n, k, ok, changed, per_tensor_ok, [None] * n)


def _grow_ag_all(cand_gid, cand_score, score, seg_c, c_start_t, ce_start_t, kept_gid, k_t, k_total: int):
    """AG's growth over all tensors (Alg. 2): per tensor, the k eligible candidate units (not kept) with
    the largest summed |ĝ| (``cand_score``; ``score``: the weights' |ĝ|, checked for non-finite values),
    ties → lowest unit. Returns (grown units ascending, the all-tensors device flag — enough eligible
    candidates, finite scores —, the per-tensor flags, the grown units' places among the candidates).
    ``k_total`` = Σk, known on the host (no synchronisation)."""
    eligible = ~isin_sorted(cand_gid, kept_gid)
    descending = 0x7FFFFFFF - cand_score.view(torch.int32).long()  # scores ≥ 0: larger score, smaller key
    key = torch.where(eligible, descending, 0x80000000)  # ineligible rank last
    grown_mask = segmented_rank(key, seg_c, c_start_t) < k_t[seg_c]
    n_eligible = _segment_sums(eligible, c_start_t)
    per_tensor_ok = (n_eligible >= k_t) & (_segment_sums(~torch.isfinite(score), ce_start_t) == 0)
    grown_at = torch.nonzero_static(grown_mask, size=k_total).squeeze(1)
    return cand_gid[grown_at], per_tensor_ok.all(), per_tensor_ok, grown_at


def _grow_ma_all(items, kept_gid, n_kept, k, u_off):
    """MA's growth over all tensors (Alg. 3): per tensor, the k units outside its kept ones (``kept_gid``: ascending,
    global numbering; ``n_kept`` per tensor) with the largest Σ√⁴(R_i·C_j) (Eq. 7.7); ascending, in the global unit
    numbering."""
    # √⁴ of every accumulator in one pass, then summed per block row / column tensor by tensor (the reductions of
    # the per-tensor selection, shape for shape: the same sums to the last bit)
    rows_each = torch.split(torch.cat([it.row_acc for it in items]).double().pow(0.25), [it.grid.out_features for it in items])
    cols_each = torch.split(torch.cat([it.col_acc for it in items]).double().pow(0.25), [it.grid.in_features for it in items])
    row_scores = [it.grid.reduce_rows(r) for it, r in zip(items, rows_each)]
    col_scores = [it.grid.reduce_cols(c) for it, c in zip(items, cols_each)]
    return _grow_rank_one_all(row_scores, col_scores, kept_gid, n_kept, k, u_off)


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
        grown_gid = _grow_ma_all(items, kept_gid, [u - k_i for u, k_i in zip(u_sizes, k)], k, u_off)

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
    changed = (~isin_sorted(grown_gid, unit_gid)).sum() * unit  # (a dropped block grown again is no change)

    # the new active blocks, and the layers' block metadata for them (see SparseLayer.block_metadata)
    units = list(torch.split(local, u_sizes))
    rows, cols = rows.to(torch.int32), cols.to(torch.int32)
    pieces = zip(*(torch.split(t, u_sizes) for t in (rows, cols, base, stride)))
    metadata = [
        kernels.BlockLayout(r, c, b, st, (bh, bw), it.grid.out_features, it.grid.in_features, u)
        for (r, c, b, st), it, u in zip(pieces, items, units)
    ]  # fmt: skip
    return AllReselections(d, source, grown_from, new_flat, units, [k_i * unit for k_i in k], ok, changed, per_tensor_ok, metadata)

