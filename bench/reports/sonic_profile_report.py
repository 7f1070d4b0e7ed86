#!/usr/bin/env python3
"""Both systems' kernel times by role, from sonic_profile.py's profile.json: which of SonicMoE's GEMMs or
sums beats ours, config by config (issue 37: "fwd+bwd >= 1.05x SonicMoE; where not, per GEMM what holds it
back").

  python3 bench/reports/sonic_profile_report.py profile.json [--md out.md]

A kernel's role comes from its name (ROLES: the first pattern that matches, case-insensitive). Our GEMMs
are named by their epilogue (EpiSwiGLU: up-proj; EpiDSwiGLU: dA'); the other four (down-proj, dX~, dW1,
dW2) share templates, so they are one role, "store GEMMs", on both sides. A name no pattern knows goes to
"other" and is listed under the table, so a new kernel is seen, not dropped. ms are per forward + backward
(profiler sums over the profiled iterations / iterations; gaps between kernels are not in them).
Where profile.json holds each system's launch order (sonic_profile.py's "sequence"), a second table names
every GEMM by its place in the order (SONIC_GEMM_ORDER, OURS_GEMM_ORDER): SonicMoE's autotuned GEMMs share
kernel names across GEMMs, so only the order says which one is faster.
"""

import argparse
import json
import re
import sys

# (role, pattern) in match order: the router's cuBLAS GEMM before the generic GEMM patterns, dA' before up.
ROLES = [
    ("router GEMM", r"nvjet|xmma|cublas|ampere_|sm90_gemm|cutlass::kernel2|gemvx|splitkreduce"),
    ("dA' (dSwiGLU + dS)", r"epidswiglu|gemmdact|gemm_dact|dact"),
    ("up-proj (SwiGLU)", r"episwiglu|gemmact|gemm_act|swiglu"),
    ("store GEMMs (down, dX~, dW1, dW2)", r"engine_kernel|varlen|gemmsm90|gemm_sm90|gemmdefault|quack|hopperwgmma|gemm"),
    ("sums (aggregate, dX~ sum, dS)", r"gather_sum|aggregat|reduction|reduce|ds_rowsum|db2_and_ds|db1|token_gather"),
    ("routing (top-K, counts, order)", r"topk|top_k|softmax|histogram|scan|radix|sort|bitmatrix|metadata|offset|"
                                       r"searchsorted|col_partial|map_rows|slots|router_backward|routing|count|prefix|scatter_entries|"
                                       r"tile_scan|expert_select|pad_key|rounding|finalize"),
]
ROLE_NAMES = [r for r, _ in ROLES] + ["other"]


def role_of(name):
    low = name.lower()
    for role, pat in ROLES:
        if re.search(pat, low):
            return role
    return "other"


def by_role(kernels):
    """{role: ms}, and the names that fell to "other" with their ms."""
    out = {r: 0.0 for r in ROLE_NAMES}
    other = []
    for k in kernels:
        r = role_of(k["name"])
        out[r] += k["ms"]
        if r == "other":
            other.append((k["name"], k["ms"]))
    return out, other


# GEMM roles in launch order. SonicMoE (sonicmoe/functional/__init__.py at 0.1.2.post1): forward up-proj, down-proj;
# backward _DownProjection (dA', then dW2), then _UpProjection (dX~, then dW1). Ours (src/moe/forward.cu,
# backward.cu): up-proj, down-proj; dA', dW2, dW1 (one launch, or two with separate gate / up weights), dX~.
SONIC_GEMM_ORDER = ["up-proj", "down-proj", "dA'", "dW2", "dX~", "dW1"]
OURS_GEMM_ORDER = ["up-proj", "down-proj", "dA'", "dW2", "dW1", "dX~"]


def is_gemm(name):
    return role_of(name) in ROLE_NAMES[1:4]


def gemm_launches(sequence, order):
    """{role: [launches]} of one iteration's GEMM launches (items with a "name"), named by their place in
    `order`; our dW1 may be two launches (separate gate / up weights: both are dW1). None when the launches
    do not fit the order (another version or path: then the aggregated table is all there is)."""
    if not sequence:
        return None
    gemms = [[k] for k in sequence if is_gemm(k["name"])]
    n = len(order)
    if len(gemms) == n + 1 and order == OURS_GEMM_ORDER and "varlenk" in gemms[4][0]["name"].lower() \
            and "varlenk" in gemms[5][0]["name"].lower():
        gemms = gemms[:4] + [gemms[4] + gemms[5]] + gemms[6:]
    if len(gemms) != n:
        return None
    return dict(zip(order, gemms))


def gemm_roles(sequence, order):
    """{role: ms} of gemm_launches (a role's launches summed); None where it is None."""
    launches = gemm_launches(sequence, order)
    return None if launches is None else {role: sum(k["ms"] for k in ks) for role, ks in launches.items()}


# The routing role split by job (first match): SonicMoE's forward top-K (a CuTe kernel on bf16 logits) and
# its `_softmax_over_topk_bwd_kernel` against our topk_softmax_kernel and router_backward_kernel; the rest
# of the role is the grouping (counts, prefix, scatter; SonicMoE's metadata kernels).
ROUTING_PARTS = [("router backward", r"router_backward|topk_bwd|over_topk_bwd"),
                 ("top-K softmax", r"topk|top_k"),
                 ("grouping (counts, order)", r".")]


def routing_parts(kernels):
    """{part: ms} over the kernels of the routing role."""
    out = {p: 0.0 for p, _ in ROUTING_PARTS}
    for k in kernels:
        if role_of(k["name"]) != "routing (top-K, counts, order)":
            continue
        low = k["name"].lower()
        out[next(p for p, pat in ROUTING_PARTS if re.search(pat, low))] += k["ms"]
    return out


def routing_table(systems):
    """Markdown lines: the routing role by job, ours beside SonicMoE's."""
    ours, sonic = routing_parts(systems["ours"]["kernels"]), routing_parts(systems["sonicmoe"]["kernels"])
    lines = ["", "Routing by job:", "", "| job | ours ms | SonicMoE ms | sonic / ours |", "|---|---|---|---|"]
    for p, _ in ROUTING_PARTS:
        if ours[p] == 0 and sonic[p] == 0:
            continue
        ratio = f"{sonic[p] / ours[p]:.2f}" if ours[p] > 0 else "-"
        lines.append(f"| {p} | {ours[p]:.3f} | {sonic[p]:.3f} | {ratio} |")
    return lines


def gemm_table(systems):
    """Markdown lines: each GEMM's ms, ours beside SonicMoE's, from both launch orders; [] if either is missing."""
    ours = gemm_roles(systems["ours"].get("sequence"), OURS_GEMM_ORDER)
    sonic = gemm_roles(systems["sonicmoe"].get("sequence"), SONIC_GEMM_ORDER)
    if ours is None or sonic is None:
        return []
    lines = ["", "Per GEMM (one profiled iteration, by launch order):", "",
             "| GEMM | ours ms | SonicMoE ms | sonic / ours |", "|---|---|---|---|"]
    for role in SONIC_GEMM_ORDER:
        lines.append(f"| {role} | {ours[role]:.3f} | {sonic[role]:.3f} | {sonic[role] / ours[role]:.2f} |")
    return lines


def report(doc):
    lines = [f"Kernel time by role, ms per forward + backward (commit {doc.get('commit')}, {doc.get('gpu')}, "
             f"{doc.get('iters')} profiled iterations); `sonic / ours` > 1: ours is faster.", ""]
    for cfg, systems in doc["configs"].items():
        if "ours" not in systems or "sonicmoe" not in systems:
            lines += [f"## {cfg}", "", f"only {', '.join(systems)} profiled", ""]
            continue
        ours, ours_other = by_role(systems["ours"]["kernels"])
        sonic, sonic_other = by_role(systems["sonicmoe"]["kernels"])
        lines += [f"## {cfg}", "", "| role | ours ms | SonicMoE ms | sonic / ours |", "|---|---|---|---|"]
        for r in ROLE_NAMES:
            if ours[r] == 0 and sonic[r] == 0:
                continue
            ratio = f"{sonic[r] / ours[r]:.2f}" if ours[r] > 0 else "-"
            lines.append(f"| {r} | {ours[r]:.3f} | {sonic[r]:.3f} | {ratio} |")
        to, ts = systems["ours"]["sum_ms"], systems["sonicmoe"]["sum_ms"]
        lines.append(f"| **all kernels** | **{to:.3f}** | **{ts:.3f}** | **{ts / to:.2f}** |")
        lines += gemm_table(systems)
        lines += routing_table(systems)
        for who, other in (("ours", ours_other), ("SonicMoE", sonic_other)):
            if other:
                lines.append("")
                lines.append(f"{who}, other: " + "; ".join(f"`{n[:80]}` {ms:.3f}" for n, ms in
                                                          sorted(other, key=lambda x: -x[1])[:8]))
        lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("profile")
    ap.add_argument("--md")
    args = ap.parse_args()
    doc = json.load(open(args.profile))
    if not doc.get("configs"):
        sys.exit(f"{args.profile}: no configs profiled")
    text = report(doc)
    if args.md:
        open(args.md, "w").write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
