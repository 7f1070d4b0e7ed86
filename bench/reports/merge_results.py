#!/usr/bin/env python3
"""Merge our C++ benchmark's JSON with bench/baselines/torch_baseline.py's JSON into the results format of
shared/bench/README.md, and print a markdown comparison table.

  python3 bench/reports/merge_results.py --ours ours.json --torch torch.json \
      --out bench/results/h200/layer_torch.json [--md bench/results/h200/layer_torch.md]

ours.json  : {"commit", "gpu", "driver", "cuda", "date",
              "results": [{"config": {...}, "systems": {"ours": {...} | {"error": ...}},
                           "kernels": {...}}]}
torch.json : {"device", "torch", "cuda", "results": [{"config": {...},
                                                      "torch_grouped_mm": {...} | {"error": ...}}]}

Configs are matched by name.  Output per config: systems ours, torch_grouped_mm and sonicmoe
(an error entry: not run here), our kernels, and speedup_vs_torch = torch (fwd+bwd) time / ours
(fwd+bwd) time (null where either system has no numbers).
"""

import argparse
import json
import sys

CONFIG_KEYS = ("name", "T", "d", "n", "E", "K")
SONICMOE_ERROR = "not run in this benchmark (issue: PyTorch extension milestone)"
TORCH_SYS = "torch_grouped_mm"


def warn(msg):
    print(f"warning: {msg}", file=sys.stderr)


def ok(m):
    return isinstance(m, dict) and "error" not in m and m.get("fwd_ms") is not None \
        and m.get("bwd_ms") is not None


def total_ms(m):
    return m["fwd_ms"] + m["bwd_ms"]


def merge(ours, torch_doc):
    torch_by_name = {}
    for r in torch_doc.get("results", []):
        torch_by_name[r["config"]["name"]] = r
    merged = {
        "commit": ours.get("commit"),
        "gpu": ours.get("gpu"),
        "driver": ours.get("driver"),
        "cuda": ours.get("cuda"),
        "torch": torch_doc.get("torch"),
        "date": ours.get("date"),
        "results": [],
    }
    if torch_doc.get("cuda") and ours.get("cuda") and \
            str(torch_doc["cuda"]) != str(ours["cuda"]):
        merged["torch_cuda"] = torch_doc["cuda"]
    tdev, ogpu = torch_doc.get("device"), ours.get("gpu")
    if tdev and ogpu and tdev != ogpu:
        warn(f"torch results were measured on '{tdev}', ours on '{ogpu}'")
        merged["torch_device"] = tdev

    seen = set()
    for r in ours.get("results", []):
        cfg = {k: r["config"][k] for k in CONFIG_KEYS if k in r["config"]}
        name = cfg["name"]
        seen.add(name)
        ours_m = r.get("systems", {}).get("ours", {"error": "missing from our results"})
        tr = torch_by_name.get(name)
        if tr is None:
            torch_m = {"error": "not in the torch baseline results"}
        else:
            tcfg = tr["config"]
            diff = [k for k in CONFIG_KEYS[1:] if k in cfg and tcfg.get(k) != cfg[k]]
            if diff:
                warn(f"{name}: shapes differ between ours and torch in {diff}")
                torch_m = {"error": "torch baseline was run with a different shape: " +
                           ", ".join(f"{k}={tcfg.get(k)}" for k in diff)}
            else:
                torch_m = tr.get(TORCH_SYS, {"error": "no torch_grouped_mm entry"})
        entry = {
            "config": cfg,
            "systems": {"ours": ours_m, TORCH_SYS: torch_m, "sonicmoe": {"error": SONICMOE_ERROR}},
            "kernels": r.get("kernels", {}),
            "speedup_vs_torch": (total_ms(torch_m) / total_ms(ours_m)
                                 if ok(ours_m) and ok(torch_m) and total_ms(ours_m) > 0 else None),
        }
        merged["results"].append(entry)

    for r in torch_doc.get("results", []):
        name = r["config"]["name"]
        if name in seen:
            continue
        warn(f"{name}: only in the torch results")
        merged["results"].append({
            "config": {k: r["config"][k] for k in CONFIG_KEYS if k in r["config"]},
            "systems": {"ours": {"error": "not in our results"},
                        TORCH_SYS: r.get(TORCH_SYS, {"error": "no torch_grouped_mm entry"}),
                        "sonicmoe": {"error": SONICMOE_ERROR}},
            "kernels": {},
            "speedup_vs_torch": None,
        })
    return merged


def _num(v, spec):
    return "-" if v is None else format(v, spec)


def _tf(m):
    if not ok(m):
        return "error" if isinstance(m, dict) and "error" in m else "-"
    return " / ".join(_num(m.get(k), ".0f") for k in ("fwd_tflops", "bwd_tflops", "total_tflops"))


def _gb(b):
    return None if b is None else b / 1e9


def markdown(merged):
    lines = [
        "| config | ours fwd / bwd / total TFLOP/s | torch fwd / bwd / total TFLOP/s | speedup "
        "| ours held GB (plan GB) | torch held GB |",
        "|---|---|---|---|---|---|",
    ]
    for r in merged["results"]:
        o, t = r["systems"]["ours"], r["systems"][TORCH_SYS]
        sp = r.get("speedup_vs_torch")
        ours_mem = "-"
        if ok(o):
            ours_mem = f"{_num(_gb(o.get('held_bytes')), '.2f')} ({_num(_gb(o.get('plan_bytes')), '.2f')})"
        torch_mem = _num(_gb(t.get("held_bytes")), ".2f") if ok(t) else "-"
        lines.append(f"| {r['config']['name']} | {_tf(o)} | {_tf(t)} | "
                     f"{'-' if sp is None else f'{sp:.2f}x'} | {ours_mem} | {torch_mem} |")
    errs = []
    for r in merged["results"]:
        for sysname in ("ours", TORCH_SYS):
            m = r["systems"][sysname]
            if isinstance(m, dict) and "error" in m:
                errs.append(f"- {r['config']['name']}, {sysname}: {m['error']}")
    head = (f"{merged.get('gpu') or '?'}, commit {merged.get('commit') or '?'}, "
            f"CUDA {merged.get('cuda') or '?'}, torch {merged.get('torch') or '?'}, "
            f"{merged.get('date') or '?'}. Speedup = torch (fwd+bwd) time / ours (fwd+bwd) time; "
            f"GB = 1e9 bytes held for backward.")
    out = head + "\n\n" + "\n".join(lines) + "\n"
    if errs:
        out += "\nErrors:\n" + "\n".join(errs) + "\n"
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ours", required=True, help="JSON written by our C++ benchmark")
    ap.add_argument("--torch", required=True, help="JSON written by bench/baselines/torch_baseline.py")
    ap.add_argument("--out", required=True, help="merged results JSON to write")
    ap.add_argument("--md", help="also write the markdown table here")
    args = ap.parse_args()

    with open(args.ours) as f:
        ours = json.load(f)
    with open(args.torch) as f:
        torch_doc = json.load(f)
    merged = merge(ours, torch_doc)
    with open(args.out, "w") as f:
        json.dump(merged, f, indent=1)
        f.write("\n")
    md = markdown(merged)
    print(md, end="")
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
