"""EP over torch.distributed all-to-all with smoe's expert-major layer, against torchtitan's pattern and
our one-node EP, forward + backward, under torchrun (written for the 2-GPU machine, any P works).

    torchrun --nproc_per_node 2 bench/drivers/ep_a2a_bench.py --out ep_a2a.json
        [--configs bench/configs/configs.json] [--only "7B n512 E64 K4,..."] [--warmup 3] [--reps 15]
        [--systems ours_a2a,torchtitan_a2a,ours_ep] [--no-check] [--tokens-per-rank N]

Systems (the same routing, inputs and local weights; the router is outside the timed step: topk ids
and scores are drawn once per config, scores are a leaf that gets its gradient):
  ours_a2a        smoe_torch.ep_a2a.moe_ep_a2a: stable sort, counts all-to-all, one host sync for the
                  splits, rows + probs all-to-all, regroup to expert-major, smoe_torch.expert_major
                  (probs applied before the down projection), inverse regroup, all-to-all back,
                  sum over K in fp32 (no atomics).
  torchtitan_a2a  torchtitan 0.3.0's AllToAllTokenDispatcher + GroupedExperts (models/common/
                  token_dispatcher.py, moe.py), written out here: counts from the one-hot routing map,
                  argsort by expert, x[token_idx], counts all-to-all + wait, input splits copied
                  non-blocking and output splits blocking (the host sync), functional all_to_all_single
                  of the rows (autograd), _permute, torch._grouped_mm gate / up, SwiGLU, _grouped_mm
                  down, _unpermute, all-to-all back, fp32 score scaling cast to bf16, deterministic
                  scatter_add into [T, d].
  ours_ep         smoe_torch.ep.ep_moe (one node, NCCL device API, no host sync); w1 / w3 interleaved
                  once outside the timed step.
Timing (bench/README.md's conventions): CUDA events, warm-up, median over reps of the max over
ranks; bwd = median(fwd+bwd) - median(fwd). TFLOP/s per rank: 6 T K d n forward, 12 T K d n backward
(T = tokens per rank). For ours_a2a and torchtitan_a2a also the forward per hop (events between
the hop calls, put by this driver: the library's hot path has no timing code). A hop's time is
GPU time between its events, so the host sync's idle gap lands in `layout`; torchtitan's functional
all-to-all waits at the first use of its result, so part of its dispatch / combine time can land
in the hop after it (the totals are exact).
Correctness first, at min(T, 256) tokens per rank, d <= 2048, n <= 1024 with the config's E and K:
out, dx, dscores, dw1, dw3, dw2 of every system against a float32 one-process loop over all E
experts on all ranks' tokens (relative L2 < 2e-2, the bf16 bound).
Output: the results format of ../shared/bench/README.md plus "device", "world_size", "nccl",
"hops_ms", "check"; commit = $SMOE_COMMIT, else `git rev-parse HEAD` (the device's .git can be stale:
pass SMOE_COMMIT).
"""
import argparse
import datetime
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYSTEMS = ("ours_a2a", "torchtitan_a2a", "ours_ep")


def load_ep_a2a():
    """smoe_torch.ep_a2a from the installed package, else the tree's file (it imports smoe_torch only
    for its default experts function)."""
    try:
        from smoe_torch import ep_a2a
        return ep_a2a
    except ImportError:
        spec = importlib.util.spec_from_file_location("smoe_ep_a2a_file",
                                                      os.path.join(REPO, "python", "smoe_torch", "ep_a2a.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


# ---- torchtitan 0.3.0's all-to-all pattern, as hops ----------------------------------------------------

def _funcol():
    import torch.distributed._functional_collectives as funcol
    return funcol


def tt_layout(st):
    """MoE.forward's counts (one-hot routing map summed), _local_reorder, the count exchange and its
    host sync (_token_count_exchange, _sync_token_count_exchange)."""
    funcol = _funcol()
    x, idx, s, E, P, group = st["x"], st["idx"], st["scores"], st["E"], st["P"], st["group"]
    T, K = idx.shape
    routing_map = torch.zeros((T, E), dtype=torch.bool, device=x.device).scatter_(-1, idx, True)
    counts_E = routing_map.sum(dim=0)
    order = torch.argsort(idx.view(-1), stable=True)
    st["scores_sorted"] = s.view(-1)[order]
    st["token_idx"] = order // K
    st["routed_input"] = x[st["token_idx"]]
    with torch.no_grad():
        recv = funcol.all_to_all_single(counts_E.view(P, -1), None, None, group=group)
        recv = torch.ops._c10d_functional.wait_tensor(recv)
        recv_E = recv.reshape(-1)
        input_splits = counts_E.view(P, -1).sum(dim=1).to(torch.device("cpu"), non_blocking=True)
        output_splits = recv_E.view(P, -1).sum(dim=1).to(torch.device("cpu"), non_blocking=False)  # the sync
    st["recv_E"] = recv_E
    st["input_splits"], st["output_splits"] = input_splits.tolist(), output_splits.tolist()


def tt_dispatch(st):
    funcol = _funcol()
    a2a = getattr(funcol, "all_to_all_single_autograd", funcol.all_to_all_single)
    st["routed"] = a2a(st["routed_input"], st["output_splits"], st["input_splits"], st["group"])


def tt_permute(st):
    """AllToAllTokenDispatcher._permute: rank-major (e, r) blocks to expert-major."""
    P = st["P"]
    recv_E = st["recv_E"]
    e = recv_E.shape[0] // P
    device, total = recv_E.device, st["routed"].shape[0]
    t_mat = recv_E.view(P, e)
    input_starts = (recv_E.cumsum(0) - recv_E).view(P, e)
    segment_lens = t_mat.t().reshape(-1)
    input_starts = input_starts.t().reshape(-1)
    seg_ids = torch.arange(segment_lens.shape[0], device=device).repeat_interleave(segment_lens, output_size=total)
    output_starts = segment_lens.cumsum(0) - segment_lens
    st["permuted_indices"] = input_starts[seg_ids] + torch.arange(seg_ids.shape[0], device=device) - output_starts[seg_ids]
    st["input_shape"] = st["routed"].shape
    st["rows"] = st["routed"][st["permuted_indices"], :]
    st["counts_e"] = t_mat.sum(0)


def tt_experts(st):
    """GroupedExperts.forward."""
    w1, w3, w2 = st["w1"], st["w3"], st["w2"]
    x = st["rows"]
    offsets = torch.cumsum(st["counts_e"], dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(x.bfloat16(), w1.bfloat16().transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(x.bfloat16(), w3.bfloat16().transpose(-2, -1), offs=offsets)
    st["y"] = torch._grouped_mm(h, w2.bfloat16().transpose(-2, -1), offs=offsets).type_as(x)


def tt_unpermute(st):
    out = st["y"].new_empty(st["input_shape"])
    out[st["permuted_indices"], :] = st["y"]
    st["y"] = out


def tt_combine(st):
    funcol = _funcol()
    a2a = getattr(funcol, "all_to_all_single_autograd", funcol.all_to_all_single)
    routed = a2a(st["y"], st["input_splits"], st["output_splits"], st["group"])
    x = st["x"]
    routed = (routed.to(torch.float32) * st["scores_sorted"].reshape(-1, 1)).to(routed.dtype)
    out = torch.zeros_like(x)
    prev, prev_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=False)   # torchtitan's deterministic_scatter_add
    try:
        st["out"] = out.scatter_add(0, st["token_idx"].reshape(-1, 1).expand(-1, x.shape[-1]), routed)
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=prev_warn)


TT_HOPS = (("layout", tt_layout), ("dispatch", tt_dispatch), ("permute", tt_permute), ("experts", tt_experts),
           ("unpermute", tt_unpermute), ("combine", tt_combine))


def torchtitan_a2a(x, idx, scores, w1, w3, w2, group):
    st = dict(x=x, idx=idx, scores=scores, w1=w1, w3=w3, w2=w2, group=group, P=dist.get_world_size(group),
              E=w1.shape[0] * dist.get_world_size(group))
    for _, hop in TT_HOPS:
        hop(st)
    return st["out"]


# ---- ours_a2a as hops (the composition moe_ep_a2a is, for the per-hop times) ---------------------------

def ours_hops(ep_a2a):
    def layout(st):
        st["plan"] = ep_a2a.layout(st["idx"], st["w1"].shape[0], st["group"])

    def dispatch(st):
        st["rows"], st["probs"] = ep_a2a.dispatch(st["x"], st["scores"], st["plan"])

    def regroup(st):
        st["rows"], st["probs"] = ep_a2a.to_expert_major(st["rows"], st["probs"], st["plan"])

    def experts(st):
        st["y"] = ep_a2a.run_experts(st["rows"], st["probs"], st["w1"], st["w3"], st["w2"], st["plan"])

    def ungroup(st):
        st["y"] = ep_a2a.from_expert_major(st["y"], st["plan"])

    def combine(st):
        st["out"] = ep_a2a.combine(st["y"], st["plan"])
    return (("layout", layout), ("dispatch", dispatch), ("regroup", regroup), ("experts", experts),
            ("ungroup", ungroup), ("combine", combine))


# ---- ours_ep -------------------------------------------------------------------------------------------

def interleave(w1, w3):
    """gate [E,n,d] + up [E,n,d] -> smoe's interleaved [E,2n,d] (row 2j gate j, 2j+1 up j)."""
    return torch.stack((w1, w3), dim=2).reshape(w1.shape[0], 2 * w1.shape[1], w1.shape[2])


# ---- timing --------------------------------------------------------------------------------------------

def _max_over_ranks(vals):
    t = torch.tensor(vals, device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def timed(fn, warmup, reps):
    """Median over reps of the max over ranks of fn's CUDA-event time (ms)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(_max_over_ranks([a.elapsed_time(b)])[0])
    return statistics.median(ts)


def timed_hops(hops, make_state, warmup, reps):
    """Forward per hop: events between the hop calls; per hop the median over reps of the max over ranks."""
    for _ in range(warmup):
        st = make_state()
        for _, hop in hops:
            hop(st)
    torch.cuda.synchronize()
    per = {name: [] for name, _ in hops}
    for _ in range(reps):
        st = make_state()
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(len(hops) + 1)]
        dist.barrier()
        evs[0].record()
        for i, (_, hop) in enumerate(hops):
            hop(st)
            evs[i + 1].record()
        torch.cuda.synchronize()
        ms = _max_over_ranks([evs[i].elapsed_time(evs[i + 1]) for i in range(len(hops))])
        for (name, _), m in zip(hops, ms):
            per[name].append(m)
        del st
    return {name: statistics.median(v) for name, v in per.items()}


# ---- correctness ---------------------------------------------------------------------------------------

def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def draw(T, d, n, E, K, seed, R):
    """All ranks' tokens (T per rank) and all E experts, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    x = torch.randn(R * T, d, generator=g).to("cuda", bf)
    dout = torch.randn(R * T, d, generator=g).to("cuda", bf)
    vals, idx = torch.randn(R * T, E, generator=g).topk(K, dim=-1)
    W1 = (torch.randn(E, n, d, generator=g) / math.sqrt(d)).to("cuda", bf)
    W3 = (torch.randn(E, n, d, generator=g) / math.sqrt(d)).to("cuda", bf)
    W2 = (torch.randn(E, d, n, generator=g) / math.sqrt(n)).to("cuda", bf)
    return x, dout, idx.cuda(), vals.softmax(-1).cuda(), W1, W3, W2


def reference_fp32(x, idx, s, W1, W3, W2):
    x, s, W1, W3, W2 = (t.float() for t in (x, s, W1, W3, W2))
    out = torch.zeros_like(x)
    for e in range(W1.shape[0]):
        tok, k = (idx == e).nonzero(as_tuple=True)
        if tok.numel():
            xe = x[tok]
            y = (F.silu(xe @ W1[e].T) * (xe @ W3[e].T)) @ W2[e].T
            out = out.index_add(0, tok, y * s[tok, k, None])
    return out


def check(systems, T, d, n, E, K, rank, R, tol=2e-2):
    """{system: {"errs": {...}, "correct": bool}} at the check shape."""
    x_all, dout_all, idx_all, s_all, W1, W3, W2 = draw(T, d, n, E, K, 7, R)
    El = E // R
    sl, tl = slice(rank * El, (rank + 1) * El), slice(rank * T, (rank + 1) * T)
    leaves = [t.detach().float().clone().requires_grad_(True) for t in (x_all, s_all, W1, W3, W2)]  # fp32 grads
    ref = reference_fp32(leaves[0], idx_all, *leaves[1:])
    ref.backward(dout_all.float())
    want = [ref.detach()[tl], leaves[0].grad[tl], leaves[1].grad[tl], leaves[2].grad[sl], leaves[3].grad[sl],
            leaves[4].grad[sl]]
    del ref, leaves
    res = {}
    for name, make in systems.items():
        try:
            fn = make(T, d, n, E, K)
            x = x_all[tl].clone().requires_grad_(True)
            s = s_all[tl].clone().requires_grad_(True)
            lw = [w[sl].clone().requires_grad_(True) for w in (W1, W3, W2)]
            out = fn(x, idx_all[tl], s, *lw)
            out.backward(dout_all[tl])
            got = [out.detach(), x.grad, s.grad] + [w.grad for w in lw]
            errs = {k: (rel(a, b) if a is not None else float("nan"))
                    for k, a, b in zip(("out", "dx", "dscores", "dw1", "dw3", "dw2"), got, want)}
            res[name] = {"errs": errs, "correct": all(v < tol for v in errs.values())}
            closer = getattr(fn, "close", None)
            if closer:
                closer()
        except Exception as ex:  # noqa: BLE001
            res[name] = {"error": repr(ex)[:300], "correct": False}
        if rank == 0:
            print(f"check {name}: {res[name]}", flush=True)
    return res


class OursEp:
    """ours_ep as a function of (x, idx, scores, w1, w3, w2); the EpGroup is made for the shape."""

    def __init__(self, T, d, n, E, K, interleave_inside=True):
        from smoe_torch import ep as sep
        self.sep = sep
        self.group = sep.EpGroup(max_tokens=max(T, 256), d=d, n=n, num_experts=E, top_k=K)
        self.interleave_inside = interleave_inside

    def __call__(self, x, idx, s, w1, w3, w2):
        w1i = interleave(w1, w3) if self.interleave_inside else w1
        return self.sep.ep_moe(self.group, x, idx.to(torch.int32), s, w1i, w2)

    def close(self):
        if self.group is not None:
            self.group.close()
            self.group = None


# ---- driver --------------------------------------------------------------------------------------------

def commit():
    """$SMOE_COMMIT, else HEAD with "+dirty" when the work tree has uncommitted changes."""
    if os.environ.get("SMOE_COMMIT"):
        return os.environ["SMOE_COMMIT"]
    try:
        git = lambda *a: subprocess.run(["git", "-C", REPO, *a], capture_output=True, text=True,  # noqa: E731
                                        check=True).stdout.strip()
        head = git("rev-parse", "HEAD")
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except Exception:  # noqa: BLE001
        return "unknown"


def run_config(c, args, ep_a2a, rank, R):
    T = args.tokens_per_rank or c["T"] // R
    d, n, E, K = c["d"], c["n"], c["E"], c["K"]
    entry = {"config": dict(c, ep=R, T_per_rank=T), "systems": {}}
    if E % R:
        entry["error"] = f"E = {E} is not a multiple of the EP size {R}"
        return entry
    El = E // R
    group = dist.group.WORLD
    wanted = [s for s in args.systems.split(",") if s]

    makers = {"ours_a2a": lambda *shape: (lambda x, i, s, w1, w3, w2: ep_a2a.moe_ep_a2a(x, i, s, w1, w3, w2, group)),
              "torchtitan_a2a": lambda *shape: (lambda x, i, s, w1, w3, w2: torchtitan_a2a(x, i, s, w1, w3, w2, group)),
              "ours_ep": lambda *shape: OursEp(*shape)}
    makers = {k: v for k, v in makers.items() if k in wanted}
    if args.check:
        cT, cd, cn = min(T, 256), min(d, 2048), min(n, 1024)
        entry["check_shape"] = {"T_per_rank": cT, "d": cd, "n": cn}
        checks = check(makers, cT, cd, cn, E, K, rank, R)
        torch.cuda.empty_cache()
    else:
        checks = {}

    # The timed inputs: this rank's tokens and routing (a per-rank seed), this rank's experts.
    g = torch.Generator().manual_seed(1000 + rank)
    bf = torch.bfloat16
    x = torch.randn(T, d, generator=g).to("cuda", bf).requires_grad_(True)
    dout = torch.randn(T, d, generator=g).to("cuda", bf)
    vals, idx = torch.randn(T, E, generator=g).topk(K, dim=-1)
    idx = idx.cuda()
    s = vals.softmax(-1).cuda().requires_grad_(True)
    lw = [(torch.randn(El, *shape, generator=g) / math.sqrt(shape[1])).to("cuda", bf).requires_grad_(True)
          for shape in ((n, d), (n, d), (d, n))]
    flops = T * K * d * n

    for name in wanted:
        if name not in makers:
            entry["systems"][name] = {"error": f"unknown system (known: {', '.join(SYSTEMS)})"}
            continue
        res = {}
        closer = None
        try:
            if name == "ours_ep":
                fn_obj = OursEp(T, d, n, E, K, interleave_inside=False)
                closer = fn_obj.close
                w1i = interleave(lw[0].detach(), lw[1].detach()).requires_grad_(True)   # once, outside the timing
                w2l = lw[2].detach().clone().requires_grad_(True)
                run = lambda: fn_obj(x, idx, s, w1i, None, w2l)   # noqa: E731
            else:
                fn = makers[name]()
                run = lambda fn=fn: fn(x, idx, s, *lw)   # noqa: E731
            f_ms = timed(run, args.warmup, args.reps)
            fb_ms = timed(lambda: run().backward(dout), args.warmup, args.reps)
            b_ms = fb_ms - f_ms
            res = {"fwd_ms": f_ms, "bwd_ms": b_ms, "fwd_bwd_ms": fb_ms, "fwd_tflops": 6 * flops / f_ms / 1e9,
                   "bwd_tflops": 12 * flops / b_ms / 1e9 if b_ms > 0 else None,
                   "total_tflops": 18 * flops / fb_ms / 1e9}
            hops = {"ours_a2a": ours_hops(ep_a2a), "torchtitan_a2a": TT_HOPS}.get(name)
            if hops is not None:
                base = dict(x=x, idx=idx, scores=s, w1=lw[0], w3=lw[1], w2=lw[2], group=group, P=R, E=E)
                res["hops_ms"] = timed_hops(hops, lambda: dict(base), args.warmup, args.reps)
            x.grad = s.grad = None
            for w in lw:
                w.grad = None
        except Exception as ex:  # noqa: BLE001  (a system that cannot run keeps an entry with the reason)
            import traceback
            traceback.print_exc()
            res = {"error": repr(ex)[:300]}
        finally:
            if closer:
                try:
                    closer()
                except Exception:  # noqa: BLE001
                    pass
            torch.cuda.empty_cache()
        if name in checks:
            res["check"] = checks[name].get("errs", checks[name].get("error"))
            res["correct"] = checks[name]["correct"]
        entry["systems"][name] = res
    return entry


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default=os.path.join(REPO, "bench", "configs", "configs.json"))
    p.add_argument("--only", default="", help="comma-separated config names")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--tokens-per-rank", type=int, default=0, help="0: the config's T / world size")
    p.add_argument("--no-check", dest="check", action="store_false")
    p.add_argument("--out", default="")
    args = p.parse_args()

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # never NVLink multicast (docs/ep.md)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, R = dist.get_rank(), dist.get_world_size()
    ep_a2a = load_ep_a2a()
    doc = {"commit": commit(), "gpu": torch.cuda.get_device_name(), "device": f"{R}x {torch.cuda.get_device_name()}",
           "driver": "bench/drivers/ep_a2a_bench.py", "cuda": torch.version.cuda, "torch": torch.__version__,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())), "date": datetime.date.today().isoformat(),
           "world_size": R, "warmup": args.warmup, "reps": args.reps, "results": []}
    configs = json.load(open(args.configs))
    only = [s for s in args.only.split(",") if s]
    for c in configs:
        if only and c["name"] not in only:
            continue
        try:
            entry = run_config(c, args, ep_a2a, rank, R)
        except Exception as ex:  # noqa: BLE001  (one config that cannot run keeps an entry; the run goes on)
            import traceback
            traceback.print_exc()
            entry = {"config": dict(c, ep=R), "error": repr(ex)[:300]}
            torch.cuda.empty_cache()
        doc["results"].append(entry)
        if rank == 0:
            print("RESULT " + json.dumps(entry), flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(doc, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
