"""Device call 19 A/B: the weight-gradient GEMM's output dtype (fp32 vs bf16) and the row-block count,
dad step time per config, interleaved rounds, median. Writes JSON to argv[1]."""
import json, sys, statistics
import torch
from _gpu_common import TOPOLOGIES, dad_system, make_data, time_steps

dev = torch.device("cuda")
configs = []
for topo, batch in (("fmnist-wide-2", 1024), ("fmnist-wide-2", 4096), ("mnist-medium-3", 1024), ("deep-8x1024", 4096),
                    ("cifar10-medium-3", 4096)):
    grids = [(fp32, chunks) for fp32 in (True, False) for chunks in ((1, 2, 4, 8) if topo == "fmnist-wide-2" else (4,))]
    for fp32, chunks in grids:
        configs.append((topo, batch, fp32, chunks))
systems = {}
for topo, batch, fp32, chunks in configs:
    n_in, widths, classes = TOPOLOGIES[topo]
    trainer, fn = dad_system(n_in, widths, classes, dev, "auto", torch.bfloat16)
    eng = trainer._engine
    eng.fp32_weight_grads = fp32
    if chunks == 1:
        eng.update_chunk_numel = 1 << 40
    else:
        eng.update_chunks = chunks
    x, y = make_data(n_in, classes, batch, 4, dev)
    def step(i, fn=fn, x=x, y=y, b=batch):
        j = i % 4
        fn(x[j * b:(j + 1) * b], y[j * b:(j + 1) * b])
    systems[(topo, batch, fp32, chunks)] = step
times = {k: [] for k in systems}
for rnd in range(3):
    for k, step in systems.items():
        times[k].append(time_steps(step, 50, 5, 10 if rnd else 20))
out = []
for (topo, batch, fp32, chunks), ts in times.items():
    us = statistics.median(ts) * 1e6
    out.append({"topology": topo, "batch": batch, "fp32_weight_grads": fp32, "update_chunks": chunks, "us_per_step": us,
                "img_per_s": batch / (us / 1e6)})
    print(f"{topo:18s} B={batch:5d} fp32_grads={fp32!s:5s} chunks={chunks}  {us:8.1f} us/step", flush=True)
json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "records": out}, open(sys.argv[1], "w"), indent=1)
