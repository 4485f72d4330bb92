"""CUDA backends of the fused linear cross-entropy (torch, triton, liger-kernel, cut-cross-entropy) vs float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as TF

from torch_dad import functional
from torch_dad.nn.lm_head import DADLMHead
from torch_dad.ops.linear_cross_entropy import linear_cross_entropy, resolve_backend, vocab_slice_backward
from torch_dad.optim import OptimizerConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def available(backend):
    try:
        resolve_backend(backend, torch.device("cuda"))
    except ValueError:
        return False
    return True


BACKENDS = [b for b in ("torch", "triton", "liger", "cce") if torch.cuda.is_available() and available(b)]


def case(n, d, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(v, d, generator=g, dtype=torch.float64) / d**0.5
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.rand(n, generator=g) < 0.2] = -100
    return h, w, y


def truth(h, w, y):
    """float64 unfused reference, computed on the GPU (fast) and brought back to the CPU."""
    h, w, y = h.cuda(), w.cuda(), y.cuda()
    ref = functional.head_loss_and_gradients(h, w, None, y)
    hh = h.clone().requires_grad_(True)
    (gi,) = torch.autograd.grad(TF.cross_entropy(TF.linear(hh, w), y), hh)
    ref = functional.HeadGradients(ref.loss.cpu(), ref.logits.cpu(), ref.grad_weight.cpu(), None)
    return ref, gi.cpu()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(252, 507, 1233), (1031, 96, 5003)])
def test_fp32_matches_float64(backend, shape):
    if backend not in ("torch", "triton"):
        pytest.skip("the library kernels are bf16/fp16 kernels; fp32 is checked for our own backends")
    h, w, y = case(*shape)
    ref, gi = truth(h, w, y)
    torch.backends.cuda.matmul.allow_tf32 = False
    res = linear_cross_entropy(h.float().cuda(), w.float().cuda(), y.cuda(), backend=backend, chunk_size=100)
    assert abs(float(res.loss) - float(ref.loss)) <= 1e-5 * float(ref.loss)
    assert rel(res.grad_weight.cpu(), ref.grad_weight) <= 1e-5
    assert rel(res.grad_input.cpu(), gi) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(252, 507, 1233), (1031, 96, 5003), (4097, 576, 49152)])
def test_bf16_within_reference_error(backend, shape):
    h, w, y = case(*shape, seed=1)
    ref, gi = truth(h, w, y)
    hc, wc, yc = h.float().cuda(), w.float().cuda(), y.cuda()
    hb = hc.bfloat16().requires_grad_(True)
    wb = wc.bfloat16().requires_grad_(True)
    gh_u, gw_u = torch.autograd.grad(TF.cross_entropy((hb @ wb.T).float(), yc), (hb, wb))
    want_gi = backend != "cce"
    if backend == "cce":
        # cut-cross-entropy's bf16 dL/dhidden was 2.1% off float64 at 4097x576x49152 (beyond this
        # test's tolerance, which is not loosened): refused with a message naming the fix
        with pytest.raises(ValueError, match="backend='triton' or 'torch'"):
            linear_cross_entropy(hc.bfloat16(), wc, yc, backend=backend, compute_dtype=torch.bfloat16)
    res = linear_cross_entropy(hc.bfloat16(), wc, yc, backend=backend, compute_dtype=torch.bfloat16,
                               grad_input=want_gi)
    assert res.backend == backend
    assert abs(float(res.loss) - float(ref.loss)) <= 1e-2 * float(ref.loss)
    assert rel(res.grad_weight.cpu(), ref.grad_weight) <= rel(gw_u.cpu(), ref.grad_weight) + 1e-2
    if want_gi:
        assert rel(res.grad_input.cpu(), gi) <= rel(gh_u.cpu(), gi) + 1e-2
    else:
        assert res.grad_input is None
    lp = torch.log_softmax(ref.logits, -1).gather(1, y.clamp(min=0)[:, None]).squeeze(1) * (y != -100)
    assert rel(res.log_probs.cpu(), lp) <= 1e-2


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in ("torch", "triton")])
@pytest.mark.parametrize("shape", [(1031, 96, 5003), (4097, 576, 49152)])
def test_vocab_sweep_bf16_within_reference_error(backend, shape):
    # dL/dlogits of all rows, then the weight in slices of 1000 rows (uneven last slice), cast from float32
    h, w, y = case(*shape, seed=4)
    ref, gi = truth(h, w, y)
    hc, wc, yc = h.float().cuda(), w.float().cuda(), y.cuda()
    hb, wb = hc.bfloat16().requires_grad_(True), wc.bfloat16().requires_grad_(True)
    gh_u, gw_u = torch.autograd.grad(TF.cross_entropy((hb @ wb.T).float(), yc), (hb, wb))
    res = linear_cross_entropy(hc.bfloat16(), wc, yc, backend=backend, compute_dtype=torch.bfloat16,
                               grad_weight=False, grad_input=False, grad_logits=True, weight_chunk_size=1000)
    assert res.backend == backend and res.grad_logits.dtype == torch.bfloat16
    gw = torch.empty_like(wc)

    def on_slice(start, stop, grad_weight, grad_bias):
        gw[start:stop] = grad_weight

    lse = linear_cross_entropy(hc.bfloat16(), wc, yc, backend=backend, compute_dtype=torch.bfloat16,
                               grad_weight=False, grad_input=False, log_sum_exp=True).log_sum_exp
    assert abs(float(res.loss) - float(ref.loss)) <= 1e-2 * float(ref.loss)
    # the summed CE's gradient from the log-sum-exp, recomputed per slice; scaled to the mean here
    for given in (dict(grad_logits=res.grad_logits), dict(log_sum_exp=lse, target=yc)):
        gh = vocab_slice_backward(hc.bfloat16(), wc, on_slice, grad_input=True, slice_rows=1000, backend=backend,
                                  weight_scale=1.0 if "grad_logits" in given else 1.0 / res.num_valid, **given)
        gh = gh if "grad_logits" in given else gh / res.num_valid
        assert rel(gw.cpu(), ref.grad_weight) <= rel(gw_u.cpu(), ref.grad_weight) + 1e-2
        assert rel(gh.cpu(), gi) <= rel(gh_u.cpu(), gi) + 1e-2


@pytest.mark.parametrize("backend,sweep", [(b, "tokens") for b in BACKENDS]
                         + [(b, s) for b in BACKENDS if b in ("torch", "triton") for s in ("vocab", "recompute")])
def test_head_step_on_cuda_applies_the_reference_gradient(backend, sweep):
    d, v, lr = 96, 5003, 100.0  # large: the update must dwarf float32 rounding of w
    h, w, y = case(512, d, v, seed=2)
    head = DADLMHead(d, v, backend=backend, compute_dtype=torch.bfloat16, device="cuda", sweep=sweep,
                     weight_chunk_size=None if sweep == "tokens" else 1000)
    assert not head.backprop_gradients  # so backend 'cce' is allowed (no bf16 dL/dhidden)
    # plain SGD (no momentum, no decay): the update is exactly -lr * dL/dW, so it can be compared
    head.config = OptimizerConfig(name="sgd", lr=lr, momentum=0.0, weight_decay=0.0)
    with torch.no_grad():
        head.weight.copy_(w)
    out = head.fused_loss(h.float().cuda(), y.cuda(), shift=False)
    out.loss.backward()
    ref, _ = truth(h, w, y)
    assert head.last_backend == backend and head.last_sweep == sweep and head.weight.grad is None
    delta = head.weight.detach().cpu().double() - w
    assert rel(delta, -lr * ref.grad_weight) <= 1e-2


def test_all_ignored_on_cuda_keeps_weights():
    head = DADLMHead(64, 1000, device="cuda")
    w0 = head.weight.detach().clone()
    x = torch.randn(3, 17, 64, device="cuda", requires_grad=True)
    out = head.fused_loss(x, torch.full((3, 17), -100, device="cuda"))
    out.loss.backward()
    assert torch.equal(head.weight, w0)


def test_auto_prefers_triton_on_cuda():
    if "triton" not in BACKENDS:
        pytest.skip("triton not usable here")
    h, w, y = case(300, 64, 3001, seed=3)
    res = linear_cross_entropy(h.float().cuda(), w.float().cuda(), y.cuda(), compute_dtype=torch.bfloat16)
    assert res.backend == "triton"
    stats = linear_cross_entropy(h.float().cuda(), w.float().cuda(), y.cuda(), token_stats=True, backend="triton")
    ref = linear_cross_entropy(h.float().cuda(), w.float().cuda(), y.cuda(), token_stats=True, backend="torch")
    assert rel(stats.entropy.cpu(), ref.entropy.cpu()) <= 1e-5
    assert float((stats.is_top1 != ref.is_top1).float().mean()) <= 1e-2  # float32 near-ties may differ


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in ("torch", "triton")])
@pytest.mark.parametrize("slice_rows", [None, 1000])
def test_uninitialised_gradient_buffers_are_never_read(monkeypatch, backend, slice_rows):
    # float32 weight, bf16 compute: dW accumulates in float32 straight from bf16 products (addmm's
    # out_dtype path). The first product runs with beta=0, so NaN-filled buffers give the same bits.
    from torch_dad.ops import linear_cross_entropy as lce_module

    h, w, y = case(3000, 96, 4099, seed=2)
    h, w, y = h.cuda().bfloat16(), w.cuda().float(), y.cuda()
    kwargs = dict(chunk_size=1024, backend=backend, weight_chunk_size=slice_rows, compute_dtype=torch.bfloat16)
    clean = linear_cross_entropy(h, w, y, **kwargs)
    monkeypatch.setattr(lce_module, "_uninitialized",
                        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))
    dirty = linear_cross_entropy(h, w, y, **kwargs)
    assert torch.equal(dirty.grad_weight, clean.grad_weight) and torch.equal(dirty.grad_input, clean.grad_input)
    assert torch.isfinite(clean.grad_weight).all()


@pytest.mark.parametrize("tokens, sweep", [(2 * 96, "vocab"), (2 * 96 + 1, "tokens")])
def test_auto_sweep_holds_the_smaller_gradient(tokens, sweep):
    # bf16 dL/dlogits (tokens x V x 2 bytes) against the float32 V x D gradient (4 D bytes per vocabulary row)
    if "triton" not in BACKENDS:
        pytest.skip("triton not usable here")
    head = DADLMHead(96, 5003, compute_dtype=torch.bfloat16, device="cuda", backprop_gradients=True)
    x = torch.randn(tokens, 96, device="cuda", requires_grad=True)
    head.fused_loss(x, torch.randint(0, 5003, (tokens,), device="cuda"), shift=False).loss.backward()
    assert head.last_backend == "triton" and head.last_sweep == sweep and x.grad is not None
