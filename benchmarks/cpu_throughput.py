"""CPU training throughput: ``DADTrainer.step`` against backprop + AdamW on the same MLP.

Same synthetic batches for every system, warm-up, median of repeats. Systems:
``dad`` (fp32), ``backprop-eager`` (``torch.optim.AdamW`` defaults), ``backprop-eager-fused``
(``AdamW(fused=True)``). Writes ``results/cpu_throughput.json``.

    python benchmarks/cpu_throughput.py            # full (about 2 minutes on 2 cores)
    python benchmarks/cpu_throughput.py --smoke    # seconds, for CI
"""

from __future__ import annotations

import argparse

import torch

import torch_dad as td
from _common import SeedMLP, backprop_mlp, environment, median_time, write_records

TOPOLOGIES = {"mnist-medium-3": [784, 1024, 512, 256], "fmnist-wide-2": [784, 4096, 4096]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    topologies = {"smoke": [64, 48, 32]} if args.smoke else {"mnist-medium-3": TOPOLOGIES["mnist-medium-3"]}
    batches = [64] if args.smoke else args.batch
    repeats, warmup = (3, 1) if args.smoke else (args.repeats, 5)
    env = environment()
    records = []
    for name, widths in topologies.items():
        for batch in batches:
            torch.manual_seed(0)
            x = torch.randn(batch, widths[0])
            y = torch.randint(0, 10, (batch,))
            dad = td.DADTrainer(SeedMLP(widths), device="cpu")
            systems = {"dad": lambda dad=dad, x=x, y=y: dad.step(x, y)}
            for label, fused in (("backprop-eager", None), ("backprop-eager-fused", True)):
                net = backprop_mlp(widths)
                opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01, fused=fused)

                def bp_step(net=net, opt=opt, x=x, y=y) -> None:
                    opt.zero_grad(set_to_none=True)
                    torch.nn.functional.cross_entropy(net(x), y).backward()
                    opt.step()

                systems[label] = bp_step
            # interleave systems across rounds so drift on a shared machine hits all alike
            times: dict[str, list[float]] = {k: [] for k in systems}
            for _ in range(1 if args.smoke else args.rounds):
                for label, fn in systems.items():
                    times[label].append(median_time(fn, warmup=warmup, repeats=repeats))
            for label, samples in times.items():
                seconds = sorted(samples)[len(samples) // 2]
                records.append({"topology": name, "batch": batch, "system": label,
                                "img_per_s": batch / seconds, "step_ms": seconds * 1e3, **env})
                print(f"{name:16s} B={batch:5d} {label:22s} {batch / seconds:10.0f} img/s")
            base = next(r for r in records if r["topology"] == name and r["batch"] == batch and r["system"] == "backprop-eager")
            ours = next(r for r in records if r["topology"] == name and r["batch"] == batch and r["system"] == "dad")
            print(f"  dad / backprop-eager = {ours['img_per_s'] / base['img_per_s']:.3f}")
    print("wrote", write_records("cpu_throughput", records, args.smoke))


if __name__ == "__main__":
    main()
