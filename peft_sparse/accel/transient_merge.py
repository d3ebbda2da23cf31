r"""The default training pass of a linear layer: W + δ written into the base weight's own storage for the length
of one matrix product, and θ₀ written back right after it.

The reference (:func:`peft_sparse.core.passes.linear_pass`) builds W' = W + Σ_a scatter(η_a, φ_a) as a fresh
(out, in) tensor in forward and again in backward: a copy of W, read and written, for every pass. Here forward
and backward instead

1. read θ₀ at η (d_φ entries, kept by the pass),
2. write θ₀[η] + φ at η in the base weight's storage — the copy's rounding, so W' holds the copy's bits
   (on CUDA steps 1 and 2 are one Triton launch, and so is step 4; a layer with one adapter repeats both from
   launches kept for its tensors, :class:`~.triton_kernels.WriteLane`),
3. multiply: Y = X·W'ᵀ + b in forward, ∂L/∂X = G·W' in backward,
4. write the saved θ₀[η] back at η (a copy of the entries read: the same bits, not a subtraction),

with steps 2–4 inside ``try/finally``, so θ₀ is back when the product fails too. Results are the reference's
bit for bit; no weight-sized tensor is made (the opt-in training merge, :mod:`.training_merge`, keeps W' in
the storage between optimizer steps instead, so the base weight shows θ₀ + δ to anything that looks then).

Nothing outside the layer's own forward and backward sees W': between steps 2 and 4 only the product runs — no
Python code, no hook, no saved-tensor hook (the weight is not saved for backward: backward writes W' again),
no recomputation of a checkpointed region (backward reads its saved tensors before step 2, and rebuilds X after
step 4). The writes go through an alias of the weight with its own version counter, so autograd records no
change of the weight (its bits after step 4 are the ones before step 2) and a pending backward of a pass that
saved the weight (the base layer's own pass, adapters disabled) stays valid.

Passes not taken (the reference computes them): without gradients, with a base weight that trains, is
quantized, stored (in, out) (GPT-2 ``Conv1D``), not contiguous, on the meta device or on another device than
X, managed by a sharding wrapper (FSDP, DeepSpeed ZeRO-3, DTensor), in an ``nn.DataParallel`` replica (the
replicas of one device share it and run in threads), under autocast to another dtype than the weight's, while
``torch.compile`` traces or functorch transforms run, and on layers merged for training (opt-in). A pass of
the layer in another thread while one is between steps 2 and 4 is refused with an error naming the layer
(:func:`write` marks the layer for that time); a thread that reads the base weight directly, not through
the layer, while the layer runs a training pass in another thread can see W' there, as it could see a
sharding wrapper's gathered weight: such readers must not run beside training, or the fast paths must be off
(``peft_sparse.fast_paths(False)``, ``PEFT_SPARSE_FAST=0``).
"""

from __future__ import annotations

import threading
from typing import Optional

import torch
import torch.nn.functional as F

from ..core import dispatch, kernels
from ..core.base import managed_by_sharding
from ..core.functional import SparseDeltaLinear, backward_pass, first_order_only, input_gradient, keep_for_backward, values_need_grad
from . import by_indices, internals

_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)
_transforms_active = internals.functorch_transforms_active


# Off: single-adapter writes on CUDA go through the generic calls, not a layer's kept lane (triton_kernels.WriteLane;
# benchmarks/bench_step.py --no-write-lane, for a comparison in one lease).
WRITE_LANE = True

# Off: the pass is not taken on CUDA (benchmarks/bench_step.py --no-transient-cuda, for a comparison in one lease
# with the fast paths' composed pass; the transient pass was host-bound for block adapters on an H200, BENCHMARKS.md).
ON_CUDA = True


def _alias(layer, weight: torch.Tensor) -> torch.Tensor:
    """The base weight's storage as a flat tensor with its own version counter (``weight.data``), kept on the
    layer while the weight keeps that object, address and shape."""
    kept = layer._weight_alias
    if kept is not None and kept[0] is weight and kept[1] == weight.data_ptr() and kept[2] == weight.shape:
        return kept[3]
    flat = weight.data.view(-1)
    layer._weight_alias = (weight, weight.data_ptr(), weight.shape, flat)
    return flat


def writable(layer, weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether a pass of ``layer`` over ``x`` may write W' into ``weight`` for its product (module docstring)."""
    return (
        not weight.requires_grad
        and weight.is_floating_point()
        and weight.is_contiguous()
        and weight.device == x.device
        and weight.device.type != "meta"
        and not managed_by_sharding(weight)
        and not _compiling()
        and not _transforms_active()
    )


def _kernels_for(flat: torch.Tensor, values) -> Optional[object]:
    """The Triton kernels' module where it writes and restores ``flat`` (a CUDA tensor of a type they compute), else None."""
    if not flat.is_cuda or not dispatch.ON or flat.dtype not in kernels.KERNEL_FLOAT_TYPES or any(v.dtype not in kernels.KERNEL_FLOAT_TYPES for v in values):
        return None
    return kernels.triton()


def write(layer, flat: torch.Tensor, indices, values) -> list:
    """Steps 1–2 of the module docstring: W' = W + Σ_a scatter(η_a, φ_a) written into ``flat`` (the base weight's
    storage), adapter after adapter as the reference's copy adds them; returns what each adapter's write found at
    its indices, for :func:`restore`. The layer's ``_writing_thread`` names this thread until then (a pass of the
    layer from another thread is refused meanwhile: :func:`check_not_writing`)."""
    check_not_writing(layer)
    # (past nn.Module.__setattr__, which costs host time; _base_weight_held: a reference pass of the layer in another
    # thread asks the listeners before it reads the weight, and is refused)
    state = layer.__dict__
    state["_writing_thread"], state["_base_weight_held"] = threading.get_ident(), True
    saved: list = []
    try:
        lane = state.get("_write_lane")
        if lane is not None and len(indices) == 1 and WRITE_LANE and dispatch.ON and lane.serves(flat, indices[0], values[0]):
            return lane.swap_in()  # this layer's last single-adapter write again (CUDA, the kernels' types: checked when made)
        triton = _kernels_for(flat, values)
        if triton is not None and len(indices) == 1 and WRITE_LANE and isinstance(values[0], torch.nn.Parameter):
            # a lane for the layer's own values (not a copy a saved-tensor hook made: a new one at every pass), kept
            state["_write_lane"] = lane = triton.WriteLane(flat, indices[0], values[0])
            with kernels.on_device(flat):
                return lane.swap_in()
        for idx, val in zip(indices, values):
            if triton is not None:  # one launch: θ₀[η] kept, θ₀[η] + φ written
                with kernels.on_device(flat):
                    saved.append(triton.swap_in(flat, idx, val))
                continue
            if flat.device.type == "cpu" and torch.get_num_threads() > 1:
                # take / put_ spread over the threads where index_select / index_add_ do not (int64 positions, kept)
                positions = by_indices.positions(layer, idx)
                base = flat.take(positions)  # θ₀ at η (plus earlier adapters' deltas where they overlap): (d_φ,)
                saved.append(base)
                flat.put_(positions, base + (val if val.dtype == flat.dtype else val.to(flat.dtype)))  # the copy's single rounding
                continue
            base = flat.index_select(0, idx)  # θ₀ at η (plus earlier adapters' deltas where they overlap): (d_φ,)
            saved.append(base)
            if flat.device.type == "cpu":  # W[η] += φ: the same single rounding of W[η] + φ as the copy's (and faster)
                flat.index_add_(0, idx, val if val.dtype == flat.dtype else val.to(flat.dtype))
            else:
                kernels.scatter_sum_into(flat, idx, base, val)
    except BaseException:
        restore(layer, flat, indices, saved)
        raise
    return saved


def restore(layer, flat: torch.Tensor, indices, saved: list) -> None:
    """Step 4 of the module docstring: what :func:`write` found at each adapter's indices written back, the last
    adapter's first (a copy of the entries read: the same bits, not a subtraction); the layer's mark cleared."""
    try:
        lane = layer.__dict__.get("_write_lane")
        if lane is not None and lane.restore(saved):  # (what the lane's write kept)
            return
        triton = _kernels_for(flat, ())
        for idx, base in zip(reversed(indices[: len(saved)]), reversed(saved)):
            if triton is not None:
                with kernels.on_device(flat):
                    triton.scatter_copy(flat, idx, base)
            elif flat.device.type == "cpu":  # (int64 positions; index_copy_ is faster than index_put_ on one thread)
                positions = by_indices.positions(layer, idx)
                if torch.get_num_threads() > 1:
                    flat.put_(positions, base)
                else:
                    flat.index_copy_(0, positions, base)
            else:
                flat.index_put_((idx,), base)
    finally:
        state = layer.__dict__
        state["_writing_thread"], state["_base_weight_held"] = None, False


def check_not_writing(layer) -> None:
    """Refuse a pass (or a look at the base weight through the layer) while another thread has W' written there."""
    owner = layer._writing_thread
    if owner is not None:
        raise RuntimeError(
            f"{layer.module_name}: a pass in another thread has this layer's adapted weight written into its base "
            f"weight (thread {owner}, inside the layer's own matrix product); concurrent training passes of one model "
            "from several threads are not supported (turn the fast paths off: peft_sparse.fast_paths(False))"
        )


class TransientMergeLinear(SparseDeltaLinear):
    """:class:`SparseDeltaLinear` with W' written into the base weight's storage for each product and θ₀ written
    back after it (module docstring), in forward and in backward. ``spec`` is the reference's, with the layer as
    ``hooks`` (``owned`` False, ``premerged`` None)."""

    @staticmethod
    def forward(ctx, x, bias, spec, *indices_and_values):
        weight_fn, _, layer, _, _, n = spec
        indices, values = indices_and_values[:n], indices_and_values[n:]  # (d_φ,) each
        weight = weight_fn()  # θ₀: (out, in), the storage written
        dtype = weight.dtype
        x_in = x if x.dtype == dtype else x.to(dtype)  # (..., in)
        b = bias if bias is None or bias.dtype == dtype else bias.to(dtype)
        flat = _alias(layer, weight)
        saved = write(layer, flat, indices, values)
        try:
            if torch.is_autocast_enabled(x.device.type):  # (autocast to the weight's own dtype: the reference's product)
                with torch.autocast(x.device.type, enabled=False):
                    y = F.linear(x_in, weight, b)  # (..., out)
            else:
                y = F.linear(x_in, weight, b)  # (..., out)
        finally:
            restore(layer, flat, indices, saved)
        del x_in
        ctx.spec, ctx.dtype, ctx.generation = spec, dtype, None
        ctx.x_meta = (x.shape, x.dtype)
        keep_for_backward(ctx, x, layer._rebuild_inputs, indices_and_values, values_need_grad(ctx, n))
        return y

    @staticmethod
    def backward(ctx, grad_out):
        first_order_only()
        return backward_pass(ctx, grad_out, _written_input_gradient)


def _written_input_gradient(ctx, g2, indices, values, x_shape, x_dtype) -> torch.Tensor:
    """∂L/∂X = G·W' (..., in) with W' written into the base weight for the product; the reference's way
    (:func:`~peft_sparse.core.functional.input_gradient`: W' built as a copy) where the weight can no longer be
    written (replaced, cast, sharded since forward) or its dtype is not the pass's."""
    layer = ctx.spec[2]
    layer.release_weight_merge()  # (θ₀ back where a training merge was set up since forward)
    weight = ctx.spec[0]()  # θ₀: (out, in)
    if weight.dtype != ctx.dtype or not writable(layer, weight, g2):
        return input_gradient(ctx, g2, indices, values, x_shape, x_dtype)
    flat = _alias(layer, weight)
    saved = write(layer, flat, indices, values)
    try:
        grad_x = g2.mm(weight)  # (tokens, out)·(out, in) → (tokens, in)
    finally:
        restore(layer, flat, indices, saved)
    grad_x = grad_x.view(*x_shape[:-1], x_shape[-1])
    return grad_x if grad_x.dtype == x_dtype else grad_x.to(x_dtype)


transient_apply = internals.direct_apply(TransientMergeLinear)


def transient_merge_pass(layer, x: torch.Tensor, active: list) -> Optional[torch.Tensor]:
    """A pass with gradients of a plain linear layer (module docstring: which are taken): the reference's output
    and gradients, bit for bit, with W' written into the base weight only for each product. None for any other
    pass, and on CUDA when :data:`ON_CUDA` is off."""
    if not active or layer.merge_for_training or not torch.is_grad_enabled() or layer.quantization_backend is not None or layer.fan_in_fan_out:
        return None
    if x.is_cuda and not ON_CUDA:
        return None
    if getattr(layer, "_is_replica", False):  # an nn.DataParallel replica: its device's replicas share the weight
        return None
    base = layer.get_base_layer()
    weight = base.weight
    if not writable(layer, weight, x):
        return None
    device = x.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) != weight.dtype:
        return None  # (the reference multiplies a converted copy)
    layer.release_weight_merge()  # (θ₀ back where a training merge was left in place: merge_for_training turned off)
    indices = [layer.sparse_indices[a] for a in active]  # η_a: (d_φ,) each
    values = [layer.sparse_values[a] for a in active]  # φ_a: (d_φ,) each
    blocks = [layer.block_metadata(a) for a in active]
    spec = (layer._stored_weight, False, layer, blocks, None, len(active))
    if len(active) == 1:
        _remember(layer, active[0], values[0], indices[0], weight, blocks)
    return transient_apply(x, base.bias, spec, *indices, *values)


def _remember(layer, name: str, values: torch.Tensor, indices: torch.Tensor, weight: torch.Tensor, blocks: list) -> None:
    """Keep the decisions of this single-adapter pass for the next one (:func:`steady_transient_forward`): nothing
    that refers back to the layer (no cycle for the collector to find)."""
    current = layer._active_adapter
    current = current if isinstance(current, str) else list(current)  # (a copy: compared by value)
    base_layer = layer._modules["base_layer"]
    base = layer.get_base_layer()
    layer.__dict__["_transient_steady"] = (
        current, name, values, values.dtype, indices, internals.version(indices), indices.data_ptr(), base_layer, base, weight,
        base._parameters.get("bias"), blocks,
    )  # fmt: skip


def steady_transient_forward(layer, x: torch.Tensor, active: list) -> Optional[torch.Tensor]:
    """A pass like the layer's last one of :func:`transient_merge_pass` (a memo, tried before the layer checks its
    tensors): every decision of the full path checked again directly — the same active adapter, values (that passed
    the layer's checks), indices (object, address, version), base layer, weight and bias objects; gradients on, the
    weight frozen, autocast off or to the weight's dtype, no tracing or transform — without its lookups (the host time
    of a layer call bounds a training step when kernels are short). Returns the output, or None: the full path."""
    kept = layer._transient_steady
    if kept is None or not torch.is_grad_enabled():  # (a pass without gradients: not this one's, the memo stays)
        return None
    current, name, values, dtype, indices, version, address, base_layer, base, weight, bias, blocks = kept
    if (
        layer._active_adapter == current
        and not layer._disable_adapters
        and not layer.merged_adapters
        and not layer.merge_for_training
        and layer._modules["base_layer"] is base_layer
        and base._parameters.get("weight") is weight
        and base._parameters.get("bias") is bias
        and "bias" not in base.__dict__  # (a bias with its own delta, read through base.bias: the full path)
        and layer._modules["sparse_values"]._parameters.get(name) is values
        and layer._ready.get(name) is values
        and values.dtype is dtype
        and layer._modules["sparse_indices"]._buffers.get(name) is indices
        and internals.version(indices) == version
        and indices.data_ptr() == address
        and not weight.requires_grad
        and weight.device == x.device
        and not _compiling()
        and not _transforms_active()
    ):
        device = x.device.type
        if not torch.is_autocast_enabled(device) or torch.get_autocast_dtype(device) == weight.dtype:
            return transient_apply(x, bias, (layer._stored_weight, False, layer, blocks, None, 1), indices, values)
    layer.__dict__["_transient_steady"] = None
    return None
