"""Integer token ids and bool masks into a model whose first ``DADBlock`` holds the embedding.

They reach the block as given (never cast to a float dtype) under every backend and ``amp_dtype``, in
``step()``, ``fit()``, ``evaluate()`` and ``solve_head()`` (which recomputes the input sample's features);
float inputs are still cast. On CPU ``backend="triton"`` runs the fused step (its PyTorch twins), whose
per-layer path runs every ``DADBlock``; ``"auto"`` resolves to the eager loop.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import Tensor, nn

import torch_dad as td
from tests.conftest import relative_error
from torch_dad.training.step import input_dtype

VOCAB, WIDTH, SEQ, CLASSES = 50, 16, 7, 5
USED = 40  # the data draws ids below this: the embedding rows above it get no gradient


class _Recorder(nn.Module):
    """``first(x)`` for a first block's input, recording every input dtype it is called with."""

    def __init__(self, first: nn.Module) -> None:
        super().__init__()
        self.first = first
        self.seen: set[torch.dtype] = set()

    def forward(self, x: Tensor) -> Tensor:
        self.seen.add(x.dtype)
        return self.first(x)


def _encoder() -> nn.Module:
    return nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, dropout=0.0, batch_first=True)


class TokenNet(td.DADModel):
    """Embedding + encoder layer, another encoder layer (mean-pool local heads), then a classifier on the
    flattened (SEQ, WIDTH) output; ``first`` replaces the embedding (e.g. for bool or float inputs)."""

    def __init__(self, first: nn.Module | None = None) -> None:
        super().__init__()
        first_block = _Recorder(nn.Sequential(first or nn.Embedding(VOCAB, WIDTH), _encoder()))
        self.b0 = td.DADBlock(first_block, num_classes=CLASSES, head_features=WIDTH, feature_dim=-1)
        self.b1 = td.DADBlock(_encoder(), num_classes=CLASSES, head_features=WIDTH, feature_dim=-1)
        self.classifier = nn.Linear(SEQ * WIDTH, CLASSES)

    @property
    def seen(self) -> set[torch.dtype]:
        """The dtypes the first block was called with."""
        recorder = self.b0.block
        assert isinstance(recorder, _Recorder)
        return recorder.seen


class _MaskProjection(nn.Module):
    """A bool mask (B, T) to (B, T, WIDTH): each position's flag through a Linear(1, WIDTH)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(1, WIDTH)

    def forward(self, mask: Tensor) -> Tensor:
        return self.proj(mask.unsqueeze(-1).to(self.proj.weight.dtype))


def token_batches(count: int, batch: int, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """``count`` batches of ``(ids (batch, SEQ) int64 below USED, labels)``."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, USED, (batch, SEQ), generator=generator),
             torch.randint(0, CLASSES, (batch,), generator=generator)) for _ in range(count)]


def _trainer(model: td.DADModel, backend: str, amp: torch.dtype | None, **options: object) -> td.DADTrainer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the engine on CPU with nothing to warn about but its own speed
        # on_nonfinite="ignore": the default guard would route "triton" through the eager layer loop
        trainer = td.DADTrainer(model, device="cpu", backend=backend, amp_dtype=amp, on_nonfinite="ignore",
                                **options)  # type: ignore[arg-type]
    assert trainer.uses_engine == (backend == "triton")
    return trainer


BACKENDS = ["torch", "triton", "auto"]
AMPS = [None, torch.bfloat16]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("amp", AMPS)
def test_token_ids_train_uncast_in_every_entry_point(backend: str, amp: torch.dtype | None) -> None:
    torch.manual_seed(0)
    model = TokenNet()
    before = copy.deepcopy(model.state_dict())
    trainer = _trainer(model, backend, amp, weight_decay=0.0)
    batches = token_batches(3, 24)
    losses = [trainer.step(x, y)[1] for x, y in batches]
    history = trainer.fit(batches, epochs=1, progress=False)
    metrics = trainer.evaluate(batches)
    assert trainer.classifier_sample is not None and trainer.classifier_sample.inputs.dtype == torch.int64
    trainer.solve_head(lambda_reg=1e-2)
    assert model.seen == {torch.int64}
    assert all(bool(torch.isfinite(loss)) for loss in losses) and torch.isfinite(torch.tensor(history[-1]["loss"]))
    assert torch.isfinite(torch.tensor([metrics["loss"], metrics["accuracy"]])).all()
    after = model.state_dict()
    embedding_key = "b0.block.first.0.weight"
    for key, value in before.items():
        if key != embedding_key:
            assert not torch.equal(after[key], value), key
    embedding, start = after[embedding_key], before[embedding_key]
    # rows of the ids seen moved; the others got no gradient and, without weight decay, no update
    assert (embedding[:USED] != start[:USED]).any(1).all()
    assert torch.equal(embedding[USED:], start[USED:])


def _outputs(backend: str, amp: torch.dtype | None, dtype: torch.dtype, batches: list[tuple[Tensor, Tensor]]
             ) -> tuple[list[tuple[Tensor, Tensor]], Tensor]:
    """Each step's ``(logits, loss)`` of a TokenNet (seeded) in ``dtype``, then its eval logits on the first batch."""
    torch.manual_seed(0)
    model = TokenNet().to(dtype)
    trainer = _trainer(model, backend, amp)
    steps = [trainer.step(x, y) for x, y in batches]
    model.eval()
    with torch.no_grad():
        return steps, model(batches[0][0])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("amp", AMPS)
def test_token_model_matches_float64(backend: str, amp: torch.dtype | None) -> None:
    """Steps in fp32 and bf16 against the same model trained in float64 (eager): every step's outputs come
    from the pre-update weights, so they compare step by step; bf16 within a few of its ulps (2**-8)."""
    batches = token_batches(4, 24, seed=1)
    want_steps, want_eval = _outputs("torch", None, torch.float64, batches)
    got_steps, got_eval = _outputs(backend, amp, torch.float32, batches)
    tol = 1e-5 if amp is None else 2e-2
    for i, ((logits, loss), (want_logits, want_loss)) in enumerate(zip(got_steps, want_steps)):
        assert logits.dtype == torch.float32
        assert relative_error(logits, want_logits) <= tol, i
        assert abs(float(loss) - float(want_loss)) <= tol * max(1.0, abs(float(want_loss))), i
    assert relative_error(got_eval, want_eval) <= tol


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bool_masks_reach_the_block_uncast_under_bfloat16(backend: str) -> None:
    torch.manual_seed(0)
    model = TokenNet(first=_MaskProjection())
    trainer = _trainer(model, backend, torch.bfloat16)
    generator = torch.Generator().manual_seed(2)
    masks = torch.rand(48, SEQ, generator=generator) < 0.5
    labels = masks[:, 0].long() + 2 * masks[:, 1].long()
    losses = [trainer.step(masks[i : i + 16], labels[i : i + 16])[1] for i in range(0, 48, 16)]
    trainer.solve_head(lambda_reg=1e-2)
    assert trainer.evaluate((masks, labels))["samples"] == 48
    assert model.seen == {torch.bool}
    assert all(bool(torch.isfinite(loss)) for loss in losses)


@pytest.mark.parametrize("backend,amp,expected", [
    ("triton", torch.bfloat16, torch.bfloat16),  # the fused step casts float inputs to the compute dtype
    ("triton", None, torch.float32),
    ("torch", torch.bfloat16, torch.float32),  # the eager block casts inside, under autocast
])
def test_float_inputs_are_still_cast(backend: str, amp: torch.dtype | None, expected: torch.dtype) -> None:
    torch.manual_seed(0)
    model = TokenNet(first=nn.Identity())
    trainer = _trainer(model, backend, amp)
    x, y = torch.randn(8, SEQ, WIDTH, dtype=torch.float64), torch.arange(8) % CLASSES
    trainer.step(x, y)
    model.seen.clear()  # the first step's width check ran the block in float32
    trainer.step(x, y)
    assert model.seen == {expected}


@pytest.mark.parametrize("dtype,compute,expected", [
    (torch.int64, torch.bfloat16, torch.int64), (torch.int32, torch.float16, torch.int32),
    (torch.bool, torch.bfloat16, torch.bool), (torch.float32, torch.bfloat16, torch.bfloat16),
    (torch.float32, None, torch.float32), (torch.int64, None, torch.int64),
])
def test_input_dtype(dtype: torch.dtype, compute: torch.dtype | None, expected: torch.dtype) -> None:
    assert input_dtype(torch.zeros(2, 3, dtype=dtype), compute) == expected
