"""On a CUDA device: the compiled Triton paths inside real layers, SpIEL steps, qSpIEL (skipped without a GPU)."""

import contextlib

import pytest
import torch
from peft import get_peft_model

from peft_sparse import SM3, SpIELConfig, SpIELScheduler
from peft_sparse.accel import nf4
from peft_sparse.core import dispatch, kernels

from .models import sparse_layers, tiny_llama, train_on

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("block_shape", [(1, 1), (16, 16), (1, 64)])
@pytest.mark.parametrize("method", ["auto", "sddmm"])
def test_cuda_value_gradients_match_dense_reference(block_shape, method):
    config = SpIELConfig(target_modules=["gate_proj", "down_proj"], density=0.25, block_shape=block_shape)
    model = get_peft_model(tiny_llama(hidden_size=64, intermediate_size=128, dtype=torch.bfloat16), config).cuda()
    for layer in sparse_layers(model):
        layer.value_grad_method = method
        with torch.no_grad():
            layer.sparse_values["default"].normal_()
        x = torch.randn(4, 33, layer.in_features, device="cuda", dtype=torch.bfloat16)
        y = layer(x)
        grad = torch.randn_like(y)
        y.backward(grad)
        dW = grad.float().reshape(-1, layer.out_features).t().mm(x.float().reshape(-1, layer.in_features))
        want = dW.view(-1)[layer.sparse_indices["default"].long()]
        got = layer.sparse_values["default"].grad.float()
        assert torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want) < 2e-2


@pytest.mark.parametrize("growth, block_shape", [("ag", (1, 1)), ("ma", (1, 1)), ("ag", (16, 16)), ("ma", (16, 16))])
def test_spiel_steps_on_cuda(growth, block_shape):
    # (a full first replacement in every case: with ma_signal="io", the block MA default, 'auto' replaces only a
    # k(t) share at so short a run, which is 0 of this tiny model's two blocks per tensor)
    config = SpIELConfig(target_modules="all-linear", density=0.1, growth=growth, reselection_steps=3,
                         gradient_estimation_steps=1, block_shape=block_shape, first_full_replacement=True)  # fmt: skip
    model = get_peft_model(tiny_llama(hidden_size=64, intermediate_size=128), config).cuda()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, fused=True) if growth == "ag" else SM3(params, lr=0.1)
    scheduler = SpIELScheduler(model, opt, total_steps=8)
    x = torch.randint(0, 97, (4, 16), device="cuda")
    losses = train_on(model, opt, scheduler, x, 8)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all((l.sparse_ages["default"] > 0).any() for l in sparse_layers(model))


def test_qspiel_on_cuda(tmp_path):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_llama(hidden_size=64, intermediate_size=128).save_pretrained(tmp_path)
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=q, device_map={"": 0})
    model = get_peft_model(base, SpIELConfig(target_modules="all-linear", density=0.1, reselection_steps=3, gradient_estimation_steps=1))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = SpIELScheduler(model, opt, total_steps=6)
    x = torch.randint(0, 97, (4, 16), device="cuda")
    model.train()
    for _ in range(6):
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
    layer = sparse_layers(model)[0]
    assert layer.sparse_values["default"].dtype == torch.float32
    assert (layer.sparse_ages["default"] == 4).any()
    assert "cuda" in kernels.SDDMM_KERNELS


@pytest.mark.parametrize("growth", ["ag", "ma"])
@pytest.mark.parametrize("block", [(1, 1), (16, 16)])
def test_batched_reselection_on_cuda_equals_per_tensor(growth, block):
    """The batched drop/grow on a GPU (sorts, binary searches, threshold counting) gives what the
    plain per-tensor functions give on the same GPU."""
    from peft_sparse.core.selection import BlockGrid
    from peft_sparse.methods.spiel.batched import TensorReselection, reselect_all
    from peft_sparse.methods.spiel.selection import reselect_ag, reselect_ma

    g = torch.Generator().manual_seed(0)
    items_cpu = []
    for out_f, in_f in [(512, 256), (256, 512), (64, 256), (512, 512)]:
        grid = BlockGrid(out_f, in_f, block)
        n_units = grid.numel // 20
        units = torch.randperm(grid.numel, generator=g)[:n_units].sort().values
        indices = grid.expand(units).to(torch.int32)
        item = TensorReselection(torch.randn(indices.numel(), generator=g), indices, n_units // 5, grid,
                                 units=units if grid.unit > 1 else None)  # fmt: skip
        if growth == "ag":
            cand = torch.randperm(grid.numel, generator=g)[: 2 * n_units].sort().values
            item.candidates = grid.expand(cand).to(torch.int32)
            item.candidate_units = cand if grid.unit > 1 else None
            item.score = torch.rand(item.candidates.numel(), generator=g)
        else:
            item.row_acc, item.col_acc = torch.rand(out_f, generator=g), torch.rand(in_f, generator=g)
        items_cpu.append(item)
    moved = [TensorReselection(**{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in vars(it).items()}) for it in items_cpu]
    batched = reselect_all(moved, growth)
    assert bool(batched.ok)
    for it, got in zip(moved, batched.indices):
        if growth == "ag":
            want = reselect_ag(it.values, it.indices, it.k, it.candidates, it.score, it.grid, it.units, it.candidate_units)
        else:
            want = reselect_ma(it.values, it.indices, it.k, it.row_acc, it.col_acc, it.grid, it.units)
        assert torch.equal(got, want.indices)


@pytest.mark.parametrize("low_cpu_mem_usage", [False, True])
def test_adapter_saved_on_cpu_loads_next_to_a_cpu_base_model(tmp_path, low_cpu_mem_usage):
    """With a GPU present PEFT loads adapter files onto CUDA (huggingface/peft#3793); the sparse layers
    follow their base layer's device, so a CPU model loaded this way still runs, bit for bit."""
    from peft import PeftModel

    config = SpIELConfig(target_modules=["q_proj", "down_proj"], density=0.1)
    model = get_peft_model(tiny_llama(), config)
    with torch.no_grad():
        for layer in sparse_layers(model):
            layer.sparse_values["default"].normal_()
    ids = torch.randint(0, 97, (2, 7))
    want = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path, low_cpu_mem_usage=low_cpu_mem_usage)
    for layer in sparse_layers(loaded):
        assert layer.sparse_values["default"].device.type == "cpu"
        assert layer.sparse_indices["default"].device.type == "cpu"
    assert torch.equal(loaded(input_ids=ids).logits, want)


def test_merged_weight_kernel_on_cuda_is_bit_exact():
    """The fused Triton merge == torch's copy-gather-add-scatter, bit for bit in bf16, in a real layer."""
    config = SpIELConfig(target_modules=["gate_proj", "down_proj"], density=0.3)
    model = get_peft_model(tiny_llama(hidden_size=64, intermediate_size=128, dtype=torch.bfloat16), config).cuda()
    for layer in sparse_layers(model):
        with torch.no_grad():
            layer.sparse_values["default"].normal_()
        weight = layer.logical_weight()
        got = layer.merged_weight()
        want = kernels.scatter_add_reference(
            torch.empty_like(weight), layer.sparse_indices["default"], layer.sparse_values["default"].detach(), weight
        )
        assert torch.equal(got, want)


@pytest.mark.parametrize("growth", ["ag", "ma"])
def test_training_merged_in_place_on_cuda_is_bit_identical(growth):
    """bf16 on CUDA: the Triton scatter that keeps W + Δ in the base weight gives the transient copy's bits."""
    runs = []
    for merge in (True, False):
        config = SpIELConfig(target_modules=["q_proj", "gate_proj", "down_proj"], density=0.2, growth=growth,
                             reselection_steps=3, gradient_estimation_steps=2)  # fmt: skip
        model = get_peft_model(tiny_llama(hidden_size=64, intermediate_size=128, dtype=torch.bfloat16), config).cuda()
        theta0 = [layer.get_base_layer().weight.detach().clone() for layer in sparse_layers(model)]
        for layer in sparse_layers(model):
            layer.merge_for_training = merge
        params = [p for p in model.parameters() if p.requires_grad]
        opt = SM3(params, lr=1e-2) if growth == "ma" else torch.optim.AdamW(params, lr=1e-2)
        x = torch.randint(0, 97, (2, 9), device="cuda")
        losses = train_on(model, opt, SpIELScheduler(model, opt, total_steps=8), x, 8)
        model.eval()
        for layer, w in zip(sparse_layers(model), theta0):
            assert torch.equal(layer.get_base_layer().weight, w)
        runs.append((losses, [layer.sparse_values["default"].detach().clone() for layer in sparse_layers(model)]))
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("growth, block_shape", [("ag", (1, 1)), ("ma", (1, 1)), ("ag", (16, 16)), ("ma", (16, 16))])
def test_default_training_pass_on_cuda_is_bit_identical(growth, block_shape, monkeypatch):
    """bf16 on CUDA: the default pass's Triton write (swap_in) and restore (scatter_copy) give the copy's bits: the
    same losses and values as with that pass unregistered (the reference's copy, the other fast paths on), θ₀ intact."""
    from peft_sparse.accel import transient_merge

    entry = dispatch._KINDS["linear"]
    runs, applied = [], []
    monkeypatch.setattr(transient_merge, "ON_CUDA", True)  # (the default; a benchmark switch turns it off)
    apply = transient_merge.transient_apply
    monkeypatch.setattr(transient_merge, "transient_apply", lambda *args: applied.append(1) or apply(*args))
    for registered in (True, False):
        if not registered:
            monkeypatch.setattr(entry, "memos", [f for f in entry.memos if f is not transient_merge.steady_transient_forward])
            monkeypatch.setattr(entry, "implementations", [f for f in entry.implementations if f is not transient_merge.transient_merge_pass])
        config = SpIELConfig(target_modules=["q_proj", "gate_proj", "down_proj"], density=0.2, growth=growth,
                             reselection_steps=3, gradient_estimation_steps=2, block_shape=block_shape)  # fmt: skip
        model = get_peft_model(tiny_llama(hidden_size=64, intermediate_size=128, dtype=torch.bfloat16), config).cuda()
        theta0 = [layer.get_base_layer().weight.detach().clone() for layer in sparse_layers(model)]
        params = [p for p in model.parameters() if p.requires_grad]
        opt = SM3(params, lr=1e-2) if growth == "ma" else torch.optim.AdamW(params, lr=1e-2)
        x = torch.randint(0, 97, (2, 9), device="cuda")
        applied.clear()
        losses = train_on(model, opt, SpIELScheduler(model, opt, total_steps=8), x, 8)
        assert bool(applied) == registered
        for layer, w in zip(sparse_layers(model), theta0):
            assert torch.equal(layer.get_base_layer().weight, w)
        runs.append((losses, [layer.sparse_values["default"].detach().clone() for layer in sparse_layers(model)]))
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b)


def test_write_lane_repeats_kept_launches_on_each_stream():
    """On CUDA a lane plans its two launches at its first write and repeats them (bf16: swap_in's bits); what a
    write keeps lives in a buffer of the stream that wrote it. (Which tensors a lane serves, its buffer per thread
    and the lanes inside training: test_triton_kernels.py, compiled on this device too.)"""
    from peft_sparse.accel import triton_kernels as tk

    torch.manual_seed(0)
    weight = torch.randn(64 * 96, device="cuda", dtype=torch.bfloat16)
    indices = torch.randperm(weight.numel(), device="cuda")[:700].sort().values.to(torch.int32)
    values = torch.randn(700, device="cuda", dtype=torch.float32) * 1e-2
    reference = weight.clone()
    tk.swap_in(reference, indices, values)
    lane = tk.WriteLane(weight, indices, values)
    original = weight.clone()
    for _ in range(3):  # (the first call plans the launches, the next ones repeat them)
        here = lane.swap_in()[0]
        assert torch.equal(weight, reference)
        assert lane.restore(lane.pending)
        assert torch.equal(weight, original)
    assert lane.swap is not None and lane.copy is not None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = lane.swap_in()[0]
        assert torch.equal(weight, reference)
        lane.restore(lane.pending)
    torch.cuda.synchronize()
    assert torch.equal(weight, original)
    assert tk.scratch(weight, 700) is here and on_side.data_ptr() != here.data_ptr()


@pytest.mark.parametrize("block_shape", [(1, 1), (16, 16)])
def test_write_lane_under_cuda_graph_capture(block_shape, monkeypatch):
    """A layer's default pass captured into CUDA graphs (``torch.cuda.make_graphed_callables``: forward and backward,
    the lane's launches with buffers of the graph's own while it captures, never the thread's kept one) and replayed
    (no Python of the layer runs) on new inputs and new values: the outputs and gradients of an eager copy of the
    layer through the generic calls, bit for bit, and θ₀ intact after each replay."""
    import copy

    from peft_sparse.accel import transient_merge, triton_kernels

    config = SpIELConfig(target_modules=["proj"], density=0.2, block_shape=block_shape)
    torch.manual_seed(0)
    base = torch.nn.Sequential()
    base.add_module("proj", torch.nn.Linear(128, 96, bias=False))
    model = get_peft_model(base.to("cuda", torch.bfloat16), config)
    eager = copy.deepcopy(model).base_model.model.proj  # (make_graphed_callables replaces the graphed layer's forward)
    layer = model.base_model.model.proj
    theta0 = layer.get_base_layer().weight.detach().clone()
    x = torch.randn(24, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kept, scratch = [], triton_kernels.scratch  # (capturing?, address) of each buffer a lane's write took

    def recorded(like, n):
        buffer = scratch(like, n)
        kept.append((torch.cuda.is_current_stream_capturing(), buffer.data_ptr()))
        return buffer

    monkeypatch.setattr(triton_kernels, "scratch", recorded)
    graphed = torch.cuda.make_graphed_callables(layer, (x,))
    assert layer._write_lane is not None  # (made in the warm-up, served while capturing)
    captured = {address for capturing, address in kept if capturing}
    assert len([1 for capturing, _ in kept if capturing]) >= 2  # (forward's write and backward's)
    assert not captured & {address for capturing, address in kept if not capturing}  # (the graph's own buffers)
    writes, write = [], transient_merge.write
    monkeypatch.setattr(transient_merge, "write", lambda *a: writes.append(a[0]) or write(*a))
    monkeypatch.setattr(transient_merge, "WRITE_LANE", False)  # (the eager copy: the generic calls)
    for step in range(3):
        values = torch.randn_like(layer.sparse_values["default"]) * 1e-2
        inputs = torch.randn(24, 128, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn(24, 96, device="cuda", dtype=torch.bfloat16)
        results = []
        for module in (graphed, eager):
            with torch.no_grad():
                module.sparse_values["default"].copy_(values)
            module.sparse_values["default"].grad = None
            given = inputs.clone().requires_grad_()
            y = module(given)
            y.backward(grad)
            torch.cuda.synchronize()
            results.append((y.detach(), given.grad, module.sparse_values["default"].grad))
            assert torch.equal(module.get_base_layer().weight, theta0), (step, module is eager)
        for a, b in zip(*results):
            assert torch.equal(a, b), step
        assert writes and all(written is eager for written in writes)  # (the graphed layer ran no Python: replays)
        writes.clear()


def test_layer_inputs_rebuilt_on_cuda_are_bit_identical(monkeypatch):
    """The rebuilt inputs (the RMSNorm outputs by the fused Triton pass) give the value gradients of kept inputs."""
    from .test_functional import _inputs_kept_case

    kernels.load_gpu_kernels()
    fused, calls = kernels.SCALED_PRODUCT_KERNELS.get("cuda"), []
    assert fused is not None
    monkeypatch.setitem(kernels.SCALED_PRODUCT_KERNELS, "cuda", lambda *a: calls.append(1) or fused(*a))
    alive, grads = _inputs_kept_case(True, monkeypatch, torch.bfloat16, "cuda")
    assert calls  # the norm outputs were rebuilt by the fused kernel
    alive_kept, grads_kept = _inputs_kept_case(False, monkeypatch, torch.bfloat16, "cuda")
    assert not any(alive.values()) and all(alive_kept.values())
    for a, b in zip(grads, grads_kept):
        assert torch.equal(a, b)


@pytest.mark.parametrize("growth", ["ma", "ag"])
def test_block_plans_are_built_for_all_layers_at_once(growth, monkeypatch):
    """After a reselection the new block layouts already hold the plans their predecessors used, and
    after an AG window's first step the candidate layouts hold theirs — built in one batch per kind
    (none inside the next backward pass)."""
    from peft_sparse.accel import triton_kernels

    from .models import inputs

    # (MA: SM3's signal, whose steps all take the block kernel and whose first reselection replaces every block)
    config = SpIELConfig(target_modules=["q_proj", "gate_proj", "down_proj"], density=0.1, growth=growth,
                         ma_signal="sm3" if growth == "ma" else None, block_shape=(16, 16), reselection_steps=3,
                         gradient_estimation_steps=2)  # fmt: skip
    model = get_peft_model(tiny_llama(hidden_size=128, intermediate_size=256), config).cuda()
    layers = sparse_layers(model)
    for layer in layers:
        layer.value_grad_method = "block"
    params = [p for p in model.parameters() if p.requires_grad]
    opt = SM3(params, lr=1e-2) if growth == "ma" else torch.optim.AdamW(params, lr=1e-2)
    scheduler = SpIELScheduler(model, opt, total_steps=7)
    batches = []  # layouts per plan batch
    original = triton_kernels.BlockGroups.of_layouts
    monkeypatch.setattr(triton_kernels.BlockGroups, "of_layouts", staticmethod(lambda ls, *a: batches.append(len(ls)) or original(ls, *a)))
    model.train()
    for step in range(1, 5):
        x = inputs(seed=step).cuda()
        batches.clear()
        model(x, labels=x).loss.backward()
        if growth == "ag" and scheduler.steps_in_window >= 1:  # a window's later step: every plan was ready
            assert not batches
        opt.step()
        opt.zero_grad()
        before = [dict(layer.cached_block_metadata("default").plans) for layer in layers]
        batches.clear()
        scheduler.step()
        if step == 2:  # the first reselection (t = γ = 2): new layouts, with their predecessors' plans
            for layer, old in zip(layers, before):
                new = layer.cached_block_metadata("default")
                assert set(new.plans) == set(old) and old and all(new.plans[k] is not old[k] for k in old)
            keys = [k for old in before for k in old]
            assert sum(batches) == len(keys) and len(batches) == len(set(keys))  # one batch per kind of plan
        if growth == "ag" and scheduler.statistics and scheduler.steps_in_window == 1:  # a window's first step
            for s in scheduler.statistics.values():  # X formed, or formed from two factors in the kernel
                keys = {triton_kernels.plan_key(s.candidate_blocks, x_reads=r) for r in (1, 2)}
                assert keys <= set(s.candidate_blocks.plans)
            for layer in layers:  # the values' plans for the later steps too
                layout = layer.cached_block_metadata("default")
                assert {triton_kernels.plan_key(layout, x_reads=r) for r in (1, 2)} <= set(layout.plans)
            assert len(layers) <= sum(batches) <= 4 * len(layers) and len(batches) <= 4


@pytest.mark.parametrize("block_shape", [(1, 1), (16, 16)])
def test_ag_reselection_and_seeding_wait_for_the_device_only_where_designed(block_shape):
    """An AG reselection synchronises the host once (the report, which reads the batched result's flag
    too: the edits are conditioned on it on the device) and the next optimizer step, which writes the
    seeds, not at all: small tables go through pinned memory."""
    import warnings

    from .models import inputs

    config = SpIELConfig(target_modules=["q_proj", "gate_proj", "down_proj"], density=0.1, growth="ag",
                         block_shape=block_shape, reselection_steps=3, gradient_estimation_steps=2)  # fmt: skip
    model = get_peft_model(tiny_llama(hidden_size=128, intermediate_size=256), config).cuda()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
    scheduler = SpIELScheduler(model, opt, total_steps=9)
    model.train()
    syncs = {}
    for step in range(1, 7):
        x = inputs(seed=step).cuda()
        model(x, labels=x).loss.backward()
        for phase, run in (("optimizer", lambda: (opt.step(), opt.zero_grad())), ("scheduler", scheduler.step)):
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    run()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs[(step, phase)] = sum("synchroniz" in str(w.message) for w in caught)
    assert syncs[(5, "scheduler")] == 1, syncs  # the second reselection (t = 5)
    assert syncs[(6, "optimizer")] == 0, syncs  # its seeds written by the next step


def test_block_kernel_product_input_on_cuda_is_bit_identical(monkeypatch):
    """Block adapters on CUDA: the grouped kernel forms down_proj's input silu(gate) ⊙ up from its
    factors tile by tile, with the value gradients of a kept (torch-formed) input, bit for bit."""
    from peft_sparse.accel import input_rebuild as rebuilds

    from .test_functional import _inputs_kept_case

    taken = []
    original = rebuilds.InputRebuild.factors
    monkeypatch.setattr(rebuilds.InputRebuild, "factors", lambda self: taken.append(original(self)) or taken[-1])
    _, grads = _inputs_kept_case(True, monkeypatch, torch.bfloat16, "cuda", block_shape=(16, 16))
    assert sum(f is not None for f in taken) == 2
    _, grads_kept = _inputs_kept_case(False, monkeypatch, torch.bfloat16, "cuda", block_shape=(16, 16))
    for a, b in zip(grads, grads_kept):
        assert torch.equal(a, b)


@pytest.mark.parametrize("nested", [True, False])
def test_fused_nf4_weight_on_cuda_is_bitsandbytes_dequantization_plus_delta(tmp_path, monkeypatch, nested):
    """qSpIEL's fused pass (NF4 dequantization and scatter in one launch) gives bit for bit the same
    weights as bitsandbytes' dequantization + scatter, hence the same losses and value gradients."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as bnb_f
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from .models import randomize_values

    tiny_llama(hidden_size=64, intermediate_size=256).save_pretrained(tmp_path)
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=nested,
                           bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=q, dtype=torch.bfloat16, device_map={"": 0})
    model = get_peft_model(base, SpIELConfig(target_modules="all-linear", density=0.2))
    randomize_values(model, scale=0.05)
    layers = sparse_layers(model)
    for layer in layers:
        weight = layer.get_base_layer().weight
        want = bnb_f.dequantize_4bit(weight.data, weight.quant_state)
        kernels.scatter_add_reference(want, layer.sparse_indices["default"], layer.sparse_values["default"].detach())
        got = nf4.fused_merged_weight(layer, [layer.sparse_indices["default"]], [layer.sparse_values["default"]], None)
        assert got is not None and torch.equal(got, want), layer.module_name
    # the kept per-program slices of the indices follow an in-place rewrite (as a reselection makes)
    layer = max(layers, key=lambda l: l.numel)  # (several programs of the fused launch)
    indices, values = layer.sparse_indices["default"], layer.sparse_values["default"]
    kept = nf4.nf4_starts(layer, indices)
    assert nf4.nf4_starts(layer, indices) is kept  # unchanged indices: kept
    weight = layer.get_base_layer().weight
    with torch.no_grad():
        torch._foreach_copy_([indices], [torch.randperm(layer.numel, device="cuda")[: indices.numel()].sort().values.to(indices.dtype)])
    want = bnb_f.dequantize_4bit(weight.data, weight.quant_state)
    kernels.scatter_add_reference(want, indices, values.detach())
    assert torch.equal(nf4.fused_merged_weight(layer, [indices], [values], None), want)
    assert torch.equal(nf4.nf4_starts(layer, indices), kernels.nf4_compose_starts(indices, layer.numel))
    x = torch.randint(0, 97, (2, 24), device="cuda")
    model.train()
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(dispatch.STEPS, "fused_weight", None)
        loss = model(x, labels=x).loss
        loss.backward()
        runs.append((loss.detach(), [l.sparse_values["default"].grad.clone() for l in layers]))
        model.zero_grad()
    assert torch.equal(runs[0][0], runs[1][0])
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b)


def test_repeated_nf4_launch_on_cuda_follows_every_change(tmp_path, monkeypatch):
    """A 4-bit layer repeats its last single-adapter fused launch (the LaunchPlan of its _NF4Rebuild) while
    the operands stay, with the same bits as the full path and bitsandbytes' dequantization + scatter;
    it follows indices rewritten in place (their per-program slices recomputed in place), takes the full
    path again (and plans anew) when the values' or the indices' storage, the quantization state, the
    4-bit weight's storage, the compute dtype or the requested dtype change, and forgets the plan with
    eval(). Training with repeated launches (counted), the indices rewritten in place midway, equals
    training without them, step for step; a deep copy of the trained model has no kept launch and the
    same loss."""
    pytest.importorskip("bitsandbytes")
    import copy

    import bitsandbytes.functional as bnb_f
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from peft_sparse.accel import nf4 as nf4_module


    from peft_sparse.accel import triton_kernels as tk

    from .models import randomize_values

    tiny_llama(hidden_size=64, intermediate_size=256).save_pretrained(tmp_path)
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)

    def build():
        base = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=q, dtype=torch.bfloat16, device_map={"": 0})
        model = get_peft_model(base, SpIELConfig(target_modules="all-linear", density=0.2))
        randomize_values(model, scale=0.05)
        return model

    model = build()
    layer = max(sparse_layers(model), key=lambda l: l.numel)
    indices, values = layer.sparse_indices["default"], layer.sparse_values["default"]
    weight = layer.get_base_layer().weight
    repeated, full = [], []
    original_call, original_compose = tk.LaunchPlan.__call__, kernels.nf4_compose
    # (counts the NF4 launch's plans only: other kept launches, e.g. the value gradient's gather, are not its)
    nf4 = tk._nf4_compose_kernel
    monkeypatch.setattr(tk.LaunchPlan, "__call__", lambda self, *t: (self.kernel is nf4 and repeated.append(1)) or original_call(self, *t))
    monkeypatch.setattr(kernels, "nf4_compose", lambda *a, **k: full.append(1) or original_compose(*a, **k))

    def check(expect_repeated, dtype=None):
        repeated.clear(), full.clear()
        got = nf4.fused_merged_weight(layer, [indices], [values], dtype)
        want = bnb_f.dequantize_4bit(weight.data, weight.quant_state)
        kernels.scatter_add_reference(want, indices, values.detach())
        assert got is not None and torch.equal(got, want)
        assert (repeated, full) == (([1], []) if expect_repeated else ([], [1])), (expect_repeated, repeated, full)

    for _ in range(3):  # (Triton's launch compiles, then the direct launch plans)
        nf4.fused_merged_weight(layer, [indices], [values], None)
    assert layer._nf4_rebuild is not None
    check(True)
    with torch.no_grad():  # contents only
        values.mul_(2)
    check(True)
    values.data = values.data.clone()  # new storage
    check(False)
    check(True)
    starts = nf4.nf4_starts(layer, indices)
    assert starts is not None and starts.numel() > 2  # (several programs: their slices matter)
    for _ in range(2):
        with torch.no_grad():  # in place, as a reselection rewrites them: the launch follows, its slices anew in place
            torch._foreach_copy_([indices], [torch.randperm(layer.numel, device="cuda")[: indices.numel()].sort().values.to(indices.dtype)])
        check(True)
        assert nf4.nf4_starts(layer, indices) is starts and torch.equal(starts, kernels.nf4_compose_starts(indices, layer.numel))
    indices.data = indices.data.clone()  # new storage
    check(False)
    check(True)
    state = weight.quant_state
    weight.quant_state = copy.copy(state)  # an equal, new state
    check(False)
    check(True)
    weight.data = weight.data.clone()  # new storage of the 4-bit weight
    check(False)
    check(True)
    assert nf4.fused_merged_weight(layer, [indices], [values], torch.float16) is None  # not the dtype bitsandbytes gives
    assert layer._nf4_rebuild is None  # (dropped: it did not apply)
    check(False)
    base = layer.get_base_layer()
    base.compute_dtype = torch.float16
    assert nf4.fused_merged_weight(layer, [indices], [values], None) is None  # bitsandbytes would compute in float16
    base.compute_dtype = torch.bfloat16
    check(False)
    check(True)
    model.eval()
    assert layer._nf4_rebuild is None
    monkeypatch.undo()

    x = torch.randint(0, 97, (2, 24), device="cuda")
    launched = []

    def counted(self, *t):
        ok = original_call(self, *t)
        if ok and self.kernel is nf4:
            launched.append(1)
        return ok

    monkeypatch.setattr(tk.LaunchPlan, "__call__", counted)
    runs = []
    for repeat in (True, False):
        if not repeat:
            monkeypatch.setattr(nf4_module._NF4Rebuild, "__call__", lambda *a: None)
        torch.manual_seed(0)
        model = build()
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        launched.clear()
        moves = torch.Generator(device="cuda").manual_seed(1)
        for step in range(5):
            loss = model(x, labels=x).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
            if step == 2:  # every layer's indices rewritten in place, as a reselection does
                with torch.no_grad():
                    for l in sparse_layers(model):
                        idx = l.sparse_indices["default"]
                        idx.copy_(torch.randperm(l.numel, device="cuda", generator=moves)[: idx.numel()].sort().values.to(idx.dtype))
        layers = sparse_layers(model)
        if repeat:  # from the third pass on (forward and backward), every layer's weight came from its plan
            assert all(l._nf4_rebuild is not None for l in layers) and len(launched) >= 2 * 2 * len(layers), len(launched)
            twin = copy.deepcopy(model)  # (the kept launches stay behind: they refer to compiled kernels)
            assert all(l._nf4_rebuild is None for l in sparse_layers(twin))
            with torch.no_grad():
                assert torch.equal(twin(x, labels=x).loss, model(x, labels=x).loss)
            del twin
        else:
            assert launched == []
        runs.append((torch.stack(losses), [l.sparse_values["default"].detach().clone() for l in layers]))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


@pytest.mark.parametrize("block_shape, beta2", [((1, 1), None), ((16, 16), None), ((1, 1), 0.999), ((16, 16), 0.999)])
def test_sm3_multi_tensor_launch_on_cuda_matches_the_torch_step(monkeypatch, block_shape, beta2):
    """SM3's one launch per parameter group, with momentum, weight decay, two groups of different
    learning rates (changed between steps), accumulators alternating between buffers and a reload of
    the optimizer's own state mid-way, against its torch step: the same values, momenta and accumulators.
    Block adapters (one program per block) also after their blocks changed in place, as a reselection
    changes them (the launch plan follows the new layout)."""
    from peft_sparse.core.selection import BlockGrid
    from peft_sparse.optim import sm3

    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(sm3, "_fused_kernel", lambda: None)
        torch.manual_seed(0)
        config = SpIELConfig(target_modules=["q_proj", "k_proj", "gate_proj", "down_proj"], density=0.2, growth="ma",
                             block_shape=block_shape)  # fmt: skip
        model = get_peft_model(tiny_llama(hidden_size=64, intermediate_size=128), config).cuda()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if "mlp" in n], "lr": 0.05}, {"params": [p for n, p in named if "mlp" not in n]}]
        opt = SM3(groups, lr=0.02, momentum=0.5, weight_decay=0.1, beta2=beta2)
        x = torch.randint(0, 97, (2, 9), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
        for step in range(5):
            model(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
            opt.param_groups[0]["lr"] *= 0.5
            if step == 2:  # reloading its own state: the accumulators are then the step's scratch buffers too
                opt.load_state_dict(opt.state_dict())
            if step == 3 and block_shape != (1, 1):  # other blocks of the first layer, in place
                layer = sparse_layers(model)[0]
                indices = layer.sparse_indices["default"]
                grid = BlockGrid(layer.out_features, layer.in_features, block_shape)
                n_blocks = (layer.out_features // 16) * (layer.in_features // 16)
                blocks = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(5))[: indices.numel() // 256].sort().values
                layer.release_training_merge()  # (θ₀ back at the old positions first, as a reselection does)
                with torch.no_grad():
                    torch._foreach_copy_([indices], [grid.expand(blocks.cuda()).to(indices.dtype)])
        states = [opt.state[p] for _, p in named]
        runs.append(([p.detach().clone() for _, p in named], states))
    (v_fused, s_fused), (v_torch, s_torch) = runs
    # the kernel's division and square root against torch's: float32 ulps
    for a, b in zip(v_fused, v_torch):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(s_fused, s_torch):
        for key in ("row_accumulator", "col_accumulator", "momentum_buffer"):
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


def test_seeding_scale_on_another_device_than_the_states():
    """The clip factor c lives on the device of the first gradient; states elsewhere (a model spread
    over devices) get it moved, not a device mismatch: exp_avg = ĝ·c·(1−β₁ᵗ), exp_avg_sq = ŝ·c²·(1−β₂ᵗ)."""
    from peft_sparse.optim.surgery import seed_optimizer_states

    param = torch.nn.Parameter(torch.zeros(6))
    opt = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.ones(6)
    opt.step()  # state on the CPU, step 1
    slots, g_hat, s_hat = torch.tensor([1, 4]), torch.tensor([2.0, -4.0]), torch.tensor([9.0, 16.0])
    seed_optimizer_states(opt, [param], [slots], [g_hat], [s_hat], scale=torch.tensor(0.5, dtype=torch.float64, device="cuda"))
    state = opt.state[param]
    torch.testing.assert_close(state["exp_avg"][slots], g_hat * 0.5 * (1 - 0.9))
    torch.testing.assert_close(state["exp_avg_sq"][slots], s_hat * 0.25 * (1 - 0.999))


def test_direct_launch_picks_the_kernel_of_each_specialization(monkeypatch):
    """triton_kernels.launch launches the kernel Triton compiled for the arguments' specialization: with
    16-byte aligned and misaligned tensors, and sizes 1, multiples of 16 and others, each result equals
    the torch reference, and a repeated call of a known specialization does not go through Triton's launch."""
    from triton.runtime.jit import JITFunction

    from peft_sparse.accel import triton_kernels as tk

    runs = []
    original = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: runs.append(1) or original(self, *a, **k))
    g = torch.Generator(device="cuda").manual_seed(0)
    for n_rows, h, offset in ((16, 256, 0), (1, 256, 0), (17, 250, 0), (16, 256, 1), (17, 250, 3), (16, 16, 0)):
        base = torch.randn(n_rows * h + offset, device="cuda", generator=g)
        full = base[offset:].view(n_rows, h)  # offset 1, 3: an address that is not 16-byte aligned
        per_row = torch.rand(n_rows, 1, device="cuda", generator=g)
        scale = torch.randn(h, device="cuda", generator=g).to(torch.bfloat16)
        want = kernels.scaled_product_reference(scale, full, per_row, torch.bfloat16)
        for call in range(3):  # (Triton's launch compiles or finds the kernel at first)
            before = len(runs)
            assert torch.equal(tk.scaled_product(scale, full, per_row, torch.bfloat16), want), (n_rows, h, offset, call)
            if call == 2:
                assert len(runs) == before, (n_rows, h, offset)  # the kept kernel, launched directly


@contextlib.contextmanager
def _plan_launches():
    """Records, while open, what each kept launch (``LaunchPlan``) returned: True when it launched."""
    from peft_sparse.accel import triton_kernels as tk

    launched, original = [], tk.LaunchPlan.__call__

    def counted(self, *tensors):
        done = original(self, *tensors)
        launched.append(done)
        return done

    tk.LaunchPlan.__call__ = counted
    try:
        yield launched
    finally:
        tk.LaunchPlan.__call__ = original


def _tenth_of_the_blocks(g, out_f: int, in_f: int):
    """The BlockLayout (on CUDA) of a random tenth of the 32×32 blocks of an (out_f, in_f) matrix."""
    from peft_sparse.core.selection import BlockGrid

    grid = BlockGrid(out_f, in_f, (32, 32))
    blocks = torch.randperm(grid.numel, generator=g)[: grid.numel // 10].sort().values
    return kernels.BlockLayout.of_blocks(blocks.cuda(), out_f, in_f, (32, 32))


@pytest.mark.parametrize("tokens, product", [(300, False), (8192, False), (2048, True)])
def test_block_value_gradient_repeats_its_kept_launch_bit_for_bit(tokens, product):
    """kernels.block_value_gradient keeps each call shape's launch on the layout and repeats it with new
    tensors: the same bits as block_sddmm_into into a new tensor, with one token slice or several
    (summed), X formed in the kernel or not; a non-contiguous input (made contiguous first) gives the
    same bits; another token count keeps a launch of its own, and a layout keeps at most four."""
    from peft_sparse.accel import triton_kernels as tk

    g = torch.Generator().manual_seed(tokens)
    out_f, in_f = 256, 512
    layout = _tenth_of_the_blocks(g, out_f, in_f)
    n = layout.rows.numel() * 32 * 32
    for step in range(-2, 3):  # (two usual launches first: Triton's own launch serves the first two)
        go = torch.randn(tokens, out_f, generator=g).cuda().to(torch.bfloat16)
        x = torch.randn(tokens, in_f, generator=g).cuda().to(torch.bfloat16)
        factor = torch.randn(tokens, in_f, generator=g).cuda().to(torch.bfloat16) if product else None
        want = tk.block_sddmm_into(go, x, layout, torch.empty(n, device="cuda"), x_factor=factor)
        if step < 0:
            continue
        with _plan_launches() as launched:
            got = kernels.block_value_gradient(go, x, layout, x_factor=factor)
        assert torch.equal(got, want)
        assert launched == ([True] if step else [])  # the first call plans, the next ones repeat
    assert len(layout.launches) == 1
    (plan, splits), = layout.launches.values()
    assert (splits > 1) == (tokens > 300)  # (300 tokens: too few to slice)
    wide = torch.randn(tokens, 2 * in_f, generator=g).cuda().to(torch.bfloat16)[:, :in_f]  # not contiguous
    go = torch.randn(tokens, out_f, generator=g).cuda().to(torch.bfloat16)
    factor = torch.randn(tokens, in_f, generator=g).cuda().to(torch.bfloat16) if product else None
    assert torch.equal(kernels.block_value_gradient(go, wide, layout, x_factor=factor),
                       tk.block_sddmm_into(go, wide, layout, torch.empty(n, device="cuda"), x_factor=factor))  # fmt: skip
    fewer = go[: tokens // 2]
    half = (factor[: tokens // 2] if product else None)
    assert torch.equal(kernels.block_value_gradient(fewer, x[: tokens // 2], layout, x_factor=half),
                       tk.block_sddmm_into(fewer, x[: tokens // 2], layout, torch.empty(n, device="cuda"), x_factor=half))  # fmt: skip
    assert len(layout.launches) == 2
    for cut in (3, 4, 5, 6, 7):  # more call shapes than a layout keeps: the oldest go
        tokens_now = tokens // cut
        got = kernels.block_value_gradient(go[:tokens_now], x[:tokens_now], layout, x_factor=factor[:tokens_now] if product else None)
        assert got.shape == (n,)
    assert len(layout.launches) <= 4


@pytest.mark.parametrize("tokens, product", [(300, False), (8192, False), (2048, True)])
def test_block_value_gradient_adds_into_out_with_its_kept_launch(tokens, product):
    """Given ``out`` (an AG window's sums at its candidate blocks), kernels.block_value_gradient adds the
    block gradient to it with a kept launch of its own: the same bits as block_sddmm_into accumulating
    into a copy of the same start, with one token slice or several; a new-tensor call keeps another."""
    from peft_sparse.accel import triton_kernels as tk

    g = torch.Generator().manual_seed(tokens + 1)
    out_f, in_f = 256, 512
    layout = _tenth_of_the_blocks(g, out_f, in_f)
    n = layout.rows.numel() * 32 * 32
    sums = torch.randn(n, generator=g).cuda()
    for step in range(-2, 3):
        go = torch.randn(tokens, out_f, generator=g).cuda().to(torch.bfloat16)
        x = torch.randn(tokens, in_f, generator=g).cuda().to(torch.bfloat16)
        factor = torch.randn(tokens, in_f, generator=g).cuda().to(torch.bfloat16) if product else None
        want = tk.block_sddmm_into(go, x, layout, sums.clone(), accumulate=True, x_factor=factor)
        if step < 0:
            continue
        with _plan_launches() as launched:
            got = kernels.block_value_gradient(go, x, layout, x_factor=factor, out=sums)
        assert got is sums and torch.equal(sums, want)
        assert launched == ([True] if step else [])
    (plan, splits), = layout.launches.values()
    assert (splits > 1) == (tokens > 300)
    fresh = kernels.block_value_gradient(go, x, layout, x_factor=factor)
    assert torch.equal(fresh, tk.block_sddmm_into(go, x, layout, torch.empty(n, device="cuda"), x_factor=factor))
    assert len(layout.launches) == 2  # the sum and the new tensor: two launches


def test_candidate_selection_launches_repeat_per_layer_shape():
    """A window's first step selects candidate blocks layer by layer with three kernels (block sums, top
    blocks, gather) whose launches are kept per layer shape and repeated with each layer's tensors: the
    same results as the references (and, for the sums, as Triton's own launch) at every call."""
    from peft_sparse.accel import triton_kernels as tk

    g = torch.Generator().manual_seed(5)
    with _plan_launches() as launched:
        for step in range(5):
            for out_f, in_f in ((256, 512), (128, 512)):  # two layer shapes, alternating
                dense = torch.randn(out_f, in_f, generator=g).to(torch.bfloat16).cuda()
                keys = kernels.block_score_keys(dense, (32, 32))
                direct = torch.empty_like(keys)
                tk._block_score_keys_kernel[(keys.numel(),)](dense, direct, in_f, in_f // 32, BH=32, BW=32, num_warps=4)
                assert torch.equal(keys, direct)
                units = kernels.top_blocks(keys, 9)
                assert torch.equal(units.cpu(), kernels.top_blocks_reference(keys.cpu(), 9))
                layout, idx, vals = kernels.gather_blocks(dense, units, (32, 32), torch.int32)
                r_layout, r_idx, r_vals = kernels.gather_blocks_reference(dense.cpu(), units.cpu(), (32, 32), torch.int32)
                assert torch.equal(idx.cpu(), r_idx) and torch.equal(vals.cpu(), r_vals)
                assert torch.equal(layout.base.cpu(), r_layout.base) and torch.equal(layout.stride.cpu(), r_layout.stride)
    assert launched.count(True) >= 3 * 2 * 2 and not any(d is False for d in launched)  # kept launches repeated, none refused


@pytest.mark.parametrize("tokens", [300, 8192])
def test_a_reselected_layout_takes_over_the_kept_launches(tokens):
    """After a reselection a layer's new layout (as many blocks, elsewhere) takes over the old one's kept
    value-gradient launches, retargeted to its own group plans: its first backward call repeats a kept
    launch and gives the same bits as a fresh launch; a layout of another block count takes none."""
    from peft_sparse.accel import triton_kernels as tk
    from peft_sparse.core.selection import BlockGrid

    g = torch.Generator().manual_seed(tokens + 2)
    out_f, in_f, shape = 256, 512, (32, 32)
    grid = BlockGrid(out_f, in_f, shape)
    perm = torch.randperm(grid.numel, generator=g)
    count = grid.numel // 10
    old = kernels.BlockLayout.of_blocks(perm[:count].sort().values.cuda(), out_f, in_f, shape)
    new = kernels.BlockLayout.of_blocks(perm[count : 2 * count].sort().values.cuda(), out_f, in_f, shape)
    fewer = kernels.BlockLayout.of_blocks(perm[2 * count : 3 * count - 1].sort().values.cuda(), out_f, in_f, shape)
    go = torch.randn(tokens, out_f, generator=g).cuda().to(torch.bfloat16)
    x = torch.randn(tokens, in_f, generator=g).cuda().to(torch.bfloat16)
    factor = torch.randn(tokens, in_f, generator=g).cuda().to(torch.bfloat16)
    for _ in range(3):  # (Triton's own launch serves the first two calls of a specialization)
        kernels.block_value_gradient(go, x, old)
        kernels.block_value_gradient(go, x, old, x_factor=factor)
    assert len(old.launches) == 2
    kernels.prepare_block_plans([new, fewer], [list(old.plans), list(old.plans)])
    kernels.carry_launches([old, old], [new, fewer])
    assert set(new.launches) == set(old.launches) and not fewer.launches
    n = count * 32 * 32
    with _plan_launches() as launched:
        got = kernels.block_value_gradient(go, x, new)
        got_product = kernels.block_value_gradient(go, x, new, x_factor=factor)
    assert launched == [True, True]
    assert torch.equal(got, tk.block_sddmm_into(go, x, new, torch.empty(n, device="cuda")))
    assert torch.equal(got_product, tk.block_sddmm_into(go, x, new, torch.empty(n, device="cuda"), x_factor=factor))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_io_statistics_read_half_precision_factors_once_on_cuda(dtype):
    """SpIEL-MA's io window sums of a half-precision CUDA layer (one norm reduction per factor, no widened copies)
    equal the widened sums of squares within float32 rounding, and the CPU keeps the widened sums."""
    from peft_sparse.methods.spiel.statistics import InputOutputStatistics, column_square_sums

    torch.manual_seed(0)
    g, x = torch.randn(300, 48, dtype=dtype), torch.randn(300, 20, dtype=dtype)
    stats = InputOutputStatistics(48, 20, "cuda")
    norms = []
    real_norm = torch.linalg.vector_norm

    def counted(*args, **kwargs):
        norms.append(args[0].dtype)
        return real_norm(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.linalg, "vector_norm", counted)
        stats.add_factors(g.cuda(), x.cuda())
    assert norms == [dtype, dtype]  # (both factors reduced as they are, in half precision)
    assert torch.allclose(stats.row_sum.cpu(), (g.float() ** 2).sum(0), rtol=1e-5, atol=0)
    assert torch.allclose(stats.col_sum.cpu(), (x.float() ** 2).sum(0), rtol=1e-5, atol=0)
    assert torch.equal(column_square_sums(g, torch.float32), (g.float() * g.float()).sum(0))
