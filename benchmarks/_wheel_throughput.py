"""Times the published torch-dad 2026.5.24 wheel's compiled ``DADTrainer.step`` (run in a subprocess).

Usage: PYTHONPATH=<extracted wheel> python _wheel_throughput.py '<json list of [topology, batch]>'
Prints one JSON record per line. The wheel imports as ``torch_dad`` too, so this process must
not see the project's sources. Data, model and timing match ``gpu_throughput.py``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

TOPOLOGIES = {
    "mnist-medium-3": (784, [1024, 512, 256], 10),
    "fmnist-wide-2": (784, [4096, 4096], 10),
    "cifar10-medium-3": (3072, [1024, 512, 256], 10),
    "deep-8x1024": (3072, [1024] * 8, 10),
}


def main() -> None:
    from torch_dad import DADLinear, DADModel, DADTrainer

    dev = torch.device("cuda")
    for name, batch in json.loads(sys.argv[1]):
        n_in, widths, classes = TOPOLOGIES[name]

        class Net(DADModel):
            def __init__(self, n_in: int = n_in, widths: list[int] = widths, classes: int = classes) -> None:
                super().__init__()
                d = n_in
                for i, w in enumerate(widths):
                    setattr(self, f"layer{i}", DADLinear(d, w, num_classes=classes))
                    d = w
                self.classifier = torch.nn.Linear(d, classes)

        torch.cuda.reset_peak_memory_stats()
        trainer = DADTrainer(Net().to(dev), device=dev)  # a string device raises in the wheel
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8 * batch, n_in, generator=g).to(dev)
        y = torch.randint(0, classes, (8 * batch,), generator=g).to(dev)

        def step(i: int, trainer: DADTrainer = trainer, x: torch.Tensor = x, y: torch.Tensor = y, batch: int = batch) -> None:
            j = i % 8
            trainer.step(x[j * batch : (j + 1) * batch], y[j * batch : (j + 1) * batch], lr=1e-3, amp_dtype=torch.bfloat16)

        for i in range(10):  # compiles
            step(i)
        torch.cuda.synchronize()
        # then 0.3 s more, as gpu_throughput.py warms each of its systems (clocks after the compile)
        start, i = time.perf_counter(), 10
        while time.perf_counter() - start < 0.3:
            step(i)
            i += 1
            if i % 10 == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        samples = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(30):
                step(i)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / 30)
        sec = statistics.median(samples)
        print(json.dumps({"topology": name, "batch": batch, "img_per_s": batch / sec,
                          "peak_mib": torch.cuda.max_memory_allocated() / 2**20}), flush=True)


if __name__ == "__main__":
    main()
