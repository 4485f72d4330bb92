"""The captured step's private pool does not grow with depth: a layer's side-stream tensors are released once
the main stream has waited for the work that reads them, so the pool holds a few layers' buffers, not every
layer's."""

from __future__ import annotations

import gc

import pytest
import torch

import torch_dad as td
from tests.gpu.conftest import requires_cuda
from torch_dad import DADLinear, DADModel

pytestmark = [requires_cuda, pytest.mark.no_kernel]


class _MLP(DADModel):
    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(DADLinear(width, width) for _ in range(depth))
        self.classifier = torch.nn.Linear(width, 10)


def _pool_slack() -> int:
    """Bytes CUDA-graph pools hold beyond their allocated blocks (a captured step's replays write there)."""
    return sum(segment["total_size"] - segment["allocated_size"] for segment in torch.cuda.memory_snapshot()
               if tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0))


def _graph_pool_bytes(depth: int, width: int, batch: int) -> int:
    gc.collect()
    torch.cuda.empty_cache()
    before = _pool_slack()  # an earlier trainer's pool, if torch keeps it, is not this one's
    torch.manual_seed(0)
    trainer = td.DADTrainer(_MLP(depth, width), "cuda", amp_dtype=torch.bfloat16)
    x, y = torch.randn(batch, width, device="cuda"), torch.randint(0, 10, (batch,), device="cuda")
    for _ in range(3):  # uncaptured, captured, replayed
        trainer.step(x, y)
    torch.cuda.synchronize()
    return _pool_slack() - before


def test_the_graph_pool_holds_a_few_layers_not_every_layer():
    width, batch = 1024, 4096
    activation = batch * width * 2  # one bf16 activation
    # from 4 layers on, a step holds its most: the side-stream tensors of the layers the main stream has not
    # yet waited for
    shallow, deep = _graph_pool_bytes(4, width, batch), _graph_pool_bytes(12, width, batch)
    # every layer's input and local error kept to the end of the step would add 16 activations
    assert deep - shallow < 4 * activation, (shallow / 2**20, deep / 2**20)
