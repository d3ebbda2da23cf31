"""Optimizer-state surgery after a reselection: the one place that edits optimizer state.

After drop/grow, slot j of a values tensor holds a new index. Every per-slot optimizer tensor is
re-gathered with the same ``source`` map (new slot → old slot, −1 for a grown slot) *in place*, so
the optimizer keeps the same Parameter objects and state tensors. Grown slots are seeded:

* ``torch.optim.AdamW`` / ``Adam`` (stock): from the estimation window's mean gradient ĝ and mean
  squared gradient ŝ, as exp_avg = ĝ·(1−β₁ᵗ) and exp_avg_sq = ŝ·(1−β₂ᵗ) with t = ``state["step"]``,
  so Adam's own bias correction (÷(1−βᵗ)) recovers exactly ĝ and ŝ at the next step. This stands in
  for the per-index age correction of the thesis (§7.3.1), which stock AdamW cannot express.
  ``amsgrad=True`` is refused: its running maximum has no meaningful value for a new slot.
* :class:`peft_sparse.SM3`: the momentum buffer (if any) starts at zero; the row and column
  accumulators cover the whole matrix and need no change.
* ``torch.optim.SGD``: the momentum buffer starts at zero.

Any other optimizer is refused with the list above.
"""

from __future__ import annotations

from typing import Optional

import torch

from .sm3 import SM3


def unwrap_optimizer(optimizer):
    """The torch optimizer inside wrappers such as accelerate's AcceleratedOptimizer."""
    seen = 0
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer") and seen < 8:
        optimizer, seen = optimizer.optimizer, seen + 1
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer (or a wrapper of one), got {type(optimizer).__name__}")
    return optimizer


SUPPORTED = (torch.optim.AdamW, torch.optim.Adam, SM3, torch.optim.SGD)


def check_supported(optimizer) -> torch.optim.Optimizer:
    opt = unwrap_optimizer(optimizer)
    if not isinstance(opt, SUPPORTED):
        names = ", ".join(f"{c.__module__}.{c.__name__}" for c in SUPPORTED)
        raise TypeError(f"optimizer {type(opt).__name__} cannot follow a reselection; supported: {names}")
    for group in opt.param_groups:
        if group.get("amsgrad"):
            raise ValueError("optimizer has amsgrad=True: its running maximum has no value for a newly grown slot")
    return opt


def _regather(tensor: torch.Tensor, source: torch.Tensor, grown: torch.Tensor, fill: Optional[torch.Tensor]) -> None:
    new = tensor[source.clamp(min=0)]
    if fill is None:
        new[grown] = 0
    else:
        new[grown] = fill.to(new.dtype)
    tensor.copy_(new)


def reindex_optimizer_state(
    optimizer,
    param: torch.Tensor,
    source: torch.Tensor,
    grad_mean: Optional[torch.Tensor] = None,
    grad_sq_mean: Optional[torch.Tensor] = None,
) -> None:
    """Re-gather ``param``'s per-slot state by ``source`` and seed the grown slots (``source == -1``).

    ``grad_mean`` / ``grad_sq_mean`` hold ĝ and ŝ of the grown slots, in slot order.
    """
    opt = check_supported(optimizer)
    state = opt.state.get(param)
    if not state:
        return
    grown = source < 0
    if isinstance(opt, (torch.optim.AdamW, torch.optim.Adam)):
        group = next(g for g in opt.param_groups if any(p is param for p in g["params"]))
        beta1, beta2 = group["betas"]
        t = float(state["step"])
        m_seed = None if grad_mean is None else grad_mean * (1 - beta1**t)
        v_seed = None if grad_sq_mean is None else grad_sq_mean * (1 - beta2**t)
        _regather(state["exp_avg"], source, grown, m_seed)
        _regather(state["exp_avg_sq"], source, grown, v_seed)
    elif isinstance(opt, SM3):
        if "momentum_buffer" in state:
            _regather(state["momentum_buffer"], source, grown, None)
    elif isinstance(opt, torch.optim.SGD):
        if state.get("momentum_buffer") is not None:
            _regather(state["momentum_buffer"], source, grown, None)
