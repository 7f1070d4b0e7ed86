"""Engine results against the per-config cuBLAS bound, layer v1 and SonicMoE (markdown table).

Usage: python3 bench/reports/engine_report.py --ours bench/results/h200/layer.json \
           --v1 <(git show debef1d:bench/results/h200/layer.json) --sonic bench/results/h200/side_by_side.json \
           --bound bench/configs/cublas_bound.json > bench/results/h200/engine_vs_bound.md
--ours_log instead of --ours reads bench_layer's text table (the first table of the log; --commit
names it), for runs whose JSON did not come back from the device.
v1 and SonicMoE come from their own JSON files (other processes, same GPU model): the ratios
against them carry that run-to-run spread (about 5% seen between machines in this session).
"""
import argparse
import json


def systems_by_config(path, system):
    d = json.load(open(path))
    out = {}
    for r in d["results"]:
        s = r.get("systems", {}).get(system) if "systems" in r else r
        if s and "total_tflops" in s:
            out[r["config"]["name"]] = s
    return out, d.get("commit", "?")


def systems_from_log(path):
    """bench_layer's text table: 'config  fwd ms  bwd ms  fwd TF  bwd TF  tot TF ...' rows."""
    out = {}
    in_table = False
    for line in open(path):
        if line.startswith("config") and "fwd TF" in line:
            if out:
                break  # only the first table
            in_table = True
            continue
        if in_table:
            if not line.strip():
                break
            parts = line.split()
            # the name has spaces; the next five fields are numbers
            for i in range(1, len(parts) - 4):
                try:
                    nums = [float(x) for x in parts[i:i + 5]]
                except ValueError:
                    continue
                out[" ".join(parts[:i])] = {"fwd_ms": nums[0], "bwd_ms": nums[1], "fwd_tflops": nums[2],
                                            "bwd_tflops": nums[3], "total_tflops": nums[4]}
                break
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours")
    ap.add_argument("--ours_log")
    ap.add_argument("--commit", default="?")
    ap.add_argument("--v1", required=True)
    ap.add_argument("--sonic", required=True)
    ap.add_argument("--bound", required=True)
    a = ap.parse_args()
    if a.ours_log:
        ours, oc = systems_from_log(a.ours_log), a.commit
    else:
        ours, oc = systems_by_config(a.ours, "ours")
    v1, vc = systems_by_config(a.v1, "ours")
    sonic, sc = systems_by_config(a.sonic, "sonicmoe")
    bound = json.load(open(a.bound))["bound"]
    print(f"Engine at {oc} vs layer v1 at {vc} and SonicMoE (side_by_side at {sc}); NVIDIA H200; "
          "TFLOP/s with 6TKdn fwd, 12TKdn bwd; % = of the per-config cuBLAS bound.\n")
    print("| config | fwd TF (% bound) | bwd TF (% bound) | total TF | v1 total | SonicMoE total | vs v1 | vs SonicMoE |")
    print("|---|---|---|---|---|---|---|---|")
    for name, o in ours.items():
        bf, bb = bound.get(name, (None, None))
        pf = f" ({100 * o['fwd_tflops'] / bf:.0f}%)" if bf else ""
        pb = f" ({100 * o['bwd_tflops'] / bb:.0f}%)" if bb else ""
        t = o["total_tflops"]
        v = v1.get(name, {}).get("total_tflops")
        s = sonic.get(name, {}).get("total_tflops")
        print(f"| {name} | {o['fwd_tflops']:.0f}{pf} | {o['bwd_tflops']:.0f}{pb} | {t:.0f} | "
              f"{v:.0f} | " if v else f"| {name} | {o['fwd_tflops']:.0f}{pf} | {o['bwd_tflops']:.0f}{pb} | {t:.0f} | n/a | ",
              end="")
        print(f"{s:.0f} | " if s else "n/a | ", end="")
        print(f"{t / v:.2f}x | " if v else "n/a | ", end="")
        print(f"{t / s:.2f}x |" if s else "n/a |")


if __name__ == "__main__":
    main()
