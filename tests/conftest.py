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

import peft_sparse  # noqa: E402,F401  (registers the sparse PEFT types)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
