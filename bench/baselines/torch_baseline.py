#!/usr/bin/env python3
"""PyTorch baseline for the MoE layer: the torchtitan pattern on torch._grouped_mm (bf16).

For each config of bench/configs/configs.json (or those named with --configs), times on one GPU:

  router   logits = x @ w_router.T                      (bf16, w_router [E, d])
           top_vals, top_idx = logits.float().topk(K)   (fp32)
           scores = softmax(top_vals)                   (fp32, softmax over the K picked only)
  permute  flat_e = top_idx.view(-1); order = argsort(flat_e, stable=True); token_idx = order // K
           counts = bincount(flat_e, minlength=E); offs = cumsum(counts).int32
  experts  x_g = x[token_idx]
           h = silu(grouped_mm(x_g, w1^T)) * grouped_mm(x_g, w3^T)    w1, w3 [E, n, d] (torchtitan)
           y = grouped_mm(h, w2^T)                                    w2 [E, d, n]
  combine  y = (y.float() * scores.view(-1)[order, None]).to(bf16)   (as torchtitan does)
           out = zeros(T, d).index_add_(0, token_idx, y)

x and all weights require grad; backward is out.backward(dout).  Conventions (FLOPs, timing,
memory) are those of shared/bench/README.md:
  - FLOPs: forward 6*T*K*d*n, backward 12*T*K*d*n; the router GEMM is timed but not counted.
  - time: CUDA events, warm-up first, median over --reps repetitions; bwd = (fwd+bwd) - fwd.
  - held_bytes: memory_allocated() after forward minus before, less the output tensor.
  - peak_bytes: max_memory_allocated() over one fwd+bwd (absolute: includes the inputs, weights,
    dout and the gradients; base_bytes is what was allocated before that fwd+bwd).

torch._grouped_mm requirements (bf16, 2D x 3D with offs), as checked by ATen (Blas.cpp /
_meta_registrations.py): both operands bf16; offs a 1-D int32 tensor of E cumulative row ends
(non-decreasing, so empty experts are fine); every operand's leading stride (row-major or
column-major) must be a multiple of 16 bytes, i.e. d and n multiples of 8 for bf16.  The number of
rows per expert does NOT need any alignment, so counts are NOT padded here (torchtitan pads them
to 8/16 only for its fp8/mxfp8 paths).  The grad fed into _grouped_mm's backward must have real
strides (an expanded grad such as that of .sum() is refused), which out.backward(dout) satisfies.

Notes:
  - torch.bincount on CUDA syncs with the host (it reads max(input) to size its output), so the
    forward contains one device->host sync, as torchtitan-style code with bincount does.
    --counts histc uses torch.histc(min=0, max=E) instead (what torchtitan itself uses; no sync).
  - --device cpu exists only to test the script's logic on a machine without a GPU (timing then
    uses perf_counter and there is no memory accounting).  On CPU, if torch._grouped_mm cannot
    run, a loop over experts with plain matmuls replaces it; on CUDA torch._grouped_mm is always
    the one used.

Usage:
  python3 bench/baselines/torch_baseline.py --out torch.json  (merged into bench/results/h200/layer_torch.json by bench/reports/merge_results.py)
  python3 bench/baselines/torch_baseline.py --configs "OLMoE-7B,Qwen3-235B" --reps 50 --warmup 10 --out t.json
  python3 bench/baselines/torch_baseline.py --check                 # correctness vs a per-token fp32 loop
  python3 bench/baselines/torch_baseline.py --device cpu --shape 256,128,64,8,2 --reps 3 --warmup 1
"""

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

try:
    from tqdm import tqdm
except ImportError:  # progress bar is a nicety only
    def tqdm(it, **_kw):
        return it

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIGS = os.path.join(os.path.dirname(HERE), "configs", "configs.json")
CONFIG_KEYS = ("name", "T", "d", "n", "E", "K")
SYSTEM = "torch_grouped_mm"


# --------------------------------------------------------------------------------------------
# grouped GEMM
# --------------------------------------------------------------------------------------------
def _grouped_mm_loop(a, b, offs):
    """CPU-only stand-in for torch._grouped_mm(a [M,k], b [E,k,N], offs): one matmul per expert."""
    ends = offs.tolist()
    outs, start = [], 0
    for e, end in enumerate(ends):
        outs.append(a[start:end] @ b[e])
        start = end
    return torch.cat(outs, 0)


_CPU_GMM_WORKS = None


def grouped_mm(a, b, offs):
    global _CPU_GMM_WORKS
    if a.is_cuda:
        return torch._grouped_mm(a, b, offs=offs)
    if _CPU_GMM_WORKS is None:
        try:
            t = torch._grouped_mm(
                torch.ones(4, 8, dtype=torch.bfloat16),
                torch.ones(2, 8, 8, dtype=torch.bfloat16),
                offs=torch.tensor([1, 4], dtype=torch.int32))
            _CPU_GMM_WORKS = tuple(t.shape) == (4, 8)
        except Exception:
            _CPU_GMM_WORKS = False
        if not _CPU_GMM_WORKS:
            print("note: torch._grouped_mm does not run on CPU here; using a per-expert loop",
                  file=sys.stderr)
    if _CPU_GMM_WORKS:
        return torch._grouped_mm(a, b, offs=offs)
    return _grouped_mm_loop(a, b, offs)


# --------------------------------------------------------------------------------------------
# the layer (torchtitan pattern)
# --------------------------------------------------------------------------------------------
def moe_forward(x, w_router, w1, w3, w2, K, counts_mode="bincount", score_mul="fp32"):
    T, d = x.shape
    E = w_router.shape[0]
    # router (bf16 GEMM; timed, not counted in FLOPs)
    logits = x @ w_router.t()                                   # [T, E] bf16
    top_vals, top_idx = logits.float().topk(K, dim=-1)          # fp32 [T, K], int64 [T, K]
    scores = torch.softmax(top_vals, dim=-1)                    # fp32 [T, K]
    # sort the T*K (token, expert) pairs by expert
    flat_e = top_idx.view(-1)
    order = torch.argsort(flat_e, stable=True)
    token_idx = order // K
    if counts_mode == "bincount":
        counts = torch.bincount(flat_e, minlength=E)            # host sync on CUDA
    else:
        counts = torch.histc(flat_e.float(), bins=E, min=0, max=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)              # _grouped_mm wants int32 ends
    # experts: SwiGLU with grouped GEMMs, w1/w3 [E, n, d], w2 [E, d, n]
    x_g = x[token_idx]                                          # [T*K, d]
    h = F.silu(grouped_mm(x_g, w1.transpose(-2, -1), offs)) * \
        grouped_mm(x_g, w3.transpose(-2, -1), offs)             # [T*K, n]
    y = grouped_mm(h, w2.transpose(-2, -1), offs)               # [T*K, d]
    # weight by the routing scores and scatter back to the tokens
    s = scores.view(-1)[order].unsqueeze(-1)                    # fp32 [T*K, 1]
    if score_mul == "fp32":
        y = (y.float() * s).to(x.dtype)                         # what torchtitan does
    else:
        y = y * s.to(x.dtype)
    out = torch.zeros(T, d, dtype=x.dtype, device=x.device).index_add_(0, token_idx, y)
    return out


def make_inputs(T, d, n, E, device, seed=0, router_std=0.02, weight_std=0.02):
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    bf16 = torch.bfloat16

    def randn(*shape, std=1.0):
        t = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
        return (t * std).to(bf16).requires_grad_(True)

    x = randn(T, d)
    w_router = randn(E, d, std=router_std)
    w1 = randn(E, n, d, std=weight_std)
    w3 = randn(E, n, d, std=weight_std)
    w2 = randn(E, d, n, std=weight_std)
    dout = randn(T, d).detach()
    return x, w_router, w1, w3, w2, dout


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_all(fn, reps, warmup, device, before=None):
    """Every timed call of fn() in ms, in order (warmup calls first, untimed).  before() runs outside
    the timed region of every call."""
    for _ in range(warmup):
        if before:
            before()
        fn()
    sync(device)
    times = []
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            if before:
                before()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        for _ in range(reps):
            if before:
                before()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def time_ms(fn, reps, warmup, device, before=None):
    """Median, min and max time of fn() in ms (time_all)."""
    times = time_all(fn, reps, warmup, device, before)
    return statistics.median(times), min(times), max(times)


def measure(fwd, params, dout, cfg, args, device):
    """Time fwd() and fwd().backward(dout) (median, see time_ms; grads of params cleared before each
    call), then, on CUDA, the bytes held between forward and backward: memory_allocated after the
    forward, less before, less the output itself. The one measurement every system here goes through."""
    T, d, n, K = (int(cfg[k]) for k in ("T", "d", "n", "K"))

    def zero_grads():
        for p in params:
            p.grad = None

    def fwd_bwd():
        fwd().backward(dout)

    fwd_ms, fwd_min, fwd_max = time_ms(fwd, args.reps, args.warmup, device)
    tot_ms, tot_min, tot_max = time_ms(fwd_bwd, args.reps, args.warmup, device, before=zero_grads)
    bwd_ms = tot_ms - fwd_ms

    res_mem = {"held_bytes": None, "peak_bytes": None, "base_bytes": None}
    if device.type == "cuda":
        zero_grads()
        gc.collect()
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = fwd()
        sync(device)
        after = torch.cuda.memory_allocated(device)
        out_bytes = out.numel() * out.element_size()
        out.backward(dout)
        del out
        sync(device)
        peak = torch.cuda.max_memory_allocated(device)
        res_mem = {"held_bytes": int(after - base - out_bytes), "peak_bytes": int(peak),
                   "base_bytes": int(base)}
    zero_grads()

    flops_f = 6.0 * T * K * d * n
    flops_b = 12.0 * T * K * d * n
    return {
        "fwd_ms": fwd_ms, "bwd_ms": bwd_ms,
        "fwd_tflops": flops_f / (fwd_ms * 1e-3) / 1e12,
        "bwd_tflops": flops_b / (bwd_ms * 1e-3) / 1e12 if bwd_ms > 0 else None,
        "total_tflops": (flops_f + flops_b) / (tot_ms * 1e-3) / 1e12,
        **res_mem,
        "fwd_bwd_ms": tot_ms,
        "fwd_ms_min_max": [fwd_min, fwd_max], "fwd_bwd_ms_min_max": [tot_min, tot_max],
    }


def bench_config(cfg, args, device):
    T, d, n, E, K = (int(cfg[k]) for k in ("T", "d", "n", "E", "K"))
    if d % 8 or n % 8:
        raise RuntimeError(f"torch._grouped_mm (bf16) needs d and n multiples of 8, got d={d} n={n}")
    x, w_router, w1, w3, w2, dout = make_inputs(T, d, n, E, device, seed=args.seed)
    params = (x, w_router, w1, w3, w2)

    def fwd():
        return moe_forward(x, w_router, w1, w3, w2, K, args.counts, args.score_mul)

    res = measure(fwd, params, dout, cfg, args, device)

    # routing balance, for information (same seed -> same routing as the timed runs)
    with torch.no_grad():
        idx = (x @ w_router.t()).float().topk(K, dim=-1).indices.view(-1)
        cnt = torch.bincount(idx, minlength=E).float()
        imbalance = float(cnt.max() / cnt.mean())

    res["max_over_mean_tokens_per_expert"] = imbalance
    del x, w_router, w1, w3, w2, dout, params
    return res


# --------------------------------------------------------------------------------------------
# correctness check against a per-token fp32 loop
# --------------------------------------------------------------------------------------------
def reference_loop(x, w_router, w1, w3, w2, K):
    """Straightforward fp32 MoE: routing decisions from the same bf16 logits as the baseline
    (so ties in bf16 resolve identically); scores from the fp32 logits of the picked experts."""
    with torch.no_grad():
        top_idx = (x @ w_router.t()).float().topk(K, dim=-1).indices
    xf, wrf, w1f, w3f, w2f = (t.detach().float().requires_grad_(True)
                              for t in (x, w_router, w1, w3, w2))
    logits = xf @ wrf.t()
    scores = torch.softmax(logits.gather(1, top_idx), dim=-1)
    idx = top_idx.tolist()
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], device=x.device)
        for j in range(K):
            e = idx[t][j]
            h = F.silu(w1f[e] @ xf[t]) * (w3f[e] @ xf[t])
            acc = acc + scores[t, j] * (w2f[e] @ h)
        rows.append(acc)
    return torch.stack(rows), (xf, wrf, w1f, w3f, w2f), top_idx


def rel_l2(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_check(args, device):
    cases = [(256, 128, 64, 8, 2), (16, 128, 64, 32, 2)]  # second one has empty experts
    tol = args.check_tol
    ok = True
    for (T, d, n, E, K) in cases:
        x, w_router, w1, w3, w2, dout = make_inputs(T, d, n, E, device, seed=args.seed)
        out = moe_forward(x, w_router, w1, w3, w2, K, args.counts, args.score_mul)
        out.backward(dout)
        ref, ref_leaves, top_idx = reference_loop(x, w_router, w1, w3, w2, K)
        ref.backward(dout.float())
        with torch.no_grad():
            idx32 = (x.float() @ w_router.float().t()).topk(K, dim=-1).indices
            same = (idx32.sort(-1).values == top_idx.sort(-1).values).all(-1).sum().item()
            empty = int((torch.bincount(top_idx.view(-1), minlength=E) == 0).sum())
        print(f"check T={T} d={d} n={n} E={E} K={K} on {device} "
              f"(empty experts: {empty}; tokens routed as by fp32 logits: {same}/{T})")
        names = ["out", "grad x", "grad w_router", "grad w1", "grad w3", "grad w2"]
        mine = [out, x.grad, w_router.grad, w1.grad, w3.grad, w2.grad]
        theirs = [ref] + [leaf.grad for leaf in ref_leaves]
        for name, a, b in zip(names, mine, theirs):
            if a is None or b is None:
                print(f"  {name:14s} missing gradient")
                ok = False
                continue
            err = rel_l2(a, b)
            flag = "ok" if err <= tol and math.isfinite(err) else "FAIL"
            ok &= flag == "ok"
            print(f"  {name:14s} rel L2 err {err:.3e}  {flag}")
    print("check passed" if ok else f"check FAILED (tolerance {tol:g})")
    return ok


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------
def load_configs(args):
    cfgs = []
    if args.shape:
        for s in args.shape:
            T, d, n, E, K = (int(v) for v in s.split(","))
            cfgs.append({"name": f"T{T} d{d} n{n} E{E} K{K}", "T": T, "d": d, "n": n, "E": E,
                         "K": K})
    if not args.shape or args.configs:
        with open(args.configs_file) as f:
            allc = json.load(f)
        if args.configs:
            wanted = [w.strip() for w in args.configs.split(",") if w.strip()]
            by_name = {c["name"]: c for c in allc}
            missing = [w for w in wanted if w not in by_name]
            if missing:
                sys.exit(f"unknown config(s): {missing}; known: {list(by_name)}")
            cfgs += [by_name[w] for w in wanted]
        else:
            cfgs += allc
    return [{k: c[k] for k in CONFIG_KEYS} for c in cfgs]


def fmt(v, spec):
    if v is None:
        width = "".join(ch for ch in spec.split(".")[0] if ch.isdigit())
        return format("-", ">" + width)
    return format(v, spec)


def print_table(results):
    w = max([len("config")] + [len(r["config"]["name"]) for r in results])
    hdr = (f"{'config':{w}s} {'fwd ms':>8s} {'bwd ms':>8s} {'fwd TF':>7s} {'bwd TF':>7s} "
           f"{'tot TF':>7s} {'held GB':>8s} {'peak GB':>8s}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        name = r["config"]["name"]
        m = r[SYSTEM]
        if "error" in m:
            print(f"{name:{w}s} error: {m['error'][:100]}")
            continue
        gb = lambda b: None if b is None else b / 1e9  # noqa: E731
        print(f"{name:{w}s} {fmt(m['fwd_ms'], '8.3f')} {fmt(m['bwd_ms'], '8.3f')} "
              f"{fmt(m['fwd_tflops'], '7.1f')} {fmt(m['bwd_tflops'], '7.1f')} "
              f"{fmt(m['total_tflops'], '7.1f')} {fmt(gb(m['held_bytes']), '8.2f')} "
              f"{fmt(gb(m['peak_bytes']), '8.2f')}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", help="comma-separated config names (default: all)")
    ap.add_argument("--configs-file", default=DEFAULT_CONFIGS)
    ap.add_argument("--shape", action="append",
                    help="extra config T,d,n,E,K (repeatable; without --configs runs only these)")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions (median; >= 20 advised)")
    ap.add_argument("--warmup", type=int, default=5, help="warm-up iterations (>= 5 advised)")
    ap.add_argument("--out", help="write the results JSON here (rewritten after every config)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (logic test only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--counts", choices=["bincount", "histc"], default="bincount",
                    help="tokens-per-expert op (bincount syncs with the host on CUDA)")
    ap.add_argument("--score-mul", choices=["fp32", "bf16"], default="fp32",
                    help="multiply expert outputs by the scores in fp32 then cast (torchtitan) "
                         "or in bf16")
    ap.add_argument("--check", action="store_true",
                    help="compare output and gradients on tiny configs with a per-token fp32 loop")
    ap.add_argument("--check-tol", type=float, default=3e-2)
    args = ap.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("CUDA is not available (use --device cpu for a logic test)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)

    if args.check:
        sys.exit(0 if run_check(args, device) else 1)

    configs = load_configs(args)
    doc = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d"),
        "options": {"reps": args.reps, "warmup": args.warmup, "counts": args.counts,
                    "score_mul": args.score_mul, "seed": args.seed},
        "results": [],
    }

    def save():
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            tmp = args.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(doc, f, indent=1)
                f.write("\n")
            os.replace(tmp, args.out)

    bar = tqdm(configs, desc="configs", unit="cfg")
    for cfg in bar:
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(cfg["name"])
        err = None
        try:
            res = bench_config(cfg, args, device)
        except (torch.cuda.OutOfMemoryError, RuntimeError) as e:  # OOM is a RuntimeError too
            err = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            res = {"error": err}
        # the exception (and its frames holding tensors) is gone here: free memory
        gc.collect()
        if device.type == "cuda":
            try:
                torch.cuda.empty_cache()
            except RuntimeError:
                pass
        if err and hasattr(bar, "write"):
            bar.write(f"{cfg['name']}: {err}")
        doc["results"].append({"config": cfg, SYSTEM: res})
        save()

    print()
    print(f"{doc['device']}  torch {doc['torch']}  cuda {doc['cuda']}  "
          f"(median of {args.reps}, warm-up {args.warmup}, counts={args.counts}, "
          f"score_mul={args.score_mul})")
    print_table(doc["results"])
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
