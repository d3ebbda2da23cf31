"""The k largest entries of a rank-one score matrix R_i·C_j without forming it (SpIEL-MA's growth, Eq. 7.7)."""

from __future__ import annotations

import math

import torch

from ...core import kernels
from ...core.selection import isin_sorted, segmented_rank, top_k_positions


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
    key = torch.where(isin_sorted(gid, kept_gid), 0x80000000, descending)  # kept (excluded) rank last
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
