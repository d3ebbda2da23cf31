r"""The mask-editing API: the one way any method changes an adapter's indices η and values φ.

A method decides *which* indices and values; this module makes the change and keeps everything that
depends on them consistent: the values' Parameter objects (edited in place, so an optimizer keeps
holding them), the per-index ages of dynamic methods and the block layouts — and it announces the change
(:mod:`.dispatch`'s listeners) to whatever else keeps state per slot or per index: the fast paths (a
training merge moves θ₀ back to the old positions and θ₀ + φ to the new ones; kept launches follow the
layouts; memos of the last pass are dropped) and the optimizer's per-slot state
(:mod:`peft_sparse.optim.surgery` listens: kept slots keep their moments, new slots start at zero).

Three calls for users and methods::

    edit.replace(model, {"model.layers.0.mlp.up_proj": (drop_positions, new_indices)}, optimizer=opt)
    edit.set_indices(model, {name: indices}, values={name: values})   # whole-adapter replacement
    edit.set_values(model, {name: values})                            # φ from anywhere (a hypernetwork)

and one batched primitive, :func:`edit_slots`, which they (and SpIEL's reselection) go through: the
new slot j of every tensor takes old slot ``source[j]``, or starts new where ``source[j] = −1``.
:func:`resize_slots` is the same edit where tensors change size (budget moved between tensors); the
values stay the same Parameter objects, so an optimizer follows there too.

Values computed by a module (a hypernetwork generating φ) stay a leaf Parameter in the layers, so
every forward and backward path applies unchanged: write them with :func:`set_values` before the
forward pass and hand the values' gradients back to the generator after the backward pass::

    generated = hypernetwork(z)                              # (d_φ,) with autograd history
    edit.set_values(model, split_by_module(generated))
    loss = model(**batch).loss; loss.backward()
    generated.backward(edit.values_grad(model))             # ∂L/∂φ into the hypernetwork
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch

from . import dispatch
from .base import index_dtype
from .layer import SparseLayer
from .owners import resize_parameter
from .selection import BlockGrid, check_sparse_tensors
from .slots import slot_map, slot_maps  # noqa: F401 (re-exported: edit.slot_map, edit.slot_maps)


@dataclass
class SlotEdit:
    """What :func:`edit_slots` did, laid end to end over the edited tensors (each keeps its size).

    ``source``: the old slot each new slot came from (−1: new), as applied (a failed ``condition``
    makes it the identity); ``old_ages``: the concatenated ages before the edit (None without ages);
    ``undo()`` puts back what the values, indices and optimizer state do not hold: the old block
    layouts, and θ₀ where a merge was set up anew."""

    sizes: list
    source: torch.Tensor
    old_ages: Optional[torch.Tensor]
    undo: Callable[[], None]

    @property
    def new(self) -> torch.Tensor:
        return self.source < 0


def _layers(model, adapter_name: Optional[str]) -> tuple[dict, str]:
    """{module name: layer} of the sparse layers holding ``adapter_name`` (default: the single active one)."""
    layers = [m for m in model.modules() if isinstance(m, SparseLayer)]
    if not layers:
        raise ValueError("the model holds no sparse adapter layers")
    if adapter_name is None:
        active = {a for layer in layers for a in layer.active_adapters if a in layer.sparse_values}
        if len(active) != 1:
            raise ValueError(f"pass adapter_name: the active sparse adapters are {sorted(active)}")
        adapter_name = active.pop()
    found = {layer.module_name: layer for layer in layers if adapter_name in layer.sparse_values}
    if not found:
        raise ValueError(f"no sparse layer holds an adapter named {adapter_name!r}")
    return found, adapter_name


def _named(found: dict, names, what: str) -> list:
    unknown = [n for n in names if n not in found]
    if unknown:
        raise KeyError(f"{what}: no sparse layer named {unknown[0]!r}; layers are e.g. {sorted(found)[:3]}")
    return [found[n] for n in names]


@torch.no_grad()
def edit_slots(
    layers: list,
    adapter_name: str,
    source: torch.Tensor,
    new_indices: torch.Tensor,
    *,
    optimizer=None,
    new_values: Optional[torch.Tensor] = None,
    step: Optional[int] = None,
    block_units: Optional[list] = None,
    block_layouts: Optional[list] = None,
    condition: Optional[torch.Tensor] = None,
) -> SlotEdit:
    """Give every tensor of ``layers`` its new indices, in place, keeping its size.

    ``source`` and ``new_indices`` run over the tensors' slots laid end to end (layer order): new slot j
    takes old slot ``source[j]`` (a global slot number) with its value, age and optimizer state, or is
    new where ``source[j] = −1``: value ``new_values[j]`` (default 0), age ``step``, zero optimizer state.
    Each tensor's new indices must be ascending and distinct. ``block_units`` / ``block_layouts`` (per
    layer, for block adapters): the new active blocks and their layout, when the caller has them
    (otherwise computed from the indices). ``condition`` (a device flag): the edit holds only where it
    is True, else every tensor keeps its contents — decided on the device, without waiting for it.
    """
    values = [layer.sparse_values[adapter_name] for layer in layers]
    indices = [layer.sparse_indices[adapter_name] for layer in layers]
    with_ages = all(adapter_name in layer.sparse_ages for layer in layers)
    ages = [layer.sparse_ages[adapter_name] for layer in layers] if with_ages else []
    sizes = [v.numel() for v in values]
    if condition is not None:  # (False: every slot its own source, the old indices)
        source = torch.where(condition, source, torch.arange(source.numel(), device=source.device))
        new_indices = torch.where(condition, new_indices, torch.cat(indices).to(new_indices.dtype))
    new = source < 0
    gather = source.clamp(min=0)
    moved = torch.cat([v.detach() for v in values])[gather]
    if new_values is None:
        moved[new] = 0
    else:
        moved = torch.where(new, new_values.to(moved.dtype), moved)
    torch._foreach_copy_([v.data for v in values], list(torch.split(moved, sizes)))
    old_ages = None
    if with_ages:
        old_ages = torch.cat(ages)
        new_ages = old_ages[gather]
        new_ages[new] = 0 if step is None else step
        torch._foreach_copy_(ages, list(torch.split(new_ages, sizes)))

    def change_indices():
        if len({i.dtype for i in indices}) == 1:
            torch._foreach_copy_(indices, list(torch.split(new_indices.to(indices[0].dtype), sizes)))
        else:  # int32 and int64 indices (tensors of 2³¹ weights or more) side by side
            for index, fresh in zip(indices, torch.split(new_indices, sizes)):
                index.copy_(fresh)

    # whatever depends on the indices follows them (a training merge: θ₀ back at the old positions before
    # they change, θ₀[η] + φ at the new ones), and the optimizer's per-slot state follows the values
    undos = dispatch.reindex(layers, change_indices)
    if optimizer is not None:
        dispatch.slots_changed(optimizer, values, source)

    # block adapters: the new layouts, and the plans and kept launches their old layouts used
    olds, layouts, plan_keys = [], [], []
    for at, layer in enumerate(layers):
        shape = layer.block_shape.get(adapter_name, (1, 1))
        if shape[0] * shape[1] == 1:
            continue
        units = block_units[at] if block_units is not None else None
        if units is None:
            units = BlockGrid(layer.out_features, layer.in_features, shape).units(layer.sparse_indices[adapter_name])
        meta = block_layouts[at] if block_layouts is not None else None
        old = layer.cached_block_metadata(adapter_name)
        olds.append((layer, old))
        layouts.append(layer.set_block_metadata(adapter_name, units, meta))
        plan_keys.append(list(old.plans) if old is not None else [])
    if layouts:
        dispatch.layouts_changed([old for _, old in olds], layouts, plan_keys)

    def undo():
        for layer, old in olds:
            if old is not None:
                layer.set_block_metadata(adapter_name, old.block_numbers(), old)
        for undo_listener in undos:
            undo_listener()

    return SlotEdit(sizes, source, old_ages, undo)


def resize_slots(
    layers: list,
    adapter_name: str,
    sources: list,
    new_indices: list,
    *,
    optimizer=None,
    new_values: Optional[list] = None,
    step: Optional[int] = None,
    checked: bool = True,
) -> None:
    """Give each tensor of ``layers`` its new indices and a size of their count (unstructured adapters).

    Per layer: new slot j takes old slot ``sources[i][j]`` (a slot of that tensor) with its value, age and
    optimizer state, or is new where it is −1: value ``new_values[i][j]`` (default 0), age ``step``, zero
    optimizer state. The values Parameters are resized in place (the same objects: an optimizer holding
    them follows); the training merges are released (the next forward pass merges again) and every cache
    built from the old indices or values is dropped with them. Hooks registered on a values tensor stay with
    its old contents: register them again (SpIEL's scheduler does so for its own).

    The new indices must be sorted, unique and inside each tensor, and the sources slots of each tensor or −1:
    checked before anything changes, for all tensors in one read of the device (a ValueError names the first
    offending layer). ``checked=False`` skips that read for a caller whose selection guarantees it (as
    :func:`slot_map`'s); either way the layers take the indices as checked, so the next forward pass does not
    check each tensor again (three reads of the device per tensor)."""
    if len(sources) != len(layers) or len(new_indices) != len(layers):
        raise ValueError(f"resize_slots: {len(layers)} layers but {len(sources)} sources and {len(new_indices)} index tensors")
    for layer, source, fresh in zip(layers, sources, new_indices):
        if source.numel() != fresh.numel():
            raise ValueError(f"{layer.module_name}: {source.numel()} sources for {fresh.numel()} new indices")
    for layer in layers:
        if layer.block_shape.get(adapter_name, (1, 1)) != (1, 1):
            raise ValueError(f"{layer.module_name}: resize_slots edits unstructured adapters; adapter {adapter_name!r} selects blocks")
    if checked:
        _check_resize(layers, adapter_name, sources, new_indices)
    dispatch.release(layers)  # (θ₀ back in the base weights: nothing kept over the old sizes)
    resized, moves = [], []
    for at, (layer, source, fresh) in enumerate(zip(layers, sources, new_indices)):
        values = layer.sparse_values[adapter_name]
        source = source.to(values.device).long()
        new = source < 0
        moved = values.detach()[source.clamp(min=0)] if values.numel() else torch.zeros(source.numel(), dtype=values.dtype, device=values.device)
        if new_values is not None and new_values[at] is not None:
            moved = torch.where(new, new_values[at].to(device=moved.device, dtype=moved.dtype), moved)
        else:
            moved.masked_fill_(new, 0)  # (a mask fill: no read of the device, as no step here makes)
        resize_parameter(layer, adapter_name, values, moved)
        if adapter_name in layer.sparse_ages:
            ages = layer.sparse_ages[adapter_name]
            new_ages = ages[source.clamp(min=0)] if ages.numel() else torch.zeros(source.numel(), dtype=ages.dtype, device=ages.device)
            new_ages.masked_fill_(new, 0 if step is None else step)
            layer.sparse_ages[adapter_name] = new_ages
        layer.sparse_indices[adapter_name] = fresh.to(device=values.device, dtype=index_dtype(layer.numel))
        layer._checked_indices[adapter_name] = layer.sparse_indices[adapter_name]  # (checked above, or vouched for)
        layer._ready.pop(adapter_name, None)
        dispatch.forget(layer, adapter_name)
        resized.append(values)
        moves.append(source)
    if optimizer is not None:
        dispatch.slots_resized(optimizer, resized, moves)


def _check_resize(layers: list, adapter_name: str, sources: list, new_indices: list) -> None:
    """:func:`resize_slots`'s checks over every tensor with one read of the device: per tensor, whether its new
    indices are sorted, unique and inside it, and its sources inside its old slots or −1."""
    flags = []
    for layer, source, fresh in zip(layers, sources, new_indices):
        old_count = layer.sparse_values[adapter_name].numel()
        fresh, source = fresh.long(), source.long().to(fresh.device)
        bad = torch.zeros((), dtype=torch.bool, device=fresh.device)
        if fresh.numel():
            bad = bad | (fresh.min() < 0) | (fresh.max() >= layer.numel) | (source.min() < -1) | (source.max() >= old_count)
        if fresh.numel() > 1:
            bad = bad | (fresh[1:] <= fresh[:-1]).any()
        flags.append(bad.to(layers[0].sparse_values[adapter_name].device))
    if not flags:
        return
    for layer, source, fresh, bad in zip(layers, sources, new_indices, torch.stack(flags).tolist()):
        if bad:
            values = torch.zeros(fresh.numel(), device=fresh.device)
            check_sparse_tensors(layer.module_name, fresh.reshape(-1), values, layer.numel)  # (raises with the details)
            raise ValueError(
                f"{layer.module_name}: a source slot is outside -1..{layer.sparse_values[adapter_name].numel() - 1} "
                f"(min {int(source.min())}, max {int(source.max())})"
            )


def replace(
    model,
    changes: Mapping[str, tuple],
    optimizer=None,
    adapter_name: Optional[str] = None,
    step: Optional[int] = None,
) -> None:
    """Drop some slots of some layers and grow new indices in their place, in place.

    ``changes`` maps a module name (as in ``layer.module_name``) to ``(drop_positions, new_indices)`` or
    ``(drop_positions, new_indices, new_values)``: positions into the layer's current values, and as
    many new flat indices into its (out, in) matrix (not active after the drop; a dropped index may
    come back, as a new slot). Kept slots keep their values, ages and optimizer state; new slots start
    at ``new_values`` (default 0), age ``step`` and zero optimizer state. ``optimizer``: the optimizer
    holding the values (stock AdamW/Adam, SGD or SM3), if any.
    """
    found, adapter_name = _layers(model, adapter_name)
    layers = _named(found, list(changes), "replace")
    sources, news, grown_values = [], [], []
    offset = 0
    for layer, change in zip(layers, changes.values()):
        if len(change) not in (2, 3):
            raise ValueError(f"{layer.module_name}: a change is (drop_positions, new_indices[, new_values]), got {len(change)} items")
        source, new_indices, position = slot_map(layer, adapter_name, change[0], change[1])
        values = layer.sparse_values[adapter_name]
        fresh = torch.zeros(values.numel(), dtype=values.dtype, device=values.device)
        if len(change) == 3:
            given = torch.as_tensor(change[2], dtype=values.dtype, device=values.device).reshape(-1)
            if given.numel() != position.numel():
                raise ValueError(f"{layer.module_name}: {given.numel()} new values for {position.numel()} grown indices")
            fresh[position] = given
        shape = layer.block_shape.get(adapter_name, (1, 1))
        if shape[0] * shape[1] > 1:
            grid = BlockGrid(layer.out_features, layer.in_features, shape)
            if grid.units(new_indices).numel() * grid.unit != new_indices.numel():
                raise ValueError(f"{layer.module_name}: the new indices are not whole {tuple(shape)} blocks")
        sources.append(torch.where(source >= 0, source + offset, -1))
        news.append(new_indices)
        grown_values.append(fresh)
        offset += values.numel()
    edit_slots(layers, adapter_name, torch.cat(sources), torch.cat(news), optimizer=optimizer,
               new_values=torch.cat(grown_values), step=step)  # fmt: skip


@torch.no_grad()
def set_indices(
    model,
    indices: Mapping[str, torch.Tensor],
    values: Optional[Mapping[str, torch.Tensor]] = None,
    optimizer=None,
    adapter_name: Optional[str] = None,
    step: Optional[int] = None,
) -> None:
    """Replace whole adapters' indices (ascending, distinct) and, optionally, their values.

    Without ``values``, an index that stays keeps its value (and optimizer state); a new one starts at
    0. With the same count per layer, the Parameters are edited in place and an ``optimizer`` follows;
    a different count makes new Parameters (a fresh optimizer is then needed: passing one is refused).
    """
    found, adapter_name = _layers(model, adapter_name)
    layers = _named(found, list(indices), "set_indices")
    if values is not None:
        _named(found, list(values), "set_indices values")
        missing = [n for n in values if n not in indices]
        if missing:
            raise KeyError(f"set_indices: values given for {missing[0]!r} without its indices")
    same, sources, news, fresh = [], [], [], []
    offset = 0
    for layer, (name, new) in zip(layers, indices.items()):
        new = torch.as_tensor(new, device=layer.sparse_indices[adapter_name].device).reshape(-1)
        given = None if values is None or name not in values else torch.as_tensor(values[name]).reshape(-1)
        current = layer.sparse_values[adapter_name]
        check_sparse_tensors(name, new.to(index_dtype(layer.numel)), given if given is not None else torch.zeros(new.numel()), layer.numel)
        if new.numel() != current.numel():
            if optimizer is not None:
                raise ValueError(
                    f"{name}: {new.numel()} indices replace {current.numel()}: the values get a new size, which an "
                    "optimizer cannot follow; set the indices first, then build the optimizer"
                )
            _resize(layer, adapter_name, new, given, step)
            continue
        old = layer.sparse_indices[adapter_name].long()
        new = new.long()
        pos = torch.searchsorted(old, new).clamp(max=max(0, old.numel() - 1))
        stays = (old[pos] == new) if old.numel() else torch.zeros_like(new, dtype=torch.bool)
        source = torch.where(stays, pos + offset, -1)
        if given is not None:
            source = torch.full_like(source, -1)  # every slot takes the given value
        sources.append(source)
        news.append(new)
        fresh.append(given.to(current.dtype).to(current.device) if given is not None else torch.zeros_like(current.detach()))
        same.append(layer)
        offset += current.numel()
    if same:
        edit_slots(same, adapter_name, torch.cat(sources), torch.cat(news), optimizer=optimizer,
                   new_values=torch.cat(fresh), step=step)  # fmt: skip
    for layer in layers:  # placeholder indices (a config with init='external') are real now
        layer._indices_pending.discard(adapter_name)


def _resize(layer: SparseLayer, adapter_name: str, indices: torch.Tensor, values: Optional[torch.Tensor], step) -> None:
    """New indices of another count: new values Parameter (and ages), every cache dropped with the old ones."""
    dispatch.release([layer])
    old = layer.sparse_values[adapter_name]
    device = old.device
    layer.sparse_indices[adapter_name] = indices.to(device=device, dtype=index_dtype(layer.numel))
    data = torch.zeros(indices.numel(), dtype=old.dtype, device=device) if values is None else values.to(device=device, dtype=old.dtype)
    layer.sparse_values[adapter_name] = torch.nn.Parameter(data, requires_grad=old.requires_grad)
    layer._register_values(adapter_name)
    layer._ready.pop(adapter_name, None)
    layer._block_metadata.pop(adapter_name, None)
    dispatch.forget(layer, adapter_name)
    if adapter_name in layer.sparse_ages:
        layer.sparse_ages[adapter_name] = torch.full((indices.numel(),), 0 if step is None else step, dtype=torch.int32, device=device)


@torch.no_grad()
def set_values(model, values: Mapping[str, torch.Tensor], adapter_name: Optional[str] = None) -> None:
    """Write φ of the named layers in place (detached; same count), e.g. values a hypernetwork generated.

    The write goes through the values' version counter, so a training merge rewrites θ₀ + φ at the next
    pass, as after an optimizer step."""
    found, adapter_name = _layers(model, adapter_name)
    layers = _named(found, list(values), "set_values")
    targets, sources = [], []
    for layer, (name, new) in zip(layers, values.items()):
        current = layer.sparse_values[adapter_name]
        new = torch.as_tensor(new).detach().reshape(-1)
        if new.numel() != current.numel():
            raise ValueError(f"{name}: {new.numel()} values for {current.numel()} indices")
        if not torch.isfinite(new).all():
            raise ValueError(f"{name}: values contain NaN or infinite numbers")
        targets.append(current)
        sources.append(new.to(device=current.device, dtype=current.dtype))
    torch._foreach_copy_(targets, sources)


def values_grad(model, names: Optional[list] = None, adapter_name: Optional[str] = None) -> torch.Tensor:
    """The values' gradients of the named layers (default: every layer of the adapter, in module order)
    laid end to end — what :func:`set_values` wrote, in the same order, to hand back to a generator.
    A layer whose values got no gradient contributes zeros."""
    found, adapter_name = _layers(model, adapter_name)
    layers = _named(found, names, "values_grad") if names is not None else list(found.values())
    grads = []
    for layer in layers:
        v = layer.sparse_values[adapter_name]
        grads.append(v.grad.reshape(-1) if v.grad is not None else torch.zeros_like(v.detach()))
    return torch.cat(grads)
