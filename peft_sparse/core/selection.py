"""Index selection primitives shared by the methods' policies (initial masks, top-k by importance)."""

from __future__ import annotations

import zlib
from typing import Callable, Mapping

import torch


def module_generator(seed: int, module_name: str) -> torch.Generator:
    """A CPU generator seeded by (seed, module name): selections don't depend on module order."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(module_name.encode())) % 2**63)


def random_indices(numel: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` distinct uniformly random indices in [0, numel), sorted, int64 (CPU).

    Memory is O(count) at low density (rejection by de-duplication), O(numel) only above 25%.
    """
    if count > numel:
        raise ValueError(f"cannot choose {count} distinct indices out of {numel}")
    if count == 0:
        return torch.empty(0, dtype=torch.long)
    if 4 * count >= numel:
        return torch.randperm(numel, generator=generator)[:count].sort().values
    pool = torch.empty(0, dtype=torch.long)
    while pool.numel() < count:
        draw = torch.randint(0, numel, (count + count // 8 + 16,), generator=generator)
        pool = torch.unique(torch.cat([pool, draw]))
    keep = torch.randperm(pool.numel(), generator=generator)[:count]
    return pool[keep].sort().values


def top_indices(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Flat positions of the ``count`` largest scores, ties broken by lowest position; sorted ascending."""
    flat = scores.reshape(-1)
    if count > flat.numel():
        raise ValueError(f"cannot choose {count} indices out of {flat.numel()} scores")
    if not torch.isfinite(flat).all():
        raise ValueError("importance scores contain NaN or infinite values")
    order = torch.sort(flat, descending=True, stable=True).indices[:count]
    return order.sort().values


def check_sparse_tensors(
    where: str,
    indices: torch.Tensor,
    values: torch.Tensor,
    numel: int,
    *,
    expected_count: int | None = None,
    index_dtype: torch.dtype | None = None,
    values_dtype: torch.dtype | None = None,
) -> None:
    """Raise a ValueError naming ``where`` unless (indices, values) is a valid sparse delta of a tensor of ``numel``."""
    if indices.dim() != 1 or values.dim() != 1:
        raise ValueError(
            f"{where}: indices and values must be 1-D, got shapes {tuple(indices.shape)} and {tuple(values.shape)}"
        )
    if indices.numel() != values.numel():
        raise ValueError(f"{where}: {indices.numel()} indices but {values.numel()} values")
    if expected_count is not None and indices.numel() != expected_count:
        raise ValueError(f"{where}: the file holds {indices.numel()} indices but the config expects {expected_count}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{where}: indices have dtype {indices.dtype}, expected an integer dtype (int32/int64)")
    if index_dtype is not None and indices.dtype != index_dtype:
        raise ValueError(f"{where}: indices have dtype {indices.dtype}, expected {index_dtype}")
    if values_dtype is not None and values.dtype != values_dtype:
        raise ValueError(f"{where}: values have dtype {values.dtype}, expected {values_dtype} (the config's values_dtype)")
    if not values.dtype.is_floating_point:
        raise ValueError(f"{where}: values have dtype {values.dtype}, expected a floating-point dtype")
    if indices.numel() == 0 or indices.device.type == "meta":
        return
    lo, hi = int(indices.min()), int(indices.max())
    if lo < 0 or hi >= numel:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{where}: index {bad} is outside the tensor of {numel} elements")
    if indices.numel() > 1:
        steps = indices[1:].long() - indices[:-1].long()
        if (steps <= 0).any():
            at = int(torch.nonzero(steps <= 0)[0])
            kind = "duplicate" if int(steps[at]) == 0 else "unsorted"
            raise ValueError(
                f"{where}: indices must be sorted and unique, found {kind} indices "
                f"{int(indices[at])}, {int(indices[at + 1])} at positions {at}, {at + 1}"
            )


def top_k_set(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending element numbers of the k largest ``scores`` (ties → lowest element numbers), without
    a host sync: a top-k threshold, then the tied elements ranked by a cumulative count.

    Cheaper than :func:`~peft_sparse.methods.spiel.top_k_positions` on weight-sized inputs (no 64-bit
    keys; the scores keep their dtype), for callers that need the set, not its order.
    """
    flat = scores.reshape(-1)
    n = flat.numel()
    k = min(k, n)
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=flat.device)
    if k == n:
        return torch.arange(n, device=flat.device)
    kth = torch.topk(flat, k, sorted=False).values.min()
    above = flat > kth
    tied = flat == kth
    need = k - above.sum()
    chosen = above | (tied & (torch.cumsum(tied, 0, dtype=torch.int64) <= need))
    return torch.nonzero_static(chosen, size=k).squeeze(1)


class BlockGrid:
    """The (out/bh) × (in/bw) grid of (bh, bw) blocks of an (out, in) matrix; (1, 1) is unstructured.

    Selection policies work on *units* — blocks, numbered row-major on the grid — and expand them to
    the flat element indices that the sparse core stores; with (1, 1) units are elements.
    """

    def __init__(self, out_features: int, in_features: int, block_shape: tuple[int, int] = (1, 1)):
        bh, bw = block_shape
        if out_features % bh or in_features % bw:
            raise ValueError(f"block_shape={tuple(block_shape)} does not tile a ({out_features}, {in_features}) matrix")
        self.out_features, self.in_features, self.bh, self.bw = out_features, in_features, bh, bw
        self.rows, self.cols = out_features // bh, in_features // bw
        self.numel = self.rows * self.cols
        self.unit = bh * bw

    @property
    def unstructured(self) -> bool:
        return self.unit == 1

    def expand(self, blocks: torch.Tensor) -> torch.Tensor:
        """Sorted flat element indices of the given blocks."""
        if self.unstructured:
            return blocks.long().sort().values
        return self.block_major(blocks).reshape(-1).sort().values

    def block_major(self, blocks: torch.Tensor) -> torch.Tensor:
        """(n, bh·bw) flat element indices of the given blocks, element (i, j) of a block at i·bw + j."""
        blocks = blocks.long()
        br, bc = blocks // self.cols, blocks % self.cols
        i = torch.arange(self.bh, device=blocks.device)
        j = torch.arange(self.bw, device=blocks.device)
        rows = (br * self.bh)[:, None, None] + i[None, :, None]
        return (rows * self.in_features + (bc * self.bw)[:, None, None] + j[None, None, :]).reshape(-1, self.unit)

    def unit_sums(self, indices: torch.Tensor, per_element: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
        """Per unit of ``units`` (ascending, all of them covered by ``indices``) the sum of ``per_element``,
        added in block-major order (deterministic: no atomics)."""
        if self.unstructured:
            return per_element
        slots = torch.searchsorted(indices.long(), self.block_major(units).reshape(-1))
        return per_element[slots].view(-1, self.unit).sum(1)

    def block_of(self, indices: torch.Tensor) -> torch.Tensor:
        """Block number of each flat element index."""
        idx = indices.long()
        if self.unstructured:
            return idx
        rows, cols = idx // self.in_features, idx % self.in_features
        return (rows // self.bh) * self.cols + cols // self.bw

    def reduce(self, dense: torch.Tensor) -> torch.Tensor:
        """Per-block sums of an (out, in) tensor, flattened in block order."""
        if self.unstructured:
            return dense.reshape(-1)
        return dense.reshape(self.rows, self.bh, self.cols, self.bw).sum(dim=(1, 3)).reshape(-1)

    def reduce_rows(self, per_row: torch.Tensor) -> torch.Tensor:
        return per_row if self.bh == 1 else per_row.reshape(self.rows, self.bh).sum(1)

    def reduce_cols(self, per_col: torch.Tensor) -> torch.Tensor:
        return per_col if self.bw == 1 else per_col.reshape(self.cols, self.bw).sum(1)

    def units(self, indices: torch.Tensor) -> torch.Tensor:
        """The sorted distinct units (blocks, or weights when unstructured) that ``indices`` touch."""
        blocks = self.block_of(indices)
        return blocks if self.unstructured else torch.unique(blocks, sorted=True)


def segmented_rank(keys: torch.Tensor, segment: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Each element's rank within its segment, ordered by (key ascending, position ascending).

    ``keys`` are non-negative integers below 2³² (int64), ``segment`` the segment number of each element
    (segments laid end to end, numbered from 0), ``starts`` each segment's first position. One stable
    sort ranks all segments at once: how many tensors' top-k selections become a single launch.
    """
    order = torch.sort((segment.long() << 32) | keys, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device) - starts[segment[order]]
    return rank

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


def isin_sorted(values: torch.Tensor, sorted_set: torch.Tensor) -> torch.Tensor:
    """Which ``values`` are in ``sorted_set`` (ascending, distinct): a binary search, O(len) memory."""
    if sorted_set.numel() == 0:
        return torch.zeros(values.shape, dtype=torch.bool, device=values.device)
    values = values.long()
    pos = torch.searchsorted(sorted_set.long(), values).clamp_(max=sorted_set.numel() - 1)
    return sorted_set.long()[pos] == values


def _order_bits(scores: torch.Tensor) -> torch.Tensor:
    """Non-negative finite scores as int32 keys with the same order (IEEE-754 bits of a float32 ≥ 0)."""
    flat = scores.reshape(-1)
    if flat.dtype != torch.float32:
        flat = flat.float()
    return flat.view(torch.int32)


def global_top_k(score_fns: Mapping[str, Callable[[], torch.Tensor]], k: int) -> dict:
    """Positions of the ``k`` largest scores over several tensors, never concatenated.

    ``score_fns`` maps a name to a function giving that tensor's non-negative finite scores (called
    once per pass, so a score may be computed on the fly: peak extra memory is one tensor's scores and
    a mask). The k-th largest score τ is found by bisection on the float32 bit patterns (≤ 32 counting
    passes, exact); every score above τ is taken, and ties at τ fill the rest in name order, lowest
    position first. Returns {name: sorted int64 positions} (possibly empty)."""
    names = list(score_fns)
    total = 0
    for name in names:
        scores = score_fns[name]()
        if scores.numel() and (not torch.isfinite(scores).all() or bool((scores < 0).any())):
            raise ValueError(f"{name}: scores must be finite and non-negative")
        total += scores.numel()
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= total:
        raise ValueError(f"cannot choose k={k!r} of {total} scores")
    if k == 0:
        return {n: torch.zeros(0, dtype=torch.long) for n in names}

    def count_at_least(bits: int) -> int:
        return sum(int((_order_bits(score_fns[n]()) >= bits).sum()) for n in names)

    lo, hi = 0, 0x7F800000  # count(≥ lo) ≥ k always; count(≥ hi) < k unless scores are +inf (refused)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count_at_least(mid) >= k:
            lo = mid
        else:
            hi = mid
    threshold = lo  # the k-th largest score's bits
    out, left = {}, k - sum(int((_order_bits(score_fns[n]()) > threshold).sum()) for n in names)
    for name in names:
        bits = _order_bits(score_fns[name]())
        above = torch.nonzero(bits > threshold).squeeze(1)
        tied = torch.nonzero(bits == threshold).squeeze(1)[: max(0, left)]
        left -= tied.numel()
        out[name] = torch.cat([above, tied]).sort().values.cpu()
    return out
