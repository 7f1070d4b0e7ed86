"""smoe_torch.ep on 2 GPUs (2 processes, NCCL): EP=2 against smoe's one-GPU layer on the whole batch.

Skips without 2 CUDA GPUs or without the _ep extension (a build without NCCL). Fresh random inputs;
outputs and gradients (x, scores, local expert weights) within the bf16 bound; a second call bitwise
identical to the first.
"""
import os
import random
import socket

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="EP tests need 2 CUDA GPUs: skipped")
smoe_torch = pytest.importorskip("smoe_torch")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn2(target, *args):
    """Runs target(rank, 2, port, *args, queue) in 2 processes; returns their queue items by rank."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, 2, port, *args, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return sorted(got, key=lambda r: r[0])


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _worker(rank, world, port, seed, T, d, n, E, K, q):
    import torch.distributed as dist
    from smoe_torch import ep as sep
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        g = torch.Generator().manual_seed(seed)
        Tt = T * world
        x_all = torch.randn(Tt, d, generator=g).bfloat16().cuda()
        dout_all = torch.randn(Tt, d, generator=g).bfloat16().cuda()
        w1 = (torch.randn(E, 2 * n, d, generator=g) / d ** 0.5).bfloat16().cuda()
        w2 = (torch.randn(E, d, n, generator=g) / n ** 0.5).bfloat16().cuda()
        logits = torch.randn(Tt, E, generator=g).cuda()
        vals, idx = logits.topk(K, dim=-1)
        idx = idx.int()
        idx[torch.rand(Tt, K, generator=g).cuda() < 0.1] = -1          # some empty slots
        idx[: Tt // 8, 0] = E - 1                                       # a hot expert on the last rank
        idx = torch.where((idx[:, :1] == idx) & (torch.arange(K, device="cuda") > 0), -1, idx)  # no duplicates
        scores_all = vals.softmax(-1)
        El = E // world
        sl, tl = slice(rank * El, (rank + 1) * El), slice(rank * T, (rank + 1) * T)
        grp = sep.EpGroup(max_tokens=T, d=d, n=n, num_experts=E, top_k=K)
        # The fake implementation's saved size (smoe_torch._layout: the local layer's part asked of C++ at
        # creation, the T-dependent rest in Python, symbolic in T) against the C++ query.
        sizes_ok = all(sep.ep_saved_state_bytes(grp.handle, t) == grp.saved_state_bytes(t) for t in (0, 1, T // 2, T))
        results = []
        for _ in range(2):
            x = x_all[tl].clone().requires_grad_(True)
            s = scores_all[tl].clone().requires_grad_(True)
            lw1 = w1[sl].clone().requires_grad_(True)
            lw2 = w2[sl].clone().requires_grad_(True)
            out = sep.ep_moe(grp, x, idx[tl], s, lw1, lw2)
            out.backward(dout_all[tl])
            results.append([t.detach().clone() for t in (out, x.grad, s.grad, lw1.grad, lw2.grad)])
        grp.close()
        # One GPU, the whole batch, every expert: smoe's caller-provided-routing layer.
        xr = x_all.clone().requires_grad_(True)
        sr = scores_all.clone().requires_grad_(True)
        rw1, rw2 = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
        ref = smoe_torch.moe_routed(xr, rw1, rw2, idx, sr, validate=False)
        ref.backward(dout_all)
        want = [ref[tl], xr.grad[tl], sr.grad[tl], rw1.grad[sl], rw2.grad[sl]]
        errs = [rel_l2(a, b) for a, b in zip(results[0], want)]
        same = all(torch.equal(a, b) for a, b in zip(results[0], results[1]))
        finite = all(bool(torch.isfinite(a).all()) for a in results[0])
        empty_zero = bool((results[0][2][idx[tl] < 0] == 0).all())
        q.put((rank, errs, same, finite, empty_zero and sizes_ok))
    except Exception as ex:  # reported by the parent
        q.put((rank, repr(ex), False, False, False))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("T,d,n,E,K", [(300, 128, 64, 8, 2), (257, 256, 128, 16, 4), (129, 64, 64, 4, 1)])
def test_ep2_matches_one_gpu(T, d, n, E, K):
    from smoe_torch import ep as sep
    if sep._ep is None:
        pytest.skip("smoe_torch built without expert parallelism (no NCCL)")
    seed = random.randrange(1 << 30)
    got = _spawn2(_worker, seed, T, d, n, E, K)
    for rank, errs, same, finite, empty_zero in got:
        assert not isinstance(errs, str), f"rank {rank} (seed {seed}): {errs}"
        names = ("out", "dx", "dscores", "dw1", "dw2")
        assert all(e < 1e-2 for e in errs), f"rank {rank} (seed {seed}): " + ", ".join(
            f"{k} {e:.2e}" for k, e in zip(names, errs))
        assert finite, f"rank {rank}: unwritten or non-finite outputs"
        assert same, f"rank {rank}: the second call is not bitwise identical to the first"
        assert empty_zero, (f"rank {rank}: empty slots must get dscores exactly 0, and the fake saved size "
                            "must equal ep_saved_state_size")


def _module_worker(rank, world, port, seed, q):
    """smoe_torch.MoE(ep_group=...) on 2 ranks against the one-GPU module with the same weights."""
    import torch.distributed as dist
    from smoe_torch import ep as sep
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        d, n, E, K, T = 128, 64, 8, 2, 200
        torch.manual_seed(seed)
        # load_balance_coeff=0 keeps the bias at 0 but routes the one-GPU module in torch too, so both
        # take the same router code path (same init on both ranks: same seed).
        full = smoe_torch.MoE(d, n, E, K, load_balance_coeff=0.0).cuda()
        grp = sep.EpGroup(max_tokens=T, d=d, n=n, num_experts=E, top_k=K)
        ep = smoe_torch.MoE(d, n, E, K, ep_group=grp, load_balance_coeff=0.0).cuda()
        El = E // world
        sl = slice(rank * El, (rank + 1) * El)
        with torch.no_grad():
            ep.router.gate.weight.copy_(full.router.gate.weight)
            for name in ("w1", "w2", "w3"):
                getattr(ep.experts, name).copy_(getattr(full.experts, name)[sl])
        g = torch.Generator().manual_seed(seed + 1)
        x_all = torch.randn(world * T, d, generator=g).cuda()
        dout_all = torch.randn(world * T, d, generator=g).cuda()
        tl = slice(rank * T, (rank + 1) * T)
        x = x_all[tl].clone().requires_grad_(True)
        out = ep(x)
        out.backward(dout_all[tl])
        xr = x_all.clone().requires_grad_(True)
        ref = full(xr)
        ref.backward(dout_all)
        gr = ep.router.gate.weight.grad.clone()
        dist.all_reduce(gr)                                # the replicated router: sum over the ranks' tokens
        errs = [rel_l2(out, ref[tl]), rel_l2(x.grad, xr.grad[tl]), rel_l2(gr, full.router.gate.weight.grad)]
        for name in ("w1", "w2", "w3"):
            errs.append(rel_l2(getattr(ep.experts, name).grad, getattr(full.experts, name).grad[sl]))
        grp.close()
        q.put((rank, errs))
    except Exception as ex:
        q.put((rank, repr(ex)))
    finally:
        dist.destroy_process_group()


def test_ep2_module_matches_one_gpu_module():
    from smoe_torch import ep as sep
    if sep._ep is None:
        pytest.skip("smoe_torch built without expert parallelism (no NCCL)")
    seed = random.randrange(1 << 30)
    got = _spawn2(_module_worker, seed)
    for rank, errs in got:
        assert not isinstance(errs, str), f"rank {rank} (seed {seed}): {errs}"
        assert all(e < 2e-2 for e in errs), f"rank {rank} (seed {seed}): out, dx, dw_router, dw1, dw2, dw3 = {errs}"
