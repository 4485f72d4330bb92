"""Device call 44: FusedStep.defer_last_update A/B after the gate fix (a branch, not n := 0), and the
gated AdamW kernel alone. Step variants: default, deferred, deferred + stream priorities; 5 rounds."""
import json, os, statistics, sys
import torch
from torch_dad.kernels.adamw import adamw_with_shadow_
from _gpu_common import TOPOLOGIES, dad_system, make_data, time_steps
dev = torch.device("cuda")
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": os.environ.get("GIT_COMMIT"),
       "kernel": {}, "records": []}
# the kernel alone: 4096 x 4096 weight + bias, bf16 grad and shadow
shapes = [(4096, 4096), (4096,)]
p = [torch.randn(s, device=dev) for s in shapes]
g = [torch.randn(shapes[0], device=dev, dtype=torch.bfloat16), torch.randn(shapes[1], device=dev)]
m = [torch.zeros(s, device=dev) for s in shapes]
v = [torch.zeros(s, device=dev) for s in shapes]
sh = [torch.empty(s, device=dev, dtype=torch.bfloat16) for s in shapes]
step_t, lr = torch.tensor(3.0, device=dev), torch.tensor(1e-4, device=dev)
for name, flag in (("ungated", None), ("gated-on", 1), ("gated-off", 0)):
    en = None if flag is None else torch.tensor(flag, device=dev, dtype=torch.int32)
    call = lambda i, en=en: adamw_with_shadow_(p, g, m, v, sh, step_t, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, enabled=en)
    ts = [time_steps(call, 50, 3, 10) * 1e6 for _ in range(3)]
    out["kernel"][name] = statistics.median(ts)
    print("kernel", name, round(statistics.median(ts), 1), "us", flush=True)
systems = {}
for name, B in (("fmnist-wide-2", 1024), ("fmnist-wide-2", 4096), ("deep-8x1024", 1024), ("mnist-medium-3", 1024)):
    n_in, widths, classes = TOPOLOGIES[name]
    x, y = make_data(n_in, classes, B, 4, dev)
    for var, defer, prio in (("default", False, None), ("deferred", True, None), ("deferred+priorities", True, True)):
        trainer, fn = dad_system(n_in, widths, classes, dev, "auto", torch.bfloat16, defer_last_update=defer)
        trainer._engine.stream_priorities = prio
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
# timeline of the deferred fmnist-wide-2 B=1024 step
from torch.profiler import ProfilerActivity, profile
step = systems[("fmnist-wide-2", 1024, "deferred")]
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for i in range(5):
        step(i)
    torch.cuda.synchronize()
prof.export_chrome_trace(sys.argv[2])
