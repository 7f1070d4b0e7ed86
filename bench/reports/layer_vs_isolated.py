#!/usr/bin/env python3
"""Each GEMM's time inside the layer against its isolated time, on the CPU from committed files.

  python3 bench/reports/layer_vs_isolated.py --bin build/smoe_heuristic --layer LAYER.json [--report NAME] \
      [--side a] LOG [LOG ...]
  python3 bench/reports/layer_vs_isolated.py --pick logged --tuner-json TUNER.json --layer LAYER.json

LOG: smoe_tune logs (every candidate's isolated median per key; `scripts/device.sh tune` keeps them).
LAYER.json: a bench_layer result (`results[].kernels`) or a layer_ab.py JSON (`rows[].stages[stage][side]`;
with several reports in one file, `--report` names one, e.g. b0_configs of n_band_ab.json).
smoe_heuristic (this build) gives each key's pick; the isolated time is that pick's median in the log.
Use a build whose heuristic made the layer's picks, or the two compare different instances.
`--pick logged` takes instead the pick the logs were measured with (the starred candidate; in a
tuner_report.py JSON (`--tuner-json`, the H200's tuner.json) the `heuristic` one): for a layer run with
the heuristic of the logs' commit, no binary needed.

The isolated medians come from back-to-back runs of one GEMM on the layer's own arguments; the layer's
stage is that GEMM between its neighbours (bwd.dA_proj also holds the dS row sum, a few us). A ratio
well above 1 says the layer's context slows that GEMM (clocks, L2 or TLB state): a cost no isolated
tuning sees.
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from heuristic_fit import heuristic_picks, parse_log, parse_tuner_json  # noqa: E402

STAGE = {"up_swiglu": "fwd.up_proj", "down_store": "fwd.down_proj", "da_dswiglu": "bwd.dA_proj",
         "dx_store": "bwd.dX_proj", "dw_gather_p": "bwd.dW2", "dw_gather_p_t": "bwd.dW1"}
FLAG = 1.15


def layer_stages(path, report=None, side="a"):
    """{config: {stage: ms}} from a bench_layer result or a layer_ab.py report."""
    d = json.load(open(path))
    if "results" in d:
        # bench_layer's kernel keys carry a _ms suffix (fwd.up_proj_ms); layer_ab's stages do not.
        return {r["config"]["name"]: {k.removesuffix("_ms"): v for k, v in r["kernels"].items()}
                for r in d["results"] if "kernels" in r}
    if "reports" in d:
        if report is None:
            sys.exit(f"{path}: several reports; name one with --report ({', '.join(d['reports'])})")
        d = d["reports"][report]
    return {r["config"]: {s: v[side] for s, v in r.get("stages", {}).items() if side in v} for r in d["rows"]}


def compare(keys, picks, stages):
    """[(config, kind, pick, isolated ms, layer ms)] for every key whose pick was timed and staged."""
    out = []
    for k, pick in zip(keys, picks):
        iso = k["cands"].get(pick)
        st = stages.get(k["config"], {}).get(STAGE.get(k["kind"], ""))
        if iso is None or st is None or not math.isfinite(iso):
            continue
        out.append((k["config"], k["kind"], pick, iso, st))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="*")
    p.add_argument("--tuner-json", action="append", default=[], help="tuner_report.py JSON (keys with candidates)")
    p.add_argument("--pick", choices=["heuristic", "logged"], default="heuristic",
                   help="heuristic: this build's (--bin); logged: the one the logs were measured with")
    p.add_argument("--bin", help="build/smoe_heuristic (with --pick heuristic)")
    p.add_argument("--layer", required=True)
    p.add_argument("--report")
    p.add_argument("--side", default="a")
    p.add_argument("--hbm-gbps", type=int, default=0, help="for logs that do not print it")
    a = p.parse_args()
    if not a.logs and not a.tuner_json:
        p.error("give tune logs or --tuner-json")
    if a.pick == "heuristic" and not a.bin:
        p.error("--pick heuristic needs --bin")
    keys = [k for f in a.logs for k in parse_log(f)] + [k for f in a.tuner_json for k in parse_tuner_json(f)]
    # The layer's stage for dW1 is one call per half with two tensors: compare interleaved keys only.
    keys = [k for k in keys if not k["halves"]]
    picks = heuristic_picks(a.bin, keys, a.hbm_gbps) if a.pick == "heuristic" else [k["logged"] for k in keys]
    rows = compare(keys, picks, layer_stages(a.layer, a.report, a.side))
    print("| config | GEMM | pick | isolated ms | layer ms | layer / isolated |")
    print("|---|---|---|---|---|---|")
    for cfg, kind, pick, iso, lay in rows:
        r = lay / iso
        print(f"| {cfg} | {kind} | {pick} | {iso:.3f} | {lay:.3f} | {'**' if r >= FLAG else ''}{r:.2f}{'**' if r >= FLAG else ''} |")
    if rows:
        by = {}
        for cfg, kind, pick, iso, lay in rows:
            by.setdefault(kind, []).append(math.log(lay / iso))
        print("\nGeomean layer / isolated per GEMM: " + ", ".join(
            f"{k} {math.exp(sum(v) / len(v)):.2f} ({len(v)})" for k, v in sorted(by.items())))


if __name__ == "__main__":
    main()
