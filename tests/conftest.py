import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / max(||b||, tiny)`` in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))
