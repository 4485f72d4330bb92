"""Device call 30 A/B (repeat of call 28 at B=1024, 5 rounds): local errors off the main stream (FusedStep.local_error_off_main) vs on it;
dad µs a step, interleaved rounds after 0.2 s warm-ups, median. JSON to argv[1]."""
import json
import statistics
import sys

import torch
from _gpu_common import TOPOLOGIES, dad_system, make_data, time_steps

dev = torch.device("cuda")
SETTINGS = [(t, 1024) for t in TOPOLOGIES] + [("cifar10-medium-3", 4096)]
systems = {}
for topo, batch in SETTINGS:
    n_in, widths, classes = TOPOLOGIES[topo]
    x, y = make_data(n_in, classes, batch, 4, dev)
    for off in (False, True):
        trainer, fn = dad_system(n_in, widths, classes, dev, "auto", torch.bfloat16)
        trainer._engine.local_error_off_main = off
        def step(i, fn=fn, x=x, y=y, b=batch):
            j = i % 4
            fn(x[j * b:(j + 1) * b], y[j * b:(j + 1) * b])
        time_steps(step, 50, 1, 20)
        systems[(topo, batch, off)] = step
times = {k: [] for k in systems}
for rnd in range(5):
    for k, step in systems.items():
        times[k].append(time_steps(step, 50, 5, 20, 0.2))
out = []
for (topo, batch, off), ts in times.items():
    us = statistics.median(ts) * 1e6
    out.append({"topology": topo, "batch": batch, "local_error_off_main": off, "us_per_step": us, "rounds_us": [t * 1e6 for t in ts]})
    print(f"{topo:18s} B={batch:5d} off_main={off!s:5s} {us:8.1f} us/step  rounds {[round(t * 1e6, 1) for t in ts]}", flush=True)
json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "records": out}, open(sys.argv[1], "w"), indent=1)
