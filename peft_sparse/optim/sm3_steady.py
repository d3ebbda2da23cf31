"""SM3's steady step: the decisions of a full fused step, repeated while they hold (a fast path of
:class:`peft_sparse.optim.SM3` on CUDA)."""

from __future__ import annotations

import itertools
import weakref

import torch

from ..accel import internals
from ..core.kernels import increment_versions, on_device
from ..core.owners import sparse_owner


class _SteadyStep:
    """The decisions of a full :class:`SM3` step in which every parameter was a CUDA sparse values tensor
    on the fused path, repeated by the next steps while each of them still holds — the host time of
    an optimizer step bounds a training step when kernels are short, and the full step looks up every
    parameter's layer, layout and launch group again.

    Before anything is written, :meth:`run` checks for every parameter, in the optimizer's order: the
    same parameter objects in the same groups (same momentum, eps and weight decay; the members of a
    launch still sharing one lr), the same state dict with the accumulators the last step left there,
    its momentum buffer and step counter (and the buffers' addresses, which the kept plans hold); a dense
    gradient of the same dtype; the parameter still its
    layer's values for the adapter, with the same indices tensor, version counter, address and size
    (a reselection rewrites the indices in place, moving the version on), and its own address and size.
    Anything else takes the full step (:meth:`SM3._leave_steady`). The two sets of accumulator buffers
    alternate, as in the full step, and each set keeps its launch plan. Holds the layers by weak
    reference only."""

    __slots__ = ("state", "groups", "entries", "params", "states", "steps", "launches", "sets", "addresses", "copies", "decays", "plans", "parity")

    @classmethod
    def after(cls, opt, items: list, launches: list, steps: list) -> "_SteadyStep":
        """The memo of the full step that just ran ``items`` ((param, state, layout, group), every
        parameter of every group, in order) in ``launches`` (``_fused_steps``' result)."""
        self = cls()
        self.state = opt.state
        self.steps = steps = cls._joined_counters(items, steps)
        self.groups = [(g, g["params"], len(g["params"]), g["momentum"], g["eps"], g["weight_decay"], g["beta2"]) for g in opt.param_groups]
        self.entries = []
        for param, state, (indices, _, _, _), _ in items:
            layer, adapter = sparse_owner(param)
            self.entries.append((param, state, weakref.ref(layer), adapter, indices, internals.version(indices), indices.data_ptr(),
                                 indices.numel(), param.data_ptr(), param.numel(), param.grad.dtype, state.get("momentum_buffer"),
                                 state["momentum_buffer"].data_ptr() if "momentum_buffer" in state else None, state["step"]))  # fmt: skip
        self.params = [item[0] for item in items]
        self.states = [item[1] for item in items]
        # set 0: the accumulators now in the states (the next step's previous ones); set 1: the scratch buffers
        self.sets = ([(s["row_accumulator"], s["col_accumulator"]) for s in self.states], [opt._scratch[p] for p in self.params])
        # the kept plans point at these buffers (and the momentum buffers): their addresses are checked too
        self.addresses = [[(r.data_ptr(), c.data_ptr()) for r, c in self.sets[k]] for k in (0, 1)]
        self.copies = [([b for pair in self.sets[1 - k] for b in pair], [a for pair in self.sets[k] for a in pair]) for k in (0, 1)]
        # parity k: the buffers of set 1 − k that the moving-average form scales by β₂ after the copy, per β₂
        self.decays = [{}, {}]
        for key, positions in launches:
            if key[11] is not None:
                for k in (0, 1):
                    self.decays[k].setdefault(key[11], []).extend(b for j in positions for b in self.sets[1 - k][j])
        self.launches = []
        for key, positions in launches:
            members = [items[k] for k in positions]
            # parity k: set k holds the previous accumulators, set 1 − k receives the updated ones
            lists = [opt._launch_lists(members, [self.sets[k][j] for j in positions], [self.sets[1 - k][j] for j in positions])
                     for k in (0, 1)]  # fmt: skip
            groups = list({id(m[3]): m[3] for m in members}.values())
            layouts = [lay[3] for _, _, lay, _ in members] if key[6] is not None else None
            self.launches.append((key, positions, groups, lists, layouts))
        self.plans = [[None, None] for _ in self.launches]
        self.parity = 0
        return self

    @staticmethod
    def _joined_counters(items: list, steps: list):
        """The parameters' step counters made views of one tensor (each state's ``"step"`` replaced by its
        view, same value, the first time), which the steady step increments with one addition — torch adds
        to a list of CPU scalars one tensor at a time, microseconds each; the list itself where the
        counters are not all 0-dim tensors of one dtype and device. Counters that already are such views,
        in order, keep their tensors."""
        first = steps[0] if steps else None
        if first is None or any(
            s.dim() != 0 or s.dtype != first.dtype or s.device != first.device or s.requires_grad for s in steps
        ) or len(steps) != len(items):  # fmt: skip
            return steps
        base = first._base
        if base is not None and base.dim() == 1 and base.numel() == len(steps) and base.dtype == first.dtype:
            start, step = base.data_ptr(), base.stride(0) * base.element_size()
            if all(s._base is base and s.data_ptr() == start + k * step for k, s in enumerate(steps)):
                return base  # (joined by an earlier steady step: the states keep the tensors they hold)
        joined = torch.stack(steps)
        for (_, state, _, _), view in zip(items, joined.unbind()):
            state["step"] = view
        return joined

    def run(self, opt) -> bool:
        """The step, when every decision still holds (True); else nothing is done (False)."""
        if opt.state is not self.state or len(opt.param_groups) != len(self.groups):
            return False
        for group, (g, params, n, momentum, eps, wd, beta2) in zip(opt.param_groups, self.groups):
            if (group is not g or group["params"] is not params or len(params) != n or group["momentum"] != momentum
                    or group["eps"] != eps or group["weight_decay"] != wd or group.get("beta2") != beta2):  # fmt: skip
                return False
        old = self.sets[self.parity]
        state_of = opt.state.get
        grads = []
        members = itertools.chain.from_iterable(g[1] for g in self.groups)
        for p, entry, (row, col), (row_ptr, col_ptr) in zip(members, self.entries, old, self.addresses[self.parity]):
            param, state, layer_ref, adapter, indices, version, indices_ptr, indices_numel, ptr, numel, grad_dtype, mom, mom_ptr, step = entry
            grad = p.grad
            if (
                p is not param or grad is None or grad.dtype is not grad_dtype or grad.is_sparse or state_of(p) is not state
                or state["row_accumulator"] is not row or state["col_accumulator"] is not col
                or state.get("momentum_buffer") is not mom or state["step"] is not step
                or row.data_ptr() != row_ptr or col.data_ptr() != col_ptr or (mom is not None and mom.data_ptr() != mom_ptr)
            ):  # fmt: skip
                return False
            layer = layer_ref()
            if layer is None:
                return False
            modules = layer._modules
            if (
                modules["sparse_values"]._parameters.get(adapter) is not p or modules["sparse_indices"]._buffers.get(adapter) is not indices
                or internals.version(indices) != version or indices.data_ptr() != indices_ptr or indices.numel() != indices_numel
                or p.data_ptr() != ptr or p.numel() != numel
            ):  # fmt: skip
                return False
            grads.append(grad)
        for _, _, groups, _, _ in self.launches:
            if len(groups) > 1 and any(g["lr"] != groups[0]["lr"] for g in groups):
                return False
        # every decision holds: the full step's work, without its lookups
        if type(self.steps) is list:
            torch._foreach_add_(self.steps, 1)
        else:
            self.steps.add_(1)
        torch._foreach_copy_(*self.copies[self.parity])
        for beta2, tensors in self.decays[self.parity].items():
            torch._foreach_mul_(tensors, beta2)
        for (key, positions, groups, lists, layouts), plans in zip(self.launches, self.plans):
            group_grads = grads if len(positions) == len(grads) else [grads[k] for k in positions]
            hyper = (groups[0]["lr"], *key[8:])
            step = int(self.states[positions[0]]["step"]) if key[11] is not None else 0  # (bias correction: after the count)
            plan = plans[self.parity]
            if plan is None:
                plan = plans[self.parity] = opt._launch(key[:7] + hyper, self.params[positions[0]], lists[self.parity], group_grads, layouts, step)
            else:
                with on_device(self.params[positions[0]]):
                    plan(group_grads, *hyper, step)
        increment_versions(self.params)  # written by the kernel: as an in-place op would mark them
        for state, (row, col) in zip(self.states, self.sets[1 - self.parity]):
            state["row_accumulator"], state["col_accumulator"] = row, col
        self.parity = 1 - self.parity
        return True

    def hand_back_scratch(self, scratch: dict) -> None:
        """Leave in ``scratch`` the buffers the full step expects there (the set not in the states)."""
        for param, pair in zip(self.params, self.sets[1 - self.parity]):
            scratch[param] = pair
