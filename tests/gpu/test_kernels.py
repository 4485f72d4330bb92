"""Each Triton kernel against its float64 reference (``torch_dad.functional`` / ``optim``).

Tolerance per dtype: the reference's own error when run in that dtype plus a margin
(fp32 1e-5, bf16/fp16 1e-2), relative in the 2-norm. Shapes are odd, inputs fresh random.
Runs on CUDA; on CPU only with ``TRITON_INTERPRET=1`` (where bf16 is swapped for fp16,
which triton's interpreter handles: it has no bf16 arithmetic).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import relative_error
from tests.gpu.conftest import DEVICE, requires_kernels
from torch_dad import functional
from torch_dad.ops.local_error import FUSED_ACTIVATIONS
from torch_dad.optim import LocalOptimizerState, OptimizerConfig, adamw_
from torch_dad.ridge import GramAccumulator

pytestmark = requires_kernels

LOW = torch.bfloat16 if DEVICE == "cuda" else torch.float16
MARGIN = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
SHAPES = [(1, 17, 2), (77, 53, 10), (130, 300, 7), (1000, 257, 10), (33, 1025, 100)]


def _reference(a, w, b, hw, hb, y, act, smoothing=0.0):  # type: ignore[no-untyped-def]
    return functional.local_loss_and_gradients(a, w, b, hw, hb, y, act, label_smoothing=smoothing)


@pytest.mark.parametrize("dtype", [torch.float32, LOW])
@pytest.mark.parametrize("activation", list(FUSED_ACTIVATIONS))
@pytest.mark.parametrize("shape", SHAPES)
def test_local_error_matches_functional(shape, activation, dtype):  # type: ignore[no-untyped-def]
    if DEVICE == "cpu" and shape[0] * shape[1] > 100_000:
        pytest.skip("too slow for the interpreter")
    _check_local_error(shape, activation, dtype)


# the launch configurations default_tiles() picks (for wide layers with few and many rows,
# mid-sized ones and narrow ones, in the dtype under test): its (M, N, CP) arguments; and
# others, as Tiles fields; each on small odd shapes
TILES: list[tuple[int, int, int] | dict[str, int | bool]] = [
    (1024, 4096, 16),
    (4096, 4096, 16),
    (4096, 1024, 16),
    (1024, 256, 16),
    dict(rows_bm=64, rows_bn=128, rows_warps=4, rows_stages=2, cols_bm=128, cols_bn=32, cols_warps=4, cols_stages=2,
         cols_programs_per_sm=4),
    dict(rows_bm=16, rows_bn=64, rows_warps=2, rows_stages=2, cols_bm=64, cols_bn=64, cols_warps=4, cols_stages=3,
         cols_programs_per_sm=1),
    dict(rows_bm=32, rows_bn=64, rows_warps=4, rows_stages=2, cols_bm=32, cols_bn=64, cols_warps=4, cols_stages=2,
         cols_programs_per_sm=2, rows_split=3),
    dict(rows_bm=16, rows_bn=32, rows_warps=4, rows_stages=3, cols_bm=64, cols_bn=32, cols_warps=4, cols_stages=2,
         cols_programs_per_sm=2, rows_split=8),
    # one launch: each program makes its rows' logits, then d_z and the gradients
    dict(rows_bm=32, rows_bn=64, rows_warps=4, rows_stages=2, cols_bm=32, cols_bn=64, cols_warps=4, cols_stages=2,
         cols_programs_per_sm=2, one_pass=True),
    dict(rows_bm=16, rows_bn=128, rows_warps=8, rows_stages=3, cols_bm=32, cols_bn=64, cols_warps=4, cols_stages=2,
         cols_programs_per_sm=2, one_pass=True),
    # few rows, mid-width layers: a 16-way column split of 64-wide tiles
    (128, 1024, 16),
]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, LOW])
@pytest.mark.parametrize("shape", [(77, 53, 10), (300, 517, 10), (130, 300, 7)])
@pytest.mark.parametrize("tiles", range(len(TILES)))
def test_local_error_launch_configurations(tiles, shape, dtype):  # type: ignore[no-untyped-def]
    from torch_dad.kernels.local_error import Tiles, default_tiles

    spec = TILES[tiles]
    element_size = torch.empty((), dtype=dtype).element_size()
    _check_local_error(shape, "relu", dtype, Tiles(**spec) if isinstance(spec, dict) else default_tiles(*spec, element_size))


# label smoothing on each launch path: the two-kernel default, the column split, one pass
@pytest.mark.parametrize("dtype", [torch.float32, LOW])
@pytest.mark.parametrize("smoothing", [0.1, 0.37])
@pytest.mark.parametrize("tiles", [None, 6, 8])
def test_local_error_label_smoothing(tiles, smoothing, dtype):  # type: ignore[no-untyped-def]
    from torch_dad.kernels.local_error import Tiles

    spec = None if tiles is None else Tiles(**TILES[tiles])  # type: ignore[arg-type]
    for shape in [(77, 53, 10), (130, 300, 7)]:
        _check_local_error(shape, "tanh", dtype, spec, smoothing)


# under torch.use_deterministic_algorithms(True): the column splits and the one-launch kernel, which add
# partial sums atomically, give way to one program per sum; the results stay within the tolerances
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, LOW])
@pytest.mark.parametrize("tiles", [6, 7, 8, 10])
def test_local_error_deterministic_mode(tiles, dtype):  # type: ignore[no-untyped-def]
    from torch_dad.kernels.local_error import Tiles, default_tiles, deterministic_tiles

    spec = TILES[tiles]
    element_size = torch.empty((), dtype=dtype).element_size()
    atomic = Tiles(**spec) if isinstance(spec, dict) else default_tiles(*spec, element_size)  # type: ignore[arg-type]
    assert atomic.rows_split > 1 or atomic.one_pass
    plain = deterministic_tiles(atomic)
    assert (plain.rows_split, plain.one_pass, plain.cols_programs_per_sm) == (1, False, 0)
    assert (plain.rows_bm, plain.cols_bn) == (atomic.rows_bm, atomic.cols_bn)
    g = torch.Generator().manual_seed(7)
    h = torch.randn(300, 517, generator=g).relu().to(DEVICE, dtype)
    hw, hb = torch.randn(10, 517, generator=g).to(DEVICE) / 23, torch.randn(10, generator=g).to(DEVICE)
    y = torch.randint(0, 10, (300,), generator=g).to(DEVICE)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # warn_only: cuBLAS elsewhere needs no env var here
    try:
        runs = [_launch(h, hw, hb, y, "relu", True, atomic) for _ in range(3)]
        _check_local_error((300, 517, 10), "relu", dtype, atomic)
    finally:
        torch.use_deterministic_algorithms(was)
    for run in runs[1:]:
        for name in ("logits", "loss", "grad_head_weight", "grad_head_bias", "d_z", "grad_bias"):
            assert torch.equal(getattr(run, name), getattr(runs[0], name)), name


def _launch(h, hw, hb, y, activation, with_dz, tiles, smoothing=0.0):  # type: ignore[no-untyped-def]
    """The Triton path of ``local_error`` with the launch configuration ``tiles``."""
    from torch_dad.kernels.local_error import launch_local_error
    from torch_dad.ops.local_error import LocalError

    return LocalError(*launch_local_error(h, hw, hb, y, activation, with_dz, tiles, label_smoothing=smoothing))


def _check_local_error(shape, activation, dtype, tiles=None, smoothing=0.0):  # type: ignore[no-untyped-def]
    from torch_dad.ops.local_error import local_error

    m, n, c = shape
    k = 29
    dev = DEVICE
    a = torch.randn(m, k, device=dev, dtype=torch.float64)
    w = torch.randn(n, k, device=dev, dtype=torch.float64) / k**0.5
    b = torch.randn(n, device=dev, dtype=torch.float64) * 0.1
    hw = (torch.randn(c, n, device=dev) / n**0.5).float()
    hb = (torch.randn(c, device=dev) * 0.1).float()
    y = torch.randint(0, c, (m,), device=dev)
    ref = _reference(a, w, b, hw.double(), hb.double(), y, activation, smoothing)
    # the reference's own error in this dtype: the same math on inputs rounded to it
    low = _reference(a.to(dtype), w.to(dtype), b.to(dtype), hw.to(dtype), hb.to(dtype), y, activation, smoothing)
    h = ref.output.to(dtype)
    if tiles is None:
        got = local_error(h, hw, hb, y, activation, backend="triton", label_smoothing=smoothing)
    else:
        got = _launch(h, hw, hb, y, activation, True, tiles, smoothing)
    assert got.d_z is not None and got.grad_bias is not None and got.d_z.dtype == dtype
    pairs = {
        "logits": (got.logits, ref.logits, low.logits),
        "grad_head_weight": (got.grad_head_weight, ref.grad_head_weight, low.grad_head_weight),
        "grad_head_bias": (got.grad_head_bias, ref.grad_head_bias, low.grad_head_bias),
        "grad_weight": (got.d_z.double().T @ a, ref.grad_weight, low.grad_weight),
        "grad_bias": (got.grad_bias, ref.grad_bias, low.grad_bias),
        "loss": (got.loss.reshape(1), ref.loss.reshape(1), low.loss.reshape(1)),
    }
    for name, (value, want, own) in pairs.items():
        assert torch.isfinite(value).all(), name
        tol = MARGIN[dtype] + 2 * relative_error(own, want)
        assert relative_error(value, want) <= tol, (name, relative_error(value, want), tol)


@pytest.mark.parametrize("dtype", [torch.float32, LOW])
@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_local_error_output_head_mode(dtype, one_pass, smoothing):  # type: ignore[no-untyped-def]
    from torch_dad.kernels.local_error import Tiles
    from torch_dad.ops.local_error import local_error

    m, n, c = 211, 75, 10
    h = torch.randn(m, n, device=DEVICE, dtype=torch.float64)
    w = torch.randn(c, n, device=DEVICE, dtype=torch.float64) * 0.1
    b = torch.randn(c, device=DEVICE, dtype=torch.float64) * 0.1
    y = torch.randint(0, c, (m,), device=DEVICE)
    ref = functional.head_loss_and_gradients(h, w, b, y, label_smoothing=smoothing)
    if one_pass:
        tiles = Tiles(rows_bm=16, rows_bn=32, rows_warps=4, rows_stages=2, cols_bm=32, cols_bn=32, cols_warps=4,
                      cols_stages=2, cols_programs_per_sm=2, one_pass=True)
        got = _launch(h.to(dtype), w.float(), b.float(), y, "relu", False, tiles, smoothing)
    else:
        got = local_error(h.to(dtype), w.float(), b.float(), y, with_dz=False, backend="triton", label_smoothing=smoothing)
    assert got.d_z is None and got.grad_bias is None
    tol = MARGIN[dtype] + (1e-2 if dtype != torch.float32 else 0.0)
    assert relative_error(got.logits, ref.logits) <= tol
    assert relative_error(got.grad_head_weight, ref.grad_weight) <= tol
    assert relative_error(got.grad_head_bias, ref.grad_bias) <= tol
    assert abs(float(got.loss) - float(ref.loss)) <= tol * float(ref.loss)


def test_local_error_rejects_bad_input():  # type: ignore[no-untyped-def]
    from torch_dad.ops.local_error import local_error

    h = torch.randn(8, 5, device=DEVICE)
    with pytest.raises(ValueError, match="activation"):
        local_error(h, torch.randn(3, 5, device=DEVICE), torch.zeros(3, device=DEVICE), torch.zeros(8, dtype=torch.long, device=DEVICE), "gelu")
    with pytest.raises(ValueError, match="head_weight"):
        local_error(h, torch.randn(3, 4, device=DEVICE), torch.zeros(3, device=DEVICE), torch.zeros(8, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="target"):
        local_error(h, torch.randn(3, 5, device=DEVICE), torch.zeros(3, device=DEVICE), torch.zeros(7, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize("sizes", [[(1,)], [(37, 53), (37,)], [(1000, 4097 // 1000 + 1), (4097,)]])
@pytest.mark.parametrize("shadow", [None, LOW])
def test_adamw_kernel_matches_fused_adamw(sizes, shadow):  # type: ignore[no-untyped-def]
    from torch_dad.ops.adamw import adamw_with_shadow_

    def fresh():  # type: ignore[no-untyped-def]
        g = torch.Generator(device="cpu").manual_seed(7)
        mk = lambda s, scale=1.0: (torch.randn(s, generator=g) * scale).to(DEVICE)  # noqa: E731
        return ([mk(s) for s in sizes], [mk(s) for s in sizes], [mk(s, 0.1) for s in sizes],
                [mk(s, 0.1).abs() for s in sizes])

    p, g, m, v = fresh()
    rp, rg, rm, rv = fresh()
    step = torch.tensor(4.0, device=DEVICE)
    rstep = torch.tensor(3.0, device=DEVICE)  # the reference increments it to 4
    lr = torch.tensor(3e-3, device=DEVICE)
    shadows = [torch.empty(s, device=DEVICE, dtype=shadow) if shadow else None for s in sizes]
    adamw_with_shadow_(p, g, m, v, shadows, step, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05, backend="triton")
    adamw_(rp, rg, rm, rv, rstep, lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)
    for got, want in zip(p + m + v, rp + rm + rv):
        assert relative_error(got, want) <= 1e-6
    assert float(step) == 4.0
    for s, q in zip(shadows, p):
        if s is not None:
            assert torch.equal(s, q.to(shadow))


@pytest.mark.parametrize("multiplier", [None, 0.37])
@pytest.mark.parametrize("bias", [False, True])
def test_row_slices_on_the_kernel_match_one_fused_adamw(bias, multiplier):  # type: ignore[no-untyped-def]
    # LocalOptimizerState.apply_rows_ on the device runs the Triton kernel slice by slice (the counter advanced
    # once); the reference is one torch AdamW step of the whole tensors on the CPU, from the gradients times
    # the multiplier the kernel reads on the device
    shapes = [(101, 7), (101,)] if bias else [(101, 7)]
    g = torch.Generator(device="cpu").manual_seed(11)
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) for s in shapes]
    config = OptimizerConfig(lr=3e-3, weight_decay=0.05)
    states = [LocalOptimizerState([p.shape for p in params]) for _ in range(2)]
    for state in states:  # a second step, so the moments are not zero
        state.apply_([p.clone() for p in params], [gr * 0.5 for gr in grads], config)
    want = [p.clone() for p in params]
    states[0].apply_(want, [gr * (multiplier or 1.0) for gr in grads], config)
    state = states[1].to(DEVICE)
    got = [p.to(DEVICE) for p in params]
    on_device = None if multiplier is None else torch.tensor(multiplier, device=DEVICE)
    for start in range(0, 101, 40):
        state.apply_rows_(got, [gr[start:start + 40].to(DEVICE) for gr in grads], config, start, start + 40,
                          advance_step=start == 0, grad_multiplier=on_device)
    assert float(state.step) == float(states[0].step) == 2.0
    for a, b in zip(got + state.moments("exp_avg") + state.moments("exp_avg_sq"),
                    want + states[0].moments("exp_avg") + states[0].moments("exp_avg_sq")):
        assert relative_error(a.cpu(), b) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, LOW])
@pytest.mark.parametrize("dims", [(1, 3, 2), (90, 37, 7), (513, 130, 10)])
def test_gram_update_matches_accumulator(dims, dtype):  # type: ignore[no-untyped-def]
    from torch_dad.ops.gram import gram_update_

    b, d, c = dims
    ref = GramAccumulator(d, c, device=DEVICE, window=700.0)
    got = GramAccumulator(d, c, device=DEVICE, window=700.0)
    for _ in range(3):
        h = torch.randn(b, d, device=DEVICE).to(dtype)
        y = torch.randint(0, c, (b,), device=DEVICE)
        ref.update(h, y)
        gram_update_(got, h, y, backend="triton")
    for (name, want), (_, value) in zip(ref.named_buffers(), got.named_buffers()):
        assert relative_error(value, want) <= 1e-6, name


@requires_kernels
@pytest.mark.parametrize("width", [1, 45, 1025])
@pytest.mark.parametrize("dtype", [torch.float32, LOW])
def test_reservoir_store_matches_twin_and_definition(width, dtype):  # type: ignore[no-untyped-def]
    """``sample[s] = batch[winner[s]]`` where ``winner[s] >= 0``, nothing else touched: the Triton
    kernel against its PyTorch twin and the plain loop, fresh inputs, a sample in float32."""
    from torch_dad.ops.reservoir import reservoir_store_

    torch.manual_seed(width)
    slots, batch = 37, 53
    inputs = torch.randn(batch, width, device=DEVICE).to(dtype)
    labels = torch.randint(0, 10, (batch,), device=DEVICE)
    winner = torch.randint(-1, batch, (slots,), device=DEVICE)
    winner[::3] = -1
    start = torch.randn(slots + 1, width, device=DEVICE), torch.randint(0, 10, (slots + 1,), device=DEVICE)
    want_x, want_y = start[0].clone(), start[1].clone()
    for s, row in enumerate(winner.tolist()):
        if row >= 0:
            want_x[s], want_y[s] = inputs[row].float(), labels[row]
    for backend in ("triton", "torch"):
        got_x, got_y = start[0].clone(), start[1].clone()
        reservoir_store_(got_x, got_y, inputs, labels, winner, backend=backend)
        assert torch.equal(got_x, want_x) and torch.equal(got_y, want_y), backend


@requires_kernels
@pytest.mark.parametrize("capacity,width", [(7, 3), (64, 45), (1500, 5)])
def test_reservoir_add_matches_twin(capacity, width):  # type: ignore[no-untyped-def]
    """The two-kernel device step of Algorithm R keeps exactly the rows its PyTorch twin keeps (the twin
    equals the sequential rule: tests/test_trainer.py), from the same draws: direct fills, a batch
    straddling the fill, batches over 1024 rows (several draw programs) and many rows per slot (later
    row wins); ``seen`` advances and the winner scratch is all -1 again after every call."""
    from torch_dad.ops.reservoir import reservoir_add_

    torch.manual_seed(capacity)
    samples = {}
    for backend in ("triton", "torch"):
        samples[backend] = (torch.zeros(capacity + 1, width, device=DEVICE), torch.zeros(capacity + 1, dtype=torch.long,
                            device=DEVICE), torch.zeros((), dtype=torch.long, device=DEVICE),
                            torch.full((capacity,), -1, dtype=torch.int32, device=DEVICE))
    gen = torch.Generator().manual_seed(1)
    for batch in (5, capacity, 2049, 3, 1100):
        x = torch.randn(batch, width, generator=gen).to(DEVICE)
        y = torch.randint(0, 10, (batch,), generator=gen).to(DEVICE)
        draws = torch.rand(batch, generator=gen, dtype=torch.float64).to(DEVICE)
        for backend, (si, sl, seen, winner) in samples.items():
            reservoir_add_(si, sl, seen, winner, x, y, draws, backend=backend)
            assert bool((winner == -1).all()), backend
    (ti, tl_, tseen, _), (ri, rl, rseen, _) = samples["triton"], samples["torch"]
    assert int(tseen) == int(rseen) == 5 + capacity + 2049 + 3 + 1100
    assert torch.equal(ti, ri) and torch.equal(tl_, rl)


@requires_kernels
@pytest.mark.parametrize("capacity,width,seed", [(7, 3, 0), (64, 45, 12345), (1500, 5, 2**62 + 3)])
def test_reservoir_add_draws_in_kernel_match_its_uniforms(capacity, width, seed):  # type: ignore[no-untyped-def]
    """``draws=None``: the draw kernel's own Philox uniforms are exactly ``reservoir_uniforms(seed, seen, B)``,
    so the sample equals the PyTorch twin fed those draws, batch after batch (fills, >1024 rows, many rows per
    slot), and ``seen`` and the winner scratch end as with explicit draws."""
    from torch_dad.ops.reservoir import reservoir_add_, reservoir_uniforms

    samples = {}
    for path in ("kernel-draws", "twin"):
        samples[path] = (torch.zeros(capacity + 1, width, device=DEVICE), torch.zeros(capacity + 1, dtype=torch.long,
                         device=DEVICE), torch.zeros((), dtype=torch.long, device=DEVICE),
                         torch.full((capacity,), -1, dtype=torch.int32, device=DEVICE))
    gen = torch.Generator().manual_seed(capacity)
    for batch in (5, capacity, 2049, 3, 1100):
        x = torch.randn(batch, width, generator=gen).to(DEVICE)
        y = torch.randint(0, 10, (batch,), generator=gen).to(DEVICE)
        si, sl, seen, winner = samples["twin"]
        draws = reservoir_uniforms(seed, seen, batch, device=DEVICE)
        reservoir_add_(si, sl, seen, winner, x, y, draws, backend="torch")
        si, sl, seen, winner = samples["kernel-draws"]
        reservoir_add_(si, sl, seen, winner, x, y, seed=seed, backend="triton")
        assert bool((winner == -1).all())
    (ki, kl, kseen, _), (ti, tl_, tseen, _) = samples["kernel-draws"], samples["twin"]
    assert int(kseen) == int(tseen) == 5 + capacity + 2049 + 3 + 1100
    assert torch.equal(ki, ti) and torch.equal(kl, tl_)


@requires_kernels
def test_reservoir_uniforms_are_53_bit_uniforms_keyed_by_seed_and_row():  # type: ignore[no-untyped-def]
    """In [0, 1), multiples of 2**-53 that use their low bits, mean and spread of U(0, 1) (5 sigma),
    a flat histogram (chi-square), one stream per seed, and a row's uniform independent of the window
    it is drawn in (what lets a resumed sample continue its stream)."""
    from torch_dad.ops.reservoir import reservoir_uniforms

    n = 200_000 if DEVICE == "cuda" else 20_000
    u = reservoir_uniforms(3, 0, n, device=DEVICE).cpu()
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    ints = (u * 2.0**53).to(torch.int64)
    assert torch.equal(ints.double(), u * 2.0**53)  # exactly 53-bit values
    assert len(set((ints % 2**20).tolist())) > 0.9 * min(n, 2**20) * (1 - min(n, 2**20) / 2**21)
    assert abs(float(u.mean()) - 0.5) < 5 * (1 / 12) ** 0.5 / n**0.5
    assert abs(float(u.var()) - 1 / 12) < 5 * 0.0745 / n**0.5  # sd of (u - 1/2)^2 is 1/sqrt(180)
    counts = torch.histc(u, bins=100, min=0.0, max=1.0)
    chi2 = float(((counts - n / 100) ** 2 / (n / 100)).sum())
    assert chi2 < 99 + 5 * (2 * 99) ** 0.5
    assert torch.equal(reservoir_uniforms(3, 1000, 500, device=DEVICE).cpu(), u[1000:1500])
    start = torch.tensor(2**33 + 5, dtype=torch.long, device=DEVICE)  # rows past 2**32: the counter's high word
    far, other = reservoir_uniforms(3, start, 1000, device=DEVICE), reservoir_uniforms(4, 0, 1000, device=DEVICE)
    assert not torch.equal(far.cpu(), u[:1000]) and not torch.equal(other.cpu(), u[:1000])
    assert float((other.cpu() - u[:1000]).abs().mean()) > 0.2


def test_reservoir_add_rejects_bad_arguments():  # type: ignore[no-untyped-def]
    from torch_dad.ops.reservoir import reservoir_add_

    x, y = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
    sample = torch.zeros(6, 3), torch.zeros(6, dtype=torch.long), torch.zeros((), dtype=torch.long)
    with pytest.raises(ValueError, match="draws must have shape"):
        reservoir_add_(*sample, torch.full((5,), -1, dtype=torch.int32), x, y, torch.rand(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="winner int32"):
        reservoir_add_(*sample, torch.full((5,), -1), x, y, torch.rand(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="same number of columns"):
        reservoir_add_(torch.zeros(6, 2), *sample[1:], torch.full((5,), -1, dtype=torch.int32), x, y,
                       torch.rand(4, dtype=torch.float64))
    winner = torch.full((5,), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="draws=None makes the draws in the Triton kernel"):
        reservoir_add_(*sample, winner, x, y, backend="torch")
    with pytest.raises(ValueError, match="seed=-1"):
        reservoir_add_(*sample, winner, x, y, torch.rand(4, dtype=torch.float64), seed=-1, backend="torch")
    assert int(sample[2]) == 0 and bool((winner == -1).all()) and not sample[0].any()  # nothing changed


def test_reservoir_store_rejects_bad_shapes():  # type: ignore[no-untyped-def]
    from torch_dad.ops.reservoir import reservoir_store_

    x, y = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="same number of columns"):
        reservoir_store_(torch.zeros(5, 2), torch.zeros(5, dtype=torch.long), x, y, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="at least that many rows"):
        reservoir_store_(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), x, y, torch.zeros(5, dtype=torch.long))
