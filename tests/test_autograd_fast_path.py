"""``DADAutogradLinear(backend=...)``: the fused Triton local error against eager and float64.

A hidden layer's local error (local-head logits, ``softmax - onehot``, ``d_z``, the bias and
local-head gradients) can run through :func:`torch_dad.ops.local_error.local_error`. Both
paths are compared with the float64 oracle :func:`torch_dad.functional.local_loss_and_gradients`
on fresh random inputs and odd shapes, with some rows labelled ``ignore_index``; tolerance per
dtype as in ``tests/gpu/test_kernels.py``: the reference's own error in that dtype plus a margin
(fp32 1e-5, bf16/fp16 1e-2), relative in the 2-norm.

The oracle takes the layer's own forward output ``h`` (itself checked against the float64 forward):
a ReLU unit whose pre-activation is within rounding of 0 can switch sides between a bf16/fp32
forward and a float64 one, and with 33 rows one such unit moves a gradient by ~1%. Measured on
the H200 (2026-11-30, 24 seeds, 33x1025x300, 256 classes, bf16): against the float64 forward,
the Triton and the eager path both missed the tolerance in 15 of 72 cases, by the same amount
(e.g. 0.0279 vs 0.0279, tolerance 0.0206); given ``h``, that comparison isolates what the fast
path computes, the local error and the gradients. Kernel cases run on CUDA, or on CPU under
``TRITON_INTERPRET=1`` (tiny shapes, fp16 for bf16: the interpreter has no bf16 arithmetic).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
import zlib
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import relative_error
from tests.gpu.conftest import DEVICE, requires_cuda, requires_kernels
from torch_dad import DADAutogradLinear, functional

IGNORE = functional.IGNORE_INDEX
LOW = torch.bfloat16 if DEVICE == "cuda" else torch.float16
MARGIN = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
# (rows, in_features, out_features, classes): tiny, for the interpreter
SHAPES = [(1, 5, 3, 2), (17, 33, 65, 10), (9, 5, 65, 2)]
CUDA_SHAPES = [(1000, 257, 513, 100), (4099, 384, 1024, 10), (33, 1025, 300, 256)]


def _labels(rows: int, classes: int, device: torch.device | str | None, ignore_every: int = 3) -> torch.Tensor:
    y = torch.randint(0, classes, (rows,), device=device)
    if rows > 1:
        y[1::ignore_every] = IGNORE  # some ignored rows, never all
    return y


def _layer(shape, activation, bias, dtype, backend, device, update="grad", **kw):  # type: ignore[no-untyped-def]
    _, k, n, c = shape
    layer = DADAutogradLinear(
        k,
        n,
        bias=bias,
        num_classes=c,
        activation=activation,
        update=update,
        backend=backend,
        device=device,
        dtype=dtype,
        **kw,
    )
    with torch.no_grad():  # a local head large enough that d_z is not tiny
        layer.head_weight.normal_(0.0, 1.0 / n**0.5)  # type: ignore[union-attr]
        layer.head_bias.normal_(0.0, 0.1)  # type: ignore[union-attr]
    return layer


def _copy(src: DADAutogradLinear, dst: DADAutogradLinear) -> None:
    with torch.no_grad():
        for a, b in zip(src.trained_tensors(), dst.trained_tensors()):
            b.copy_(a)


def _seed(*key: object) -> int:
    """A stable per-case seed (``hash`` of a str changes with every interpreter start)."""
    return zlib.crc32(repr(key).encode())


def _forward64(layer: DADAutogradLinear, x: torch.Tensor) -> torch.Tensor:
    """``act(x W^T + b)`` in float64."""
    z = x.reshape(-1, x.shape[-1]).double() @ layer.weight.detach().double().T
    if layer.bias is not None:
        z = z + layer.bias.detach().double()
    return functional.activation_forward(z, layer.activation)


def _oracle_given_output(layer, x, h, y, dtype=torch.float64):  # type: ignore[no-untyped-def]
    """``functional``'s local error and gradients in ``dtype``, from the layer's own output ``h``.

    ``dL/dh`` from :func:`functional.local_rule_error`, ``d_z = dL/dh * act'(z)`` read off ``h``
    (relu: ``h > 0`` exactly where ``z > 0``), ``g_W = d_z^T x``, ``g_b = sum(d_z)``.
    """
    a, h, y = x.reshape(-1, x.shape[-1]).to(dtype), h.reshape(-1, h.shape[-1]).to(dtype), y.reshape(-1)
    hw, hb = layer.head_weight.detach().to(dtype), layer.head_bias.detach().to(dtype)  # type: ignore[union-attr]
    rule = functional.local_rule_error(
        "ce", h, y, hw, hb, label_smoothing=layer.label_smoothing, ignore_index=layer.ignore_index
    )
    d_z = rule.grad_output * functional.activation_derivative(h, h, layer.activation)
    return SimpleNamespace(
        loss=rule.loss, grad_weight=d_z.T @ a, grad_bias=d_z.sum(0) if layer.bias is not None else None,
        grad_head_weight=rule.grad_head_weight, grad_head_bias=rule.grad_head_bias,
    )


def _oracle(layer: DADAutogradLinear, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype = torch.float64):
    """``functional.local_loss_and_gradients`` on the layer's current tensors, cast to ``dtype``."""
    t = [p.detach().to(dtype) for p in (layer.weight, layer.bias, layer.head_weight, layer.head_bias) if p is not None]
    w, rest = t[0], t[1:]
    b = rest.pop(0) if layer.bias is not None else None
    return functional.local_loss_and_gradients(
        x.reshape(-1, x.shape[-1]).to(dtype),
        w,
        b,
        rest[0],
        rest[1],
        y.reshape(-1),
        layer.activation,
        label_smoothing=layer.label_smoothing,
        ignore_index=layer.ignore_index,
    )


def _grads(layer: DADAutogradLinear, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """The local gradients ``update="grad"`` accumulates into ``.grad`` after one backward."""
    return _grads_and_output(layer, x, y)[0]


def _grads_and_output(layer: DADAutogradLinear, x: torch.Tensor, y: torch.Tensor):  # type: ignore[no-untyped-def]
    """``(local gradients, forward output)`` of one forward and backward."""
    for p in layer.parameters():
        p.grad = None
    layer.set_y_context(y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the float16 GradScaler hint
        out = layer(x)
        out.sum().backward()
    return [p.grad for p in layer.trained_tensors()], out.detach()


def _check_against_oracle(layer, x, y, got, dtype, h):  # type: ignore[no-untyped-def]
    # the forward itself, against float64
    assert relative_error(h.reshape(-1, h.shape[-1]), _forward64(layer, x)) <= MARGIN[dtype]
    ref = _oracle_given_output(layer, x, h, y)
    own = _oracle_given_output(layer, x, h, y, dtype)  # the reference's own error in this dtype
    names = ["grad_weight", "grad_bias", "grad_head_weight", "grad_head_bias"]
    if layer.bias is None:
        names.remove("grad_bias")
    assert len(got) == len(names)
    for name, value in zip(names, got):
        want, low = getattr(ref, name), getattr(own, name)
        assert value.dtype == dtype and torch.isfinite(value).all(), name
        tol = MARGIN[dtype] + 2 * relative_error(low, want)
        assert relative_error(value, want) <= tol, (name, relative_error(value, want), tol)
    assert layer.last_local_loss is not None
    tol = MARGIN[dtype] + 2 * relative_error(own.loss.reshape(1), ref.loss.reshape(1))
    assert relative_error(layer.last_local_loss.reshape(1), ref.loss.reshape(1)) <= tol


# ---------------------------------------------------------------------------------- kernel cases
@requires_kernels
@pytest.mark.parametrize("dtype", [torch.float32, LOW])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", ["relu", "tanh", "identity"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("smoothing", [None, 0.0])  # the hidden default (0.1) and a plain one-hot
def test_triton_and_eager_gradients_match_oracle(shape, activation, bias, dtype, smoothing):  # type: ignore[no-untyped-def]
    torch.manual_seed(_seed(shape, activation, bias, str(dtype)))
    fast = _layer(shape, activation, bias, dtype, "triton", DEVICE, label_smoothing=smoothing)
    slow = _layer(shape, activation, bias, dtype, "eager", DEVICE, label_smoothing=smoothing)
    _copy(fast, slow)
    x = torch.randn(shape[0], shape[1], device=DEVICE).to(dtype)
    y = _labels(shape[0], shape[3], DEVICE)
    (got_fast, h_fast), (got_slow, h_slow) = _grads_and_output(fast, x, y), _grads_and_output(slow, x, y)
    assert fast.last_backend == "triton" and slow.last_backend == "torch"
    _check_against_oracle(fast, x, y, got_fast, dtype, h_fast)
    _check_against_oracle(slow, x, y, got_slow, dtype, h_slow)


@requires_kernels
@pytest.mark.parametrize("early", [True, False])
def test_triton_path_with_sequence_input_and_early_gradients(early):  # type: ignore[no-untyped-def]
    # (B, T, D) input, labels (B, T) with ignored tokens; gradients formed in forward or backward
    torch.manual_seed(3)
    shape = (2 * 7, 6, 11, 5)
    fast = _layer(shape, "relu", True, torch.float32, "triton", DEVICE)
    fast.early_gradients = early
    x = torch.randn(2, 7, 6, device=DEVICE)
    y = _labels(14, 5, DEVICE, ignore_every=4).reshape(2, 7)
    got, h = _grads_and_output(fast, x, y)
    assert fast.last_backend == "triton"
    _check_against_oracle(fast, x, y, got, torch.float32, h)


@requires_kernels
def test_all_rows_ignored_falls_back_to_zero_gradients():  # type: ignore[no-untyped-def]
    shape = (5, 4, 6, 3)
    layer = _layer(shape, "relu", True, torch.float32, "triton", DEVICE)
    y = torch.full((5,), IGNORE, device=DEVICE)
    got = _grads(layer, torch.randn(5, 4, device=DEVICE), y)
    assert layer.last_backend == "torch"
    assert all(torch.equal(g, torch.zeros_like(g)) for g in got)
    assert float(layer.last_local_loss) == 0.0  # type: ignore[arg-type]


def _adamw_reference(params, grads, state, step, lr, betas, eps, wd):  # type: ignore[no-untyped-def]
    """``torch.optim.AdamW``'s update written out, in float64."""
    b1, b2 = betas
    for i, (p, g) in enumerate(zip(params, grads)):
        m, v = state.setdefault(i, (torch.zeros_like(p), torch.zeros_like(p)))
        p.mul_(1 - lr * wd)
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        p.sub_(lr * (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps))


def _adamw_trajectory(shape, activation, bias, device, steps=3, tol=1e-5):  # type: ignore[no-untyped-def]
    """``update="inplace"`` over ``steps`` steps: every step's parameter change against AdamW in
    float64 on the oracle gradients at the layer's own weights and forward output.

    The float64 moments run alongside each layer, so a wrong step count, bias correction,
    weight decay or moment update shows at the step it happens. Checked per step, not against
    one float64 trajectory: a ReLU unit within rounding of 0 may switch sides between the two,
    and AdamW turns that into a visible change of the whole row (H200, fp32, 1000x257x513,
    24 seeds: 11 of 48 float64 trajectories differed by 3e-4 to 3e-3 after 3 steps, on the
    eager path as often as on the Triton one).
    """
    torch.manual_seed(_seed(shape, activation, bias))
    # eps well above the fp32 rounding of g: AdamW's first step is ~lr * sign(g), and eps keeps
    # it continuous where g is a rounding error away from 0
    kw = {"lr": 1e-2, "weight_decay": 0.05, "eps": 1e-6}
    fast = _layer(shape, activation, bias, torch.float32, "triton", device, update="inplace", **kw)
    slow = _layer(shape, activation, bias, torch.float32, "eager", device, update="inplace", **kw)
    _copy(fast, slow)
    # float64 moments per layer: from the float64 gradients, and from the float32 ones (the
    # reference's own error: AdamW divides by sqrt(v) + eps, so where |g| ~ eps an fp32
    # rounding of g moves the update by up to lr * that rounding / eps)
    states: dict = {"triton": {}, "torch": {}}
    own_states: dict = {"triton": {}, "torch": {}}
    for step in range(1, steps + 1):
        x = torch.randn(shape[0], shape[1], device=device)
        y = _labels(shape[0], shape[3], device)
        for layer, name in ((fast, "triton"), (slow, "torch")):
            before = [t.detach().double().clone() for t in layer.trained_tensors()]
            layer.set_y_context(y)
            out = layer(x)
            assert relative_error(out.detach(), _forward64(layer, x)) <= MARGIN[torch.float32]
            want, own = [t.clone() for t in before], [t.clone() for t in before]
            for dtype, result, state in ((torch.float64, want, states), (torch.float32, own, own_states)):
                oracle = _oracle_given_output(layer, x, out.detach(), y, dtype)
                g = [oracle.grad_weight, oracle.grad_bias, oracle.grad_head_weight, oracle.grad_head_bias]
                _adamw_reference(result, [t.double() for t in g if t is not None], state[name], step, kw["lr"],
                                 layer.config.betas, layer.config.eps, kw["weight_decay"])
            out.sum().backward()
            assert layer.last_backend == name
            # compared on the change: the parameters themselves would hide an error in the update
            for i, (p, p0, p_want, p_own) in enumerate(zip(layer.trained_tensors(), before, want, own)):
                bound = tol + 2 * relative_error(p_own - p0, p_want - p0)
                assert relative_error(p.detach().double() - p0, p_want - p0) <= bound, (name, step, i, bound)
    assert float(fast.optim_state.step) == float(slow.optim_state.step) == steps  # type: ignore[union-attr]


@requires_kernels
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", ["relu", "tanh", "identity"])
def test_inplace_adamw_trajectory_matches_oracle(activation, bias):  # type: ignore[no-untyped-def]
    _adamw_trajectory((17, 33, 65, 10), activation, bias, DEVICE)


@requires_kernels
def test_inplace_update_is_one_fused_adamw_launch(monkeypatch):  # type: ignore[no-untyped-def]
    calls: list[int] = []
    fused = torch._fused_adamw_

    def counting(params, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(params))
        return fused(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", counting)
    layer = _layer((9, 5, 7, 3), "relu", True, torch.float32, "triton", DEVICE, update="inplace")
    layer.set_y_context(_labels(9, 3, DEVICE))
    layer(torch.randn(9, 5, device=DEVICE)).sum().backward()
    assert layer.last_backend == "triton"
    assert calls == [4]  # weight, bias, local head weight and bias in one multi-tensor launch


# ---------------------------------------------------------------------------------- CUDA, larger
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["relu", "tanh", "identity"])
@pytest.mark.parametrize("shape", CUDA_SHAPES)
def test_cuda_triton_gradients_match_oracle(shape, activation, dtype):  # type: ignore[no-untyped-def]
    torch.manual_seed(_seed(shape, activation, str(dtype)))
    fast = _layer(shape, activation, True, dtype, "auto", "cuda")
    slow = _layer(shape, activation, True, dtype, "eager", "cuda")
    _copy(fast, slow)
    x = torch.randn(shape[0], shape[1], device="cuda").to(dtype)
    y = _labels(shape[0], shape[3], "cuda", ignore_every=7)
    (got_fast, h_fast), (got_slow, h_slow) = _grads_and_output(fast, x, y), _grads_and_output(slow, x, y)
    assert fast.last_backend == "triton" and slow.last_backend == "torch"
    _check_against_oracle(fast, x, y, got_fast, dtype, h_fast)
    _check_against_oracle(slow, x, y, got_slow, dtype, h_slow)


@requires_cuda
@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_cuda_autocast_bf16_with_fp32_masters(activation):  # type: ignore[no-untyped-def]
    torch.manual_seed(11)
    shape = (2048, 256, 512, 10)
    fast = _layer(shape, activation, True, torch.float32, "auto", "cuda")
    x = torch.randn(shape[0], shape[1], device="cuda")
    y = _labels(shape[0], shape[3], "cuda", ignore_every=5)
    fast.set_y_context(y)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = fast(x)
    out.float().sum().backward()
    assert fast.last_backend == "triton"
    got = [p.grad for p in fast.trained_tensors()]
    assert all(g is not None and g.dtype == torch.float32 for g in got)
    # the oracle on the bf16-rounded operands autocast hands the layer
    ref = _oracle(fast, x, y)
    own = _oracle(fast, x, y, torch.bfloat16)
    for name, value in zip(["grad_weight", "grad_bias", "grad_head_weight", "grad_head_bias"], got):
        want = getattr(ref, name)
        tol = MARGIN[torch.bfloat16] + 2 * relative_error(getattr(own, name), want)
        assert relative_error(value, want) <= tol, name  # type: ignore[arg-type]


@requires_cuda
@pytest.mark.parametrize("activation", ["relu", "tanh", "identity"])
def test_cuda_inplace_adamw_trajectory_matches_oracle(activation):  # type: ignore[no-untyped-def]
    _adamw_trajectory((1000, 257, 513, 100), activation, True, "cuda", tol=1e-4)


@requires_cuda
def test_cuda_auto_picks_triton_and_eager_where_it_does_not_apply():  # type: ignore[no-untyped-def]
    shape = (64, 16, 32, 10)
    x, y = torch.randn(64, 16, device="cuda"), _labels(64, 10, "cuda")
    layer = _layer(shape, "relu", True, torch.float32, "auto", "cuda")
    _grads(layer, x, y)
    assert layer.last_backend == "triton"
    layer = _layer(shape, "gelu", True, torch.float32, "auto", "cuda")  # its derivative needs z
    _grads(layer, x, y)
    assert layer.last_backend == "torch"


# ---------------------------------------------------------------------------------- no kernel needed
@pytest.mark.no_kernel
def test_bad_backend_raises_and_leaves_the_layer_unchanged():  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="backend"):
        DADAutogradLinear(4, 3, num_classes=2, activation="relu", backend="cuda")
    layer = DADAutogradLinear(4, 3, num_classes=2, activation="relu", backend="eager")
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    text = repr(layer)
    for bad in ("cuda-graph", "Triton", None, 1):
        with pytest.raises(ValueError, match="backend"):
            layer.backend = bad  # type: ignore[assignment]
        assert layer.backend == "torch" and repr(layer) == text
    after = layer.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    layer.backend = "auto"
    assert layer.backend == "auto" and "backend" not in repr(layer)


@pytest.mark.no_kernel
@pytest.mark.parametrize("interpret", ["0", "1"])
def test_cpu_auto_and_eager_stay_pure_pytorch(monkeypatch, interpret):  # type: ignore[no-untyped-def]
    # "auto" takes the kernel for CUDA tensors only: TRITON_INTERPRET=1 (set for kernel tests)
    # does not send CPU layers through the interpreter; only backend="triton" does
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    for backend in ("auto", "eager"):
        layer = _layer((6, 4, 5, 3), "relu", True, torch.float32, backend, "cpu")
        _grads(layer, torch.randn(6, 4), _labels(6, 3, "cpu"))
        assert layer.last_backend == "torch"


@pytest.mark.no_kernel
@pytest.mark.slow
def test_eager_backend_never_imports_triton():  # type: ignore[no-untyped-def]
    # "eager" (even with TRITON_INTERPRET=1), "auto" on CPU tensors and the head role never
    # import triton; "eager" and the head role do not even import torch_dad.kernels
    code = (
        "import sys, torch\n"
        "import torch_dad as td\n"
        "layer = td.DADAutogradLinear(4, 3, num_classes=3, activation='relu', backend='auto')\n"
        "layer.set_y_context(torch.tensor([0, 2, -100, 1, 1]))\n"
        "layer(torch.randn(5, 4)).sum().backward()\n"
        "assert layer.last_backend == 'torch' and not any(m.split('.')[0] == 'triton' for m in sys.modules)\n"
        "del sys.modules['torch_dad.kernels'], sys.modules['torch_dad.ops.local_error']\n"
        "for backend, role in (('eager', 'hidden'), ('auto', 'head')):\n"
        "    kw = dict(num_classes=3, activation='relu') if role == 'hidden' else {}\n"
        "    layer = td.DADAutogradLinear(4, 3, backend=backend, **kw)\n"
        "    for update in range(2):\n"
        "        layer.set_y_context(torch.tensor([0, 2, -100, 1, 1]))\n"
        "        layer(torch.randn(5, 4)).sum().backward()\n"
        "    assert layer.last_backend == 'torch'\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton' or m == 'torch_dad.kernels'))\n"
    )
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    for interpret in ("1", "0"):
        env = {**os.environ, "TRITON_INTERPRET": interpret, "PYTHONPATH": src}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        assert out.stdout.strip() == "[]", (interpret, out.stdout, out.stderr)


@pytest.mark.no_kernel
def test_triton_backend_falls_back_where_the_kernel_does_not_apply(monkeypatch):  # type: ignore[no-untyped-def]
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a kernel launch here would raise instead
    x, y = torch.randn(6, 4), _labels(6, 3, "cpu")
    cases = [
        ((6, 4, 5, 3), "gelu", {}),  # its derivative needs z
        ((6, 4, 5, 300), "relu", {}),  # more classes than the kernel holds
    ]
    for shape, activation, kw in cases:
        layer = _layer(shape, activation, True, torch.float32, "triton", "cpu", **kw)
        _grads(layer, x, y if shape[3] == 3 else torch.randint(0, 300, (6,)))
        assert layer.last_backend == "torch", (activation, kw, shape)
    head = DADAutogradLinear(4, 3, update="grad", backend="triton")  # the head role: eager math
    _grads(head, x, y)
    assert head.last_backend == "torch"
    # where the kernel applies but cannot run (CPU, no interpreter): a clear error, no update
    layer = _layer((6, 4, 5, 3), "relu", True, torch.float32, "triton", "cpu", update="inplace")
    before = [t.clone() for t in layer.trained_tensors()]
    layer.set_y_context(y)
    with pytest.raises(ValueError, match="backend='triton'"):
        layer(x).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(before, layer.trained_tensors()))
