"""SpIEL-AG's gradient-estimation window: growth candidates and their gradient sums (Eq. 7.5); SpIEL-MA's row and
column accumulators when the optimizer is not SM3 (:class:`RowColumnAccumulators`), and its window of input/output
statistics (:class:`InputOutputStatistics`, ``ma_signal='io'``)."""

from __future__ import annotations

from typing import Callable, ClassVar, Optional

import torch
import torch.distributed as dist

from ...accel import internals
from ...core import kernels
from ...core.base import index_dtype
from ...core.layer import SparseLayer
from ...core.selection import BlockGrid
from ...optim.sm3 import accumulate_sparse


# ------------------------------------------------------------------------------------------- scheduler
def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class _WindowStatistics:
    """Growth candidates of one tensor and their gradient sums over an estimation window (AG)."""

    def __init__(self, num_candidate_units: int, grid: BlockGrid, dtype: torch.dtype = torch.float32, normalize: str = "none",
                 micro_batches: bool = False):
        self.num_candidate_units = num_candidate_units
        # micro_batches (reference='authors'): Σg² over micro-batches, not optimizer steps, and their count
        # (the released trainer's samples), so that its seeds ĝ = Σg/n, ŝ = Σg²/n average micro-batches; on several
        # processes each micro-batch's gradients are averaged over the ranks first (one process's view of it)
        self.micro_batches = micro_batches
        self.samples = 0
        self.step_sq: Optional[torch.Tensor] = None  # Σ over this step's micro-batches of g² (micro_batches)
        self.normalize = normalize  # "column": scores divided by their column's RMS gradient (first micro-batch)
        self.col_scale: Optional[torch.Tensor] = None  # (in_features,) with normalize="column"
        self.grid = grid
        self.dtype = dtype  # float32, or float64 over float64 values
        self.candidates: Optional[torch.Tensor] = None  # ascending flat indices
        self.candidate_units: Optional[torch.Tensor] = None  # ascending blocks (weights when unstructured)
        self.step_sum: Optional[torch.Tensor] = None  # Σ over this step's micro-batches
        self.grad_sum: Optional[torch.Tensor] = None  # Σ_steps g
        self.grad_sq_sum: Optional[torch.Tensor] = None  # Σ_steps g²
        # block adapters, once the candidates are chosen: their BlockLayout, what the block kernel needs
        # to compute the candidates' gradients without the dense dW (element (i, j) of candidate block b
        # sits at base[b] + i·stride[b] + j in ``candidates``)
        self.candidate_blocks = None

    # whether the window's later micro-batches take the candidate blocks' gradients from the block
    # kernel (off: from the dense dW, as the first micro-batch does)
    block_kernel: ClassVar[bool] = True

    def __call__(self, layer: SparseLayer, dense_grad: torch.Tensor) -> None:
        flat = dense_grad.reshape(-1)
        if self.candidates is None:  # first micro-batch of the window: pick the candidates
            if distributed():
                flat = flat.clone()
                dist.all_reduce(flat)  # identical candidates on every rank
            g = self.grid
            if g.unstructured and self.normalize == "column":  # by |∂L/∂W_ij| / RMS_i(∂L/∂W_ij): spread over columns
                matrix = flat.view(g.out_features, g.in_features)
                self.col_scale = column_scale(matrix, self.dtype)
                self.candidates, first = kernels.top_scaled_magnitudes(matrix, self.col_scale, self.num_candidate_units, index_dtype(flat.numel()))
                if distributed():
                    first = None  # the selection's gradients are all ranks' sum: this rank's are gathered below
            elif g.unstructured:  # units are the weights (one narrow copy of their indices), by |∂L/∂W|
                self.candidates, first = kernels.top_magnitudes(flat, self.num_candidate_units, index_dtype(flat.numel()))
                if distributed():
                    first = None  # the selection's gradients are all ranks' sum: this rank's are gathered below
            else:  # blocks by Σ|∂L/∂W| (float32), then their layout, elements and first gradients in one pass
                block_shape = (g.bh, g.bw)
                keys = kernels.block_score_keys(flat.view(g.out_features, g.in_features), block_shape)
                self.candidate_units = kernels.top_blocks(keys, self.num_candidate_units)  # ascending
                own = dense_grad.reshape(g.out_features, g.in_features)  # this rank's gradient
                layout, self.candidates, first = kernels.gather_blocks(own, self.candidate_units, block_shape, index_dtype(flat.numel()))
                if self.block_kernel:
                    self.candidate_blocks = layout
            # (Σ g and Σ g² are allocated at the step's end, all tensors' together: see _allocate_sums)
            if first is not None and self.dtype == torch.float32:  # this micro-batch's gradients at the candidates
                self.step_sum = first
                self._count(first, fresh=True)
                return
            self.step_sum = torch.zeros(self.candidates.numel(), dtype=self.dtype, device=flat.device)
            if distributed():
                flat = dense_grad.reshape(-1)
        here = flat.index_select(0, self.candidates)
        if self.micro_batches and distributed():  # (the global micro-batch's gradient, as one process would see it)
            dist.all_reduce(here)
            here /= dist.get_world_size()
        self.step_sum += here
        self._count(here)

    def _count(self, gradient: torch.Tensor, fresh: bool = False) -> None:
        """One more micro-batch; with ``micro_batches`` its squared gradient joins ``step_sq``."""
        self.samples += 1
        if not self.micro_batches:
            return
        if fresh or self.step_sq is None:
            self.step_sq = torch.zeros(self.candidates.numel(), dtype=self.dtype, device=gradient.device)
        self.step_sq.addcmul_(gradient.to(self.dtype), gradient.to(self.dtype))

    def growth_score(self) -> torch.Tensor:
        """Σ g at the candidates (ĝ up to 1/γ: its magnitude ranks them), divided by the column scale if normalized."""
        if self.col_scale is None:
            return self.grad_sum
        return self.grad_sum / self.col_scale[self.candidates.long() % self.grid.in_features].to(self.grad_sum.dtype)

    def candidate_layout(self):
        """The :class:`~peft_sparse.core.kernels.BlockLayout` of the ascending ``candidate_units`` (block
        adapters): where each candidate block's elements sit in ``candidates``."""
        g = self.grid
        return kernels.BlockLayout.of_blocks(self.candidate_units, g.out_features, g.in_features, (g.bh, g.bw))

    def index_candidate_blocks(self) -> None:
        """Set ``candidate_blocks`` (see :meth:`candidate_layout`), unless ``block_kernel`` is off."""
        if self.block_kernel:
            self.candidate_blocks = self.candidate_layout()

    def add_candidate_gradients(self, grad_out2d: torch.Tensor, x2d: torch.Tensor, x_factor: Optional[torch.Tensor] = None) -> None:
        """Add one micro-batch's gradient at the candidate blocks (``candidate_blocks``) to ``step_sum``
        from the block kernel, instead of from the dense dW (``x_factor``: the layer input is
        ``x2d ⊙ x_factor``, formed tile by tile; see :func:`~peft_sparse.core.kernels.block_sddmm_into`),
        repeating the launch kept for the call's shape (:func:`~peft_sparse.core.kernels.block_value_gradient`)."""
        kernels.block_value_gradient(grad_out2d, x2d, self.candidate_blocks, x_factor=x_factor, out=self.step_sum)

    def end_step(self) -> None:
        if self.candidates is None:
            return
        _end_steps([self])

    def tensors(self) -> dict:
        if self.candidates is None:
            return {}
        _allocate_sums([self])
        tensors = {"candidates": self.candidates, "step_sum": self.step_sum, "grad_sum": self.grad_sum, "grad_sq_sum": self.grad_sq_sum,
                   "samples": torch.tensor(self.samples)}
        if self.step_sq is not None:
            tensors["step_sq"] = self.step_sq
        if self.col_scale is not None:
            tensors["col_scale"] = self.col_scale
        if self.candidate_units is not None:  # block adapters
            tensors["candidate_units"] = self.candidate_units
        return tensors


def _allocate_sums(statistics: list) -> None:
    """Zero Σ g and Σ g² of the armed statistics that have none yet (a window's first step), one buffer
    per device and dtype for all of them (views of it)."""
    groups: dict = {}
    for stats in statistics:
        if stats.candidates is not None and stats.grad_sum is None:
            groups.setdefault((stats.step_sum.device, stats.step_sum.dtype), []).append(stats)
    for (device, dtype), fresh in groups.items():
        sizes = [m.step_sum.numel() for m in fresh]
        sums = torch.zeros(2, sum(sizes), dtype=dtype, device=device)
        for m, grad_sum, grad_sq_sum in zip(fresh, sums[0].split(sizes), sums[1].split(sizes)):
            m.grad_sum, m.grad_sq_sum = grad_sum, grad_sq_sum


def _end_steps(statistics: list) -> None:
    """:meth:`_WindowStatistics.end_step` of many tensors with a few multi-tensor launches (one group per
    device and dtype) instead of four launches each; the same operations, so the same bits."""
    groups: dict = {}
    for stats in statistics:
        if stats.candidates is not None:
            groups.setdefault((stats.step_sum.device, stats.step_sum.dtype), []).append(stats)
    _allocate_sums(statistics)
    for members in groups.values():
        step = [m.step_sum for m in members]
        torch._foreach_add_([m.grad_sum for m in members], step)
        by_step = [m for m in members if not m.micro_batches]
        if by_step:  # Σ g² over optimizer steps: the square of each step's summed gradient
            torch._foreach_add_([m.grad_sq_sum for m in by_step], torch._foreach_mul([m.step_sum for m in by_step], [m.step_sum for m in by_step]))
        for m in members:
            if m.micro_batches and m.step_sq is not None:  # Σ g² over micro-batches (reference='authors')
                m.grad_sq_sum += m.step_sq
                m.step_sq.zero_()
        torch._foreach_zero_(step)


def column_scale(matrix: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each column's RMS gradient in ``dtype`` (clamped to its smallest normal): the divisor of
    ``score_normalization="column"``'s candidate scores."""
    return matrix.to(dtype).pow(2).mean(0).sqrt().clamp_min(torch.finfo(dtype).tiny)


def column_square_sums(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Σ over the rows of t² per column, in ``dtype``. A half-precision CUDA tensor is read once by one norm reduction
    that accumulates in ``dtype`` (‖t_j‖², within a rounding of the sum itself); otherwise t is widened and squared
    (two transient copies, which at 7B shapes cost a window step more than its products)."""
    if t.is_cuda and t.dtype in (torch.float16, torch.bfloat16) and dtype in (torch.float32, torch.float64):
        return torch.linalg.vector_norm(t, 2, dim=0, dtype=dtype).square_()
    w = t.to(dtype)
    return (w * w).sum(0)


class InputOutputStatistics:
    """SpIEL-MA's growth signal with ``ma_signal='io'``: over one estimation window, per row i of a tensor
    A_i = Σ_tokens (∂L/∂Y_i)² and per column j B_j = Σ_tokens X_j² — the factors of every weight's gradient
    ∂L/∂W_ij = Σ_tokens (∂L/∂Y_i)·X_j, summed over the window's micro-batches. By Cauchy–Schwarz (∂L/∂W_ij)² ≤
    A_i·B_j for each micro-batch, so R = A, C = B ranks every weight of the tensor, inactive ones included,
    where SM3's accumulators only see the rows and columns the mask holds. Memory is out + in floats; the
    backward pass hands over G and X (``takes_factors``, the core's seam), so no dense gradient is formed.
    An embedding table's backward has no such factors: it hands over the dense ∂L/∂E, and A, B are the row
    and column sums of its square (for one token, A_i·B_j is then G_ij² times a constant)."""

    takes_factors: ClassVar[bool] = True

    def __init__(self, out_features: int, in_features: int, device, dtype: torch.dtype = torch.float32):
        self.row_sum = torch.zeros(out_features, dtype=dtype, device=device)  # A: Σ (∂L/∂Y_i)²
        self.col_sum = torch.zeros(in_features, dtype=dtype, device=device)  # B: Σ X_j²
        self.seen = 0  # backward passes added

    def add_factors(self, grad_out2d: torch.Tensor, x2d: torch.Tensor, x_factor: Optional[torch.Tensor] = None) -> None:
        x = x2d if x_factor is None else x2d * x_factor  # (tokens, in), transient
        self.row_sum += column_square_sums(grad_out2d, self.row_sum.dtype)
        self.col_sum += column_square_sums(x, self.col_sum.dtype)
        self.seen += 1

    def __call__(self, layer, dense_grad: torch.Tensor) -> None:  # (embedding tables: the dense ∂L/∂E)
        square = dense_grad.to(self.row_sum.dtype).reshape(self.row_sum.numel(), self.col_sum.numel()).square()
        self.row_sum += square.sum(1)
        self.col_sum += square.sum(0)
        self.seen += 1

    def tensors(self) -> dict:
        return {"row_sum": self.row_sum, "col_sum": self.col_sum, "seen": torch.tensor(self.seen)}

    def load(self, tensors: dict) -> None:
        self.row_sum.copy_(tensors["row_sum"])
        self.col_sum.copy_(tensors["col_sum"])
        self.seen = int(tensors["seen"])


class RowColumnAccumulators:
    """SpIEL-MA's growth statistics when the optimizer is not :class:`peft_sparse.SM3`: SM3-II's row and
    column accumulators of every tensor, kept from the values' gradients just before each optimizer step
    (``optimizer.register_step_pre_hook``: after clipping and accumulation, as SM3 sees them) —

        ν_j = min(R_{r_j}, C_{c_j}) + g_j²,   R_i ← max(R_i, max_{j: r_j = i} ν_j),   C_k likewise,

    SM3's own update (:func:`peft_sparse.optim.sm3.accumulate_sparse`: the same bits as its accumulators for the
    same gradients). Memory is Σ(out + in) floats, nothing per weight. All tensors of a device share one R and one
    C buffer (each tensor a slice), and one step is a handful of launches for all of them: the rows and columns of
    the values, offset into those buffers, are rebuilt whenever an indices tensor is another object or was edited
    in place (its version counter) since they were built.
    """

    def __init__(self, layers: list, adapter_name: str):
        self.adapter_name = adapter_name
        self.groups: dict = {}  # device → {"layers", "row", "col", "rows": None | global rows, "cols"}
        for layer in layers:
            values = layer.sparse_values[adapter_name]
            self.groups.setdefault(values.device, {"layers": []})["layers"].append(layer)
        self.views: dict = {}  # module name → (its R, its C): views of the group's buffers
        for device, group in self.groups.items():
            members = group["layers"]
            dtype = torch.float64 if any(m.sparse_values[adapter_name].dtype == torch.float64 for m in members) else torch.float32
            group["row"] = torch.zeros(sum(m.out_features for m in members), dtype=dtype, device=device)
            group["col"] = torch.zeros(sum(m.in_features for m in members), dtype=dtype, device=device)
            rows = group["row"].split([m.out_features for m in members])
            cols = group["col"].split([m.in_features for m in members])
            for layer, r, c in zip(members, rows, cols):
                self.views[layer.module_name] = (r, c)
            group["built_from"] = None  # [(indices tensor, its version)] the positions below were built from
            group["rows"] = group["cols"] = None

    def _positions(self, group: dict, indices: list) -> None:
        rows, cols, row_at, col_at = [], [], 0, 0
        for layer, idx in zip(group["layers"], indices):
            r, c = kernels.rows_cols(idx, layer.in_features)
            rows.append(r + row_at)
            cols.append(c + col_at)
            row_at += layer.out_features
            col_at += layer.in_features
        group["rows"], group["cols"] = torch.cat(rows), torch.cat(cols)
        group["built_from"] = [(idx, internals.version(idx)) for idx in indices]

    @torch.no_grad()
    def update(self, *_unused, gradient: Optional[Callable] = None) -> None:
        """One optimizer step's gradients into R and C (a step pre-hook; a values tensor without a gradient
        this step counts as zero gradients, as SM3 skips it). ``gradient``: values → its gradient, where it is not
        ``values.grad`` (under DeepSpeed ZeRO: the reduced gradients it holds)."""
        name = self.adapter_name
        gradient = gradient if gradient is not None else (lambda values: values.grad)
        for group in self.groups.values():
            indices = [m.sparse_indices[name] for m in group["layers"]]
            built = group["built_from"]
            if built is None or any(i is not b or internals.version(i) != v for i, (b, v) in zip(indices, built)):
                self._positions(group, indices)
            row, col = group["row"], group["col"]
            grads = []
            for layer in group["layers"]:
                values = layer.sparse_values[name]
                g = gradient(values)
                grads.append(torch.zeros(getattr(values, "ds_numel", values.numel()), dtype=values.dtype, device=row.device) if g is None else g.reshape(-1))
            if all(g.dtype == grads[0].dtype for g in grads):  # (one cast of the joined gradients: the same bits as a cast of each)
                joined = torch.cat(grads).to(row.dtype)
            else:
                joined = torch.cat([g.to(row.dtype) for g in grads])
            accumulate_sparse(row, col, group["rows"], group["cols"], joined)

    def tensors(self) -> dict:
        """{module name: {"row_accumulator", "col_accumulator"}} (views of the shared buffers)."""
        return {name: {"row_accumulator": r, "col_accumulator": c} for name, (r, c) in self.views.items()}

    def load(self, saved: dict) -> None:
        if set(saved) != set(self.views):
            missing = sorted(set(self.views) - set(saved))[:3]
            raise ValueError(f"scheduler state holds no SpIEL-MA accumulators of {missing} (it was saved with another optimizer or adapter)")
        for name, (r, c) in self.views.items():
            r.copy_(saved[name]["row_accumulator"])
            c.copy_(saved[name]["col_accumulator"])
