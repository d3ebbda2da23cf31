"""Adam moments of grown slots, seeded from the window's statistics at the next optimizer step (§7.3.1)."""

from __future__ import annotations

import torch

from ...accel import internals
from ...optim.surgery import seed_optimizer_states
from .statistics import distributed


class DeferredSeeding:
    """Seeds the optimizer moments of grown slots at the *next* optimizer step, in that step's gradient units.

    The window statistics ĝ, ŝ come from raw backward gradients, but the training loop may rescale
    gradients before the optimizer sees them: the Trainer clips the global norm to ``max_grad_norm``
    and fp16 training removes a loss scale. Right after a reselection the values sit exactly where
    the gradient is largest, so clipping shrinks the next gradients far more than those of the window;
    raw-scale seeds would then outweigh the gradients Adam actually receives for dozens of steps
    and drive the new weights too far. So the seeds are written just before the next optimizer step
    (a step pre-hook), scaled by that step's factor c = ‖g_seen‖/‖g_raw‖ over the adapter's values:
    ‖g_raw‖ is read by post-accumulate hooks after each backward, ‖g_seen‖ when the step starts.
    Without rescaling c is exactly 1 and the seeds are exactly ĝ·(1−β₁ᵗ) and ŝ·(1−β₂ᵗ).

    ``reference='authors'`` seeds both moments at once, at scale 1, each slot's age set to the window's length
    (:meth:`apply_now` right after the reselection): the released code writes its seeds when it reselects, from the
    raw window statistics, into an optimizer that corrects each slot by its own age.
    """

    def __init__(self, optimizer, params: list, first_moment: bool = True):
        self.optimizer = optimizer
        self.first_moment = first_moment  # False: only the second moment is seeded
        self.params = params
        # id(param) → (grown slots, ĝ, ŝ, the steps they stand for) waiting for the next step
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = {}
        self.raw: dict = {}  # after a backward: the ids of the parameters with gradients and Σ‖g‖²
        self.last_factor = None  # c of the last seeding (a float, or a device scalar)
        self._queued = False
        self._handles = [p.register_post_accumulate_grad_hook(self._after_backward) for p in params]
        self._handles.append(optimizer.register_step_pre_hook(self._before_step))

    def _after_backward(self, param) -> None:
        if not self.pending or param.grad is None or self._queued:
            return
        # Read every gradient norm once the backward pass is over, in one multi-tensor reduction. Under
        # DDP the local gradient is averaged over ranks only when the backward pass finishes (DDP queues
        # that as an end-of-backward callback), so every rank measures the same averaged gradient: a
        # callback queued now runs before DDP's, so it queues a second one, which runs after.
        queued = internals.queue_after_backward(
            (lambda: internals.queue_after_backward(self._read_raw)) if distributed() else self._read_raw
        )
        if queued:
            self._queued = True
            return
        # no end-of-backward callbacks in this torch: read this gradient now, as it stands after its last
        # accumulation (exact in one process; under DDP, the rank's own gradient before averaging)
        if not self.raw or id(param) in self.raw["ids"]:
            self.raw = {"ids": set(), "total": None, "each": {}}
        self.raw["ids"].add(id(param))
        self.raw["each"][id(param)] = _squared_norm([param])
        self.raw["total"] = torch.stack(list(self.raw["each"].values())).sum()

    def _read_raw(self) -> None:
        self._queued = False
        with_grad = [p for p in self.params if p.grad is not None]
        self.raw = {"ids": {id(p) for p in with_grad}, "total": _squared_norm(with_grad)}

    def factor(self):
        """c: 1.0, or a float64 device scalar (computed without waiting for the device)."""
        if not self.raw:
            return 1.0
        seen = [p for p in self.params if id(p) in self.raw["ids"] and p.grad is not None]
        # the same reduction as the raw norms, so that no rescaling gives exactly 1
        raw = self.raw["total"]
        seen = _squared_norm(seen).to(raw.device)
        return torch.where((raw == seen) | (raw == 0.0), 1.0, torch.sqrt(seen / torch.where(raw == 0.0, 1.0, raw)))

    @torch.no_grad()
    def _before_step(self, optimizer, args, kwargs) -> None:
        if not self.pending:
            return
        c = self.factor()
        params = [p for p in self.params if id(p) in self.pending]
        entries = [self.pending[id(p)] for p in params]
        seed_optimizer_states(self.optimizer, params, [e[0] for e in entries], [e[1] for e in entries],
                              [e[2] for e in entries], scale=c, first=self.first_moment, ages=[e[3] for e in entries])  # fmt: skip
        self.pending, self.raw, self.last_factor = {}, {}, c

    def apply_now(self) -> None:
        """Seed the pending slots at once, at scale 1 (under DeepSpeed ZeRO, whose step runs no torch optimizer
        hooks and frees the gradients as it reduces them, so the next step's clip factor cannot be observed)."""
        self.raw = {}
        self._before_step(self.optimizer, (), {})

    def rehook(self) -> None:
        """Register the post-accumulate hooks again (after the values were resized: hooks stay with the old tensors)."""
        for handle in self._handles[:-1]:
            handle.remove()
        self._handles = [p.register_post_accumulate_grad_hook(self._after_backward) for p in self.params] + self._handles[-1:]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _squared_norm(params: list) -> torch.Tensor:
    """Σ‖grad‖² over ``params`` (float64, on the first one's device) by one multi-tensor norm per device."""
    if not params:
        return torch.zeros((), dtype=torch.float64)
    device = params[0].grad.device
    grads = [p.grad.detach() if p.grad.dtype in (torch.float32, torch.float64) else p.grad.detach().float() for p in params]
    norms = torch._foreach_norm(grads)
    if all(n.device == device for n in norms):  # (stacked, then widened: the same float64 values, two launches)
        return torch.stack(norms).to(torch.float64).square().sum()
    return torch.stack([n.to(device=device, dtype=torch.float64) for n in norms]).square().sum()
