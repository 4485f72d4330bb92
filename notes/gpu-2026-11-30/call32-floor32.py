"""Device call 32: the fmnist-wide-2 floor against what 5x the wheel needs, in one run.

Per batch (1024, 4096): each GEMM of the step and the AdamW kernel timed alone inside a CUDA
graph (20 calls per replay, median of 7 replays), the HBM copy bandwidth and a large bf16 GEMM
for the achievable rates, the DAD step itself, and the wheel (in subprocesses, 3 runs).
"""
import json, os, statistics, subprocess, sys
import torch
from torch_dad.kernels.adamw import adamw_with_shadow_
from _gpu_common import dad_system, make_data, time_steps

dev = torch.device("cuda")
bf = torch.bfloat16
out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": os.environ.get("GIT_COMMIT")}


def graphed_us(fn, calls=20, replays=7):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    t = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        t.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(t)

# achievable rates
big = torch.randn(8192, 8192, device=dev, dtype=bf)
out["bf16_gemm_8192_tflops"] = 2 * 8192**3 / graphed_us(lambda: big @ big, calls=5) / 1e6
src = torch.empty(2**28, device=dev, dtype=torch.float32); dst = torch.empty_like(src)
out["copy_1GiB_tb_s"] = 2 * src.numel() * 4 / graphed_us(lambda: dst.copy_(src), calls=5) / 1e6
del big, src, dst

for B in (1024, 4096):
    r = {}
    x = torch.randn(B, 784, device=dev, dtype=bf); h1 = torch.randn(B, 4096, device=dev, dtype=bf).relu_()
    w1 = torch.randn(4096, 784, device=dev, dtype=bf) * 0.03; b1 = torch.zeros(4096, device=dev, dtype=bf)
    w2 = torch.randn(4096, 4096, device=dev, dtype=bf) * 0.01; b2 = torch.zeros(4096, device=dev, dtype=bf)
    dz1 = torch.randn(B, 4096, device=dev, dtype=bf); dz2 = torch.randn(B, 4096, device=dev, dtype=bf)
    r["fwd1_us"] = graphed_us(lambda: torch._addmm_activation(b1, x, w1.T))
    r["fwd2_us"] = graphed_us(lambda: torch._addmm_activation(b2, h1, w2.T))
    r["dW1_us"] = graphed_us(lambda: dz1.T @ x)
    r["dW2_us"] = graphed_us(lambda: dz2.T @ h1)
    flops = 2 * B * (784 * 4096 + 4096 * 4096) * 2
    r["gemm_gflop"] = flops / 1e9
    r["gemm_floor_at_989tflops_us"] = flops / 989e12 * 1e6
    r["gemm_floor_at_measured_8192_rate_us"] = flops / (out["bf16_gemm_8192_tflops"] * 1e12) * 1e6
    r["gemm_sum_measured_us"] = r["fwd1_us"] + r["fwd2_us"] + r["dW1_us"] + r["dW2_us"]
    out[f"B{B}"] = r
    print(json.dumps({B: r}), flush=True)

# AdamW of each layer (weight + bias, bf16 gradient, bf16 shadow), as the engine runs it
for name, (o, i) in {"layer2": (4096, 4096), "layer1": (4096, 784)}.items():
    p = [torch.randn(o, i, device=dev), torch.randn(o, device=dev)]
    g = [torch.randn(o, i, device=dev, dtype=bf), torch.randn(o, device=dev, dtype=bf)]
    m = [torch.zeros_like(t) for t in p]; v = [torch.zeros_like(t) for t in p]
    sh = [torch.empty(o, i, device=dev, dtype=bf), torch.empty(o, device=dev, dtype=bf)]
    st = torch.ones((), device=dev); lr = torch.full((), 1e-3, device=dev)
    us = graphed_us(lambda: adamw_with_shadow_(p, g, m, v, sh, st, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01))
    n = o * i + o
    # read p, m, v (fp32) and g (bf16); write p, m, v (fp32) and the bf16 shadow
    nbytes = n * (4 * 6 + 2 + 2)
    out[f"adamw_{name}"] = {"us": us, "params": n, "bytes": nbytes, "tb_s": nbytes / us / 1e6,
                            "floor_at_copy_bw_us": nbytes / (out["copy_1GiB_tb_s"] * 1e12) * 1e6}
    print(json.dumps({name: out[f"adamw_{name}"]}), flush=True)

# the DAD step itself
for B in (1024, 4096):
    xs, ys = make_data(784, 10, B, 4, dev)
    _, fn = dad_system(784, [4096, 4096], 10, dev, "auto", bf)
    def step(i, fn=fn, xs=xs, ys=ys, B=B):
        j = i % 4
        fn(xs[j * B:(j + 1) * B], ys[j * B:(j + 1) * B])
    out[f"B{B}"]["dad_step_us"] = time_steps(step, 50, 5, 20, 0.3) * 1e6
    print("dad", B, out[f"B{B}"]["dad_step_us"], flush=True)
    del fn

# the wheel, 3 fresh processes per batch
wheel = os.environ["WHEEL_SITE"]
for B in (1024, 4096):
    runs = []
    for k in range(3):
        p = subprocess.run([sys.executable, "_wheel_throughput.py", json.dumps([["fmnist-wide-2", B]])], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": wheel}, timeout=150)
        lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
        if lines:
            runs.append(json.loads(lines[-1])["img_per_s"])
        else:
            runs.append(None); out.setdefault("wheel_errors", []).append(p.stderr[-800:])
    out[f"B{B}"]["wheel_img_per_s_runs"] = runs
    ok = [v for v in runs if v]
    out[f"B{B}"]["needed_for_5x_us_runs"] = [B / (5 * v) * 1e6 for v in ok]
    print("wheel", B, runs, flush=True)
print(json.dumps(out, indent=1))
json.dump(out, open(os.environ["RES"], "w"), indent=1)
