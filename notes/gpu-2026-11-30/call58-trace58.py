"""Device call 58: why `dad` (with the 4,096-row head sample) is slower than `dad-no-head-stats` at
cifar10-medium-3 B=1024: per-step times in 5 interleaved rounds (CUDA events around 50 steps, and the host's
time per step call), then kernel timelines (chrome traces to argv[2]) of both, and of mnist-medium-3 B=1024."""
import json, os, statistics, sys, time
import torch
from torch.profiler import ProfilerActivity, profile
from _gpu_common import TOPOLOGIES, dad_system, make_data, time_steps

dev = torch.device("cuda")
out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": os.environ.get("GIT_COMMIT"), "runs": []}
systems = {}
for name in ("cifar10-medium-3", "mnist-medium-3"):
    n_in, widths, classes = TOPOLOGIES[name]
    B = 1024
    x, y = make_data(n_in, classes, B, 4, dev)
    for head in ("sample", "none"):
        trainer, fn = dad_system(n_in, widths, classes, dev, "auto", torch.bfloat16, head=head)
        def step(i, fn=fn, x=x, y=y, B=B):
            j = i % 4
            fn(x[j * B:(j + 1) * B], y[j * B:(j + 1) * B])
        time_steps(step, 30, 1, 10)
        systems[(name, head)] = (step, trainer)
times = {k: [] for k in systems}
host = {k: [] for k in systems}
for rnd in range(5):
    for k, (step, _) in systems.items():
        times[k].append(time_steps(step, 50, 3, 10, 0.05) * 1e6)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(50):
            step(i)
        host[k].append((time.perf_counter() - t0) / 50 * 1e6)  # host time per call, GPU not waited for
        torch.cuda.synchronize()
for k in systems:
    rec = {"topology": k[0], "head": k[1], "us_per_step": statistics.median(times[k]), "rounds": times[k],
           "host_us_per_call": statistics.median(host[k])}
    out["runs"].append(rec)
    print(json.dumps({a: (round(b, 1) if isinstance(b, float) else b) for a, b in rec.items() if a != "rounds"}),
          [round(t, 1) for t in times[k]], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
for k, (step, trainer) in systems.items():
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(5):
            step(i)
        torch.cuda.synchronize()
    prof.export_chrome_trace(os.path.join(sys.argv[2], f"trace-{k[0]}-1024-{k[1]}.json"))
