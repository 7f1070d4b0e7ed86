#!/usr/bin/env python3
"""Per-stage achieved TFLOP/s or GB/s of our layer, against the H200 ceilings measured in this
workplace (dense bf16 GEMM ~793 TFLOP/s, device copy ~4.2 TB/s; ../shared/bench/README.md).

Usage: python3 bench/reports/analyze_kernels.py bench/results/h200/layer.json [--top 3] [--md out.md]
FLOPs / bytes per stage (T tokens, TK routed rows, bf16 = 2 bytes), minimal traffic:
  GEMMs: up_proj 4*TK*d*n, down_proj 2*TK*n*d, dA_proj 2*TK*d*n, dW2 2*TK*d*n, dW1 4*TK*n*d,
         dX_proj 4*TK*n*d
  gathers: 2*TK*d*2 (read + write); aggregate / dx_sum: TK*d*2 + T*d*2; swiglu: TK*2n*2 + TK*n*2;
  dh_ds: reads H, dA' (TK*3n*2), writes dH, A' (TK*3n*2)
"""
import argparse
import json

PEAK_TF, PEAK_BW = 793.0, 4.2e12


def stage_cost(stage, c):
    T, d, n, K = c["T"], c["d"], c["n"], c["K"]
    TK = T * K
    s = stage.split(".", 1)[1]
    flops = {"up_proj": 4 * TK * d * n, "down_proj": 2 * TK * n * d, "dA_proj": 2 * TK * d * n,
             "dW2": 2 * TK * d * n, "dW1": 4 * TK * n * d, "dX_proj": 4 * TK * n * d}
    if s in flops:
        return "flops", flops[s]
    nbytes = {"gather_x": 4 * TK * d, "gather_dout": 4 * TK * d, "aggregate": 2 * TK * d + 2 * T * d,
              "dx_sum": 2 * TK * d + 2 * T * d, "swiglu": 6 * TK * n, "dh_ds": 12 * TK * n}
    if s in nbytes:
        return "bytes", nbytes[s]
    return None, 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("layer_json")
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--md")
    a = ap.parse_args()
    res = json.load(open(a.layer_json))["results"]
    lines = ["| config | slowest stages: ms, achieved vs ceiling | memory-bound stages share of total |",
             "|---|---|---|"]
    for r in res:
        k = {key[:-3]: v for key, v in r.get("kernels", {}).items()}
        if not k:
            continue
        c = r["config"]
        total = sum(k.values())
        parts = []
        for stage, ms in sorted(k.items(), key=lambda kv: -kv[1])[: a.top]:
            kind, amount = stage_cost(stage, c)
            if kind == "flops":
                parts.append(f"{stage} {ms:.2f} ms {amount / ms / 1e9:.0f} TF/s ({amount / ms / 1e9 / PEAK_TF:.0%})")
            elif kind == "bytes":
                parts.append(f"{stage} {ms:.2f} ms {amount / ms / 1e6:.0f} GB/s ({amount / ms / 1e-3 / PEAK_BW:.0%})")
            else:
                parts.append(f"{stage} {ms:.2f} ms")
        mem = sum(ms for st, ms in k.items() if stage_cost(st, c)[0] == "bytes")
        lines.append(f"| {c['name']} | " + "; ".join(parts) + f" | {mem / total:.0%} |")
    text = "\n".join(lines)
    print(text)
    if a.md:
        open(a.md, "w").write(text + "\n")


if __name__ == "__main__":
    main()
