"""Slot maps: where each slot of an edited values tensor comes from, as pure index arithmetic.

After dropping some slots of a tensor and growing new indices, new slot j holds old slot ``source[j]`` (or
is new: −1); the new indices stay ascending. :func:`slot_map` computes that for one tensor, with checks;
:func:`slot_maps` for many tensors at once, without reading the device. The edits of :mod:`.edit` apply them.
"""

from __future__ import annotations

from typing import Optional

import torch

from .devices import table
from .selection import isin_sorted


def slot_map(layer, adapter_name: str, drop: torch.Tensor, grow: torch.Tensor, same_count: bool = True, checked: bool = True):
    """(source, new indices, where the grown indices went: new slot of grown index i in the caller's order) of one
    tensor after dropping slots ``drop`` and growing indices ``grow``: for :func:`replace` (``same_count``) and for
    :func:`resize_slots` (counts may differ). ``checked=False`` skips the checks of positions and indices (each
    reads the device) for a caller whose selection guarantees them, and builds the result without reading the
    device at all (the counts are the tensors' lengths)."""
    where = layer.module_name
    old = layer.sparse_indices[adapter_name].long()
    n = old.numel()
    drop = torch.as_tensor(drop, device=old.device).long().reshape(-1)
    grow = torch.as_tensor(grow, device=old.device).long().reshape(-1)
    if same_count and drop.numel() != grow.numel():
        raise ValueError(f"{where}: {drop.numel()} positions dropped but {grow.numel()} indices grown; the count must stay the same")
    if not checked:
        keep = torch.ones(n, dtype=torch.bool, device=old.device)
        keep[drop] = False
        return _merged_slots(old, keep, grow, kept_count=n - drop.numel())
    if drop.numel() and (int(drop.min()) < 0 or int(drop.max()) >= n):
        raise ValueError(f"{where}: drop position {int(drop.min()) if int(drop.min()) < 0 else int(drop.max())} is outside 0..{n - 1}")
    if drop.unique().numel() != drop.numel():
        raise ValueError(f"{where}: drop positions repeat")
    keep = torch.ones(n, dtype=torch.bool, device=old.device)
    keep[drop] = False
    kept = old[keep]
    grow_sorted, order = torch.sort(grow)
    if grow.numel() and (int(grow_sorted[0]) < 0 or int(grow_sorted[-1]) >= layer.numel):
        bad = int(grow_sorted[0]) if int(grow_sorted[0]) < 0 else int(grow_sorted[-1])
        raise ValueError(f"{where}: grown index {bad} is outside the tensor of {layer.numel} elements")
    if grow.numel() > 1 and bool((grow_sorted[1:] == grow_sorted[:-1]).any()):
        raise ValueError(f"{where}: grown indices repeat")
    clash = isin_sorted(grow_sorted, kept)
    if bool(clash.any()):
        raise ValueError(f"{where}: grown index {int(grow_sorted[clash][0])} is already active (and not dropped)")
    return _merged_slots(old, keep, grow)


def _merged_slots(old: torch.Tensor, keep: torch.Tensor, grow: torch.Tensor, kept_count: Optional[int] = None):
    """:func:`slot_map`'s result from the kept slots' mask and the grown indices (disjoint from the kept ones).
    With ``kept_count`` (the mask's count, known to the caller) no step reads the device: the positions where a
    mask holds come from a stable sort instead of ``nonzero`` (the same positions, in the same order)."""
    if kept_count is None:
        kept_at = torch.nonzero(keep).squeeze(1)
    else:
        kept_at = torch.sort((~keep).to(torch.uint8), stable=True).indices[:kept_count]
    return _merge_by_rank(old[kept_at], kept_at, grow)


def _merge_by_rank(kept: torch.Tensor, kept_at: torch.Tensor, grow: torch.Tensor):
    """The union of ``kept`` (ascending indices, from slots ``kept_at``) and ``grow`` (indices disjoint from them,
    any order) as (source of each new slot: its old slot or −1, the merged ascending indices, the new slot of each
    grown index in ``grow``'s order). Each element's new slot is its rank in its own list plus the count of the
    other list's elements below it: two binary searches, not a sort of the union; no read of the device."""
    device = kept.device
    grow_sorted, order = torch.sort(grow)
    kept_to = torch.searchsorted(grow_sorted, kept) + torch.arange(kept.numel(), device=device)
    grown_to = torch.searchsorted(kept, grow_sorted) + torch.arange(grow.numel(), device=device)
    merged = torch.empty(kept.numel() + grow.numel(), dtype=kept.dtype, device=device)
    merged[kept_to], merged[grown_to] = kept, grow_sorted
    source = torch.empty_like(merged)
    source[kept_to], source[grown_to] = kept_at, -1
    position_of_grown = torch.empty_like(order)
    position_of_grown[order] = grown_to
    return source, merged, position_of_grown


def slot_maps(old: torch.Tensor, dropped: torch.Tensor, grown: torch.Tensor, sizes: list, new_sizes: list,
              offsets: list, grown_owner: torch.Tensor):  # fmt: skip
    """:func:`slot_map` of many tensors at once, for a caller that resizes them together (:func:`resize_slots`).
    Inputs are concatenations over the tensors: ``old`` their indices each offset by ``offsets[i]`` (the elements
    of the tensors before it, so ``old`` stays ascending), ``dropped`` ascending slots of ``old``, ``grown`` offset
    indices disjoint from the kept ones with ``grown_owner`` their tensor; ``sizes``/``new_sizes`` the counts
    before and after. Returns, concatenated in tensor order, each new slot's source (an old slot of its own tensor,
    or −1) and index, and each grown index's new slot within its tensor in ``grown``'s order: the same integers as
    each tensor's :func:`slot_map`, from a few dozen launches whatever the number of tensors, with no read of the
    device (the caller vouches for the inputs, as with ``checked=False``)."""
    device = old.device
    keep = torch.ones(old.numel(), dtype=torch.bool, device=device)
    keep[dropped] = False
    source, merged, new_slot = _merged_slots(old, keep, grown, kept_count=old.numel() - dropped.numel())
    old_starts, new_starts = [0], [0]
    for size, new_size in zip(sizes[:-1], new_sizes[:-1]):
        old_starts.append(old_starts[-1] + size)
        new_starts.append(new_starts[-1] + new_size)
    tensor_of_slot = torch.repeat_interleave(
        torch.arange(len(sizes), device=device), table(new_sizes, device), output_size=merged.numel()
    )
    merged = merged - table(offsets, device)[tensor_of_slot]
    source = torch.where(source >= 0, source - table(old_starts, device)[tensor_of_slot], -1)
    return source, merged, new_slot - table(new_starts, device)[grown_owner]
