"""Device call 59: the head sample's draws made in the draw kernel (Philox, this commit) against the default
CUDA generator inside the graph (the previous add_on_device, restored by a patch), `dad` defaults, 5 interleaved
rounds; also the host's time per step call. JSON to argv[1]."""
import json, os, statistics, sys, time
import torch
from torch_dad import ridge
from torch_dad.kernels.reservoir import reservoir_add_
from _gpu_common import TOPOLOGIES, dad_system, make_data, time_steps

dev = torch.device("cuda")
NEW = ridge.InputReservoir.add_on_device


def old_add_on_device(self, inputs, labels):
    draws = torch.rand(inputs.shape[0], device=self.seen.device, dtype=torch.float64)
    reservoir_add_(self.inputs, self.labels, self.seen, self._winner, inputs, labels, draws)


systems = {}
SETTINGS = [("mnist-medium-3", 1024), ("cifar10-medium-3", 1024), ("mnist-medium-3", 4096), ("cifar10-medium-3", 4096),
            ("fmnist-wide-2", 1024), ("deep-8x1024", 4096)]
for name, B in SETTINGS:
    n_in, widths, classes = TOPOLOGIES[name]
    x, y = make_data(n_in, classes, B, 4, dev)
    for variant, fn_add in (("generator", old_add_on_device), ("philox", NEW)):
        ridge.InputReservoir.add_on_device = fn_add
        trainer, fn = dad_system(n_in, widths, classes, dev, "auto", torch.bfloat16)
        def step(i, fn=fn, x=x, y=y, B=B):
            j = i % 4
            fn(x[j * B:(j + 1) * B], y[j * B:(j + 1) * B])
        time_steps(step, 30, 1, 10)  # captures with this variant
        systems[(name, B, variant)] = (step, trainer)
ridge.InputReservoir.add_on_device = NEW
times = {k: [] for k in systems}
host = {k: [] for k in systems}
for rnd in range(5):
    for k, (step, _) in systems.items():
        times[k].append(time_steps(step, 50, 3, 10, 0.05) * 1e6)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(50):
            step(i)
        host[k].append((time.perf_counter() - t0) / 50 * 1e6)
        torch.cuda.synchronize()
out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": os.environ.get("GIT_COMMIT"), "runs": []}
for (name, B, variant), (step, trainer) in systems.items():
    s = trainer.head_sample
    rec = {"topology": name, "batch": B, "variant": variant, "us_per_step": statistics.median(times[(name, B, variant)]),
           "rounds_us": times[(name, B, variant)], "host_us_per_call": statistics.median(host[(name, B, variant)]),
           "sample_size": s.size, "sample_seen": int(s.seen)}
    out["runs"].append(rec)
    print(f"{name} B={B} {variant}: {rec['us_per_step']:.1f} us/step (rounds {[round(t, 1) for t in rec['rounds_us']]}), "
          f"host {rec['host_us_per_call']:.1f} us/call, sample {rec['sample_size']} of {rec['sample_seen']}", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
