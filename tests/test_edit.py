"""The core's mask-editing API: a toy dynamic method, hypernetwork-driven values, and bad input."""

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel, get_peft_model

import peft_sparse
from peft_sparse import SparseFTConfig, SpIELConfig
from peft_sparse.core import edit

from .models import inputs, randomize_values, sparse_layers, tiny_llama


class SwapATenth:
    """A toy dynamic method: every 3 steps, each layer swaps a random tenth of its indices for random
    inactive ones, through the mask-editing API (the core keeps merges, layouts and Adam's state right)."""

    def __init__(self, model, optimizer, seed: int = 0):
        self.model, self.optimizer, self.t = model, optimizer, 0
        self.generator = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        self.t += 1
        if self.t % 3:
            return
        changes = {}
        for layer in sparse_layers(self.model):
            active = layer.sparse_indices["default"].long()
            k = max(1, active.numel() // 10)
            drop = torch.randperm(active.numel(), generator=self.generator)[:k]
            free = torch.ones(layer.numel, dtype=torch.bool)
            free[active] = False
            inactive = torch.nonzero(free).squeeze(1)
            grow = inactive[torch.randperm(inactive.numel(), generator=self.generator)[:k]]
            changes[layer.module_name] = (drop, grow)
        edit.replace(self.model, changes, optimizer=self.optimizer, step=self.t)


def _train_toy(steps: int = 10, block_shape=(1, 1)):
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.2, block_shape=block_shape))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    method = SwapATenth(model, optimizer)
    model.train()
    for step in range(steps):
        x = inputs(seed=step, batch=4, length=9)
        model(x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        method.step()
    return model.eval()


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "reference"])
def test_toy_dynamic_method_equals_a_fresh_model_with_its_indices_and_values(fast, tmp_path):
    with peft_sparse.fast_paths(fast):
        trained = _train_toy()
        x = inputs(seed=99, batch=2, length=9)
        with torch.no_grad():
            out = trained(x).logits
        # a freshly built model holding the same indices and values
        fresh = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.2))
        edit.set_indices(fresh, {layer.module_name: layer.sparse_indices["default"] for layer in sparse_layers(trained)},
                         values={layer.module_name: layer.sparse_values["default"] for layer in sparse_layers(trained)})  # fmt: skip
        with torch.no_grad():
            assert torch.equal(fresh.eval()(x).logits, out)
        # and after save/load
        trained.save_pretrained(tmp_path / "toy")
        loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path / "toy").eval()
        with torch.no_grad():
            assert torch.equal(loaded(x).logits, out)


def test_toy_dynamic_method_is_bit_identical_on_the_fast_and_reference_paths():
    with peft_sparse.fast_paths(True):
        a = _train_toy()
    with peft_sparse.fast_paths(False):
        b = _train_toy()
    for la, lb in zip(sparse_layers(a), sparse_layers(b)):
        assert torch.equal(la.sparse_indices["default"], lb.sparse_indices["default"])
        assert torch.equal(la.sparse_values["default"], lb.sparse_values["default"])


def test_replace_keeps_kept_slots_and_resets_new_ones():
    model = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.2))
    randomize_values(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    x = inputs(seed=1)
    model.train()
    model(x, labels=x).loss.backward()
    optimizer.step()
    layer = sparse_layers(model)[0]
    before_idx = layer.sparse_indices["default"].long().clone()
    before_val = layer.sparse_values["default"].detach().clone()
    before_avg = optimizer.state[layer.sparse_values["default"]]["exp_avg"].clone()
    free = torch.ones(layer.numel, dtype=torch.bool)
    free[before_idx] = False
    grow = torch.nonzero(free).squeeze(1)[:2]
    edit.replace(model, {layer.module_name: ([0, 3], grow, [0.5, -0.25])}, optimizer=optimizer, step=7)
    after_idx = layer.sparse_indices["default"].long()
    kept = torch.ones(before_idx.numel(), dtype=torch.bool)
    kept[[0, 3]] = False
    expected = torch.sort(torch.cat([before_idx[kept], grow])).values
    assert torch.equal(after_idx, expected)
    values = layer.sparse_values["default"].detach()
    avg = optimizer.state[layer.sparse_values["default"]]["exp_avg"]
    ages = layer.sparse_ages["default"]
    for slot, index in enumerate(after_idx.tolist()):
        if index in grow.tolist():
            assert values[slot] == (0.5 if index == int(grow[0]) else -0.25)
            assert avg[slot] == 0 and ages[slot] == 7
        else:
            old = before_idx.tolist().index(index)
            assert values[slot] == before_val[old] and avg[slot] == before_avg[old] and ages[slot] == 0


def test_replace_and_set_indices_refuse_bad_input():
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.2))
    layer = sparse_layers(model)[0]
    name = layer.module_name
    active = layer.sparse_indices["default"].long()
    with pytest.raises(KeyError, match="no sparse layer named 'nope'"):
        edit.replace(model, {"nope": ([0], [1])})
    with pytest.raises(ValueError, match="1 positions dropped but 2 indices grown"):
        edit.replace(model, {name: ([0], [1, 2])})
    with pytest.raises(ValueError, match="already active"):
        edit.replace(model, {name: ([0], [int(active[1])])})
    with pytest.raises(ValueError, match="outside the tensor"):
        edit.replace(model, {name: ([0], [layer.numel])})
    with pytest.raises(ValueError, match="drop position"):
        edit.replace(model, {name: ([active.numel()], [0])})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with pytest.raises(ValueError, match="new size, which an optimizer cannot follow"):
        edit.set_indices(model, {name: active[:-1]}, optimizer=optimizer)
    with pytest.raises(ValueError, match="2 values for"):
        edit.set_values(model, {name: torch.zeros(2)})


def test_set_indices_with_another_count_makes_new_values():
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.2))
    layer = sparse_layers(model)[0]
    edit.set_indices(model, {layer.module_name: torch.tensor([1, 5, 9])}, values={layer.module_name: torch.tensor([1.0, 2.0, 3.0])})
    assert layer.sparse_indices["default"].tolist() == [1, 5, 9]
    assert layer.sparse_values["default"].tolist() == [1.0, 2.0, 3.0]
    assert layer.sparse_values["default"].requires_grad
    delta = layer.logical_delta("default").reshape(-1)
    assert delta[5] == 2.0 and delta.count_nonzero() == 3


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "reference"])
def test_values_from_a_hypernetwork_get_the_gradients_of_a_dense_delta(fast):
    """φ generated each step by a module: set_values before the pass, values_grad back into the module.
    The module's gradients equal autograd through W + scatter(η, hyper(z)) computed densely."""
    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.1))
    layers = sparse_layers(model)
    sizes = [layer.sparse_values["default"].numel() for layer in layers]
    hyper = torch.nn.Linear(4, sum(sizes))
    z = torch.randn(4)
    x = inputs(seed=3, batch=2, length=8)
    model.train()
    with peft_sparse.fast_paths(fast):
        for _ in range(2):  # two steps: the second pass rewrites what the first left (merges, memos)
            generated = hyper(z)
            edit.set_values(model, {layer.module_name: v for layer, v in zip(layers, generated.split(sizes))})
            loss = model(x, labels=x).loss
            loss.backward()
            hyper.zero_grad()
            generated.backward(edit.values_grad(model))
            ours = [p.grad.clone() for p in hyper.parameters()]
            with torch.no_grad():
                for p in hyper.parameters():
                    p -= 0.1 * p.grad
            model.zero_grad()

            # the dense reference, with the values from before this update
            with torch.no_grad():
                for p in hyper.parameters():
                    p += 0.1 * p.grad
            reference = tiny_llama()
            reference.train()
            names = dict(reference.named_modules())
            weights = {}
            dense = hyper(z)
            for layer, v in zip(layers, dense.split(sizes)):
                w = names[layer.module_name].weight
                delta = torch.zeros(w.numel()).index_add(0, layer.sparse_indices["default"].long(), v)
                weights[layer.module_name + ".weight"] = w.detach() + delta.view_as(w)
            logits = torch.func.functional_call(reference, weights, (x,)).logits
            ref_loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            hyper.zero_grad()
            ref_loss.backward()
            torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
            for a, p in zip(ours, hyper.parameters()):
                torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-6)  # (float32 sums in another order)
            with torch.no_grad():
                for p in hyper.parameters():
                    p -= 0.1 * p.grad


def test_a_deepspeed_optimizer_without_zero_partitions_is_refused_with_the_way_out():
    """A DeepSpeed optimizer other than ZeRO 1/2's (which tests/test_deepspeed.py runs) has no state bridge: SpIEL
    refuses it, naming what runs (SpIEL-AG under ZeRO, DDP, FSDP2)."""
    from peft_sparse import SpIELScheduler

    model = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.1))
    inner = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    zero = type("DeepSpeedZeroOptimizer", (), {"__module__": "deepspeed.runtime.zero.stage_1_and_2"})()
    zero.optimizer = inner
    with pytest.raises(NotImplementedError, match="DeepSpeed optimizer.*SpIEL-AG.*DDP / FSDP2"):
        SpIELScheduler(model, zero, total_steps=10)


@pytest.mark.parametrize("drops, grows", [(5, 5), (9, 2), (0, 7), (12, 0), (40, 40)])
def test_slot_map_without_checks_equals_the_checked_one(drops, grows):
    """``checked=False`` builds the slot map without reading the device (stable sorts for nonzero): the same
    sources, indices and grown positions as the checked path, for equal and unequal counts."""
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["q_proj"], density=0.05))
    layer = sparse_layers(model)[0]
    g = torch.Generator().manual_seed(drops * 100 + grows)
    old = layer.sparse_indices["default"].long()
    drop = torch.randperm(old.numel(), generator=g)[:drops]
    inactive = torch.ones(layer.numel, dtype=torch.bool)
    inactive[old] = False
    candidates = torch.nonzero(inactive).squeeze(1)
    grow = candidates[torch.randperm(candidates.numel(), generator=g)[:grows]]
    checked = edit.slot_map(layer, "default", drop, grow, same_count=False)
    free = edit.slot_map(layer, "default", drop, grow, same_count=False, checked=False)
    for a, b in zip(checked, free):
        assert torch.equal(a, b)
    source, merged, position = free
    assert merged.numel() == old.numel() - drops + grows and bool((merged[1:] > merged[:-1]).all())
    assert torch.equal(merged[position], grow) and bool((source[position] == -1).all())
