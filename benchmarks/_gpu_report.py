"""Markdown tables from results/gpu_*.json (for docs/benchmarks.md): python _gpu_report.py

The throughput table is the last run of the default topologies without ``--recipes`` or ``--deterministic``;
the memory and scaling tables are the last run of their records."""

from __future__ import annotations

from _common import RESULTS, latest_results, read_runs


def throughput() -> None:
    plain = [run for run in read_runs(RESULTS / "gpu_throughput.json")
             if not {"recipes", "deterministic", "topologies", "batches"} & set(run["config"])]
    rows = plain[-1]["results"]
    ips = {(r["topology"], r["batch"], r["system"]): r["img_per_s"] for r in rows}
    ratio = {r["topology"]: r["flop_ratio"] for r in rows}
    systems = ["dad", "dad-no-head-stats", "backprop-graphed", "backprop-eager", "wheel-2026.5.24"]
    print("| topology | B | " + " | ".join(systems) + " | dad / bp-graphed | no-stats / bp-graphed | dad / wheel |")
    print("|---" * (len(systems) + 5) + "|")
    for topo, b in sorted({(r["topology"], r["batch"]) for r in rows}, key=lambda k: (k[1], list(ratio).index(k[0]))):
        cells = [f"{ips[(topo, b, s)]:,.0f}" if (topo, b, s) in ips else "–" for s in systems]
        ref = ips.get((topo, b, "backprop-graphed"))
        wheel = ips.get((topo, b, "wheel-2026.5.24"))
        dad = ips.get((topo, b, "dad"), float("nan"))
        nost = ips.get((topo, b, "dad-no-head-stats"), float("nan"))
        print(f"| {topo} | {b} | " + " | ".join(cells)
              + f" | {dad / ref:.2f} | {nost / ref:.2f} | "
              + (f"{dad / wheel:.1f}" if wheel else "–") + " |")


def memory() -> None:
    rows = latest_results(RESULTS / "gpu_memory.json")
    print("| system | depth x width | B | static MiB | above-static MiB | graph pool MiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        pool = r.get("pool_mib")
        print(f"| {r['system']} | {r['depth']} x {r['width']} | {r['batch']} | {r['static_mib']:,.0f} | "
              f"{r['above_static_mib']:,.0f} | {'' if pool is None else f'{pool:,.0f}'} |")


def scaling() -> None:
    rows = latest_results(RESULTS / "gpu_scaling.json")
    by = {(r["system"], r["depth"]): r for r in rows}
    print("| depth | dad img/s | backprop-graphed img/s | ratio | dad peak MiB | backprop peak MiB |")
    print("|---|---|---|---|---|---|")
    for d in sorted({r["depth"] for r in rows}):
        a, b = by[("dad", d)], by[("backprop-graphed", d)]
        print(f"| {d} | {a['img_per_s']:,.0f} | {b['img_per_s']:,.0f} | {a['img_per_s'] / b['img_per_s']:.2f} | "
              f"{a['peak_mib']:,.0f} | {b['peak_mib']:,.0f} |")


if __name__ == "__main__":
    throughput()
    print()
    memory()
    print()
    scaling()
