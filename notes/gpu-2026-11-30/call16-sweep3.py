"""Device call 13: local-error strategies per shape (row kernel logits vs cuBLAS logits), whole call
and per kernel, on the H200. Writes JSON to argv[1]."""
import json, statistics, sys
import torch
from torch_dad.kernels import local_error as LE

dev = torch.device("cuda")
torch.manual_seed(0)

def bench(fn, inner=20, reps=15):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / inner)
    return statistics.median(ts)

def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))

C = 10
out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "shapes": []}
for M, N, with_dz in [(4096, 1024, True), (4096, 4096, True), (1024, 4096, True), (4096, 512, True), (1024, 1024, True),
                      (4096, 1024, False), (1024, 4096, False), (4096, 256, True)]:
    h = torch.randn(M, N, device=dev).relu_().to(torch.bfloat16)
    w = torch.randn(C, N, device=dev) * N ** -0.5
    b = torch.randn(C, device=dev)
    y = torch.randint(0, C, (M,), device=dev)
    ref = LE._local_error_torch(h, w, b, y, "relu", with_dz)
    base = LE.default_tiles(M, N, 16)
    rec = {"M": M, "N": N, "with_dz": with_dz, "default": base.__dict__}
    for bm in (16, 32, 64):
        for bn in (64, 128, 256):
            for sp in (1, 2, 4, 8, 16):
                t = LE.Tiles(**{**base.__dict__, "rows_bm": bm, "rows_bn": bn, "rows_split": sp})
                name = f"bm{bm}_bn{bn}_s{sp}"
                try:
                    r = LE._local_error_triton(h, w, b, y, "relu", with_dz, t)
                    err = max(rel(r.logits, ref.logits), rel(r.grad_head_weight, ref.grad_head_weight), rel(r.loss, ref.loss),
                              *([rel(r.d_z, ref.d_z), rel(r.grad_bias, ref.grad_bias)] if with_dz else []))
                    rec[name] = {"us": bench(lambda t=t: LE._local_error_triton(h, w, b, y, "relu", with_dz, t)), "err": err}
                except Exception as e:
                    rec[name] = {"error": str(e)[:200]}
    rec["default_us"] = bench(lambda: LE._local_error_triton(h, w, b, y, "relu", with_dz, base))
    ok = {k: v for k, v in rec.items() if isinstance(v, dict) and "us" in v and v["err"] < 2e-2}
    best = min(ok, key=lambda k: ok[k]["us"])
    bad = [k for k, v in rec.items() if isinstance(v, dict) and ("error" in v or v.get("err", 0) >= 2e-2) and k != "default"]
    out["shapes"].append(rec)
    print(M, N, with_dz, "default", round(rec["default_us"], 1), "best", best, round(ok[best]["us"], 1),
          "s1:", {k: round(v["us"], 1) for k, v in ok.items() if k.endswith("_s1")}, "bad", bad[:3], flush=True)
    print("   top5", sorted(((round(v["us"], 1), k) for k, v in ok.items()))[:6], flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
