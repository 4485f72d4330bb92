"""Device call 51: the split row kernel's relaxed partial-logit adds (a barrier before the counter)
against acq_rel, per call; and the step with local errors as in call 50's 'relaxed' engine (two kernels
everywhere, acq_rel partial logits: 'before') against this commit's defaults. Writes JSON to argv[1]."""
import dataclasses, json, os, statistics, sys
import torch
from torch_dad.kernels import local_error as LE
from _gpu_common import TOPOLOGIES, dad_system, make_data, time_steps

dev = torch.device("cuda")
torch.manual_seed(0)
ORIGINAL = LE._local_error_triton


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


def old_tiles(M, N, element_size=2):
    """The call-50 'relaxed' engine's choice: two kernels; its split path had acq_rel partial adds."""
    if N <= 256:
        return LE.Tiles(rows_bm=32, rows_bn=128, rows_warps=4, rows_stages=3, cols_bm=64,
                        cols_bn=64 if N >= 2048 else 32, cols_warps=4, cols_stages=3, cols_programs_per_sm=2)
    return LE.default_tiles(M, N, 16, element_size)


out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": os.environ.get("GIT_COMMIT"),
       "calls": [], "steps": []}
C = 10
for M, N, dz in ((1024, 4096, True), (1024, 4096, False), (2048, 4096, True), (1024, 256, True), (4096, 256, False)):
    h = torch.randn(M, N, device=dev).relu_().to(torch.bfloat16)
    w = torch.randn(C, N, device=dev) * N ** -0.5
    b = torch.randn(C, device=dev)
    y = torch.randint(0, C, (M,), device=dev)
    ref = LE._local_error_torch(h, w, b, y, "relu", dz)
    rec = {"M": M, "N": N, "with_dz": dz}
    new = LE.default_tiles(M, N, 16)
    for name, t in (("default", new), ("default-acq_rel", dataclasses.replace(new, atomic_sem="acq_rel")),
                    ("two-kernels", dataclasses.replace(old_tiles(M, N), atomic_sem="relaxed"))):
        worst = 0.0
        for _ in range(20):  # the split path's counter: check the sums many times
            r = ORIGINAL(h, w, b, y, "relu", dz, t)
            worst = max(worst, rel(r.logits, ref.logits), rel(r.grad_head_weight, ref.grad_head_weight),
                        *([rel(r.d_z, ref.d_z)] if dz else []))
        rec[name] = {"us": bench(lambda t=t: ORIGINAL(h, w, b, y, "relu", dz, t)), "worst_err": worst}
    out["calls"].append(rec)
    print(f"{M}x{N} dz={dz}: " + "  ".join(f"{k} {v['us']:.1f} us (err {v['worst_err']:.1e})" for k, v in rec.items()
                                         if isinstance(v, dict)), flush=True)


def patched(h, head_weight, head_bias, target, activation, with_dz, tiles=None):
    M, N = h.shape
    return ORIGINAL(h, head_weight, head_bias, target, activation, with_dz,
                    dataclasses.replace(old_tiles(M, N, h.element_size()), atomic_sem="relaxed") if N <= 256 else
                    _split_acq_rel(M, N, h.element_size()))


def _split_acq_rel(M, N, es):
    # before this commit the split path's partial adds were acq_rel and the gradient adds relaxed (call 50);
    # the closest configuration here is acq_rel for both in the split case
    t = LE.default_tiles(M, N, 16, es)
    return dataclasses.replace(t, atomic_sem="acq_rel") if t.rows_split > 1 and M <= 2048 and N >= 2048 else t


systems = {}
for name, B in (("fmnist-wide-2", 1024), ("mnist-medium-3", 1024), ("cifar10-medium-3", 4096)):
    n_in, widths, classes = TOPOLOGIES[name]
    x, y = make_data(n_in, classes, B, 4, dev)
    for var in ("before", "default"):
        LE._local_error_triton = patched if var == "before" else ORIGINAL
        trainer, fn = dad_system(n_in, widths, classes, dev, "auto", torch.bfloat16)
        def step(i, fn=fn, x=x, y=y, b=B):
            j = i % 4
            fn(x[j * b:(j + 1) * b], y[j * b:(j + 1) * b])
        time_steps(step, 30, 1, 10)
        systems[(name, B, var)] = step
LE._local_error_triton = ORIGINAL
times = {k: [] for k in systems}
for rnd in range(5):
    for k, step in systems.items():
        times[k].append(time_steps(step, 50, 3, 10, 0.05))
for (name, B, var), ts in times.items():
    us = statistics.median(ts) * 1e6
    out["steps"].append({"topology": name, "batch": B, "variant": var, "us_per_step": us, "rounds_us": [t * 1e6 for t in ts]})
    print(f"{name} B={B} {var}: {us:.1f} us/step rounds {[round(t * 1e6, 1) for t in ts]}", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
