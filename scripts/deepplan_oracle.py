#!/usr/bin/env python3
"""An independent reading of DeepPlan's planner (EuroSys'23, Algorithm 1 with the artifact's
stall model), used by tests/deepplan_oracle.rs as an oracle for src/plan/deepplan.

Written from the paper and the libserve spec, in plain Python with no dependencies, and kept
deliberately literal: the pipeline is simulated as two clocks (the load stream's and the
execution stream's), not as the slack recurrence the Rust planner uses, so the two share no
arithmetic shortcut.

Reads a JSON list of cold-start profiles ({"model", "layers": [{"bytes", "load_ms", "exec_ms",
"dha_ms", ...}]}) on stdin; writes a JSON list of {"plan": ["load"|"dha", ...], "latency_ms",
"all_load_latency_ms", "resim_plan", "resim_latency_ms"} on stdout.
"""
import json
import sys


def run_time(layer, method):
    if method == "dha" and layer["bytes"] > 0:
        return layer["dha_ms"]
    return layer["exec_ms"]


def simulate(layers, plan):
    """Per-layer stalls and the latency: the load stream copies the loaded layers back to back
    from 0; each layer starts when the previous one ended and, if loaded, when its copy landed."""
    copied = 0.0
    end = 0.0
    stalls = []
    for layer, method in zip(layers, plan):
        start = end
        stall = 0.0
        if method == "load" and layer["bytes"] > 0:
            copied += layer["load_ms"]
            if copied > end:
                stall = copied - end
                start = copied
        end = start + run_time(layer, method)
        stalls.append(stall)
    return stalls, end


def algorithm1(layers, resim_always):
    n = len(layers)
    plan = ["load"] * n
    stalls, _ = simulate(layers, plan)
    for i in range(n):
        stall = stalls[i]
        if not stall > 0:
            continue
        candidates = [j for j in range(i + 1) if layers[j]["bytes"] > 0 and plan[j] == "load"]
        # Python's sort is stable: equal keys keep layer order.
        candidates.sort(key=lambda j: (layers[j]["dha_ms"] - layers[j]["exec_ms"], -layers[j]["load_ms"]))
        cleared = False
        for j in candidates:
            l = layers[j]
            diff = l["dha_ms"] - l["exec_ms"]
            if l["dha_ms"] > l["exec_ms"] + 1.5 * l["load_ms"]:
                break
            if stall < diff:
                break
            plan[j] = "dha"
            stall = stall - l["load_ms"] - diff
            if stall <= 0:
                stalls, _ = simulate(layers, plan)
                cleared = True
                break
        if not cleared and resim_always:
            stalls, _ = simulate(layers, plan)
    return plan


def main():
    out = []
    for profile in json.load(sys.stdin):
        layers = profile["layers"]
        plan = algorithm1(layers, False)
        resim = algorithm1(layers, True)
        out.append({
            "plan": plan,
            "latency_ms": simulate(layers, plan)[1],
            "all_load_latency_ms": simulate(layers, ["load"] * len(layers))[1],
            "resim_plan": resim,
            "resim_latency_ms": simulate(layers, resim)[1],
        })
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
