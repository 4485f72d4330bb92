"""Shared helpers for benchmark scripts: environment record, timing, MLP builders."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import torch_dad as td

RESULTS = Path(__file__).resolve().parent / "results"


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (Linux), else the machine type, e.g. ``x86_64``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    """Device, torch version, commit and date, stored in every record. ``GIT_COMMIT`` in the environment
    names the commit where the tree was copied without its git history (a copy may carry a stale one)."""
    commit = os.environ.get("GIT_COMMIT", "")
    try:
        commit = commit or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, check=False
        ).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    else:
        device = f"cpu ({cpu_model()}, {torch.get_num_threads()} threads)"
    return {
        "device": device,
        "torch": torch.__version__,
        "commit": commit,
        "date": _dt.date.today().isoformat(),
    }


def fresh_process_json(command: Sequence[str]) -> dict[str, Any]:
    """Run ``command`` (a benchmark's worker mode for one system) in a fresh process and return the JSON object on
    the last line of its output: no allocator cache, CUDA-graph pool or cuBLAS workspace of another system counts
    in its memory. A failed run raises ``RuntimeError`` with the end of its output."""
    done = subprocess.run(list(command), capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}:\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-4000:]}")
    return dict(json.loads(lines[-1]))


def median_time(fn: Callable[[], Any], *, warmup: int, repeats: int, sync: Callable[[], None] | None = None,
                calls: int = 1) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` samples after ``warmup`` calls; a sample is ``calls``
    calls back to back (then ``sync()``), divided by ``calls``, as a training loop runs steps without waiting."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if sync:
            sync()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


class Timer:
    """Wall seconds between marks: CUDA events on GPU (no host sync mid-stream), perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


class DADMLP(td.DADModel):
    """The quickstart model: DAD hidden layers + an ``nn.Linear`` classifier."""

    def __init__(
        self,
        widths: Sequence[int],
        num_classes: int = 10,
        activation: str = "relu",
        *,
        normalize: str | None = None,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            td.DADLinear(
                a,
                b,
                num_classes=num_classes,
                activation=activation,
                normalize=normalize,
                label_smoothing=label_smoothing,
            )
            for a, b in zip(widths[:-1], widths[1:])
        )
        self.classifier = torch.nn.Linear(widths[-1], num_classes)


def cuda_step_memory(step: Callable[[], Any]) -> tuple[int, int]:
    """``(allocated before, peak during)`` one call of ``step`` on the current CUDA device, in bytes."""
    torch.cuda.synchronize()
    static = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return static, torch.cuda.max_memory_allocated()


def graph_pool_slack() -> int:
    """Bytes that CUDA-graph memory pools hold reserved but not allocated right now, on the current device.

    A graph's replays write into its pool's blocks even while the allocator counts them as free, so
    ``max_memory_allocated`` misses them; a step's true peak is its allocated peak plus this.
    """
    return sum(segment["total_size"] - segment["allocated_size"] for segment in torch.cuda.memory_snapshot()
               if tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0))


def backprop_mlp(
    widths: Sequence[int],
    num_classes: int = 10,
    *,
    activation: str = "relu",
    normalize: str | None = None,
    dropout: float = 0.0,
) -> torch.nn.Sequential:
    """The same MLP as :class:`DADMLP` for plain backprop: ``act(norm(Linear(x)))`` blocks (then
    ``nn.Dropout(dropout)`` if ``dropout``), then a Linear head.

    ``normalize`` matches ``DADLinear``: ``"layernorm"`` is parameter-free
    (``nn.LayerNorm(elementwise_affine=False)``), ``"batchnorm"`` is ``nn.BatchNorm1d`` with its affine
    parameters; ``"leaky_relu"`` has torch's slope 0.01, as in ``DADLinear``.
    """
    acts = {"relu": torch.nn.ReLU, "gelu": torch.nn.GELU, "tanh": torch.nn.Tanh, "leaky_relu": torch.nn.LeakyReLU}
    norms = {"layernorm": lambda n: torch.nn.LayerNorm(n, elementwise_affine=False), "batchnorm": torch.nn.BatchNorm1d}
    if activation not in acts:
        raise ValueError(f"activation={activation!r} must be one of {', '.join(acts)}")
    if normalize is not None and normalize not in norms:
        raise ValueError(f"normalize={normalize!r} must be None or one of {', '.join(norms)}")
    mods: list[torch.nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        mods.append(torch.nn.Linear(a, b))
        if normalize is not None:
            mods.append(norms[normalize](b))
        mods.append(acts[activation]())
        if dropout:
            mods.append(torch.nn.Dropout(dropout))
    mods.append(torch.nn.Linear(widths[-1], num_classes))
    return torch.nn.Sequential(*mods)


def cuda_kernel_times(prof: Any) -> dict[str, list[float]]:
    """``{kernel name: [microseconds of each launch]}`` from a finished ``torch.profiler`` run's CUDA events."""
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.device_time)
    return kernels


def kernel_ms_by_kind(step: Callable[[], Any], kinds: Sequence[tuple[str, Sequence[str]]], steps: int,
                      total: str = "total") -> dict[str, float]:
    """GPU kernel time per call of ``step`` (ms, ``steps`` calls under ``torch.profiler``) by kind: the first of
    ``kinds`` (``(kind, name fragments)``) one of whose fragments the lower-cased kernel name contains, else
    ``"other"``; ``total`` names their sum (the busy time, launch gaps excluded)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    lowered = [(kind, [part.lower() for part in parts]) for kind, parts in kinds]
    times: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)
        if us <= 0:
            continue
        name = event.key.lower()
        kind = next((k for k, parts in lowered if any(p in name for p in parts)), "other")
        times[kind] = times.get(kind, 0.0) + us / 1e3 / steps
    return {total: round(sum(times.values()), 3), **{k: round(v, 3) for k, v in sorted(times.items())}}


def record_path(name: str, *, smoke: bool = False, out: str | Path | None = None) -> Path:
    """Where ``name``'s runs go: ``out`` if given, else ``results/<name>.json``, or under ``--smoke`` a file
    of the same name in the temporary directory (smoke runs never touch ``results/``)."""
    if out is not None:
        return Path(out)
    return (Path(tempfile.gettempdir()) / "torch_dad_smoke" if smoke else RESULTS) / f"{name}.json"


def run_config(
    args: argparse.Namespace, parser: argparse.ArgumentParser, *, exclude: Sequence[str] = ()
) -> dict[str, Any]:
    """The command-line options of ``args`` that differ from ``parser``'s defaults, as JSON values: a run's
    configuration. ``smoke``, ``out`` and the ``exclude`` options (paths, output and plotting switches) are left out."""
    skip = {"smoke", "out", *exclude}
    config = {}
    for key, value in sorted(vars(args).items()):
        if key in skip or value == parser.get_default(key):
            continue
        config[key] = json.loads(json.dumps(value, default=str))
    return config


def read_runs(path: str | Path) -> list[dict[str, Any]]:
    """The runs of a record: ``{"benchmark": ..., "runs": [...]}``; a plain list of rows (a file written
    before records held runs) reads as one run of those rows."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and isinstance(data.get("runs"), list):
        return data["runs"]
    if isinstance(data, list):
        return [{"environment": {}, "config": {}, "results": data}]
    raise ValueError(f"{path}: expected a record {{'benchmark': ..., 'runs': [...]}} or a list of rows")


def latest_results(path: str | Path) -> list[dict[str, Any]]:
    """The rows of the last run in the record at ``path``."""
    runs = read_runs(path)
    if not runs:
        raise ValueError(f"{path} holds no runs")
    return runs[-1]["results"]


def _run_key(run: dict[str, Any]) -> str:
    return json.dumps([run["environment"].get("device"), run["config"]], sort_keys=True)


def write_run(
    name: str,
    results: list[dict[str, Any]],
    *,
    config: dict[str, Any],
    smoke: bool = False,
    out: str | Path | None = None,
    env: dict[str, Any] | None = None,
) -> Path:
    """Add one run (``env``, default :func:`environment`; ``config``; ``results``) to ``name``'s record
    (:func:`record_path`) and return its path.

    The rule for every benchmark: a run of the same device and configuration as an earlier one replaces it, and
    the new run goes last, so a record holds the latest run of each configuration. A row's environment fields
    equal to the run's are dropped (a row keeps those where it was measured elsewhere, e.g. at another commit).
    """
    env = environment() if env is None else env
    rows = [{k: v for k, v in row.items() if not (k in env and env[k] == v) and not (k == "environment" and v == env)}
            for row in results]
    run = {"environment": env, "config": config, "results": rows}
    path = record_path(name, smoke=smoke, out=out)
    runs = read_runs(path) if path.exists() else []
    runs = [r for r in runs if _run_key(r) != _run_key(run)] + [run]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, "runs": runs}, indent=1) + "\n")
    return path


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` on the file-only Agg backend, or ``None`` without matplotlib (the ``plot`` extra):
    a benchmark then writes its record and no plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_path(record: Path) -> Path:
    """Where the plot of the record at ``record`` goes: beside it, ``<name>.png``."""
    return record.with_suffix(".png")


def run_title(run: dict[str, Any]) -> str:
    """A plot's subtitle: the run's device and torch version."""
    env = run["environment"]
    return f"{env.get('device', '?')}, torch {env.get('torch', '?')}"


def draw_record(name: str, plot: Callable[[list[dict[str, Any]], Path], bool], *, smoke: bool = False,
                out: str | Path | None = None) -> Path | None:
    """Draw ``name``'s record (every run of it, :func:`read_runs`) with ``plot(runs, png_path)``: the PNG's
    path, or ``None`` when ``plot`` drew nothing (no matplotlib, or no run it plots)."""
    record = record_path(name, smoke=smoke, out=out)
    path = plot_path(record)
    return path if plot(read_runs(record), path) else None


def save_figure(fig: Any, title: str, path: Path, fontsize: float = 10,
                rect: tuple[float, float, float, float] = (0, 0, 1, 1)) -> bool:
    """Title ``fig``, lay it out in ``rect`` (room for a figure legend), write it to ``path`` and close it;
    ``True`` (a ``plot``'s answer)."""
    fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return True
