"""Expert-parallel MoE baselines on torch.distributed (issue 11's comparison points) and their check.

  torchtitan_a2a   torchtitan's pattern: top-K, argsort by expert, all_to_all_single of the counts
                   (a device-to-host sync for the splits), all_to_all_single of one row per
                   (token, k), permute to expert-major, grouped GEMMs (torch._grouped_mm on CUDA),
                   the reverse path, score-weighted sum over k.
  ours_local_a2a   the same communication, with the local experts on our single-GPU kernels
                   (smoe_torch.moe_routed: every received row is a "token" routed to one expert;
                   gate / up as two tensors; the runs up to f0ce1bd stacked them every step).
Runs up to f0ce1bd also handed both baselines' expert functions their per-expert counts as a host
list (one more device-to-host sync per forward, after the split sizes' own); now a device tensor.
  ours_ep          smoe's EP layer (smoe_torch.ep.ep_moe): the same router in torch, then dispatch by
                   NVLink stores into symmetric windows (NCCL device API), the local experts on our
                   kernels over the received tokens, combine; no host sync, no permutation copy.

Both are differentiable (torch.distributed.nn.functional.all_to_all_single), so forward and backward
are timed, and both are checked against the one-process layer on all ranks' tokens.

    torchrun --nproc_per_node 2 bench/baselines/ep_baseline.py --configs bench/configs/configs.json --out ep_base.json
    python3 bench/baselines/ep_baseline.py --cpu-check      # 2 gloo processes on the CPU: the logic alone
"""
import argparse
import json
import math
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single


def swiglu_experts_loop(x, w1, w3, w2, counts):
    """Grouped SwiGLU experts on expert-major rows (counts: [El] rows per expert, a tensor): a loop (CPU,
    references)."""
    out, o = [], 0
    for e, c in enumerate(counts.tolist()):
        xe = x[o:o + c]
        out.append((F.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T)
        o += c
    return torch.cat(out) if out else x.new_zeros(0, w2.shape[1])


def swiglu_experts_grouped_mm(x, w1, w3, w2, counts):
    """The same with torch._grouped_mm (CUDA, bf16): offsets are the cumulative row counts, on the device
    (no host sync: torchtitan keeps its per-expert counts on the device too)."""
    offs = counts.cumsum(0).to(torch.int32)
    g = torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)
    u = torch._grouped_mm(x, w3.transpose(1, 2), offs=offs)
    return torch._grouped_mm(F.silu(g) * u, w2.transpose(1, 2), offs=offs)


def acc_dtype(t):
    """fp32 accumulation for bf16/fp16 data, the data's own precision above that (the CPU check)."""
    return torch.promote_types(t.dtype, torch.float32)


def route(x, wr, K):
    a = acc_dtype(x)
    logits = x.to(a) @ wr.to(a).T
    vals, idx = logits.topk(K, dim=-1)
    return idx, vals.softmax(-1)


def ep_moe(x, wr, w1, w3, w2, K, E, group, experts_fn, route_fn=None):
    """One rank's part of the EP layer (torchtitan pattern). w1/w3/w2: this rank's E/R experts.
    route_fn(x) -> (idx, scores) replaces the default top-K softmax router (x @ wr^T)."""
    R = dist.get_world_size(group)
    El = E // R
    T, d = x.shape
    idx, s = route(x, wr, K) if route_fn is None else route_fn(x)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)             # entries by expert (then entry index)
    rows = x.repeat_interleave(K, dim=0)[order]          # one row per (token, k), expert-major
    counts = torch.bincount(flat, minlength=E)           # [E] rows per global expert, this rank
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)   # [R * El]: from rank s, for my experts
    send_split = counts.view(R, El).sum(1).tolist()      # the device-to-host sync of this pattern
    recv_split = recv_counts.view(R, El).sum(1).tolist()
    recv = all_to_all_single(x.new_empty(sum(recv_split), d), rows, recv_split, send_split, group=group)
    # Received rows are (source rank, local expert); permute to (local expert, source rank).
    # On the device, with no further host sync (torchtitan does this with one kernel too): a received
    # row j of block (r, l) goes to dst_off[l, r] + (j - src_off[r, l]); perm is that map's inverse.
    rc = recv_counts.view(R, El)
    n_recv = recv.shape[0]
    src_off = (rc.reshape(-1).cumsum(0) - rc.reshape(-1)).view(R, El)
    dst_off = (rc.t().reshape(-1).cumsum(0) - rc.t().reshape(-1)).view(El, R).t()   # [R, El]
    block = torch.repeat_interleave(torch.arange(R * El, device=x.device), rc.reshape(-1), output_size=n_recv)
    j = torch.arange(n_recv, device=x.device)
    dpos = dst_off.reshape(-1)[block] + j - src_off.reshape(-1)[block]
    perm = torch.empty_like(j).index_copy_(0, dpos, j)
    y = experts_fn(recv[perm], w1, w3, w2, rc.sum(0))   # [El] rows per local expert, on the device
    back = torch.empty_like(y)
    back = back.index_copy(0, perm, y) if y.shape[0] else y
    ret = all_to_all_single(x.new_empty(rows.shape[0], d), back, send_split, recv_split, group=group)
    per_entry = torch.empty_like(ret).index_copy(0, order, ret).view(T, K, d)
    return (per_entry.to(s.dtype) * s.unsqueeze(-1)).sum(1).to(x.dtype)   # k order, fp32 (or finer)


def one_gpu_reference(x_all, wr, w1, w3, w2, K):
    idx, s = route(x_all, wr, K)
    x = x_all.to(s.dtype)
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        tok, k = (idx == e).nonzero(as_tuple=True)
        if tok.numel():
            xe = x[tok]
            y = (F.silu(xe @ w1[e].to(x.dtype).T) * (xe @ w3[e].to(x.dtype).T)) @ w2[e].to(x.dtype).T
            out = out.index_add(0, tok, y * s[tok, k, None])
    return out


def weights(E, d, n, seed, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *shape, scale: (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)  # noqa: E731
    return (mk(E, d, scale=1 / math.sqrt(d)), mk(E, n, d, scale=1 / math.sqrt(d)),
            mk(E, n, d, scale=1 / math.sqrt(d)), mk(E, d, n, scale=1 / math.sqrt(n)))


def check(rank, T, d, n, E, K, device, dtype, experts_fn, tol):
    """EP output and gradients (x, expert weights) against the one-process layer on all tokens."""
    R = dist.get_world_size()
    El = E // R
    wr, w1, w3, w2 = weights(E, d, n, 1, device, dtype)
    g = torch.Generator(device="cpu").manual_seed(100)
    x_all = torch.randn(R * T, d, generator=g).to(device=device, dtype=dtype)
    dout_all = torch.randn(R * T, d, generator=g).to(device=device, dtype=dtype)
    sl = slice(rank * El, (rank + 1) * El)
    x = x_all[rank * T:(rank + 1) * T].clone().requires_grad_(True)
    lw = [w[sl].clone().requires_grad_(True) for w in (w1, w3, w2)]
    out = ep_moe(x, wr, *lw, K, E, None, experts_fn)
    a = acc_dtype(x)
    out.to(a).backward(dout_all[rank * T:(rank + 1) * T].to(a))
    xr = x_all.clone().to(a).requires_grad_(True)
    rw = [w.clone().to(a).requires_grad_(True) for w in (w1, w3, w2)]
    ref = one_gpu_reference(xr, wr, *rw, K)
    ref.backward(dout_all.to(a))
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()  # noqa: E731
    errs = {"out": rel(out, ref[rank * T:(rank + 1) * T]), "dx": rel(x.grad, xr.grad[rank * T:(rank + 1) * T])}
    for name, a, b in zip(("dw1", "dw3", "dw2"), lw, rw):
        errs[name] = rel(a.grad, b.grad[sl])
    bad = {k: v for k, v in errs.items() if not v < tol}
    print(f"rank {rank}: " + " ".join(f"{k} {v:.2e}" for k, v in errs.items()), flush=True)
    return not bad


def interleave(w1, w3):
    """torchtitan's gate [E,n,d] and up [E,n,d] -> smoe's [E,2n,d] (row 2j gate j, 2j+1 up j)."""
    return torch.stack((w1, w3), dim=2).reshape(w1.shape[0], 2 * w1.shape[1], w1.shape[2])


def ours_ep_layer(group, x, wr, w1i, w2, K):
    from smoe_torch import ep as sep
    idx, s = route(x, wr, K)
    return sep.ep_moe(group, x, idx, s, w1i, w2)


def check_ours_ep(group, rank, T, d, n, E, K, tol):
    """ours_ep's output and gradients against the one-process layer on all ranks' tokens."""
    R = dist.get_world_size()
    El = E // R
    wr, w1, w3, w2 = weights(E, d, n, 1, "cuda", torch.bfloat16)
    g = torch.Generator(device="cpu").manual_seed(100)
    x_all = torch.randn(R * T, d, generator=g).to(device="cuda", dtype=torch.bfloat16)
    dout_all = torch.randn(R * T, d, generator=g).to(device="cuda", dtype=torch.bfloat16)
    sl = slice(rank * El, (rank + 1) * El)
    x = x_all[rank * T:(rank + 1) * T].clone().requires_grad_(True)
    w1i = interleave(w1[sl], w3[sl]).clone().requires_grad_(True)
    w2l = w2[sl].clone().requires_grad_(True)
    out = ours_ep_layer(group, x, wr, w1i, w2l, K)
    out.backward(dout_all[rank * T:(rank + 1) * T])
    xr = x_all.clone().float().requires_grad_(True)
    rw = [w.clone().float().requires_grad_(True) for w in (w1, w3, w2)]
    ref = one_gpu_reference(xr, wr, *rw, K)
    ref.backward(dout_all.float())
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()  # noqa: E731
    dg = w1i.grad.view(El, n, 2, d)
    errs = {"out": rel(out, ref[rank * T:(rank + 1) * T]), "dx": rel(x.grad, xr.grad[rank * T:(rank + 1) * T]),
            "dw1": rel(dg[:, :, 0], rw[0].grad[sl]), "dw3": rel(dg[:, :, 1], rw[1].grad[sl]),
            "dw2": rel(w2l.grad, rw[2].grad[sl])}
    print(f"rank {rank} ours_ep: " + " ".join(f"{k} {v:.2e}" for k, v in errs.items()), flush=True)
    return all(v < tol for v in errs.values())


def gpu_busy(fn, steps=3, label=""):
    """Kernel time per call of fn (torch.profiler, CUDA activity: the sum of every kernel's and copy's
    device time over `steps` calls, / steps), max over ranks. Against the CUDA-event time of timed()
    it separates what the kernels take from what the step waits for: host launches, host syncs, a
    peer's kernel. Rank 0 prints its top kernels."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    evs = prof.key_averages()
    busy = sum(e.self_device_time_total for e in evs) / 1e3 / steps
    if dist.get_rank() == 0:
        print(f"PROFILE {label}: {busy:.3f} ms of kernels per call (rank 0)\n"
              + evs.table(sort_by="self_device_time_total", row_limit=12), flush=True)
    t = torch.tensor([busy], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        t = torch.tensor([a.elapsed_time(b)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)   # max over ranks, as Parallel Kernel Bench
        ts.append(t.item())
    return statistics.median(ts)


def bench(args):
    dist.init_process_group("nccl")
    rank, R = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    import smoe_torch

    def ours_fn(xr, w1, w3, w2, counts):
        El = w1.shape[0]
        ids = torch.repeat_interleave(torch.arange(El, device=xr.device, dtype=torch.int32), counts,
                                      output_size=xr.shape[0]).unsqueeze(1)
        # gate / up as torchtitan's two tensors (MoEWeights::w3): no per-step stack of the weights
        return smoe_torch.moe_routed(xr, w1, w2, ids, torch.ones_like(ids, dtype=torch.float32), validate=False,
                                     w3=w3)

    systems = {"torchtitan_a2a": swiglu_experts_grouped_mm, "ours_local_a2a": ours_fn}
    configs = json.load(open(args.configs))
    results = []
    def run_config(c):
        T, d, n, E, K = c["T"] // R, c["d"], c["n"], c["E"], c["K"]
        entry = {"config": dict(c, ep=R), "systems": {}}
        # Correctness at min(T, 256) tokens per rank and at most d 2048, n 1024, with the config's E and
        # K: the float32 one-process reference holds every expert's weights and gradients, which at
        # DeepSeek-V3.2's size (E 256, d 7168, n 2048) is 90 GB and ran the 500 s step out.
        cT, cd, cn = min(T, 256), min(d, 2048), min(n, 1024)
        entry["check_shape"] = {"T_per_rank": cT, "d": cd, "n": cn}
        ok = all(check(rank, cT, cd, cn, E, K, "cuda", torch.bfloat16, fn, 2e-2) for fn in systems.values())
        wr, w1, w3, w2 = weights(E, d, n, 1, "cuda", torch.bfloat16)
        El = E // R
        lw = [w[rank * El:(rank + 1) * El].clone().requires_grad_(True) for w in (w1, w3, w2)]
        x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
        runs = {name: (lambda fn=fn: ep_moe(x, wr, *lw, K, E, None, fn)) for name, fn in systems.items()}
        oks = {name: ok for name in systems}
        group = None
        if "ours_ep" in args.systems:
            from smoe_torch import ep as sep
            try:
                cg = sep.EpGroup(max_tokens=cT, d=cd, n=cn, num_experts=E, top_k=K)  # the check's own shape
                oks["ours_ep"] = check_ours_ep(cg, rank, cT, cd, cn, E, K, 2e-2)
                cg.close()
                group = sep.EpGroup(max_tokens=max(T, 256), d=d, n=n, num_experts=E, top_k=K)
                w1i = interleave(lw[0].detach(), lw[1].detach()).requires_grad_(True)   # once, outside the timing
                w2l = lw[2].detach().clone().requires_grad_(True)
                runs["ours_ep"] = lambda: ours_ep_layer(group, x, wr, w1i, w2l, K)
            except Exception as ex:
                entry["systems"]["ours_ep"] = {"error": str(ex)[:300]}
        for name, run in runs.items():
            if name not in args.systems:
                continue
            try:
                f_ms = timed(run, args.warmup, args.reps)
                fb_ms = timed(lambda: run().backward(dout), args.warmup, args.reps)
                flops = T * K * d * n   # per rank
                entry["systems"][name] = {"fwd_ms": f_ms, "bwd_ms": fb_ms - f_ms, "fwd_tflops": 6 * flops / f_ms / 1e9,
                                          "bwd_tflops": 12 * flops / (fb_ms - f_ms) / 1e9, "correct": oks[name]}
                if args.profile:   # kernel time per call, next to the event time above (never fatal)
                    tag = f"{c['name']} {name}"
                    try:
                        entry["systems"][name]["fwd_kernel_ms"] = gpu_busy(run, label=tag + " fwd")
                        entry["systems"][name]["fwd_bwd_kernel_ms"] = gpu_busy(lambda: run().backward(dout),
                                                                               label=tag + " fwd+bwd")
                    except Exception as ex:  # noqa: BLE001
                        entry["systems"][name]["profile_error"] = str(ex)[:300]
            except Exception as ex:  # a system that cannot run keeps an entry with the reason
                entry["systems"][name] = {"error": str(ex)[:300]}
        if group is not None:
            group.close()
        return entry

    def save():
        if rank == 0 and args.out:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "world_size": R,
                       "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                       "commit": os.environ.get("SMOE_COMMIT", "unknown"), "results": results}, open(args.out, "w"), indent=1)

    for c in configs:
        if args.only and c["name"] not in args.only.split(","):
            continue
        try:
            entry = run_config(c)
        except Exception as ex:   # one config that cannot run (memory, a bug) keeps an entry and the run goes on
            import traceback
            traceback.print_exc()
            entry = {"config": dict(c, ep=R), "error": repr(ex)[:300]}
            torch.cuda.empty_cache()
        results.append(entry)
        if rank == 0:
            print("RESULT " + json.dumps(entry), flush=True)
        save()
    dist.destroy_process_group()


def cpu_check_worker(rank, R, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=R)
    ok = True
    for (T, d, n, E, K) in ((24, 16, 8, 8, 2), (17, 8, 8, 4, 1), (30, 16, 8, 8, 8)):
        ok &= check(rank, T, d, n, E, K, "cpu", torch.float64, swiglu_experts_loop, 1e-10)
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                  "configs", "configs.json"))
    p.add_argument("--only", default="")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default="")
    p.add_argument("--systems", default="torchtitan_a2a,ours_local_a2a,ours_ep")
    p.add_argument("--cpu-check", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="also the kernel time per call (torch.profiler): what the event time spends waiting")
    args = p.parse_args()
    if args.cpu_check:
        import torch.multiprocessing as mp
        mp.spawn(cpu_check_worker, args=(2, 29511), nprocs=2, join=True)
        print("cpu check: EP=2 (gloo) matches the one-process layer: out, dx, dw1, dw3, dw2")
    else:
        bench(args)


if __name__ == "__main__":
    main()
