#!/usr/bin/env python3
"""Side-by-side benchmark in one process: (a) this library through its torch op, (b) the torch
grouped_mm baseline (torchtitan pattern, bench/baselines/torch_baseline.py), (c) SonicMoE 0.1.2.post1 if importable
(bench/baselines/sonicmoe_env.sh installs it on the GPU machine).

Same inputs for all three (torch_baseline.make_inputs); the same timing (torch_baseline.measure: CUDA events, warm-up,
median) and memory accounting (memory_allocated after forward minus before, less the output). Then, with
--rounds R (default 4), (a) and (c) again on one set of tensors in R rounds of alternating order (round_order),
whose per-round ratio the table reports beside the sequential one.
(a) calls torch.ops.smoe.moe_forward with gate/up already interleaved (the library's layout, as a
caller that keeps its weights that way would); smoe_torch.MoE's own cost over the op is in
bench/drivers/module_vs_op.py.

Usage (on the GPU, after `pip install --no-build-isolation .`):
  python3 bench/drivers/side_by_side.py --out bench/results/h200/side_by_side.json --plots bench/results/h200
The results file is rewritten after every config, so a run cut short keeps the configs it finished.
Runs of config subsets (each config's systems still in one process) are merged with
  python3 bench/drivers/side_by_side.py --merge a.json b.json ... --out side_by_side.json [--plots DIR]
which, like --replot, needs neither torch nor a GPU.
"""
import argparse
import gc
import json
import os
import statistics
import subprocess
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/
sys.path.insert(0, os.path.join(BENCH, "baselines"))  # torch_baseline
DEFAULT_CONFIGS = os.path.join(BENCH, "configs", "configs.json")
TORCH_REASON = None
try:
    import torch
    import torch_baseline as tb
except ImportError as e:  # --replot / --merge run without torch (the CPU machine)
    torch = tb = None
    TORCH_REASON = f"{type(e).__name__}: {e}"

SONIC_REASON = None
try:
    import sonicmoe  # noqa: F401
    from sonicmoe.enums import ActivationType
except Exception as e:  # noqa: BLE001
    SONIC_REASON = (
        f"import sonicmoe failed ({type(e).__name__}: {e}). It is not installed on the GPU machine "
        "(no network there); bench/baselines/sonicmoe_env.sh packs sonic-moe 0.1.2.post1 and its dependencies "
        "into .whl/ and installs them there")


def interleave_w13(w1, w3):
    """torchtitan w1 [E][n][d] (gate) and w3 [E][n][d] (up) -> [E][2n][d], gate/up alternating by row
    (the layout of this library and of SonicMoE's concat_layout=False)."""
    E, n, d = w1.shape
    return torch.stack((w1.detach(), w3.detach()), dim=2).reshape(E, 2 * n, d).contiguous().requires_grad_(True)


def layer_inputs(cfg, args, device):
    """torch_baseline's inputs (same seed, same values) with w1/w3 interleaved into [E][2n][d]."""
    T, d, n, E = (int(cfg[k]) for k in ("T", "d", "n", "E"))
    x, w_router, w1, w3, w2, dout = tb.make_inputs(T, d, n, E, device, seed=args.seed)
    return (x, w_router, interleave_w13(w1, w3), w2), dout


def ours_forward(params, K):
    return torch.ops.smoe.moe_forward(*params, K)[0]


def bench_ours(cfg, args, device):
    import smoe_torch  # noqa: F401
    T, n, E, K = (int(cfg[k]) for k in ("T", "n", "E", "K"))
    params, dout = layer_inputs(cfg, args, device)
    res = tb.measure(lambda: ours_forward(params, K), params, dout, cfg, args, device)
    res["plan_bytes"] = int(4 * T * K * n + 20 * T * K + 4 * (2 * E + 1))
    return res


def rel_l2(a, b, rows=None):
    """||a - b|| / ||b||, accumulated in float64 over chunks (the weight gradients of the largest configs
    are 7.5e9 elements: a whole-tensor float64 copy would not fit). rows: optional boolean row mask."""
    if rows is not None:
        a, b = a[rows], b[rows]
    num = den = 0.0
    for ca, cb in zip(a.reshape(-1).split(1 << 26), b.reshape(-1).split(1 << 26)):
        ca, cb = ca.double(), cb.double()
        num += float((ca - cb).square().sum())
        den += float(cb.square().sum())
    return (num / max(den, 1e-300)) ** 0.5


def sonic_forward(params, K, stream):
    """SonicMoE's layer on our tensors: its w1 (2n, d, E) and w2 (d, n, E) are permute(1, 2, 0) views of
    our [E][2n][d] and [E][d][n] (bench_sonic)."""
    x, w_router, w1i, w2 = params
    return sonicmoe.moe_TC_softmax_topk_layer(x, w_router, w1i.permute(1, 2, 0), None, w2.permute(1, 2, 0),
                                              None, K, stream, ActivationType.SWIGLU, False)[0]


def bench_sonic(cfg, args, device):
    """SonicMoE 0.1.2.post1 through moe_TC_softmax_topk_layer (its own router: softmax over the K chosen
    logits, as ours). Its weight format is w1 (2n, d, E) with stride order (2, 0, 1), gate/up interleaved,
    and w2 (d, n, E) likewise: exactly permute(1, 2, 0) of our [E][2n][d] and [E][d][n]. So both systems
    see the very same tensors, and we also record how far apart their outputs and gradients are."""
    K = int(cfg["K"])
    params, dout = layer_inputs(cfg, args, device)
    stream = torch.cuda.current_stream().cuda_stream

    def fwd():
        return sonic_forward(params, K, stream)

    res = tb.measure(fwd, params, dout, cfg, args, device)
    try:
        res["agreement_with_ours"] = agreement(fwd, params, dout, K)
    except Exception as e:  # noqa: BLE001  (the timing above stands on its own)
        res["agreement_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return res


def round_order(names, r):
    """Round r's order of the systems: as given on even rounds, reversed on odd ones. Over an even number
    of rounds each system then runs first and last equally often, so a drift of the card's clocks (the
    H100 runs power-capped under this load) and the L2 state one system leaves the next fall on both
    alike. The sequential measurement (tb.measure per system) runs ours before torch before SonicMoE,
    every config, in one block each."""
    names = list(names)
    return names if r % 2 == 0 else names[::-1]


def interleaved_rounds(systems, rounds, timer):
    """systems: {name: (fwd, fwd_bwd, before)}; timer(fn, before) -> the timed calls of one block (its
    warm-up untimed), in ms. Each round runs, per system in round_order, a block of fwd() and then a
    block of fwd_bwd() (before() outside every timed call). Returns {name: {"fwd_ms": [...],
    "fwd_bwd_ms": [...]}}: each block's median, one per round."""
    per = {k: {"fwd_ms": [], "fwd_bwd_ms": []} for k in systems}
    for r in range(rounds):
        for name in round_order(systems, r):
            fwd, fwd_bwd, before = systems[name]
            per[name]["fwd_ms"].append(statistics.median(timer(fwd, None)))
            per[name]["fwd_bwd_ms"].append(statistics.median(timer(fwd_bwd, before)))
    return per


def interleaved_summary(per, a="ours", b="sonicmoe"):
    """b's time over a's (> 1: a is faster) in each round, for the forward, the backward (the round's
    fwd_bwd less its fwd) and both, with their median, min and max over the rounds. A ratio of a round
    whose time of a is not positive is left out (None)."""
    out = {}
    rounds = len(per[a]["fwd_ms"])
    for key in ("fwd", "bwd", "fwd_bwd"):
        def t(name, r):
            f, fb = per[name]["fwd_ms"][r], per[name]["fwd_bwd_ms"][r]
            return f if key == "fwd" else fb - f if key == "bwd" else fb
        ratios = [t(b, r) / t(a, r) if t(a, r) > 0 else None for r in range(rounds)]
        ok = [v for v in ratios if v is not None]
        out[key] = {"rounds": ratios, "median": statistics.median(ok) if ok else None,
                    "min": min(ok) if ok else None, "max": max(ok) if ok else None}
    return out


def bench_interleaved(cfg, args, device):
    """ours and SonicMoE on one set of tensors in --rounds alternating rounds (interleaved_rounds), blocks
    of --round-warmup untimed and --round-reps timed calls: the ratio of the two without the order and
    drift of the sequential measurement."""
    import smoe_torch  # noqa: F401
    K = int(cfg["K"])
    params, dout = layer_inputs(cfg, args, device)
    stream = torch.cuda.current_stream().cuda_stream

    def zero_grads():
        for p in params:
            p.grad = None

    def make(fwd):
        return fwd, (lambda: fwd().backward(dout)), zero_grads

    systems = {"ours": make(lambda: ours_forward(params, K)), "sonicmoe": make(lambda: sonic_forward(params, K, stream))}
    per = interleaved_rounds(systems, args.rounds,
                             lambda fn, before: tb.time_all(fn, args.round_reps, args.round_warmup, device, before))
    zero_grads()
    return {"rounds": args.rounds, "reps": args.round_reps, "warmup": args.round_warmup,
            "order": "ours then SonicMoE on even rounds, the reverse on odd ones",
            "per_round_ms": per, "sonicmoe_over_ours": interleaved_summary(per)}


def agreement(sonic_fwd, params, dout, K):
    """How far SonicMoE and this library are apart at the same inputs (both bf16, neither a reference).
    SonicMoE's router takes top-K of bf16 logits (F.linear in bf16); ours of fp32 logits. Where two
    logits are closer than bf16 resolution the K-th expert can differ, which moves that token's output
    by O(its score). So we report the fraction of tokens whose expert sets differ, and the rel. L2 of
    out and dx over all tokens and over the tokens whose sets agree (the like-for-like comparison)."""
    import smoe_torch  # noqa: F401
    x, w_router = params[0], params[1]
    with torch.no_grad():
        idx32 = torch.topk(x.float() @ w_router.float().t(), K, dim=1).indices.sort(dim=1).values
        idx16 = torch.topk(torch.nn.functional.linear(x, w_router), K, dim=1).indices.sort(dim=1).values
        same = (idx32 == idx16).all(dim=1)
    outs = {}
    for name, f in (("sonic", sonic_fwd), ("ours", lambda: ours_forward(params, K))):
        for p in params:
            p.grad = None
        o = f()
        o.backward(dout)
        outs[name] = [o.detach()] + [p.grad for p in params]
        del o
    for p in params:
        p.grad = None
    s, o = outs["sonic"], outs["ours"]
    r = {"tokens_with_other_experts": float(1 - same.float().mean())}
    r.update({f"{k}_all_tokens": rel_l2(a, b) for k, a, b in zip(("out", "dx", "dw_router", "dw1", "dw2"), s, o)})
    r.update({f"{k}_same_experts": rel_l2(a, b, same) for k, a, b in zip(("out", "dx"), s[:2], o[:2])})
    return r


def run_system(fn, cfg, args, device):
    try:
        return fn(cfg, args, device)
    except Exception as e:  # noqa: BLE001  (OOM or anything else: record and go on)
        import traceback
        return {"error": f"{type(e).__name__}: {str(e)[:300]}", "traceback_tail": traceback.format_exc()[-2000:]}
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def plots(doc, outdir):
    results = doc["results"]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [r["config"]["name"] for r in results]
    systems = [("ours", "smoe (this library)", "#1f77b4"), ("torch_grouped_mm", "torch grouped_mm", "#ff7f0e"),
               ("sonicmoe", "SonicMoE", "#2ca02c")]
    x = range(len(names))
    w = 0.27
    fig, axes = plt.subplots(3, 1, figsize=(14, 11), sharex=True)
    for ax, key, title in zip(axes, ("fwd_tflops", "bwd_tflops", "total_tflops"),
                              ("forward", "backward", "forward + backward")):
        for i, (sk, label, color) in enumerate(systems):
            vals = [r["systems"].get(sk, {}).get(key) or 0 for r in results]
            bars = ax.bar([v + (i - 1) * w for v in x], vals, w, label=label, color=color)
            for b, v in zip(bars, vals):
                ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f}" if v else "n/a", ha="center", va="bottom",
                        fontsize=7, rotation=0 if v else 90)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{title} (FLOPs {'6' if key == 'fwd_tflops' else '12' if key == 'bwd_tflops' else '18'}TKdn)")
        ax.axhline(793, color="gray", ls=":", lw=1)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(loc="upper left")
    axes[-1].set_xticks(list(x))
    axes[-1].set_xticklabels(names, rotation=30, ha="right")
    fig.suptitle(f"MoE layer fwd+bwd, bf16, {doc['gpu']}, commit {doc['commit']} (dotted: dense bf16 GEMM "
                 "793 TFLOP/s; n/a: no number, the JSON says why)")
    fig.tight_layout()
    fig.savefig(os.path.join(outdir, "side_by_side_tflops.png"), dpi=110)
    fig, ax = plt.subplots(figsize=(14, 5))
    for i, (sk, label, color) in enumerate(systems):
        vals = [(r["systems"].get(sk, {}).get("held_bytes") or 0) / 1e9 for r in results]
        ax.bar([v + (i - 1) * w for v in x], vals, w, label=label, color=color)
    plan = [r["systems"]["ours"].get("plan_bytes", 0) / 1e9 if "plan_bytes" in r["systems"]["ours"] else 0
            for r in results]
    ax.scatter([v - w for v in x], plan, marker="_", s=300, color="black", label="plan 4TKn + O(TK)", zorder=3)
    ax.set_yscale("log")
    ax.set_ylabel("GB held between forward and backward (log)")
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    for i, (sk, _, _) in enumerate(systems):
        for xi, r in zip(x, results):
            if "held_bytes" not in r["systems"].get(sk, {}):
                ax.text(xi + (i - 1) * w, ax.get_ylim()[0] * 1.1, "n/a", ha="center", va="bottom", fontsize=7,
                        rotation=90)
    ax.set_title(f"activation memory kept for backward ({doc['gpu']}, commit {doc['commit']})")
    fig.tight_layout()
    fig.savefig(os.path.join(outdir, "side_by_side_memory.png"), dpi=110)


def table_md(doc, path):
    """The results as a markdown table (what bench/README.md quotes)."""
    def trip(r):
        return "n/a" if "error" in r else f"{r['fwd_tflops']:.0f} / {r['bwd_tflops']:.0f} / {r['total_tflops']:.0f}"

    def gb(r):
        return "n/a" if "error" in r else f"{r['held_bytes'] / 1e9:.2f}"

    lines = [f"Side by side on {doc['gpu']} (driver {doc['driver']}, torch {doc['torch']}), commit {doc['commit']}, "
             f"{doc['date']}. TFLOP/s fwd / bwd / total (6, 12, 18 TKdn); GB held between forward and backward.",
             "",
             "| config | ours | torch grouped_mm | SonicMoE | ours vs torch | ours vs SonicMoE | GB ours / torch / SonicMoE |",
             "|---|---|---|---|---|---|---|"]
    for e in doc["results"]:
        o, t, so = (e["systems"][k] for k in ("ours", "torch_grouped_mm", "sonicmoe"))
        vt = f"{e['speedup_vs_torch']:.2f}x" if "speedup_vs_torch" in e else "n/a"
        vs = f"{e['speedup_vs_sonicmoe']:.2f}x" if "speedup_vs_sonicmoe" in e else "n/a"
        lines.append(f"| {e['config']['name']} | {trip(o)} | {trip(t)} | {trip(so)} | {vt} | {vs} | "
                     f"{gb(o)} / {gb(t)} / {gb(so)} |")
    inter = [e for e in doc["results"] if "interleaved" in e and "error" not in e["interleaved"]]
    if inter:
        def span(v):
            return "n/a" if v["median"] is None else f"{v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f})"
        i0 = inter[0]["interleaved"]
        lines += ["", f"Ours against SonicMoE in alternating rounds on the same tensors ({i0['rounds']} rounds, "
                  f"{i0['order']}; blocks of {i0['warmup']} untimed and {i0['reps']} timed calls): SonicMoE's "
                  "time over ours (> 1: ours is faster), the median over the rounds (min-max).", "",
                  "| config | forward | backward | forward + backward |", "|---|---|---|---|"]
        for e in inter:
            r = e["interleaved"]["sonicmoe_over_ours"]
            lines.append(f"| {e['config']['name']} | {span(r['fwd'])} | {span(r['bwd'])} | {span(r['fwd_bwd'])} |")
    errs = [(e["config"]["name"], k, r["error"]) for e in doc["results"] for k, r in e["systems"].items()
            if "error" in r]
    errs += [(e["config"]["name"], "interleaved", e["interleaved"]["error"]) for e in doc["results"]
             if "error" in e.get("interleaved", {})]
    if errs:
        lines += ["", "n/a:"] + [f"- {n}, {k}: {msg}" for n, k, msg in errs]
    if "processes" in doc:  # merged from runs of config subsets (--merge)
        lines += ["", f"Merged: {doc['processes']}."]
    open(path, "w").write("\n".join(lines) + "\n")


def load_configs_files(spec):
    """The configs of one file or of several, comma-separated (e.g. the public configs, the sweep and the
    wide shapes in one run), in order; a name may appear once."""
    cfgs, seen = [], set()
    for path in (p.strip() for p in spec.split(",") if p.strip()):
        for c in json.load(open(path)):
            if c["name"] in seen:
                sys.exit(f"side_by_side.py: config {c['name']!r} is in more than one of {spec}")
            seen.add(c["name"])
            cfgs.append(c)
    return cfgs


def merge(paths, configs_file):
    """One results document from runs of config subsets: the same machine and software (gpu, driver,
    cuda, torch, commit must agree), results in the configs file's order, a config at most once."""
    docs = [json.load(open(p)) for p in paths]
    out = {k: v for k, v in docs[0].items() if k != "results"}
    for k in ("commit", "gpu", "driver", "cuda", "torch"):
        vals = {str(d.get(k)) for d in docs}
        if len(vals) > 1:
            sys.exit(f"side_by_side.py --merge: the files differ in {k}: {sorted(vals)}")
    order = [c["name"] for c in load_configs_files(configs_file)]
    results, seen = [], set()
    for d in docs:
        for r in d["results"]:
            name = r["config"]["name"]
            if name in seen:
                sys.exit(f"side_by_side.py --merge: {name} is in more than one file")
            seen.add(name)
            results.append(r)
    results.sort(key=lambda r: order.index(r["config"]["name"]) if r["config"]["name"] in order else len(order))
    out["results"] = results
    out["dates"] = sorted({d.get("date") for d in docs})
    out["processes"] = (f"{len(docs)} bench/drivers/side_by_side.py processes, each config's systems in one process: "
                        + "; ".join(" / ".join(r["config"]["name"] for r in d["results"]) for d in docs))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", help="comma-separated config names (default: all)")
    ap.add_argument("--configs-file", default=DEFAULT_CONFIGS,
                    help="a configs JSON, or several comma-separated (the public configs, the sweep, the wide shapes)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--counts", default="histc")
    ap.add_argument("--score-mul", default="fp32")
    ap.add_argument("--out", help="results JSON (required unless --replot)")
    ap.add_argument("--plots", help="folder for the PNG plots")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--systems", default="ours,torch,sonicmoe", help="which of ours,torch,sonicmoe to run")
    ap.add_argument("--rounds", type=int, default=4,
                    help="after the sequential measurement, ours and SonicMoE in this many alternating rounds "
                         "(round_order; 0: none)")
    ap.add_argument("--round-reps", type=int, default=10, help="timed calls per block of a round")
    ap.add_argument("--round-warmup", type=int, default=2, help="untimed calls before each block of a round")
    ap.add_argument("--replot", metavar="JSON", help="only redraw the plots of a results file (no GPU)")
    ap.add_argument("--merge", metavar="JSON", nargs="+",
                    help="merge results files of config subsets into --out (no GPU), in --configs-file order")
    args = ap.parse_args()
    if args.merge:
        if not args.out:
            ap.error("--merge needs --out")
        doc = merge(args.merge, args.configs_file)
        json.dump(doc, open(args.out, "w"), indent=1)
        table_md(doc, os.path.splitext(args.out)[0] + ".md")
        if args.plots:
            plots(doc, args.plots)
        return
    if args.replot:
        doc = json.load(open(args.replot))
        plots(doc, args.plots or os.path.dirname(os.path.abspath(args.replot)))
        table_md(doc, os.path.splitext(args.replot)[0] + ".md")
        return
    if not args.out:
        ap.error("--out is required")
    if torch is None:
        sys.exit(f"side_by_side.py: torch / torch_baseline do not import ({TORCH_REASON}); "
                 "only --replot and --merge run without them")
    if os.environ.get("SMOE_BENCH_STACKS"):  # debugging: dump every thread's stack every N seconds
        import faulthandler
        faulthandler.dump_traceback_later(int(os.environ["SMOE_BENCH_STACKS"]), repeat=True)
    device = torch.device("cuda")
    cfgs = load_configs_files(args.configs_file)
    if args.configs:
        want = set(args.configs.split(","))
        cfgs = [c for c in cfgs if c["name"] in want]
    from tqdm import tqdm
    results = []
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip().splitlines()[0]
    doc = {"commit": args.commit, "gpu": torch.cuda.get_device_name(), "driver": driver,
           "cuda": torch.version.cuda, "torch": torch.__version__,
           "date": subprocess.run(["date", "+%F"], capture_output=True, text=True).stdout.strip(),
           "results": results}
    bar = tqdm(cfgs, unit="cfg")
    for cfg in bar:
        bar.set_postfix_str(cfg["name"])
        conf = {k: cfg[k] for k in ("name", "T", "d", "n", "E", "K")}
        want = args.systems.split(",")
        skip = {"error": "not run (--systems)"}
        ours = run_system(bench_ours, cfg, args, device) if "ours" in want else skip
        torch_res = run_system(tb.bench_config, cfg, args, device) if "torch" in want else skip
        sonic = ({"error": SONIC_REASON} if SONIC_REASON else run_system(bench_sonic, cfg, args, device)) \
            if "sonicmoe" in want else skip
        entry = {"config": conf, "systems": {"ours": ours, "torch_grouped_mm": torch_res, "sonicmoe": sonic}}
        if "error" not in ours and "error" not in torch_res:
            entry["speedup_vs_torch"] = torch_res["fwd_bwd_ms"] / ours["fwd_bwd_ms"]
        if "error" not in ours and "error" not in sonic:
            entry["speedup_vs_sonicmoe"] = sonic["fwd_bwd_ms"] / ours["fwd_bwd_ms"]
            if args.rounds > 0:
                entry["interleaved"] = run_system(bench_interleaved, cfg, args, device)
        results.append(entry)
        json.dump(doc, open(args.out, "w"), indent=1)
    def trip(s):
        return "error" if "error" in s else f"{s['fwd_tflops']:.0f}/{s['bwd_tflops']:.0f}/{s['total_tflops']:.0f}"

    def gb(s):
        return "-" if "error" in s else f"{s['held_bytes'] / 1e9:.2f}"

    print(f"\n{'config':20s} {'TFLOP/s fwd/bwd/total:':>22s} {'ours':>12s} {'torch':>12s} {'sonicmoe':>12s}"
          f" {'x torch':>8s} {'x sonic':>8s}   GB held: ours / torch / sonic")
    for r in results:
        o, t, so = (r["systems"][k] for k in ("ours", "torch_grouped_mm", "sonicmoe"))
        sp = f"{r['speedup_vs_torch']:.2f}" if "speedup_vs_torch" in r else "-"
        ss = f"{r['speedup_vs_sonicmoe']:.2f}" if "speedup_vs_sonicmoe" in r else "-"
        inter = r.get("interleaved", {}).get("sonicmoe_over_ours", {}).get("fwd_bwd", {}).get("median")
        si = f"  (alternating rounds: x{inter:.3f})" if inter is not None else ""
        print(f"{r['config']['name']:20s} {'':>22s} {trip(o):>12s} {trip(t):>12s} {trip(so):>12s} {sp:>8s} {ss:>8s}"
              f"   {gb(o)} / {gb(t)} / {gb(so)}{si}")
    if SONIC_REASON:
        print("sonicmoe:", SONIC_REASON)
    table_md(doc, os.path.splitext(args.out)[0] + ".md")
    if args.plots:
        plots(doc, args.plots)


if __name__ == "__main__":
    main()
