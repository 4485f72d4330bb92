"""Device call 57: the DAD step against a measured floor built from its unavoidable kernels, and the wheel's
speed in fresh processes, all in one run.

Skeleton per layer (bf16 operands, fp32 masters, this GPU's kernels): the forward GEMM a @ W^T (cuBLAS, no
epilogue), the weight-gradient GEMM d_z^T @ a (cuBLAS), and the project's AdamW kernel on the weight and bias
with the bf16 copy (adamw_with_shadow_). No local error, no heads, no classifier, no sample, no input cast.
Timed as one CUDA graph (median of replays) in two schedules: everything on one stream, and the engine's
overlap (each layer's weight gradient and AdamW on a side stream, beside the next forward). Also: the GEMMs
alone and the AdamWs alone. Then the real step (DADTrainer defaults) and the wheel in 3 fresh processes.
JSON to argv[1]; argv[2] is the wheel path."""
import json, os, statistics, subprocess, sys, tempfile, zipfile
from pathlib import Path
import torch
from torch_dad.kernels.adamw import adamw_with_shadow_
from _gpu_common import TOPOLOGIES, dad_system, make_data, time_steps

dev = torch.device("cuda")
torch.manual_seed(0)


def graph_us(fn, inner=10, reps=21):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / inner)
    return statistics.median(ts)


def skeleton(n_in, widths, B):
    dims = [n_in, *widths]
    x = torch.randn(B, n_in, device=dev).to(torch.bfloat16)
    layers = []
    for d_in, d_out in zip(dims[:-1], dims[1:]):
        W = torch.randn(d_out, d_in, device=dev) * d_in ** -0.5
        b = torch.zeros(d_out, device=dev)
        layers.append(dict(W=W, b=b, Wb=W.to(torch.bfloat16), bb=b.to(torch.bfloat16),
                           m=[torch.zeros_like(W), torch.zeros_like(b)], v=[torch.zeros_like(W), torch.zeros_like(b)],
                           dz=(torch.randn(B, d_out, device=dev) * 1e-3).to(torch.bfloat16),
                           gb=torch.randn(d_out, device=dev) * 1e-3, step=torch.ones((), device=dev)))
    lr = torch.tensor(1e-3, device=dev)
    side = torch.cuda.Stream()

    def update(L, a):
        g = L["dz"].T @ a
        adamw_with_shadow_([L["W"], L["b"]], [g, L["gb"]], L["m"], L["v"], [L["Wb"], L["bb"]], L["step"], lr,
                           betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    def serial():
        a = x
        for L in layers:
            h = a @ L["Wb"].T
            update(L, a)
            a = h

    def overlapped():
        a = x
        main = torch.cuda.current_stream()
        keep = []
        for L in layers:
            h = a @ L["Wb"].T
            side.wait_stream(main)
            with torch.cuda.stream(side):
                update(L, a)
            keep.append(a)
            a = h
        main.wait_stream(side)

    def gemms_only():
        a = x
        for L in layers:
            h = a @ L["Wb"].T
            L["dz"].T @ a
            a = h

    def adamw_only():
        for L in layers:
            adamw_with_shadow_([L["W"], L["b"]], [L["Wb"], L["gb"]], L["m"], L["v"], [None, None], L["step"], lr,
                               betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    flops = sum(2 * 2 * B * i * o for i, o in zip(dims[:-1], dims[1:]))
    params = sum(i * o + o for i, o in zip(dims[:-1], dims[1:]))
    return {"serial_us": graph_us(serial), "overlapped_us": graph_us(overlapped), "gemms_only_us": graph_us(gemms_only),
            "adamw_only_us": graph_us(adamw_only), "gemm_gflop": flops / 1e9, "params": params,
            "gemm_us_at_989": flops / 989e12 * 1e6, "adamw_bytes_mb": params * 28 / 1e6,
            "adamw_us_at_4800": params * 28 / 4.8e12 * 1e6}


SETTINGS = [("fmnist-wide-2", 1024), ("fmnist-wide-2", 4096), ("deep-8x1024", 4096), ("deep-8x1024", 1024)]
out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": os.environ.get("GIT_COMMIT"),
       "settings": []}
for name, B in SETTINGS:
    n_in, widths, classes = TOPOLOGIES[name]
    rec = {"topology": name, "batch": B, **skeleton(n_in, widths, B)}
    x, y = make_data(n_in, classes, B, 4, dev)
    trainer, fn = dad_system(n_in, widths, classes, dev, "auto", torch.bfloat16)
    def step(i, fn=fn, x=x, y=y, B=B):
        j = i % 4
        fn(x[j * B:(j + 1) * B], y[j * B:(j + 1) * B])
    rec["dad_us"] = statistics.median(time_steps(step, 50, 5, 20, 0.3) * 1e6 for _ in range(3))
    out["settings"].append(rec)
    print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in rec.items()}), flush=True)
    del trainer, fn, step
    torch.cuda.empty_cache()
    json.dump(out, open(sys.argv[1], "w"), indent=1)

# the wheel, 3 fresh processes, each over the same settings
jobs = [[n, b] for n, b in SETTINGS]
with tempfile.TemporaryDirectory() as tmp:
    with zipfile.ZipFile(sys.argv[2]) as zf:
        zf.extractall(tmp)
    script = Path(os.getcwd()) / "_wheel_throughput.py"
    out["wheel_runs"] = []
    for run in range(3):
        proc = subprocess.run([sys.executable, str(script), json.dumps(jobs)], env={**os.environ, "PYTHONPATH": tmp},
                              cwd=tmp, capture_output=True, text=True, timeout=110)
        rows = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
        out["wheel_runs"].append(rows)
        print("wheel run", run, [(r["topology"], r["batch"], round(r["img_per_s"]), round(r["batch"] / r["img_per_s"] * 1e6)) for r in rows],
              proc.stderr[-300:] if len(rows) < len(jobs) else "", flush=True)
        json.dump(out, open(sys.argv[1], "w"), indent=1)
