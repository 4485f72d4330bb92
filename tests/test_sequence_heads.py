"""Token-level local heads (``torch_dad.nn.sequence_heads``) and ``DADBlock``/``DADTrainer`` with labels (batch, T).

Every design's closed-form loss and gradients are checked against float64 autograd of the same loss, on odd
shapes with ignored positions, in float64, float32 and bfloat16 rows; then a block's whole gradient list, the
trainer's step on both CPU runners, ``fit``/``evaluate`` per token, checkpoints, and the argument checks.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import torch_dad as td
from torch_dad.nn.sequence_heads import TOKEN_HEADS, BucketHead, LowRankHead, TokenHead, VocabHead, make_token_head

N, WIDTH, VOCAB, RANK, BUCKETS = 13, 7, 23, 5, 6
#: relative tolerance of the closed-form gradients against the float64 reference, per rows' dtype
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _heads() -> dict[str, TokenHead]:
    torch.manual_seed(0)
    return {
        "full": VocabHead(WIDTH, VOCAB),
        "fused": VocabHead(WIDTH, VOCAB, fused=True),
        "full-nobias": VocabHead(WIDTH, VOCAB, bias=False),
        "lowrank": LowRankHead(WIDTH, VOCAB, RANK),
        "bucket": BucketHead(WIDTH, VOCAB, BUCKETS),
    }


def _labels(n: int = N, ignored: int = 4) -> Tensor:
    labels = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(1))
    labels[:ignored] = -100  # ignored positions: no loss, no gradient
    return labels


def _reference(head: TokenHead, rows: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Float64 autograd of the head's training loss: (loss, dL/drows, dL/dparams)."""
    ref = copy.deepcopy(head).double()
    h = rows.detach().double().requires_grad_(True)
    if isinstance(ref, BucketHead):  # its training loss is over the labels' buckets
        logits, labels = ref.classes(h), ref.bucket_labels(labels)
    else:
        logits = ref(h)
    loss = nn.functional.cross_entropy(logits, labels, ignore_index=-100)
    params = list(ref.parameters())
    grads = torch.autograd.grad(loss, [h, *params])
    return loss.detach(), grads[0], list(grads[1:])


def _close(actual: Tensor, expected: Tensor, tol: float) -> None:
    scale = expected.detach().abs().max().clamp_min(1e-3)
    assert float((actual.detach().double() - expected.detach()).abs().max() / scale) <= tol


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["full", "fused", "full-nobias", "lowrank", "bucket"])
def test_head_step_matches_float64_autograd(name: str, dtype: torch.dtype) -> None:
    head = _heads()[name]
    rows = torch.randn(N, WIDTH, generator=torch.Generator().manual_seed(2))
    labels = _labels()
    loss, grad_rows, grads = _reference(head, rows, labels)
    if dtype == torch.float64:
        head = head.double()
    step = head.step(rows.to(dtype), labels)
    tol = TOLERANCE[dtype]
    assert step.loss.dtype == torch.float32 or dtype == torch.float64
    _close(step.loss.reshape(1), loss.reshape(1), tol)
    assert step.grad_hidden.dtype == dtype and step.grad_hidden.shape == rows.shape
    _close(step.grad_hidden, grad_rows, tol)
    assert len(step.grads) == len(grads)
    for got, want in zip(step.grads, grads):
        assert got.shape == want.shape
        _close(got, want, tol)
    assert step.grad_hidden[:4].abs().max() == 0  # ignored rows get no gradient


def test_logits_are_formed_by_the_full_and_bucket_heads_only() -> None:
    rows, labels = torch.randn(N, WIDTH), _labels()
    for name, head in _heads().items():
        logits = head.step(rows, labels).logits
        classes = {"bucket": BUCKETS, "fused": 0, "lowrank": 0}.get(name, VOCAB)
        assert logits.shape == (N, classes)


@pytest.mark.parametrize("name", ["full", "fused", "lowrank", "bucket"])
def test_every_position_ignored_gives_zero_loss_and_gradients(name: str) -> None:
    step = _heads()[name].step(torch.randn(N, WIDTH), torch.full((N,), -100))
    assert float(step.loss) == 0.0
    assert all(float(g.abs().max()) == 0.0 for g in [step.grad_hidden, *step.grads])


def test_bucket_head_vocabulary_logits_spread_each_bucket_evenly() -> None:
    head = BucketHead(WIDTH, VOCAB, BUCKETS).double()
    sizes = torch.bincount(head.bucket_of, minlength=BUCKETS)
    assert int(sizes.max() - sizes.min()) <= 1  # balanced
    hidden = torch.randn(2, 3, WIDTH, dtype=torch.float64)
    log_p = torch.log_softmax(head(hidden), -1)
    assert log_p.shape == (2, 3, VOCAB)
    bucket_log_p = torch.log_softmax(head.classes(hidden), -1)
    expected = bucket_log_p[..., head.bucket_of] - sizes[head.bucket_of].double().log()
    assert torch.allclose(log_p, expected, atol=1e-12)
    labels = _labels(6, ignored=1)
    vocab_loss = nn.functional.cross_entropy(head(hidden).reshape(6, -1), labels, ignore_index=-100)
    bucket_loss = head.step(hidden.reshape(6, -1), labels).loss
    extra = sizes[head.bucket_of[labels[1:]]].double().log().mean()
    assert torch.allclose(vocab_loss, bucket_loss + extra, atol=1e-12)
    assert "bucket_of" not in head.state_dict()  # derived from the seed, not saved


def test_make_token_head_builds_each_design() -> None:
    kinds = {"full": VocabHead, "fused": VocabHead, "lowrank": LowRankHead, "bucket": BucketHead}
    for name in TOKEN_HEADS:
        head = make_token_head(name, WIDTH, VOCAB)
        assert isinstance(head, kinds[name]) and head.vocab_size == VOCAB and head.width == WIDTH
    assert make_token_head("fused", WIDTH, VOCAB).fused  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="local_head='softmax'"):
        make_token_head("softmax", WIDTH, VOCAB)


def test_head_argument_errors() -> None:
    with pytest.raises(ValueError, match="buckets=30 must be at most vocab_size=23"):
        BucketHead(WIDTH, VOCAB, 30)
    with pytest.raises(ValueError, match="rank"):
        LowRankHead(WIDTH, VOCAB, 0)
    head = VocabHead(WIDTH, VOCAB)
    with pytest.raises(ValueError, match="rows of width 7"):
        head.step(torch.randn(N, WIDTH + 1), _labels())
    with pytest.raises(ValueError, match="labels have shape"):
        head.step(torch.randn(N, WIDTH), _labels(N + 1))
    with pytest.raises(TypeError, match="labels have dtype"):
        head.step(torch.randn(N, WIDTH), _labels().float())


# ---------------------------------------------------------------------------------------------- DADBlock

SEQ, BATCH = 5, 3


class CausalLayer(nn.Module):
    """A pre-norm encoder layer with a causal mask: position t attends to positions <= t."""

    def __init__(self, width: int = WIDTH + 1) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True, norm_first=True)

    def forward(self, x: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device, dtype=x.dtype)
        return self.layer(x, src_mask=mask, is_causal=True)


def _block(head: str | TokenHead, width: int = WIDTH + 1) -> td.DADBlock:
    torch.manual_seed(3)
    module = nn.Sequential(nn.Embedding(VOCAB, width), CausalLayer(width))
    return td.DADBlock(module, head, num_classes=VOCAB, head_features=width)


def _tokens() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(4)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    y = torch.roll(x, -1, 1)
    y[:, -1] = -100
    y[0, :2] = -100
    return x, y


@pytest.mark.parametrize("name", TOKEN_HEADS)
def test_block_gradients_match_float64_autograd_of_the_whole_block(name: str) -> None:
    block = _block(name).double()
    x, y = _tokens()
    result, grads = block.local_gradients(x, y)
    ref = copy.deepcopy(block)
    out = ref.block(x)
    if isinstance(ref.head, BucketHead):
        logits, labels = ref.head.classes(out), ref.head.bucket_labels(y)
    else:
        logits, labels = ref.head(out), y
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    expected = torch.autograd.grad(loss, ref.trained_tensors(), allow_unused=True)
    assert len(grads) == len(expected) == len(block.trained_tensors())
    for got, want, p in zip(grads, expected, block.trained_tensors()):
        want = torch.zeros_like(p) if want is None else want
        assert got.dtype == p.dtype
        _close(got, want, 1e-9)
    assert torch.allclose(result.loss.double(), loss, rtol=1e-10)
    assert result.output.shape == (BATCH, SEQ, WIDTH + 1)
    assert result.logits.shape[:2] == (BATCH, SEQ)
    assert block.local_head(block(x)).shape == (BATCH, SEQ, VOCAB)  # vocabulary logits for evaluation


def test_block_bf16_compute_is_close_to_float32() -> None:
    x, y = _tokens()
    block = _block("fused")
    full, grads = block.local_gradients(x, y)
    half, half_grads = block.local_gradients(x, y, torch.bfloat16)
    assert abs(float(half.loss) - float(full.loss)) < 0.05
    for g, h in zip(grads, half_grads):
        assert h.dtype == torch.float32
        _close(h.double(), g.double(), 0.1)


def test_block_token_head_argument_errors() -> None:
    module = nn.Embedding(VOCAB, WIDTH)
    assert td.DADBlock(nn.Embedding(VOCAB, WIDTH), VocabHead(WIDTH, VOCAB)).num_classes == VOCAB
    assert td.DADBlock(nn.Embedding(VOCAB, WIDTH), head_features=WIDTH).num_classes == 10  # a class head's default
    with pytest.raises(ValueError, match="local_head='mlp' must be a module or one of 'full'"):
        td.DADBlock(module, "mlp", num_classes=VOCAB, head_features=WIDTH)
    with pytest.raises(TypeError, match="local_head='full' needs head_features="):
        td.DADBlock(module, "full", num_classes=VOCAB)
    with pytest.raises(TypeError, match="num_classes= \\(the vocabulary size\\)"):
        td.DADBlock(module, "full", head_features=WIDTH)
    with pytest.raises(ValueError, match="num_classes=10, but the token head's vocab_size is 23"):
        td.DADBlock(module, VocabHead(WIDTH, VOCAB), num_classes=10)
    with pytest.raises(ValueError, match="label_smoothing=0.1 applies to a class head"):
        td.DADBlock(module, "full", num_classes=VOCAB, head_features=WIDTH, label_smoothing=0.1)
    with pytest.raises(TypeError, match="local_head must be a torch.nn.Module or a token head's name"):
        td.DADBlock(module, 3)  # type: ignore[arg-type]
    block = td.DADBlock(nn.Embedding(VOCAB, WIDTH), "full", num_classes=VOCAB, head_features=WIDTH + 2)
    with pytest.raises(ValueError, match=f"head_features={WIDTH + 2}, but the block's output"):
        block.check_input(torch.zeros(2, SEQ, dtype=torch.long))


# ---------------------------------------------------------------------------------------------- DADTrainer


class TinyLM(td.DADModel):
    """Three causal blocks (the embedding in the first), each with its own token head; the last one's is the LM head."""

    def __init__(self, heads: tuple[str, ...] = ("bucket", "lowrank", "fused"), classifier: bool = False) -> None:
        super().__init__()
        torch.manual_seed(5)
        width = WIDTH + 1
        modules = [nn.Sequential(nn.Embedding(VOCAB, width), CausalLayer(width))] + [CausalLayer(width) for _ in heads[1:]]
        self.blocks = nn.ModuleList(
            td.DADBlock(m, h, num_classes=VOCAB, head_features=width) for m, h in zip(modules, heads)
        )
        if classifier:
            self.classifier = nn.Linear(SEQ * width, VOCAB)


def _corpus(rows: int = 24) -> tuple[Tensor, Tensor]:
    """A learnable sequence task: each next token is the current one plus one (mod VOCAB)."""
    start = torch.randint(0, VOCAB, (rows, 1), generator=torch.Generator().manual_seed(6))
    x = (start + torch.arange(SEQ)) % VOCAB
    y = (x + 1) % VOCAB
    y[:, 0] = -100
    return x, y


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_trainer_step_equals_each_blocks_local_step(backend: str) -> None:
    model = TinyLM()
    reference = copy.deepcopy(model)
    trainer = td.DADTrainer(model, lr=1e-2, backend=backend, on_nonfinite="ignore")
    x, y = _corpus(8)
    logits, loss = trainer.step(x, y)
    a = x
    for block in reference.blocks:
        result, grads = block.local_gradients(a, y)
        block.apply_local_update(grads, trainer.config, 1e-2)
        a = result.output
    assert torch.allclose(loss, result.loss, rtol=1e-5)
    assert logits.shape == (8, SEQ, 0)  # the fused head forms no logits
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6)


def test_fit_and_evaluate_report_per_token_loss(tmp_path: Path) -> None:
    x, y = _corpus()
    trainer = td.DADTrainer(TinyLM(("full", "full")), lr=1e-2)
    before = trainer.evaluate((x, y), batch_size=7)
    history = trainer.fit((x, y), epochs=4, eval=(x, y), batch_size=8, progress=False)
    after = trainer.evaluate((x, y), batch_size=7)
    labelled = int((y != -100).sum())
    assert before["samples"] == after["samples"] == labelled  # counted per labelled token
    assert after["loss"] < before["loss"]
    assert history[-1]["eval_loss"] == pytest.approx(after["loss"])
    with torch.no_grad():
        logits = trainer.model(x)
    expected = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100)
    assert after["loss"] == pytest.approx(float(expected), rel=1e-5)
    path = tmp_path / "lm.safetensors"
    trainer.save_checkpoint(path)
    restored = td.DADTrainer(TinyLM(("full", "full")), lr=1e-2)
    restored.load_checkpoint(path)
    assert restored.evaluate((x, y), batch_size=7)["loss"] == pytest.approx(after["loss"])


def test_trainer_rejects_bad_token_labels_and_mixed_models() -> None:
    trainer = td.DADTrainer(TinyLM(), check_values=True)
    x, y = _corpus(4)
    before = [p.clone() for p in trainer.model.parameters()]
    with pytest.raises(ValueError, match="labels have shape \\(4,\\)"):
        trainer.step(x, y[:, 0])
    bad = y.clone()
    bad[1, 2] = VOCAB
    with pytest.raises(ValueError, match="labels must lie in \\[0, 23\\)"):
        trainer.step(x, bad)
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), before))
    assert trainer.step_count == 0
    with pytest.raises(ValueError, match="token labels \\(batch, T\\): no solve"):
        trainer.solve_head()
    with pytest.raises(ValueError, match="Remove model.classifier"):
        td.DADTrainer(TinyLM(classifier=True))
    mixed = TinyLM()
    mixed.blocks[1] = td.DADBlock(CausalLayer(), num_classes=VOCAB, head_features=WIDTH + 1, feature_dim=-1)
    with pytest.raises(ValueError, match="DAD layer 1 \\(DADBlock\\) takes one label per row"):
        td.DADTrainer(mixed)
