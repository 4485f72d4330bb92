"""Device call 34: the new default (update_chunks=None: 4 blocks up to 2048 rows, else 2) against 4 blocks
always, fmnist-wide-2, 5 interleaved rounds. JSON to argv[1]."""
import json, statistics, sys
import torch
from _gpu_common import TOPOLOGIES, dad_system, make_data, time_steps
dev = torch.device("cuda")
systems = {}
n_in, widths, classes = TOPOLOGIES["fmnist-wide-2"]
for batch in (1024, 4096):
    x, y = make_data(n_in, classes, batch, 4, dev)
    for chunks in (None, 4):
        trainer, fn = dad_system(n_in, widths, classes, dev, "auto", torch.bfloat16)
        trainer._engine.update_chunks = chunks
        def step(i, fn=fn, x=x, y=y, b=batch):
            j = i % 4
            fn(x[j * b:(j + 1) * b], y[j * b:(j + 1) * b])
        time_steps(step, 50, 1, 20)
        systems[(batch, chunks)] = step
times = {k: [] for k in systems}
for rnd in range(5):
    for k, step in systems.items():
        times[k].append(time_steps(step, 50, 5, 20, 0.2))
out = []
for (batch, chunks), ts in times.items():
    us = statistics.median(ts) * 1e6
    out.append({"topology": "fmnist-wide-2", "batch": batch, "update_chunks": chunks, "us_per_step": us, "rounds_us": [t * 1e6 for t in ts]})
    print(f"fmnist-wide-2 B={batch} update_chunks={chunks} {us:.1f} us/step rounds {[round(t * 1e6, 1) for t in ts]}", flush=True)
json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "records": out}, open(sys.argv[1], "w"), indent=1)
