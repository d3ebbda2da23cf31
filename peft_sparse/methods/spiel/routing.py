"""SpIEL on the experts of a mixture-of-experts model: the no-token rule.

Each expert of a fused expert tensor is a tensor of its own to SpIEL (:mod:`peft_sparse.core.experts`): its own
budget, its own AG candidates, its own MA row and column statistics. Its gradient comes only from the tokens the
router sent to it, so an expert that received none since its statistics started has no information at all:

* AG: its candidates' accumulated gradients are all exactly 0, so its "largest" candidates are ties broken by
  position, and a reselection would drop its k smallest |φ| for them;
* MA: its row and column accumulators did not move since the previous reselection, so growth would rank by the
  same scores as then, typically growing back the weights just dropped — at value 0, losing what they had learned.

**Rule.** An expert that received no token in the window — AG: the gradient-estimation window; MA: the steps since
the previous reselection — keeps its indices, values and optimizer state at that reselection (with
``budget_split='adaptive'``: none of its weights is dropped and none of its candidates grows). An expert that
received a few tokens is reselected as usual: its candidates and accumulators rank weights within that expert
only (each expert has its own budget), so their smaller scale does not count against it.

The tokens are counted from the routing indices the experts module receives (``top_k_index`` in transformers 5),
on the device, and read once per reselection; across processes they are summed first, so every rank skips the
same experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...core.experts import SparseParameter


class RoutedTokens:
    """The tokens routed to each expert slice among ``layers`` (a scheduler's), counted by their wrappers."""

    def __init__(self, model, layers: list):
        mine = {id(layer) for layer in layers}
        self.wrappers = []  # wrappers of 3-D parameters with a slice among the layers
        for module in model.modules():
            if isinstance(module, SparseParameter) and any(id(s) in mine for s in module.slices):
                if module.owner()._parameters[module.parameter_name].dim() == 3:
                    self.wrappers.append(module)

    def start(self) -> None:
        """Count from zero (a window opens, or a reselection is done)."""
        for wrapper in self.wrappers:
            wrapper.count_routed_tokens()

    def stop(self) -> None:
        for wrapper in self.wrappers:
            wrapper.routed_tokens = None

    def idle(self) -> set:
        """Module names of the expert slices no token reached since :meth:`start` (one read of the device)."""
        counting = [w for w in self.wrappers if w.routed_tokens is not None]
        if not counting:
            return set()
        counts = torch.cat([w.routed_tokens.to(counting[0].routed_tokens.device) for w in counting])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        counts = counts.tolist()
        idle, at = set(), 0
        for wrapper in counting:
            for layer in wrapper.slices:
                if counts[at] == 0:
                    idle.add(layer.module_name)
                at += 1
        return idle

    def tensors(self) -> dict:
        return {w.key: {"counts": w.routed_tokens} for w in self.wrappers if w.routed_tokens is not None}

    def load(self, saved: dict) -> None:
        for wrapper in self.wrappers:
            if wrapper.key in saved:
                wrapper.routed_tokens = saved[wrapper.key]["counts"].to(wrapper.owner()._parameters[wrapper.parameter_name].device, copy=True)
