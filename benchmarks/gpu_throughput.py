"""Training throughput on one GPU: the DAD step against tuned backprop and the published wheel.

Systems, measured in one run on the same synthetic data (fp32 inputs resident on the GPU,
rotated over 8 batches), bf16 compute, fp32 master weights, AdamW:

- ``dad``: ``DADTrainer(backend="auto")`` with its defaults, i.e. the fused step captured in a
  CUDA graph, plus the ``classifier_sample_size=4096`` reservoir of input rows for ``solve_head()``
  (a few copies outside the graph);
- ``dad-gram-stats``: instead of the sample, the streamed Gram statistics of the classifier's
  input (``accumulate_classifier_statistics=True, classifier_sample_size=0``; the default in earlier versions);
- ``dad-no-head-stats``: neither, i.e. the training step alone;
- ``backprop-graphed``: forward, backward and fused AdamW (``capturable=True``) in one CUDA graph;
- ``backprop-eager``: the same, op by op;
- ``wheel-2026.5.24``: the published wheel's compiled ``DADTrainer.step`` (``--wheel PATH``).

Timing: CUDA events around 50 steps, median of 5 repeats, in 3 interleaved rounds (median of rounds),
each preceded by 20 steps and 0.3 s of warm-up (the graph is
captured during warm-up). Writes ``results/gpu_throughput.json``. ``--smoke``: CPU, tiny sizes.

Run: python benchmarks/gpu_throughput.py [--wheel .whl/torch_dad-2026.5.24-py3-none-any.whl]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from _common import environment, write_records
from _gpu_common import (
    TOPOLOGIES,
    backprop_eager,
    backprop_graphed,
    cuda_sync,
    dad_system,
    flop_ratio,
    make_data,
    time_steps,
)


def run_wheel(wheel: str, jobs: list[tuple[str, int]], timeout: float) -> list[dict]:
    """Time the wheel in a subprocess whose only ``torch_dad`` is the extracted wheel."""
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tmp)
        env = {**os.environ, "PYTHONPATH": tmp}
        script = Path(__file__).with_name("_wheel_throughput.py")
        try:
            proc = subprocess.run([sys.executable, str(script), json.dumps(jobs)], env=env, cwd=tmp,
                                  capture_output=True, text=True, timeout=timeout)
            out, err = proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            err = f"timeout after {timeout} s"
        for line in out.splitlines():
            if line.startswith("{"):
                rows.append(json.loads(line))
        if len(rows) < len(jobs):
            print(f"wheel: {len(rows)}/{len(jobs)} measured; stderr tail: {err[-800:]}", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run, seconds")
    parser.add_argument("--wheel", default=None, help="path to torch_dad-2026.5.24-py3-none-any.whl")
    parser.add_argument("--wheel-timeout", type=float, default=240.0)
    parser.add_argument("--batches", default="1024,4096")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    env = environment()
    if args.smoke:
        topologies = {"smoke": (64, [48, 32], 10)}
        batches = [32]
        amp = None
        steps, repeats, warmup, warmup_s, rounds = 3, 2, 2, 0.0, 1
    else:
        topologies = TOPOLOGIES
        batches = [int(b) for b in args.batches.split(",")]
        amp = torch.bfloat16
        steps, repeats, warmup, warmup_s, rounds = 50, 5, 20, 0.3, 3
    records = []
    for name, (n_in, widths, classes) in topologies.items():
        for batch in batches:
            pool = 8
            x, y = make_data(n_in, classes, batch, pool, device)

            def batch_at(i: int, pool: int = pool, batch: int = batch, x: torch.Tensor = x, y: torch.Tensor = y) -> tuple[torch.Tensor, torch.Tensor]:
                j = i % pool
                return x[j * batch : (j + 1) * batch], y[j * batch : (j + 1) * batch]

            systems = ["dad", "dad-gram-stats", "dad-no-head-stats", "backprop-eager"] + (["backprop-graphed"] if cuda else [])
            steps_of, peak_of = {}, {}
            for system in systems:  # build, capture and warm each; its peak memory is taken here
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                if system.startswith("dad"):
                    _, fn = dad_system(n_in, widths, classes, device, "auto" if cuda else "fused", amp,
                                       head={"dad": "sample", "dad-gram-stats": "gram"}.get(system, "none"))
                elif system == "backprop-eager":
                    fn = backprop_eager(n_in, widths, classes, device, amp)
                else:
                    fn = backprop_graphed(n_in, widths, classes, device, amp, batch)
                steps_of[system] = lambda i, fn=fn: fn(*batch_at(i))
                time_steps(steps_of[system], steps, 1, warmup)
                cuda_sync()
                peak_of[system] = torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")
            # interleaved rounds, each system warmed again first: clock and cache state hit all alike
            seconds: dict[str, list[float]] = {system: [] for system in systems}
            for _ in range(rounds):
                for system in systems:
                    seconds[system].append(time_steps(steps_of[system], steps, repeats, warmup, warmup_s))
            for system in systems:
                sec = statistics.median(seconds[system])
                records.append({
                    "topology": name, "batch": batch, "system": system, "img_per_s": batch / sec,
                    "peak_mib": peak_of[system], "flop_ratio": flop_ratio(n_in, widths, classes), **env,
                })
                print(json.dumps(records[-1]), flush=True)
            del steps_of
    if args.wheel and cuda:
        jobs = [(name, b) for name in topologies for b in batches]
        for row in run_wheel(args.wheel, jobs, args.wheel_timeout):
            n_in, widths, classes = topologies[row["topology"]]
            records.append({**row, "system": "wheel-2026.5.24", "flop_ratio": flop_ratio(n_in, widths, classes), **env})
            print(json.dumps(records[-1]), flush=True)
    path = write_records("gpu_throughput", records, args.smoke)
    if args.out:
        Path(args.out).write_text(json.dumps(records, indent=2) + "\n")
    print(f"\n{env['device']}  torch {env['torch']}  -> {path}")
    table = {(r["topology"], r["batch"], r["system"]): r["img_per_s"] for r in records}
    print(f"{'topology':18} {'B':>5} {'system':18} {'img/s':>12} {'x bp-graphed':>12}")
    for (topo, b, system), ips in table.items():
        ref = table.get((topo, b, "backprop-graphed"))
        print(f"{topo:18} {b:>5} {system:18} {ips:>12,.0f} {ips / ref if ref else float('nan'):>12.2f}")


if __name__ == "__main__":
    main()
