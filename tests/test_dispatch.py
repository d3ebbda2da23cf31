"""The core's seam (peft_sparse.core.dispatch): the fast paths plug in there and nowhere else, the switch leaves
only the references, and a new implementation or a new kind of base tensor plugs in without touching the layer."""

import pytest
import torch
from peft import get_peft_model

import peft_sparse
from peft_sparse import SparseFTConfig, SpIELConfig
from peft_sparse.core import dispatch, edit
from peft_sparse.core.layer import SparseLinear

from .models import inputs, randomize_values, sparse_layers, tiny_llama

pytestmark = pytest.mark.fast_only  # (these tests switch the paths themselves)


def _count_fast_calls(monkeypatch) -> dict:
    """Wrap every registered implementation and step so that each call counts (name → calls)."""
    calls: dict = {}

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return function(*args, **kwargs)

        return wrapper

    for kind, entry in dispatch._KINDS.items():
        for attribute in ("memos", "implementations"):
            wrapped = [counted(f"{kind}:{f.__name__}", f) for f in getattr(entry, attribute)]
            monkeypatch.setattr(entry, attribute, wrapped)
    for step in ("base_output", "fused_weight", "input_rebuild", "delta_matrices", "apply"):
        function = getattr(dispatch.STEPS, step)
        if function is not None:
            monkeypatch.setattr(dispatch.STEPS, step, counted(step, function))
    return calls


def _train(steps: int = 3):
    model = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.1, training_merge=True))
    randomize_values(model, scale=0.1)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for step in range(steps):
        x = inputs(seed=step)
        model(x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        logits = model(inputs(seed=9, batch=1, length=1)).logits
    return [layer.sparse_values["default"].detach().clone() for layer in sparse_layers(model)], logits


def test_the_switch_leaves_only_the_references(monkeypatch):
    """Off, no registered implementation or step is asked; on, they take the passes (steady, merged, memos)
    and give the reference's results bit for bit."""
    calls = _count_fast_calls(monkeypatch)
    with peft_sparse.fast_paths(False):
        reference = _train()
    assert calls == {}
    with peft_sparse.fast_paths(True):
        fast = _train()
    assert calls.get("linear:steady_forward", 0) > 0 and calls.get("linear:training_merge_pass", 0) > 0
    assert calls.get("linear:inference_forward", 0) > 0 and calls.get("apply", 0) > 0
    assert all(torch.equal(a, b) for a, b in zip(reference[0], fast[0]))
    assert torch.equal(reference[1], fast[1])


def test_a_new_implementation_plugs_in_without_touching_the_layer(monkeypatch):
    """An implementation registered for a kind takes the passes it accepts (its output is the layer's), declines
    the others (None: the next one, then the reference), and is never asked with the fast paths off."""
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["q_proj", "down_proj"], density=0.2))
    randomize_values(model)
    model.eval()
    x = inputs()
    with torch.no_grad():
        want = model(x).logits
    taken, declined = [], []

    def dense_delta(layer, x, active):  # the eval pass as X·(W + δ)ᵀ + b, δ formed densely
        if torch.is_grad_enabled() or len(active) != 1:
            declined.append(layer)
            return None
        taken.append(layer)
        base = layer.get_base_layer()
        return torch.nn.functional.linear(x, base.weight + layer.get_delta_weight(active[0]), base.bias)

    entry = dispatch._KINDS["linear"]
    monkeypatch.setattr(entry, "memos", [dense_delta])  # (ahead of the inference memo, which would take them)
    with torch.no_grad():
        got = model(x).logits
    assert len(taken) == len(sparse_layers(model)) and not declined
    torch.testing.assert_close(got, want)
    model.train()
    model(x, labels=x).loss.backward()  # training passes: declined, the reference computes them
    assert len(declined) == len(sparse_layers(model)) and len(taken) == len(sparse_layers(model))
    with peft_sparse.fast_paths(False), torch.no_grad():
        model.eval()
        assert torch.equal(model(x).logits, want)
    assert len(taken) == len(sparse_layers(model))


def test_a_new_kind_of_base_tensor_plugs_in_without_touching_the_layer(monkeypatch):
    """A layer whose ``base_kind`` names a kind registered with its own reference is computed by that reference
    (here: the delta applied twice, a stand-in for another parametrisation of the base tensor)."""

    def twice(layer, x, active, args, kwargs):
        y = layer.base_layer(x, *args, **kwargs)
        for name in active:
            y = y + 2 * torch.nn.functional.linear(x, layer.get_delta_weight(name))
        return y

    monkeypatch.setitem(dispatch._KINDS, "twice", dispatch._Kind(twice))
    base = torch.nn.Linear(8, 6)
    layer = SparseLinear(base, "proj")
    layer.update_layer("default", torch.tensor([1, 9, 20, 47]), torch.float32)
    with torch.no_grad():
        layer.sparse_values["default"].copy_(torch.tensor([0.5, -1.0, 2.0, 0.25]))
    x = torch.randn(3, 8)
    once = layer(x)
    layer.base_kind = "twice"
    delta = torch.zeros(48).index_add_(0, layer.sparse_indices["default"], layer.sparse_values["default"].detach()).view(6, 8)
    torch.testing.assert_close(layer(x), base(x) + 2 * x @ delta.t())
    torch.testing.assert_close(once, base(x) + x @ delta.t())


def test_edits_reach_the_listeners(monkeypatch):
    """The mask-editing API announces what it changes: the indices' rewrite (wrapped by the listeners), the
    slots' new sources to the keeper of the optimizer's state, and releases before a resize."""
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["q_proj"], density=0.1))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    heard = []

    class Recorder(dispatch.Listener):
        def release(self, layers, weight_only):
            heard.append(("release", len(layers), weight_only))

        def reindex(self, layers, change):
            heard.append(("reindex", len(layers)))
            change()
            return None

        def slots_changed(self, optimizer, values, source):
            heard.append(("slots", source.tolist()))
            return False  # (not its state: the optimizer's keeper still follows)

    monkeypatch.setattr(dispatch, "LISTENERS", [*dispatch.LISTENERS, Recorder()])
    layer = sparse_layers(model)[0]
    name = layer.module_name
    old = layer.sparse_indices["default"].clone()
    grown = int(torch.isin(torch.arange(layer.numel), old, invert=True).nonzero()[0])
    edit.replace(model, {name: ([0], [grown])}, optimizer=optimizer)
    assert ("reindex", 1) in heard
    source = next(entry[1] for entry in heard if entry[0] == "slots")
    assert source.count(-1) == 1 and sorted(s for s in source if s >= 0) == list(range(1, old.numel()))
    heard.clear()
    edit.set_indices(model, {name: old[:-1]})  # another count: a new values tensor, the layer released first
    assert ("release", 1, False) in heard
