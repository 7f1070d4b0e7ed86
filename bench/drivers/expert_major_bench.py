#!/usr/bin/env python3
"""The expert-major layer (smoe_torch.expert_major) against what a user would otherwise run, one H200.

Per config (bench/configs/configs.json; routing: top-K of a softmax router over torch_baseline's
inputs, fixed seed, or --routing uniform), on the same R = T*K rows (expert-major rows = the
token-major (token, slot) pairs sorted by expert, x_em = x[token_of_row], probs = scores[order]):
  smoe_em_concat          expert_major, w1 [E,2n,d] concatenated (Megatron fc1 / transformers), probs
  smoe_em_separate        expert_major, torchtitan's w1 (gate) / w3 (up) [E,n,d], no probs (torchtitan
                          applies its scores outside the experts)
  smoe_em_separate_probs  the same with probs
  torch_grouped_mm        torchtitan's GroupedExperts: two torch._grouped_mm (gate, up), silu(g)*u,
                          * probs, grouped_mm down (torch_baseline's pattern without routing/gather)
  smoe_token_major        smoe_torch.moe_routed on the same [T,K] ids / scores: its own gather and
                          aggregation included (what the expert-major path costs relative to it)
  smoe_em_capacity        smoe_em_concat on a segmented layout: each expert's segment rounded up to
                          a multiple of --align rows; x / probs / dout hold NaN in the padding rows
Before timing, each system runs one forward + backward whose output and gradients (x, weights,
probs) are compared by relative L2 with smoe_em_concat's and (the output) with the float32 twin
smoe_torch.expert_major_ref on the rows of the first experts; > 2e-2, a non-finite value or a
non-zero padding row fails that system loudly (no timing, exit status 1). Timing and memory are
torch_baseline.measure (CUDA events, warm-up, median); FLOPs 6*R*d*n forward, 18*R*d*n forward +
backward. peak_bytes = max_memory_allocated over one fwd+bwd less what was allocated before it.

Usage (on the GPU, after `pip install --no-build-isolation .`):
  python3 bench/drivers/expert_major_bench.py --out $OUT/em_bench.json --md $OUT/em_bench.md --commit <hash>
  python3 bench/drivers/expert_major_bench.py --configs OLMoE-7B --systems smoe_em_concat,torch_grouped_mm
  python3 bench/drivers/expert_major_bench.py --cpu-smoke   # harness logic on the CPU, tiny shape
"""
import argparse
import gc
import importlib.util
import json
import math
import os
import shlex
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, os.path.join(BENCH, "baselines"))
import torch_baseline as tb  # noqa: E402

SYSTEMS = ("smoe_em_concat", "smoe_em_separate", "smoe_em_separate_probs", "torch_grouped_mm",
           "smoe_token_major", "smoe_em_capacity")
TOL = 2e-2
SMOKE_CFG = {"name": "cpu-smoke", "T": 40, "d": 64, "n": 32, "E": 6, "K": 2}


def load_layer(gpu):
    """(expert_major module, smoe_torch package or None). On the CPU the extension is not built, so the
    module is loaded from its file (as tests/python/test_expert_major.py does): expert_major_ref and
    saved_state_bytes are plain torch / arithmetic."""
    if gpu:
        import smoe_torch  # registers torch.ops.smoe.*
        return sys.modules["smoe_torch.expert_major"], smoe_torch  # smoe_torch.expert_major is the function
    if "smoe_torch.expert_major" in sys.modules:
        # The extension is already imported (a pytest session on a GPU machine): a second copy of the
        # file would register the ops' fake kernels again, which torch refuses.
        return sys.modules["smoe_torch.expert_major"], None
    spec = importlib.util.spec_from_file_location(
        "smoe_em_bench_file", os.path.join(ROOT, "python", "smoe_torch", "expert_major.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod, None


def rel_l2(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------------
# inputs: one problem per config, shared by every system (allocated once, freed after the config)
# ------------------------------------------------------------------------------------------------
def build_problem(cfg, args, device):
    T, d, n, E, K = (int(cfg[k]) for k in ("T", "d", "n", "E", "K"))
    # torch_baseline's inputs (same seed, same values): x [T,d], router, gate w1 / up w3 [E,n,d],
    # w2 [E,d,n], dout [T,d]; all leaves require grad.
    x_tm, wr, gate, up, w2, dout_tm = tb.make_inputs(T, d, n, E, device, seed=args.seed)
    with torch.no_grad():
        if args.routing == "softmax":  # torch_baseline's router: top-K of the bf16 logits, softmax over K
            top_vals, top_idx = (x_tm @ wr.t()).float().topk(K, dim=-1)
            scores = torch.softmax(top_vals, dim=-1)
        else:  # uniform random top-K without repeats
            g = torch.Generator(device=device).manual_seed(args.seed + 1)
            top_idx = torch.rand(T, E, generator=g, device=device).topk(K, dim=-1).indices
            scores = torch.softmax(torch.randn(T, K, generator=g, device=device), dim=-1)
        del wr
        # dispatch: row r of the expert-major input is (token, slot) pair order[r] (stable: tokens
        # ascending within an expert, as torchtitan's / Megatron's permutation)
        flat_e = top_idx.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        token_of_row = order // K
        counts = torch.bincount(flat_e, minlength=E).to(torch.int32)
        R = T * K
        # capacity layout: segment e = [seg_off[e], seg_off[e+1]), counts[e] rounded up to --align;
        # valid row r of expert e goes to dest[r] = seg_off[e] + (r - begin(e)); the rest is padding
        c64 = counts.long()
        seg_off = torch.zeros(E + 1, dtype=torch.long, device=device)
        seg_off[1:] = torch.cumsum((c64 + args.align - 1) // args.align * args.align, 0)
        expert_of_row = torch.repeat_interleave(torch.arange(E, device=device), c64)
        begin = torch.cumsum(c64, 0) - c64
        dest = seg_off[expert_of_row] + torch.arange(R, device=device) - begin[expert_of_row]
        R_pad = int(seg_off[-1])
        pad_mask = torch.ones(R_pad, dtype=torch.bool, device=device)
        pad_mask[dest] = False
        # the twin's rows: the first experts' rows (contiguous from 0), at least min(R, 2048) of them,
        # so whole GEMM tiles of real experts are checked without an fp32 copy of every weight
        cum = torch.cumsum(c64, 0).tolist()
        Es = next((e + 1 for e, c in enumerate(cum) if c >= min(R, 2048)), E)
        P = SimpleNamespace(
            T=T, d=d, n=n, E=E, K=K, R=R, R_pad=R_pad, counts=counts, order=order,
            token_of_row=token_of_row, expert=top_idx.to(torch.int32), dest=dest, pad_mask=pad_mask,
            seg_off=seg_off.to(torch.int32), twin_experts=Es, twin_rows=cum[Es - 1],
            x_tm=x_tm, dout_tm=dout_tm, gate=gate, up=up, w2=w2,
            scores=scores.detach().requires_grad_(True),
            x_em=x_tm.detach()[token_of_row].requires_grad_(True),
            probs=scores.reshape(-1)[order].detach().requires_grad_(True),
            dout_em=dout_tm[token_of_row].contiguous(),
            # concatenated gate / up [E,2n,d]: a copy made once (Megatron / transformers store it so)
            w1cat=torch.cat((gate.detach(), up.detach()), 1).requires_grad_(True))
    return P


def agg(rows, P):
    """Per-row [R,d] -> per-token [T,d] sums in fp32 (the token-major aggregation, for comparisons)."""
    return torch.zeros(P.T, rows.shape[1], dtype=torch.float32, device=rows.device).index_add_(
        0, P.token_of_row, rows.float())


def padded(t, P):
    """t [R,...] placed at the capacity layout's valid rows; NaN in the padding rows (never read)."""
    out = t.new_full((P.R_pad,) + tuple(t.shape[1:]), float("nan"))
    out[P.dest] = t
    return out


# ------------------------------------------------------------------------------------------------
# systems: fwd() -> output, the leaves whose gradients it makes, its dout, and canon(out): output and
# gradients in the common space of smoe_em_concat (expert-major rows, or token space for token-major)
# ------------------------------------------------------------------------------------------------
def grouped_mm(a, b, offs):
    return tb.grouped_mm(a, b, offs)  # torch._grouped_mm on CUDA; a per-expert loop on CPU if needed


def make_system(name, P, em, smoe):
    layer = em.expert_major if smoe is not None else em.expert_major_ref  # CPU: the twin stands in
    n = P.n
    S = SimpleNamespace(dout=P.dout_em, extra=lambda out: {}, saved_bytes=None)
    if name in ("smoe_em_concat", "smoe_em_capacity"):
        wts = [P.w1cat, P.w2]
        wgrads = lambda: {"dgate": P.w1cat.grad[:, :n], "dup": P.w1cat.grad[:, n:], "dw2": P.w2.grad}  # noqa: E731
    else:
        wts = [P.gate, P.up, P.w2]
        wgrads = lambda: {"dgate": P.gate.grad, "dup": P.up.grad, "dw2": P.w2.grad}  # noqa: E731
    if name == "smoe_em_concat":
        S.params = [P.x_em, P.probs] + wts
        S.fwd = lambda: layer(P.x_em, P.counts, P.w1cat, P.w2, probs=P.probs, gate_up="concatenated")
        S.canon = lambda out: {"out_rows": out, "dx_rows": P.x_em.grad, "dprobs": P.probs.grad, **wgrads()}
        S.saved_bytes = em.saved_state_bytes(P.R, n, P.E)
    elif name == "smoe_em_separate":
        # no probs: out[r] / p[r] of the probs system. With dout * p the gradients of x and of the
        # weights are the probs system's (p y = W2 (p a)), so they compare with smoe_em_concat's.
        S.params = [P.x_em] + wts
        S.dout = (P.dout_em.float() * P.probs.detach()[:, None]).to(P.dout_em.dtype)
        S.fwd = lambda: layer(P.x_em, P.counts, P.gate, P.w2, P.up)
        S.canon = lambda out: {"out_rows": out.float() * P.probs.detach()[:, None], "dx_rows": P.x_em.grad,
                               **wgrads()}
        S.saved_bytes = em.saved_state_bytes(P.R, n, P.E)
    elif name == "smoe_em_separate_probs":
        S.params = [P.x_em, P.probs] + wts
        S.fwd = lambda: layer(P.x_em, P.counts, P.gate, P.w2, P.up, probs=P.probs)
        S.canon = lambda out: {"out_rows": out, "dx_rows": P.x_em.grad, "dprobs": P.probs.grad, **wgrads()}
        S.saved_bytes = em.saved_state_bytes(P.R, n, P.E)
    elif name == "torch_grouped_mm":
        def fwd():  # torchtitan GroupedExperts (offsets made inside, as it does); probs Megatron's way
            offs = torch.cumsum(P.counts, 0, dtype=torch.int32)
            g = grouped_mm(P.x_em, P.gate.transpose(-2, -1), offs)
            u = grouped_mm(P.x_em, P.up.transpose(-2, -1), offs)
            h = (F.silu(g) * u * P.probs[:, None]).to(P.x_em.dtype)  # fp32 product, bf16 operand
            return grouped_mm(h, P.w2.transpose(-2, -1), offs)
        S.params = [P.x_em, P.probs] + wts
        S.fwd = fwd
        S.canon = lambda out: {"out_rows": out, "dx_rows": P.x_em.grad, "dprobs": P.probs.grad, **wgrads()}
    elif name == "smoe_token_major":
        if smoe is not None:
            S.fwd = lambda: smoe.moe_routed(P.x_tm, P.gate, P.w2, P.expert, P.scores, validate=False, w3=P.up)
            with torch.no_grad():
                S.saved_bytes = int(torch.ops.smoe.moe_forward_routed(
                    P.x_tm, P.gate, P.w2, P.expert, P.scores, P.up)[1].numel())
        else:  # CPU stand-in with the same gather / aggregation maps (exercises them, not the op)
            def fwd():
                y = layer(P.x_tm[P.token_of_row], P.counts, P.gate, P.w2, P.up,
                          probs=P.scores.reshape(-1)[P.order])
                return agg(y, P).to(P.x_tm.dtype)
            S.fwd = fwd
        S.params = [P.x_tm, P.scores] + wts
        S.dout = P.dout_tm
        S.canon = lambda out: {"out_tok": out, "dx_tok": P.x_tm.grad,
                               "dprobs": P.scores.grad.reshape(-1)[P.order], **wgrads()}
    elif name == "smoe_em_capacity":
        x_pad = padded(P.x_em.detach(), P).requires_grad_(True)
        p_pad = padded(P.probs.detach(), P).requires_grad_(True)
        S.dout = padded(P.dout_em, P)
        S.params = [x_pad, p_pad] + wts
        S.fwd = lambda: layer(x_pad, P.counts, P.w1cat, P.w2, probs=p_pad, segment_offset=P.seg_off,
                              gate_up="concatenated")
        S.canon = lambda out: {"out_rows": out[P.dest], "dx_rows": x_pad.grad[P.dest],
                               "dprobs": p_pad.grad[P.dest], **wgrads()}

        def extra(out):  # the contract: zero output, dx and dprobs on every padding row
            m = P.pad_mask
            v = max(float(t.detach()[m].float().abs().max()) if int(m.sum()) else 0.0
                    for t in (out, x_pad.grad, p_pad.grad))
            return {"padding_rows": int(m.sum()), "padding_max_abs": v}
        S.extra = extra
        S.saved_bytes = em.saved_state_bytes(P.R_pad, n, P.E)
    else:
        raise ValueError(f"unknown system {name!r} (known: {', '.join(SYSTEMS)})")
    return S


def clear_grads(params):
    for p in params:
        p.grad = None


def check_pass(S):
    """One forward + backward; the system's output and gradients in the common space (detached; the
    leaves' .grad are reset so the next system starts from None and cannot accumulate into these)."""
    clear_grads(S.params)
    out = S.fwd()
    out.backward(S.dout)
    canon = {k: v.detach() for k, v in S.canon(out).items()}
    extra = S.extra(out)
    clear_grads(S.params)
    return canon, extra


def compare(canon, extra, ref, twin, P):
    """{check: value} and the list of failures (rel L2 > TOL, non-finite, non-zero padding)."""
    checks, bad = {}, []
    for k, v in canon.items():
        if not bool(torch.isfinite(v.float()).all()):
            bad.append(f"{k}: non-finite values")
    if twin is not None and "out_rows" in canon:
        checks["out_vs_fp32_twin"] = rel_l2(canon["out_rows"][:P.twin_rows], twin)
    for k, v in canon.items():
        if ref is not None and k in ref:
            checks[f"{k}_vs_concat"] = rel_l2(v, ref[k])
    bad += [f"{k} = {v:.3e} > {TOL:g}" for k, v in checks.items() if not v <= TOL]
    if not checks:  # no reference and no twin rows: an unchecked number is not reported
        bad.append("nothing to compare against (the smoe_em_concat reference failed)")
    checks = {k: (v if math.isfinite(v) else None) for k, v in checks.items()}  # strict JSON: no NaN
    checks.update(extra)
    if extra.get("padding_max_abs", 0.0) != 0.0:
        bad.append(f"padding rows not zero (max |.| = {extra['padding_max_abs']:g})")
    return checks, bad


# ------------------------------------------------------------------------------------------------
# one config: check every system, then time the ones that are right
# ------------------------------------------------------------------------------------------------
def bench_config(cfg, systems, args, device, em, smoe):
    P = build_problem(cfg, args, device)
    F_ = float(P.R) * P.d * P.n
    entry = {k: cfg[k] for k in ("name", "T", "d", "n", "E", "K")}
    entry.update({"R": P.R, "R_capacity": P.R_pad, "systems": {}})
    with torch.no_grad():  # the float32 twin on the first experts' rows (math fp32, output fp32)
        Es, rows = P.twin_experts, P.twin_rows
        twin = em.expert_major_ref(P.x_em[:rows].float(), P.counts[:Es], P.gate[:Es], P.w2[:Es], P.up[:Es],
                                   probs=P.probs[:rows])
    ref = None
    try:  # the reference: smoe_em_concat's output and gradients (checked against the twin itself)
        ref, _ = check_pass(make_system("smoe_em_concat", P, em, smoe))
        ref["out_tok"], ref["dx_tok"] = agg(ref["out_rows"], P), agg(ref["dx_rows"], P)
    except Exception as e:  # noqa: BLE001  (then only the twin is compared against)
        print(f"  {cfg['name']}: no smoe_em_concat reference ({type(e).__name__}: {e})", file=sys.stderr)
    failed = []
    for name in systems:
        res, S = {}, None
        try:
            S = make_system(name, P, em, smoe)
            canon, extra = check_pass(S)
            checks, bad = compare(canon, extra, ref, twin, P)
            del canon
            errs = [v for k, v in checks.items() if k.endswith(("_twin", "_concat"))]
            res.update({"rel_l2": max(errs) if errs and None not in errs else None, "checks": checks,
                        "saved_state_bytes": S.saved_bytes})
            if bad:
                res["error"] = "correctness: " + "; ".join(bad)
                failed.append(f"{cfg['name']} / {name}: {res['error']}")
                print(f"  !!! CORRECTNESS FAILURE {cfg['name']} / {name}: {'; '.join(bad)}", file=sys.stderr)
            else:
                r = tb.measure(S.fwd, S.params, S.dout, cfg, args, device)
                base = r.get("base_bytes")
                res.update({"fwd_ms": r["fwd_ms"], "fwdbwd_ms": r["fwd_bwd_ms"],
                            "fwd_tflops": 6 * F_ / (r["fwd_ms"] * 1e-3) / 1e12,
                            "fwdbwd_tflops": 18 * F_ / (r["fwd_bwd_ms"] * 1e-3) / 1e12,
                            "peak_bytes": None if base is None else r["peak_bytes"] - base,
                            "held_bytes": r["held_bytes"]})
        except Exception as e:  # noqa: BLE001  (an OOM, a shape the system refuses: record, go on)
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            res["error"] = f"{type(e).__name__}: {msg}"
            print(f"  {cfg['name']} / {name}: {res['error']}", file=sys.stderr)
        if S is not None:
            clear_grads(S.params)
        del S
        entry["systems"][name] = res
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        v = res.get("fwdbwd_ms")
        print(f"  {name:24s} " + (f"fwd {res['fwd_ms']:8.3f} ms  fwd+bwd {v:8.3f} ms  "
                                   f"{res['fwdbwd_tflops']:6.1f} TF/s  rel_l2 {res['rel_l2']:.2e}"
                                   if v is not None else f"error: {res.get('error')}"), flush=True)
    del P, ref, twin
    return entry, failed


# ------------------------------------------------------------------------------------------------
# reporting
# ------------------------------------------------------------------------------------------------
def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "-"


def markdown(doc):
    f = lambda v, s: "-" if v is None else format(v, s)  # noqa: E731
    gb = lambda b: None if b is None else b / 1e9  # noqa: E731
    L = [f"# expert-major layer vs baselines: {doc['device']}, commit {doc['commit']}, {doc['date']}", "",
         f"`{doc['command']}`", "",
         "FLOPs 6*R*d*n forward, 18*R*d*n forward+backward (R = T*K rows); median of "
         f"{doc['reps']} after {doc['warmup']} warm-up; peak GB = max_memory_allocated over one fwd+bwd "
         "less what was allocated before it (1e9 B); rel L2 = the worst of the output / gradient checks.", "",
         "| config | system | fwd ms | fwd+bwd ms | fwd TF/s | fwd+bwd TF/s | peak GB | saved GB | rel L2 |",
         "|---|---|---|---|---|---|---|---|---|"]
    for c in doc["configs"]:
        if "skipped" in c or "error" in c:
            L.append(f"| {c['name']} | {c.get('skipped') or c.get('error')} | | | | | | | |")
            continue
        for s, m in c["systems"].items():
            if m.get("fwd_ms") is None:
                L.append(f"| {c['name']} | {s} | {(m.get('error') or '')[:90]} | | | | | | {f(m.get('rel_l2'), '.1e')} |")
                continue
            L.append(f"| {c['name']} | {s} | {m['fwd_ms']:.3f} | {m['fwdbwd_ms']:.3f} | {m['fwd_tflops']:.0f} | "
                     f"{m['fwdbwd_tflops']:.0f} | {f(gb(m['peak_bytes']), '.2f')} | "
                     f"{f(gb(m['saved_state_bytes']), '.2f')} | {f(m['rel_l2'], '.1e')} |")
    L += ["", "Speedups (time of the other / time of smoe_em_concat; capacity: its time / compact's):", "",
          "| config | vs torch_grouped_mm fwd | vs torch_grouped_mm fwd+bwd | vs smoe_token_major fwd+bwd | "
          "capacity / compact fwd+bwd |", "|---|---|---|---|---|"]
    for c in doc["configs"]:
        s = c.get("systems", {})
        g = lambda sys_, k: s.get(sys_, {}).get(k)  # noqa: E731
        if s:
            L.append(f"| {c['name']} | {ratio(g('torch_grouped_mm', 'fwd_ms'), g('smoe_em_concat', 'fwd_ms'))} | "
                     f"{ratio(g('torch_grouped_mm', 'fwdbwd_ms'), g('smoe_em_concat', 'fwdbwd_ms'))} | "
                     f"{ratio(g('smoe_token_major', 'fwdbwd_ms'), g('smoe_em_concat', 'fwdbwd_ms'))} | "
                     f"{ratio(g('smoe_em_capacity', 'fwdbwd_ms'), g('smoe_em_concat', 'fwdbwd_ms'))} |")
    return "\n".join(L) + "\n"


def kernel_seconds(entry, args):
    """Seconds of a config's timed runs (measure: warm-up + reps of fwd and of fwd+bwd, one more fwd+bwd
    for the memory; plus the check pass): what grows with its FLOPs."""
    return sum(((args.warmup + args.reps) * (m["fwd_ms"] + m["fwdbwd_ms"]) + 2 * m["fwdbwd_ms"]) / 1e3
               for m in entry.get("systems", {}).values() if m.get("fwd_ms") is not None)


def write(doc, args):
    for path, text in ((args.out, lambda: json.dumps(doc, indent=1) + "\n"), (args.md, lambda: markdown(doc))):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
            with open(path + ".tmp", "w") as fh:
                fh.write(text())
            os.replace(path + ".tmp", path)  # rewritten after every config: a cut-short run keeps its part


def main(argv=None):
    t0 = time.time()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", help="comma-separated config names (default: all of --configs-file)")
    ap.add_argument("--configs-file", default=tb.DEFAULT_CONFIGS)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--routing", choices=("softmax", "uniform"), default="softmax")
    ap.add_argument("--align", type=int, default=128, help="capacity case: segments rounded up to this many rows")
    ap.add_argument("--out", help="results JSON")
    ap.add_argument("--md", help="markdown table")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--device-name", help="default: torch.cuda.get_device_name()")
    ap.add_argument("--max-seconds", type=float, default=240.0,
                    help="skip configs whose estimated time would run past this (the device call has a hard limit)")
    ap.add_argument("--cpu-smoke", action="store_true", help="harness logic on the CPU at a tiny shape")
    args = ap.parse_args(argv)
    args.shape = None  # tb.load_configs' option, not offered here
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        sys.exit(f"unknown system(s) {unknown}; known: {', '.join(SYSTEMS)}")
    if args.cpu_smoke:
        device, cfgs = torch.device("cpu"), [dict(SMOKE_CFG)]
        args.reps, args.warmup = min(args.reps, 2), min(args.warmup, 1)
    else:
        if not torch.cuda.is_available():
            sys.exit("CUDA is not available (use --cpu-smoke for the harness logic)")
        device = torch.device("cuda", torch.cuda.current_device())
        cfgs = tb.load_configs(args)
    em, smoe = load_layer(device.type == "cuda")
    doc = {"commit": args.commit, "device": args.device_name or (
               torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": shlex.join(
               ["python3", os.path.relpath(os.path.abspath(__file__), ROOT)] + (sys.argv[1:] if argv is None else argv)),
           "torch": torch.__version__, "reps": args.reps, "warmup": args.warmup, "routing": args.routing,
           "align": args.align, "tolerance": TOL, "configs": []}
    failures, kernel_s, work_done, overhead = [], 0.0, 0.0, 0.0
    for cfg in cfgs:
        work = float(cfg["T"]) * cfg["K"] * cfg["d"] * cfg["n"]
        # the time budget: the timed kernels scale with the FLOPs at the rate seen so far; the rest of a
        # config (inputs, checks, first calls) as the last config's (the first one's has the one-time init)
        est = 1.2 * kernel_s / work_done * work + overhead if work_done else 0.0
        if work_done and time.time() - t0 + est > args.max_seconds:
            print(f"{cfg['name']}: skipped (estimated {est:.0f} s past --max-seconds {args.max_seconds:g})", flush=True)
            doc["configs"].append({**{k: cfg[k] for k in ("name", "T", "d", "n", "E", "K")},
                                   "skipped": f"time budget (estimated {est:.0f} s)"})
            continue
        print(f"{cfg['name']}  T={cfg['T']} d={cfg['d']} n={cfg['n']} E={cfg['E']} K={cfg['K']}", flush=True)
        tc = time.time()
        try:
            entry, failed = bench_config(cfg, systems, args, device, em, smoe)
            failures += failed
        except Exception as e:  # noqa: BLE001  (the inputs themselves did not fit, say)
            entry = {**{k: cfg[k] for k in ("name", "T", "d", "n", "E", "K")},
                     "error": f"{type(e).__name__}: {str(e).strip()[:300]}"}
            print(f"  {entry['error']}", file=sys.stderr)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        wall, ks = time.time() - tc, kernel_seconds(entry, args)
        kernel_s, work_done, overhead = kernel_s + ks, work_done + work, max(wall - ks, 0.0)
        entry["seconds"] = round(wall, 2)
        doc["configs"].append(entry)
        write(doc, args)
    write(doc, args)
    print(markdown(doc))
    if failures:
        print("\n!!! CORRECTNESS FAILURES (these systems were not timed):\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
