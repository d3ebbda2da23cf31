r"""AdamW with a per-element age in its bias correction (thesis §7.3.1), as the authors' released SpIEL code runs it.

SpIEL grows weights at different times, so a single step count cannot correct every slot's moments for their bias
towards zero: "we track the age of each weight (i.e. the number of steps since it was last grown) individually, and
use it to calculate the appropriate bias correction" (§7.3.1). Each element keeps an age a (1 at its first step) in
``state["age"]``:

.. math::
    m \leftarrow \beta_1 m + (1-\beta_1) g, \qquad v \leftarrow \beta_2 v + (1-\beta_2) g^2, \qquad
    p \leftarrow p - \mathrm{lr}\, \frac{m}{(\sqrt{v} + \epsilon)\,(1-\beta_1^{a}) / \sqrt{1-\beta_2^{a}}}, \qquad
    p \leftarrow p - \mathrm{lr}\,\lambda\, p, \qquad a \leftarrow a + 1

which is the released optimizer's update: ε is added before the bias correction (Kingma and Ba's efficient form,
where ``torch.optim.AdamW`` adds it after) and the decoupled weight decay λ applies after the step (where
``torch.optim.AdamW`` applies it before). A SpIEL reselection with ``reference="authors"`` seeds a grown slot's
moments from its estimation window and sets its age to the window's length
(:func:`peft_sparse.optim.surgery.seed_optimizer_states`); a slot grown without seeds starts at age 1.
Memory: three floats per trainable element (Adam's two and the age).
"""

from __future__ import annotations

import torch


class AgedAdamW(torch.optim.Optimizer):
    """AdamW whose bias correction uses each element's own age (module docstring). Pass it to the Trainer with
    ``optimizer_cls_and_kwargs=(peft_sparse.AgedAdamW, {"lr": ..., "weight_decay": ...})``."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        if not 0.0 <= lr:
            raise ValueError(f"lr must be >= 0, got lr={lr!r}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must lie in [0, 1), got betas={tuple(betas)!r}")
        if not 0.0 <= eps:
            raise ValueError(f"eps must be >= 0, got eps={eps!r}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay must be >= 0, got weight_decay={weight_decay!r}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AgedAdamW does not take sparse gradients")
                state = self.state[p]
                if not state:
                    state["age"] = torch.ones_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                age, exp_avg, exp_avg_sq = state["age"], state["exp_avg"], state["exp_avg_sq"]
                grad = p.grad.to(exp_avg.dtype)
                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                denom = exp_avg_sq.sqrt().add_(eps)
                denom.mul_((1.0 - beta1**age).to(denom.dtype))  # per-element bias corrections
                denom.div_(torch.sqrt(1.0 - beta2**age).to(denom.dtype))
                p.addcdiv_(exp_avg.to(p.dtype), denom.to(p.dtype), value=-lr)
                if decay > 0.0:
                    p.add_(p, alpha=-lr * decay)
                age += 1
        return loss
