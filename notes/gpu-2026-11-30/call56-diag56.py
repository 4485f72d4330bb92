"""Device call 56: what bounds the local error's time? Variants of the tiled kernel with parts removed (wrong
results, timing only), against the default two-kernel launch and pure load/store kernels, at 4096 x 1024 and
1024 x 4096 (bf16, 10 classes); then kernel timelines of the default DAD step at deep-8x1024 B=4096 and
fmnist-wide-2 B=1024. JSON to argv[1], traces to argv[2] (a folder)."""
import json, os, statistics, sys
import torch
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile
from torch_dad.kernels import local_error as LE
from torch_dad.kernels.local_error_triton import softmax_error, times_derivative
from _gpu_common import TOPOLOGIES, dad_system, make_data, time_steps

dev = torch.device("cuda")


@triton.jit
def diag_kernel(h_ptr, w_ptr, b_ptr, y_ptr, logits_ptr, dz_ptr, gw_ptr, gb_ptr, part_ptr, count_ptr,
                M, N, C, inv_count, col_blocks, BM: tl.constexpr, BN: tl.constexpr, CP: tl.constexpr,
                PART: tl.constexpr, WAIT: tl.constexpr, GW: tl.constexpr, GB: tl.constexpr, DZ: tl.constexpr,
                MATH: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    rmask = rows < M
    cols = pid_n * BN + tl.arange(0, BN)
    nmask = cols < N
    cls = tl.arange(0, CP)
    cmask = cls < C
    h = tl.load(h_ptr + rows[:, None] * N + cols[None, :], mask=rmask[:, None] & nmask[None, :], other=0.0)
    if MATH:
        w = tl.load(w_ptr + cls[:, None] * N + cols[None, :], mask=cmask[:, None] & nmask[None, :], other=0.0).to(h.dtype)
        acc = tl.dot(h, tl.trans(w))
        part = part_ptr + rows[:, None] * CP + cls[None, :]
        if PART == 1:
            tl.atomic_add(part, acc, mask=rmask[:, None], sem="relaxed")
        if PART == 2:
            tl.atomic_add(part, acc, mask=rmask[:, None] & cmask[None, :], sem="relaxed")
        if WAIT:
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + pid_m, 1.0, sem="acq_rel") + 1.0
            while arrived < col_blocks:
                arrived = tl.atomic_add(count_ptr + pid_m, 0.0, sem="acquire")
            acc = tl.load(part, mask=rmask[:, None], other=0.0, cache_modifier=".cg")
        logits, d_logits, row_loss = softmax_error(acc, b_ptr, y_ptr, rows, rmask, cls, cmask, inv_count)
        dlc = d_logits.to(h.dtype)
        if GW:
            gw = tl.dot(tl.trans(dlc), h)
            tl.atomic_add(gw_ptr + cls[:, None] * N + cols[None, :], gw, mask=cmask[:, None] & nmask[None, :], sem="relaxed")
        dz = tl.dot(dlc, w)
        dz = times_derivative(dz, h, 0)
        if DZ:
            tl.store(dz_ptr + rows[:, None] * N + cols[None, :], dz.to(dz_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])
        if GB:
            tl.atomic_add(gb_ptr + cols, tl.sum(dz, axis=0), mask=nmask, sem="relaxed")
    else:
        if DZ:
            tl.store(dz_ptr + rows[:, None] * N + cols[None, :], h, mask=rmask[:, None] & nmask[None, :])
        else:
            tl.store(gb_ptr + cols, tl.sum(h.to(tl.float32), axis=0), mask=nmask)


def bench(fn, inner=20, reps=15):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / inner)
    return statistics.median(ts)


out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": os.environ.get("GIT_COMMIT"),
       "diag": []}
C, CP = 10, 16
VARIANTS = {
    "full": dict(PART=1, WAIT=1, GW=1, GB=1, DZ=1, MATH=1),
    "part-real-classes-only": dict(PART=2, WAIT=1, GW=1, GB=1, DZ=1, MATH=1),
    "no-gw-atomics": dict(PART=1, WAIT=1, GW=0, GB=1, DZ=1, MATH=1),
    "no-gb-atomics": dict(PART=1, WAIT=1, GW=1, GB=0, DZ=1, MATH=1),
    "no-wait": dict(PART=1, WAIT=0, GW=1, GB=1, DZ=1, MATH=1),
    "no-part-no-wait": dict(PART=0, WAIT=0, GW=1, GB=1, DZ=1, MATH=1),
    "no-dz-store": dict(PART=1, WAIT=1, GW=1, GB=1, DZ=0, MATH=1),
    "math-only": dict(PART=0, WAIT=0, GW=0, GB=0, DZ=1, MATH=1),
    "copy-h-to-dz": dict(PART=0, WAIT=0, GW=0, GB=0, DZ=1, MATH=0),
    "read-h": dict(PART=0, WAIT=0, GW=0, GB=0, DZ=0, MATH=0),
}
for M, N in ((4096, 1024), (1024, 4096), (4096, 4096)):
    h = torch.randn(M, N, device=dev).relu_().to(torch.bfloat16)
    w = torch.randn(C, N, device=dev) * N ** -0.5
    b = torch.randn(C, device=dev)
    y = torch.randint(0, C, (M,), device=dev)
    rec = {"M": M, "N": N, "default_us": bench(lambda: LE._local_error_triton(h, w, b, y, "relu", True))}
    for bm, bn, nw in ((64, 256, 8), (64, 128, 8), (32, 128, 4)):
        rb, cb = -(-M // bm), -(-N // bn)
        for name, flags in VARIANTS.items():
            def run(flags=flags, bm=bm, bn=bn, nw=nw, rb=rb, cb=cb):
                sums = torch.zeros(C * N + N + M * CP + rb, device=dev)
                dz = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
                logits = torch.empty(M, C, device=dev)
                diag_kernel[(cb, rb)](h, w, b, y, logits, dz, sums, sums[C * N:], sums[C * N + N:], sums[C * N + N + M * CP:],
                                      M, N, C, 1.0 / M, float(cb), BM=bm, BN=bn, CP=CP, num_warps=nw, num_stages=1, **flags)
            rec[f"bm{bm}-bn{bn}-w{nw} {name}"] = bench(run)
    def memset_only(M=M, N=N):
        torch.zeros(C * N + N + M * CP + M // 64, device=dev)
    rec["memset-only"] = bench(memset_only)
    out["diag"].append(rec)
    print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in rec.items()}, indent=0), flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)

for name, B in (("deep-8x1024", 4096), ("fmnist-wide-2", 1024)):
    n_in, widths, classes = TOPOLOGIES[name]
    x, y = make_data(n_in, classes, B, 4, dev)
    trainer, fn = dad_system(n_in, widths, classes, dev, "auto", torch.bfloat16)
    def step(i, fn=fn, x=x, y=y, B=B):
        j = i % 4
        fn(x[j * B:(j + 1) * B], y[j * B:(j + 1) * B])
    us = time_steps(step, 50, 5, 20, 0.3) * 1e6
    print(name, B, "us/step", us, flush=True)
    out.setdefault("steps", []).append({"topology": name, "batch": B, "us_per_step": us})
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(5):
            step(i)
        torch.cuda.synchronize()
    prof.export_chrome_trace(os.path.join(sys.argv[2], f"trace-{name}-{B}.json"))
json.dump(out, open(sys.argv[1], "w"), indent=1)
