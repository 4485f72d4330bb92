"""Device call 38: kernel timeline of the default DAD step, fmnist-wide-2 B=1024 (chrome trace to argv[1])."""
import sys
import torch
from torch.profiler import ProfilerActivity, profile
from _gpu_common import TOPOLOGIES, dad_system, make_data, time_steps
dev = torch.device("cuda")
n_in, widths, classes = TOPOLOGIES["fmnist-wide-2"]
B = 1024
x, y = make_data(n_in, classes, B, 4, dev)
trainer, fn = dad_system(n_in, widths, classes, dev, "auto", torch.bfloat16)
def step(i):
    j = i % 4
    fn(x[j * B:(j + 1) * B], y[j * B:(j + 1) * B])
print("us/step", time_steps(step, 50, 5, 20, 0.3) * 1e6, flush=True)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for i in range(5):
        step(i)
    torch.cuda.synchronize()
prof.export_chrome_trace(sys.argv[1])
