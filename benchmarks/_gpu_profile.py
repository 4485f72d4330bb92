"""Kernel-level profile of one training step (dad vs backprop-graphed), for docs/design-engine.md.

For each system: kernels per step, summed kernel time per step, and the step's wall time, so
launch gaps (wall - busy) are visible; plus the ten costliest kernels. Also the arithmetic
floor of the step's GEMMs at the measured bf16 rate. Run: python _gpu_profile.py [topology] [batch]
"""

from __future__ import annotations

import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from _common import cuda_kernel_times
from _gpu_common import TOPOLOGIES, backprop_graphed, dad_system, flop_ratio, make_data, time_steps


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "mnist-medium-3"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    n_in, widths, classes = TOPOLOGIES[name]
    dev = torch.device("cuda")
    x, y = make_data(n_in, classes, batch, 4, dev)
    out = {"topology": name, "batch": batch, "flop_ratio": flop_ratio(n_in, widths, classes)}
    dims = [n_in, *widths, classes]
    macs = sum(a * b for a, b in zip(dims[:-1], dims[1:]))
    out["backprop_gflop_per_step"] = 2 * batch * (3 * macs - n_in * widths[0]) / 1e9
    for system in ("dad", "dad-no-head-stats", "backprop-graphed"):
        if system.startswith("dad"):
            _, fn = dad_system(n_in, widths, classes, dev, "auto", torch.bfloat16, head={"dad": "sample", "dad-gram-stats": "gram"}.get(system, "none"))
        else:
            fn = backprop_graphed(n_in, widths, classes, dev, torch.bfloat16, batch)

        def step(i: int, fn=fn) -> None:  # type: ignore[no-untyped-def]
            j = i % 4
            fn(x[j * batch : (j + 1) * batch], y[j * batch : (j + 1) * batch])

        wall = time_steps(step, 50, 5, 20)
        n = 20
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(n):
                step(i)
            torch.cuda.synchronize()
        per_kernel = cuda_kernel_times(prof)
        count = sum(len(v) for v in per_kernel.values()) / n
        busy = sum(sum(v) for v in per_kernel.values()) / n
        top = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:12]
        out[system] = {
            "wall_us_per_step": wall * 1e6, "kernels_per_step": count, "kernel_busy_us_per_step": busy,
            "top": [{"kernel": k[:90], "calls_per_step": len(v) / n, "us_per_step": sum(v) / n} for k, v in top],
        }
        print(json.dumps({system: out[system]}, indent=1), flush=True)
        del fn
    print(json.dumps(out))


if __name__ == "__main__":
    main()
