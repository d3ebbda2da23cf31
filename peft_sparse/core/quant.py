"""The plain 4-bit path: bitsandbytes ``Linear4bit`` weights read in the logical (out, in) layout.

The layer dequantizes the weight through PEFT's quantization backend, adds the delta and multiplies (thesis
Eq. 7.8); on CUDA the fused NF4 launch of :mod:`peft_sparse.accel.nf4` does the first two in one pass.
"""

from __future__ import annotations

from torch import nn


def is_bnb_4bit(module: nn.Module) -> bool:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return False
    return isinstance(module, bnb.nn.Linear4bit)


def standard_4bit_layout(base: nn.Module) -> None:
    """Undo bitsandbytes' CPU inference repacking (AVX512-BF16 layout) so dequantization reads the weight right.

    bitsandbytes repacks a Linear4bit weight in place the first time the *base* layer runs on CPU in
    eval mode without gradients; ``dequantize_4bit`` does not understand that layout.
    """
    weight = getattr(base, "weight", None)
    state = getattr(weight, "quant_state", None)
    if state is not None and getattr(state, "packing_format_for_cpu", False):
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

        weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
