"""Device call 36: why the fused weight-gradient + AdamW kernel is slower than cuBLAS + AdamW.

Per shape, each timed alone (20 calls in a CUDA graph, median of 7 replays):
- cublas: the bf16 GEMM d_z.T @ a;  unfused: that GEMM + the AdamW kernel (the engine's path);
- tri-gemm: the fused kernel's K-loop, storing the bf16 gradient (no AdamW);
- tri-epi: the fused kernel's epilogue alone, reading a bf16 gradient tile instead of the K-loop;
- fused: the library kernel (kernels/weight_update.py), default and 4-stage tiles;
- fused-sub: the same with the epilogue in two column halves (fewer live registers);
- fused-bp: the same with block-pointer loads and stores in the epilogue.
JSON to argv[1].
"""
import json, os, statistics, sys
import torch
import triton
import triton.language as tl
from torch_dad.kernels import weight_update as wu
from torch_dad.kernels.adamw import adamw_with_shadow_, adamw_values, bias_corrections, log_betas

dev = torch.device("cuda")
bf = torch.bfloat16
out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": os.environ.get("GIT_COMMIT"), "records": []}


def graphed_us(fn, calls=20, replays=7):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    t = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        t.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(t)


@triton.jit
def _tile(pid, n_out, n_in, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    tiles_n = tl.cdiv(n_out, BN)
    tiles_k = tl.cdiv(n_in, BK)
    per_group = GROUP * tiles_k
    first_n = (pid // per_group) * GROUP
    group_size = tl.minimum(tiles_n - first_n, GROUP)
    return first_n + (pid % per_group) % group_size, (pid % per_group) // group_size


@triton.jit
def _kloop(dz_ptr, a_ptr, rn, rk, batch, stride_dz, stride_a, BN: tl.constexpr, BK: tl.constexpr, BB: tl.constexpr):
    rb = tl.arange(0, BB)
    dz_ptrs = dz_ptr + rb[:, None] * stride_dz + rn[None, :]
    a_ptrs = a_ptr + rb[:, None] * stride_a + rk[None, :]
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for b0 in range(0, batch, BB):
        acc = tl.dot(tl.trans(tl.load(dz_ptrs)), tl.load(a_ptrs), acc)
        dz_ptrs += BB * stride_dz
        a_ptrs += BB * stride_a
    return acc


@triton.jit
def tri_gemm(dz_ptr, a_ptr, g_ptr, batch, n_out, n_in, stride_dz, stride_a,
             BN: tl.constexpr, BK: tl.constexpr, BB: tl.constexpr, GROUP: tl.constexpr):
    pid_n, pid_k = _tile(tl.program_id(0), n_out, n_in, BN, BK, GROUP)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = pid_k * BK + tl.arange(0, BK)
    acc = _kloop(dz_ptr, a_ptr, rn, rk, batch, stride_dz, stride_a, BN, BK, BB)
    tl.store(g_ptr + rn[:, None] * n_in + rk[None, :], acc.to(tl.bfloat16))


@triton.jit
def _epi(acc, rn, rk, n_in, w_ptr, wm_ptr, wv_ptr, ws_ptr, lr, b1, b2, eps, wd, bc1, bc2_sqrt):
    offs = rn[:, None] * n_in + rk[None, :]
    p, m, v = adamw_values(tl.load(w_ptr + offs), acc, tl.load(wm_ptr + offs), tl.load(wv_ptr + offs),
                           lr, b1, b2, eps, wd, bc1, bc2_sqrt)
    tl.store(w_ptr + offs, p)
    tl.store(wm_ptr + offs, m)
    tl.store(wv_ptr + offs, v)
    tl.store(ws_ptr + offs, p.to(tl.bfloat16))


@triton.jit
def tri_fused(dz_ptr, a_ptr, g_ptr, w_ptr, wm_ptr, wv_ptr, ws_ptr, step_ptr, lr_ptr, batch, n_out, n_in,
              stride_dz, stride_a, b1, b2, log_b1, log_b2, eps, wd,
              BN: tl.constexpr, BK: tl.constexpr, BB: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr):
    # MODE 0: epilogue only (gradient read from g); 1: two column halves; 2: block pointers
    pid_n, pid_k = _tile(tl.program_id(0), n_out, n_in, BN, BK, GROUP)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = pid_k * BK + tl.arange(0, BK)
    bc1, bc2_sqrt = bias_corrections(step_ptr, log_b1, log_b2)
    lr = tl.load(lr_ptr)
    if MODE == 0:
        acc = tl.load(g_ptr + rn[:, None] * n_in + rk[None, :]).to(tl.float32)
        _epi(acc, rn, rk, n_in, w_ptr, wm_ptr, wv_ptr, ws_ptr, lr, b1, b2, eps, wd, bc1, bc2_sqrt)
    elif MODE == 1:
        acc = _kloop(dz_ptr, a_ptr, rn, rk, batch, stride_dz, stride_a, BN, BK, BB)
        acc = tl.permute(tl.reshape(acc, (BN, 2, BK // 2)), (0, 2, 1))
        lo, hi = tl.split(acc)
        rk0 = pid_k * BK + tl.arange(0, BK // 2)
        _epi(lo, rn, rk0, n_in, w_ptr, wm_ptr, wv_ptr, ws_ptr, lr, b1, b2, eps, wd, bc1, bc2_sqrt)
        _epi(hi, rn, rk0 + BK // 2, n_in, w_ptr, wm_ptr, wv_ptr, ws_ptr, lr, b1, b2, eps, wd, bc1, bc2_sqrt)
    else:
        acc = _kloop(dz_ptr, a_ptr, rn, rk, batch, stride_dz, stride_a, BN, BK, BB)
        shape = (n_out, n_in)
        strides = (n_in, 1)
        o = (pid_n * BN, pid_k * BK)
        pw = tl.make_block_ptr(w_ptr, shape, strides, o, (BN, BK), (1, 0))
        pm = tl.make_block_ptr(wm_ptr, shape, strides, o, (BN, BK), (1, 0))
        pv = tl.make_block_ptr(wv_ptr, shape, strides, o, (BN, BK), (1, 0))
        ps = tl.make_block_ptr(ws_ptr, shape, strides, o, (BN, BK), (1, 0))
        p, m, v = adamw_values(tl.load(pw), acc, tl.load(pm), tl.load(pv), lr, b1, b2, eps, wd, bc1, bc2_sqrt)
        tl.store(pw, p)
        tl.store(pm, m)
        tl.store(pv, v)
        tl.store(ps, p.to(tl.bfloat16))


hyper = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
for B, o, i in [(1024, 4096, 4096), (4096, 4096, 4096), (1024, 1024, 1024), (4096, 1024, 3072)]:
    dz = torch.randn(B, o, device=dev, dtype=bf) / B
    a = torch.randn(B, i, device=dev, dtype=bf).relu_()
    g = torch.empty(o, i, device=dev, dtype=bf)
    p = [torch.randn(o, i, device=dev), torch.randn(o, device=dev)]
    m = [torch.zeros_like(t) for t in p]; v = [torch.zeros_like(t) for t in p]
    sh = [torch.empty(o, i, device=dev, dtype=bf), torch.empty(o, device=dev, dtype=bf)]
    gb = torch.randn(o, device=dev)
    st = torch.ones((), device=dev); lr = torch.full((), 1e-3, device=dev)
    r = {"batch": B, "out": o, "in": i}
    r["cublas"] = graphed_us(lambda: dz.T @ a)
    r["unfused"] = graphed_us(lambda: adamw_with_shadow_(p, [dz.T @ a, gb], m, v, sh, st, lr, **hyper))
    r["adamw_alone"] = graphed_us(lambda: adamw_with_shadow_(p, [g, gb], m, v, sh, st, lr, **hyper))
    for name, c in {"default": wu.UpdateTiles(), "s4": wu.UpdateTiles(num_stages=4)}.items():
        r[f"fused_{name}"] = graphed_us(lambda: wu.weight_grad_adamw_(dz, a, p, gb, m, v, sh, st, lr, tiles=c, **hyper))
    for bn, bk, bb, w, s in [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4)]:
        key = f"{bn}x{bk}x{bb}w{w}s{s}"
        grid = (triton.cdiv(o, bn) * triton.cdiv(i, bk),)
        try:
            r[f"tri-gemm_{key}"] = graphed_us(lambda: tri_gemm[grid](dz, a, g, B, o, i, dz.stride(0), a.stride(0), BN=bn, BK=bk, BB=bb, GROUP=8, num_warps=w, num_stages=s))
            for mode, mname in ((0, "tri-epi"), (1, "fused-sub"), (2, "fused-bp")):
                r[f"{mname}_{key}"] = graphed_us(lambda: tri_fused[grid](
                    dz, a, g, p[0], m[0], v[0], sh[0], st, lr, B, o, i, dz.stride(0), a.stride(0),
                    0.9, 0.999, *log_betas((0.9, 0.999)), 1e-8, 0.01, BN=bn, BK=bk, BB=bb, GROUP=8, MODE=mode,
                    num_warps=w, num_stages=s))
        except Exception as e:
            r[f"error_{key}"] = repr(e)[:300]
    out["records"].append(r)
    print(json.dumps({k: (round(x, 1) if isinstance(x, float) else x) for k, x in r.items()}), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
