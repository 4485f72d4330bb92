"""Runs the published wheel torch-dad==2026.5.24 as its README uses it (called by accuracy.py).

Started with only the wheel's extracted folder on PYTHONPATH, so ``import torch_dad`` is the
wheel. Argument: a JSON spec ``{jobs, cache, device, batch}``; prints one JSON line of records.
Per epoch it records the wheel's last local head accuracy (its best output); after training,
``trainer.solve_head()`` as in the README (``test_acc_readme_solve_head``).
"""

from __future__ import annotations

import json
import sys
import time

import torch
from torch import nn


def _wheel_model(linear: type, base: type, widths: list[int]) -> nn.Module:
    """The README's model: DADLinear layers, then an nn.Linear classifier."""

    class Net(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(linear(a, b, num_classes=10) for a, b in zip(widths[:-1], widths[1:]))
            self.classifier = nn.Linear(widths[-1], 10)

    return Net()


@torch.no_grad()
def _local_head_acc(model: nn.Module, xte: torch.Tensor, yte: torch.Tensor) -> float:
    """Accuracy of the last layer's local head (``W_loc``, ``b_loc``) on the test set."""
    correct = 0
    for i in range(0, xte.shape[0], 4096):
        h = xte[i : i + 4096]
        for layer in model.dad_layers:
            h, _ = layer(h)
        last = model.dad_layers[-1]
        logits = nn.functional.linear(h, last.W_loc, last.b_loc)
        correct += int((logits.argmax(1) == yte[i : i + 4096]).sum())
    return correct / xte.shape[0]


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    import torch_dad
    from torch_dad import DADLinear, DADModel, DADTrainer

    device = torch.device(spec["device"])  # the wheel needs a torch.device, not a string
    batch = spec["batch"]
    xtr, ytr, xte, yte = (t.to(device) for t in torch.load(spec["cache"]))
    amp = torch.bfloat16 if device.type == "cuda" else torch.float32  # the README's amp_dtype on CUDA
    out = []
    for job in spec["jobs"]:
        torch.manual_seed(job["seed"])
        model = _wheel_model(DADLinear, DADModel, job["widths"]).to(device)
        trainer = DADTrainer(model, device=device)
        curve, elapsed = [], 0.0
        for epoch in range(job["epochs"]):
            generator = torch.Generator().manual_seed(job["seed"] * 1000 + epoch)
            order = torch.randperm(xtr.shape[0], generator=generator).to(device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for i in range(0, xtr.shape[0], batch):
                idx = order[i : i + batch]
                trainer.step(xtr[idx], ytr[idx], lr=job["lr"], amp_dtype=amp)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed += time.perf_counter() - start
            curve.append({"epoch": epoch + 1, "test_acc": _local_head_acc(model, xte, yte), "train_s": elapsed})
        trainer.solve_head()
        with torch.no_grad():
            pred = torch.cat([model.forward_inference(xte[i : i + 4096]).argmax(1) for i in range(0, xte.shape[0], 4096)])
        readme = float((pred == yte).float().mean())
        out.append({**job, "test_acc": curve[-1]["test_acc"], "train_s": elapsed, "curve": curve,
                    "test_acc_readme_solve_head": readme, "wheel_file": torch_dad.__file__})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
