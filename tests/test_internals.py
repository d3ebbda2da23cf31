"""Every torch internal the fast paths use can go missing: the fast paths then fall back and the results
are those of the reference path (``peft_sparse.fast_paths(False)``), bit for bit on CPU."""

import pytest
import torch
from peft import get_peft_model

import peft_sparse
from peft_sparse import SpIELConfig, SpIELScheduler
from peft_sparse.accel import internals

from .models import inputs, sparse_layers, tiny_llama

pytestmark = pytest.mark.fast_only  # (these tests switch the paths themselves)


def _absent(monkeypatch) -> None:
    """Make every internal look absent, as a torch without it would."""
    monkeypatch.setattr(internals, "version", lambda tensor: object())
    monkeypatch.setattr(internals, "saved_tensor", lambda node, name: None)
    monkeypatch.setattr(internals, "node_kind", lambda node: None)
    monkeypatch.setattr(internals, "saved_tensor_hooks_active", lambda: True)
    monkeypatch.setattr(internals, "queue_after_backward", lambda callback: False)
    monkeypatch.setattr(internals, "triton_device_caches", lambda kernel: None)
    monkeypatch.setattr(internals, "module_hooks_anywhere", lambda module: True)


def _train(growth: str, clip: float = 0.0, steps: int = 12):
    config = SpIELConfig(target_modules="all-linear", density=0.1, growth=growth, reselection_steps=4, gradient_estimation_steps=2,
                         training_merge=True)  # fmt: skip
    model = get_peft_model(tiny_llama(), config)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2) if growth == "ag" else peft_sparse.SM3(params, lr=1e-2)
    scheduler = SpIELScheduler(model, optimizer, total_steps=20)
    model.train()
    for step in range(steps):
        x = inputs(seed=step, batch=4, length=9)
        model(x, labels=x).loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return [(m.sparse_indices["default"].clone(), m.sparse_values["default"].detach().clone()) for m in sparse_layers(model)]


@pytest.mark.parametrize("growth", ["ag", "ma"])
def test_with_every_internal_absent_the_fast_paths_give_the_reference_results(growth, monkeypatch):
    with peft_sparse.fast_paths(False):
        reference = _train(growth)
    _absent(monkeypatch)
    with peft_sparse.fast_paths(True):
        fallback = _train(growth)
    for (ia, va), (ib, vb) in zip(reference, fallback):
        assert torch.equal(ia, ib)
        assert torch.equal(va, vb)


def test_seeding_without_end_of_backward_callbacks_reads_each_gradient_as_it_lands(monkeypatch):
    """Gradient clipping scales the seeds by the clip factor; without the engine's callback queue each raw
    gradient norm is read in its post-accumulate hook instead: the same factor up to summation order."""
    with_queue = _train("ag", clip=0.5)
    monkeypatch.setattr(internals, "queue_after_backward", lambda callback: False)
    without = _train("ag", clip=0.5)
    for (ia, va), (ib, vb) in zip(with_queue, without):
        assert torch.equal(ia, ib)
        torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-7)  # (Σ‖g‖² summed in another order)


def test_version_falls_back_to_a_key_equal_to_nothing():
    t = torch.zeros(3)
    assert internals.version(t) == internals.version(t)
    with torch.inference_mode():
        frozen = torch.zeros(3)
    assert internals.version(frozen) != internals.version(frozen)


def test_direct_apply_falls_back_to_the_public_apply(monkeypatch):
    from peft_sparse.core.functional import SparseDeltaLinear

    monkeypatch.delattr(torch._C, "_are_functorch_transforms_active")
    assert internals.direct_apply(SparseDeltaLinear) == SparseDeltaLinear.apply


def test_saved_tensor_reads_a_products_factors_and_refuses_hooked_ones():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    y = a * b
    assert internals.node_kind(y.grad_fn) == "MulBackward0"
    assert torch.equal(internals.saved_tensor(y.grad_fn, "_saved_self"), a)
    assert internals.saved_tensor(y.grad_fn, "_no_such_field") is None
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert internals.saved_tensor_hooks_active()
        z = a * b
    assert internals.saved_tensor(z.grad_fn, "_saved_self") is internals.HOOKED
    assert not internals.saved_tensor_hooks_active()


def test_no_module_but_internals_touches_a_torch_or_triton_internal():
    """The claim of accel/internals.py (and core/internals.py, the core's two), checked on the sources: version
    counters, the C++ autograd and CUDA entry points, the engine's callback queue and Triton's caches are read
    there and nowhere else."""
    import pathlib
    import re

    package = pathlib.Path(peft_sparse.__file__).parent
    pattern = re.compile(r"\._version\b|torch\._C\b|_execution_engine|\.device_caches\b|_raw_saved_")
    offenders = [
        f"{path.relative_to(package)}:{n}"
        for path in package.rglob("*.py") if path.name != "internals.py"
        for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line.split("#")[0])
    ]  # fmt: skip
    assert not offenders
