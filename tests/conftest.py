import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


@pytest.fixture(scope="session")
def mnist():
    """``torch_dad.data.mnist()``, loaded once for every test that reads real MNIST (none writes to it)."""
    from torch_dad import data

    return data.mnist()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / max(||b||, tiny)`` in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))
