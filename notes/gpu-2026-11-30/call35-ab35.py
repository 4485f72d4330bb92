"""Device call 35: the fused weight-gradient + AdamW kernel (kernels/weight_update.py).

A. Every DAD layer shape of the four topologies at B=1024 and 4096: cuBLAS GEMM + AdamW kernel
   (the engine's unfused path) against the fused kernel in several launch configurations,
   each timed alone, 20 calls in a CUDA graph, median of 7 replays.
B. The graphed DADTrainer.step, fused_weight_update False / True (default tiles) / True (the
   best tiles of A for each shape), 5 interleaved rounds.
C. A torch.profiler trace of fmnist-wide-2 B=1024 with the fused update (kernel timeline).
JSON to argv[1], trace to argv[2].
"""
import json, os, statistics, sys
import torch
from torch_dad.kernels import weight_update as wu
from torch_dad.kernels.adamw import adamw_with_shadow_
from _gpu_common import TOPOLOGIES, dad_system, make_data, time_steps

dev = torch.device("cuda")
bf = torch.bfloat16
out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": os.environ.get("GIT_COMMIT"),
       "kernels": [], "steps": []}


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


CONFIGS = [wu.UpdateTiles(), wu.UpdateTiles(num_warps=4), wu.UpdateTiles(block_b=32, num_stages=4),
           wu.UpdateTiles(block_k=256), wu.UpdateTiles(block_n=256), wu.UpdateTiles(block_n=64, num_warps=4, num_stages=4),
           wu.UpdateTiles(block_k=64, num_warps=4, num_stages=4), wu.UpdateTiles(block_b=128, num_stages=2),
           wu.UpdateTiles(group=4), wu.UpdateTiles(num_stages=4)]
shapes = set()
for n_in, widths, _ in TOPOLOGIES.values():
    dims = [n_in, *widths]
    for i, o in zip(dims[:-1], dims[1:]):
        for B in (1024, 4096):
            shapes.add((B, o, i))
best = {}
hyper = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
for B, o, i in sorted(shapes):
    dz = torch.randn(B, o, device=dev, dtype=bf) / B
    a = torch.randn(B, i, device=dev, dtype=bf).relu_()
    p = [torch.randn(o, i, device=dev), torch.randn(o, device=dev)]
    m = [torch.zeros_like(t) for t in p]; v = [torch.zeros_like(t) for t in p]
    sh = [torch.empty(o, i, device=dev, dtype=bf), torch.empty(o, device=dev, dtype=bf)]
    gb = torch.randn(o, device=dev)
    st = torch.ones((), device=dev); lr = torch.full((), 1e-3, device=dev)
    unfused = graphed_us(lambda: adamw_with_shadow_(p, [dz.T @ a, gb], m, v, sh, st, lr, **hyper))
    gemm = graphed_us(lambda: dz.T @ a)
    rec = {"batch": B, "out": o, "in": i, "unfused_us": unfused, "gemm_us": gemm, "fused_us": {}}
    for c in CONFIGS:
        try:
            us = graphed_us(lambda: wu.weight_grad_adamw_(dz, a, p, gb, m, v, sh, st, lr, tiles=c, **hyper))
        except Exception as e:  # e.g. shared memory overflow
            us = None
            rec.setdefault("errors", {})[str(c)] = repr(e)[:200]
        rec["fused_us"][str(c)] = us
    ok = {k: u for k, u in rec["fused_us"].items() if u is not None}
    kbest = min(ok, key=ok.get)
    best[(B, o, i)] = next(c for c in CONFIGS if str(c) == kbest)
    rec["best"] = kbest
    rec["bytes_fused"] = o * i * 26 + B * (o + i) * 2
    out["kernels"].append(rec)
    print(f"B={B} {o}x{i}: unfused {unfused:.1f} (gemm {gemm:.1f}) default {rec['fused_us'][str(CONFIGS[0])]} best {ok[kbest]:.1f} {kbest}", flush=True)

# B: in-step A/B
real_fn = wu.weight_grad_adamw_


def with_best(d_z, a, params, *args, tiles=None, **kw):
    key = (d_z.shape[0], d_z.shape[1], a.shape[1])
    return real_fn(d_z, a, params, *args, tiles=best.get(key), **kw)


import torch_dad.engine as eng
variants = {"off": (False, real_fn), "fused": (None, real_fn), "fused-best": (None, with_best)}
systems = {}
for name, (n_in, widths, classes) in TOPOLOGIES.items():
    for B in (1024, 4096):
        x, y = make_data(n_in, classes, B, 4, dev)
        for var, (flag, fn_) in variants.items():
            eng.weight_grad_adamw_ = fn_
            trainer, fn = dad_system(n_in, widths, classes, dev, "auto", bf)
            trainer._engine.fused_weight_update = flag
            def step(i, fn=fn, x=x, y=y, b=B):
                j = i % 4
                fn(x[j * b:(j + 1) * b], y[j * b:(j + 1) * b])
            time_steps(step, 50, 1, 20)  # captures with this variant's kernel
            systems[(name, B, var)] = step
eng.weight_grad_adamw_ = real_fn
times = {k: [] for k in systems}
for rnd in range(5):
    for k, step in systems.items():
        times[k].append(time_steps(step, 50, 3, 10, 0.1))
for (name, B, var), ts in times.items():
    us = statistics.median(ts) * 1e6
    out["steps"].append({"topology": name, "batch": B, "variant": var, "us_per_step": us, "rounds_us": [t * 1e6 for t in ts]})
    print(f"{name} B={B} {var}: {us:.1f} us/step rounds {[round(t * 1e6, 1) for t in ts]}", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)

# C: timeline of fmnist-wide-2 B=1024, fused update
from torch.profiler import ProfilerActivity, profile
step = systems[("fmnist-wide-2", 1024, "fused")]
for i in range(10):
    step(i)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for i in range(5):
        step(i)
    torch.cuda.synchronize()
prof.export_chrome_trace(sys.argv[2])
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
