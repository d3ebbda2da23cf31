import os
import warnings

import torch

if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on CPU; the flag must be set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
warnings.filterwarnings("ignore", message=".*kernels.*")

import peft_sparse  # noqa: E402  (registers the sparse PEFT types)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


# the training, resume and composition tests run on the fast paths and on the reference path
# (peft_sparse.fast_paths(False)); a test marked fast_only checks a fast path's own behaviour
BOTH_PATHS = {"test_spiel_training", "test_spiel_trainer", "test_composition", "test_lifecycle", "test_loading", "test_spiel_reference"}


def pytest_generate_tests(metafunc):
    module = metafunc.module.__name__.rsplit(".", 1)[-1]
    if module in BOTH_PATHS and metafunc.definition.get_closest_marker("fast_only") is None:
        metafunc.parametrize("fast_paths_on", [True, False], ids=["fast", "reference"], indirect=True)


@pytest.fixture(autouse=True)
def fast_paths_on(request):
    """Every test runs with the fast paths on, except the reference run of a BOTH_PATHS test."""
    on = getattr(request, "param", True)
    with peft_sparse.fast_paths(on):
        yield on


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
