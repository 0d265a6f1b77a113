"""Picks the device for the whole suite. Without CUDA, Triton kernels run in its interpreter on the CPU,
which must be chosen before triton is first imported."""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # A different seed per test (and per run unless PYTEST_SEED is set): inputs are fresh random data,
    # yet any failure is reproducible from the printed seed.
    seed = int(os.environ.get("PYTEST_SEED", torch.seed() % (1 << 31)))
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield
