"""SpIEL-AG with ``budget_split="adaptive"``: one reselection over all tensors at once, so budget moves between them.

The uniform split gives every tensor the same density for the whole run; here a reselection drops and grows over
the concatenation of every tensor instead of within each (the thesis names moving budget between tensors as
future work, §7.6). Both rankings must compare weights of different tensors, so both are in the units of a weight's
change under Adam:

* DROP: the k smallest |φ| (or |φ − φ₀|, ``drop_criterion="change"``) of all tensors: how far each active weight moved;
* GROW: the k candidates with the largest |ĝ|/√ŝ of all tensors, ĝ and ŝ the window's mean gradient and mean squared
  gradient: the size of the step Adam would take at that weight (per unit learning rate), free of the tensor's
  gradient scale, which |ĝ| alone is not.

k is the sum of the tensors' k(i, t) of Eq. 7.6, so the schedule, the first full replacement and the total budget
are those of the uniform split; only where the weights sit changes. Each tensor keeps at least one weight. Each
tensor's window takes ⌈candidate_ratio · q_i⌉ candidates with q_i its uniform quota (not its current size), so a
tensor that lost weights can win them back. Sizes change, so the edit goes through
:func:`peft_sparse.core.edit.resize_slots` and the config's ``tunable_weights_per_module`` follows (a saved adapter
loads with its sizes). The selection runs as torch operations over d_φ and the candidates (no fast path of its own).
"""

from __future__ import annotations

import warnings

import torch

from ...core import edit
from ...core.budget import split_budget
from ...core.selection import isin_sorted
from ...schedules.reselection import replacement_count


def uniform_quotas(layers: list, adapter_name: str) -> dict:
    """{module name: its uniform share of the adapter's current total}: the candidate base of each window."""
    sizes = {m.module_name: m.numel for m in layers}
    total = sum(m.sparse_values[adapter_name].numel() for m in layers)
    return split_budget(sizes, total)


@torch.no_grad()
def reselect_adaptive(scheduler, t: int) -> dict:
    """One reselection of every tensor of ``scheduler``'s adapter over their concatenation (module docstring).

    Both rankings run over the concatenations, so the device is read twice per reselection (the counts that bound
    k, then each tensor's share of the drops and grows), not per tensor: on a GPU every read waits for the queue."""
    c, name = scheduler.config, scheduler.adapter_name
    layers = scheduler.layers
    values = [m.sparse_values[name] for m in layers]
    sizes = [v.numel() for v in values]
    k = sum(
        replacement_count(t, scheduler.total_steps, d, c.initial_reselection_rate, c.schedule, scheduler.gamma, scheduler.first_full)
        for d in sizes
    )
    if k == 0:
        return {}
    device = values[0].device
    inf = float("inf")
    idle = scheduler.routing.idle()  # experts no token reached: nothing dropped, nothing grown (.routing)
    # DROP scores, each tensor's largest kept out of reach (every tensor keeps a weight)
    drop_scores = []
    for layer, v in zip(layers, values):
        score = (v.detach() - scheduler.drop_reference[layer.module_name] if c.drop_criterion == "change" else v.detach()).abs().float()
        if layer.module_name in idle:
            score.fill_(inf)
        elif score.numel():
            score.index_fill_(0, score.argmax().view(1), inf)
        drop_scores.append(score.to(device))
    all_drop = torch.cat(drop_scores)
    # GROW scores: |ĝ|/√ŝ at each tensor's candidates, −∞ where the candidate is active now
    n = max(1, scheduler.steps_in_window)
    owner_of, cands, raw, g_means, s_means = [], [], [], [], []
    # which candidates are active now: one binary search over every tensor at once, each tensor's indices and
    # candidates offset by the elements of the tensors before it (the active indices stay ascending)
    offsets, active_sets, offset_cands = [], [], []
    at_element = 0
    for layer in layers:
        offsets.append(at_element)
        active_sets.append(layer.sparse_indices[name].to(device).long() + at_element)
        at_element += layer.numel
    for at, layer in enumerate(layers):
        stats = scheduler.statistics.get(layer.module_name)
        if layer.module_name in idle:
            continue
        if stats is None or stats.candidates is None:
            warnings.warn(f"SpIEL: {layer.module_name} got no gradient in the estimation window; it grows nothing")
            continue
        cand = stats.candidates.long()
        g, s2 = stats.grad_sum / n, stats.grad_sq_sum / n
        owner_of.append(at)
        cands.append(cand.to(device))
        raw.append((g.abs() / (s2.sqrt() + 1e-30)).float().to(device))
        offset_cands.append(cand.to(device) + offsets[at])
        g_means.append(g.float().to(device))
        s_means.append(s2.float().to(device))
    if not cands:
        return {}
    counts = [x.numel() for x in cands]
    # (fills, not tensors from host lists: a copy from pageable host memory waits for the device's queue)
    owners = torch.cat([torch.full((n,), at, dtype=torch.long, device=device) for at, n in zip(owner_of, counts)])
    old_global, cands_global = torch.cat(active_sets), torch.cat(offset_cands)
    active = isin_sorted(cands_global, old_global)
    cands, raw = torch.cat(cands), torch.cat(raw)
    g_means, s_means = torch.cat(g_means), torch.cat(s_means)
    finite, eligible, droppable = torch.stack(
        [torch.isfinite(raw).all().long(), (~active).sum(), torch.isfinite(all_drop).sum()]
    ).tolist()  # (read 1)
    if not finite:
        for at, part in zip(owner_of, raw.split(counts)):
            if not bool(torch.isfinite(part).all()):
                raise FloatingPointError(f"SpIEL: non-finite growth scores in {layers[at].module_name}; nothing was reselected")
    k = min(k, droppable, eligible)
    if k == 0:
        return {}
    dropped = torch.sort(torch.topk(all_drop, k, largest=False, sorted=False).indices).values  # (ascending: by tensor)
    grown = torch.topk(raw.masked_fill(active, -inf), k, sorted=False).indices
    grown = grown[torch.sort(owners[grown], stable=True).indices]  # (grouped by tensor)
    starts = [0]
    for size in sizes[:-1]:
        starts.append(starts[-1] + size)
    bounds = torch.cat([torch.full((1,), s, dtype=torch.long, device=device) for s in starts[1:]]) if len(starts) > 1 else torch.zeros(0, dtype=torch.long, device=device)
    drop_owner = torch.bucketize(dropped, bounds, right=True)
    # (a tensor without ages counts its dropped weights as age 0)
    ages = torch.cat([(m.sparse_ages[name] if name in m.sparse_ages else torch.full((n,), t, device=device)).to(device).long() for m, n in zip(layers, sizes)])
    dropped_age = (t - ages[dropped]).sum().view(1)
    shares = torch.cat([
        torch.bincount(drop_owner, minlength=len(layers)), torch.bincount(owners[grown], minlength=len(layers)), dropped_age,
    ]).tolist()  # (read 2)
    drop_counts, grow_counts, dropped_age = shares[: len(layers)], shares[len(layers) : 2 * len(layers)], shares[-1]
    new_sizes = [size - dropped_here + grown_here for size, dropped_here, grown_here in zip(sizes, drop_counts, grow_counts)]
    sources, news, new_slots = edit.slot_maps(old_global, dropped, cands_global[grown], sizes, new_sizes, offsets, owners[grown])
    grow_parts = grown.split(grow_counts)
    sources, news, new_slots = sources.split(new_sizes), news.split(new_sizes), new_slots.split(grow_counts)
    seeds = [(new_slots[at], g_means[mine], s_means[mine]) for at, mine in enumerate(grow_parts)]  # (in the order of new_slots)
    edit.resize_slots(layers, name, sources, news, optimizer=scheduler.optimizer, step=t, checked=False)
    if scheduler.seeding is not None:
        scheduler.seeding.rehook()
    counts = c.tunable_weights_per_module
    for layer, size in zip(layers, new_sizes):
        if counts is not None and layer.module_name in counts:
            counts[layer.module_name] = int(size)
    if scheduler.seeding is not None:
        for v, (slots, g_hat, s_hat), grew in zip(values, seeds, grow_counts):
            if grew:
                scheduler.seeding.pending[id(v)] = (slots, g_hat, s_hat, n)
    total = sum(new_sizes)
    moved = sum(abs(a - b) for a, b in zip(new_sizes, sizes)) // 2
    return {
        "spiel/step": t,
        "spiel/replaced": k,
        "spiel/fraction_changed": k / max(1, total),
        "spiel/mean_age_dropped": dropped_age / max(1, k),
        "spiel/budget_moved": moved,
        "spiel/density_min": min(s / m.numel for s, m in zip(new_sizes, layers)),
        "spiel/density_max": max(s / m.numel for s, m in zip(new_sizes, layers)),
    }
