"""Issue 11's EP=2 results: merges raw torchrun runs of bench/baselines/ep_baseline.py into the shared results
format, adds the communication-aware roofline per config, writes a table and a plot.

    python3 bench/reports/ep_report.py <raw per-run JSONs; those of the current report: git show 5ae9409 -- bench/results/h200x2/ep_raw> --out bench/results/h200x2/ep

Roofline (per rank, global batch T split evenly over R = 2 ranks, uniform routing; docs/ep.md):
  GEMM   fwd 6 (T/R) K d n FLOPs, bwd 12 (T/R) K d n, at the per-config cuBLAS bound
         (bench/configs/cublas_bound.json: dense GEMMs + the aggregation's HBM bytes, so the HBM term is in it)
  NVLink p = 1 - C(E/R, K) / C(E, K), the chance that a token has an expert on the other rank; per
         direction, forward moves (T/R) p d 2 bytes of dispatch and as many of combine, backward the
         same (dO out, dX~ back); at 350 GB/s, the LSA push measured on this machine
  roofline = max(GEMM, NVLink) (communication overlapped), fraction = roofline / measured.
A later run of a config replaces an earlier one system by system (the raw files stay in ep_raw/);
"later" is by the commit time of each file's commit (git), not by the order of the arguments (a
glob sorts the hashes alphabetically).
Baseline numbers (torchtitan_a2a, ours_local_a2a) of runs before 6910319 are dropped: that
bench/baselines/ep_baseline.py built the baseline's receive permutation with E/R * R host syncs, which
inflated its forward (1.4B: 13.1 ms, 5.0 ms with the on-device permutation). Our EP numbers of
those runs stay (they never used that path).
"""
import argparse
import json
import math
import os
import subprocess

NVLINK_GBS = 350.0
BASELINE_INVALID_RUNS = {"fbbbbad", "5e9fecd"}   # see the docstring


def roofline(c, bound, R=2):
    T, d, n, E, K = c["T"], c["d"], c["n"], c["E"], c["K"]
    Tr = T / R
    p = 1.0 - math.comb(E // R, K) / math.comb(E, K)
    fwd_gemm = 6 * Tr * K * d * n / (bound[0] * 1e12) * 1e3
    bwd_gemm = 12 * Tr * K * d * n / (bound[1] * 1e12) * 1e3
    link_bytes = 2 * Tr * p * d * 2
    link_ms = link_bytes / (NVLINK_GBS * 1e9) * 1e3
    return {"fwd_ms": max(fwd_gemm, link_ms), "bwd_ms": max(bwd_gemm, link_ms), "fwd_gemm_ms": fwd_gemm,
            "bwd_gemm_ms": bwd_gemm, "nvlink_ms_per_pass": link_ms, "nvlink_bytes_per_direction": link_bytes,
            "p_cross": p, "nvlink_gbs": NVLINK_GBS}


def commit_time(commit, root):
    """Commit time of a hash (seconds), or 0 when git does not know it (the argument order then)."""
    try:
        out = subprocess.run(["git", "-C", root, "show", "-s", "--format=%ct", commit], capture_output=True,
                             text=True, timeout=30)
        return int(out.stdout.strip()) if out.returncode == 0 else 0
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("raw", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    root = os.path.dirname(os.path.abspath(__file__))
    cfg_dir = os.path.join(os.path.dirname(root), "configs")
    bound = json.load(open(os.path.join(cfg_dir, "cublas_bound.json")))["bound"]
    order = [c["name"] for c in json.load(open(os.path.join(cfg_dir, "configs.json")))]
    merged, meta, dropped = {}, {}, {}
    runs = [json.load(open(f)) for f in args.raw]
    runs.sort(key=lambda d: commit_time(d.get("commit", ""), root))   # stable: ties keep argument order
    for d in runs:
        for r in d["results"]:
            name = r["config"]["name"]
            e = merged.setdefault(name, {"config": r["config"], "systems": {}})
            for s, v in r.get("systems", {}).items():
                if s != "ours_ep" and d["commit"] in BASELINE_INVALID_RUNS:
                    dropped.setdefault(name, set()).add(s)
                    continue
                e["systems"][s] = dict(v, commit=d["commit"])
        meta[d["commit"]] = {k: d.get(k) for k in ("gpu", "torch", "nccl", "world_size")}
    results = []
    for name in order:
        c = next(c for c in json.load(open(os.path.join(cfg_dir, "configs.json"))) if c["name"] == name)
        e = merged.get(name, {"config": dict(c, ep=2), "systems": {}})
        for s in ("ours_ep", "torchtitan_a2a", "ours_local_a2a"):
            why = ("not measured since 6910319 (the earlier run had the baseline's host-sync bug)"
                   if s in dropped.get(name, ()) else "not measured: the device time of the session ran out first")
            e["systems"].setdefault(s, {"error": why})
        rl = roofline(c, bound[name])
        e["systems"]["roofline"] = rl
        o = e["systems"]["ours_ep"]
        if "fwd_ms" in o:
            o["total_ms"] = o["fwd_ms"] + o["bwd_ms"]
            o["roofline_fraction"] = {"fwd": rl["fwd_ms"] / o["fwd_ms"], "bwd": rl["bwd_ms"] / o["bwd_ms"],
                                      "total": (rl["fwd_ms"] + rl["bwd_ms"]) / o["total_ms"]}
            for base in ("torchtitan_a2a", "ours_local_a2a"):
                b = e["systems"][base]
                if "fwd_ms" in b:
                    o.setdefault("speedup_total", {})[base] = (b["fwd_ms"] + b["bwd_ms"]) / o["total_ms"]
        results.append(e)
    out = {"gpu": "2x NVIDIA H200 (NV18)", "device": "nvidia-h200-x2", "driver": "580.159.04", "cuda": "13.0",
           "date": "2026-11-30", "runs": meta, "ep": 2,
           "timing": "median of 5-7 reps after warm-up, CUDA events, max over ranks; fwd_ms = forward, bwd_ms = "
                     "(forward+backward) - forward; TFLOP/s per rank with 6 (T/2) K d n fwd, 12 (T/2) K d n bwd",
           "results": results}
    json.dump(out, open(args.out + ".json", "w"), indent=1)

    lines = ["# EP=2 on nvidia-h200-x2: smoe's EP layer vs the torchtitan all-to-all pattern", "",
             "Per rank, global batch T split over 2 ranks; ms = max over ranks (median); roofline = max(GEMM at the",
             "cuBLAS bound, NVLink bytes at 350 GB/s) per pass. Generated by bench/reports/ep_report.py from "
             "ep_raw/.", "",
             "| config | ours_ep fwd / bwd ms | torchtitan_a2a fwd / bwd ms | ours_local_a2a fwd / bwd ms | "
             "speedup vs torchtitan (fwd+bwd) | roofline fwd / bwd ms | fraction of roofline fwd / bwd / total |",
             "|---|---|---|---|---|---|---|"]
    fmt = lambda s: f"{s['fwd_ms']:.2f} / {s['bwd_ms']:.2f}" if "fwd_ms" in s else "not measured"  # noqa: E731
    for e in results:
        s = e["systems"]
        o, rl = s["ours_ep"], s["roofline"]
        sp = f"{o['speedup_total']['torchtitan_a2a']:.2f}x" if "speedup_total" in o and "torchtitan_a2a" in o["speedup_total"] else "-"
        fr = o.get("roofline_fraction")
        frs = f"{fr['fwd']:.0%} / {fr['bwd']:.0%} / {fr['total']:.0%}" if fr else "-"
        lines.append(f"| {e['config']['name']} | {fmt(o)} | {fmt(s['torchtitan_a2a'])} | {fmt(s['ours_local_a2a'])} | "
                     f"{sp} | {rl['fwd_ms']:.2f} / {rl['bwd_ms']:.2f} | {frs} |")
    # With bench/baselines/ep_baseline.py --profile: the kernels' time per call next to the event time. Where
    # the event time is far above it, the step waits on the host (launches, syncs) or on a peer.
    prof = [(e["config"]["name"], sname, v) for e in results for sname, v in e["systems"].items()
            if isinstance(v, dict) and "fwd_kernel_ms" in v]
    if prof:
        lines += ["", "Kernel time per call (torch.profiler, max over ranks) against the event time:", "",
                  "| config | system | fwd event / kernels ms | fwd+bwd event / kernels ms | commit |",
                  "|---|---|---|---|---|"]
        for name, sname, v in prof:
            lines.append(f"| {name} | {sname} | {v['fwd_ms']:.2f} / {v['fwd_kernel_ms']:.2f} | "
                         f"{v['fwd_ms'] + v['bwd_ms']:.2f} / {v['fwd_bwd_kernel_ms']:.2f} | {v.get('commit', '?')} |")
    open(args.out + ".md", "w").write("\n".join(lines) + "\n")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = [e["config"]["name"] for e in results]
    fig, ax = plt.subplots(figsize=(12, 5))
    w = 0.2
    for i, (s, col) in enumerate((("roofline", "0.7"), ("ours_ep", "C0"), ("ours_local_a2a", "C2"), ("torchtitan_a2a", "C1"))):
        vals = [(e["systems"][s]["fwd_ms"] + e["systems"][s]["bwd_ms"]) if "fwd_ms" in e["systems"][s] else 0 for e in results]
        ax.bar([j + (i - 1.5) * w for j in range(len(names))], vals, w, label=s, color=col)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("forward + backward ms per step (max over ranks)")
    ax.set_yscale("log")
    ax.set_title("EP=2, 2x H200 (NV18): smoe EP vs all-to-all baselines (0 = not measured)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)


if __name__ == "__main__":
    main()
