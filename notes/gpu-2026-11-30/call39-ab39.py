"""Device call 39: FusedStep.stream_priorities (AdamW at the lowest stream priority, forwards and
local errors highest, weight-gradient GEMMs next) against the default streams, the four
topologies at B=1024 and 4096, 5 interleaved rounds; then the timeline of fmnist-wide-2 B=1024
with priorities. JSON to argv[1], trace to argv[2]."""
import json, os, statistics, sys
import torch
from _gpu_common import TOPOLOGIES, dad_system, make_data, time_steps
dev = torch.device("cuda")
print("stream priority range", torch.cuda.Stream.priority_range(), flush=True)
systems = {}
for name, (n_in, widths, classes) in TOPOLOGIES.items():
    for B in (1024, 4096):
        x, y = make_data(n_in, classes, B, 4, dev)
        for var, flag in (("default", False), ("priorities", True)):
            trainer, fn = dad_system(n_in, widths, classes, dev, "auto", torch.bfloat16)
            trainer._engine.stream_priorities = flag
            def step(i, fn=fn, x=x, y=y, b=B):
                j = i % 4
                fn(x[j * b:(j + 1) * b], y[j * b:(j + 1) * b])
            time_steps(step, 50, 1, 20)
            systems[(name, B, var)] = step
times = {k: [] for k in systems}
for rnd in range(5):
    for k, step in systems.items():
        times[k].append(time_steps(step, 50, 3, 10, 0.1))
out = []
for (name, B, var), ts in times.items():
    us = statistics.median(ts) * 1e6
    out.append({"topology": name, "batch": B, "streams": var, "us_per_step": us, "rounds_us": [t * 1e6 for t in ts]})
    print(f"{name} B={B} {var}: {us:.1f} us/step rounds {[round(t * 1e6, 1) for t in ts]}", flush=True)
json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": os.environ.get("GIT_COMMIT"), "records": out}, open(sys.argv[1], "w"), indent=1)
from torch.profiler import ProfilerActivity, profile
step = systems[("fmnist-wide-2", 1024, "priorities")]
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for i in range(5):
        step(i)
    torch.cuda.synchronize()
prof.export_chrome_trace(sys.argv[2])
