"""Device call 26 A/B: SM carve-out of the weight-gradient GEMMs (room for AdamW beside them) and the
row-block count; dad µs a step, interleaved rounds after 0.3 s warm-ups, median. JSON to argv[1]."""
import json
import statistics
import sys

import torch
from _gpu_common import TOPOLOGIES, dad_system, make_data, time_steps

dev = torch.device("cuda")
print("carveout api", hasattr(torch._C, "_set_sm_carveout_experimental"), flush=True)
SETTINGS = [("fmnist-wide-2", 1024), ("fmnist-wide-2", 4096), ("deep-8x1024", 4096), ("cifar10-medium-3", 4096)]
VARIANTS = [(None, 4), (16, 4), (32, 4), (64, 4), (96, 4), (32, 8), (64, 8)]
systems = {}
for topo, batch in SETTINGS:
    n_in, widths, classes = TOPOLOGIES[topo]
    x, y = make_data(n_in, classes, batch, 4, dev)
    for carve, chunks in VARIANTS:
        if topo != "fmnist-wide-2" and chunks != 4:
            continue
        trainer, fn = dad_system(n_in, widths, classes, dev, "auto", torch.bfloat16)
        trainer._engine.update_gemm_sm_carveout = carve
        trainer._engine.update_chunks = chunks
        def step(i, fn=fn, x=x, y=y, b=batch):
            j = i % 4
            fn(x[j * b:(j + 1) * b], y[j * b:(j + 1) * b])
        time_steps(step, 50, 1, 20)
        systems[(topo, batch, carve, chunks)] = step
times = {k: [] for k in systems}
for rnd in range(3):
    for k, step in systems.items():
        times[k].append(time_steps(step, 50, 5, 20, 0.2))
out = []
for (topo, batch, carve, chunks), ts in times.items():
    us = statistics.median(ts) * 1e6
    out.append({"topology": topo, "batch": batch, "carveout": carve, "chunks": chunks, "us_per_step": us})
    print(f"{topo:18s} B={batch:5d} carveout={carve!s:5s} chunks={chunks}  {us:8.1f} us/step", flush=True)
json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "records": out}, open(sys.argv[1], "w"), indent=1)
