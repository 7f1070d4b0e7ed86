"""The torch path's peak memory across runs of bench/drivers/side_by_side.py: per config the bytes held
from forward to backward, and for each run (label=results.json) `peak_bytes - base_bytes` of ours (the most
the caching allocator held above the inputs during one forward + backward), plus SonicMoE's from a run
that has it. Wall times are listed but are not an A/B: the runs are separate processes.

Usage: python3 bench/reports/peak_memory.py before=a.json fix=b.json [ovl=c.json ...] \
           [--sonic <label>] --md out.md --json out.json
A run may also be `label=report.json#key`: the side_by_side document embedded under "runs" in an earlier
report (bench/results/h100/peak_memory.json keeps its 8c2ad69 and overlay runs as #fix and #ovl).
(bench/results/h100/peak_memory.md is this report: 811ef09, 8c2ad69, 8c2ad69 + the overlay.)
"""
import argparse
import json

GB = 1e9


def above_base(sys_result):
    """peak_bytes - base_bytes in GB, or None where the run did not measure it (error, not run)."""
    if not sys_result or "peak_bytes" not in sys_result or "base_bytes" not in sys_result:
        return None
    return (sys_result["peak_bytes"] - sys_result["base_bytes"]) / GB


def collect(runs, sonic_label=None):
    """runs: [(label, side_by_side doc)]. One row per config of the runs, in first-seen order."""
    by_run = {label: {r["config"]["name"]: r["systems"] for r in doc["results"]} for label, doc in runs}
    names = []
    for _, doc in runs:
        for r in doc["results"]:
            if r["config"]["name"] not in names:
                names.append(r["config"]["name"])
    rows = []
    for name in names:
        ours = {label: by_run[label].get(name, {}).get("ours") for label, _ in runs}
        held = next((o["held_bytes"] / GB for o in ours.values() if o and "held_bytes" in o), None)
        row = {"config": name, "held_gb": held,
               "peak_above_base_gb": {label: above_base(o) for label, o in ours.items()},
               "fwd_bwd_ms": {label: (o or {}).get("fwd_bwd_ms") for label, o in ours.items()}}
        if sonic_label:
            row["sonicmoe_peak_above_base_gb"] = above_base(by_run[sonic_label].get(name, {}).get("sonicmoe"))
        rows.append(row)
    return rows


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def markdown(runs, rows, sonic_label=None):
    labels = [label for label, _ in runs]
    head = "| config | held GB | " + " | ".join(f"{lb} ({runs[i][1].get('commit', '?')})" for i, lb in enumerate(labels))
    head += f" | SonicMoE ({sonic_label})" if sonic_label else ""
    head += " | fwd+bwd ms " + " / ".join(labels) + " |"
    sep = "|---" * (2 + len(labels) + (1 if sonic_label else 0) + 1) + "|"
    gpus = sorted({doc.get("gpu", "?") for _, doc in runs})
    lines = [f"Peak above the inputs (`peak_bytes - base_bytes`, GB = 1e9) of one forward + backward through the torch "
             f"path, per run of `side_by_side.py`; {', '.join(gpus)}. Wall times are separate processes, not an A/B.",
             "", head, sep]
    for r in rows:
        cells = [r["config"], _f(r["held_gb"])] + [_f(r["peak_above_base_gb"][lb]) for lb in labels]
        if sonic_label:
            cells.append(_f(r["sonicmoe_peak_above_base_gb"]))
        cells.append(" / ".join(_f(r["fwd_bwd_ms"][lb]) for lb in labels))
        lines.append("| " + " | ".join(cells) + " |")
    if len(labels) >= 2:
        first, last = labels[0], labels[-1]
        drops = [r["peak_above_base_gb"][first] - r["peak_above_base_gb"][last] for r in rows
                 if r["peak_above_base_gb"][first] is not None and r["peak_above_base_gb"][last] is not None]
        if drops:
            lines += ["", f"{first} -> {last}: the peak falls by {min(drops):.2f}-{max(drops):.2f} GB over "
                          f"{len(drops)} configs."]
    if sonic_label:
        gaps = [r["peak_above_base_gb"][labels[-1]] - r["sonicmoe_peak_above_base_gb"] for r in rows
                if r["peak_above_base_gb"][labels[-1]] is not None and r["sonicmoe_peak_above_base_gb"] is not None]
        if gaps:
            lines.append(f"{labels[-1]} against SonicMoE's peak: {min(gaps):+.2f} to {max(gaps):+.2f} GB "
                         f"({len(gaps)} configs).")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="label=side_by_side results JSON, oldest first")
    ap.add_argument("--sonic", help="the label of the run whose SonicMoE peaks to list")
    ap.add_argument("--md")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    runs = []
    for spec in a.runs:
        label, _, path = spec.partition("=")
        if not path:
            ap.error(f"{spec!r}: want label=path")
        path, _, key = path.partition("#")  # path#key: the run `key` embedded in an earlier report's "runs"
        with open(path) as f:
            d = json.load(f)
        if key:
            if key not in d.get("runs", {}) or "results" not in d["runs"][key]:
                ap.error(f"{spec!r}: {path} has no embedded run {key!r}")
            d = d["runs"][key]
        runs.append((label, d))
    if a.sonic and a.sonic not in [lb for lb, _ in runs]:
        ap.error(f"--sonic {a.sonic!r} is not one of the runs' labels")
    rows = collect(runs, a.sonic)
    md = markdown(runs, rows, a.sonic)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md)
    else:
        print(md, end="")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"kind": "peak_memory", "runs": {lb: {k: doc.get(k) for k in ("commit", "gpu", "torch", "date")}
                                                      for lb, doc in runs},
                       "sonic_from": a.sonic, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
