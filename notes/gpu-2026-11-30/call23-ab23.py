"""Device call 23 A/B: stream priorities and update overlap of the captured step; dad µs a step per variant,
interleaved rounds, median. Writes JSON to argv[1]."""
import json, sys, statistics
import torch
from _gpu_common import TOPOLOGIES, dad_system, make_data, time_steps

dev = torch.device("cuda")
print("priority range", torch.cuda.Stream.priority_range(), flush=True)
VARIANTS = {"default": {}, "main-high": {"capture_priority": -5}, "side-high": {"side_priority": -5},
            "no-overlap": {"overlap_updates": False}, "main-high+no-sample-side": {"capture_priority": -5, "side_priority": 0}}
SETTINGS = [("deep-8x1024", 4096), ("deep-8x1024", 1024), ("fmnist-wide-2", 1024), ("mnist-medium-3", 1024),
            ("cifar10-medium-3", 4096)]
systems = {}
for topo, batch in SETTINGS:
    n_in, widths, classes = TOPOLOGIES[topo]
    x, y = make_data(n_in, classes, batch, 4, dev)
    for name, knobs in VARIANTS.items():
        if name == "main-high+no-sample-side":
            continue
        trainer, fn = dad_system(n_in, widths, classes, dev, "auto", torch.bfloat16)
        for k, v in knobs.items():
            setattr(trainer._engine, k, v)
        def step(i, fn=fn, x=x, y=y, b=batch):
            j = i % 4
            fn(x[j * b:(j + 1) * b], y[j * b:(j + 1) * b])
        systems[(topo, batch, name)] = step
times = {k: [] for k in systems}
for rnd in range(3):
    for k, step in systems.items():
        times[k].append(time_steps(step, 50, 5, 10 if rnd else 20))
out = []
for (topo, batch, name), ts in times.items():
    us = statistics.median(ts) * 1e6
    out.append({"topology": topo, "batch": batch, "variant": name, "us_per_step": us, "img_per_s": batch / (us / 1e6)})
    print(f"{topo:18s} B={batch:5d} {name:12s} {us:8.1f} us/step", flush=True)
json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "records": out}, open(sys.argv[1], "w"), indent=1)
