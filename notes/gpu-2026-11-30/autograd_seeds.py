"""Characterise the two autograd fast-path failures of call 6 over many seeds (CUDA)."""
import json, sys, torch, warnings
sys.path.insert(0, ".")
import tests.test_autograd_fast_path as t
from tests.conftest import relative_error
out = {"grad": [], "traj": []}
names = ["grad_weight", "grad_bias", "grad_head_weight", "grad_head_bias"]
for seed in range(24):
    for shape, act in [((33, 1025, 300, 256), "relu"), ((33, 1025, 300, 256), "tanh"), ((1000, 257, 513, 100), "relu")]:
        torch.manual_seed(seed)
        fast = t._layer(shape, act, True, torch.bfloat16, "auto", "cuda")
        slow = t._layer(shape, act, True, torch.bfloat16, "eager", "cuda")
        t._copy(fast, slow)
        x = torch.randn(shape[0], shape[1], device="cuda").to(torch.bfloat16)
        y = t._labels(shape[0], shape[3], "cuda", ignore_every=7)
        gf, gs = t._grads(fast, x, y), t._grads(slow, x, y)
        ref = t._oracle(fast, x, y); own = t._oracle(fast, x, y, torch.bfloat16)
        rec = {"seed": seed, "shape": shape, "act": act, "backend": fast.last_backend}
        for n, a, b in zip(names, gf, gs):
            want = getattr(ref, n)
            rec[n] = [relative_error(a, want), relative_error(b, want), 1e-2 + 2 * relative_error(getattr(own, n), want)]
        out["grad"].append(rec)
    for act in ["relu", "tanh"]:
        torch.manual_seed(seed)
        shape = (1000, 257, 513, 100)
        kw = {"lr": 1e-2, "weight_decay": 0.05, "eps": 1e-6}
        fast = t._layer(shape, act, True, torch.float32, "triton", "cuda", update="inplace", **kw)
        slow = t._layer(shape, act, True, torch.float32, "eager", "cuda", update="inplace", **kw)
        t._copy(fast, slow)
        ref = [p.detach().double().clone() for p in fast._trained_tensors()]
        start = [p.clone() for p in ref]
        state = {}
        for step in range(1, 4):
            x = torch.randn(shape[0], shape[1], device="cuda"); y = t._labels(shape[0], shape[3], "cuda")
            w, b, hw, hb = ref
            o = t.F.local_loss_and_gradients(x.double(), w, b, hw, hb, y, act)
            t._adamw_reference(ref, [o.grad_weight, o.grad_bias, o.grad_head_weight, o.grad_head_bias], state, step,
                               kw["lr"], fast.config.betas, fast.config.eps, kw["weight_decay"])
            for layer in (fast, slow):
                layer.set_y_context(y); layer(x).sum().backward()
        out["traj"].append({"seed": seed, "act": act, "errors": [
            [relative_error(pf.detach().double() - p0, pr - p0), relative_error(ps.detach().double() - p0, pr - p0)]
            for pf, ps, pr, p0 in zip(fast._trained_tensors(), slow._trained_tensors(), ref, start)]})
json.dump(out, open(sys.argv[1], "w"), indent=1)
bad = [r for r in out["grad"] if any(r[n][0] > r[n][2] or r[n][1] > r[n][2] for n in names)]
print("grad cases over tolerance:", len(bad), "of", len(out["grad"]))
for r in bad[:10]: print(json.dumps(r))
badt = [r for r in out["traj"] if any(e[0] > 1e-4 or e[1] > 1e-4 for e in r["errors"])]
print("trajectory cases over 1e-4:", len(badt), "of", len(out["traj"]))
for r in badt[:10]: print(json.dumps(r))
