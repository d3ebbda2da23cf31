r"""Autograd for a linear layer with sparse deltas:

.. math::
    Y = X\,\big(W + \textstyle\sum_a \mathrm{scatter}(\eta_a, \phi_a)\big)^\top + b
    \qquad \text{(thesis Eq. 7.2, 7.8)}

``W`` is the frozen base weight in its logical (out, in) layout (dequantized for 4-bit layers).
The merged weight exists only transiently: forward builds it, uses it and drops it; backward
builds it again for ∂L/∂X — unless the layer keeps W + scatter(η, φ) in the base weight's own
storage while training (``premerged``; see ``SparseLayer``), when both passes read it in place.
What is saved for backward is the indices, the values and X (or how to rebuild X, see
:class:`InputRebuild`) — never a tensor of W's size (the frozen base weight is looked up again
through ``weight_fn``, not saved).

∂L/∂φ_j = ((∂L/∂Y)ᵀ X)[η_j] (Eq. 7.4 / E.5). It is computed by :func:`kernels.value_gradient`
(dense GEMM + gather, or SDDMM, chosen per layer) unless a *dense-gradient consumer* is armed on
the layer: then dW is formed once, handed to the consumer (e.g. SpIEL-AG candidate statistics) and
the value gradients are gathered from it.
"""

from __future__ import annotations

import weakref
from _weakref import _remove_dead_weakref
from collections.abc import Sequence
from typing import Callable, Optional, Protocol

import torch
import torch.nn.functional as F

from .. import accel
from . import kernels


class GradientHooks(Protocol):
    """What the autograd function needs from the layer beyond tensors (implemented by ``SparseLayer``)."""

    dense_grad_consumer: Optional[Callable[[object, torch.Tensor], None]]
    dense_grad_count: int
    value_grad_method: str
    rebuild_inputs: str  # see input_rebuild


def compose_weight(
    weight: torch.Tensor, indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor], dtype: torch.dtype, owned: bool
) -> torch.Tensor:
    """W + Σ scatter(η_a, φ_a) as a fresh contiguous (out, in) tensor of ``dtype`` (``owned``: W may be reused)."""
    if owned and weight.dtype == dtype and weight.is_contiguous():
        merged, source = weight, None
    else:
        merged, source = torch.empty(weight.shape, dtype=dtype, device=weight.device), weight
    if not indices:
        return merged.copy_(source) if source is not None else merged
    for a, (idx, val) in enumerate(zip(indices, values)):
        kernels.scatter_add_into(merged, idx, val, source if a == 0 else None)  # the first also copies W in
    return merged


def _pass_weight(weight: torch.Tensor, indices, values, dtype: torch.dtype, owned: bool) -> torch.Tensor:
    """The weight one pass multiplies with: W itself when there is nothing to add or convert (a base-only
    pass), else the transient W + Σ scatter(η_a, φ_a)."""
    if not indices and weight.dtype == dtype:
        return weight
    return compose_weight(weight, indices, values, dtype, owned)


def _fused_weight(hooks, owned: bool, premerged, indices, values, dtype) -> Optional[torch.Tensor]:
    """W + Σ scatter(η_a, φ_a) from the layer's fused path (``hooks.fused_merged_weight``: dequantization
    and scatter in one launch, for 4-bit weights), or None when it has none for this pass."""
    if not owned or premerged is not None:
        return None
    fused = getattr(hooks, "fused_merged_weight", None)
    return fused(indices, values, dtype) if fused is not None else None


def _compute_dtype(x: torch.Tensor, weight_dtype: torch.dtype) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return weight_dtype


class InputRebuild:
    """How backward rebuilds a layer input X from tensors autograd keeps anyway, instead of keeping X.

    Two patterns, both recognised from X's autograd node (nothing model-specific is imported):

    * X = A ⊙ B with both factors saved by the product's node — a gated MLP's activation
      silu(gate) ⊙ up feeding ``down_proj``;
    * X = S ⊙ (P ⊙ Q).to(X.dtype) with S saved by the outer product and P, Q by the inner one, X in a
      16-bit type — an RMSNorm's output ``weight * (h·rsqrt(var + ε)).to(dtype)`` feeding q/k/v or
      gate/up (the norm's own backward keeps h and the rsqrt).

    The rebuild repeats the same elementwise operations on the same tensors, so it gives the same
    bits. Tensors saved through saved-tensor hooks (X computed inside a checkpoint region, offloading)
    are never used: X is then kept. Not detectable, hence not supported: X changed through ``.data``
    after it was computed (an in-place edit through autograd is detected and X kept). Layers reading
    the same X share one record: the first backward that needs X rebuilds it, the last one drops it
    (``pending`` counts the readers registered in forward).
    """

    __slots__ = ("node", "inner", "saved", "dtype", "pending", "value", "__weakref__")

    def __init__(self, node, inner, saved: Optional[str], dtype: torch.dtype):
        self.node, self.inner, self.saved, self.dtype = node, inner, saved, dtype
        self.pending, self.value = 0, None

    def _compute(self) -> torch.Tensor:
        node = self.node
        if self.inner is None:
            return node._saved_self * node._saved_other
        return kernels.scaled_product(getattr(node, self.saved), self.inner._saved_self, self.inner._saved_other, self.dtype)

    def get(self) -> torch.Tensor:
        value = self.value if self.value is not None else self._compute()
        self.pending -= 1
        self.value = value if self.pending > 0 else None
        return value

    def factors(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(A, B) with X = A ⊙ B, both of X's shape and dtype, for the last reader when X = A ⊙ B is not
        formed yet (counted as its read): a consumer that multiplies tile by tile never writes X out.
        None otherwise — then :meth:`get`."""
        if self.inner is not None or self.value is not None or self.pending != 1:
            return None
        a, b = self.node._saved_self, self.node._saved_other
        if a.shape != b.shape or a.dtype != self.dtype or b.dtype != self.dtype:
            return None
        self.pending = 0
        return a, b


# id(autograd node) → a weak reference to its rebuild record, alive while some layer's backward may still
# need it (the record holds the node, so while it lives the id is that node's). A plain dict of weak
# references: ``weakref.WeakValueDictionary``'s Python-level get and set cost microseconds per layer call.
# Dead entries are dropped as the table grows (:func:`_register`).
_REBUILDS: "dict[int, weakref.ref[InputRebuild]]" = {}
_PRUNE_AT = [1024]


def _registered(node) -> Optional[InputRebuild]:
    """The live rebuild record of ``node``, or None."""
    ref = _REBUILDS.get(id(node))
    record = ref() if ref is not None else None
    return record if record is not None and record.node is node else None


def _register(node, record: InputRebuild) -> None:
    if len(_REBUILDS) >= _PRUNE_AT[0]:  # (amortised: the table at most doubles its live entries between prunes)
        # Safe with forward passes in several threads (nn.DataParallel): the items are copied in one step,
        # and an entry is removed only if its reference is still dead (as WeakValueDictionary removes them)
        for key, ref in list(_REBUILDS.items()):
            if ref() is None:
                _remove_dead_weakref(_REBUILDS, key)
        _PRUNE_AT[0] = max(1024, 2 * len(_REBUILDS))
    _REBUILDS[id(node)] = weakref.ref(record)


class _Hooked(Exception):
    """A saved tensor went through saved-tensor hooks (checkpointing, offloading): never unpack it in forward."""


_RAW_NAMES = {"_saved_self": "_raw_saved_self", "_saved_other": "_raw_saved_other"}  # (no string built per call)


def _saved(node, name: str):
    """The tensor ``node`` saved as ``name`` (``"_saved_self"``…), None when it saved none there.
    Raises _Hooked, without unpacking, when the tensor was packed by saved-tensor hooks: unpacking it
    now would spend a checkpoint's single unpack, or copy an offloaded tensor back."""
    raw = getattr(node, _RAW_NAMES[name], None)
    if raw is not None and getattr(raw, "unpack_hook", None) is not None:
        raise _Hooked(name)
    try:
        value = getattr(node, name)
    except RuntimeError:  # freed, or not a saved field
        return None
    return value if isinstance(value, torch.Tensor) else None


REBUILD_MODES = ("all", "products", "none")
# the saved-tensor hooks in force now (None: none), looked up once; a torch without it: X always kept
_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def input_rebuild(x: torch.Tensor, mode: str = "all") -> Optional[InputRebuild]:
    """The shared :class:`InputRebuild` of X (registering one more reader), or None when X must be kept.

    ``mode``: ``"all"`` — both patterns; ``"products"`` — only X = A ⊙ B with both factors kept (the
    cheaper rebuild: one multiplication); ``"none"`` — always keep X. Skipped while saved-tensor hooks
    are active (activation checkpointing, offloading): they manage what is kept, and X then goes
    through them like any saved tensor."""
    if mode == "none" or x.is_inference() or x._version != 0:  # (inference tensors: no version to follow)
        return None  # (edited in place since it was computed: no longer A ⊙ B)
    node = x.grad_fn
    if node is None or type(node).__name__ != "MulBackward0":
        return None
    if _TOP_HOOKS is None or _TOP_HOOKS(False) is not None:
        return None
    record = _registered(node)
    if record is None:
        try:
            record = _new_rebuild(node, x)
        except _Hooked:
            return None
        if record is None:
            return None
        _register(node, record)
    if mode == "products" and record.inner is not None:
        return None
    record.pending += 1
    return record


def _broadcast(*shapes: torch.Size) -> Optional[tuple]:
    """The broadcast of ``shapes``, None when they do not broadcast (``torch.broadcast_shapes`` without
    its symbolic-shape machinery, which costs tens of microseconds per call)."""
    ndim = max(len(s) for s in shapes)
    out = []
    for i in range(-ndim, 0):
        size = 1
        for s in shapes:
            if len(s) >= -i and s[i] != 1:
                if size != 1 and size != s[i]:
                    return None
                size = s[i]
        out.append(size)
    return tuple(out)


def _broadcasts_to(shape: torch.Size, a: torch.Size, b: torch.Size) -> bool:
    """Whether shapes ``a`` and ``b`` broadcast to exactly ``shape``: at once when one of them is ``shape``
    and the other ``shape`` too, one entry per row (``(..., 1)``) or one per column (``shape[-1:]``), else
    through :func:`_broadcast`."""
    for full, other in ((a, b), (b, a)):
        if full == shape and (other == shape or other == shape[-1:] or (len(other) == len(shape) and other[-1] == 1 and other[:-1] == shape[:-1])):
            return True
    return _broadcast(a, b) == tuple(shape)


def _new_rebuild(node, x: torch.Tensor) -> Optional[InputRebuild]:
    a, b = _saved(node, "_saved_self"), _saved(node, "_saved_other")
    shape = x.shape
    if a is not None and b is not None:
        if _broadcasts_to(shape, a.shape, b.shape) and (a.dtype == b.dtype == x.dtype or torch.result_type(a, b) == x.dtype):
            return InputRebuild(node, None, None, x.dtype)
        return None
    if (a is None) == (b is None) or x.dtype not in (torch.float16, torch.bfloat16):
        return None
    saved_name, s, unsaved = ("_saved_self", a, 1) if a is not None else ("_saved_other", b, 0)
    cast = node.next_functions[unsaved][0]
    if cast is None or type(cast).__name__ != "ToCopyBackward0":
        return None
    inner = cast.next_functions[0][0]
    if inner is None or type(inner).__name__ != "MulBackward0":
        return None
    p, q = _saved(inner, "_saved_self"), _saved(inner, "_saved_other")
    if p is None or q is None or s.dtype != x.dtype or not (s.get_device() == p.get_device() == q.get_device() == x.get_device()):
        return None
    if not _broadcasts_to(shape, p.shape, q.shape) or not _broadcasts_to(shape, s.shape, shape):
        return None
    return InputRebuild(node, inner, saved_name, x.dtype)


def _direct_apply(function: type, fixed: bool = False) -> Callable:
    """``function.apply`` without ``torch.autograd.Function.apply``'s Python wrapper, which on every call
    builds a closure, inspects ``setup_context`` and unwraps every argument (microseconds of host time per
    layer call, which bounds a training step whose kernels are short). Tensor arguments go through the
    same unwrapping of a dead functorch wrapper (a tensor that escaped a finished transform). While
    functorch transforms are active, and under ``torch.compile`` (which knows ``Function.apply``), the
    wrapper's own path. ``fixed``: :class:`MergedDeltaLinear`'s five arguments (x, bias, spec, indices,
    values), passed by name and unwrapped one by one, without building the argument list."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    unwrap = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)
    compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if active is None or unwrap is None or compiling is None:  # pragma: no cover - another torch: the public path
        return function.apply
    direct = super(torch.autograd.Function, function).apply  # (what the wrapper calls: the C++ apply)
    wrapped = function.apply

    tensor = torch.Tensor

    if fixed:

        def apply_fixed(x, bias, spec, indices, values):
            if active() or compiling():
                return wrapped(x, bias, spec, indices, values)
            return direct(unwrap(x), bias if bias is None else unwrap(bias), spec, unwrap(indices), unwrap(values))

        return apply_fixed

    def apply(*args):
        if active() or compiling():
            return wrapped(*args)
        return direct(*[unwrap(a) if isinstance(a, tensor) else a for a in args])

    return apply


def _values_need_grad(ctx, n_adapters: int) -> bool:
    """Whether any of the function's last ``n_adapters`` inputs (the values) needs a gradient."""
    needs = ctx.needs_input_grad
    return any(needs[len(needs) - n_adapters :])


def _save_for_backward(ctx, x: torch.Tensor, mode: str, indices_and_values: tuple, need_values: bool) -> None:
    """Save what backward needs: the indices, the values and X — or, when autograd already keeps what X
    is made of (:class:`InputRebuild`, ``mode`` as in :func:`input_rebuild`), how to rebuild X; X not at all
    when no value needs a gradient (``need_values`` False) or under ``torch.inference_mode``, which records
    no backward pass."""
    need_values = need_values and not torch.is_inference_mode_enabled()
    rebuild = input_rebuild(x, mode) if need_values and accel.ON else None  # (a fast path: off, X is saved)
    ctx.x_rebuild = rebuild
    if rebuild is not None or not need_values:
        ctx.x_saved = False
        ctx.save_for_backward(*indices_and_values)
    else:
        ctx.x_saved = True
        ctx.save_for_backward(x, *indices_and_values)


def _first_order_only() -> None:
    """Refuse a backward pass that builds a graph of its own (``create_graph=True``): these backward passes
    use the merged weight as stored and Triton kernels, through which autograd cannot differentiate, so
    a second derivative would be silently wrong."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "sparse adapter layers do not support double backward (create_graph=True, e.g. a gradient penalty "
            "through the adapter's layers): their gradients are first-order only"
        )


class SparseDeltaLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, spec, *indices_and_values):
        # spec: the pass's non-tensor arguments in one (each argument of apply costs host time)
        weight_fn, owned, hooks, blocks, premerged, n_adapters = spec
        indices = indices_and_values[:n_adapters]
        values = indices_and_values[n_adapters:]
        device = x.device.type
        autocast = torch.is_autocast_enabled(device)
        if premerged is not None:  # the stored weight already holds W + Σ scatter(η, φ) (see SparseLayer)
            merged = weight_fn()
            dtype = torch.get_autocast_dtype(device) if autocast else merged.dtype
        else:
            merged = _fused_weight(hooks, owned, premerged, indices, values, torch.get_autocast_dtype(device) if autocast else None)
            if merged is not None:  # built in one fused pass (a 4-bit layer), transient (out, in)
                dtype = merged.dtype
            else:
                weight = weight_fn()  # (out, in), frozen
                dtype = torch.get_autocast_dtype(device) if autocast else weight.dtype
                merged = _pass_weight(weight, indices, values, dtype, owned)  # transient (out, in)
                del weight
        x_in = x if x.dtype == dtype else x.to(dtype)
        b = bias if bias is None or bias.dtype == dtype else bias.to(dtype)
        if autocast:
            with torch.autocast(device, enabled=False):
                y = F.linear(x_in, merged, b)  # (..., out)
        else:
            y = F.linear(x_in, merged, b)
        del merged, x_in
        ctx.spec, ctx.dtype = spec, dtype
        ctx.generation = premerged.generation if premerged is not None else None
        ctx.x_meta = (x.shape, x.dtype)  # (and out_features = y.shape[-1], in_features = x.shape[-1])
        _save_for_backward(ctx, x, getattr(hooks, "rebuild_inputs", "all"), indices_and_values, _values_need_grad(ctx, n_adapters))
        return y

    @staticmethod
    def backward(ctx, grad_out):
        _first_order_only()
        saved = ctx.saved_tensors
        x, rest = (saved[0], saved[1:]) if ctx.x_saved else (None, saved)
        weight_fn, owned, hooks, ctx_blocks, premerged, n = ctx.spec
        indices, values = rest[:n], rest[n:]
        x_shape, x_dtype = ctx.x_meta
        out_features, in_features = grad_out.shape[-1], x_shape[-1]
        needs = ctx.needs_input_grad  # (x, [merged,] bias, spec, *indices, *values)
        need_x, need_bias = needs[0], needs[len(needs) - 2 * n - 2]
        need_values = needs[len(needs) - n :]
        dtype = ctx.dtype
        g2 = grad_out.reshape(-1, out_features)  # (tokens, out)
        if g2.dtype != dtype:
            g2 = g2.to(dtype)

        grad_x = None
        if need_x:
            if premerged is not None and premerged.still_merged(ctx.generation):
                merged = weight_fn()
            else:  # recomputed, transient — from θ₀: a later forward may have merged the layer in place since
                release = getattr(hooks, "release_weight_merge", None)
                if release is not None:
                    release()
                merged = _fused_weight(hooks, owned, None, indices, values, dtype)
                if merged is None:
                    merged = _pass_weight(weight_fn(), indices, values, dtype, owned)
            grad_x = g2.mm(merged).view(*x_shape[:-1], in_features)  # (..., in)
            if grad_x.dtype != x_dtype:
                grad_x = grad_x.to(x_dtype)
            del merged

        value_grads = [None] * n
        if any(need_values):
            consumer = hooks.dense_grad_consumer if hooks is not None else None
            method = hooks.value_grad_method if hooks is not None else "auto"
            blocks = [_chosen_block(ctx_blocks[a] if ctx_blocks and need_values[a] else None, method, g2, in_features, values[a]) for a in range(n)]
            # an AG window whose candidates are known blocks: their gradients from the block kernel too
            wanted = getattr(consumer, "candidate_blocks", None) if consumer is not None else None
            if wanted is not None and method != "dense":
                bh, bw = wanted.block_shape
                if method == "auto" and kernels.COST_MODEL.choose_block(kernels.device_type(g2), g2.shape[0], out_features, in_features, wanted.rows.numel() * bh * bw, (bh, bw)) != "block":
                    wanted = None
            else:
                wanted = None
            factors = None
            if x is None and ctx.x_rebuild is not None:
                # X = A ⊙ B read only by block kernels: they form it tile by tile (X's bits as torch's)
                if (consumer is None or wanted is not None) and n == 1 and blocks[0] is not None and g2.dtype == x_dtype == dtype:
                    factors = ctx.x_rebuild.factors()
                if factors is None:
                    x = ctx.x_rebuild.get()  # the same elementwise operations on the same tensors: the same bits
            if factors is not None:
                x2, x2_factor = (f.reshape(-1, in_features) for f in factors)  # (tokens, in) each
            else:
                x2, x2_factor = x.reshape(-1, in_features), None  # (tokens, in)
                if x2.dtype != dtype:
                    x2 = x2.to(dtype)
            if wanted is not None:
                consumer.add_candidate_gradients(g2, x2, x2_factor)
                hooks.dense_grad_count += 1
                consumer = None  # the values' gradients as outside a window
            if consumer is not None:
                dW = kernels.dense_weight_gradient(g2, x2)  # (out, in), freed on return
                hooks.dense_grad_count += 1
                consumer(hooks, dW)
                flat = dW.view(-1)
                for a in range(n):
                    if need_values[a]:
                        value_grads[a] = kernels.gather_as(flat, indices[a], values[a].dtype)
                del dW, flat
            else:
                for a in range(n):
                    if need_values[a]:
                        value_grads[a] = _value_gradient(g2, x2, x2_factor, blocks[a], indices[a], values[a], method)

        grad_bias = g2.sum(0).to(grad_out.dtype) if need_bias else None
        return (grad_x, grad_bias, None, *([None] * n), *value_grads)


class GivenWeightLinear(SparseDeltaLinear):
    """:class:`SparseDeltaLinear` whose forward pass multiplies by a merged weight the caller built
    (``merged``: a transient (out, in) W + Σ scatter(η_a, φ_a) in the pass's dtype, used once; e.g. a
    4-bit layer's kept fused launch, see ``SparseLayer``), without autocast and without ``premerged``.
    Backward is :class:`SparseDeltaLinear`'s: it rebuilds the merged weight itself."""

    @staticmethod
    def forward(ctx, x, merged, bias, spec, *indices_and_values):
        dtype = merged.dtype
        x_in = x if x.dtype == dtype else x.to(dtype)
        y = F.linear(x_in, merged, bias if bias is None or bias.dtype == dtype else bias.to(dtype))
        del merged, x_in
        ctx.spec, ctx.dtype, ctx.generation = spec, dtype, None
        ctx.x_meta = (x.shape, x.dtype)
        _save_for_backward(ctx, x, getattr(spec[2], "rebuild_inputs", "all"), indices_and_values, _values_need_grad(ctx, spec[5]))
        return y

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, *rest = SparseDeltaLinear.backward(ctx, grad_out)
        return (grad_x, None, *rest)


class MergedDeltaLinear(SparseDeltaLinear):
    """:class:`SparseDeltaLinear` for a steady training pass of one adapter merged in place (``premerged``):
    X and the bias already in the stored weight's dtype, autocast off — what the caller checked, so forward
    multiplies by the stored weight without the generic pass's decisions. Arguments are
    :class:`SparseDeltaLinear`'s (``spec``'s ``premerged`` is the merge); backward takes the generic one's
    decisions for these passes in a lean form, and hands over to it for anything else."""

    @staticmethod
    def forward(ctx, x, bias, spec, indices, values):
        merge = spec[4]
        weight = merge.weight
        y = F.linear(x, weight, bias)
        ctx.spec, ctx.dtype, ctx.generation, ctx.x_meta = spec, weight.dtype, merge.generation, (x.shape, x.dtype)
        _save_for_backward(ctx, x, spec[2]._rebuild_inputs, (indices, values), ctx.needs_input_grad[4])  # (its one adapter's values)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        # The steady pass's backward: the generic one's decisions for what forward checked (one adapter,
        # merged in place; X, weight and output of one dtype, so no casts), without its general lookups —
        # this runs once per layer call in the backward pass, whose host time can bound a step. Anything
        # else (an AG window's dense gradients, a bias to differentiate, the merge written back since
        # forward) takes the generic backward.
        spec = ctx.spec
        layer, merge = spec[2], spec[4]
        needs = ctx.needs_input_grad  # (x, bias, spec, indices, values)
        if layer.dense_grad_consumer is not None or needs[1] or not merge.still_merged(ctx.generation) or torch.is_grad_enabled():
            return SparseDeltaLinear.backward(ctx, grad_out)
        x_shape = ctx.x_meta[0]
        in_features = x_shape[-1]
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # (tokens, out)
        grad_x = g2.mm(merge.weight).view(x_shape) if needs[0] else None
        saved = ctx.saved_tensors  # (read in every case, as the generic backward does: autograd's in-place edit check)
        if not needs[4]:
            return grad_x, None, None, None, None
        x, indices, values = saved if ctx.x_saved else (None, *saved)
        method = layer.value_grad_method
        block = _chosen_block(spec[3][0] if spec[3] else None, method, g2, in_features, values)
        factors = None
        if x is None:  # rebuilt (ctx.x_rebuild); X = A ⊙ B read only by the block kernel: formed tile by tile
            factors = ctx.x_rebuild.factors() if block is not None else None
            if factors is None:
                x = ctx.x_rebuild.get()
        x2, x2_factor = (f.reshape(-1, in_features) for f in factors) if factors is not None else (x.reshape(-1, in_features), None)
        return grad_x, None, None, None, _value_gradient(g2, x2, x2_factor, block, indices, values, method)


def _chosen_block(block, method: str, g2: torch.Tensor, in_features: int, values: torch.Tensor):
    """The block layout a value gradient goes through, or None for the unstructured paths: ``method``
    ``"dense"`` never takes the block kernel, ``"auto"`` takes it where the cost model chooses it."""
    if block is None or method == "dense":
        return None
    if method == "auto" and kernels.COST_MODEL.choose_block(kernels.device_type(g2), g2.shape[0], g2.shape[1], in_features, values.numel(), block.block_shape) == "dense":
        return None
    return block


def _value_gradient(g2, x2, x2_factor, block, indices, values, method: str) -> torch.Tensor:
    """∂L/∂φ in the values' dtype from G (tokens, out) and X (tokens, in; X = x2 ⊙ x2_factor when a factor
    is given, block kernel only): the block kernel straight into the values' order, else
    :func:`kernels.value_gradient` by ``method``."""
    if block is not None:
        grad = kernels.block_value_gradient(g2, x2, block, x_factor=x2_factor)
    else:
        grad = kernels.value_gradient(g2, x2, indices, g2.shape[1], x2.shape[1], method)
    return grad if grad.dtype == values.dtype else grad.to(values.dtype)


sparse_delta_apply = _direct_apply(SparseDeltaLinear)
given_weight_apply = _direct_apply(GivenWeightLinear)
merged_apply = _direct_apply(MergedDeltaLinear, fixed=True)


def sparse_delta_linear(
    x: torch.Tensor,
    weight_fn: Callable[[], torch.Tensor],
    bias: Optional[torch.Tensor],
    indices: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    hooks: Optional[GradientHooks] = None,
    owned: bool = False,
    blocks: Optional[Sequence] = None,
    premerged=None,
) -> torch.Tensor:
    """Y = X (W + Σ scatter(η_a, φ_a))ᵀ + b with a memory-lean backward.

    ``weight_fn()`` returns the frozen logical (out, in) weight; ``owned=True`` says it returns a
    fresh tensor (e.g. a dequantized copy) that may be modified in place. ``blocks[a]`` is the block
    metadata of adapter a (see ``SparseLayer.block_metadata``) or None: block adapters get their
    value gradient from a block-sparse product. ``premerged`` (an object with ``generation`` and
    ``still_merged(generation)``): the weight ``weight_fn()`` returns already holds W + Σ scatter(η_a, φ_a),
    so neither pass builds a merged copy; backward builds one if the stored weight was written back or
    rewritten since forward (``still_merged`` False for the forward's generation).
    """
    return sparse_delta_apply(x, bias, (weight_fn, owned, hooks, blocks, premerged, len(indices)), *indices, *values)


def delta_matrix(indices: torch.Tensor, values: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """scatter(η, φ) as an (out, in) CSR matrix (η ascending row-major positions)."""
    rows, cols = kernels.rows_cols(indices, in_features)
    return kernels.csr_pattern(rows, cols, values, (out_features, in_features))


def sparse_delta_product(
    x: torch.Tensor, indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor], out_features: int, matrices: Optional[list] = None
) -> torch.Tensor:
    """X · (Σ_a scatter(η_a, φ_a))ᵀ without a weight-sized tensor: O(tokens · d_φ), in the values' dtype.

    ``matrices``: the deltas as CSR matrices (:func:`delta_matrix`) when the caller keeps them."""
    in_features = x.shape[-1]
    x2 = x.reshape(-1, in_features)  # (tokens, in)
    y = None
    for a, (idx, val) in enumerate(zip(indices, values)):
        delta = matrices[a] if matrices is not None else delta_matrix(idx, val.detach(), out_features, in_features)
        part = torch.sparse.mm(delta, x2.t().to(val.dtype)).t()  # (tokens, out)
        y = part if y is None else y + part.to(y.dtype)
    return y.reshape(*x.shape[:-1], out_features)


def sparse_delta_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    indices: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
) -> torch.Tensor:
    """Plain-autograd version (keeps the merged weight for backward); used when W itself is trained."""
    flat = weight.reshape(-1)
    for idx, val in zip(indices, values):
        flat = flat.index_add(0, idx, val.to(weight.dtype))
    return F.linear(x.to(weight.dtype), flat.view_as(weight), bias)
