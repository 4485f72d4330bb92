"""Token-level local heads on CUDA: the Triton-backed fused heads against float64 autograd, and a model of
token-level ``DADBlock``s in the CUDA-graph step against the eager step."""

from __future__ import annotations

import copy

import pytest
import torch

import torch_dad as td
from tests.gpu.conftest import requires_cuda
from tests.test_sequence_heads import TinyLM, _close, _corpus, _reference
from torch_dad.nn.sequence_heads import BucketHead, LowRankHead, VocabHead

pytestmark = requires_cuda

WIDTH, VOCAB, ROWS = 96, 3001, 517


@pytest.mark.parametrize("name", ["fused", "lowrank", "full", "bucket"])
def test_heads_on_cuda_in_bf16_match_float64_autograd(name: str) -> None:
    torch.manual_seed(0)
    head = {
        "fused": VocabHead(WIDTH, VOCAB, fused=True), "full": VocabHead(WIDTH, VOCAB),
        "lowrank": LowRankHead(WIDTH, VOCAB, 64), "bucket": BucketHead(WIDTH, VOCAB, 257),
    }[name].cuda()
    rows = torch.randn(ROWS, WIDTH, device="cuda")
    labels = torch.randint(0, VOCAB, (ROWS,), device="cuda")
    labels[::7] = -100
    loss, grad_rows, grads = _reference(head, rows, labels)
    step = head.step(rows.bfloat16(), labels, backend="triton")
    _close(step.loss.reshape(1), loss.reshape(1), 2e-2)
    _close(step.grad_hidden, grad_rows, 5e-2)
    for got, want in zip(step.grads, grads):
        _close(got, want, 5e-2)


def test_cuda_graph_step_matches_the_eager_step() -> None:
    x, y = _corpus(16)
    model = TinyLM()
    graphed = td.DADTrainer(copy.deepcopy(model), device="cuda", lr=1e-2, amp_dtype=torch.bfloat16,
                            backend="cuda-graph", on_nonfinite="ignore")
    eager = td.DADTrainer(model, device="cuda", lr=1e-2, amp_dtype=torch.bfloat16, backend="torch")
    losses = []
    for trainer in (graphed, eager):
        for _ in range(4):  # uncaptured, captured, then replays
            _, loss = trainer.step(x, y)
        losses.append(float(loss))
    assert graphed.engine is not None and graphed.engine.num_graphs == 1
    assert losses[0] == pytest.approx(losses[1], rel=5e-2)
    for p, q in zip(graphed.model.parameters(), eager.model.parameters()):
        _close(p.double(), q.double(), 0.1)
