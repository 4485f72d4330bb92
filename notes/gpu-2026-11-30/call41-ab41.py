"""Device call 41: the head sample's stream priority under stream priorities (default 0 vs -2, the
forwards' priority) and priorities off, the three topologies that use them, B=1024 and 4096, 5 rounds."""
import json, os, statistics, sys
import torch
from torch_dad.engine import FusedStep
from _gpu_common import TOPOLOGIES, dad_system, make_data, time_steps
dev = torch.device("cuda")
systems = {}
base = dict(FusedStep.STREAM_PRIORITIES)
for name in ("mnist-medium-3", "cifar10-medium-3", "deep-8x1024"):
    n_in, widths, classes = TOPOLOGIES[name]
    for B in (1024, 4096):
        x, y = make_data(n_in, classes, B, 4, dev)
        for var, flag, sample in (("off", False, 0), ("sample-0", None, 0), ("sample-critical", None, -2)):
            FusedStep.STREAM_PRIORITIES = dict(base, sample=sample)
            trainer, fn = dad_system(n_in, widths, classes, dev, "auto", torch.bfloat16)
            trainer._engine.stream_priorities = flag
            def step(i, fn=fn, x=x, y=y, b=B):
                j = i % 4
                fn(x[j * b:(j + 1) * b], y[j * b:(j + 1) * b])
            time_steps(step, 50, 1, 20)
            systems[(name, B, var)] = step
FusedStep.STREAM_PRIORITIES = base
times = {k: [] for k in systems}
for rnd in range(5):
    for k, step in systems.items():
        times[k].append(time_steps(step, 50, 3, 10, 0.1))
out = []
for (name, B, var), ts in times.items():
    us = statistics.median(ts) * 1e6
    out.append({"topology": name, "batch": B, "variant": var, "us_per_step": us, "rounds_us": [t * 1e6 for t in ts]})
    print(f"{name} B={B} {var}: {us:.1f} us/step rounds {[round(t * 1e6, 1) for t in ts]}", flush=True)
json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": os.environ.get("GIT_COMMIT"), "records": out}, open(sys.argv[1], "w"), indent=1)
