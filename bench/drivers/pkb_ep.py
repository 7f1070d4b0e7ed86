"""Parallel Kernel Bench-style EP tasks (issue 12): for each task a PyTorch + NCCL reference and ours,
run under torchrun on N GPUs of one node; correctness over seeds; time of both (max over ranks,
median); Fast@p (share of tasks where ours is >= p times faster than the reference) for p = 1, 1.5, 2;
the fraction of a communication-aware roofline.

    torchrun --nproc_per_node N bench/drivers/pkb_ep.py --out pkb.json [--scaling weak|strong] [--tokens 8192]
        [--only "7B n512 E64 K4,..."] [--seeds 3]

Tasks, per config of bench/configs/configs.json that fits and per routing (balanced: the random router;
skewed: +2 on the logits of rank 0's experts, so most rows go to one rank):
  layer_fwd         the EP MoE layer forward (router in torch for both)
  layer_bwd         its backward (time of forward+backward minus forward)
  dispatch_combine  the communication alone. Reference: torchtitan's path with identity experts
                    (counts all-to-all, host sync for the splits, one row per (token, k) out and back,
                    weighted sum); ours: smoe_torch.ep's roundtrip (one row per (token, rank)).
Scaling: weak keeps --tokens per rank; strong keeps the config's T as the global batch.
Correctness: the layer's output and gradients against the one-process float32 layer on all ranks'
tokens (relative L2 <= 2e-2, the bf16 bound), at every seed, for both systems; dispatch_combine's
outputs against their exact values.
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.distributed as dist

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/
sys.path.insert(0, os.path.join(BENCH, "baselines"))
from ep_baseline import (ep_moe, interleave, one_gpu_reference, route, swiglu_experts_grouped_mm,  # noqa: E402
                         timed, weights)

NVLINK_GBS = 350.0   # LSA push per direction measured on the 2-GPU machine (multi-gpu-digest.md)


def skewed_router(wr, E, R):
    """A router whose logits favour rank 0's experts: most tokens send most rows to rank 0."""
    bias = torch.zeros(E, device=wr.device, dtype=torch.float32)
    bias[: E // R] = 2.0
    return bias


def route_b(x, wr, K, bias):
    if bias is None:
        return route(x, wr, K)
    logits = x.float() @ wr.float().T + bias
    vals, idx = logits.topk(K, dim=-1)
    return idx, vals.softmax(-1)


def ours_layer(group, x, wr, w1i, w2, K, bias):
    from smoe_torch import ep as sep
    idx, s = route_b(x, wr, K, bias)
    return sep.ep_moe(group, x, idx, s, w1i, w2)


def ref_layer(x, wr, w1, w3, w2, K, E, bias):
    """The torchtitan pattern (all_to_all_single + grouped_mm), with the same (possibly biased) router."""
    return ep_moe(x, wr, w1, w3, w2, K, E, None, swiglu_experts_grouped_mm,
                  route_fn=lambda x_: route_b(x_, wr, K, bias))


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def a2a_roundtrip(x, idx, s, E, group=None):
    """torchtitan's communication with identity experts: rows per (token, k) out and back."""
    from torch.distributed.nn.functional import all_to_all_single
    R = dist.get_world_size(group)
    T, d = x.shape
    K = idx.shape[1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = x.repeat_interleave(K, dim=0)[order]
    counts = torch.bincount(flat, minlength=E)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    send = counts.view(R, -1).sum(1).tolist()
    recv = recv_counts.view(R, -1).sum(1).tolist()
    got = all_to_all_single(x.new_empty(sum(recv), d), rows, recv, send, group=group)
    back = all_to_all_single(x.new_empty(rows.shape[0], d), got, send, recv, group=group)
    per_entry = torch.empty_like(back).index_copy(0, order, back).view(T, K, d)
    return (per_entry.float() * s.unsqueeze(-1)).sum(1).to(x.dtype)


def roofline_ms(T_rank, d, n, E, K, R, bound):
    p = 1.0 - math.comb(E - E // R, K) / math.comb(E, K) if R > 1 else 0.0   # token leaves its rank
    # expected other ranks hit per token: (R-1) * (1 - C(E - E/R, K) / C(E, K))
    hit = (R - 1) * (1.0 - math.comb(E - E // R, K) / math.comb(E, K)) if R > 1 else 0.0
    link = 2 * T_rank * hit * d * 2 / (NVLINK_GBS * 1e9) * 1e3
    fwd = 6 * T_rank * K * d * n / (bound[0] * 1e12) * 1e3
    bwd = 12 * T_rank * K * d * n / (bound[1] * 1e12) * 1e3
    return {"layer_fwd": max(fwd, link), "layer_bwd": max(bwd, link), "dispatch_combine": link, "p_cross": p}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=os.path.join(BENCH, "configs", "configs.json"))
    ap.add_argument("--only", default="")
    ap.add_argument("--scaling", choices=("weak", "strong"), default="strong")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per rank (weak scaling)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    ap.add_argument("--check_only", action="store_true", help="correctness only (CHECK lines), no timing")
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank, R = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    from smoe_torch import ep as sep
    bound = json.load(open(os.path.join(BENCH, "configs", "cublas_bound.json")))["bound"]
    tasks = []

    def record(entry):
        tasks.append(entry)
        if rank == 0:
            print("TASK " + json.dumps(entry), flush=True)
            if args.out:
                json.dump(summary(), open(args.out, "w"), indent=1)

    def summary():
        done = [t for t in tasks if "ours_ms" in t and "ref_ms" in t]
        ok = [t for t in done if t["correct"]]
        fast = {str(p): (sum(1 for t in ok if t["ref_ms"] >= p * t["ours_ms"]) / len(done) if done else 0.0)
                for p in (1, 1.5, 2)}
        return {"gpu": torch.cuda.get_device_name(), "world_size": R, "scaling": args.scaling,
                "commit": os.environ.get("SMOE_COMMIT", "unknown"), "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "torch": torch.__version__, "seeds": args.seeds, "fast_at_p": fast,
                "correct_tasks": f"{len(ok)}/{len(done)}", "tasks": tasks}

    for c in json.load(open(args.configs)):
        if args.only and c["name"] not in args.only.split(","):
            continue
        d, n, E, K = c["d"], c["n"], c["E"], c["K"]
        T = args.tokens if args.scaling == "weak" else c["T"] // R
        if E % R:
            continue
        El = E // R
        for routing in ("balanced", "skewed"):
            base = {"config": c["name"], "routing": routing, "T_per_rank": T, "world_size": R}
            try:
                group = sep.EpGroup(max_tokens=T, d=d, n=n, num_experts=E, top_k=K)
            except Exception as ex:
                for task in ("layer_fwd", "layer_bwd", "dispatch_combine"):
                    record(dict(base, task=task, error=repr(ex)[:300]))
                continue
            wr, w1, w3, w2 = weights(E, d, n, 1, "cuda", torch.bfloat16)
            bias = skewed_router(wr, E, R) if routing == "skewed" else None
            sl = slice(rank * El, (rank + 1) * El)
            # Correctness over seeds, at min(T, 256) tokens per rank (the float32 reference is slow).
            correct = {"layer": True, "dispatch_combine": True, "ref": True}
            Tc = min(T, 256)
            for seed in range(args.seeds):
                g = torch.Generator(device="cpu").manual_seed(1000 + seed)
                x_all = torch.randn(R * Tc, d, generator=g).to("cuda", torch.bfloat16)
                dout_all = torch.randn(R * Tc, d, generator=g).to("cuda", torch.bfloat16)
                tl = slice(rank * Tc, (rank + 1) * Tc)
                x = x_all[tl].clone().requires_grad_(True)
                w1i = interleave(w1[sl], w3[sl]).clone().requires_grad_(True)
                w2l = w2[sl].clone().requires_grad_(True)
                out = ours_layer(group, x, wr, w1i, w2l, K, bias)
                out.backward(dout_all[tl])
                xr = x_all.float().requires_grad_(True)
                rw = [w.float().requires_grad_(True) for w in (w1, w3, w2)]
                if bias is None:
                    ref = one_gpu_reference(xr, wr, *rw, K)
                else:   # the same reference with the biased selection
                    idx_all, s_all = route_b(xr, wr, K, bias)
                    ref = torch.zeros_like(xr)
                    for e in range(E):
                        tok, k = (idx_all == e).nonzero(as_tuple=True)
                        if tok.numel():
                            xe = xr[tok]
                            y = (torch.nn.functional.silu(xe @ rw[0][e].T) * (xe @ rw[1][e].T)) @ rw[2][e].T
                            ref = ref.index_add(0, tok, y * s_all[tok, k, None])
                ref.backward(dout_all.float())
                dg = w1i.grad.view(El, n, 2, d)
                errs = [rel(out, ref[tl]), rel(x.grad, xr.grad[tl]), rel(dg[:, :, 0], rw[0].grad[sl]),
                        rel(dg[:, :, 1], rw[1].grad[sl]), rel(w2l.grad, rw[2].grad[sl])]
                correct["layer"] &= all(e < 2e-2 for e in errs)
                xt = x_all[tl].clone().requires_grad_(True)   # the reference system on the same data
                lw = [w[sl].clone().requires_grad_(True) for w in (w1, w3, w2)]
                rt = ref_layer(xt, wr, *lw, K, E, bias)
                ref_err = rel(rt, ref[tl])
                correct["ref"] &= ref_err < 2e-2
                # Which check failed, when one does: ours (out, dx, dw1, dw3, dw2) and the reference's out.
                print("CHECK " + json.dumps(dict(base, rank=rank, seed=seed, ours=[round(e, 5) for e in errs],
                                                 ref=round(ref_err, 5))), flush=True)
                idx, _ = route_b(x_all[tl], wr, K, bias)
                rt_out = sep._ep.roundtrip(group.handle, x_all[tl].contiguous(), idx.int().contiguous())
                hits = torch.zeros(Tc, device="cuda")
                for q in range(R):
                    hits += ((idx // El) == q).any(dim=1).float()
                want = (x_all[tl].float() * hits[:, None]).bfloat16()
                correct["dispatch_combine"] &= torch.equal(rt_out, want)
            ok_all = {}
            for k_, v in correct.items():
                t_ = torch.tensor([1 if v else 0], device="cuda")
                dist.all_reduce(t_, op=dist.ReduceOp.MIN)
                ok_all[k_] = bool(t_.item())
            if args.check_only:
                group.close()
                if rank == 0:
                    print("CHECKED " + json.dumps(dict(base, **ok_all)), flush=True)
                continue
            # Timing at T tokens per rank.
            x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            dout = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
            w1i = interleave(w1[sl], w3[sl]).clone().requires_grad_(True)
            w2l = w2[sl].clone().requires_grad_(True)
            lw = [w[sl].clone().requires_grad_(True) for w in (w1, w3, w2)]
            rl = roofline_ms(T, d, n, E, K, R, bound[c["name"]])
            ours_f = lambda: ours_layer(group, x, wr, w1i, w2l, K, bias)  # noqa: E731
            timings = {}
            try:
                timings["ours_fwd"] = timed(ours_f, args.warmup, args.reps)
                timings["ours_fb"] = timed(lambda: ours_f().backward(dout), args.warmup, args.reps)
                idx, s = route_b(x.detach(), wr, K, bias)
                idx32 = idx.int().contiguous()
                xd = x.detach().contiguous()
                timings["ours_dc"] = timed(lambda: sep._ep.roundtrip(group.handle, xd, idx32), args.warmup, args.reps)
                timings["ref_dc"] = timed(lambda: a2a_roundtrip(xd, idx, s, E), args.warmup, args.reps)
                ref_f = lambda: ref_layer(x, wr, *lw, K, E, bias)  # noqa: E731
                timings["ref_fwd"] = timed(ref_f, args.warmup, args.reps)
                timings["ref_fb"] = timed(lambda: ref_f().backward(dout), args.warmup, args.reps)
            except Exception as ex:
                timings["error"] = repr(ex)[:300]
            group.close()
            for task, o, r_, okk in (("layer_fwd", "ours_fwd", "ref_fwd", "layer"), ("layer_bwd", None, None, "layer"),
                                     ("dispatch_combine", "ours_dc", "ref_dc", "dispatch_combine")):
                e = dict(base, task=task, correct=ok_all[okk] and (ok_all["ref"] if task != "dispatch_combine" else True))
                if task == "layer_bwd":
                    if "ours_fb" in timings:
                        e["ours_ms"] = timings["ours_fb"] - timings["ours_fwd"]
                    if "ref_fb" in timings:
                        e["ref_ms"] = timings["ref_fb"] - timings["ref_fwd"]
                else:
                    if o in timings:
                        e["ours_ms"] = timings[o]
                    if r_ in timings:
                        e["ref_ms"] = timings[r_]
                if "ours_ms" in e:
                    e["roofline_ms"] = rl[task]
                    e["roofline_fraction"] = rl[task] / e["ours_ms"]
                if "ref_ms" in e and "ours_ms" in e:
                    e["speedup"] = e["ref_ms"] / e["ours_ms"]
                if "error" in timings:
                    e["error"] = timings["error"]
                record(e)
    if rank == 0:
        s = summary()
        print("FAST@P " + json.dumps(s["fast_at_p"]) + " correct " + s["correct_tasks"], flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
