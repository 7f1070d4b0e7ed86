#!/usr/bin/env python3
"""Each GEMM stage of the layer against its two floors, from bench_layer JSONs (issue 37: per GEMM,
what holds it back).

  python3 bench/reports/gemm_floors.py --peak-tflops 660 --copy-tbs 4.3 run1.json [run2.json ...] > floors.md

Per config and GEMM stage, the lowest median over the given runs, and two lower bounds on its time:
  compute  its FLOPs (2 * M * N * K over the T * K rows) at --peak-tflops (a dense bf16 GEMM's rate
           on the device, measured apart: e.g. cuBLAS on one large square GEMM);
  bytes    the bytes it must move at the least, at --copy-tbs (device-to-device copy bandwidth):
           bf16 everywhere, each gathered source (x, dO: [T, d]) read once, each weight once, index,
           score and dS traffic left out.
The larger one is the stage's floor; `% floor` = floor / measured, and `bound by` names the floor
that binds. A stage far below its floor is held back by neither (latency, the epilogue, the tile
order); one near its bytes floor moves fewer bytes or none faster.

Bytes per stage (R = T * K rows, E experts, W1 [E, 2n, d], W2 [E, n, d]):
  fwd.up_proj    reads x [T, d] + W1, writes H [R, 2n] + A [R, n]
  fwd.down_proj  reads A [R, n] + W2, writes Y [R, d]
  bwd.dA_proj    reads dO [T, d] + W2 + H [R, 2n], writes dH [R, 2n] + A' [R, n]
  bwd.dX_proj    reads dH [R, 2n] + W1, writes dX~ [R, d]
  bwd.dW1        reads x [T, d] + dH [R, 2n], writes dW1 (W1's size)
  bwd.dW2        reads dO [T, d] + A' [R, n], writes dW2 (W2's size)
"""

import argparse
import json

STAGES = ("fwd.up_proj", "fwd.down_proj", "bwd.dA_proj", "bwd.dX_proj", "bwd.dW1", "bwd.dW2")


def stage_flops_bytes(c):
    """{stage: (FLOPs, bytes)} of one config."""
    T, d, n, E, K = c["T"], c["d"], c["n"], c["E"], c["K"]
    R = T * K
    x = T * d * 2
    w1 = E * 2 * n * d * 2
    w2 = E * n * d * 2
    h = R * 2 * n * 2
    a = R * n * 2
    y = R * d * 2
    return {
        "fwd.up_proj": (2 * R * d * 2 * n, x + w1 + h + a),
        "fwd.down_proj": (2 * R * n * d, a + w2 + y),
        "bwd.dA_proj": (2 * R * d * n, x + w2 + h + h + a),
        "bwd.dX_proj": (2 * R * 2 * n * d, h + w1 + y),
        "bwd.dW1": (2 * R * d * 2 * n, x + h + w1),
        "bwd.dW2": (2 * R * n * d, x + a + w2),
    }


def floors(c, ms, peak_tflops, copy_tbs):
    """{stage: dict} for the stages of `ms` ({stage: measured ms})."""
    out = {}
    for st, (flops, nbytes) in stage_flops_bytes(c).items():
        if st not in ms:
            continue
        compute_ms = flops / (peak_tflops * 1e12) * 1e3
        bytes_ms = nbytes / (copy_tbs * 1e12) * 1e3
        floor = max(compute_ms, bytes_ms)
        out[st] = {"ms": ms[st], "tflops": flops / (ms[st] * 1e-3) / 1e12, "gb": nbytes / 1e9,
                   "tbs": nbytes / (ms[st] * 1e-3) / 1e12, "compute_ms": compute_ms, "bytes_ms": bytes_ms,
                   "floor_ms": floor, "of_floor": floor / ms[st],
                   "bound": "bytes" if bytes_ms > compute_ms else "compute"}
    return out


def best_stage_ms(paths):
    """{config name: (config, {stage: lowest ms})}, and the commits seen."""
    best, commits = {}, []
    for p in paths:
        doc = json.load(open(p))
        commits.append(doc.get("commit", "?"))
        for r in doc["results"]:
            c, k = r["config"], r.get("kernels", {})
            _, ms = best.setdefault(c["name"], (c, {}))
            for st in STAGES:
                v = k.get(st + "_ms")
                if v and v > 0:
                    ms[st] = min(ms.get(st, v), v)
    return best, sorted(set(commits))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+")
    p.add_argument("--peak-tflops", type=float, required=True, help="dense bf16 GEMM rate of the device")
    p.add_argument("--copy-tbs", type=float, required=True, help="device-to-device copy bandwidth")
    p.add_argument("--json", help="also write every number here")
    a = p.parse_args()
    best, commits = best_stage_ms(a.runs)
    rows = {name: floors(c, ms, a.peak_tflops, a.copy_tbs) for name, (c, ms) in best.items()}
    print(f"# GEMM stages against their floors ({', '.join(commits)})\n")
    print(f"Floors: FLOPs at {a.peak_tflops:g} TFLOP/s, compulsory bytes at {a.copy_tbs:g} TB/s "
          f"(`bench/reports/gemm_floors.py`); lowest stage median over {len(a.runs)} run(s).\n")
    print("| config | " + " | ".join(STAGES) + " |")
    print("|---|" + "---|" * len(STAGES))
    for name, st in rows.items():
        cells = []
        for s in STAGES:
            v = st.get(s)
            cells.append("-" if v is None else f"{v['ms']:.3f} ms, {100 * v['of_floor']:.0f}% ({v['bound']})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\n`x ms, y% (z)`: the stage's time, the floor as a share of it, the floor that binds.")
    if a.json:
        json.dump({"commits": commits, "peak_tflops": a.peak_tflops, "copy_tbs": a.copy_tbs, "rows": rows},
                  open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
