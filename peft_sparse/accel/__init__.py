"""Everything in peft_sparse that exists only for speed, behind one switch.

The plain path — scatter W + δ, the autograd function, the value gradient by dense GEMM + gather or
SDDMM, the per-tensor drop/grow of :mod:`peft_sparse.methods.spiel.selection` — is the reference: it
is what the fast paths must reproduce. The fast paths are

* the **training merge**: W + scatter(η, φ) kept in the base weight's storage while one adapter trains
  (opt-in per layer, ``merge_for_training``), rewritten after each optimizer step;
* **steady-pass memos**: a layer's, and SM3's, decisions of the last pass reused after cheap checks;
* **input rebuilds**: layer inputs rebuilt in backward from what autograd keeps anyway;
* **inference memos**: a layer's CSR delta kept between passes without gradients (matrix-vector at one token);
* **generation merges**: a causal-LM PeftModel's ``generate`` runs inside ``merged_for_inference`` (the adapters
  merged in place for the call, θ₀ written back bit for bit after; ``SparseTuner.generate``);
* the **Triton kernels** (SDDMM, block products, the fused NF4 dequantize + delta, the fused SM3 step)
  and their **kept launches**;
* SpIEL's **batched reselection** (all tensors in a handful of launches).

``peft_sparse.fast_paths(False)`` turns all of them off — as a context manager, or as a call that holds
until changed, like ``torch.set_grad_enabled`` — and so does ``PEFT_SPARSE_FAST=0`` in the environment.
Results are the same either way (bit for bit on CPU, where the tests check it); only speed and memory
differ. Every use of a torch or Triton internal sits in :mod:`.internals`, with a fallback.
"""

from __future__ import annotations

import os

ON: bool = os.environ.get("PEFT_SPARSE_FAST", "1").strip().lower() not in ("0", "false", "off", "no")


def enabled() -> bool:
    """Whether the fast paths are on."""
    return ON


class fast_paths:
    """Turn the fast paths on or off: ``with peft_sparse.fast_paths(False): ...`` restores the previous
    setting on exit; a bare ``peft_sparse.fast_paths(False)`` holds until changed. Turning them off
    writes θ₀ back into any base weight merged for training (at the layer's next pass)."""

    def __init__(self, on: bool = True):
        if not isinstance(on, bool):
            raise TypeError(f"fast_paths takes True or False, got {on!r}")
        global ON
        self.previous, ON = ON, on

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        global ON
        ON = self.previous
