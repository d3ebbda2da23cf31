"""Steady merged passes of layers that read the same input (q/k/v, gate/up) run as one autograd node.

Outputs and gradients are the separate layers' bit for bit. Anything that breaks the pattern — a layer that does not come, comes with another input or another
weight — is seen, and the layers then run alone.
"""

import copy

import pytest
import torch
from peft import get_peft_model
from torch import nn
from torch.utils.checkpoint import checkpoint

from peft_sparse import SM3, SparseFTConfig, SpIELConfig, SpIELScheduler

from .models import inputs, randomize_values, sparse_layers, tiny_llama

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _node_counts(root) -> dict:
    """Type name → number of nodes in the autograd graph below ``root`` (nodes held while walking: a
    built-in node's Python object lives only while referenced, so a freed one's id can come back)."""
    counts, stack, seen = {}, [root], {}
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        counts[type(node).__name__] = counts.get(type(node).__name__, 0) + 1
        stack.extend(f for f, _ in node.next_functions)
    return counts


def _steady_llama(dtype, steps: int = 3, block_shape=(1, 1), device: str = "cpu"):
    """A tiny Llama with every projection targeted, a SpIEL scheduler attached (its layers' observers are
    idle) and ``steps`` SM3 steps taken: its passes are steady and its groups found."""
    config = SpIELConfig(target_modules=ALL_LINEAR, density=0.25, growth="ma", reselection_steps=50, block_shape=block_shape)
    model = get_peft_model(tiny_llama(dtype=dtype), config).to(device)
    randomize_values(model, scale=0.1)
    opt = SM3([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = SpIELScheduler(model, opt, total_steps=200)
    x = inputs().to(device)
    model.train()
    for _ in range(steps):
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt, scheduler, x


def _pass(model, x):
    """(loss, input-embedding gradient, values' gradients, graph node counts) of one training pass."""
    embeds = model.get_input_embeddings()(x).detach().requires_grad_()
    loss = model(inputs_embeds=embeds, labels=x).loss
    counts = _node_counts(loss.grad_fn)
    loss.backward()
    grads = []
    for layer in sparse_layers(model):
        grads.append(layer.sparse_values["default"].grad)
        layer.sparse_values["default"].grad = None
    return loss.detach(), embeds.grad, grads, counts


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("block_shape", [(1, 1), (16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_reading_one_input_run_as_one_node(dtype, block_shape, device):
    """q/k/v and gate/up become one node each per decoder layer, with the separate layers' loss, input
    gradient and value gradients bit for bit (on CUDA through the compiled kernels)."""
    model, _, _, x = _steady_llama(dtype, block_shape=block_shape, device=device)
    layers = sparse_layers(model)
    n_decoder = len(model.base_model.model.model.layers)
    grouped = _pass(model, x)
    assert grouped[3].get("SharedInputLinearBackward") == 2 * n_decoder
    assert grouped[3].get("MergedDeltaLinearBackward") == 2 * n_decoder  # o_proj, down_proj
    for layer in layers:
        layer.group_shared_inputs = False
    alone = _pass(model, x)
    assert "SharedInputLinearBackward" not in alone[3] and alone[3]["MergedDeltaLinearBackward"] == 7 * n_decoder
    assert torch.equal(grouped[0], alone[0]) and torch.equal(grouped[1], alone[1])
    assert all(torch.equal(a, b) for a, b in zip(grouped[2], alone[2]))


class _Heads(nn.Module):
    """Three linear layers on one input; ``mode`` picks which run and on what."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 12), nn.Linear(16, 8), nn.Linear(16, 4, bias=False)
        self.to(dtype)
        self.mode = "all"
        g = torch.Generator().manual_seed(5)
        self.r = [torch.randn(3, 5, n, generator=g).to(dtype) for n in (12, 8, 4)]

    def forward(self, x):
        if self.mode == "leaf":  # the layers read the model's input itself (no history: never grouped)
            return [self.a(x), self.b(x), self.c(x)]
        x = x * 1.0  # (an input with history, as a norm's output is)
        if self.mode == "all":
            ys = [self.a(x), self.b(x), self.c(x)]
        elif self.mode == "a-only":
            ys = [self.a(x)]
        elif self.mode == "b-elsewhere":  # b reads a copy of X
            ys = [self.a(x), self.b(x.clone()), self.c(x)]
        elif self.mode == "checkpointed":
            ys = list(checkpoint(lambda x: (self.a(x), self.b(x), self.c(x)), x, use_reentrant=False))
        elif self.mode == "members-checkpointed":  # a outside the checkpoint, b and c inside it

            def region(x):  # (with a product after b and c that saves tensors, as most regions do)
                yb, yc = self.b(x), self.c(x)
                return yb, yc + 0.0 * (yc * yc)

            ys = [self.a(x), *checkpoint(region, x, use_reentrant=False)]
        elif self.mode == "raise-after-a":  # e.g. out of memory between the projections
            self.a(x)
            raise torch.OutOfMemoryError("simulated")
        return sum((y * r).sum() for y, r in zip(ys, self.r))


def _steady_heads(steps: int = 3, dtype=torch.float32):
    torch.manual_seed(0)
    model = get_peft_model(_Heads(dtype), SparseFTConfig(target_modules=["a", "b", "c"], density=0.25))
    heads = model.base_model.model
    heads.theta0 = {name: getattr(heads, name).logical_weight().detach().clone() for name in "abc"}  # (frozen: the reference reads it)
    randomize_values(model, scale=0.2)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    model.train()
    for _ in range(steps):
        model(x).backward()
        opt.step()
        opt.zero_grad()
    return model, opt, x


def _reference(model, x):
    """Loss, input gradient and values' gradients by plain autograd of the dense delta in float64."""
    heads = model.base_model.model
    x64 = x.detach().double().requires_grad_()
    values = {name: getattr(heads, name).sparse_values["default"].detach().double().requires_grad_() for name in "abc"}
    ys = {}
    for name in "abc":
        layer = getattr(heads, name)
        theta0 = heads.theta0[name].double()
        w = theta0.reshape(-1).index_add(0, layer.sparse_indices["default"].long(), values[name]).view_as(theta0)
        bias = layer.get_base_layer().bias
        ys[name] = nn.functional.linear(x64, w, None if bias is None else bias.detach().double())
    mode = heads.mode
    used = "a" if mode == "a-only" else "abc"
    loss = sum((ys[n] * heads.r["abc".index(n)].double()).sum() for n in used)
    loss.backward()
    return loss.detach(), x64.grad, {n: values[n].grad for n in "abc"}


def _heads_pass(model, x):
    heads = model.base_model.model
    xg = x.detach().clone().requires_grad_()
    loss = model(xg)
    counts = _node_counts(loss.grad_fn)
    loss.backward()
    grads = {}
    for name in "abc":
        values = getattr(heads, name).sparse_values["default"]
        grads[name], values.grad = values.grad, None
    return loss.detach(), xg.grad, grads, counts


def _assert_matches_reference(result, reference, skipped=()):
    loss, x_grad, grads, _ = result
    torch.testing.assert_close(loss.double(), reference[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_grad.double(), reference[1], rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        if name in skipped:
            assert grad is None, name
        else:
            torch.testing.assert_close(grad.double(), reference[2][name], rtol=1e-5, atol=1e-5)


def test_a_group_gives_autograds_gradients_of_the_dense_delta():
    model, _, x = _steady_heads()
    result = _heads_pass(model, x)
    assert result[3].get("SharedInputLinearBackward") == 1 and "MergedDeltaLinearBackward" not in result[3]
    _assert_matches_reference(result, _reference(model, x))


def test_a_layer_that_does_not_come_gets_no_gradient_and_the_group_is_found_again():
    model, _, x = _steady_heads()
    heads = model.base_model.model
    heads.mode = "a-only"  # a's node computes b's and c's outputs too; nobody reads them
    result = _heads_pass(model, x)
    assert result[3].get("SharedInputLinearBackward") == 1
    reference = _reference(model, x)
    _assert_matches_reference(result, reference, skipped="bc")
    heads.mode = "all"
    result = _heads_pass(model, x)  # the group was dropped: each layer alone, and found again
    assert result[3].get("MergedDeltaLinearBackward") == 3 and "SharedInputLinearBackward" not in result[3]
    _assert_matches_reference(result, _reference(model, x))
    result = _heads_pass(model, x)
    assert result[3].get("SharedInputLinearBackward") == 1
    _assert_matches_reference(result, _reference(model, x))


def test_a_layer_on_another_input_or_changed_values_runs_alone():
    model, opt, x = _steady_heads()
    heads = model.base_model.model
    heads.mode = "b-elsewhere"  # b's call brings another tensor: its stashed output is not used
    result = _heads_pass(model, x)
    assert result[3].get("SharedInputLinearBackward") == 1 and result[3].get("MergedDeltaLinearBackward") == 1
    _assert_matches_reference(result, _reference(model, x))
    heads.mode = "all"
    result = _heads_pass(model, x)  # dropped: alone
    assert result[3].get("MergedDeltaLinearBackward") == 3 and "SharedInputLinearBackward" not in result[3]
    result = _heads_pass(model, x)  # found again
    assert result[3].get("SharedInputLinearBackward") == 1
    _assert_matches_reference(result, _reference(model, x))


def test_values_edited_after_the_group_computed_them_are_seen():
    """b's values edited in place between a's call (which computed b's output) and b's own call: b's
    version counter moved, so b computes its own output from the new values."""
    model, _, x = _steady_heads()
    heads = model.base_model.model
    edits = []

    def edit(module, args):
        with torch.no_grad():
            module.sparse_values["default"].mul_(1.5)
        edits.append(1)

    hook = heads.b.register_forward_pre_hook(edit)
    xg = x.detach().clone().requires_grad_()
    loss = model(xg)
    hook.remove()
    assert edits and _node_counts(loss.grad_fn).get("SharedInputLinearBackward") == 1
    loss.backward()
    grads = {n: getattr(heads, n).sparse_values["default"].grad for n in "abc"}
    reference = _reference(model, x)  # (from the edited values)
    torch.testing.assert_close(loss.double(), reference[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xg.grad.double(), reference[1], rtol=1e-5, atol=1e-5)
    for n in "abc":
        torch.testing.assert_close(grads[n].double(), reference[2][n], rtol=1e-5, atol=1e-5)


def test_a_dense_gradient_consumer_on_a_member_gets_the_dense_gradient():
    """An AG window on one member (a dense-gradient consumer armed on it): that member goes through the
    generic backward inside the group's node, its consumer sees dW, every gradient stays autograd's."""
    model, _, x = _steady_heads()
    heads = model.base_model.model
    seen = []
    heads.b.dense_grad_consumer = lambda layer, dense: seen.append(dense.clone())
    try:
        result = _heads_pass(model, x)
    finally:
        heads.b.dense_grad_consumer = None
    assert result[3].get("SharedInputLinearBackward") == 1 and len(seen) == 1
    reference = _reference(model, x)
    _assert_matches_reference(result, reference)
    dense = (heads.r[1].reshape(-1, 8).T.double() @ x.reshape(-1, 16).double())  # ∂L/∂W_b = Gᵀ X
    torch.testing.assert_close(seen[0].double(), dense, rtol=1e-5, atol=1e-5)


def test_checkpointed_layers_are_never_grouped():
    """Under saved-tensor hooks (a non-reentrant checkpoint) the layers run alone in both the first pass
    and the recomputation, which must save the same tensors."""
    model, _, x = _steady_heads()
    heads = model.base_model.model
    heads.mode = "checkpointed"
    for _ in range(2):
        result = _heads_pass(model, x)
        assert "SharedInputLinearBackward" not in result[3]
        _assert_matches_reference(result, _reference(model, x))


def test_copies_start_without_groups():
    model, _, x = _steady_heads()
    heads = model.base_model.model
    assert heads.a._shared.group == (heads.b, heads.c)
    copied = copy.deepcopy(model)
    assert copied.base_model.model.a._shared.group is None
    assert torch.equal(model(x), copied(x))  # (the copy's first passes run alone)
    assert "SharedInputLinearBackward" not in _node_counts(copied(x).grad_fn)


def test_a_member_kept_alone_leaves_the_others_grouped():
    model, _, x = _steady_heads()
    heads = model.base_model.model
    heads.b.group_shared_inputs = False
    for _ in range(2):
        result = _heads_pass(model, x)
    assert result[3].get("SharedInputLinearBackward") == 1 and result[3].get("MergedDeltaLinearBackward") == 1
    _assert_matches_reference(result, _reference(model, x))


def test_separate_backward_passes_from_an_input_without_history():
    """Outputs of one node free what the node needs at their first backward pass; layers reading an input
    without history (a leaf) are never grouped, so a backward pass per output works as with layers alone."""
    model, _, x = _steady_heads()
    heads = model.base_model.model
    heads.mode = "leaf"
    xg = x.detach().clone().requires_grad_()
    ys = model(xg)
    assert not any(_node_counts(y.grad_fn).get("SharedInputLinearBackward") for y in ys)
    for y, r in zip(ys, heads.r):
        (y * r).sum().backward()
    heads.mode = "all"  # (the reference's loss: the same sum)
    reference = _reference(model, x)
    torch.testing.assert_close(xg.grad.double(), reference[1], rtol=1e-5, atol=1e-5)
    for n in "abc":
        torch.testing.assert_close(getattr(heads, n).sparse_values["default"].grad.double(), reference[2][n], rtol=1e-5, atol=1e-5)


def test_layers_of_two_models_on_one_input_group_within_each_model():
    """Two models reading the same tensor (an ensemble, a teacher and a student) each group their own
    layers; deleting one frees its layers, whatever the other still holds."""
    import gc
    import weakref

    first, opt, x = _steady_heads()
    second, opt2, _ = _steady_heads()
    first.base_model.model.mode = second.base_model.model.mode = "leaf"
    for _ in range(3):
        h = x * 1.0
        loss = sum((y * r).sum() for m in (first, second) for y, r in zip(m(h), m.base_model.model.r))
        loss.backward()
        opt.step()
        opt2.step()
    del loss
    a1, a2 = first.base_model.model.a, second.base_model.model.a
    assert a1._shared.group == (first.base_model.model.b, first.base_model.model.c)
    assert a2._shared.group == (second.base_model.model.b, second.base_model.model.c)
    h = x.detach().clone().requires_grad_() * 1.0
    ys1, ys2 = first(h), second(h)
    assert _node_counts(ys1[2].grad_fn).get("SharedInputLinearBackward") == 1
    assert ys2[1].grad_fn is ys2[2].grad_fn and ys2[1].grad_fn is not ys1[1].grad_fn
    layer = weakref.ref(second.base_model.model.b)
    del second, opt2, ys2, a2
    gc.disable()
    try:
        assert layer() is None
    finally:
        gc.enable()


def test_outputs_nobody_takes_are_dropped_and_hold_no_layer():
    """A pass that raised after the leader's call leaves its members' outputs untaken: the next forward pass
    of the model drops them before it runs (they hold that pass's graph), and its results are autograd's.
    Untaken outputs do not keep their layers alive: deleting the model frees them without the collector."""
    import gc
    import weakref

    model, _, x = _steady_heads()
    heads = model.base_model.model
    heads.mode = "raise-after-a"
    with pytest.raises(torch.OutOfMemoryError):
        model(x.detach().clone().requires_grad_())
    assert heads.b._shared.stash is not None and heads.c._shared.stash is not None
    seen = []
    hook = heads.register_forward_pre_hook(lambda module, args: seen.append((module.b._shared.stash, module.c._shared.stash)))
    heads.mode = "all"
    result = _heads_pass(model, x)
    hook.remove()
    assert seen == [(None, None)]
    _assert_matches_reference(result, _reference(model, x))
    heads.mode = "a-only"
    _heads_pass(model, x)
    assert heads.b._shared.stash is not None  # (b's output, untaken)
    layer = weakref.ref(heads.b)
    del heads
    gc.disable()
    try:
        del model
        assert layer() is None
    finally:
        gc.enable()


def test_members_inside_a_checkpoint_run_alone():
    """The leader outside a non-reentrant checkpoint, its members inside: the members run alone in the
    first pass as in the recomputation (which must save what the first pass saved)."""
    model, _, x = _steady_heads()
    heads = model.base_model.model
    heads.mode = "members-checkpointed"
    for _ in range(2):
        result = _heads_pass(model, x)
        _assert_matches_reference(result, _reference(model, x))


@pytest.mark.parametrize("change", ["edit", "train"])
def test_a_members_bias_changed_after_the_group_computed_its_output_is_seen(change):
    model, _, x = _steady_heads()
    heads = model.base_model.model
    bias = heads.b.get_base_layer().bias

    def pre(module, args):
        with torch.no_grad():
            bias.add_(1.0)
        if change == "train":
            bias.requires_grad_(True)

    hook = heads.b.register_forward_pre_hook(pre)
    result = _heads_pass(model, x)
    hook.remove()
    _assert_matches_reference(result, _reference(model, x))  # (the reference reads the edited bias)
    if change == "train":
        torch.testing.assert_close(bias.grad, heads.r[1].sum((0, 1)))
