"""Train an MoE layer with expert parallelism over 2 (or more) GPUs of one node:

    torchrun --nproc_per_node 2 examples/ep_train/ep_train.py --steps 100

Each rank holds E/R experts of smoe_torch.MoE(ep_group=...) and its own batch of tokens; the
router is replicated, so its gradient is averaged over the ranks (what DDP / FSDP would do); the
experts' gradients stay local. The task is regression onto a fixed random "teacher" MoE; the script
prints the loss (mean over ranks) and fails if it did not fall by half.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank per step")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top_k", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    import smoe_torch
    from smoe_torch.ep import EpGroup

    group = EpGroup(max_tokens=args.tokens, d=args.dim, n=args.hidden, num_experts=args.experts, top_k=args.top_k)
    torch.manual_seed(1234)   # same router init on every rank (replicated), experts differ per rank below
    model = smoe_torch.MoE(args.dim, args.hidden, args.experts, args.top_k, ep_group=group).cuda()
    # One teacher for every rank: the experts serve both ranks' tokens, so per-rank teachers would
    # ask one set of experts to fit two functions (the loss stalled at 0.76x of its start that way,
    # H200 x2 at 48b52aa, where the same model on one CPU with one teacher reaches 0.36x).
    teacher_w = [torch.randn(args.dim, args.dim, device="cuda") / args.dim ** 0.5 for _ in range(2)]
    torch.manual_seed(1234 + rank)
    model.experts.init_weights(0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    g = torch.Generator(device="cuda").manual_seed(99 + rank)
    losses = []
    t0 = None
    for step in range(args.steps):
        if step == 5:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        x = torch.randn(args.tokens, args.dim, device="cuda", generator=g)
        with torch.no_grad():
            y = torch.tanh(x @ teacher_w[0]) @ teacher_w[1]
        out = model(x)
        loss = F.mse_loss(out.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gr = model.router.gate.weight.grad
        dist.all_reduce(gr, op=dist.ReduceOp.AVG)          # the replicated router: data-parallel gradient
        opt.step()
        lt = loss.detach().clone()
        dist.all_reduce(lt, op=dist.ReduceOp.AVG)
        losses.append(lt.item())
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d} loss {losses[-1]:.5f}", flush=True)
    torch.cuda.synchronize()
    if rank == 0 and t0 is not None:
        print(f"{(time.perf_counter() - t0) / (args.steps - 5) * 1e3:.2f} ms per step (forward + backward + AdamW), "
              f"EP={world}, {args.tokens} tokens per rank", flush=True)
    group.close()
    dist.destroy_process_group()
    if losses[-1] > 0.5 * losses[0]:
        raise SystemExit(f"loss did not fall by half: {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
