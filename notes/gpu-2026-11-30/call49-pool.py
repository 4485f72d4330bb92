"""Builds benchmarks/results/cpu_throughput_isolated_xeon.json from device calls 48 and 49.

Call 48 wrote full records (6 rounds per thread count). Call 49 asked for 24 rounds, and the
600 s device-call limit stopped it after 14 rounds (2 threads) and 10 rounds (16 threads), so
its per-round step times are read from the logs, which print every round as it ends.
Run from the repository root: python notes/gpu-2026-11-30/call49-pool.py
"""
import json
import re
import statistics as st

NOTES = "notes/gpu-2026-11-30"
SYSTEMS = ("dad", "backprop-eager", "backprop-eager-fused")
ROUND = re.compile(r"round (\d+)/24: dad ([\d.]+) ms  backprop-eager ([\d.]+) ms  backprop-eager-fused ([\d.]+) ms")


def device(threads):
    return f"cpu (Intel(R) Xeon(R) Processor, AVX-512, {threads} threads; the H200 machine's host, GPU hidden)"


def summary(dad_ms, base_ms):
    ratios = [b / d for b, d in zip(base_ms, dad_ms)]
    q = st.quantiles(ratios, n=4)
    return {"dad_over_this_per_round": ratios, "dad_over_this_median": st.median(ratios),
            "dad_over_this_q1": q[0], "dad_over_this_q3": q[2], "rounds_at_or_above_1_2": sum(r >= 1.2 for r in ratios)}


records = []
for threads in (2, 16):
    call48 = {r["system"]: r["round_step_ms"] for r in json.load(open(f"{NOTES}/call48-cpu_throughput_isolated_t{threads}.json"))}
    rows = [tuple(map(float, m.groups()[1:])) for line in open(f"{NOTES}/call49-cpu_t{threads}.log") if (m := ROUND.search(line))]
    call49 = {name: [row[i] for row in rows] for i, name in enumerate(SYSTEMS)}
    for label, per_system, commit, source in (
        ("call 48", call48, "8d6bb0d", f"device call 48, {NOTES}/call48-cpu_throughput_isolated_t{threads}.json"),
        ("call 49", call49, "1c7fbc9", f"device call 49, {NOTES}/call49-cpu_t{threads}.log (cut at {len(rows)} of 24 rounds by the 600 s call limit)"),
        ("pooled", {k: call48[k] + call49[k] for k in SYSTEMS}, "8d6bb0d+1c7fbc9", "calls 48 and 49 pooled; the CPU step code is the same at both commits"),
    ):
        for system in SYSTEMS:
            ms = per_system[system]
            record = {"topology": "mnist-medium-3", "batch": 1024, "system": system, "protocol": "isolated", "run": label,
                      "rounds": len(ms), "img_per_s": 1024 / (st.median(ms) / 1e3), "step_ms": st.median(ms),
                      "round_step_ms": ms, "device": device(threads), "torch": "2.11.0+cu130", "commit": commit,
                      "date": "2026-11-30", "source": source}
            if system != "dad":
                record.update(summary(per_system["dad"], ms))
                print(f"{threads:2d} threads {label:8s} {system:21s} rounds {len(ms):2d}  median {record['dad_over_this_median']:.3f}"
                      f"  q {record['dad_over_this_q1']:.3f}-{record['dad_over_this_q3']:.3f}  >=1.2: {record['rounds_at_or_above_1_2']}")
            records.append(record)
with open("benchmarks/results/cpu_throughput_isolated_xeon.json", "w") as f:
    json.dump(records, f, indent=1)
