"""The cost model: which way a value gradient or a pass without gradients is computed, from shapes and counts."""

from __future__ import annotations

from typing import Optional

import torch

from .devices import SDDMM_KERNELS, device_type


class CostModel:
    """Chooses ``"dense"`` or ``"sddmm"`` for a layer from its shape, token count and number of indices.

    Times are modelled as ``flops / rate``: the dense path costs one GEMM of tokens·out·in
    multiply-adds plus a gather; the SDDMM path costs tokens·nnz multiply-adds at a much lower rate
    (no tensor-core reuse). ``sddmm_relative_rate`` is the SDDMM rate as a fraction of the GEMM
    rate, measured per device (``benchmarks/``); the CPU value comes from the torch reference.
    """

    def __init__(self, sddmm_relative_rate: Optional[dict[str, float]] = None):
        # measured: benchmarks/value_grad.py. On an H200 at 8192 tokens the Triton SDDMM lost to the
        # bf16 GEMM + gather at every density from 0.2% to 10% (docs/perf-log.md). On 2 CPU cores
        # (SmolLM2-135M's shapes, 440 tokens, float32) torch's sampled product ran at 0.025–0.12 of the
        # GEMM's rate: 2–4× faster than the dense path at 1% density, 1.0–2.5× at 4.6%.
        self.sddmm_relative_rate = {"cpu": 0.05, "cuda": 0.0005}
        if sddmm_relative_rate:
            self.sddmm_relative_rate.update(sddmm_relative_rate)

    # block kernels: a fixed launch/latency cost (in GEMM multiply-add equivalents) plus their MACs at a
    # fraction of the GEMM rate; the dense path also pays a fixed cost (GEMM launch, the gather, the
    # GEMM's poor efficiency on small shapes). The fixed costs: an H100 (benchmarks/value_grad.py, 8192
    # tokens): dense dW + gather of a 256×2048 layer took 0.037 ms for 0.013 ms of MACs. The rates: the
    # grouped kernel (block_sddmm_into) on an H200 at TinyLlama's shapes, 5.2% and 10% density, where
    # the MACs outweigh the fixed cost (docs/perf-log.md, round s21): 64×64 ran at 0.18–0.25 of the GEMM
    # rate, 32×32 at 0.16–0.20, 16×16 at 0.067–0.087; 1×64 (one block per program) at 0.004.
    block_relative_rate = {(64, 64): 0.22, (32, 32): 0.2, (16, 16): 0.065, (1, 64): 0.004}
    block_overhead = {"cuda": 6e9, "cpu": 0.0}
    dense_overhead = {"cuda": 8e9, "cpu": 0.0}

    def block_rate(self, block_shape) -> float:
        """The block kernel's rate (fraction of the GEMM rate) for ``block_shape``: the measured one, else
        that of the largest measured shape that fits inside it (row vectors within row vectors, tiles
        within tiles) — a larger block reads fewer operand bytes per multiply-add, so it runs at least
        as fast per element as a block it contains; the slowest measured rate when none fits."""
        # (a measured shape given as a tuple looked up at once: this runs in every block layer's backward)
        rate = self.block_relative_rate.get(block_shape) if type(block_shape) is tuple else None
        if rate is not None:
            return rate
        bh, bw = (int(d) for d in block_shape)
        rate = self.block_relative_rate.get((bh, bw))
        if rate is not None:
            return rate
        inside = [(h * w, r) for (h, w), r in self.block_relative_rate.items() if h <= bh and w <= bw and (h == 1) == (bh == 1)]
        return max(inside)[1] if inside else min(self.block_relative_rate.values())

    def choose_block(self, device: torch.device, tokens: int, out_features: int, in_features: int, nnz: int, block_shape) -> str:
        """``"block"`` (block-sparse product) or ``"dense"`` (GEMM + gather) for a block adapter (``device``:
        a ``torch.device`` or its type's name)."""
        rate = self.block_rate(block_shape)
        kind = device if type(device) is str else device.type
        block_cost = self.block_overhead.get(kind, 0.0) + tokens * nnz / rate
        dense_cost = self.dense_overhead.get(kind, 0.0) + tokens * out_features * in_features
        return "block" if block_cost < dense_cost else "dense"

    # inference without gradients (generation, evaluation): the delta applied from its nnz entries (a
    # sparse product, tokens·nnz multiply-adds) or a weight-sized W + δ rebuilt per call. On 2 CPU cores at
    # SmolLM2-135M's shapes the sparse product was cheaper up to tokens·density ≈ 0.3 (1 token: 0.05 against
    # 0.09–0.15 ms per layer); on CUDA the ratio is a conservative guess until measured.
    inference_sparse_ratio = {"cpu": 0.3, "cuda": 0.02}

    def choose_inference(self, x: torch.Tensor, tokens: int, out_features: int, in_features: int, nnz: int) -> str:
        """``"sparse"`` (X·Wᵀ + X·δᵀ from δ's entries) or ``"rebuild"`` (X·(W + δ)ᵀ) for a pass without gradients."""
        ratio = self.inference_sparse_ratio.get(device_type(x), 0.0)
        if x.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            return "rebuild"
        return "sparse" if tokens * nnz < ratio * out_features * in_features else "rebuild"

    def choose(self, device: torch.device, tokens: int, out_features: int, in_features: int, nnz: int) -> str:
        rate = self.sddmm_relative_rate.get(device.type, 0.0)
        if device.type not in SDDMM_KERNELS and device.type != "cpu":
            rate = min(rate, self.sddmm_relative_rate["cpu"])
        dense_cost = tokens * out_features * in_features
        sddmm_cost = tokens * nnz / max(rate, 1e-12)
        return "sddmm" if sddmm_cost < dense_cost else "dense"


COST_MODEL = CostModel()
