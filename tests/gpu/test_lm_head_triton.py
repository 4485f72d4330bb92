"""``backend="triton"`` of the fused linear cross-entropy (kernels/cross_entropy.py) against float64.

Runs on CUDA; on CPU only with ``TRITON_INTERPRET=1`` (tiny shapes: the interpreter is slow;
fp16 stands in for bf16, which the interpreter cannot compute in). Tolerances as tests/test_lm_head.py:
float32 1e-5 relative; half precision within the unfused half step's own error + 1e-2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as TF

from tests.gpu.conftest import DEVICE, requires_kernels
from tests.test_lm_head import make, reference, rel
from torch_dad.nn.lm_head import DADLMHead
from torch_dad.ops import cross_entropy as CE
from torch_dad.ops.linear_cross_entropy import (
    default_chunk_size,
    linear_cross_entropy,
    resolve_backend,
    vocab_slice_backward,
)

pytestmark = requires_kernels

LOW = torch.bfloat16 if DEVICE == "cuda" else torch.float16


def _to(*ts):  # type: ignore[no-untyped-def]
    return [None if t is None else t.to(DEVICE) for t in ts]


@pytest.mark.parametrize("shape,chunk", [((37, 23, 101), 7), ((37, 23, 101), None), ((5, 7, 13), 2)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("small_blocks", [False, True])
def test_fp32_matches_float64(shape, chunk, bias, small_blocks, monkeypatch):
    if small_blocks:  # several vocabulary blocks per row, the last one partial (101 = 3 * 32 + 5)
        monkeypatch.setattr(CE, "_MAX_BLOCK_V", 32)
        monkeypatch.setattr(CE, "_MAX_ONE_BLOCK_V", 32)
    n, d, v = shape
    h, w, b, y = make(n, d, v, torch.float32, bias, seed=n * v + int(bias) + 7 * int(small_blocks))
    y[:2] = -100  # ignored rows, at least one per chunk of 7 at the start
    ref, gi, tok, ent, top1 = reference(h, w, b, y)
    hh, ww, bb, yy = _to(h, w, b, y)
    res = linear_cross_entropy(hh, ww, yy, bb, chunk_size=chunk, token_stats=True, backend="triton")
    assert res.backend == "triton" and res.num_valid == int((y != -100).sum())
    assert abs(float(res.loss) - float(ref.loss)) <= 1e-5 * abs(float(ref.loss))
    assert rel(res.grad_weight.cpu(), ref.grad_weight) <= 1e-5
    assert rel(res.grad_input.cpu(), gi) <= 1e-5
    assert res.grad_input.dtype == torch.float32 and res.grad_weight.dtype == torch.float32
    if bias:
        assert rel(res.grad_bias.cpu(), ref.grad_bias) <= 1e-5
    else:
        assert res.grad_bias is None
    assert rel(res.log_probs.cpu(), tok) <= 1e-5
    assert rel(res.entropy.cpu(), ent) <= 1e-5
    assert torch.equal(res.is_top1.cpu(), top1)
    assert not res.grad_input[:2].any() and float(res.log_probs[:2].abs().sum()) == 0.0


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("weight_chunk", [None, 50])  # 50: the float32 weight cast 50 rows at a time (203 = 4 x 50 + 3)
def test_half_within_reference_error(bias, weight_chunk):
    n, d, v = 61, 24, 203
    h, w, b, y = make(n, d, v, torch.float32, bias, seed=11 + int(bias))
    ref, gi, _, _, _ = reference(h, w, b, y)
    # the unfused half step: half logits, float32 CE, half backward (on the CPU in float32 arithmetic)
    hl, wl = h.to(LOW).float().requires_grad_(True), w.to(LOW).float().requires_grad_(True)
    bl = None if b is None else b.to(LOW).float().requires_grad_(True)
    logits = TF.linear(hl, wl, bl).to(LOW).float()
    grads = torch.autograd.grad(TF.cross_entropy(logits, y), [t for t in (hl, wl, bl) if t is not None])
    gh_u, gw_u = grads[0], grads[1]
    hh, ww, bb, yy = _to(h, w, b, y)
    res = linear_cross_entropy(hh.to(LOW), ww, yy, bb, compute_dtype=LOW, chunk_size=16, backend="triton",
                               weight_chunk_size=weight_chunk)
    assert res.grad_input.dtype == LOW and res.grad_weight.dtype == torch.float32
    assert abs(float(res.loss) - float(ref.loss)) <= 1e-2 * float(ref.loss)
    assert rel(res.grad_weight.cpu(), ref.grad_weight) <= rel(gw_u, ref.grad_weight) + 1e-2
    assert rel(res.grad_input.cpu(), gi) <= rel(gh_u, gi) + 1e-2
    if bias:
        assert rel(res.grad_bias.cpu(), ref.grad_bias) <= rel(grads[2], ref.grad_bias) + 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, LOW])
@pytest.mark.parametrize("one_block", [True, False])  # the row in registers whole, or in blocks of 32 lanes
def test_row_kernel_matches_its_twin(dtype, one_block, monkeypatch):
    if not one_block:
        monkeypatch.setattr(CE, "_MAX_BLOCK_V", 32)
        monkeypatch.setattr(CE, "_MAX_ONE_BLOCK_V", 32)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(13, 77, generator=g) * 3).to(dtype)
    x[4, 10] = float("-inf")  # a masked-out logit: probability 0, no NaN
    x[9, 40] = x[9, 5] = x[9].max() + 1  # a tied maximum: the first index is the top-1
    y = torch.randint(0, 77, (13,), generator=g)
    y[[1, 7]] = -100
    y[9] = 40
    out = {}
    for backend in ("torch", "triton"):
        xx = x.clone().to(DEVICE)
        lp, ent, lse = (torch.zeros(13, device=DEVICE) for _ in range(3))
        top1 = torch.zeros(13, dtype=torch.bool, device=DEVICE)
        CE.cross_entropy_rows_(xx, y.to(DEVICE), lp, ignore_index=-100, scale=0.37, entropy=ent, is_top1=top1,
                               lse=lse, backend=backend)
        out[backend] = [t.cpu() for t in (xx, lp, ent, top1, lse)]
    (gt, lpt, entt, topt, lset), (gk, lpk, entk, topk, lsek) = out["torch"], out["triton"]
    assert torch.isfinite(gk.float()).all() and torch.isfinite(lpk).all() and torch.isfinite(entk).all()
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    assert rel(gk, gt) <= tol and rel(lpk, lpt) <= 1e-6 and rel(entk, entt) <= 1e-5
    assert torch.equal(topk, topt) and not bool(topk[9])
    assert not gk[[1, 7]].any() and float(lpk[[1, 7]].abs().sum()) == 0.0
    # every row's log-sum-exp against float64
    assert rel(lsek, torch.logsumexp(x.double(), 1).float()) <= 1e-6 and rel(lset, lsek) <= 1e-6


@pytest.mark.parametrize("one_block", [True, False])
def test_row_kernel_on_a_vocabulary_slice_takes_the_targets_inside_it(one_block, monkeypatch):
    # columns 30 .. 30 + 77 of a larger vocabulary: rows whose target lies outside count as ignored, and
    # target_logit is written on the rows whose target lies inside, nowhere else
    if not one_block:
        monkeypatch.setattr(CE, "_MAX_BLOCK_V", 32)
        monkeypatch.setattr(CE, "_MAX_ONE_BLOCK_V", 32)
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(11, 77, generator=g) * 3).to(LOW)
    y = torch.tensor([30, 106, 29, 107, 0, 500, -100, 64, 31, 105, 70])
    inside = (y >= 30) & (y < 107)
    for backend in ("torch", "triton"):
        lp, lse, tl_ = torch.ones(11, device=DEVICE), torch.zeros(11, device=DEVICE), torch.full((11,), 7.0, device=DEVICE)
        CE.cross_entropy_rows_(x.to(DEVICE), y.to(DEVICE), lp, ignore_index=-100, scale=1.0, write_grad=False,
                               lse=lse, target_logit=tl_, col_offset=30, backend=backend)
        lp, lse, tl_ = lp.cpu(), lse.cpu(), tl_.cpu()
        picked = x.float()[inside.nonzero().squeeze(1), y[inside] - 30]
        assert torch.equal(tl_[inside], picked) and torch.equal(tl_[~inside], torch.full((int((~inside).sum()),), 7.0))
        assert rel(lp[inside], picked - torch.logsumexp(x.double(), 1).float()[inside]) <= 1e-6
        assert not lp[~inside].any()
        assert rel(lse, torch.logsumexp(x.double(), 1).float()) <= 1e-6


@pytest.mark.parametrize("width", [77, 4096, 5003, 8192, 8193])  # one block up to 8192 logits, then blocks
def test_row_kernel_log_sum_exp_alone_matches_float64(width):
    # what the recomputing sweep's forward asks of each vocabulary slice: every row "ignored", lse only
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(6, width, generator=g) * 4).to(LOW)
    xx = x.to(DEVICE)
    lp, lse = torch.ones(6, device=DEVICE), torch.zeros(6, device=DEVICE)
    CE.cross_entropy_rows_(xx, torch.full((6,), -100, device=DEVICE), lp, ignore_index=-100, scale=1.0,
                           write_grad=False, lse=lse)
    assert rel(lse.cpu(), torch.logsumexp(x.double(), 1).float()) <= 1e-6
    assert not lp.any() and torch.equal(xx.cpu(), x)


def test_all_ignored_and_loss_only():
    h, w, b, y = make(9, 5, 17, torch.float32, True)
    hh, ww, bb = _to(h, w, b)
    res = linear_cross_entropy(hh, ww, torch.full((9,), -100, device=DEVICE), bb, backend="triton")
    assert res.num_valid == 0 and float(res.loss) == 0.0
    assert not res.grad_weight.any() and not res.grad_bias.any() and not res.grad_input.any()
    ref, *_ = reference(h, w, b, y)
    only = linear_cross_entropy(hh, ww, y.to(DEVICE), bb, backend="triton", grad_weight=False, grad_input=False)
    assert only.grad_weight is None and only.grad_input is None
    assert abs(float(only.loss) - float(ref.loss)) <= 1e-5 * float(ref.loss)


def test_resolution_and_chunk_size():
    dev = torch.device(DEVICE)
    assert resolve_backend("triton", dev, token_stats=True, bias=True) == "triton"
    # the logits chunk alone (no float32 copy) fits TRITON_CHUNK_BYTES: 2048 rows at V=49152 bf16
    assert default_chunk_size(49152, torch.bfloat16, backend="triton") == 2048


def test_head_step_matches_torch_backend():
    """DADLMHead on the triton backend: the same AdamW step and dL/dhidden as on the torch one."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 11, 16, generator=g).to(DEVICE)
    labels = torch.randint(0, 97, (3, 11), generator=g).to(DEVICE)
    labels[0, :4] = -100
    heads, grads = [], []
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        head = DADLMHead(16, 97, bias=True, backend=backend, lr=1e-2, backprop_gradients=True, device=DEVICE)
        xx = x.clone().requires_grad_(True)
        head.fused_loss(xx, labels).loss.backward()
        assert head.last_backend == backend and head.weight.grad is None
        heads.append(head)
        grads.append(xx.grad)
    assert rel(heads[1].weight, heads[0].weight) <= 1e-6 and rel(heads[1].bias, heads[0].bias) <= 1e-6
    assert rel(grads[1], grads[0]) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, LOW])
@pytest.mark.parametrize("bias", [False, True])
def test_grad_logits_and_vocab_slices_match_float64(dtype, bias):
    # sweep="vocab"'s two halves on the Triton row kernel: dL/dlogits of all rows, then the weight in slices of 40
    n, d, v = 37, 23, 101
    h, w, b, y = make(n, d, v, torch.float32, bias, seed=19 + int(bias))
    ref, gi, tok, _, _ = reference(h, w, b, y)
    hh, ww, bb, yy = _to(h, w, b, y)
    res = linear_cross_entropy(hh.to(dtype), ww, yy, bb, reduction="sum", compute_dtype=dtype, backend="triton",
                               grad_weight=False, grad_input=False, grad_logits=True, weight_chunk_size=40)
    assert res.backend == "triton" and res.grad_logits.dtype == dtype
    gw, gb = torch.empty_like(ww), torch.empty(v, device=ww.device)

    def on_slice(start, stop, grad_weight, grad_bias):
        gw[start:stop] = grad_weight
        if bias:
            gb[start:stop] = grad_bias

    lse = linear_cross_entropy(hh.to(dtype), ww, yy, bb, compute_dtype=dtype, backend="triton", grad_weight=False,
                               grad_input=False, log_sum_exp=True, chunk_size=16).log_sum_exp
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert abs(float(res.loss) / res.num_valid - float(ref.loss)) <= tol * float(ref.loss)
    assert rel(res.log_probs.cpu(), tok) <= tol
    assert rel(lse.cpu(), torch.logsumexp(ref.logits, 1)) <= tol
    # the stored dL/dlogits, then the same recomputed per slice from the log-sum-exp by the Triton kernel
    for given in (dict(grad_logits=res.grad_logits), dict(log_sum_exp=lse, target=yy)):
        gh = vocab_slice_backward(hh.to(dtype), ww, on_slice, bias=bb, grad_input=True, backend="triton",
                                  weight_scale=1.0 / res.num_valid, slice_rows=40, **given)
        assert rel(gw.cpu(), ref.grad_weight) <= tol and rel(gh.cpu() / res.num_valid, gi) <= tol
        if bias:
            assert rel(gb.cpu(), ref.grad_bias) <= tol


@pytest.mark.parametrize("n,d,v,slice_rows,fused", [
    (37, 24, 101, 40, 3),     # a last slice of 21 rows: its gradient rows padded to 24 for TMA
    (130, 64, 300, 112, 3),   # token and vocabulary tiles both partial
    (5, 8, 17, 16, 2),        # fewer tokens than a tile has rows; a last slice of one row
    (37, 23, 101, 40, 0),     # 46-byte rows: no TMA, cuBLAS + the row kernel
])
@pytest.mark.parametrize("bias", [False, True])
def test_recomputed_slices_in_one_kernel_match_float64(n, d, v, slice_rows, fused, bias, monkeypatch):
    from torch_dad.kernels import logits as kernels

    launches = []
    launch = kernels.logit_grad
    monkeypatch.setattr(kernels, "logit_grad", lambda *args: launches.append(args[-2]) or launch(*args))
    h, w, b, y = make(n, d, v, torch.float32, bias, seed=n + d)
    ref, gi, _, _, _ = reference(h, w, b, y)
    hh, ww, bb, yy = _to(h, w, b, y)
    lse = linear_cross_entropy(hh.to(LOW), ww, yy, bb, compute_dtype=LOW, backend="triton", grad_weight=False,
                               grad_input=False, log_sum_exp=True).log_sum_exp
    gw, gb = torch.full_like(ww, float("nan")), torch.full((v,), float("nan"), device=ww.device)

    def on_slice(start, stop, grad_weight, grad_bias):
        gw[start:stop] = grad_weight
        if bias:
            gb[start:stop] = grad_bias

    num_valid = int((y != -100).sum())
    gh = vocab_slice_backward(hh.to(LOW), ww, on_slice, log_sum_exp=lse, target=yy, bias=bb, grad_input=True,
                              backend="triton", weight_scale=1.0 / num_valid, slice_rows=slice_rows)
    assert launches == list(range(0, v, slice_rows))[:fused]
    tol = 2e-2
    assert rel(gw.cpu(), ref.grad_weight) <= tol and rel(gh.cpu() / num_valid, gi) <= tol
    if bias:
        assert rel(gb.cpu(), ref.grad_bias) <= tol


@pytest.mark.parametrize("n,d,v,slice_rows,fused", [
    (37, 24, 101, 40, 3),     # three slices, the last of 21 rows: partial column tiles
    (130, 64, 300, 112, 3),   # token and vocabulary tiles both partial
    (5, 8, 17, 16, 2),        # fewer tokens than a tile has rows; a last slice of one row
    (37, 23, 101, 40, 0),     # 46-byte rows: no TMA, cuBLAS + the row kernel
])
@pytest.mark.parametrize("bias", [False, True])
def test_sliced_log_sum_exp_in_one_kernel_matches_float64(n, d, v, slice_rows, fused, bias, monkeypatch):
    # the recomputing sweep's forward: each slice's logits reduced in registers, then the tiles merged and each
    # target's logit taken as a dot product
    from torch_dad.kernels import logits as kernels

    launches, picks = [], []
    reduce, pick = kernels.tile_log_sum_exp, kernels.log_probs
    monkeypatch.setattr(kernels, "tile_log_sum_exp", lambda *args: launches.append(args[-1]) or reduce(*args))
    monkeypatch.setattr(kernels, "log_probs", lambda *args: picks.append(1) or pick(*args))
    h, w, b, y = make(n, d, v, torch.float32, bias, seed=n + d)
    y[:3] = torch.tensor([0, v - 1, -100])  # the vocabulary's first and last rows, and an ignored row
    hh, ww, bb, yy = _to(h, w, b, y)
    res = linear_cross_entropy(hh.to(LOW), ww, yy, bb, compute_dtype=LOW, backend="triton", grad_weight=False,
                               grad_input=False, log_sum_exp=True, weight_chunk_size=slice_rows)
    # the first tile row each slice writes: 256-column tiles, so one per slice at these sizes
    assert launches == list(range(fused)) and picks == [1] * bool(fused)
    # float64 over the inputs as the kernels read them, rounded to the compute dtype
    logits = h.to(LOW).double() @ w.to(LOW).double().T + (0 if b is None else b.to(LOW).double())
    lse = torch.logsumexp(logits, 1)
    valid = y != -100
    want = torch.where(valid, logits.gather(1, y.clamp(min=0)[:, None])[:, 0] - lse, 0.0)
    # without the fused kernels the logits are the GEMM's, rounded to the compute dtype
    tol = 1e-5 if fused else 2e-3
    assert res.log_sum_exp.dtype == torch.float32 and rel(res.log_sum_exp.cpu(), lse) <= tol
    assert rel(res.log_probs.cpu(), want) <= tol and not res.log_probs.cpu()[~valid].any()
    assert abs(float(res.loss) + float(want.sum()) / int(valid.sum())) <= tol * abs(float(want.sum()))


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 1), (5, 37), (2, 3, 1031)])
@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("ignore_index", [-100, 0])
def test_next_token_targets_kernel_equals_the_torch_ops(shape, shift, dtype, ignore_index):
    # one launch for the shift, the mask and both counts, against shift_labels and compares on the CPU
    from torch_dad.kernels.labels import next_token_targets as kernel
    from torch_dad.ops.linear_cross_entropy import next_token_targets, shift_labels

    vocab = 50
    g = torch.Generator().manual_seed(sum(shape) + shift)
    labels = torch.randint(-3, vocab + 3, shape, generator=g).to(dtype)  # a few ids out of range
    labels[torch.rand(shape, generator=g) < 0.3] = ignore_index
    targets, mask, counts = kernel(labels.to(DEVICE), vocab, ignore_index, shift)
    want = shift_labels(labels, ignore_index) if shift else labels
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    assert targets.dtype == dtype and torch.equal(targets.cpu(), want)
    assert torch.equal(mask.cpu(), want != ignore_index)
    assert counts.cpu().tolist() == [int(bad.sum()), int((want != ignore_index).sum())]
    # the op reads the counts through the check: the count of the mask, or the error naming the bad ids
    good = labels.masked_fill(bad, 1)
    _, _, check = next_token_targets(good.to(DEVICE), vocab, ignore_index, shift=shift)
    assert check.result() == int((shift_labels(good, ignore_index) if shift else good).ne(ignore_index).sum())
    if bad.any():
        _, _, check = next_token_targets(labels.to(DEVICE), vocab, ignore_index, shift=shift)
        with pytest.raises(ValueError, match=r"labels must lie in \[0, 50\)"):
            check.result()
