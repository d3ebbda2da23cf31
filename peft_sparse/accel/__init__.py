"""Everything in peft_sparse that exists only for speed, behind one switch, plugged into the core's seam.

The plain path — scatter W + δ, the autograd function, the value gradient by dense GEMM + gather or
SDDMM, the per-tensor drop/grow of :mod:`peft_sparse.methods.spiel.selection` — is the reference: it
is what the fast paths must reproduce. The fast paths are

* the **default training pass** of a plain linear layer: W + scatter(η, φ) written into the base weight's storage
  for the length of each matrix product only (forward and backward), θ₀ written back right after, no weight-sized
  copy; its decisions repeated from a memo while they hold (:mod:`.transient_merge`);
* the **training merge**: W + scatter(η, φ) kept in the base weight's storage while one adapter trains
  (opt-in per layer, ``merge_for_training``), rewritten after each optimizer step;
* **steady-pass memos**: a layer's, and SM3's, decisions of the last pass reused after cheap checks;
* **input rebuilds**: layer inputs rebuilt in backward from what autograd keeps anyway;
* **inference memos**: a layer's CSR delta kept between passes without gradients (matrix-vector at one token);
* **index memos**: what passes derive from an adapter's indices (int64 positions, the CPU value gradient's CSR
  pattern) kept until the indices change (:mod:`.by_indices`);
* **generation merges**: a causal-LM PeftModel's ``generate`` runs inside ``merged_for_inference`` (the adapters
  merged in place for the call, θ₀ written back bit for bit after; ``SparseTuner.generate``);
* the **Triton kernels** (SDDMM, block products, the fused NF4 dequantize + delta, the fused SM3 step)
  and their **kept launches**;
* SpIEL's **batched reselection** (all tensors in a handful of launches).

The core never imports this package: importing it registers the fast paths with the core's seam
(:mod:`peft_sparse.core.dispatch`) — the implementations of a pass, the single steps, the listeners that keep
what they hold consistent when a layer changes, the kernels (:mod:`.gpu`) — as the table below says.

``peft_sparse.fast_paths(False)`` turns all of them off — as a context manager, or as a call that holds
until changed, like ``torch.set_grad_enabled`` — and so does ``PEFT_SPARSE_FAST=0`` in the environment.
Results are the same either way (bit for bit on CPU, where the tests check it); only speed and memory
differ. Every use of a torch or Triton internal sits in :mod:`.internals`, with a fallback.
"""

from __future__ import annotations

import os

from ..core import dispatch, kernels
from . import by_indices, gpu, inference, input_rebuild, internals, nf4, steady, training_merge, transient_merge  # noqa: F401 (gpu: the kernels)


def enabled() -> bool:
    """Whether the fast paths are on."""
    return dispatch.ON


def __getattr__(name: str):
    if name == "ON":  # (``peft_sparse.accel.ON``: the switch's state, kept in the core's seam)
        return dispatch.ON
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class fast_paths:
    """Turn the fast paths on or off: ``with peft_sparse.fast_paths(False): ...`` restores the previous
    setting on exit; a bare ``peft_sparse.fast_paths(False)`` holds until changed. Turning them off
    writes θ₀ back into any base weight merged for training (at the layer's next pass)."""

    def __init__(self, on: bool = True):
        if not isinstance(on, bool):
            raise TypeError(f"fast_paths takes True or False, got {on!r}")
        self.previous, dispatch.ON = dispatch.ON, on

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        dispatch.ON = self.previous


class _FastPathState(dispatch.Listener):
    """What the fast paths keep on layers, kept consistent with the core's changes."""

    def release(self, layers: list, weight_only: bool) -> None:
        for layer in layers:  # (a loop, not a list: this runs in every reference pass, mostly for one layer)
            if layer._writing_thread is not None:  # another thread is inside the layer's product (transient_merge)
                transient_merge.check_not_writing(layer)
            if layer._training_merge is not None:
                # θ₀ back, one launch per group of like tensors
                training_merge.release_training_merges([merged for merged in layers if merged._training_merge is not None])
                break
        if weight_only:
            return
        for layer in layers:  # the last pass's decisions and fused launch hold the layer's tensors
            if layer._steady is not None:
                layer._steady = None
            if layer._transient_steady is not None:
                layer._transient_steady = None
            if layer._write_lane is not None:
                layer._write_lane = None
            if layer._nf4_rebuild is not None:
                layer._nf4_rebuild = None

    def forget(self, layer, adapter) -> None:
        layer._weight_alias = None
        layer._by_indices = []
        if adapter is None:
            layer._delta_csr.clear()
        else:
            layer._delta_csr.pop(adapter, None)
        layer._inference_memo = None
        layer._steady = None
        layer._transient_steady = None
        layer._write_lane = None

    def reindex(self, layers: list, change):
        for layer in layers:  # what is kept of indices about to change (kept by version too, but a foreach
            layer._by_indices = []  # copy under a TorchDispatchMode leaves the versions as they were)
        merged_anew = training_merge.reseat_training_merges(layers, change)
        if not merged_anew:
            return None
        return lambda: training_merge.release_training_merges([layer for layer, _ in merged_anew])

    def layouts_changed(self, olds: list, news: list, plan_keys: list) -> None:
        kernels.prepare_block_plans(news, plan_keys)  # the group plans the old layouts used, for the new ones
        kernels.carry_launches(olds, news)


# ---------------------------------------------------------------------------------------------- registration
# what each fast path keeps on a layer: (initial value, kept by a copy of the layer)
for _name, _initial, _copied in (
    ("_training_merge", lambda: None, True),  # training_merge._TrainingMerge: W + δ in the base weight
    ("_steady", lambda: None, True),  # the last training pass's decisions (steady.py)
    ("_nf4_cache", lambda: None, False),  # (weakref to the 4-bit weight, its storage pointer, quant state, operands)
    ("_nf4_starts_cache", lambda: None, False),  # (weakref to an indices tensor, (address, version, size), its starts)
    ("_nf4_rebuild", lambda: None, True),  # the last single-adapter fused NF4 launch, to repeat (nf4.py)
    ("_delta_csr", dict, False),  # adapter → (key, indices, values, its CSR delta) for passes without gradients
    ("_inference_memo", lambda: None, False),  # the single active adapter's CSR delta and its checks (inference.py)
    ("_weight_alias", lambda: None, False),  # (weight, address, shape, its storage as a flat alias) (transient_merge.py)
    ("_by_indices", list, False),  # [(indices, key, version, address, a tensor derived from them)] (by_indices.py)
    ("_writing_thread", lambda: None, False),  # the thread inside the layer's product with W' written (transient_merge.py)
    ("_transient_steady", lambda: None, False),  # the last default training pass's decisions (transient_merge.py)
    ("_write_lane", lambda: None, False),  # the last single-adapter write on CUDA, to repeat (transient_merge.py)
):
    dispatch.register_layer_state(_name, _initial, _copied)

# kind → memos (tried before the layer checks its tensors), then implementations, in this order
dispatch.register("linear", inference.inference_forward, memo=True)
dispatch.register("linear", steady.steady_forward, memo=True)
dispatch.register("linear", transient_merge.steady_transient_forward, memo=True)
dispatch.register("linear", training_merge.training_merge_pass)
dispatch.register("linear", transient_merge.transient_merge_pass)
dispatch.register("quantized", inference.inference_forward, memo=True)
dispatch.register("quantized", steady.steady_forward, memo=True)
dispatch.register("quantized", steady.quantized_training_pass)

dispatch.STEPS.base_output = inference.base_output
dispatch.STEPS.fused_weight = nf4.fused_merged_weight
dispatch.STEPS.input_rebuild = input_rebuild.input_rebuild
dispatch.STEPS.delta_matrices = inference.kept_delta_matrices
dispatch.STEPS.sampled_pattern = by_indices.sampled_pattern
dispatch.STEPS.apply = steady.sparse_delta_apply
dispatch.listen(_FastPathState())

dispatch.ON = os.environ.get("PEFT_SPARSE_FAST", "1").strip().lower() not in ("0", "false", "off", "no")
