"""Token ids (int64) into an embedding-first ``DADBlock`` model on the fused and CUDA-graph engines, against
the eager step (GPU, or interpreter): the ids reach the embedding uncast under bf16, captured or not."""

from __future__ import annotations

import pytest
import torch

import torch_dad as td
from tests.conftest import relative_error
from tests.gpu.conftest import DEVICE, requires_cuda, requires_kernels
from tests.test_token_inputs import CLASSES, USED, TokenNet, token_batches

pytestmark = requires_kernels

BACKENDS = ["triton"] + (["cuda-graph"] if DEVICE == "cuda" else [])
AMPS = [None] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _pair(backend: str, amp: torch.dtype | None) -> tuple[td.DADTrainer, td.DADTrainer]:
    torch.manual_seed(3)
    ref, new = TokenNet(), TokenNet()
    new.load_state_dict(ref.state_dict())
    options = {"device": DEVICE, "amp_dtype": amp, "on_nonfinite": "ignore"}
    fused = td.DADTrainer(new, backend=backend, **options)  # type: ignore[arg-type]
    assert fused.uses_engine
    return td.DADTrainer(ref, backend="torch", **options), fused  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("amp", AMPS)
def test_token_model_on_the_engine_matches_eager(backend: str, amp: torch.dtype | None) -> None:
    eager, fused = _pair(backend, amp)
    tol = 1e-4 if amp is None else 3e-2
    # four equal batches (captured from the second under "cuda-graph"), then a ragged one (uncaptured)
    batches = token_batches(4, 32, seed=4) + token_batches(1, 9, seed=5)
    for i, (x, y) in enumerate(batches):
        x, y = x.to(DEVICE), y.to(DEVICE)
        logits_e, loss_e = eager.step(x, y)
        logits_f, loss_f = fused.step(x, y)
        assert relative_error(loss_f, loss_e) <= tol, i
        assert relative_error(logits_f, logits_e) <= 5 * tol, i
    if backend == "cuda-graph":
        assert fused.engine is not None and fused.engine.num_graphs >= 1
    assert fused.model.seen == eager.model.seen == {torch.int64}
    assert relative_error(torch.tensor(fused.running_loss), torch.tensor(eager.running_loss)) <= tol


@requires_cuda
def test_token_model_fit_solve_head_and_evaluate_on_cuda_graphs() -> None:
    """bf16 under the captured step: the input sample keeps the int64 ids (drawn on the device inside the
    graph) and ``solve_head`` recomputes their features; the embedding rows of unseen ids never move."""
    torch.manual_seed(0)
    model = TokenNet()
    start = model.b0.block.first[0].weight.detach().clone().cuda()
    trainer = td.DADTrainer(model, device="cuda", amp_dtype=torch.bfloat16, weight_decay=0.0, on_nonfinite="ignore")
    batches = [(x.cuda(), y.cuda()) for x, y in token_batches(6, 32, seed=6)]
    trainer.fit(batches, epochs=2, progress=False)
    assert trainer.engine is not None and trainer.engine.num_graphs >= 1
    sample = trainer.classifier_sample
    assert sample is not None and sample.inputs.dtype == torch.int64 and sample.size == 2 * 6 * 32
    seen_rows = {tuple(row) for x, _ in batches for row in x.tolist()}
    assert {tuple(row) for row in sample.inputs[: sample.size].tolist()} == seen_rows
    before = trainer.evaluate(batches)
    trainer.solve_head(lambda_reg=1e-2)
    after = trainer.evaluate(batches)
    # the closed-form fit on the rows it was solved from beats chance (random labels) and the online head
    assert after["accuracy"] >= max(before["accuracy"], 2 / CLASSES) and torch.isfinite(torch.tensor(after["loss"]))
    assert model.seen == {torch.int64}
    embedding = model.b0.block.first[0].weight.detach()
    assert (embedding[:USED] != start[:USED]).any(1).all()
    assert torch.equal(embedding[USED:], start[USED:])
