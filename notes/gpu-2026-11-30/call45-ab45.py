"""Device call 45: the AdamW kernel on few looping programs (FusedStep.adamw_programs) alone and beside a
GEMM, and in the step; per-layer head updates vs one fused launch; with/without defer_last_update."""
import json, os, statistics, sys
import torch
import torch_dad.kernels.adamw as K
from torch_dad.engine import FusedStep
from _gpu_common import TOPOLOGIES, dad_system, make_data, time_steps
dev = torch.device("cuda")
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": os.environ.get("GIT_COMMIT"),
       "kernel": [], "beside_gemm": [], "records": []}
shapes = [(4096, 4096), (4096,)]
p = [torch.randn(s, device=dev) for s in shapes]
g = [torch.randn(shapes[0], device=dev, dtype=torch.bfloat16), torch.randn(shapes[1], device=dev)]
m = [torch.zeros(s, device=dev) for s in shapes]
v = [torch.zeros(s, device=dev) for s in shapes]
sh = [torch.empty(s, device=dev, dtype=torch.bfloat16) for s in shapes]
st, lr = torch.tensor(3.0, device=dev), torch.tensor(1e-4, device=dev)
def adamw(programs):
    K.adamw_with_shadow_(p, g, m, v, sh, st, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, programs=programs)
for block, warps in ((2048, 4), (4096, 8), (8192, 16)):
    K.PERSISTENT_BLOCK, K.PERSISTENT_WARPS = block, warps
    for P in (None, 16, 33, 66, 132, 264, 528):
        if P is None and block != 2048:
            continue
        us = statistics.median(time_steps(lambda i, P=P: adamw(P), 50, 3, 10) * 1e6 for _ in range(3))
        out["kernel"].append({"block": block, "warps": warps, "programs": P, "us": us})
        print(f"adamw alone block={block} warps={warps} programs={P}: {us:.1f} us", flush=True)
K.PERSISTENT_BLOCK, K.PERSISTENT_WARPS = 4096, 8
# beside a 4096 x 4096 x 1024 bf16 GEMM on another stream, launched right after the AdamW
a = torch.randn(1024, 4096, device=dev, dtype=torch.bfloat16)
w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
gemm_alone = statistics.median(time_steps(lambda i: a @ w.T, 50, 3, 10) * 1e6 for _ in range(3))
print(f"gemm alone {gemm_alone:.1f} us", flush=True)
def pair(i, P):
    s1.wait_stream(torch.cuda.current_stream()); s2.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s1):
        adamw(P)
    with torch.cuda.stream(s2):
        a @ w.T
    torch.cuda.current_stream().wait_stream(s1); torch.cuda.current_stream().wait_stream(s2)
for P in (None, 16, 33, 66, 99, 132):
    us = statistics.median(time_steps(lambda i, P=P: pair(i, P), 30, 3, 10) * 1e6 for _ in range(3))
    out["beside_gemm"].append({"programs": P, "us_both": us, "gemm_alone_us": gemm_alone})
    print(f"adamw(programs={P}) + gemm on two streams: {us:.1f} us", flush=True)
plan = {
    ("fmnist-wide-2", 1024): ["base", "heads-fused", "P32", "P66", "P99", "deferred", "deferred+P32", "deferred+P66"],
    ("fmnist-wide-2", 4096): ["base", "heads-fused", "P66", "deferred+P66"],
    ("deep-8x1024", 1024): ["base", "heads-fused", "P66", "deferred+P66"],
    ("mnist-medium-3", 1024): ["base", "heads-fused", "P66"],
    ("cifar10-medium-3", 4096): ["base", "heads-fused", "P66"],
}
systems = {}
for (name, B), variants in plan.items():
    n_in, widths, classes = TOPOLOGIES[name]
    x, y = make_data(n_in, classes, B, 4, dev)
    for var in variants:
        trainer, fn = dad_system(n_in, widths, classes, dev, "auto", torch.bfloat16, defer_last_update="deferred" in var)
        e = trainer._engine
        e.head_updates_per_layer = var != "heads-fused"
        e.adamw_programs = int(var.split("P")[1]) if "P" in var else None
        def step(i, fn=fn, x=x, y=y, b=B):
            j = i % 4
            fn(x[j * b:(j + 1) * b], y[j * b:(j + 1) * b])
        time_steps(step, 50, 1, 20)
        systems[(name, B, var)] = step
times = {k: [] for k in systems}
for rnd in range(5):
    for k, step in systems.items():
        times[k].append(time_steps(step, 50, 3, 10, 0.1))
for (name, B, var), ts in times.items():
    us = statistics.median(ts) * 1e6
    out["records"].append({"topology": name, "batch": B, "variant": var, "us_per_step": us, "rounds_us": [t * 1e6 for t in ts]})
    print(f"{name} B={B} {var}: {us:.1f} us/step rounds {[round(t * 1e6, 1) for t in ts]}", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
from torch.profiler import ProfilerActivity, profile
for var, path in (("P66", sys.argv[2]), ("deferred+P66", sys.argv[3])):
    step = systems[("fmnist-wide-2", 1024, var)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(5):
            step(i)
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
