r"""SM3-II (Anil et al., 2019) over sparse values, with row and column accumulators of the full shape.

For the values φ of a sparse adapter on an (out, in) matrix, with φ_j at row r_j and column c_j:

.. math::
    \nu_j = \min(R_{r_j}, C_{c_j}) + g_j^2, \qquad
    R_i \leftarrow \max(R_i, \max_{j: r_j = i} \nu_j), \quad C_k \leftarrow \max(C_k, \max_{j: c_j = k} \nu_j),
    \qquad \phi_j \leftarrow \phi_j - \mathrm{lr}\, g_j / \sqrt{\nu_j}

The accumulators R (out) and C (in) cover the *whole* matrix, not only the active entries, so they
survive SpIEL reselections unchanged and give SpIEL-MA its growth score √⁴(R_i·C_k) (thesis Eq. 7.7).
Memory: out + in floats per matrix (plus d_φ with momentum), against Adam's 2·d_φ.

``beta2=None`` (the default) is the definition above: sums, so the steps shrink as 1/√t. ``beta2`` in (0, 1) is
SM3's moving-average form: ν_j = β₂·min(R_{r_j}, C_{c_j}) + (1 − β₂)·g_j², R and C decay by β₂ before taking their
maxima (the inactive entries of a row, with g = 0, would have ν = β₂·min(R, C)), and the step is
lr·g_j/√(ν_j/(1 − β₂ᵗ)), bias-corrected as Adam's. Same memory.

On CUDA the sparse step is one fused Triton kernel for all sparse values tensors of a parameter group
(accumulators updated with atomic max into copies of the previous ones, so the result equals the
sequential definition); elsewhere it runs as torch operations. When every parameter took that launch,
the next steps repeat its decisions (launch groups, plans, buffers) after checking that each still
holds, without looking up every parameter's layer and layout again (``_SteadyStep``). Dense parameters (e.g. ``modules_to_save``) get the same SM3-II with one accumulator per row and
column (2-D; higher ranks are viewed as (first dim, rest)) or a plain Adagrad accumulator (1-D).
Weight decay is decoupled (AdamW-style): φ ← φ·(1 − lr·λ).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..core import dispatch
from ..core.kernels import on_device, rows_cols
from ..core.owners import sparse_owner
from .sm3_steady import _SteadyStep


_FUSED = []


def _fused_kernel():
    """The fused Triton step for CUDA sparse values, :class:`~peft_sparse.accel.triton_kernels.MultiSM3`
    (None without Triton)."""
    if not _FUSED:
        try:
            from ..accel.triton_kernels import MultiSM3, sm3_block_shape_supported
        except ImportError:
            MultiSM3 = sm3_block_shape_supported = None
        _FUSED.extend((MultiSM3, sm3_block_shape_supported))
    return _FUSED[0]


def _fused_device(param: torch.Tensor) -> bool:
    """Whether ``param`` lives where the fused step runs (CUDA, with Triton)."""
    return param.is_cuda and dispatch.ON and _fused_kernel() is not None


def _block_kernel_takes(block_shape) -> bool:
    """Whether the fused step takes adapters of these blocks one program per block."""
    _fused_kernel()
    return len(_FUSED) == 2 and _FUSED[1] is not None and _FUSED[1](block_shape)


_PLANS_KEPT = 4  # launch plans kept per group: the accumulators alternate between two sets of buffers


def _accumulated(previous: torch.Tensor, grad_sq: torch.Tensor, beta2: Optional[float]) -> torch.Tensor:
    """ν from the covering accumulator value(s) ``previous`` (a fresh tensor, written in place) and g²: the sum
    previous + g², or with ``beta2`` the moving average β₂·previous + (1 − β₂)·g²."""
    if beta2 is None:
        return previous.add_(grad_sq)
    return previous.mul_(beta2).add_((1 - beta2) * grad_sq)


def accumulate_sparse(
    row_acc: torch.Tensor, col_acc: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, grad: torch.Tensor, beta2: Optional[float] = None
) -> torch.Tensor:
    """SM3-II's accumulator update for sparse values at (rows, cols): ν = min(R_rows, C_cols) + g², then R and C
    take the maximum ν of each row and column, in place; returns ν. With ``beta2`` (SM3's moving-average form):
    ν = β₂·min(R_rows, C_cols) + (1 − β₂)·g², and R, C decay by β₂ before taking the maxima. (Also SpIEL-MA's
    statistics beside other optimizers: :class:`peft_sparse.methods.spiel.statistics.RowColumnAccumulators`.)"""
    # (index_select: the same gather as row_acc[rows], with a few times less host work)
    nu = _accumulated(torch.minimum(row_acc.index_select(0, rows), col_acc.index_select(0, cols)), grad * grad, beta2)
    if beta2 is not None:
        row_acc.mul_(beta2)
        col_acc.mul_(beta2)
    row_acc.scatter_reduce_(0, rows, nu, reduce="amax", include_self=True)
    col_acc.scatter_reduce_(0, cols, nu, reduce="amax", include_self=True)
    return nu


class SM3(torch.optim.Optimizer):
    def __init__(
        self, params, lr: float = 1e-3, momentum: float = 0.0, eps: float = 1e-30, weight_decay: float = 0.0, beta2: Optional[float] = None
    ):
        if not lr > 0.0:
            raise ValueError(f"SM3: lr must be positive, got lr={lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"SM3: momentum must be in [0, 1), got momentum={momentum}")
        if not eps >= 0.0:
            raise ValueError(f"SM3: eps must be non-negative, got eps={eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"SM3: weight_decay must be non-negative, got weight_decay={weight_decay}")
        if beta2 is not None and (isinstance(beta2, bool) or not isinstance(beta2, (int, float)) or not 0.0 < beta2 < 1.0):
            raise ValueError(f"SM3: beta2 must be None (sums of squared gradients) or in (0, 1), got beta2={beta2!r}")
        super().__init__(params, dict(lr=lr, momentum=momentum, eps=eps, weight_decay=weight_decay, beta2=beta2))
        # param → (row, col) buffers of the accumulators' shapes that the fused step writes into (swapped
        # with the accumulators afterwards); not state: they hold nothing between steps
        self._scratch: dict = {}
        # launch plans of the multi-tensor step (address tables), per group of element types
        self._plans: dict = {}
        # the decisions of the last full step, repeated while they hold (see _SteadyStep)
        self._steady: Optional[_SteadyStep] = None

    def __setstate__(self, state: dict) -> None:
        # a copy (copy.deepcopy, pickling) carries defaults, state and groups only: no buffers, plans or memo
        super().__setstate__(state)
        self._scratch, self._plans, self._steady = {}, {}, None

    @staticmethod
    def sparse_layout(param: torch.Tensor, blocks: bool = False):
        """(indices, out_features, in_features) of a sparse values parameter, or None for a dense one.
        ``blocks``: with a fourth entry, the adapter's block layout where the fused CUDA step takes its
        blocks one program each (see ``MultiSM3``), else None."""
        owner = sparse_owner(param)
        if owner is None:
            return None
        layer, adapter = owner
        layout = (layer._modules["sparse_indices"]._buffers[adapter], layer.out_features, layer.in_features)
        if not blocks:
            return layout
        shape = layer.block_shape.get(adapter, (1, 1))
        if shape[0] * shape[1] == 1 or not _block_kernel_takes(shape):
            return (*layout, None)
        return (*layout, layer.block_metadata(adapter))

    _ACCUMULATOR_KEYS = ("row_accumulator", "col_accumulator", "accumulator", "momentum_buffer")

    def load_state_dict(self, state_dict: dict) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, except that the accumulators and momentum keep
        their float32 precision over 16-bit parameters (torch casts every floating state tensor to its
        parameter's dtype, which would round them to bfloat16). The tensors are copies: nothing is shared
        with ``state_dict``."""
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        kept = {}
        for pid, param in zip(saved_ids, params):
            entry = state_dict["state"].get(pid, {})
            kept[param] = {k: v for k, v in entry.items() if k in self._ACCUMULATOR_KEYS and isinstance(v, torch.Tensor)}
        super().load_state_dict(state_dict)
        for param, tensors in kept.items():
            for key, value in tensors.items():
                dtype = torch.float32 if param.dtype in (torch.float16, torch.bfloat16) and value.is_floating_point() else None
                self.state[param][key] = value.to(device=param.device, dtype=dtype or value.dtype, copy=True)
        self._scratch = {}  # buffers of the previous state's shapes and identities
        self._steady = None

    def _init_state(self, param, state, layout, momentum: float):
        state["step"] = torch.zeros((), dtype=torch.float32)
        acc_dtype = torch.float32 if param.dtype in (torch.float16, torch.bfloat16) else param.dtype
        if layout is not None:
            out_features, in_features = layout[1], layout[2]
            state["row_accumulator"] = torch.zeros(out_features, dtype=acc_dtype, device=param.device)
            state["col_accumulator"] = torch.zeros(in_features, dtype=acc_dtype, device=param.device)
        elif param.dim() >= 2:
            state["row_accumulator"] = torch.zeros(param.shape[0], dtype=acc_dtype, device=param.device)
            state["col_accumulator"] = torch.zeros(param[0].numel(), dtype=acc_dtype, device=param.device)
        else:
            state["accumulator"] = torch.zeros_like(param, dtype=acc_dtype)
        if momentum > 0:
            state["momentum_buffer"] = torch.zeros_like(param, dtype=acc_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        steady = self._steady
        if steady is not None:
            if dispatch.ON and steady.run(self):
                return loss
            self._leave_steady()
        on_fused = []  # CUDA sparse values: one Triton launch each, after one multi-tensor copy of the accumulators
        steps = []
        every_param_fused = True
        for group in self.param_groups:
            lr, momentum, eps, wd = group["lr"], group["momentum"], group["eps"], group["weight_decay"]
            beta2 = group.setdefault("beta2", None)  # (groups of a state saved before beta2 existed: the sums)
            for param in group["params"]:
                if param.grad is None:
                    every_param_fused = False
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("SM3 does not take torch sparse gradients; sparse values have dense grads")
                state = self.state[param]
                fused = _fused_device(param)
                layout = self.sparse_layout(param, blocks=fused)
                if not state:
                    self._init_state(param, state, layout, momentum)
                steps.append(state["step"])
                if layout is not None and fused:
                    on_fused.append((param, state, layout, group))
                    continue
                every_param_fused = False
                self._torch_step(param, state, layout, lr, momentum, eps, wd, beta2)
        if steps:
            torch._foreach_add_(steps, 1)
        if on_fused:
            launches = self._fused_steps(on_fused)
            if every_param_fused:
                self._steady = _SteadyStep.after(self, on_fused, launches, steps)
        return loss

    def forget_layouts(self) -> None:
        """Drop the launch plans, scratch buffers and steady-step memo built over the parameters' current
        sizes (called when sparse values are resized in place)."""
        self._leave_steady()
        self._plans, self._scratch = {}, {}

    def _leave_steady(self) -> None:
        """Forget the steady step, leaving the scratch buffers where the full step expects them."""
        steady, self._steady = self._steady, None
        if steady is not None:
            steady.hand_back_scratch(self._scratch)

    def _fused_steps(self, items) -> list:
        """One multi-tensor Triton launch per group of values with the same hyper-parameters, device
        and element types (usually one for the whole model), after one multi-tensor copy of the
        accumulators into the buffers the updated ones go to (scaled by β₂ in the moving-average form, whose launches
        also hold one step count each). Returns the launch groups: (key, positions of their members in ``items``) each."""
        scratch = self._scratch
        accumulators, buffers, decayed = [], [], {}
        groups: dict = {}
        for position, item in enumerate(items):
            param, state, (indices, _, _, blocks), group = item
            pair = scratch.get(param)
            acc = (state["row_accumulator"], state["col_accumulator"])
            if pair is None or any(
                b is a or b.shape != a.shape or b.dtype != a.dtype or b.device != a.device for a, b in zip(acc, pair)
            ):  # (b is a: a state loaded from this very dict, whose accumulator is now the scratch buffer too)
                pair = scratch[param] = (torch.empty_like(acc[0]), torch.empty_like(acc[1]))
            accumulators.extend(acc)
            buffers.extend(pair)
            beta2 = group["beta2"]
            if beta2 is not None:
                decayed.setdefault(beta2, []).extend(pair)
            mom = state.get("momentum_buffer")
            key = (param.device, param.dtype, param.grad.dtype, indices.dtype, acc[0].dtype, mom.dtype if mom is not None else None,
                   blocks.block_shape if blocks is not None else None,
                   group["lr"], group["momentum"], group["eps"], group["weight_decay"], beta2)  # fmt: skip
            # (the moving average's bias correction depends on the step: members of one launch share it)
            step = int(state["step"]) if beta2 is not None else 0
            groups.setdefault((key, step), []).append(position)
        torch._foreach_copy_(buffers, accumulators)
        for beta2, tensors in decayed.items():
            torch._foreach_mul_(tensors, beta2)
        for (key, step), positions in groups.items():
            members = [items[k] for k in positions]
            old = [(s["row_accumulator"], s["col_accumulator"]) for _, s, _, _ in members]
            lists = self._launch_lists(members, old, [scratch[p] for p, *_ in members])
            self._launch(key, members[0][0], lists, [p.grad for p, *_ in members], [lay[3] for _, _, lay, _ in members], step)
            for param, state, _, _ in members:
                torch.autograd.graph.increment_version(param)  # written by the kernel: as an in-place op would mark it
                # the updated copies become the accumulators; the previous ones are next step's scratch
                row_new, col_new = scratch[param]
                scratch[param] = (state["row_accumulator"], state["col_accumulator"])
                state["row_accumulator"], state["col_accumulator"] = row_new, col_new
        return [(key, positions) for (key, _), positions in groups.items()]

    @staticmethod
    def _launch_lists(members, old_pairs, new_pairs) -> tuple:
        """``MultiSM3``'s per-tensor lists but the gradients: values, indices, in_features, the previous
        (row, col) accumulators (``old_pairs``), the buffers the updated ones go to (``new_pairs``),
        momentum buffers."""
        return (
            [p for p, _, _, _ in members], [lay[0] for _, _, lay, _ in members], [lay[2] for _, _, lay, _ in members],
            [pair[0] for pair in old_pairs], [pair[1] for pair in old_pairs],
            [pair[0] for pair in new_pairs], [pair[1] for pair in new_pairs], [s.get("momentum_buffer") for _, s, _, _ in members],
        )  # fmt: skip

    def _launch(self, key, first, lists, grads, layouts, step: int = 0):
        """One ``MultiSM3`` launch of a group (``key``: see ``_fused_steps``) at optimizer step ``step`` (read with
        β₂ only) from its kept plan; returns the plan."""
        MultiSM3 = _fused_kernel()
        values, indices, in_features, *accumulators_and_moms = lists
        if key[6] is None:
            layouts = None
        # plans per launch group (its members, not its lr, which schedules change); each alternates
        # between two sets of accumulator buffers (and block adapters' plans hold their layouts)
        plans = self._plans.setdefault(key[:7] + key[8:] + (tuple(id(p) for p in values),), {})
        ptrs = MultiSM3.key_of(values, indices, in_features, *accumulators_and_moms)
        plan = plans.get(ptrs)
        with on_device(first):
            if plan is None or not plan.holds(layouts):
                while len(plans) >= _PLANS_KEPT:
                    plans.pop(next(iter(plans)))
                plan = plans[ptrs] = MultiSM3(values, grads, indices, in_features, *accumulators_and_moms, layouts=layouts)
            plan(grads, *key[7:], step)
        return plan

    @staticmethod
    def _torch_step(param, state, layout, lr, momentum, eps, wd, beta2=None) -> None:
        acc_dtype = (state.get("accumulator") if "accumulator" in state else state["row_accumulator"]).dtype
        grad = param.grad.to(acc_dtype)
        if layout is not None:
            indices, in_features = layout[0], layout[2]
            rows, cols = rows_cols(indices, in_features)
            nu = accumulate_sparse(state["row_accumulator"], state["col_accumulator"], rows, cols, grad, beta2)  # (d_φ,)
        elif "accumulator" in state:
            nu = _accumulated(state["accumulator"], grad * grad, beta2)
        else:
            row_acc, col_acc = state["row_accumulator"], state["col_accumulator"]
            g2 = grad.reshape(row_acc.numel(), col_acc.numel())
            nu = _accumulated(torch.minimum(row_acc[:, None], col_acc[None, :]), g2 * g2, beta2)  # (rows, cols)
            if beta2 is not None:
                row_acc.mul_(beta2)
                col_acc.mul_(beta2)
            torch.maximum(row_acc, nu.amax(dim=1), out=row_acc)
            torch.maximum(col_acc, nu.amax(dim=0), out=col_acc)
            nu = nu.view_as(grad)
        if beta2 is not None:  # the moving average's bias correction, 1 / (1 − β₂ᵗ) at this step t (counted after it)
            nu = nu * (1.0 / (1.0 - beta2 ** (float(state["step"]) + 1)))
        update = grad / nu.add(eps).sqrt()
        if momentum > 0:
            buf = state["momentum_buffer"]
            buf.mul_(momentum).add_(update, alpha=1 - momentum)
            update = buf
        if wd:
            param.mul_(1 - lr * wd)
        param.add_(update.to(param.dtype), alpha=-lr)
