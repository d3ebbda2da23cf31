r"""Sparse deltas over parameters a module reads itself (PEFT's ``target_parameters``): the fused expert tensors of
mixture-of-experts models, or any other 1-D, 2-D or 3-D parameter — a bias is one row, and may be adapted beside the
weight of the same module, whose sparse layer the bias's wrapper then wraps.

In transformers 5 the experts of Mixtral, Qwen3-MoE and similar models are one module per layer holding 3-D
parameters — ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I) — which its forward pass reads as
``self.gate_up_proj`` (an eager loop over experts, ``batched_mm`` or ``grouped_mm``). A :class:`SparseParameter`
wraps that module for one parameter P and holds one :class:`SparseSlice` per expert e: an ordinary sparse layer
whose logical matrix is P[e], (rows, cols) as stored. So every method's policy, the budget split, SpIEL's
statistics (AG's candidates, MA's row and column accumulators), merging, saving and the mask-editing API see each
expert as a tensor of its own. A 2-D parameter has a single slice. While the wrapped module runs it reads

.. math::
    P' = P + \mathrm{stack}_e \textstyle\sum_a \mathrm{scatter}(\eta_{e,a}, \phi_{e,a}), \qquad
    \frac{\partial L}{\partial \phi_{e,a,j}} = \frac{\partial L}{\partial P'}[e][\eta_{e,a,j}]

(:class:`ParameterDelta`: one scatter over every slice's indices, offset by e·rows·cols). ∂L/∂P' is the gradient
the module's own operations give; it is dense and transient (freed when this backward returns), and a slice whose
``dense_grad_consumer`` is armed (SpIEL's estimation window) is handed its (rows, cols) part of it. P' itself is
not kept for backward: whatever the module's operations save of it (P', a transpose, one expert's slice) is saved
as a recipe and rebuilt once, when backward first needs it — so a step keeps O(d_φ) per wrapped parameter, not a
copy of P. Where other saved-tensor hooks are active (activation checkpointing), those decide what is kept.

Routing (MoE only): while counting is on (:meth:`SparseParameter.count_routed_tokens`), the wrapper adds up the
tokens routed to each expert from the ``top_k_index`` its module receives, for the no-token rule of SpIEL.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Optional

import torch
from torch import nn

from .functional import compose_weight, first_order_only
from .internals import current_saved_tensor_hooks, version
from .kernels import gather_as
from .layer import SparseLayer
from .targets import parameter_targets


def unsupported_parameter_reason(param: torch.Tensor) -> Optional[str]:
    if param.dim() not in (1, 2, 3):
        return (f"has shape {tuple(param.shape)}: sparse adapters adapt 1-D (a bias: one row), 2-D (rows, cols) and 3-D "
                "(experts, rows, cols) parameters")
    if not param.dtype.is_floating_point:
        return f"is of dtype {param.dtype}: sparse adapters adapt floating-point parameters"
    return None


def slice_names(key: str, param: torch.Tensor) -> list[str]:
    """The names of a parameter's sparse layers: ``key`` for a 1-D or 2-D parameter, ``key.e`` for expert e of a 3-D
    one."""
    return [f"{key}.{e}" for e in range(param.shape[0])] if param.dim() == 3 else [key]


def slice_shape(param: torch.Tensor) -> tuple[int, int]:
    """(rows, cols) of each of a parameter's slices: a 1-D parameter (a bias) is one row."""
    return (1, int(param.shape[0])) if param.dim() == 1 else (int(param.shape[-2]), int(param.shape[-1]))


def parameter_owner(module: nn.Module) -> nn.Module:
    """The module that holds a parameter under any wrappers: nested :class:`SparseParameter` wrappers and a sparse
    layer of the same module (a bias adapted beside the weight its sparse layer adapts)."""
    while isinstance(module, (SparseParameter, SparseLayer)) and not isinstance(module, SparseSlice):
        module = module.base_layer
    return module


def logical_name(path: str) -> str:
    """The name of a sparse layer (its ``module_name``, the key of its count) from its path in the model or in an
    adapter file: ``<module>[.base_layer…].deltas.<parameter>[.<expert>]`` → ``<module>.<parameter>[.<expert>]``;
    other paths as they are."""
    if ".deltas." not in path and not path.startswith("deltas."):
        return path
    while ".base_layer" in path:
        prefix, _, suffix = path.rpartition(".base_layer")
        path = prefix + suffix
    return path.replace(".deltas.", ".") if ".deltas." in path else path.removeprefix("deltas.")


def parameter_slice(model: nn.Module, name: str) -> Optional["ParameterSlice"]:
    """The :class:`ParameterSlice` a sparse layer named ``name`` (:func:`logical_name`) adapts in a plain
    ``model``, or None when ``name`` names no 2-D or 3-D parameter there."""
    candidates = [(name, None)]
    head, _, tail = name.rpartition(".")
    if tail.isdigit():
        candidates.append((head, int(tail)))
    for key, index in candidates:
        module_name, _, parameter = key.rpartition(".")
        try:
            owner = model.get_submodule(module_name)
        except AttributeError:
            continue
        param = owner._parameters.get(parameter)
        if param is not None and (param.dim() in (1, 2) if index is None else param.dim() == 3 and index < param.shape[0]):
            return ParameterSlice(owner, parameter, index)
    return None


def matched_parameters(config, model: nn.Module) -> tuple[dict, dict]:
    """({slice name: size}, {slice name: [rows, cols]}) of the parameters ``config.target_parameters`` names: one
    slice per expert of a 3-D parameter, one for a 2-D parameter, one row for a 1-D one."""
    sizes, shapes = {}, {}
    layers = tuple(key for key, m in model.named_modules() if isinstance(m, SparseLayer))
    for key, owner, name in parameter_targets(config, model, skip=layers):
        param = owner._parameters[name]
        reason = unsupported_parameter_reason(param)
        if reason:
            raise TypeError(f"target parameter {key!r} {reason}")
        rows, cols = slice_shape(param)
        bh, bw = config.block_shape
        if rows % bh or cols % bw:
            raise ValueError(f"block_shape={config.block_shape} does not tile target parameter {key!r}, whose slices are ({rows}, {cols})")
        for slice_name in slice_names(key, param):
            sizes[slice_name], shapes[slice_name] = rows * cols, [rows, cols]
    return sizes, shapes


class ParameterSlice(nn.Module):
    """The base layer a :class:`SparseSlice` sees: expert ``index`` of ``owner``'s parameter ``parameter_name`` (the
    whole parameter when ``index`` is None), a (rows, cols) view into it. The owner is referenced, not registered:
    it stays where it is in the model."""

    def __init__(self, owner: nn.Module, parameter_name: str, index: Optional[int]):
        super().__init__()
        object.__setattr__(self, "owner", owner)
        self.parameter_name = parameter_name
        self.index = index
        self.out_features, self.in_features = slice_shape(owner._parameters[parameter_name])

    def parameter(self) -> nn.Parameter:
        return self.owner._parameters[self.parameter_name]

    @property
    def weight(self) -> torch.Tensor:
        param = self.parameter()
        if param.dim() == 1:
            return param.view(1, -1)  # (a bias as one row: a view, so merging writes the parameter)
        return param if self.index is None else param[self.index]

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__name__}: a slice of {self.parameter_name!r} is read by the module that owns it")

    def extra_repr(self) -> str:
        where = "" if self.index is None else f"[{self.index}]"
        return f"{self.parameter_name}{where}: ({self.out_features}, {self.in_features})"


class SparseSlice(nn.Module, SparseLayer):
    """The sparse delta of one expert (or of a whole 2-D parameter) of a :class:`SparseParameter`. Everything but
    the pass is :class:`SparseLayer`'s: indices into its (rows, cols) matrix, values, ages, merging, editing."""

    base_kind = "parameter"
    __getstate__ = SparseLayer.__getstate__

    def __init__(self, base_layer: ParameterSlice, module_name: str, parameter_key: str) -> None:
        super().__init__()
        SparseLayer.__init__(self, base_layer, module_name)
        self.parameter_key = parameter_key  # the adapted parameter's name (module_name without the expert)

    train = SparseLayer.train
    _apply = SparseLayer._apply
    _replicate_for_data_parallel = SparseLayer._replicate_for_data_parallel
    __repr__ = SparseLayer.__repr__

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.module_name}: the delta of a parameter slice is applied by its SparseParameter, "
                           "when the module that owns the parameter runs")  # fmt: skip

    def supports_lora_conversion(self, adapter_name: str = "default") -> bool:
        """False: PEFT's LoRA conversion writes modules only (its LoRA on parameters reports False as well)."""
        return False

    def _weight_is_shared(self, weight: torch.Tensor) -> bool:
        # the slice is a view: whether another parameter shares the whole parameter's storage
        return SparseLayer._weight_is_shared(self, self.get_base_layer().parameter())


class SparseParameter(nn.Module):
    """Sparse deltas over parameter ``parameter_name`` of the module it wraps (module docstring). Wrappers of several
    parameters of one module nest, as PEFT's ``ParamWrapper`` does; each reads the delta of its own parameter."""

    def __init__(self, base_layer: nn.Module, parameter_name: str, key: str) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.parameter_name = parameter_name
        self.key = key
        owner = self.owner()
        param = owner._parameters[parameter_name]
        if param.dim() == 3:  # (saved as <module>.deltas.<parameter>.<expert>: see logical_name)
            delta = nn.ModuleList(SparseSlice(ParameterSlice(owner, parameter_name, e), f"{key}.{e}", key) for e in range(param.shape[0]))
        else:
            delta = SparseSlice(ParameterSlice(owner, parameter_name, None), key, key)
        self.deltas = nn.ModuleDict({parameter_name: delta})
        self.routed_tokens: Optional[torch.Tensor] = None  # (E,) tokens routed to each expert while counting
        self.unrouted = False  # True once a pass came without routing indices: nothing is counted from then on
        self._global_indices: dict = {}  # adapter → (key of the slices' indices, their concatenation, offset)

    # ------------------------------------------------------------------------------ structure
    @property
    def slices(self) -> list:
        """The sparse layers of the parameter: one per expert, or the one of a 2-D parameter."""
        delta = self.deltas[self.parameter_name]
        return list(delta) if isinstance(delta, nn.ModuleList) else [delta]

    def owner(self) -> nn.Module:
        """The module that holds the parameter (under any nested wrappers, and the sparse layer of its weight)."""
        return parameter_owner(self.base_layer)

    def get_base_layer(self) -> nn.Module:
        return self.owner()

    @property
    def merged(self) -> bool:
        return self.slices[0].merged

    def merge(self, safe_merge: bool = False, adapter_names: Optional[list] = None) -> None:
        for layer in self.slices:
            layer.merge(safe_merge=safe_merge, adapter_names=adapter_names)

    def unmerge(self) -> None:
        for layer in self.slices:
            if layer.merged:
                layer.unmerge()

    def unload_and_optionally_merge_module(self, merge: bool, safe_merge: bool, adapter_names: Optional[list]) -> nn.Module:
        """PEFT's ``unload``/``merge_and_unload``: this wrapper and those nested under it merged (if asked) and
        removed; returns the module that owns the parameters."""
        module = self
        while isinstance(module, SparseParameter):
            if merge:
                module.merge(safe_merge=safe_merge, adapter_names=adapter_names)
            module = module.base_layer
        if isinstance(module, SparseLayer):  # (the sparse layer of the same module's weight, under its bias's wrapper)
            module.release_training_merge()
            if merge:
                module.merge(safe_merge=safe_merge, adapter_names=adapter_names)
            module = module.get_base_layer()
        return module

    # ------------------------------------------------------------------------------ routing
    def count_routed_tokens(self) -> None:
        """Start counting, from zero, the tokens routed to each expert (3-D parameters of a module that receives
        routing indices, ``top_k_index``; otherwise counting stops at the first pass, with a warning)."""
        param = self.owner()._parameters[self.parameter_name]
        if param.dim() == 3 and not self.unrouted:
            self.routed_tokens = torch.zeros(param.shape[0], dtype=torch.long, device=param.device)

    def _count(self, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex():
            warnings.warn(f"{self.key}: {type(self.owner()).__name__} receives no routing indices (top_k_index), so the "
                          "tokens routed to each expert are not counted and SpIEL's no-token rule does not apply to it")  # fmt: skip
            self.routed_tokens, self.unrouted = None, True
            return
        experts = self.routed_tokens.numel()
        self.routed_tokens += torch.bincount(ids.reshape(-1).long().clamp(0, experts), minlength=experts + 1)[:experts]

    # ------------------------------------------------------------------------------ the pass
    def forward(self, *args, **kwargs):
        if "adapter_names" in kwargs:
            raise ValueError(f"{self.key}: mixed adapter batches (adapter_names) are not supported for target_parameters "
                             "(nor by PEFT's LoRA there); run one adapter per batch, or merge")  # fmt: skip
        first = self.slices[0]
        if first.merged:
            if not first.disable_adapters:
                return self.base_layer(*args, **kwargs)
            self.unmerge()  # disabled: θ₀ back, the module alone
        if self.routed_tokens is not None and first.training:
            self._count(args, kwargs)
        active = first.active_sparse_adapters()
        if not active:
            return self.base_layer(*args, **kwargs)
        observer = first.training_observer
        if observer is not None and first.training and not getattr(observer, "idle", False) and torch.is_grad_enabled():
            observer(first)
        for layer in self.slices:
            layer.check_ready(active)
        owner = self.owner()
        weight = owner._parameters[self.parameter_name]
        indices = [self._indices_of(a) for a in active]  # (Σ_e d_φ,) each, ascending positions in P
        values = [torch.cat([layer.sparse_values[a] for layer in self.slices]) for a in active]  # (Σ_e d_φ,) each
        recipe = _Rebuild(weight, indices, [v.detach() for v in values])
        merged = ParameterDelta.apply(weight, (self, recipe, len(active)), *indices, *values)  # P': (E, rows, cols)
        owner.__dict__[self.parameter_name] = merged  # (an instance attribute: found before the parameter)
        try:
            with _saved_as_recipe(merged, recipe):
                return self.base_layer(*args, **kwargs)
        finally:
            owner.__dict__.pop(self.parameter_name, None)

    def _indices_of(self, adapter: str) -> torch.Tensor:
        """Every slice's indices of ``adapter`` as positions in the whole parameter (kept until one changes)."""
        tensors = [layer.sparse_indices[adapter] for layer in self.slices]
        key = tuple((id(t), version(t)) for t in tensors)
        kept = self._global_indices.get(adapter)
        if kept is not None and kept[0] == key:
            return kept[1]
        size = self.slices[0].numel
        dtype = torch.int32 if size * len(tensors) < 2**31 else torch.int64
        joined = torch.cat([t.to(dtype) + e * size for e, t in enumerate(tensors)])
        self._global_indices[adapter] = (key, joined)
        return joined

    def hand_dense_gradient(self, grad: torch.Tensor) -> None:
        """Each slice's part of ∂L/∂P' to its armed dense-gradient consumer (SpIEL's statistics)."""
        layers = self.slices
        if all(layer.dense_grad_consumer is None for layer in layers):
            return
        grad = grad.contiguous()
        parts = [grad.view(1, -1)] if grad.dim() == 1 else [grad] if grad.dim() == 2 else grad.unbind(0)  # (rows, cols) each
        for layer, part in zip(layers, parts):
            consumer = layer.dense_grad_consumer
            if consumer is not None:
                layer.dense_grad_count += 1
                consumer(layer, part)

    def __repr__(self) -> str:
        return "sparse." + nn.Module.__repr__(self)

    def extra_repr(self) -> str:
        return f"parameter_name={self.parameter_name!r}"


class _Rebuild:
    """How to build P' = P + Σ_a scatter(η_a, φ_a) again: P (looked up, not copied), the indices and the values as
    the pass used them (a concatenation: a later optimizer step does not change it). Built once per backward."""

    def __init__(self, weight: nn.Parameter, indices: list, values: list):
        self.weight, self.indices, self.values = weight, indices, values
        self.weight_version = version(weight)
        self.kept: Optional[torch.Tensor] = None

    def build(self) -> torch.Tensor:
        w = self.weight
        flat = compose_weight(w.detach().view(-1, w.shape[-1]), self.indices, self.values, w.dtype, owned=False)
        return flat.view(w.shape)

    def get(self) -> torch.Tensor:
        if self.kept is None:
            if version(self.weight) != self.weight_version:
                raise RuntimeError("a parameter with a sparse delta was modified in place between the forward pass and "
                                   "its backward pass (merged?); run the forward pass again")  # fmt: skip
            self.kept = self.build()
        return self.kept


class _Saved:
    __slots__ = ("recipe", "size", "stride", "offset")

    def __init__(self, recipe, size, stride, offset):
        self.recipe, self.size, self.stride, self.offset = recipe, size, stride, offset


# what the passes now inside :func:`_saved_as_recipe` blocks produced: (storage, dtype, device, recipe) each (nested
# wrappers of one module, and MoE layers inside MoE layers, share one pair of hooks)
_PRODUCED: list = []


def _pack(t: torch.Tensor):
    for storage, dtype, device, recipe in _PRODUCED:
        try:
            same = t.dtype == dtype and t.device == device and t.untyped_storage().data_ptr() == storage
        except (RuntimeError, NotImplementedError):  # (tensors without a plain storage)
            return t
        if same:
            return _Saved(recipe, t.size(), t.stride(), t.storage_offset())
    return t


def _unpack(saved):
    if isinstance(saved, _Saved):
        return saved.recipe.get().as_strided(saved.size, saved.stride, saved.offset)
    return saved


@contextlib.contextmanager
def _saved_as_recipe(merged: torch.Tensor, recipe: _Rebuild):
    """What autograd saves of ``merged`` (itself or a view) inside the block is saved as ``recipe`` and rebuilt on
    first use in backward (module docstring). Not when gradients are off, nor under saved-tensor hooks of others."""
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        yield
        return
    hooks = current_saved_tensor_hooks()
    if hooks is not None and (hooks is False or hooks[0] is not _pack):  # (others' hooks: they decide)
        yield
        return
    _PRODUCED.append((merged.untyped_storage().data_ptr(), merged.dtype, merged.device, recipe))
    try:
        if hooks is None:
            with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
                yield
        else:  # (inside another wrapper's block: its hooks serve this pass too)
            yield
    finally:
        _PRODUCED.pop()


class ParameterDelta(torch.autograd.Function):
    r"""P' = P + Σ_a scatter(η_a, φ_a) over a whole parameter; ∂L/∂φ_a = (∂L/∂P')[η_a] (module docstring).
    Arguments: P, ``spec`` = (the wrapper, its :class:`_Rebuild`, n), the n adapters' global indices, their n
    values (each the concatenation over the slices)."""

    @staticmethod
    def forward(ctx, weight, spec, *indices_and_values):
        wrapper, recipe, n = spec
        ctx.wrapper, ctx.recipe, ctx.n = wrapper, recipe, n
        ctx.value_dtypes = [v.dtype for v in indices_and_values[n:]]
        ctx.save_for_backward(*indices_and_values[:n])
        return recipe.build()  # (E, rows, cols), transient: what backward needs of it is rebuilt

    @staticmethod
    def backward(ctx, grad):
        first_order_only()
        ctx.recipe.kept = None  # (every reader of P' has had its gradient: the rebuilt copy goes)
        n, needs = ctx.n, ctx.needs_input_grad
        ctx.wrapper.hand_dense_gradient(grad)
        flat = grad.contiguous().view(-1)  # ∂L/∂P', flat
        value_grads = [gather_as(flat, idx, dtype) if needs[2 + n + a] else None
                       for a, (idx, dtype) in enumerate(zip(ctx.saved_tensors, ctx.value_dtypes))]  # fmt: skip
        return (grad if needs[0] else None, None, *([None] * n), *value_grads)
