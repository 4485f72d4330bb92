"""Device call 33 A/B: the row-block update (FusedStep.update_chunks / update_chunk_numel) swept;
dad µs a step, interleaved rounds after 0.2 s warm-ups, median. JSON to argv[1]."""
import json
import statistics
import sys

import torch
from _gpu_common import TOPOLOGIES, dad_system, make_data, time_steps

dev = torch.device("cuda")
M = 2**20
CONFIGS = {
    ("fmnist-wide-2", 1024): [(4, 8 * M), (2, 8 * M), (8, 8 * M), (16, 8 * M), (4, 2 * M), (8, 2 * M)],
    ("fmnist-wide-2", 4096): [(4, 8 * M), (2, 8 * M), (8, 8 * M), (16, 8 * M), (4, 2 * M)],
    ("deep-8x1024", 4096): [(4, 8 * M), (4, M // 2)],
    ("cifar10-medium-3", 4096): [(4, 8 * M), (4, 2 * M)],
}
systems = {}
for (topo, batch), configs in CONFIGS.items():
    n_in, widths, classes = TOPOLOGIES[topo]
    x, y = make_data(n_in, classes, batch, 4, dev)
    for chunks, numel in configs:
        trainer, fn = dad_system(n_in, widths, classes, dev, "auto", torch.bfloat16)
        trainer._engine.update_chunks = chunks
        trainer._engine.update_chunk_numel = numel
        def step(i, fn=fn, x=x, y=y, b=batch):
            j = i % 4
            fn(x[j * b:(j + 1) * b], y[j * b:(j + 1) * b])
        time_steps(step, 50, 1, 20)
        systems[(topo, batch, chunks, numel)] = step
times = {k: [] for k in systems}
for rnd in range(5):
    for k, step in systems.items():
        times[k].append(time_steps(step, 50, 5, 20, 0.2))
out = []
for (topo, batch, chunks, numel), ts in times.items():
    us = statistics.median(ts) * 1e6
    out.append({"topology": topo, "batch": batch, "update_chunks": chunks, "update_chunk_numel": numel,
                "us_per_step": us, "rounds_us": [t * 1e6 for t in ts]})
    print(f"{topo:18s} B={batch:5d} chunks={chunks:2d} numel>={numel / M:4.1f}M {us:8.1f} us/step  rounds {[round(t * 1e6, 1) for t in ts]}", flush=True)
json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "records": out}, open(sys.argv[1], "w"), indent=1)
