r"""Autograd for a linear layer with sparse deltas, the reference of every linear pass:

.. math::
    Y = X\,\big(W + \textstyle\sum_a \mathrm{scatter}(\eta_a, \phi_a)\big)^\top + b
    \qquad \text{(thesis Eq. 7.2, 7.8)}

``W`` is the frozen base weight in its logical (out, in) layout (dequantized for 4-bit layers).
The merged weight exists only transiently: forward builds it, uses it and drops it; backward
builds it again for ∂L/∂X — unless a fast path keeps W + scatter(η, φ) in the base weight's own
storage while training (``premerged``), when both passes read it in place. What is saved for
backward is the indices, the values and X (or, through the ``input_rebuild`` step of
:mod:`.dispatch`, how to rebuild X) — never a tensor of W's size (the frozen base weight is looked up
again through ``weight_fn``, not saved).

∂L/∂φ_j = ((∂L/∂Y)ᵀ X)[η_j] (Eq. 7.4 / E.5). It is computed by :func:`kernels.value_gradient`
(dense GEMM + gather, or SDDMM, chosen per layer) unless a *dense-gradient consumer* is armed on
the layer: then dW is formed once, handed to the consumer (e.g. SpIEL-AG candidate statistics) and
the value gradients are gathered from it. A consumer whose ``takes_factors`` is True never gets dW: it
gets dW's factors instead, ``consumer.add_factors(G, X, X_factor)`` (G = ∂L/∂Y as (tokens, out), X as
(tokens, in), X = X ⊙ X_factor when a factor is given; e.g. SpIEL-MA's input/output statistics, which
keep Σ G² and Σ X² per row and column), and the value gradients are computed as without a consumer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable, Optional, Protocol

import torch
import torch.nn.functional as F

from . import dispatch, kernels
from .dispatch import STEPS

# what backward may rebuild instead of keeping X (SparseLayer.rebuild_inputs): gated-MLP activations and
# 16-bit RMSNorm outputs, only the activations, or nothing
REBUILD_MODES = ("all", "products", "none")


class GradientHooks(Protocol):
    """What the autograd function needs from the layer beyond tensors (implemented by ``SparseLayer``)."""

    dense_grad_consumer: Optional[Callable[[object, torch.Tensor], None]]
    dense_grad_count: int
    value_grad_method: str
    rebuild_inputs: str  # one of REBUILD_MODES

    def release_weight_merge(self) -> None: ...


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


def pass_weight(weight: torch.Tensor, indices, values, dtype: torch.dtype, owned: bool) -> torch.Tensor:
    """The weight one pass multiplies with: W itself when there is nothing to add or convert (a base-only
    pass), else the transient W + Σ scatter(η_a, φ_a)."""
    if not indices and weight.dtype == dtype:
        return weight
    return compose_weight(weight, indices, values, dtype, owned)


def _fused_weight(hooks, owned: bool, indices, values, dtype) -> Optional[torch.Tensor]:
    """W + Σ scatter(η_a, φ_a) of a dequantized (``owned``) weight from the ``fused_weight`` step of
    :mod:`.dispatch` (dequantization and scatter in one launch), or None: the reference's way."""
    if not owned or not dispatch.ON:
        return None
    fused = STEPS.fused_weight
    return fused(hooks, indices, values, dtype) if fused is not None else None


def compute_dtype(x: torch.Tensor, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype a pass over ``x`` multiplies in: autocast's where it is on, else the weight's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return weight_dtype


def values_need_grad(ctx, n_adapters: int) -> bool:
    """Whether any of the function's last ``n_adapters`` inputs (the values) needs a gradient."""
    needs = ctx.needs_input_grad
    return any(needs[len(needs) - n_adapters :])


def keep_for_backward(ctx, x: torch.Tensor, mode: str, indices_and_values: tuple, need_values: bool) -> None:
    """Save what backward needs: the indices, the values and X — or, where the ``input_rebuild`` step of
    :mod:`.dispatch` finds that autograd already keeps what X is made of (``mode``: one of
    :data:`REBUILD_MODES`), how to rebuild X; X not at all when no value needs a gradient (``need_values``
    False) or under ``torch.inference_mode``, which records no backward pass."""
    need_values = need_values and not torch.is_inference_mode_enabled()
    rebuild = STEPS.input_rebuild(x, mode) if need_values and dispatch.ON and STEPS.input_rebuild is not None else None
    ctx.x_rebuild = rebuild
    if rebuild is not None or not need_values:
        ctx.x_saved = False
        ctx.save_for_backward(*indices_and_values)
    else:
        ctx.x_saved = True
        ctx.save_for_backward(x, *indices_and_values)


def first_order_only() -> None:
    """Refuse a backward pass that builds a graph of its own (``create_graph=True``): these backward passes
    use the merged weight as stored and Triton kernels, through which autograd cannot differentiate, so
    a second derivative would be silently wrong."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "sparse adapter layers do not support double backward (create_graph=True, e.g. a gradient penalty "
            "through the adapter's layers): their gradients are first-order only"
        )


class SparseDeltaLinear(torch.autograd.Function):
    r"""One pass of a linear layer with sparse deltas (module docstring):

    .. math::
        Y = X\,W'^\top + b, \quad W' = W + \textstyle\sum_a \mathrm{scatter}(\eta_a, \phi_a); \qquad
        \frac{\partial L}{\partial X} = G\,W', \quad
        \frac{\partial L}{\partial \phi_{a,j}} = (G^\top X)[\eta_{a,j}], \quad
        \frac{\partial L}{\partial b} = \textstyle\sum_t G_t

    with G = ∂L/∂Y. Arguments: X (..., in), the bias (out,) or None, ``spec`` = (weight_fn, owned, hooks,
    blocks, premerged, n) — the pass's non-tensor arguments in one, as each argument of ``apply`` costs host
    time — then the n adapters' indices and their n values. W' is built in forward and again in backward
    (never kept), unless ``premerged`` says the stored weight holds it."""

    @staticmethod
    def forward(ctx, x, bias, spec, *indices_and_values):
        weight_fn, owned, hooks, blocks, premerged, n_adapters = spec
        indices = indices_and_values[:n_adapters]  # (d_φ,) each, ascending flat positions in (out, in)
        values = indices_and_values[n_adapters:]  # (d_φ,) each
        device = x.device.type
        autocast = torch.is_autocast_enabled(device)
        if premerged is not None:  # the stored weight already holds W + Σ scatter(η, φ)
            merged = weight_fn()  # (out, in), in place
            dtype = torch.get_autocast_dtype(device) if autocast else merged.dtype
        else:
            merged = _fused_weight(hooks, owned, indices, values, torch.get_autocast_dtype(device) if autocast else None)
            if merged is not None:  # W' built in one fused launch (a 4-bit weight): transient (out, in)
                dtype = merged.dtype
            else:
                weight = weight_fn()  # W: (out, in), frozen
                dtype = torch.get_autocast_dtype(device) if autocast else weight.dtype
                merged = pass_weight(weight, indices, values, dtype, owned)  # W': transient (out, in)
                del weight
        x_in = x if x.dtype == dtype else x.to(dtype)  # (..., in)
        b = bias if bias is None or bias.dtype == dtype else bias.to(dtype)
        if autocast:
            with torch.autocast(device, enabled=False):
                y = F.linear(x_in, merged, b)  # (..., out)
        else:
            y = F.linear(x_in, merged, b)  # (..., out)
        del merged, x_in
        ctx.spec, ctx.dtype = spec, dtype
        ctx.generation = premerged.generation if premerged is not None else None
        ctx.x_meta = (x.shape, x.dtype)
        keep_for_backward(ctx, x, getattr(hooks, "rebuild_inputs", "all"), indices_and_values, values_need_grad(ctx, n_adapters))
        return y

    @staticmethod
    def backward(ctx, grad_out):
        return backward_pass(ctx, grad_out, input_gradient)


def backward_pass(ctx, grad_out, input_gradient_fn: Callable) -> tuple:
    """:class:`SparseDeltaLinear`'s backward, with ∂L/∂X = G·W' from ``input_gradient_fn`` (:func:`input_gradient`
    or an implementation that forms G·W' another way, bit for bit): (∂L/∂X, ∂L/∂b, None for the spec and each
    indices tensor, ∂L/∂φ_a for each adapter)."""
    first_order_only()
    saved = ctx.saved_tensors
    x, rest = (saved[0], saved[1:]) if ctx.x_saved else (None, saved)  # X: (..., in), or rebuilt below
    n = ctx.spec[5]
    indices, values = rest[:n], rest[n:]
    x_shape, x_dtype = ctx.x_meta
    out_features, in_features = grad_out.shape[-1], x_shape[-1]
    needs = ctx.needs_input_grad  # (x, bias, spec, *indices, *values)
    need_x, need_bias = needs[0], needs[len(needs) - 2 * n - 2]
    need_values = needs[len(needs) - n :]
    g2 = grad_out.reshape(-1, out_features)  # G: (tokens, out)
    if g2.dtype != ctx.dtype:
        g2 = g2.to(ctx.dtype)
    grad_x = input_gradient_fn(ctx, g2, indices, values, x_shape, x_dtype) if need_x else None  # (..., in)
    value_grads = [None] * n
    if any(need_values):
        value_grads = values_gradients(ctx, g2, x, indices, values, need_values, out_features, in_features, x_dtype)
    grad_bias = g2.sum(0).to(grad_out.dtype) if need_bias else None  # (out,)
    return (grad_x, grad_bias, None, *([None] * n), *value_grads)


def input_gradient(ctx, g2, indices, values, x_shape, x_dtype) -> torch.Tensor:
    """∂L/∂X = G·W' (..., in): W' read in place while the forward's merge still holds, else built again —
    from θ₀ (a later forward pass may have merged the layer in place since: the layer writes θ₀ back first)."""
    weight_fn, owned, hooks, _, premerged, _ = ctx.spec
    if premerged is not None and premerged.still_merged(ctx.generation):
        merged = weight_fn()  # (out, in), in place
    else:
        release = getattr(hooks, "release_weight_merge", None)
        if release is not None:
            release()
        merged = _fused_weight(hooks, owned, indices, values, ctx.dtype)
        if merged is None:
            merged = pass_weight(weight_fn(), indices, values, ctx.dtype, owned)  # W': transient (out, in)
    grad_x = g2.mm(merged).view(*x_shape[:-1], x_shape[-1])  # (tokens, out)·(out, in) → (..., in)
    return grad_x if grad_x.dtype == x_dtype else grad_x.to(x_dtype)


def values_gradients(ctx, g2, x, indices, values, need_values, out_features: int, in_features: int, x_dtype) -> list:
    """∂L/∂φ_a = (Gᵀ·X)[η_a] for every adapter that needs it (Eq. 7.4 / E.5), and the layer's dense-gradient
    consumer served on the way (module docstring): an AG window whose candidates are known blocks gets their
    block gradients, a consumer taking dW's factors gets G and X, any other gets dW itself once (the values'
    gradients are then gathered from it)."""
    _, _, hooks, ctx_blocks, _, n = ctx.spec
    dtype = ctx.dtype
    consumer = hooks.dense_grad_consumer if hooks is not None else None
    method = hooks.value_grad_method if hooks is not None else "auto"
    blocks = [chosen_block(ctx_blocks[a] if ctx_blocks and need_values[a] else None, method, g2, in_features, values[a]) for a in range(n)]
    # an AG window whose candidates are known blocks: their gradients from the block kernel too
    wanted = getattr(consumer, "candidate_blocks", None) if consumer is not None else None
    if wanted is not None and method != "dense":
        bh, bw = wanted.block_shape
        if method == "auto" and kernels.COST_MODEL.choose_block(kernels.device_type(g2), g2.shape[0], out_features, in_features,
                                                                  wanted.rows.numel() * bh * bw, (bh, bw)) != "block":  # fmt: skip
            wanted = None
    else:
        wanted = None
    takes_factors = consumer is not None and getattr(consumer, "takes_factors", False)
    factors = None
    if x is None and ctx.x_rebuild is not None:
        # X = A ⊙ B read only by block kernels: they form it tile by tile (X's bits as torch's)
        if (consumer is None or wanted is not None or takes_factors) and n == 1 and blocks[0] is not None and g2.dtype == x_dtype == dtype:
            factors = ctx.x_rebuild.factors()
        if factors is None:
            x = ctx.x_rebuild.get()  # the same elementwise operations on the same tensors: the same bits
    if factors is not None:
        x2, x2_factor = (f.reshape(-1, in_features) for f in factors)  # (tokens, in) each
    else:
        x2, x2_factor = x.reshape(-1, in_features), None  # X: (tokens, in)
        if x2.dtype != dtype:
            x2 = x2.to(dtype)
    if wanted is not None:
        consumer.add_candidate_gradients(g2, x2, x2_factor)
        hooks.dense_grad_count += 1
        consumer = None  # the values' gradients as outside a window
    elif takes_factors:  # dW's factors, not dW (no dense gradient formed)
        consumer.add_factors(g2, x2, x2_factor)
        consumer = None
    value_grads = [None] * n
    if consumer is not None:
        dW = kernels.dense_weight_gradient(g2, x2)  # Gᵀ·X: (out, in), freed on return
        hooks.dense_grad_count += 1
        consumer(hooks, dW)
        flat = dW.view(-1)
        for a in range(n):
            if need_values[a]:
                value_grads[a] = kernels.gather_as(flat, indices[a], values[a].dtype)  # (d_φ,)
        del dW, flat
    else:
        for a in range(n):
            if need_values[a]:
                value_grads[a] = values_gradient(g2, x2, x2_factor, blocks[a], indices[a], values[a], method, hooks)  # (d_φ,)
    return value_grads


def chosen_block(block, method: str, g2: torch.Tensor, in_features: int, values: torch.Tensor):
    """The block layout a value gradient goes through, or None for the unstructured paths: ``method``
    ``"dense"`` never takes the block kernel, ``"auto"`` takes it where the cost model chooses it."""
    if block is None or method == "dense":
        return None
    if method == "auto" and kernels.COST_MODEL.choose_block(kernels.device_type(g2), g2.shape[0], g2.shape[1], in_features, values.numel(), block.block_shape) == "dense":
        return None
    return block


def values_gradient(g2, x2, x2_factor, block, indices, values, method: str, layer=None) -> torch.Tensor:
    """∂L/∂φ in the values' dtype from G (tokens, out) and X (tokens, in; X = x2 ⊙ x2_factor when a factor
    is given, block kernel only): the block kernel straight into the values' order, else
    :func:`kernels.value_gradient` by ``method`` — given the indices' sampled pattern kept by ``layer``
    (``STEPS.sampled_pattern``) where the SDDMM runs on the CPU."""
    if block is not None:
        grad = kernels.block_value_gradient(g2, x2, block, x_factor=x2_factor)
    else:
        out_features, in_features = g2.shape[1], x2.shape[1]
        if method == "auto":
            method = kernels.COST_MODEL.choose(g2.device, g2.shape[0], out_features, in_features, indices.numel())
        pattern = None
        if method == "sddmm" and layer is not None and dispatch.ON and STEPS.sampled_pattern is not None and kernels.sampled_product_applies(g2, x2):
            pattern = STEPS.sampled_pattern(layer, indices, out_features, in_features, g2.dtype)
        grad = kernels.value_gradient(g2, x2, indices, out_features, in_features, method, pattern)
    return grad if grad.dtype == values.dtype else grad.to(values.dtype)


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
    apply = STEPS.apply if dispatch.ON and STEPS.apply is not None else SparseDeltaLinear.apply
    return apply(x, bias, (weight_fn, owned, hooks, blocks, premerged, len(indices)), *indices, *values)


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
        if x2.device.type == "cpu" and delta.dtype in (torch.float16, torch.bfloat16):
            # (CPU sparse products have no 16-bit kernels: float32, rounded back to the values' dtype)
            part = torch.sparse.mm(delta.to(torch.float32), x2.t().float()).t().to(val.dtype)
        else:
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
