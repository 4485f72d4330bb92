"""How far a DAD MLP step is from its floor: the step's unavoidable kernels alone, against the whole step.

Per topology (``_gpu_common.TOPOLOGIES``) and batch, bf16 compute, fp32 master weights:

- ``gemms_us``: the step's forward GEMMs and weight-gradient GEMMs (cuBLAS, bf16), one after another;
- ``adamw_us``: every layer's AdamW with its bf16 copy (the engine's kernel, ``torch_dad.ops.adamw``);
- ``serial_us``: per layer its forward, its weight gradient and its AdamW, one after another;
- ``overlapped_us``: each layer's weight gradient and AdamW on a side stream beside the next layer's forward, as the
  default step places them;
- ``roofline_us``: the GEMMs at 989 TFLOP/s plus the AdamW's bytes (28 a weight) at 4.8 TB/s;
- ``step_us``: the default ``DADTrainer.step`` (a CUDA graph) on the same batches, rotated over 4.

Nothing else is in the floor: no local errors, local heads, classifier, input cast or input sample. Each part is
captured as one CUDA graph and timed with CUDA events (50 replays, median of 5 repeats, after warm-up).

``share_of_peak``: the step's model FLOPs over its time, against 790 TFLOP/s (the H200's dense bf16 peak). Model
FLOPs per row count the DAD step's own work: per hidden layer of ``in -> out`` its forward and weight-gradient GEMMs
(``4 * in * out``) and its local head's three products with ``C`` classes (``6 * out * C``), and the classifier's
forward and gradient (``4 * d * C``); no input gradients. ``share_at_floor`` is the same FLOPs over
``overlapped_us``: the most any step that runs these kernels could reach. Adds a run to ``results/step_floor.json``
and draws it into ``results/step_floor.png`` (``--plot-only`` redraws it).

    python benchmarks/step_floor.py                 # H200: the four topologies at B=1024 and 4096
    python benchmarks/step_floor.py --smoke         # CPU, seconds: the same parts eagerly, tiny sizes
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import torch

from _common import draw_record, environment, pyplot, run_config, run_title, save_figure, write_run
from _gpu_common import TOPOLOGIES, capture, dad_system, make_data, time_steps
from torch_dad.ops.adamw import adamw_with_shadow_

PEAK_FLOPS = 790e12  # H200 dense bf16, the share's reference
GEMM_FLOPS = 989e12  # H200 dense bf16 as the datasheet gives it, the roofline's
MEMORY_BYTES_PER_S = 4.8e12
ADAMW_BYTES = 28  # per weight: read fp32 weight, moments and a bf16 gradient; write fp32 weight, moments, bf16 copy


def model_flops(n_in: int, widths: Sequence[int], classes: int) -> int:
    """The DAD step's FLOPs per row (see the module docstring)."""
    dims = [n_in, *widths]
    layers = sum(4 * a * b + 6 * b * classes for a, b in zip(dims[:-1], dims[1:]))
    return layers + 4 * dims[-1] * classes


class Floor:
    """The floor's tensors for one topology and batch: bf16 inputs, weights and errors, fp32 masters and moments."""

    def __init__(self, n_in: int, widths: Sequence[int], batch: int, device: torch.device, dtype: torch.dtype) -> None:
        g = torch.Generator().manual_seed(0)
        dims = [n_in, *widths]
        self.x = torch.randn(batch, n_in, generator=g).to(device, dtype)
        self.layers = []
        for a, b in zip(dims[:-1], dims[1:]):
            master = [torch.randn(b, a, generator=g).div_(a**0.5).to(device), torch.zeros(b, device=device)]
            self.layers.append({
                "w": master[0].to(dtype), "master": master, "shadow": [master[0].to(dtype), master[1].to(dtype)],
                "moments": ([torch.zeros_like(t) for t in master], [torch.zeros_like(t) for t in master]),
                "d_z": torch.randn(batch, b, generator=g).to(device, dtype), "grad_b": torch.zeros(b, device=device),
                "step": torch.ones((), device=device),
            })
        self.lr = torch.full((), 1e-6, device=device)
        self.weights = sum(a * b + b for a, b in zip(dims[:-1], dims[1:]))
        self.gemm_flops = sum(4 * batch * a * b for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, i: int, a: torch.Tensor) -> torch.Tensor:
        return a @ self.layers[i]["w"].T

    def weight_grad(self, i: int, a: torch.Tensor) -> torch.Tensor:
        return self.layers[i]["d_z"].T @ a

    def adamw(self, i: int, grad: torch.Tensor) -> None:
        layer = self.layers[i]
        adamw_with_shadow_(layer["master"], [grad, layer["grad_b"]], *layer["moments"], layer["shadow"], layer["step"],
                           self.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    def inputs(self) -> list[torch.Tensor]:
        """Each layer's input: the forward chain from ``x``, made once."""
        chain = [self.x]
        for i in range(len(self.layers) - 1):
            chain.append(self.forward(i, chain[-1]))
        return chain

    def bodies(self) -> dict[str, Callable[[], None]]:
        """The four parts of the floor, each one call."""
        chain, n = self.inputs(), len(self.layers)
        grads = [self.weight_grad(i, chain[i]) for i in range(n)]

        def gemms() -> None:
            a = self.x
            for i in range(n):
                self.weight_grad(i, a)
                a = self.forward(i, a)

        def adamw() -> None:
            for i in range(n):
                self.adamw(i, grads[i])

        def serial() -> None:
            a = self.x
            for i in range(n):
                self.adamw(i, self.weight_grad(i, a))
                a = self.forward(i, a)

        def overlapped() -> None:
            if not self.x.is_cuda:
                return serial()
            main, side = torch.cuda.current_stream(), self._side()
            a, keep = self.x, []
            for i in range(n):
                h = self.forward(i, a)
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    self.adamw(i, self.weight_grad(i, a))
                keep.append(a)  # read on the side stream: held until the join
                a = h
            main.wait_stream(side)
            return None

        return {"gemms": gemms, "adamw": adamw, "serial": serial, "overlapped": overlapped}

    def _side(self) -> torch.cuda.Stream:
        if not hasattr(self, "side"):
            self.side = torch.cuda.Stream()
        return self.side


def measure(name: str, batch: int, device: torch.device, steps: int, repeats: int) -> dict[str, Any]:
    """One topology at one batch: the floor's parts and the default step, in microseconds."""
    n_in, widths, classes = TOPOLOGIES[name]
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    floor = Floor(n_in, widths, batch, device, dtype)
    row: dict[str, Any] = {"topology": name, "batch": batch}
    for part, body in floor.bodies().items():
        run = capture(body) if cuda else body
        row[f"{part}_us"] = 1e6 * time_steps(lambda i, run=run: run(), steps, repeats, warmup=10, warmup_s=0.2 * cuda)
    row["roofline_us"] = 1e6 * (floor.gemm_flops / GEMM_FLOPS + floor.weights * ADAMW_BYTES / MEMORY_BYTES_PER_S)
    x, y = make_data(n_in, classes, batch, 4, device)
    _, step = dad_system(n_in, widths, classes, device, "auto", torch.bfloat16 if cuda else None)

    def train(i: int) -> None:
        j = i % 4
        step(x[j * batch : (j + 1) * batch], y[j * batch : (j + 1) * batch])

    row["step_us"] = 1e6 * time_steps(train, steps, repeats, warmup=20, warmup_s=0.3 * cuda)
    flops = model_flops(n_in, widths, classes) * batch
    row["share_of_peak"] = flops / (row["step_us"] * 1e-6) / PEAK_FLOPS
    row["share_at_floor"] = flops / (row["overlapped_us"] * 1e-6) / PEAK_FLOPS
    return row


PARTS = ("gemms", "adamw", "serial", "overlapped", "roofline", "step")


def plot(runs: list[dict[str, Any]], path: Any) -> bool:
    """One group of bars per topology and batch: each part of the floor and the whole step (µs), with the step's
    share of peak above it."""
    plt = pyplot()
    rows = runs[-1]["results"] if runs else []
    if plt is None or not rows:
        return False
    fig, ax = plt.subplots(figsize=(max(8.0, 1.6 * len(rows)), 4.5))
    width = 0.8 / len(PARTS)
    for k, part in enumerate(PARTS):
        ax.bar([i + (k - (len(PARTS) - 1) / 2) * width for i in range(len(rows))], [r[f"{part}_us"] for r in rows],
               width, label=part)
    for i, r in enumerate(rows):
        ax.annotate(f"{100 * r['share_of_peak']:.0f}% (floor {100 * r['share_at_floor']:.0f}%)", (i, r["step_us"]),
                    textcoords="offset points", xytext=(0, 4), ha="center", fontsize=7)
    ax.set_xticks(range(len(rows)), [f"{r['topology']}\nB={r['batch']}" for r in rows], fontsize=8)
    ax.set_ylabel("µs per step")
    ax.legend(fontsize=8, ncol=3)
    ax.grid(True, axis="y", alpha=0.3)
    return save_figure(fig, f"the step's floor and the step, share of bf16 peak: {run_title(runs[-1])}", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES), choices=sorted(TOPOLOGIES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny batches, eagerly")
    parser.add_argument("--out", default=None, help="record path (default results/step_floor.json)")
    parser.add_argument("--plot-only", action="store_true", help="redraw results/step_floor.png from the record")
    args = parser.parse_args()
    if args.plot_only:
        print("plot:", draw_record("step_floor", plot, out=args.out))
        return
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("step_floor.py times CUDA graphs on a GPU; use --smoke on a CPU")
    device = torch.device("cuda" if cuda else "cpu")
    topologies, batches = (args.topologies[:1], [16]) if args.smoke else (args.topologies, args.batches)
    steps, repeats = (50, 5) if cuda else (2, 1)
    env = environment()
    rows = []
    for name in topologies:
        for batch in batches:
            rows.append(measure(name, batch, device, steps, repeats))
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
    path = write_run("step_floor", rows, config=run_config(args, parser, exclude=["plot_only"]), smoke=args.smoke,
                     out=args.out, env=env)
    print(f"-> {path}")
    if not args.smoke:
        print("plot:", draw_record("step_floor", plot, out=args.out))


if __name__ == "__main__":
    main()
