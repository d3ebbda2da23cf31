"""The autograd core: gradients against autograd of a dense masked delta, memory contract, seams."""

import pytest
import torch
from peft import PeftModel, get_peft_model
from torch import nn
from transformers.pytorch_utils import Conv1D

from peft_sparse import SparseFTConfig
from peft_sparse.core import devices, kernels
from peft_sparse.core.functional import sparse_delta_linear
from peft_sparse.core.layer import SparseLinear
from peft_sparse.core.selection import BlockGrid, random_indices

from .models import MODELS, inputs, randomize_values, sparse_layers, tiny_llama


def _dense_reference(x, weight, bias, indices, values):
    """y = x (W + Σ scatter)ᵀ + b built from a dense masked delta with plain autograd."""
    delta = torch.zeros(weight.numel(), dtype=weight.dtype)
    for idx, val in zip(indices, values):
        delta = delta.index_add(0, idx.long(), val.to(weight.dtype))
    return torch.nn.functional.linear(x, weight + delta.view_as(weight), bias)


def _problem(dtype=torch.float64, out_features=7, in_features=5, counts=(6, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, dtype=dtype, generator=g)
    bias = torch.randn(out_features, dtype=dtype, generator=g, requires_grad=True)
    x = torch.randn(2, 3, in_features, dtype=dtype, generator=g, requires_grad=True)
    indices = [random_indices(weight.numel(), c, g).to(torch.int32) for c in counts]
    values = [torch.randn(c, dtype=dtype, generator=g, requires_grad=True) for c in counts]
    return x, weight, bias, indices, values


class _Hooks:
    def __init__(self, method="auto", consumer=None):
        self.value_grad_method = method
        self.dense_grad_consumer = consumer
        self.dense_grad_count = 0


@pytest.mark.parametrize("method", ["dense", "sddmm"])
def test_gradcheck_float64(method):
    x, weight, bias, indices, values = _problem()
    hooks = _Hooks(method)

    def fn(x, bias, v0, v1):
        return sparse_delta_linear(x, lambda: weight, bias, indices, [v0, v1], hooks=hooks)

    assert torch.autograd.gradcheck(fn, (x, bias, *values))


@pytest.mark.parametrize("method", ["dense", "sddmm", "auto"])
def test_matches_dense_masked_delta(method):
    x, weight, bias, indices, values = _problem(dtype=torch.float32, out_features=33, in_features=17, counts=(40, 25))
    y = sparse_delta_linear(x, lambda: weight, bias, indices, values, hooks=_Hooks(method))
    grad = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, bias, *values), grad)
    xr, br = x.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    vr = [v.detach().clone().requires_grad_() for v in values]
    yr = _dense_reference(xr, weight, br, indices, vr)
    want = torch.autograd.grad(yr, (xr, br, *vr), grad)
    torch.testing.assert_close(y, yr)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the value gradient is the dense weight gradient gathered at the indices (Eq. 7.4)
    dW = grad.reshape(-1, 33).t().mm(x.detach().reshape(-1, 17))
    for idx, g in zip(indices, got[2:]):
        torch.testing.assert_close(g, dW.view(-1)[idx.long()], rtol=1e-5, atol=1e-5)


def test_nothing_weight_sized_is_saved_and_base_gets_no_grad():
    torch.manual_seed(0)
    base = nn.Linear(24, 40)
    base.weight.requires_grad_(False)
    base.bias.requires_grad_(False)
    layer = SparseLinear(base, "probe")
    layer.update_layer("default", random_indices(base.weight.numel(), 30, torch.Generator().manual_seed(0)), torch.float32)
    with torch.no_grad():
        layer.sparse_values["default"].normal_()
    x = torch.randn(3, 5, 24, requires_grad=True)  # 3*5*24 = 360 elements, W has 960
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    assert saved, "the hook saw nothing: the test would pass vacuously"
    assert all(t.numel() != base.weight.numel() for t in saved), [t.shape for t in saved]
    assert max(t.numel() for t in saved) == x.numel()
    y.square().sum().backward()
    assert base.weight.grad is None and base.bias.grad is None
    assert layer.sparse_values["default"].grad is not None and x.grad is not None


def test_dense_gradient_seam_fires_only_when_armed():
    torch.manual_seed(0)
    base = nn.Linear(12, 9).requires_grad_(False)
    layer = SparseLinear(base, "probe")
    layer.update_layer("default", random_indices(base.weight.numel(), 10, torch.Generator().manual_seed(1)), torch.float32)
    x = torch.randn(4, 12)
    layer(x).sum().backward()
    assert layer.dense_grad_count == 0
    received = []
    layer.dense_grad_consumer = lambda hooks, dW: received.append(dW.clone())
    y = layer(x)
    grad = torch.randn_like(y)
    y.backward(grad)
    assert layer.dense_grad_count == 1 and len(received) == 1
    torch.testing.assert_close(received[0], grad.t().mm(x))
    layer.dense_grad_consumer = None
    layer(x).sum().backward()
    assert layer.dense_grad_count == 1


def test_conv1d_uses_logical_out_in_indices():
    torch.manual_seed(0)
    conv = Conv1D(nf=6, nx=4).requires_grad_(False)  # stores (in=4, out=6)
    linear = nn.Linear(4, 6).requires_grad_(False)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    indices = torch.tensor([0, 5, 13, 23])  # rows 0,1,3,5 of the (6, 4) matrix
    a, b = SparseLinear(conv, "conv"), SparseLinear(linear, "linear")
    for layer in (a, b):
        layer.update_layer("default", indices, torch.float32)
        with torch.no_grad():
            layer.sparse_values["default"].copy_(torch.tensor([1.0, -2.0, 3.0, 0.5]))
    x = torch.randn(3, 4)
    torch.testing.assert_close(a(x), b(x))
    torch.testing.assert_close(a.logical_delta("default"), b.logical_delta("default"))
    assert a.logical_delta("default")[1, 1] == -2.0
    # PEFT's get_delta_weight is in the stored layout: W' = W + ΔW for Conv1D's (in, out) weight too
    torch.testing.assert_close(a.get_delta_weight("default"), b.get_delta_weight("default").t())
    assert a.get_delta_weight("default").shape == conv.weight.shape
    a.merge()
    torch.testing.assert_close(a.get_base_layer().weight.t(), b.merged_weight())


def test_sddmm_reference_chunks(monkeypatch):
    monkeypatch.setattr(devices, "REFERENCE_CHUNK_BYTES", 64)
    g = torch.Generator().manual_seed(0)
    go, x = torch.randn(9, 5, generator=g), torch.randn(9, 4, generator=g)
    idx = torch.arange(20)
    got = kernels.value_gradient(go, x, idx, 5, 4, method="sddmm")
    torch.testing.assert_close(got, go.t().mm(x).view(-1))
    with pytest.raises(ValueError, match="method='bogus'"):
        kernels.value_gradient(go, x, idx, 5, 4, method="bogus")


def test_autocast_bfloat16_cpu():
    x, weight, bias, indices, values = _problem(dtype=torch.float32, out_features=16, in_features=8, counts=(10,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = sparse_delta_linear(x, lambda: weight, bias, indices, values, hooks=_Hooks())
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert values[0].grad.dtype == torch.float32
    ref = _dense_reference(x.detach(), weight, bias.detach(), indices, [v.detach() for v in values])
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=5e-2)


def _inputs_kept_case(rebuild, monkeypatch, dtype, device: str = "cpu", block_shape=(1, 1)):
    """Train-mode forward of a tiny Llama; which layer inputs are still alive after forward, and the
    value gradients after backward. Block adapters take the block kernel whatever the cost model says."""
    import gc
    import weakref

    from peft import get_peft_model

    from peft_sparse import SpIELConfig
    from peft_sparse.core import dispatch

    from .models import inputs, randomize_values, sparse_layers, tiny_llama

    if rebuild is False:
        monkeypatch.setattr(dispatch.STEPS, "input_rebuild", lambda x, mode="all": None)
    targets = ["q_proj", "k_proj", "gate_proj", "up_proj", "down_proj"]
    config = SpIELConfig(target_modules=targets, density=0.3, block_shape=block_shape)
    model = get_peft_model(tiny_llama(dtype=dtype), config).to(device)
    randomize_values(model, scale=0.1)
    model.train()
    for layer in sparse_layers(model):
        if isinstance(rebuild, str):
            layer.rebuild_inputs = rebuild
        if block_shape != (1, 1):
            layer.value_grad_method = "block"
    seen, handles = {}, []
    for layer in sparse_layers(model):
        if ".layers.1." in layer.module_name:  # layer 0 reads the embeddings, which need no gradient
            kind = layer.module_name.rsplit(".", 1)[1]
            handles.append(layer.register_forward_pre_hook(lambda m, args, kind=kind: seen.__setitem__(kind, weakref.ref(args[0]))))
    x = inputs().to(device)
    loss = model(x, labels=x).loss
    for h in handles:
        h.remove()
    gc.collect()
    alive = {kind: ref() is not None for kind, ref in seen.items()}
    loss.backward()
    return alive, [layer.sparse_values["default"].grad.clone() for layer in sparse_layers(model)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_inputs_are_rebuilt_not_kept(monkeypatch, dtype):
    """down_proj's input silu(gate) ⊙ up, and (in 16-bit models) the RMSNorm outputs feeding q/k and
    gate/up, are not held for backward — autograd keeps what they are made of — and the value
    gradients are bit-identical to keeping them."""
    alive, grads = _inputs_kept_case(True, monkeypatch, dtype)
    alive_kept, grads_kept = _inputs_kept_case(False, monkeypatch, dtype)
    assert all(alive_kept.values()) and set(alive) == {"q_proj", "k_proj", "gate_proj", "up_proj", "down_proj"}
    assert not alive["down_proj"]
    norm_rebuilt = dtype == torch.bfloat16
    for kind in ("q_proj", "k_proj", "gate_proj", "up_proj"):
        assert alive[kind] is not norm_rebuilt, kind
    for a, b in zip(grads, grads_kept):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_kernel_forms_the_gated_activation_from_its_factors(monkeypatch, dtype):
    """A block adapter on down_proj takes silu(gate) and up instead of their product (the kernel
    multiplies tile by tile); the value gradients are bit-identical to keeping the product (here the
    blocks are grouped alike either way)."""
    from peft_sparse.accel import input_rebuild as rebuilds

    taken = []
    original = rebuilds.InputRebuild.factors
    monkeypatch.setattr(rebuilds.InputRebuild, "factors", lambda self: taken.append(original(self)) or taken[-1])
    alive, grads = _inputs_kept_case(True, monkeypatch, dtype, block_shape=(16, 16))
    assert not alive["down_proj"] and sum(f is not None for f in taken) == 2  # down_proj of both layers
    alive_kept, grads_kept = _inputs_kept_case(False, monkeypatch, dtype, block_shape=(16, 16))
    assert all(alive_kept.values())
    for a, b in zip(grads, grads_kept):
        assert torch.equal(a, b)


def test_rebuild_inputs_modes(monkeypatch):
    """"products" rebuilds only the gated activation, "none" keeps every input; gradients never change."""
    _, grads = _inputs_kept_case(True, monkeypatch, torch.bfloat16)
    alive, grads_products = _inputs_kept_case("products", monkeypatch, torch.bfloat16)
    assert not alive["down_proj"] and all(alive[k] for k in ("q_proj", "k_proj", "gate_proj", "up_proj"))
    alive, grads_none = _inputs_kept_case("none", monkeypatch, torch.bfloat16)
    assert all(alive.values())
    for a, b, c in zip(grads, grads_products, grads_none):
        assert torch.equal(a, b) and torch.equal(a, c)
    from peft import get_peft_model

    from peft_sparse import SpIELConfig

    from .models import sparse_layers, tiny_llama

    layer = sparse_layers(get_peft_model(tiny_llama(), SpIELConfig(target_modules=["q_proj"], density=0.1)))[0]
    with pytest.raises(ValueError, match="rebuild_inputs='some'"):
        layer.rebuild_inputs = "some"


def test_input_rebuild_patterns():
    """What is recognised, and that a rebuild repeats the forward's bits; readers of one X share a record."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from peft_sparse.accel import input_rebuild as rebuilds



    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(3, 4, requires_grad=True)
    x = a * b
    first, second = rebuilds.input_rebuild(x), rebuilds.input_rebuild(x)
    assert first is second and first.pending == 2
    assert torch.equal(first.get(), x) and first.value is not None  # kept for the second reader
    assert torch.equal(first.get(), x) and first.value is None  # dropped after the last
    assert rebuilds.input_rebuild(a * torch.randn(4)) is None  # one factor kept, the other a leaf
    assert rebuilds.input_rebuild(a * b.detach()) is None  # one factor not kept
    with torch.autograd.graph.save_on_cpu():
        assert rebuilds.input_rebuild(a * b) is None
    norm = LlamaRMSNorm(4).to(torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        norm.weight.normal_()
    h = torch.randn(2, 3, 4, dtype=torch.bfloat16, requires_grad=True)
    y = norm(h)
    record = rebuilds.input_rebuild(y)
    assert record is not None and record.inner is not None
    assert torch.equal(record.get(), y)
    assert rebuilds.input_rebuild(LlamaRMSNorm(4).requires_grad_(False)(h.float())) is None  # float32: cast target unknown


def test_input_rebuild_table_forgets_dead_records():
    """The table of rebuild records holds them weakly: a record dies with the autograd graph that holds
    it, its entry is dropped as the table grows (it stays bounded over many passes), and a new node
    never gets a dead node's record — even at a reused address. Readers of one X, also not in a row,
    share its record while it lives."""
    from peft_sparse.accel import input_rebuild as rebuilds

    a = torch.randn(3, 4, requires_grad=True)
    kept = []  # live nodes (their ids stay taken) whose records died: only pruning removes their entries
    for _ in range(3000):
        kept.append(a * a)
        assert rebuilds.input_rebuild(kept[-1]) is not None
    assert len(rebuilds._REBUILDS) < 2 * 1024
    assert all(rebuilds._registered(x.grad_fn) is None for x in kept)
    del kept
    x, y = a * 2.0 * a, a * a
    first = rebuilds.input_rebuild(x)
    other = rebuilds.input_rebuild(y)
    assert rebuilds.input_rebuild(x) is first and first.pending == 2 and other is not first
    node = x.grad_fn
    del first, other
    # (the records live only in the table now: dead, though the node lives on)
    assert rebuilds._registered(node) is None
    fresh = rebuilds.input_rebuild(x)
    assert fresh.node is node and fresh.pending == 1


def test_input_rebuild_table_in_several_threads():
    """Forward passes in several threads (nn.DataParallel's replicas) register and prune rebuild records
    at once without an error: the pruning copies the table's items in one step and removes an entry only
    while its reference is dead."""
    import collections
    import sys
    import threading

    from peft_sparse.accel import input_rebuild as rebuilds



    a = torch.randn(2, 2, requires_grad=True)
    errors = []

    def work():
        alive = collections.deque(maxlen=1500)  # live nodes whose records die at once: the table grows, prunes
        for _ in range(6000):
            x = a * a
            alive.append(x)
            try:
                assert rebuilds.input_rebuild(x) is not None
            except Exception as error:  # (collected: an exception in a thread does not fail the test by itself)
                errors.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (threads switch often: a race shows within this many registrations)
    try:
        threads = [threading.Thread(target=work) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []


def test_input_made_inside_a_checkpoint_region_is_kept():
    """X = silu(gate) ⊙ up computed inside a non-reentrant checkpoint and read outside it: its factors
    were packed by the checkpoint's hooks, so X is kept (unpacking them in forward would spend the
    checkpoint's single unpack) and backward runs, with the gradients of rebuild_inputs="none"."""
    from peft import get_peft_model
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    from peft_sparse import SpIELConfig

    from .models import randomize_values, sparse_layers

    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up, self.down = nn.Linear(16, 24), nn.Linear(16, 24), nn.Linear(24, 16)

        def forward(self, x):
            act = checkpoint(lambda x: nn.functional.silu(self.gate(x)) * self.up(x), x, use_reentrant=False)
            return self.down(act)

    torch.manual_seed(0)
    model = get_peft_model(Gated(), SpIELConfig(target_modules=["down"], density=0.3))
    randomize_values(model, scale=0.3)
    model.train()
    x = torch.randn(4, 16, requires_grad=True)
    grads = []
    for mode in ("all", "none"):
        for layer in sparse_layers(model):
            layer.rebuild_inputs = mode
            layer.sparse_values["default"].grad = None
        x.grad = None
        model(x).square().sum().backward()
        grads.append((x.grad.clone(), sparse_layers(model)[0].sparse_values["default"].grad.clone()))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_direct_autograd_apply_keeps_functorch_behaviour():
    """The sparse autograd function is applied without torch.autograd.Function.apply's Python wrapper,
    except while functorch transforms are active — there the wrapper's own error (the function defines no
    setup_context) is raised, as through Function.apply — and under torch.compile, which gives the same
    output and value gradients as eager."""
    w = torch.randn(4, 6)
    indices, values = torch.tensor([1, 7, 20]), torch.randn(3, requires_grad=True)
    x = torch.randn(2, 6)
    y = sparse_delta_linear(x, lambda: w, None, [indices], [values])
    want = torch.nn.functional.linear(x, (w.reshape(-1).index_add(0, indices, values.detach())).view_as(w))
    assert torch.equal(y, want)
    y.sum().backward()
    assert values.grad is not None
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda v: sparse_delta_linear(x, lambda: w, None, [indices], [v]).sum())(values.detach())
    compiled_values = values.detach().clone().requires_grad_()
    compiled = torch.compile(lambda x: sparse_delta_linear(x, lambda: w, None, [indices], [compiled_values]), backend="eager")
    out = compiled(x)
    assert torch.equal(out, want)
    out.sum().backward()
    assert torch.equal(compiled_values.grad, values.grad)


def test_direct_autograd_apply_unwraps_dead_functorch_wrappers():
    """A tensor that escaped a finished functorch transform (a dead wrapper), passed as the values,
    keeps its gradient through the direct apply, as through Function.apply."""
    from peft_sparse.core.functional import SparseDeltaLinear

    w = torch.randn(4, 6)
    indices = torch.tensor([1, 7, 20])
    x = torch.randn(2, 6)

    class Hooks:
        dense_grad_consumer, dense_grad_count, value_grad_method, rebuild_inputs = None, 0, "auto", "all"

    grads = []
    for through_wrapper in (True, False):
        base = torch.ones(3, requires_grad=True)
        leaked = []
        torch.func.vjp(lambda v: leaked.append(v * 2) or v.sum(), base)
        assert torch._C._functorch.is_functorch_wrapped_tensor(leaked[0])
        if through_wrapper:
            y = SparseDeltaLinear.apply(x, None, (lambda: w, False, Hooks(), None, None, 1), indices, leaked[0])
        else:
            y = sparse_delta_linear(x, lambda: w, None, [indices], [leaked[0]], hooks=Hooks())
        y.sum().backward()
        grads.append(base.grad)
    assert grads[1] is not None and torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("adapters", [1, 2])
def test_given_weight_linear_equals_sparse_delta_linear(adapters):
    """GivenWeightLinear (the forward multiplies by a merged weight the caller built) gives the outputs and
    the input, bias and value gradients of SparseDeltaLinear bit for bit: a bias, a bfloat16 weight under
    a float32 input, one or two adapters."""
    from peft_sparse.accel.steady import GivenWeightLinear
    from peft_sparse.core.functional import SparseDeltaLinear, compose_weight

    torch.manual_seed(0)
    w = torch.randn(8, 12, dtype=torch.bfloat16)
    indices = [random_indices(w.numel(), 10, torch.Generator().manual_seed(a)) for a in range(adapters)]

    class Hooks:
        dense_grad_consumer, dense_grad_count, value_grad_method, rebuild_inputs = None, 0, "auto", "all"

    results = []
    for given in (True, False):
        values = [torch.randn(10, generator=torch.Generator().manual_seed(a), requires_grad=True) for a in range(adapters)]
        bias = torch.randn(8, generator=torch.Generator().manual_seed(9), requires_grad=True)
        x = torch.randn(3, 5, 12, generator=torch.Generator().manual_seed(7), requires_grad=True)
        spec = (lambda: w.clone(), True, Hooks(), None, None, adapters)
        if given:
            merged = compose_weight(w, indices, [v.detach() for v in values], w.dtype, owned=False)
            y = GivenWeightLinear.apply(x, merged, bias, spec, *indices, *values)
        else:
            y = SparseDeltaLinear.apply(x, bias, spec, *indices, *values)
        y.float().pow(2).sum().backward()
        results.append((y, x.grad, bias.grad, *[v.grad for v in values]))
    for a, b in zip(*results):
        assert a is not None and torch.equal(a, b)



def test_broadcast_shortcut_agrees_with_the_broadcast():
    """The quick answers of ``_broadcasts_to`` (one shape is X's, the other X's, per row or per column)
    are the full broadcast's, for matching and mismatching shapes alike."""
    from itertools import product

    from peft_sparse.accel.input_rebuild import _broadcast, _broadcasts_to

    shape = torch.Size([2, 3, 4])
    others = [(2, 3, 4), (4,), (2, 3, 1), (1, 3, 4), (3, 4), (1,), (), (2, 1, 4), (2, 3, 5), (5,), (2, 3, 2), (3, 1), (1, 1, 1), (2, 2, 4)]
    for a, b in product(others, repeat=2):
        a, b = torch.Size(a), torch.Size(b)
        assert _broadcasts_to(shape, a, b) == (_broadcast(a, b) == tuple(shape)), (a, b)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("block_shape", [(1, 1), (4, 4)])
def test_forward_under_inference_mode_equals_no_grad(name, block_shape):
    """A trainable adapter's forward pass under ``torch.inference_mode`` (generation pipelines use it), in
    training and in eval mode, gives the bits of the same pass under ``torch.no_grad``; training passes
    before and after it agree with each other; an inference tensor fed to a pass that autograd tracks
    fails with torch's own error, as ``nn.Linear`` does."""
    build, targets, logits = MODELS[name]
    model = get_peft_model(build(), SparseFTConfig(target_modules=targets, density=0.25, block_shape=block_shape))
    randomize_values(model, scale=0.05)
    x = inputs()
    for mode in ("train", "eval"):
        getattr(model, mode)()
        first = logits(model(input_ids=x))  # a tracked pass first: its steady memo must not leak into the next ones
        with torch.no_grad():
            want = logits(model(input_ids=x))
        with torch.inference_mode():
            got = logits(model(input_ids=x))
        assert got.is_inference() and torch.equal(got, want), mode
        again = logits(model(input_ids=x))
        assert torch.equal(again, first) and again.requires_grad, mode
        again.sum().backward()
        assert all(layer.sparse_values["default"].grad is not None for layer in sparse_layers(model))
        model.zero_grad()
    model.train()
    layer = sparse_layers(model)[0]
    with torch.inference_mode():
        h = torch.randn(2, 3, layer.in_features)
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        layer(h)


@pytest.mark.parametrize("merge", [True, False])
def test_double_backward_is_refused(merge):
    """A backward pass that builds a graph (``create_graph=True``, e.g. a gradient penalty) through a sparse
    layer is refused with a clear error — on the first pass, on a steady pass of a layer merged in place and
    on the transient path — instead of giving second derivatives that miss the adapter's dependence."""
    torch.manual_seed(0)
    model = get_peft_model(nn.Sequential(nn.Linear(8, 6)), SparseFTConfig(target_modules=["0"], density=0.5))
    randomize_values(model, scale=0.3)
    layer = sparse_layers(model)[0]
    layer.merge_for_training = merge
    model.train()
    optimizer = torch.optim.SGD([layer.sparse_values["default"]], lr=0.0)
    for step in range(3):  # (the second and third passes are steady ones where the layer merges in place)
        x = torch.randn(4, 8, requires_grad=True)
        with pytest.raises(RuntimeError, match="do not support double backward"):
            torch.autograd.grad((layer(x) ** 2).sum(), x, create_graph=True)
        layer(x).sum().backward()  # first order: as ever
        assert layer.sparse_values["default"].grad is not None
        optimizer.step()
        optimizer.zero_grad()


def _saved_adapter(path, config) -> torch.Tensor:
    """Save a tiny Llama's adapter of ``config`` with random non-zero values to ``path``; returns inputs for it."""
    model = get_peft_model(tiny_llama(), config)
    randomize_values(model, scale=0.1)
    model.save_pretrained(path)
    return inputs()


def test_block_adapter_loaded_under_inference_mode(tmp_path):
    """A block adapter created or loaded under ``torch.inference_mode`` (its indices inference tensors, which
    have no version counter) runs inside and outside inference mode with the outputs of one loaded normally,
    and its block layout follows an in-place edit of its indices made inside inference mode."""
    x = _saved_adapter(tmp_path, SparseFTConfig(target_modules="all-linear", density=0.25, block_shape=(4, 4)))
    with torch.no_grad():
        want = PeftModel.from_pretrained(tiny_llama(), tmp_path).eval()(x).logits
    with torch.inference_mode():
        loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path).eval()
        assert sparse_layers(loaded)[0].sparse_indices["default"].is_inference()
        assert torch.equal(loaded(x).logits, want)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, want)
    layer = sparse_layers(loaded)[0]
    grid = BlockGrid(layer.out_features, layer.in_features, (4, 4))
    blocks = grid.units(layer.sparse_indices["default"])
    others = torch.tensor([b for b in range(grid.numel) if b not in set(blocks.tolist())][: blocks.numel()])
    assert others.numel() == blocks.numel()
    assert torch.equal(layer.block_metadata("default").block_numbers(), blocks)
    with torch.inference_mode():  # an in-place edit inside inference mode: the layout follows it
        layer.sparse_indices["default"].copy_(grid.expand(others).to(layer.sparse_indices["default"].dtype))
    assert torch.equal(layer.block_metadata("default").block_numbers(), others)


def test_merging_into_a_base_made_under_inference_mode(tmp_path):
    """A base model loaded under ``torch.inference_mode`` merges an adapter inside inference mode (the same
    outputs as merging a normally loaded one) and refuses to outside it with a clear error naming the module."""
    x = _saved_adapter(tmp_path, SparseFTConfig(target_modules=["q_proj"], density=0.25))
    with torch.no_grad():
        want = PeftModel.from_pretrained(tiny_llama(), tmp_path).merge_and_unload()(x).logits
    with torch.inference_mode():
        loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path)
    with pytest.raises(RuntimeError, match=r"model.layers.0.self_attn.q_proj: the base weight was created under torch.inference_mode"):
        loaded.merge_adapter()
    with torch.inference_mode():
        loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path)
        assert torch.equal(loaded.merge_and_unload()(x).logits, want)
